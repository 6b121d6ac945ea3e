"""A straggler for the main job, set by the test (never by psring): on the rank(s) named by
STRAGGLER_RANK (comma-separated), each batch's forward/backward first sleeps a random 0-2x STRAGGLER_S seconds (and,
with STRAGGLER_PULL_S, each pull of the ps shards' parameters first sleeps that long: a worker that
starts or joins after the others took steps without it).
Python imports this at start-up in every process whose PYTHONPATH names this directory."""

import os

if os.environ.get("STRAGGLER_RANK") is not None and os.environ.get("RANK") in os.environ["STRAGGLER_RANK"].split(","):
    import random
    import time

    import psring.training.job as _job

    _real = _job.forward_backward
    _rng = random.Random(int(os.environ["RANK"]))

    def _slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(_rng.uniform(0.0, 2.0) * float(os.environ.get("STRAGGLER_S", "0.01")))
        return _real(*args, **kwargs)

    _job.forward_backward = _slow

    if os.environ.get("STRAGGLER_PULL_S"):  # ... and its pulls of the shards' parameters start that late
        import asyncio

        from psring.topology.ps.worker import params as _params

        _pull = _params.ParameterClient._pull_all

        async def _late_pull(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            await asyncio.sleep(float(os.environ["STRAGGLER_PULL_S"]))
            return await _pull(self, *args, **kwargs)

        _params.ParameterClient._pull_all = _late_pull
