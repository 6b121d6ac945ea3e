"""One rank of the main job: ``python -m psring.training SPEC_JSON`` (``psring train`` starts these)."""

import json
import sys

from ..transport.loop import new_event_loop
from .job import worker

loop = new_event_loop()
try:
    loop.run_until_complete(worker(json.loads(sys.argv[1])))
finally:
    loop.close()
