"""A straggler for the main job, set by the test (never by psring): on the rank named by
STRAGGLER_RANK, each batch's forward/backward first sleeps a random 0-2x STRAGGLER_S seconds.
Python imports this at start-up in every process whose PYTHONPATH names this directory."""

import os

if os.environ.get("STRAGGLER_RANK") is not None and os.environ.get("RANK") == os.environ["STRAGGLER_RANK"]:
    import random
    import time

    import psring.training.job as _job

    _real = _job.forward_backward
    _rng = random.Random(int(os.environ["RANK"]))

    def _slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(_rng.uniform(0.0, 2.0) * float(os.environ.get("STRAGGLER_S", "0.01")))
        return _real(*args, **kwargs)

    _job.forward_backward = _slow
