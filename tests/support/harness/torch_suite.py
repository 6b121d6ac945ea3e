"""torch's own distributed test suite (``_DistTestBase`` from torch/testing/_internal/distributed/
distributed_test.py, shipped in the torch wheel; the suite torch runs for gloo, NCCL and MPI in
test/distributed/test_distributed_spawn.py) against the psring backend, or gloo, on one selection.

    python tests/support/harness/torch_suite.py --backend psring --world-size 2 [--topology ps] [-k PATTERN] [--json]
        [--progress FILE [--skip-done]]   # a line per test as it ends; --skip-done goes on where a run stopped

Run the same selection with ``--backend gloo`` and compare: every test gloo passes, psring must.

How psring is let through the suite's gates, in this driver only (no test body is changed):

- the suite's module reads ``BACKEND`` when it is imported and gates tests on it (decorators such
  as ``BACKEND != "gloo"``, ``DistTestCases.backend_feature[...]``) and in test bodies (expected
  errors and dtypes per backend). Here it is imported with ``BACKEND=gloo``: psring is judged as a
  CPU backend with gloo's features, which is what it claims to be;
- the process groups the suite makes are psring's: ``dist.init_process_group``, ``dist.new_group``
  and ``dist.new_subgroups`` (as the suite's module sees them) take "psring" where the suite asks
  for "gloo". ``dist.get_backend`` answers "psring": the suite's tests of the backend's name
  (``test_get_backend``, ``test_Backend_enum_class``) compare it with ``BACKEND`` and are the
  name-only exceptions.

Each test runs in fresh processes (the suite's own ``MultiProcessTestCase`` spawning them);
``import psring.torch`` in every one registers the backend. Needs ``expecttest`` (the ``torch-suite``
tests install it with the dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TARGET = os.environ.get("PSRING_SUITE_BACKEND", "psring")  # what the groups really are

os.environ["BACKEND"] = "gloo"  # the suite's gates see gloo (see the module docstring)
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="psring-torch-suite-"))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402

import psring.torch  # noqa: E402,F401  (registers the backend in this process and every spawned one)


def _patch() -> list[str]:
    """Route the suite's process groups to TARGET; returns what was patched, for the record."""
    if TARGET == "gloo":
        return []
    real_init, real_new_group = dist.init_process_group, dist.new_group
    real_new_subgroups = dist.new_subgroups

    def swap(backend: Any) -> Any:
        return TARGET if isinstance(backend, str) and backend.lower() == "gloo" else backend

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (swap(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return real_init(*args, **kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        if len(args) >= 3:
            args = (*args[:2], swap(args[2]), *args[3:])
        return real_new_group(*args, **kwargs)

    def new_subgroups(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return real_new_subgroups(*args, **kwargs)

    suite.dist = _Namespace(dist, init_process_group=init_process_group, new_group=new_group,
                            new_subgroups=new_subgroups)  # fmt: skip
    return [
        "distributed_test.BACKEND imported as 'gloo'",
        f"distributed_test.dist.init_process_group / new_group / new_subgroups: backend 'gloo' -> {TARGET!r}",
    ]


class _Namespace:
    """torch.distributed as the suite's module sees it: a few functions replaced, the rest as is."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


PATCHED = _patch()


class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


class _Record(unittest.TextTestResult):
    #: a file that gets one line per test as it ends (--progress): a long run cut short keeps what it did
    progress: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict[str, str] = {}
        self.why: dict[str, str] = {}

    def _row(self, test: Any, outcome: str) -> None:
        self.rows[test._testMethodName] = outcome
        if self.progress:
            with open(self.progress, "a") as f:
                f.write(f"{test._testMethodName} {outcome}\n")

    def addSuccess(self, test: Any) -> None:
        super().addSuccess(test)
        self._row(test, "passed")

    def addFailure(self, test: Any, err: Any) -> None:
        super().addFailure(test, err)
        self.why[test._testMethodName] = self._exc_info_to_string(err, test)[-1500:]
        self._row(test, "failed")

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self.why[test._testMethodName] = self._exc_info_to_string(err, test)[-1500:]
        self._row(test, "failed")

    def addSkip(self, test: Any, reason: str) -> None:
        super().addSkip(test, reason)
        self._row(test, "skipped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=("psring", "gloo"), default=TARGET)
    p.add_argument("--world-size", type=int, default=int(os.environ["WORLD_SIZE"]))
    p.add_argument("--topology", choices=("ring", "ps"), default=None, help="psring's (PSRING_TOPOLOGY)")
    p.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    p.add_argument("--tests", default="", help="run exactly these tests (comma-separated names)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--progress", default="", help="append 'NAME OUTCOME' to this file as each test ends")
    p.add_argument("--skip-done", action="store_true", help="leave out the tests already in --progress's file")
    args = p.parse_args(argv)
    if args.backend != TARGET or str(args.world_size) != os.environ["WORLD_SIZE"] or (
        args.topology and os.environ.get("PSRING_TOPOLOGY") != args.topology
    ):  # the settings are read at import, here and in every spawned process: start again with them
        env = {**os.environ, "PSRING_SUITE_BACKEND": args.backend, "WORLD_SIZE": str(args.world_size)}
        if args.topology:
            env["PSRING_TOPOLOGY"] = args.topology
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TestDistBackendWithSpawn) if not args.k or any(k in n for k in args.k)]
    if args.tests:
        wanted = [t.strip() for t in args.tests.split(",") if t.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            p.error(f"--tests: no such test in torch's suite: {unknown}")
        names = [n for n in names if n in wanted]
    if args.progress:
        _Record.progress = args.progress
        if args.skip_done and os.path.exists(args.progress):
            with open(args.progress) as f:
                done = {line.split()[0] for line in f if line.strip()}
            names = [n for n in names if n not in done]
    tests = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    t0 = time.monotonic()
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1, resultclass=_Record)
    result: Any = runner.run(tests)
    summary = {
        "backend": args.backend,
        "topology": os.environ.get("PSRING_TOPOLOGY", "ring") if args.backend == "psring" else None,
        "world_size": args.world_size,
        "seconds": round(time.monotonic() - t0, 1),
        "counts": {k: sum(1 for v in result.rows.values() if v == k) for k in ("passed", "failed", "skipped")},
        "tests": result.rows,
        "why": result.why,
        "patched": PATCHED,
    }
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(json.dumps(summary["counts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
