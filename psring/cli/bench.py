"""``psring bench allreduce``: nccl-tests-style timing of all_reduce over real processes.

The parent starts a store and N ranks (``psring launch`` machinery); each rank times
every size (warm-up, then ``iters`` timed calls, each after a barrier); the figure
per size is the median over iterations of the slowest rank. busbw = algbw * 2(N-1)/N.
The same rank worker can run torch.distributed's gloo backend (``--backend gloo``)
so benchmarks/compare_gloo.py measures both side by side in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from .. import settings as settings_mod
from ..core.codec import CODECS
from ..rendezvous.launch import launch
from ..settings import TOPOLOGY_NAMES, Settings
from ..transport.loop import new_event_loop

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB")
    num = text.rstrip("KMGB")
    unit = text[len(num) :]
    if unit not in _SUFFIX or not num:
        raise ValueError(f"size {text!r} is not a byte count like 4, 64K, 1M or 1G")
    value = float(num) * _SUFFIX[unit]
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return int(value)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


# ---------------------------------------------------------------- parent side
def run_allreduce(
    *,
    topology: str,
    workers: int,
    sizes: list[int],
    dtype: str = "float32",
    iters: int = 10,
    warmup: int = 2,
    backend: str = "psring",
    servers: int | None = None,
    quiet: bool = True,
    colocate: bool = False,
    scale: bool = False,
    compression: str | None = None,
) -> list[dict[str, Any]]:
    """Spawn the ranks, time every size, return one row per size (``scale``: each row also has
    the worst rank's set-up figures under "setup")."""

    with tempfile.TemporaryDirectory(prefix="psring-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {
            "sizes": sizes,
            "dtype": dtype,
            "iters": iters,
            "warmup": warmup,
            "out": out,
            "backend": backend,
            "gloo_init": "file://" + os.path.join(tmp, "gloo-rendezvous"),
            "small_iters": max(iters, 200),
            "mid_iters": max(iters, 50),
            "scale": scale,
            "compression": compression,
        }
        env = settings_mod.child_env(settings_mod.process_env(), servers=servers, ps_colocate=colocate or None)
        cmd = [sys.executable, "-m", "psring.training.bench_ranks", json.dumps(spec)]
        if backend == "mpich":  # MPICH's own launcher starts its ranks
            mpi_env = {k: v for k, v in env.items() if not k.startswith(("MPIR_", "FI_"))}
            proc = subprocess.run([mpiexec(), "-n", str(workers), "-host", "localhost", *cmd], env=mpi_env,
                                  capture_output=quiet, text=True, timeout=1800)  # fmt: skip
            code = proc.returncode
        else:
            loop = new_event_loop()
            try:
                code = loop.run_until_complete(
                    launch(workers, cmd, topology=topology, env=env, prefix_output=not quiet)
                )
            finally:
                loop.close()
        if code != 0:
            raise RuntimeError(f"benchmark ranks failed (exit code {code})")
        with open(out) as fh:
            result = json.load(fh)
        rows = result["results"]
    for row in rows:
        if "setup" in result:
            row["setup"] = result["setup"]
        t = row["time_s"]
        row["algbw_GBps"] = row["size"] / t / 1e9 if t > 0 else 0.0
        row["busbw_GBps"] = row["algbw_GBps"] * 2 * (workers - 1) / workers
        row["dtype"] = dtype
    return rows


def run_sgd(
    *,
    topology: str,
    workers: int,
    params: int,
    tensors: int,
    steps: int,
    warmup: int,
    servers: int | None,
    compression: str | None = None,
) -> dict[str, Any]:

    with tempfile.TemporaryDirectory(prefix="psring-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {
            "mode": "sgd",
            "params": params,
            "tensors": tensors,
            "steps": steps,
            "warmup": warmup,
            "out": out,
            "compression": compression,
        }
        env = settings_mod.child_env(settings_mod.process_env(), servers=servers)
        cmd = [sys.executable, "-m", "psring.training.bench_ranks", json.dumps(spec)]
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(launch(workers, cmd, topology=topology, env=env, prefix_output=False))
        finally:
            loop.close()
        if code != 0:
            raise RuntimeError(f"benchmark ranks failed (exit code {code})")
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    steps_s = np.array(result["step_s"])
    med = np.median(steps_s, axis=0)
    result.update(step_ms=1e3 * med[0], exchange_ms=1e3 * med[1], update_ms=1e3 * med[2])
    return result


def mpich_problem() -> str | None:
    """Why MPICH cannot be run here (None: it can): mpi4py missing, no mpiexec, or an mpiexec that is
    another MPI's (Open MPI's, which an image may carry, takes none of MPICH's settings and refuses root)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "the mpich variant needs mpi4py and MPICH (pip install -e '.[bench]')"
    found = _find_mpiexec()
    if found is None:
        return "the mpich variant needs MPICH's mpiexec (pip install -e '.[bench]')"
    try:
        said = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{found} --version failed: {e}"
    text = said.stdout + said.stderr
    if "HYDRA" not in text and "MPICH" not in text:  # MPICH's launcher is Hydra
        first = text.strip().splitlines()[0] if text.strip() else "nothing"
        return f"{found} is not MPICH's mpiexec (it says {first!r}); pip install -e '.[bench]' brings MPICH's"
    return None


def _find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the mpich wheel installs it there), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def mpiexec() -> str:
    """MPICH's mpiexec (SystemExit saying why where there is none: mpich_problem)."""
    problem = mpich_problem()
    if problem is not None:
        raise SystemExit(f"psring bench: {problem}")
    found = _find_mpiexec()
    assert found is not None
    return found


def run_scale(worlds: list[int], variants: list[str], iters: int = 20) -> list[dict[str, Any]]:
    """For each world size and variant (ring, ps, gloo, mpich): the worst rank's set-up cost (time
    to init, file descriptors, sockets, threads) and 4-byte and 1 MiB all_reduce times."""
    rows = []
    for n in worlds:
        for variant in variants:
            backend = variant if variant in ("gloo", "mpich") else "psring"
            topology = "ring" if backend != "psring" else variant
            got = run_allreduce(
                topology=topology, workers=n, sizes=[4, 1 << 20], iters=iters, warmup=2, backend=backend, scale=True
            )
            small, large = got
            rows.append(
                {"world": n, "variant": variant, **small["setup"], "t4_s": small["time_s"], "t1m_s": large["time_s"]}
            )
    return rows


def format_scale(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# the worst rank of each run; processes share this machine's cores (oversubscribed past 2)",
        f"{'N':>3} {'variant':>7} {'init ms':>8} {'fds':>5} {'sockets':>8} {'threads':>8} "
        f"{'4 B us':>9} {'1 MiB ms':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['world']:>3} {r['variant']:>7} {r['init_s'] * 1e3:>8.1f} {r['fds']:>5} {r['sockets']:>8} "
            f"{r['threads']:>8} {r['t4_s'] * 1e6:>9.1f} {r['t1m_s'] * 1e3:>9.2f}"
        )
    return "\n".join(lines)


def cli_scale(args: argparse.Namespace) -> int:
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w]
    except ValueError:
        raise SystemExit(f"psring bench scale: --worlds {args.worlds!r} must be comma-separated integers") from None
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in ("ring", "ps", "gloo", "mpich")]
    if bad or not variants or any(w < 1 for w in worlds) or not worlds:
        raise SystemExit("psring bench scale: --worlds are positive integers, --variants among ring, ps, gloo, mpich")
    if "mpich" in variants and (problem := mpich_problem()) is not None:
        raise SystemExit(f"psring bench scale: {problem}")
    if "gloo" in variants:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            raise SystemExit("psring bench scale: the gloo variant needs torch (pip install torch)") from None
    rows = run_scale(worlds, variants, args.iters)
    print(json.dumps(rows) if args.json else format_scale(rows))
    return 0


