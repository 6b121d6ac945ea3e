"""all_reduce across containers: psring's ring, psring's parameter server and torch's gloo, one rank
per container on one Docker network (so TCP through the bridge: containers share no network
namespace, and psring's same-host shared-memory paths are off between them), side by side.

    python benchmarks/containers.py --workers 2,4 --size 64M --iters 5 --rounds 2
    python benchmarks/containers.py --workers 2 --size 1M --iters 2 --rounds 1 --json   # a quick look

Needs a Docker engine and the images: psring:latest (deploy/Dockerfile, built here if missing,
on the stand-in base of tests/support/harness/docker_base.sh) and psring-bench:latest (psring:latest plus
torch's CPU wheel for gloo, from this machine's wheel cache; built here too). Rounds alternate
the order of ring, ps and gloo; each figure is the median over a round's timed calls of the
slowest rank (nccl-tests' convention), busbw = size * 2(N-1)/N / time. The ps rows have S=N
shards, one hosted in each worker's container (colocated).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from psring.cli.bench import parse_size  # noqa: E402

BENCH_DOCKERFILE = """FROM psring:latest
USER root
COPY wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER 10001
"""


def sh(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def ensure_images(gloo: bool) -> str:
    """The image the ranks run: psring's own, plus torch where gloo is measured."""
    sh("bash", os.path.join(ROOT, "tests", "support", "harness", "docker_base.sh"))
    sh("docker", "build", "-q", "-f", os.path.join(ROOT, "deploy", "Dockerfile"), "-t", "psring:latest", ROOT)
    if not gloo:
        return "psring:latest"
    if sh("docker", "image", "inspect", "psring-bench:latest", check=False).returncode == 0:
        return "psring-bench:latest"
    wheels = glob.glob("/opt/wheels/torch-2.13.0*cp311*.whl")
    if not wheels:
        raise SystemExit("no torch 2.13.0 cp311 wheel in /opt/wheels: gloo cannot be measured here")
    with tempfile.TemporaryDirectory() as ctx:
        os.makedirs(os.path.join(ctx, "wheels"))
        shutil.copy(wheels[0], os.path.join(ctx, "wheels"))
        with open(os.path.join(ctx, "Dockerfile"), "w") as fh:
            fh.write(BENCH_DOCKERFILE)
        sh("docker", "build", "-q", "-t", "psring-bench:latest", ctx, timeout=1800)
    return "psring-bench:latest"


def run_once(image: str, network: str, backend: str, n: int, size: int, iters: int) -> float:
    """One run: n containers, one rank each; returns the median time per all_reduce (slowest rank)."""
    tag = uuid.uuid4().hex[:6]
    out_dir = tempfile.mkdtemp(prefix="psring-ctr-")
    os.chmod(out_dir, 0o777)
    spec = {
        "sizes": [size],
        "dtype": "float32",
        "iters": iters,
        "warmup": 2,
        "out": "/out/result.json",
        "backend": "gloo" if backend == "gloo" else "psring",
        "gloo_init": None,
        "small_iters": iters,
        "timeout": 120.0,
    }
    names = [f"psr-{tag}-{r}" for r in range(n)]
    try:
        for r, name in enumerate(names):
            env = {
                "RANK": str(r),
                "WORLD_SIZE": str(n),
                "MASTER_ADDR": names[0],
                "MASTER_PORT": "29500",
                "PSRING_TOPOLOGY": "ps" if backend == "ps" else "ring",
                "PSRING_PS_COLOCATE": "1" if backend == "ps" else "0",
                "PYTHONUNBUFFERED": "1",
            }
            args = ["docker", "run", "-d", "--name", name, "--network", network, "--shm-size", "256m"]
            for k, v in env.items():
                args += ["-e", f"{k}={v}"]
            if r == 0:
                args += ["-v", f"{out_dir}:/out"]
            sh(*args, image, "python", "-m", "psring.training.bench_ranks", json.dumps(spec))
        codes = [int(sh("docker", "wait", name, timeout=600).stdout.strip()) for name in names]
        if any(codes):
            logs = "\n".join(sh("docker", "logs", name, check=False).stdout[-1500:] for name in names)
            raise SystemExit(f"{backend} N={n}: ranks exited {codes}\n{logs}")
        with open(os.path.join(out_dir, "result.json")) as fh:
            return float(json.load(fh)["results"][0]["time_s"])
    finally:
        sh("docker", "rm", "-f", *names, check=False)
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4")
    p.add_argument("--size", default="64M")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backends", default="ring,ps,gloo")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if shutil.which("docker") is None or sh("docker", "info", check=False).returncode != 0:
        raise SystemExit("no Docker engine answers (start dockerd)")
    size = parse_size(args.size)
    backends = args.backends.split(",")
    image = ensure_images("gloo" in backends)
    network = f"psring-bench-{uuid.uuid4().hex[:6]}"
    sh("docker", "network", "create", network)
    rows = []
    try:
        for n in (int(w) for w in args.workers.split(",")):
            times: dict[str, list[float]] = {b: [] for b in backends}
            for rnd in range(args.rounds):
                order = backends[rnd % len(backends) :] + backends[: rnd % len(backends)]
                for backend in order:
                    times[backend].append(run_once(image, network, backend, n, size, args.iters))
                    time.sleep(0.5)
            for backend in backends:
                t = statistics.median(times[backend])
                busbw = size * 2 * (n - 1) / n / t / 1e9
                rows.append({"workers": n, "backend": backend, "time_ms": t * 1e3, "busbw_GBps": busbw,
                             "runs_ms": [round(x * 1e3, 1) for x in times[backend]]})  # fmt: skip
    finally:
        sh("docker", "network", "rm", network, check=False)
    for n in sorted({r["workers"] for r in rows}):
        gloo = next((r for r in rows if r["workers"] == n and r["backend"] == "gloo"), None)
        for r in rows:
            if r["workers"] == n and gloo is not None:
                r["vs_gloo"] = r["busbw_GBps"] / gloo["busbw_GBps"]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"# all_reduce {args.size} float32 across containers, one rank each, TCP through a Docker bridge")
    print(f"{'N':>3} {'backend':>8} {'ms':>10} {'busbw GB/s':>11} {'vs gloo':>8}  runs (ms)")
    for r in rows:
        vs = f"{r['vs_gloo']:.2f}x" if "vs_gloo" in r else "-"
        line = f"{r['workers']:>3} {r['backend']:>8} {r['time_ms']:>10.1f} {r['busbw_GBps']:>11.3f} {vs:>8}"
        print(f"{line}  {r['runs_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
