"""A real Slurm on this machine: munged, slurmctld and slurmd started by the test with a slurm.conf of
its own (a few CPUs declared on one node), then psring jobs the way users start them: ``srun -n 4
python job.py`` with no launcher, and an ``sbatch`` script that finds rank 0's host with
``scontrol show hostnames``. Skips, saying why, where Slurm or munge are not installed (CI installs
them as root, best effort).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_start import CHECK, check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NEEDED = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "munged", "munge")


def _why_not() -> str | None:
    missing = [tool for tool in NEEDED if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}")]
    if missing:
        return f"Slurm is not installed here (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting slurmctld and slurmd needs root"
    if not os.path.exists("/etc/munge/munge.key"):
        return "munge has no key (/etc/munge/munge.key)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _munge_works() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        cred = subprocess.run([_tool("munge"), "-n"], capture_output=True, timeout=10)
        if cred.returncode == 0:
            return (
                subprocess.run([_tool("unmunge")], input=cred.stdout, capture_output=True, timeout=10).returncode == 0
            )
    return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("slurm")
    started: list[subprocess.Popen[bytes]] = []
    munged_pid = None
    if not _munge_works():  # start munge's daemon as its own user, and end it (by PID) at the end
        os.makedirs("/run/munge", exist_ok=True)
        user = pwd.getpwnam("munge")
        os.chown("/run/munge", user.pw_uid, user.pw_gid)
        pidfile = Path("/run/munge/psring-test-munged.pid")  # where the munge user may write
        subprocess.run(
            ["su", "-s", "/bin/sh", "munge", "-c", f"{_tool('munged')} --pid-file={pidfile}"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and _munge_works()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _munge_works():
            pytest.skip("munged did not start")
        munged_pid = int(pidfile.read_text().split()[0])
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = _free_port(), _free_port()
    conf = tmp / "slurm.conf"
    for sub in ("ctld", "d"):
        (tmp / sub).mkdir()
    conf.write_text(
        f"""ClusterName=psringtest
SlurmctldHost={host}
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={tmp}/ctld
SlurmdSpoolDir={tmp}/d
SlurmctldPidFile={tmp}/ctld.pid
SlurmdPidFile={tmp}/d.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmdParameters=config_overrides
SlurmctldLogFile={tmp}/ctld.log
SlurmdLogFile={tmp}/d.log
NodeName={host} CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
    try:
        for daemon in ("slurmctld", "slurmd"):
            started.append(
                subprocess.Popen(
                    [_tool(daemon), "-D", "-f", str(conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            if state.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            logs = "".join(p.read_text() for p in (tmp / "ctld.log", tmp / "d.log") if p.exists())
            pytest.fail(f"Slurm's node did not come up idle: {state.stdout}{state.stderr}\n{logs[-3000:]}")
        yield {"SLURM_CONF": str(conf), "TMP": str(tmp)}
    finally:
        for proc in started:  # by PID: these two daemons and nothing else
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if munged_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(munged_pid, signal.SIGTERM)


def _run(cmd: list[str], slurm: dict[str, str], extra: dict[str, str] | None = None, timeout: float = 150) -> str:
    env = {**os.environ, "SLURM_CONF": slurm["SLURM_CONF"], "PYTHONUNBUFFERED": "1", **(extra or {})}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_srun_starts_a_job_without_a_launcher(slurm: dict[str, str], topology: str) -> None:
    out = _run(["srun", "-n", "4", sys.executable, CHECK, "60"], slurm, {"PSRING_TOPOLOGY": topology})
    check([(0, out)], 4, topology)


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_sbatch_script_as_users_write_one(slurm: dict[str, str], topology: str) -> None:
    out_file = Path(slurm["TMP"]) / f"job-{topology}.out"
    script = Path(slurm["TMP"]) / f"job-{topology}.sh"
    script.write_text(
        f"""#!/bin/bash
#SBATCH -n 4
#SBATCH -o {out_file}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export PSRING_TOPOLOGY={topology}
srun {sys.executable} {CHECK} 60
"""
    )
    _run(["sbatch", "--wait", str(script)], slurm)
    check([(0, out_file.read_text())], 4, topology)