def cli_sgd(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit(f"psring bench: --workers must be at least 1, got {args.workers}")
    if args.topology == "ring" and args.servers is not None:
        raise SystemExit("psring bench: --servers applies to --topology ps only")
    n = parse_size(args.params.upper().replace("M", "000000").replace("K", "000")) if args.params else 0
    r = run_sgd(
        topology=args.topology,
        workers=args.workers,
        params=n,
        tensors=args.tensors,
        steps=args.steps,
        warmup=args.warmup,
        servers=args.servers,
        compression=None if args.compression == "none" else args.compression,
    )
    title = (
        f"psring SyncSGD step, topology={args.topology}, workers={args.workers}, {n / 1e6:g}M float32 params "
        f"in {r['tensors']} tensors ({r['buckets']} buckets), compression={args.compression}"
    )
    if args.json:
        print(json.dumps({"title": title, **r}))
        return 0
    print(f"# {title}")
    print(f"{'step (ms)':>12} {'exchange (ms)':>14} {'update (ms)':>12}")
    print(f"{r['step_ms']:>12.1f} {r['exchange_ms']:>14.1f} {r['update_ms']:>12.1f}")
    if args.topology == "ps":
        print("# over ps the optimizer runs on the servers: its time is inside the exchange")
    return 0


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        f"{'size':>10} {'count':>12} {'dtype':>8} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
        f" {'sent/call':>10}",
    ]
    for r in rows:
        sent = r.get("bytes_sent_per_call")
        lines.append(
            f"{human(r['size']):>10} {r['count']:>12} {r['dtype']:>8} {r['time_s'] * 1e6:>12.1f} "
            f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f} {_mib(sent):>10}"
        )
    return "\n".join(lines)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 20):.2f}M" if nbytes >= 1 << 20 else str(nbytes)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["size"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def cli(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.workers < 1:
        raise SystemExit(f"psring bench: --workers must be at least 1, got {args.workers}")
    if args.topology == "ring" and getattr(args, "colocate", False):
        raise SystemExit("psring bench: --colocate applies to --topology ps only")
    rows = run_allreduce(
        topology=args.topology,
        workers=args.workers,
        sizes=sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        servers=getattr(args, "servers", None),
        colocate=getattr(args, "colocate", False),
        compression=None if args.compression == "none" else args.compression,
    )
    title = f"psring all_reduce, topology={args.topology}, workers={args.workers}"
    if args.compression != "none":
        title += f", compression={args.compression}"
    if getattr(args, "colocate", False):
        title += " (shards colocated with the workers)"
    if args.json:
        print(json.dumps({"title": title, "rows": rows}))
    else:
        print(format_table(rows, title))
    if args.plot:
        plot(rows, args.plot, title)
    return 0


