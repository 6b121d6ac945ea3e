"""A fault campaign (#59): every process kind x every fault x every phase, invariants checked after each.

Each case starts a bed of real processes on loopback, injects one fault into one process at one phase,
and then checks what an operator relies on:

- **bounded**: the job's submitter (or ``psring train``) ends within ``--bound`` seconds: nothing hangs;
- **no silent loss**: the job either ends done with the undisturbed run's parameters (the same
  ``param_digest``), or fails with an error line that names the fault (the process or its role);
- **usable after**: where the restart policy brings the process back, a fresh job on the same bed
  ends done with the undisturbed run's parameters;
- **SIGTERM ends everything** within 10 s (docker's grace), each process exiting by itself;
- **nothing left running**: no process carrying the case's marker survives the case.

Beds. ``cluster``: a store (``--data-dir``), worker daemons and, for ps, a server daemon; the job is a
``psring submit --max-restarts 2``. A daemon or the store that gets SIGKILL or SIGTERM is started again
with the same arguments one second later, as ``restart: always`` would. ``launch``: ``psring train``
(the launcher) and its rank processes, ``--max-restarts 2``.

Kinds: store, worker (daemon), server (daemon), submitter, dashboard (cluster bed); etcd (a member of a
three-member etcd cluster that is the cluster bed's store instead of psring's); rank, launcher, shard (a
ps job's shard process; launch bed).
Faults: kill (SIGKILL), term (SIGTERM), stop (SIGSTOP for ``--stop-s``, then SIGCONT), partition (every
packet the process and its children send is dropped for ``--stop-s``, then the link heals: the process
is moved into a cgroup of its own and an iptables rule drops that cgroup's output -- root, iptables'
cgroup match and cgroup v2), partition-store (the same, for packets to the store's ports only: a client
of the store cut off from it, its peers still reachable), partition-peer (a daemon cut off from one other
daemon only, both ways, for ``--stop-s``: for this fault the bed's daemons are hosts of their own --
network namespaces on a bridge, as the hosts bed's -- and the cut is iptables in the victim's
namespace), full-disk (the store's data directory, a tmpfs of its own, is filled for ``--stop-s``,
then emptied -- root), wire (a daemon stopped and started
again as a psring of the next wire version, as a rolling upgrade gone wrong would: it must end by itself
within the grace naming both versions; then the operator puts the right one back). A fault that needs
what this machine lacks is skipped, saying why.
Phases: idle (before the job: for daemons and the store; a partition or a full disk still holds when
the job is submitted), placement (cluster bed: the moment a worker daemon says it takes its rank, the
submitter waiting for the others' acks), rendezvous (the job placed, its ranks meeting: on the cluster
bed as soon as the submitter says the job is placed; on the launch bed as soon as the victim's process
exists), mid-step (a quarter of the job's steps done), checkpoint (cluster bed: as the store takes one
of the job's checkpoints -- its log grows by a checkpoint's bytes at once -- the first to the third),
compaction (cluster bed: the store runs with ``--compact-bytes 256K`` and the fault lands as it compacts
-- its snapshot being written or its log just cut -- the first to the third time), admission (the
elastic bed: two ps workers under ``psring launch --elastic`` admit a third, the joiner kind, at a step boundary;
the fault lands as they say they admitted it; held when every worker reports the same parameters at
every step and the survivors agree on the live group, or a failure names the fault).

    python benchmarks/faults.py                         # every case, both topologies
    python benchmarks/faults.py --kinds store --faults kill --phases mid-step --topologies ring
    python benchmarks/faults.py --case ring/worker/kill/mid-step --seed 3    # replay one case
    python benchmarks/faults.py --workers 2 --stop-s 5 --log campaign.jsonl  # in parts: skips what held

Seeded: the seed picks the victim among processes of its kind and the moment within its phase; a case
that fails prints the command that replays it. Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.harness.netns import NetnsCluster, netns_available  # noqa: E402

MARK = "PSRING_FAULT_CASE"
GRACE_S = 10.0

KINDS = ("store", "etcd", "worker", "server", "submitter", "dashboard", "rank", "launcher", "shard", "joiner")
FAULTS = ("kill", "term", "stop", "partition", "partition-store", "partition-peer", "full-disk", "wire")
PHASES = ("idle", "placement", "rendezvous", "mid-step", "checkpoint", "compaction", "admission")
#: phases only the cluster bed has (a job placed on daemons; checkpoints and compaction in psring's store)
PLACED = ("placement", "checkpoint", "compaction")
#: a write to the store's log at least this large at once is a checkpoint (the main job's: ~75 KiB)
CHECKPOINT_BYTES = 16 << 10
#: the store's --compact-bytes in the compaction phase: it compacts every few checkpoints
COMPACT_BYTES = "256K"
#: a psring whose wire version is the next one (``wire`` fault): the same code, told it speaks another
OTHER_WIRE = (
    "import sys; import psring.core.wire as w; w.WIRE_VERSION += 1; from psring.cli import main; sys.exit(main())"
)
#: processes a restart policy brings back (the cluster bed's long-running ones)
RESTARTED = ("store", "etcd", "worker", "server", "dashboard")
#: the launch bed's kinds (the rest are the cluster bed's)
LAUNCHED = ("rank", "launcher", "shard", "joiner")
#: the elastic bed's job (admission): ps workers that admit new ones every 3 steps
GROW_JOB = os.path.join(ROOT, "tests", "support", "jobs", "elastic_grow_job.py")
#: faults that last --stop-s and then heal by themselves (the process is not restarted)
PASSING = ("stop", "partition", "partition-store", "partition-peer", "full-disk")


class Proc:
    """One process of a bed, its output gathered by a thread (never blocks the campaign)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], exe: list[str] | None = None) -> None:
        self.name, self.argv, self.env, self.exe = name, argv, env, exe
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (time.monotonic())
        self.p = subprocess.Popen(
            [*(exe or [sys.executable, "-m", "psring"]), *argv], env=env, cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = re.search(pattern, self.lines[seen])
                seen += 1
                if m:
                    return m
            if self.p.poll() is not None and seen >= len(self.lines):
                self._reader.join(1)
                if seen >= len(self.lines):
                    break
            time.sleep(0.02)
        raise RuntimeError(f"{self.name}: {pattern!r} never appeared (exit {self.p.poll()}): {self.tail()}")

    def timed(self, since: float, n: int = 40) -> str:
        """Its last ``n`` lines, each after the seconds since ``since`` it came at."""
        start = max(0, len(self.lines) - n)
        timed = zip(self.times[start:], self.lines[start:], strict=False)
        return "\n".join(f"{t - since:7.2f} {line[:300]}" for t, line in timed)

    def tail(self, n: int = 8) -> str:
        return " | ".join(line[:200] for line in self.lines[-n:])[-600:]

    @property
    def out(self) -> str:
        self._reader.join(2)
        return "\n".join(self.lines)


def marked_pids(tag: str, var: str = MARK) -> list[int]:
    """Processes carrying ``var=tag`` in their environment (ranks a daemon or launcher started too)."""
    want = f"{var}={tag}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(d))
        except OSError:
            continue
    return found


def _summary(out: str) -> dict[str, Any] | None:
    rows = [line for line in out.splitlines() if line.startswith("{") and "param_digest" in line]
    return json.loads(rows[-1]) if rows else None


@dataclasses.dataclass
class Case:
    topology: str
    kind: str
    fault: str
    phase: str

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.kind}/{self.fault}/{self.phase}"

    def why_not(self) -> str | None:
        """Why this combination is not a case (None: it is one)."""
        if self.kind == "server" and self.topology != "ps":
            return "no server daemon on the ring"
        if self.kind == "shard" and self.topology != "ps":
            return "no shard processes on the ring"
        if self.phase == "idle" and self.kind in ("submitter", *LAUNCHED):
            return "exists only while a job runs"
        if self.phase in PLACED and self.kind in LAUNCHED:
            return "placement, and checkpoints and compaction in the store: the cluster bed's"
        if self.kind == "joiner" and self.phase != "admission":
            return "a joiner exists only in the admission phase"
        if self.phase == "admission" and (self.topology != "ps" or self.kind not in LAUNCHED):
            return "elastic admission: the ps's, on the elastic bed (psring launch, a worker joining)"
        if self.phase in ("checkpoint", "compaction") and self.kind == "etcd":
            return "the moment is read off psring's store log (etcd's is preallocated)"
        if self.fault == "full-disk" and self.kind != "store":
            return "only the store writes to disk"
        if self.fault == "partition-store" and self.kind not in ("worker", "server", "submitter", "dashboard"):
            return "cut off from the store only: a cluster bed's client of the store"
        if self.fault == "partition-peer" and self.kind not in ("worker", "server"):
            return "cut off from one peer: a daemon of the cluster bed (each a host of its own)"
        if self.fault == "wire" and self.kind not in ("worker", "server"):
            return "a restart with another wire version: a daemon's (the store is one cluster's own)"
        return None

    def lacks(self) -> str | None:
        """What this machine lacks to inject the fault (None: nothing)."""
        if self.fault == "full-disk" and os.geteuid() != 0:
            return "a full disk needs root (a tmpfs of its own for the store's data)"
        if self.fault == "partition-peer":
            return Hosts.lacks()
        if self.fault.startswith("partition") and Partition.lacks() is not None:
            return Partition.lacks()
        if self.kind == "etcd" and shutil.which("etcd") is None:
            return "etcd is not installed (apt-get install etcd-server)"
        return None


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.references: dict[str, str] = {}
        self.took: dict[str, float] = {}  # the undisturbed run's seconds, by topology
        self.net: Hosts | None = None  # the bed's hosts, for a partition from one peer
        self.peer: Proc | None = None  # that peer
        self.submitter_exe: list[str] | None = None

    # ------------------------------------------------------------------ beds
    def _env(self, tag: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", MARK: tag}
        env.pop("PSRING_STORE", None)
        return env

    def _job_argv(self, address: str, topology: str) -> list[str]:
        return ["submit", "--store", address, "--topology", topology, "--workers", str(self.args.workers),
                "--epochs", str(self.args.epochs), "--max-restarts", "2", "--timeout", "30", "--json"]  # fmt: skip

    def _train_argv(self, topology: str) -> list[str]:
        return ["train", "--topology", topology, "--workers", str(self.args.workers), "--epochs",
                str(self.args.epochs), "--max-restarts", "2", "--timeout", "30", "--json"]  # fmt: skip

    def reference(self, topology: str) -> str:
        """The undisturbed run's parameter digest (the main job's bits do not depend on the bed)."""
        if topology not in self.references:
            t0 = time.monotonic()
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "psring", *self._train_argv(topology)], cwd=ROOT, capture_output=True,
                    text=True, timeout=self.args.bound, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"the undisturbed {topology} run did not end within --bound {self.args.bound:g}s: "
                    "this machine is too busy to judge a case by it"
                ) from None
            summary = _summary(done.stdout)
            if done.returncode != 0 or summary is None:
                raise RuntimeError(
                    f"the undisturbed {topology} run failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}"
                )
            self.references[topology] = str(summary["param_digest"])
            self.took[topology] = time.monotonic() - t0
        return self.references[topology]

    def _host(self, name: str) -> tuple[str, list[str] | None]:
        """Where a bed's process runs: its address, and the command that starts psring there (None:
        this namespace). Every process on 127.0.0.1, but for a partition from one peer: then each
        daemon is a host of its own (a network namespace; the submitter shares the store's)."""
        if self.net is None:
            return "127.0.0.1", None
        ip = self.net.address(name)
        return ip, ["ip", "netns", "exec", self.net.cluster.hosts[name], sys.executable, "-m", "psring"]

    # ----------------------------------------------------------------- a case
    def run(self, case: Case, seed: int) -> list[str]:
        """The case's broken invariants ([] when every one held)."""
        rng = random.Random(f"{case.name}/{seed}")
        tag = f"{case.name.replace('/', '-')}-{seed}-{os.getpid()}-{time.monotonic_ns()}"
        env = self._env(tag)
        procs: list[Proc] = []
        problems: list[str] = []
        self.tails: dict[str, str] = {}
        self.dumps: dict[str, str] = {}
        self.procs = procs
        started = time.monotonic()
        try:
            want = self.reference(case.topology) if case.phase != "admission" else ""
        except RuntimeError as exc:  # no reference: the case cannot be judged, said as such
            self.outcome = ""
            return [f"the case could not run: {exc}"]
        self.healing: list[threading.Timer] = []
        self.outcome = ""
        self.store_ports: list[int] = []
        self.wire_problems: list[str] = []
        self.net = Hosts(seed) if case.fault == "partition-peer" else None
        with tempfile.TemporaryDirectory(prefix="psring-faults-") as data:
            disk = Disk(data) if case.fault == "full-disk" else None
            try:
                if case.phase == "admission":
                    problems += self._admission_case(case, rng, env, procs, tag)
                elif case.kind in LAUNCHED:
                    problems += self._launch_case(case, rng, env, procs, want, tag)
                else:
                    problems += self._cluster_case(case, rng, env, procs, want, data, disk)
            except Exception as exc:  # a bed that did not come up is a failed case, said as such
                problems.append(f"the case could not run: {type(exc).__name__}: {exc}")
            finally:
                for timer in self.healing:  # a fault that outlived its case heals now, before the next case
                    timer.cancel()
                    timer.function()
                problems += self._stop_all(procs, tag)
                if problems:  # what each process said last: the report of a failed case carries it
                    self.tails = {f"{p.name} #{i}": p.tail(12) for i, p in enumerate(procs)}
                if self.args.tails:  # every case's: what each process said, and when
                    self.tails = {f"{p.name} #{i}": p.timed(started) for i, p in enumerate(procs)}
                if disk is not None:
                    disk.close()
                if self.net is not None:
                    self.net.close()
        return problems

    def _inject(self, proc: Proc, fault: str, disk: Disk | None = None) -> None:
        """Inject the fault. stop blocks for --stop-s; partition and full-disk return at once and heal
        --stop-s later by themselves (so a job submitted meanwhile meets them)."""
        if fault == "kill":
            os.kill(proc.p.pid, signal.SIGKILL)
        elif fault in ("term", "wire"):  # wire: stopped, to be restarted as another version (_restart)
            os.kill(proc.p.pid, signal.SIGTERM)
        elif fault == "stop":
            os.kill(proc.p.pid, signal.SIGSTOP)
            time.sleep(self.args.stop_s)
            os.kill(proc.p.pid, signal.SIGCONT)
        else:
            if fault == "partition-peer":
                assert self.net is not None and self.peer is not None
                heal = self.net.cut(_host_of(proc), _host_of(self.peer))
            elif fault in ("partition", "partition-store"):
                cut = Partition(proc.p.pid, self.store_ports if fault == "partition-store" else None)
                heal = cut.heal
            else:
                assert disk is not None
                disk.fill()
                heal = disk.empty
            timer = threading.Timer(self.args.stop_s, _once(heal))
            self.healing.append(timer)
            timer.start()

    def _mid_step(self, proc: Proc, rng: random.Random) -> None:
        """Wait for a moment within the job's second quarter of steps (its progress lines say where it is)."""
        m = proc.wait_line(r"step (\d+)/(\d+)", 120)
        total = int(m[2])
        at = rng.randint(max(1, total // 4), max(1, total // 2))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [int(x[1]) for line in proc.lines[-20:] if (x := re.search(r"step (\d+)/\d+", line))]
            if done and max(done) >= at:
                return
            if proc.p.poll() is not None:
                raise RuntimeError(f"{proc.name} ended before step {at} of {total}: {proc.tail()}")
            time.sleep(0.01)
        raise RuntimeError(f"{proc.name} did not reach step {at} of {total}: {proc.tail()}")

    def _store_moment(self, data: str, phase: str, rng: random.Random, job: Proc) -> None:
        """Wait until the store is writing a checkpoint (its log grew by a checkpoint's bytes at once: rank
        0's set of the job's parameters) or compacting (its snapshot being written, or its log just cut),
        the first to the third such moment, by the seed."""
        log, tmp = os.path.join(data, "log"), os.path.join(data, "snapshot.tmp")
        skip = rng.randint(0, 2)
        last, was = _size(log), False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            size = _size(log)
            now = size - last >= CHECKPOINT_BYTES if phase == "checkpoint" else os.path.exists(tmp) or size < last
            last = size
            if now and not was:
                if skip == 0:
                    return
                skip -= 1
            was = now
            if job.p.poll() is not None:
                raise RuntimeError(f"{job.name} ended before the store's {phase}: {job.tail()}")
            time.sleep(0.001)
        raise RuntimeError(f"no {phase} in the store's log within 120s: {job.tail()}")

    def _cluster_case(
        self,
        case: Case,
        rng: random.Random,
        env: dict[str, str],
        procs: list[Proc],
        want: str,
        data: str,
        disk: Disk | None,
    ) -> list[str]:
        problems: list[str] = []
        if disk is not None:
            data = disk.mount()
        members: list[Proc] = []
        if case.kind == "etcd":  # the store is an etcd cluster of three: one member is the victim
            members, address = _etcd(env, data)
            procs += members
            store = None
            self.store_ports = [int(hp.rsplit(":", 1)[1]) for hp in address.removeprefix("etcd://").split(",")]
        else:
            ip, exe = self._host("store")
            compact = ["--compact-bytes", COMPACT_BYTES] if case.phase == "compaction" else []
            store = Proc("store", ["store", "--host", ip, "--port", "0", "--data-dir", data, *compact], env, exe)
            procs.append(store)
            port = int(store.wait_line(r"listening on \S*:(\d+)", 30)[1])
            address = f"{ip}:{port}"
            store.argv = ["store", "--host", ip, "--port", str(port), "--data-dir", data, *compact]
            self.store_ports = [port]
        for i in range(self.args.workers):
            ip, exe = self._host(f"w{i}")
            w = Proc(f"worker w{i}", ["worker", "--store", address, "--host", ip, "--name", f"w{i}"], env, exe)
            procs.append(w)
            w.wait_line("ready on", 60)
        if case.topology == "ps":
            ip, exe = self._host("s0")
            s = Proc("server s0", ["server", "--cluster", "--store", address, "--host", ip, "--name", "s0"], env, exe)
            procs.append(s)
            s.wait_line("ready for ps jobs", 60)
        self.submitter_exe = self._host("store")[1]
        dashboard = None
        if case.kind == "dashboard":
            dashboard = Proc("dashboard", ["dashboard", "--store", address, "--port", "0", "--interval", "0.5"], env)
            procs.append(dashboard)
            dashboard.wait_line(r"psring dashboard: http", 60)
        pool = {
            "store": [store] if store is not None else [],
            "etcd": members,
            "worker": [p for p in procs if p.name.startswith("worker")],
            "server": [p for p in procs if p.name.startswith("server")],
            "dashboard": [dashboard] if dashboard is not None else [],
        }
        victim: Proc | None = None
        daemons = pool["worker"] + pool["server"]
        if case.phase == "idle":
            victim = rng.choice(pool[case.kind])
            if case.fault == "partition-peer":
                self.peer = rng.choice([d for d in daemons if d is not victim])
            self._inject(victim, case.fault, disk)
            self._restart(victim, case, procs)
        submit = Proc("submitter", self._job_argv(address, case.topology), env, self.submitter_exe)
        procs.append(submit)
        if case.phase != "idle":
            if case.phase == "mid-step":
                self._mid_step(submit, rng)
            elif case.phase == "placement":  # a worker daemon took its rank; the others may not have yet
                _first_line(pool["worker"], r"taking rank \d+ of job", 120)
            elif case.phase in ("checkpoint", "compaction"):
                self._store_moment(data, case.phase, rng, submit)
            else:  # rendezvous: the job is placed, its ranks are meeting
                submit.wait_line(r"job \S+ placed", 120)
                time.sleep(rng.uniform(0.0, 0.3))
            victim = submit if case.kind == "submitter" else rng.choice(pool[case.kind])
            if case.fault == "partition-peer":
                self.peer = rng.choice([d for d in daemons if d is not victim])
            self._inject(victim, case.fault, disk)
            if case.kind != "submitter":
                self._restart(victim, case, procs)
        assert victim is not None
        problems += self._judge(submit, victim, case, want)
        problems += self.wire_problems
        for timer in self.healing:  # the fault has healed before the cluster is judged again
            timer.join()
        if case.kind == "dashboard":  # read only: the job never noticed; and the page serves again
            problems += _dashboard_serves(getattr(victim, "restarted", victim), case)
        if case.kind == "submitter":  # the cluster goes on: a fresh job on it still gives the bits
            again = Proc("submitter (again)", self._job_argv(address, case.topology), env, self.submitter_exe)
            procs.append(again)
            problems += [f"after: {p}" for p in self._judge(again, None, case, want)]
        elif case.kind in RESTARTED:
            after = "after the restart" if case.fault not in PASSING else f"after the {case.fault} healed"
            again = Proc(f"submitter ({after})", self._job_argv(address, case.topology), env, self.submitter_exe)
            procs.append(again)
            problems += [f"{after}: {p}" for p in self._judge(again, None, case, want)]
        return problems

    def _restart(self, victim: Proc, case: Case, procs: list[Proc]) -> None:
        """The restart policy: a store or daemon that ended is started again with its arguments."""
        if case.fault in PASSING or case.kind not in RESTARTED:
            return
        try:
            victim.p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            return  # _judge names it: it did not end on SIGTERM
        time.sleep(1.0)
        if case.fault == "wire":  # restarted as another wire version first; the operator then puts it right
            self._other_wire(victim, procs)
        fresh = Proc(victim.name, victim.argv, victim.env, victim.exe)
        procs.append(fresh)
        ready = {"store": "listening on", "worker": "ready on", "server": "ready for ps jobs",
                 "dashboard": "psring dashboard: http",
                 "etcd": "ready to serve client requests"}[case.kind]  # fmt: skip
        fresh.wait_line(ready, 60)
        victim.restarted = fresh  # type: ignore[attr-defined]

    def _other_wire(self, victim: Proc, procs: list[Proc]) -> None:
        """The daemon started again as a psring of the next wire version (a rolling upgrade gone wrong):
        it must end by itself within the grace, naming both versions, and change nothing."""
        odd = Proc(f"{victim.name} (wire +1)", victim.argv, victim.env, exe=[sys.executable, "-c", OTHER_WIRE])
        procs.append(odd)
        try:
            odd.p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            self.wire_problems.append(f"{odd.name} still running {GRACE_S:g}s after it started: {odd.tail()}")
            return
        said = odd.out
        if odd.p.returncode == 0 or not re.search(r"wire version \d+ is not this server's \d+", said):
            self.wire_problems.append(
                f"{odd.name} ended ({odd.p.returncode}) without naming the versions: {odd.tail()}"
            )

    def _admission_case(
        self, case: Case, rng: random.Random, env: dict[str, str], procs: list[Proc], tag: str
    ) -> list[str]:
        """The elastic bed: two ps workers under ``psring launch`` that admit new workers every 3 steps
        (tests/support/jobs/elastic_grow_job.py); a third joins once the job runs, and the fault lands
        as the workers admit it (a worker's line says it was admitted). Held: the launcher and joiner end
        within the bound; every worker that reports a step reports the same parameters for it; each that
        finishes agrees on the live group; or the one that failed names the fault."""
        job_env = {**env, "STEPS": "150"}
        argv = ["launch", "-n", "2", "--topology", "ps", "--elastic", "--", sys.executable, GROW_JOB]
        launch = Proc("launcher", argv, job_env)
        procs.append(launch)
        launch.wait_line(r'"step": 2,', 120)
        ranks = [pid for pid in marked_pids(tag) if pid != launch.p.pid and _runs(pid, GROW_JOB)]
        envs = [e for e in map(_environ, ranks) if "WORLD_SIZE" in e]
        if not envs:
            return [f"no worker of the elastic job found: {launch.tail()}"]
        mine = envs[0]
        extra = {k: mine[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if k in mine}
        joiner = Proc("joiner", [GROW_JOB], {**job_env, **extra, "JOIN": "1", "PSRING_TOPOLOGY": "ps"},
                      exe=[sys.executable])  # fmt: skip
        procs.append(joiner)
        launch.wait_line(r'"admitted"', 120)
        if case.kind == "launcher":
            victim: Any = launch
        elif case.kind == "joiner":
            victim = joiner
        else:
            module = "psring.topology.ps" if case.kind == "shard" else GROW_JOB
            ours = (joiner.p.pid, launch.p.pid)
            found = sorted(pid for pid in marked_pids(tag) if _runs(pid, module) and pid not in ours)
            if not found:
                return [f"no {case.kind} process found to fault"]
            victim = _Pid(rng.choice(found), case.kind)
        self._inject(victim, case.fault)
        problems: list[str] = []
        for proc in (launch, joiner):
            try:
                proc.p.wait(timeout=self.args.bound)
            except subprocess.TimeoutExpired:
                problems.append(f"{proc.name} still waiting {self.args.bound:g}s later: {proc.tail()}")
        if problems:
            return problems
        rows = [r for line in launch.lines + joiner.lines if (r := _row(line)) is not None]
        steps: dict[int, set[float]] = {}
        for r in rows:
            if "step" in r:
                steps.setdefault(r["step"], set()).add(r["w"])
        split = sorted(t for t, ws in steps.items() if len(ws) > 1)
        if split:
            problems.append(f"workers reported different parameters at step(s) {split[:5]}")
        ends = [r for r in rows if "live" in r]
        if any(r["sum"] != r["live"] for r in ends):
            problems.append(f"the survivors disagree on the live group: {ends}")
        codes = {"launcher": launch.p.returncode, "joiner": joiner.p.returncode}
        self.outcome = "done, agreed" if not any(codes.values()) else f"ended {codes}"
        for proc in (launch, joiner):
            if proc.p.returncode and proc is not victim:
                last = next((line for line in reversed(proc.lines) if line.strip()), "")
                if not _names(last, victim, case):
                    problems.append(
                        f"{proc.name} failed ({proc.p.returncode}) without naming the fault: {last[:300]!r}"
                    )
        if not ends and launch.p.returncode == 0:  # (a launcher that failed said why, above)
            problems.append(f"the launcher ended well but no worker finished the elastic job: {launch.tail()}")
        return problems

    def _launch_case(
        self, case: Case, rng: random.Random, env: dict[str, str], procs: list[Proc], want: str, tag: str
    ) -> list[str]:
        train = Proc("launcher", self._train_argv(case.topology), env)
        procs.append(train)
        module = "psring.topology.ps" if case.kind == "shard" else "psring.training"

        def found() -> list[int]:
            return [pid for pid in marked_pids(tag) if pid != train.p.pid and _runs(pid, module)]

        if case.phase == "rendezvous":  # as soon as the victim's process (the launcher's: a rank) exists
            deadline = time.monotonic() + 60
            while not found() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
        else:  # mid-step: a moment within the job's second quarter of epochs, by its own epoch lines (a
            # moment timed by the undisturbed run came after the whole job once: it ran faster than that)
            self._mid_epoch(train, rng, self.took[case.topology])
        if train.p.poll() is not None:
            return ["the job ended before its fault could be injected: give it more --epochs"]
        if case.kind == "launcher":
            victim = train
        else:
            if not found():
                return [f"no {case.kind} process found to fault"]
            pid = rng.choice(sorted(found()))
            victim = _Pid(pid, case.kind)  # type: ignore[assignment]
        self._inject(victim, case.fault)
        return self._judge(train, victim, case, want)

    def _mid_epoch(self, proc: Proc, rng: random.Random, took: float) -> None:
        """Wait until ``psring train`` says it finished an epoch in its second quarter (its lines: "epoch N
        loss ..."); without such lines, a moment within the undisturbed run's second quarter."""
        at = rng.randint(max(1, self.args.epochs // 4), max(1, self.args.epochs // 2))
        deadline = time.monotonic() + self.args.bound
        fallback = time.monotonic() + rng.uniform(0.3, 0.5) * took
        seen, epochs = 0, False
        while time.monotonic() < deadline and proc.p.poll() is None:
            while seen < len(proc.lines):
                m = re.search(r"\bepoch (\d+) loss", proc.lines[seen])
                seen += 1
                epochs |= m is not None
                if m and int(m[1]) >= at:
                    return
            if not epochs and time.monotonic() > fallback:
                return  # (no epoch lines by the timed moment: fault it then)
            time.sleep(0.002)

    def _judge(self, job: Proc, victim: Any, case: Case, want: str) -> list[str]:
        """bounded, and done with the bits or failed naming the fault."""
        problems: list[str] = []
        t0 = time.monotonic()
        dumped = False
        while job.p.poll() is None:
            now = time.monotonic()
            if now - t0 > self.args.bound:
                self._dump_waiting()
                return [f"{job.name} still waiting {self.args.bound:g}s later: {job.tail()}"]
            quiet = now - job.times[-1] if job.times else 0.0  # (from its first line: it has its handler)
            if self.args.dump_silent and quiet > self.args.dump_silent and not dumped:
                dumped = True  # once a job: what the bed waits in while the job says nothing
                self._dump_waiting(f"{job.name} silent {quiet:.1f}s")
            time.sleep(0.1)
        took = time.monotonic() - t0
        if victim is not None:  # the faulted job's outcome, for the report
            code = job.p.returncode
            self.outcome = "done, the bits" if code == 0 else f"failed ({code}): {job.tail(1)[:120]}"
        if victim is job:  # the job's own process got the fault
            if case.fault in PASSING:  # paused or cut off, then back: it goes on to the bits
                if job.p.returncode != 0 or str((_summary(job.out) or {}).get("param_digest")) != want:
                    problems.append(f"{job.name} did not finish with the bits after its {case.fault}: {job.tail()}")
            elif took > GRACE_S:
                problems.append(f"{job.name} took {took:.1f}s to end on SIG{case.fault.upper()}")
            return problems
        summary = _summary(job.out)
        if job.p.returncode == 0 and summary is not None:
            if str(summary.get("param_digest")) != want:
                problems.append(f"{job.name} finished with other parameters ({summary.get('param_digest')} != {want})")
        else:
            last = next((line for line in reversed(job.lines) if line.strip()), "")
            named = victim is not None and _names(last, victim, case)
            if not named:
                problems.append(f"{job.name} failed ({job.p.returncode}) in {took:.1f}s without naming the fault: "
                                f"{last[:300]!r}")  # fmt: skip
        return problems

    def _dump_waiting(self, why: str = "") -> None:
        """A process waited past its bound: SIGUSR1 to every psring process of the bed still running (each
        prints its asyncio tasks' await chains and its threads' stacks, and goes on) -- kept in the log."""
        # (a process that has said nothing yet may not have its handler yet: SIGUSR1 would end it)
        live = [p for p in self.procs if p.p.poll() is None and p.exe != ["etcd"] and p.lines]
        marks = {id(p): len(p.lines) for p in live}
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.p.pid, signal.SIGUSR1)
        time.sleep(2.0)
        for i, p in enumerate(live):
            self.dumps[f"{why + ': ' if why else ''}{p.name} #{i}"] = "\n".join(p.lines[marks[id(p)]:][:400])

    def _stop_all(self, procs: list[Proc], tag: str) -> list[str]:
        """SIGTERM to every process still running: each must end within the grace; nothing marked may stay."""
        problems: list[str] = []
        live = [p for p in procs if p.p.poll() is None]
        for p in live:
            os.kill(p.p.pid, signal.SIGCONT)
            os.kill(p.p.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for p in live:
            try:
                p.p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                problems.append(f"{p.name} still running {GRACE_S:g}s after SIGTERM: {p.tail()}")
                p.p.kill()
                p.p.wait(timeout=30)
        time.sleep(0.5)
        left = marked_pids(tag)
        if left:
            problems.append(f"left running after the case: pids {left}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return problems


class _Pid:
    """A process the campaign did not start itself (a rank or a shard process under a launcher)."""

    def __init__(self, pid: int, kind: str = "rank") -> None:
        self.pid = pid
        self.name = f"{kind} (pid {pid})"

        class _P:
            pass

        self.p = _P()
        self.p.pid = pid  # type: ignore[attr-defined]


def _row(line: str) -> dict[str, Any] | None:
    """The elastic job's JSON line in a line (a launcher prefixes its ranks' lines), if any."""
    m = re.search(r"(\{.*\})\s*$", line)
    try:
        return json.loads(m[1]) if m else None
    except ValueError:
        return None


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw if "=" in x)


def _runs(pid: int, module: str) -> bool:
    """Whether process pid runs ``python -m module``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return module.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _once(fn: Any) -> Any:
    done: list[bool] = []

    def run() -> None:
        if not done:
            done.append(True)
            fn()

    return run


def _children(pid: int) -> list[int]:
    """pid and every process below it."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


class Partition:
    """A process (and its children) cut off the network: its cgroup's output dropped, until healed."""

    ROOT = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"

    @classmethod
    def lacks(cls) -> str | None:
        if os.geteuid() != 0:
            return "a partition needs root (iptables, cgroups)"
        if not os.path.exists(os.path.join(cls.ROOT, "cgroup.procs")) or not os.path.exists(
            os.path.join(cls.ROOT, "cgroup.subtree_control")
        ):
            return f"a partition needs cgroup v2 (none at {cls.ROOT})"
        try:
            probe = subprocess.run(["iptables", "-m", "cgroup", "--help"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return "a partition needs iptables"
        if probe.returncode != 0 or "--path" not in probe.stdout:
            return "a partition needs iptables' cgroup match"
        return None

    def __init__(self, pid: int, ports: list[int] | None = None) -> None:
        """``ports``: cut off from those (the store's) only; else from everything."""
        self.name = f"psring-fault-{os.getpid()}-{pid}"
        self.path = os.path.join(self.ROOT, self.name)
        only = ["-p", "tcp", "-m", "multiport", "--dports", ",".join(map(str, ports))] if ports else []
        self.rule = ["OUTPUT", "-m", "cgroup", "--path", self.name, *only, "-j", "DROP"]
        os.makedirs(self.path, exist_ok=True)
        self.moved: dict[int, str] = {}
        for p in _children(pid):
            try:
                with open(f"/proc/{p}/cgroup") as f:
                    home = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), "/")
                with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                    f.write(str(p))
                self.moved[p] = home
            except OSError:  # ended meanwhile
                continue
        subprocess.run(["iptables", "-I", *self.rule], check=True, timeout=30)

    def heal(self) -> None:
        subprocess.run(["iptables", "-D", *self.rule], check=False, timeout=30)
        for p in _pids_in(self.path):  # its children forked meanwhile are in it too
            home = self.moved.get(p, "/")
            try:
                with open(os.path.join(self.ROOT, home.lstrip("/"), "cgroup.procs"), "w") as f:
                    f.write(str(p))
            except OSError:
                try:
                    with open(os.path.join(self.ROOT, "cgroup.procs"), "w") as f:
                        f.write(str(p))
                except OSError:  # ended meanwhile
                    continue
        try:
            os.rmdir(self.path)
        except OSError:  # a process still in it: it ends with the case (_stop_all)
            pass


def _pids_in(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _first_line(procs: list[Proc], pattern: str, timeout: float) -> None:
    """Until one of ``procs`` says ``pattern``."""
    deadline = time.monotonic() + timeout
    seen = [len(p.lines) for p in procs]
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            lines = p.lines[seen[i] :]
            seen[i] += len(lines)
            if any(re.search(pattern, line) for line in lines):
                return
        time.sleep(0.002)
    raise RuntimeError(f"no {pattern!r} from {', '.join(p.name for p in procs)} within {timeout:g}s")


def _host_of(proc: Proc) -> str:
    """The bed's host name of a daemon (its --name: w0, s0)."""
    return proc.name.split()[1]


class Hosts:
    """The cluster bed's hosts for a partition from one peer: network namespaces on one bridge
    (tests/support/harness/netns.py, as the hosts bed's), one per daemon and one for the store and
    the submitter. A cut is two iptables rules in the victim's namespace (to and from the peer)."""

    def __init__(self, seed: int) -> None:
        # "x": no other bed's tag (a uuid's hex) starts so, and the campaign's tests tell its namespaces by it
        self.cluster = NetnsCluster(f"x{os.getpid() % 1000}{seed % 100}{time.monotonic_ns() % 1000}")

    @staticmethod
    def lacks() -> str | None:
        if os.geteuid() != 0:
            return "a partition from one peer needs root (network namespaces, iptables)"
        if shutil.which("iptables") is None:
            return "a partition from one peer needs iptables"
        return netns_available()

    def address(self, name: str) -> str:
        if name not in self.cluster.hosts:
            self.cluster.host(name)
        return self.cluster.addresses[name]

    def cut(self, host: str, peer: str) -> Any:
        """Drop every packet between ``host`` and ``peer`` (both ways; the store and the other daemons
        still reachable) until the returned heal is called."""
        ns, other = self.cluster.hosts[host], self.cluster.addresses[peer]
        rules = [["OUTPUT", "-d", other, "-j", "DROP"], ["INPUT", "-s", other, "-j", "DROP"]]
        for rule in rules:
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-I", *rule], check=True, timeout=30)

        def heal() -> None:
            for rule in rules:
                subprocess.run(["ip", "netns", "exec", ns, "iptables", "-D", *rule], check=False, timeout=30)

        return heal

    def close(self) -> None:
        self.cluster.close()


class Disk:
    """The store's data directory on a small tmpfs of its own, filled and emptied on demand."""

    SIZE = "64m"  # larger than the log before its first compaction (16 MiB): a smaller disk fills with the log

    def __init__(self, base: str) -> None:
        self.dir = os.path.join(base, "store-data")
        self.filler = os.path.join(self.dir, "filler")
        self.mounted = False

    def mount(self) -> str:
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(os.path.dirname(self.dir), OWNER), "w") as f:  # before the mount: see reclaim()
            f.write(str(os.getpid()))
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.SIZE}", "tmpfs", self.dir], check=True, timeout=30)
        self.mounted = True
        return self.dir

    def fill(self) -> None:
        chunk = b"\0" * (1 << 16)
        with open(self.filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError:  # ENOSPC: full
                pass
            try:
                while True:
                    f.write(b"\0")
            except OSError:
                pass

    def empty(self) -> None:
        try:
            os.unlink(self.filler)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.dir], check=False, timeout=30)
            self.mounted = False


OWNER = "owner"  # a Disk's base holds its campaign's pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim() -> list[str]:
    """What campaigns that ended without their clean-up (SIGKILLed, or the machine restarted under them)
    left: a full-disk case's tmpfs and a partition's cgroup and iptables rule, each keyed by the pid of
    the campaign that made it. Those whose campaign is gone are undone; a live campaign's are left alone.
    Returns what was undone, one line each."""
    done: list[str] = []
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if "/psring-faults-" in line]
    for point in points:
        base = os.path.dirname(point)
        try:
            with open(os.path.join(base, OWNER)) as f:
                owner = int(f.read().strip() or 0)
        except (OSError, ValueError):
            owner = 0  # mounted before owners were written: nobody's now
        if owner and _alive(owner):
            continue
        subprocess.run(["umount", "-l", point], check=False, timeout=30)
        shutil.rmtree(base, ignore_errors=True)
        done.append(f"unmounted {point} (its campaign, pid {owner or '?'}, is gone)")
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        return done
    rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True, timeout=30).stdout
    for rule in rules.splitlines():
        m = re.search(r"--path (psring-fault-(\d+)-\d+)", rule)
        if m is None or _alive(int(m.group(2))):
            continue
        subprocess.run(["iptables", "-D", *rule.split()[1:]], check=False, timeout=30)
        done.append(f"deleted the iptables rule of {m.group(1)} (its campaign is gone)")
    try:
        groups = [g for g in os.listdir(Partition.ROOT) if g.startswith("psring-fault-")]
    except OSError:
        groups = []
    for group in groups:
        m = re.fullmatch(r"psring-fault-(\d+)-\d+", group)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(Partition.ROOT, group)
        for pid in _pids_in(path):  # back to the root group; they are the dead campaign's, ended by now
            try:
                with open(os.path.join(Partition.ROOT, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError:
                continue
        try:
            os.rmdir(path)
            done.append(f"removed the cgroup {group} (its campaign is gone)")
        except OSError:
            pass
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _etcd(env: dict[str, str], data: str) -> tuple[list[Proc], str]:
    """Three etcd members on 127.0.0.1 (peer URLs on loopback), each ready; and the store address."""
    names = ["e0", "e1", "e2"]
    client = {n: _free_port() for n in names}
    peer = {n: _free_port() for n in names}
    cluster = ",".join(f"{n}=http://127.0.0.1:{peer[n]}" for n in names)
    members = []
    for n in names:
        argv = ["--name", n, "--data-dir", os.path.join(data, n),
                "--listen-client-urls", f"http://127.0.0.1:{client[n]}",
                "--advertise-client-urls", f"http://127.0.0.1:{client[n]}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer[n]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[n]}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "1000"]  # fmt: skip
        members.append(Proc(f"etcd {n}", argv, env, exe=["etcd"]))
    for m in members:
        m.wait_line("ready to serve client requests", 60)
    return members, "etcd://" + ",".join(f"127.0.0.1:{client[n]}" for n in names)


def _dashboard_serves(dash: Any, case: Case) -> list[str]:
    """The (restarted or resumed) dashboard answers /api/status with the cluster's daemons."""
    import urllib.request

    said = [line for line in dash.lines if "psring dashboard: http" in line]
    m = re.search(r"(http://\S+?)/?(\s|$)", said[-1]) if said else None
    if m is None:
        return [f"the dashboard never said where it serves: {dash.tail()}"]
    deadline = time.monotonic() + 30
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(m[1] + "/api/status", timeout=5) as r:
                status = json.loads(r.read())
            if status.get("workers") and not status.get("error"):
                return []
            last = f"no workers in {str(status)[:200]}"
        except (OSError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.5)
    return [f"the dashboard does not serve after its {case.fault}: {last}"]


def _names(line: str, victim: Any, case: Case) -> bool:
    """Whether a failure line names the fault: the process (its name, its rank) or its role."""
    low = line.lower()
    words = {"store", "worker", "server", "shard", "rank", "lost", "killed", "signal", "terminated", "disk",
             "space", "unreachable", "timed out", "etcd"}  # fmt: skip
    return any(w in low for w in words) or victim.name.split()[-1].lower() in low


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for topology, kind, fault, phase in itertools.product(args.topologies, args.kinds, args.faults, args.phases):
        c = Case(topology, kind, fault, phase)
        if c.why_not() is None:
            out.append(c)
    return out


def code_digest() -> str:
    """What the cases run: a digest of psring's sources (its .py, .c, .h and page files), so a log of
    cases run in parts -- across days, beside other work -- can show they all ran the same code."""
    import hashlib

    h = hashlib.sha256()
    base = os.path.join(ROOT, "psring")
    for folder, dirs, files in sorted(os.walk(base)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".c", ".h", ".html")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, base).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read() + b"\0")
    return h.hexdigest()[:16]


def held_in_log(path: str, code: str, args: argparse.Namespace) -> set[str]:
    """The cases a log (``--log``) says held on this code with this run's seed and bed."""
    held: set[str] = set()
    if not os.path.exists(path):
        return held
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            same = (row.get("code"), row.get("seed"), row.get("workers"), row.get("stop_s"), row.get("epochs")) == (
                code, args.seed, args.workers, args.stop_s, args.epochs)  # fmt: skip
            if same and row.get("held"):
                held.add(row["case"])
    return held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", nargs="+", default=["ring", "ps"], choices=["ring", "ps"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--case", help="one case, TOPOLOGY/KIND/FAULT/PHASE (what a failure prints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=60, help="the job's length: long enough to fault it mid-step")
    p.add_argument("--stop-s", type=float, default=10.0, help="seconds a SIGSTOPped process stays stopped")
    p.add_argument("--bound", type=float, default=240.0, help="seconds a job may take, faults and all")
    p.add_argument("--json", action="store_true", help="one JSON line per case")
    p.add_argument("--dump-silent", type=float, default=0.0, metavar="S",
                   help="SIGUSR1 the bed (once a job) when a judged job says nothing for S seconds; kept in --log")
    p.add_argument("--tails", action="store_true",
                   help="keep every case's processes' last lines, timed, in --log (a failed case's are kept anyway)")
    p.add_argument("--log", help="append each case's result (JSON, with a digest of psring's code) to this file, "
                   "and skip the cases it says held on the same code, seed and bed: a campaign in parts")
    args = p.parse_args(argv)
    todo = cases(args)
    if args.case:
        parts = args.case.split("/")
        if len(parts) != 4:
            p.error(f"--case {args.case!r}: want TOPOLOGY/KIND/FAULT/PHASE")
        todo = [Case(*parts)]
        why = todo[0].why_not()
        if why is not None:
            p.error(f"--case {args.case}: not a case ({why})")

    def interrupted(signum: int, _frame: Any) -> None:  # the case under way ends its bed, then the campaign
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # (a shell's background job starts with SIGINT ignored)
    for line in reclaim():  # what a campaign killed before its clean-up left
        print(f"reclaimed: {line}", flush=True)
    campaign = Campaign(args)
    failed = 0
    skipped = 0
    code = code_digest()
    before = held_in_log(args.log, code, args) if args.log else set()
    held_before = sum(c.name in before for c in todo)
    if held_before:
        print(f"{held_before} of these cases held already on this code ({code}, {args.log}): not run again",
              flush=True)  # fmt: skip
    for case in todo:
        if case.name in before:
            continue
        lacks = case.lacks()
        if lacks is not None:
            skipped += 1
            if args.json:
                print(json.dumps({"case": case.name, "seed": args.seed, "skipped": lacks}), flush=True)
            else:
                print(f"{case.name:34} skipped: {lacks}", flush=True)
            continue
        t0 = time.monotonic()
        problems = campaign.run(case, args.seed)
        took = time.monotonic() - t0
        failed += bool(problems)
        if args.log:
            with open(args.log, "a") as fh:
                fh.write(json.dumps({"case": case.name, "held": not problems, "problems": problems, "code": code,
                                     "seed": args.seed, "workers": args.workers, "stop_s": args.stop_s,
                                     "epochs": args.epochs, "seconds": round(took, 1), "job": campaign.outcome,
                                     "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                     **({"tails": campaign.tails} if campaign.tails else {}),
                                     **({"dumps": campaign.dumps} if campaign.dumps else {})}) + "\n")  # fmt: skip
        if args.json:
            print(json.dumps({"case": case.name, "seed": args.seed, "held": not problems, "problems": problems,
                              "seconds": round(took, 1), "job": campaign.outcome,
                              **({"tails": campaign.tails} if problems else {})}), flush=True)  # fmt: skip
        else:
            verdict = f"held ({campaign.outcome})" if not problems else "FAILED: " + "; ".join(problems)
            print(f"{case.name:34} {took:6.1f}s  {verdict}", flush=True)
        if problems:
            print(f"  replay: python benchmarks/faults.py --case {case.name} --seed {args.seed} "
                  f"--workers {args.workers} --epochs {args.epochs} --stop-s {args.stop_s:g}", flush=True)  # fmt: skip
    ran = len(todo) - skipped - held_before
    note = f" ({skipped} skipped: this machine lacks their fault)" if skipped else ""
    print(f"{ran - failed} of {ran} cases held{note}", flush=True)
    if held_before:
        print(f"with the log's: {held_before + ran - failed} of {len(todo) - skipped} held on this code ({code})",
              flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:  # the case under way ended its processes on the way out
        print(f"faults.py: interrupted ({exc}); --log keeps what ran", file=sys.stderr)
        sys.exit(130)
