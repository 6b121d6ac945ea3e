"""One rank of the main job: ``python -m psring.training SPEC_JSON`` (``psring train`` starts these)."""

import json
import sys

from ..core.arrays import keep_freed_memory
from ..transport.loop import new_event_loop
from .checkpoint import DirCheckpoints
from .job import worker

keep_freed_memory()  # this process is psring's own rank: reuse freed memory instead of faulting pages in
spec = json.loads(sys.argv[1])
checkpoints = DirCheckpoints(spec["checkpoint_dir"]) if spec.get("checkpoint_dir") else None
loop = new_event_loop()
try:
    loop.run_until_complete(worker(spec, checkpoints=checkpoints))
finally:
    loop.close()