def register(sub: argparse._SubParsersAction, env: Settings) -> None:
    p = sub.add_parser("bench", help="benchmarks", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser(
        "allreduce",
        help="time all_reduce over N local processes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--topology", choices=TOPOLOGY_NAMES, default=env.topology, help="PSRING_TOPOLOGY")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--servers", type=int, default=env.servers, help="parameter-server shards (ps; PSRING_SERVERS)")
    b.add_argument(
        "--colocate",
        action="store_true",
        default=env.ps_colocate,
        help="ps: each worker process hosts its shards (PSRING_PS_COLOCATE=1)"
    )
    b.add_argument("--sizes", default="4,1M,16M,64M", help="comma-separated byte sizes (K, M, G suffixes)")
    b.add_argument("--dtype", default="float32")
    b.add_argument("--compression", choices=("none", *CODECS), default="none",
                   help="a codec on the wire (float32, op sum); the table's 'sent' column shows its bytes")  # fmt: skip
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("--plot", default=None, help="write a PNG of busbw against size")
    b.set_defaults(func=cli)
    b = bsub.add_parser(
        "sgd",
        help="time SyncSGD steps on synthetic gradients of a realistic model shape",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--params", default="25M", help="total float32 parameters (K, M suffixes: decimal)")
    b.add_argument("--tensors", type=int, default=160, help="how many tensors they are split into")
    b.add_argument("--topology", choices=TOPOLOGY_NAMES, default=env.topology, help="PSRING_TOPOLOGY")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--servers", type=int, default=env.servers, help="parameter-server shards (ps; PSRING_SERVERS)")
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--compression", choices=("none", *CODECS), default="none", help="a codec on the wire")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cli_sgd)
    b = bsub.add_parser(
        "scale",
        help="how set-up cost and small-message time grow with the world size, beside gloo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--worlds", default="2,4,8,16,32", help="comma-separated world sizes")
    b.add_argument(
        "--variants",
        default="ring,ps,gloo",
        help="among ring, ps, gloo, mpich (gloo needs torch; mpich needs mpi4py and MPICH: the bench extra)",
    )
    b.add_argument("--iters", type=int, default=20, help="timed 1 MiB all_reduces (at least 50; 4 B: 200)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cli_scale)
