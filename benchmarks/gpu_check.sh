#!/usr/bin/env bash
# One command for a GPU machine that has Python, numpy, msgpack, uvloop, torch and cupy but no network
# (issue #41's checks; benchmarks/GPU-RESULTS.md holds what it printed):
#   A. correctness, with the rest of the suite running beside it (pytest-xdist, capped in time):
#      every gpu-marked test; `psring train --device cuda` over ring and ps at 4 workers against the
#      CPU run (accuracy, and the parameters' digest: ring == ps bit for bit).
#   B. figures, alone on the machine: cupy vs numpy all_reduce (64 MiB, 4 ranks sharing the GPU, with
#      PSRING_GPU_OVERLAP=1 as a column); the staging steps; one DDP step on CUDA tensors, psring
#      against gloo (and NCCL where it takes several ranks on one GPU), with the parameters against gloo's.
# Runs psring from this working tree (no install). Logs go to $PSRING_GPU_OUT (default ./gpu-check-out).
# PSRING_GPU_SUITE_S caps the rest of the suite (default 270 s; 0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${PSRING_GPU_OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
log="$out/gpu.log"
say() { echo "== $(date +%T) $*" | tee -a "$log"; }
python3 -c "import cupy, numpy, msgpack, uvloop; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" 2>&1 | tee -a "$log" || exit 2
python3 -c "import pytest, pytest_asyncio, pytest_timeout" 2>/dev/null || {
  echo "gpu_check: the tests need pytest, pytest-asyncio and pytest-timeout (pip install, or carry their wheels)" >&2
  exit 2
}
{ nvidia-smi -L; python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'numpy', numpy.__version__)"; nproc; } 2>&1 | tee -a "$log"

suite_s="${PSRING_GPU_SUITE_S:-270}"
suite_pid=""
if [ "$suite_s" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  say "A. the rest of the suite (not gpu), beside, for at most ${suite_s} s"
  timeout -k 10 "$suite_s" python3 -m pytest -p no:cacheprovider -o addopts="" -m "not gpu and not long" -n 8 -q -rfE -p no:benchmark \
    --timeout 200 tests > "$out/suite.log" 2>&1 &
  suite_pid=$!
fi

say "A. every gpu-marked test"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rfEs tests 2>&1 | tee "$out/gpu-tests.log" | tail -n 30 | tee -a "$log"

say "A. psring train: cuda ring, cuda ps, cpu ring (4 workers, full length)"
for run in "cuda ring" "cuda ps" "cpu ring"; do
  set -- $run
  timeout 240 python3 -m psring train --device "$1" --topology "$2" --workers 4 --json 2>>"$out/train.err" | tail -n 1 |
    DEV="$1" python3 -c 'import json, os, sys
s = json.loads(sys.stdin.read())
print("train --device %s --topology %s: accuracy %.4f, ranks agree %s, digest %s, wall %.1f s, comm %.2f ms/step" % (
    os.environ["DEV"], s["topology"], s["test_accuracy"], s["ranks_agree"], s["params_digest"], s["wall_s"],
    s["ms_per_step_comm"]))' 2>&1 | tee -a "$log"
done

if [ -n "$suite_pid" ]; then
  say "A. waiting for the suite"
  wait "$suite_pid"; echo "suite exit $? (124: cut at ${suite_s} s)" | tee -a "$log"
  tail -n 40 "$out/suite.log" | tee -a "$log"
fi

say "B. cupy vs numpy all_reduce, 4 ranks on one GPU"
timeout 200 python3 benchmarks/gpu_allreduce.py --workers "${PSRING_GPU_WORKERS:-4}" --sizes "${PSRING_GPU_SIZES:-1M,16M,64M}" --variants 2>&1 | tee -a "$log"
say "B. staging steps"
timeout 60 python3 benchmarks/gpu_staging.py 2>&1 | tee -a "$log"
say "B. one DDP step on CUDA tensors"
(cd benchmarks && timeout 240 python3 torch_backend.py --device cuda --workers 2,4 --rounds 2 --variants gloo,ring,ps,nccl) \
  > "$out/ddp.log" 2>&1
grep -m 2 -i "nccl error\|duplicate gpu" "$out/ddp.log" | tee -a "$log"  # why NCCL refused, where it did
grep -A 6 "^# DDP" "$out/ddp.log" | tee -a "$log"
say "done"
