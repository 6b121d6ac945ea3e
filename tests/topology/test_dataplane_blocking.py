"""The data plane's all_reduce over TCP from the blocking API: run whole in C on the caller's thread
(psring.topology.ring.plane.allreduce.PlaneAllReduce.soon, NativeJobs.run_here), one rank a process as users run it."""

from __future__ import annotations

import pytest

from ..conftest import blocking_job_end, run_blocking_job
from ..transport.test_shmboard import _needs_native

pytestmark = [pytest.mark.slow]


BLOCKING_JOB = """
import os, time, numpy as np, psring
from psring.core.fold import canonical_fold
g = psring.init()
n, grp = g.world_size, g.group
plane = grp.net.plane
assert plane is not None and plane.shm_out is None and plane.native is not None
for i in range(80):
    dtype = np.float64 if i % 3 == 1 else np.float32
    xs = [np.random.default_rng(1000 * i + r).standard_normal(200_000 + i).astype(dtype) for r in range(n)]
    op = ("sum", "avg", "max", "prod")[i % 4]
    if i % 20 == 13:  # a call in flight on the loop: the next one takes the plane's threads, in order
        h = g.all_reduce(np.ones(300_000, np.float32), async_op=True)
        y = g.all_reduce(xs[g.rank], op)
        assert np.all(h.wait() == n), i
    else:
        y = g.all_reduce(xs[g.rank], op)
    ref = canonical_fold(xs, op, np.empty_like(xs[0]))
    assert y.tobytes() == ref.tobytes(), (i, op)
    if g.rank == 1 and i % 20 == 19:
        time.sleep(0.5)  # a late rank: the others' calls are handed to the plane's receive thread
done = (grp.plane.ran_now, grp.plane.adopted)
assert plane.native.jobs >= sum(done), (plane.native.jobs, done)
""" + blocking_job_end("grp.plane.ran_now, grp.plane.adopted").replace(
    "np.ones(2, np.float32)",
    "np.ones(300_000, np.float32)",  # rank 1 gone: a plane call, on this thread, names it
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_blocking_plane_calls_over_tcp_run_in_c_on_the_callers_thread(tmp_path, world: int) -> None:
    """The blocking API's plane all_reduces over TCP run whole on the caller's thread (NativeJobs.run_here)
    when nothing is in flight; a late peer hands the job, where it stands, to the plane's receive thread;
    a lost rank is named to the others. Bits against canonical_fold every call."""
    _needs_native()
    script = tmp_path / "job.py"
    script.write_text(BLOCKING_JOB)
    env = {"PSRING_SAME_HOST": "off", "PSRING_RING_PLANE_MIN": str(64 << 10), "PSRING_RING_PLANE_PIECE": "100000"}
    env["PSRING_RING_TWO_HOP"] = "0"  # the plane's path: from 4 ranks these sizes would take two hops (test_two_hop.py)
    for r, (here, adopted) in run_blocking_job(script, world, **env).items():
        # the 60 sums, averages and products and the 4 calls beside them (max: the threads), but those that
        # waited on rank 1's naps -- and after a nap the next calls find the plane idle again
        assert here >= 50, (r, here, adopted)
        if r != 1:
            assert adopted > 0, (r, here, adopted)  # rank 1's naps made the others wait past PLANE_ADOPT_AFTER
