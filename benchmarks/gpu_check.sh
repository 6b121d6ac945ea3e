#!/usr/bin/env bash
# One command for a GPU machine that has Python, numpy, msgpack, uvloop and cupy but no network:
# runs psring from this working tree (no install), the gpu tests, a cupy-vs-numpy all_reduce table
# (with PSRING_GPU_OVERLAP=1 as a column), and the main job on the GPU over both topologies.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import cupy, numpy, msgpack, uvloop; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
python3 -c "import pytest, pytest_asyncio, pytest_timeout" 2>/dev/null || {
  echo "gpu_check: the gpu tests need pytest, pytest-asyncio and pytest-timeout (pip install, or carry their wheels)" >&2
  exit 2
}
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py tests/torch/test_torch.py "$@"
python3 benchmarks/gpu_allreduce.py --workers "${PSRING_GPU_WORKERS:-4}" --sizes "${PSRING_GPU_SIZES:-1M,16M,64M}" --variants
# the main job on the GPU, both topologies, full length: the accuracy bar is the CPU run's (0.95)
for topo in ring ps; do
  python3 -m psring train --device cuda --topology "$topo" --workers 4 --json | tail -n 1 | python3 -c '
import json, sys
s = json.loads(sys.stdin.read())
t, a, ok = s["topology"], s["test_accuracy"], s["ranks_agree"]
print(f"train --device cuda --topology {t}: test accuracy {a:.4f}, ranks agree {ok}")'
done
