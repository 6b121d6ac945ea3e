#!/usr/bin/env bash
# One command for a GPU machine that has Python, numpy, msgpack, uvloop and cupy but no network:
# runs psring from this working tree (no install), the gpu tests, and a cupy-vs-numpy all_reduce table.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import cupy, numpy, msgpack, uvloop; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py "$@"
python3 benchmarks/gpu_allreduce.py --workers "${PSRING_GPU_WORKERS:-4}" --sizes "${PSRING_GPU_SIZES:-1M,16M,64M}"
