"""Loss against H for local SGD / DiLoCo at equal samples (#82), on this host's loopback.

The loss a run reaches does not depend on the links, only on the algorithm: so the runs here are the
slow-link bed's model and ranks (benchmarks/diloco_rank.py: a 10.5 MB MLP, AdamW inner, outer Nesterov
SGD lr 0.7 momentum 0.9, int8 on the pseudo-gradients) started with ``psring launch`` on one host. Each
run takes the same steps (so the same samples); the table has each run's held-out loss of the global
parameters and its ratio to synchronous SGD's (H = 1, every step averaged, fp32).

    python benchmarks/diloco_loss.py --workers 4 --steps 1000 --runs 1,10,50,100,500,100:K4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run(workers: int, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="psring-diloco-loss-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "psring", "launch", "-n", str(workers), "--", sys.executable,
               str(ROOT / "benchmarks" / "diloco_rank.py"), json.dumps({**spec, "out": out})]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            said = proc.stdout[-1500:] + proc.stderr[-1500:]
            raise SystemExit(f"diloco_loss: {spec} failed ({proc.returncode}): {said}")
        return dict(json.loads(Path(out).read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--runs", default="1,10,50,100,500", help="H, or H:Kk for K fragments")
    ap.add_argument("--codec", default="int8", help="on the pseudo-gradients (H > 1)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for text in args.runs.split(","):
        h, _, k = text.partition(":K")
        spec = {"steps": args.steps, "local_steps": int(h), "fragments": int(k or 1), "lr": args.lr,
                "compression": args.codec if int(h) > 1 else None}  # fmt: skip
        got = run(args.workers, spec, args.timeout)
        got["name"] = text
        rows.append(got)
        print(f"# H={text}: test loss {got['test_loss']:.4f} ({got['wall_s']:.1f} s)", flush=True)
    base = rows[0]["test_loss"]
    print(f"# {args.workers} workers, {args.steps} steps of 32 a worker each (equal samples); loss of the global "
          f"parameters on a held-out set; x: against the first run ({rows[0]['name']})")  # fmt: skip
    print(f"{'H':>8} {'test loss':>10} {'x':>7} {'MB sent/worker':>15}")
    for r in rows:
        sent = max(r["bytes_sent"]) / 1e6
        print(f"{r['name']:>8} {r['test_loss']:>10.4f} {r['test_loss'] / base:>7.3f} {sent:>15.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
