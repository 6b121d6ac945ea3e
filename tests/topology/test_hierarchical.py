"""Hierarchical all_reduce and the two-level order (#27): ranks that say they are on several hosts.

The ranks are real processes under ``psring launch``; which "host" each is on comes from
PSRING_HOST_ID (tests/support/jobs/hier_job.py), as ranks in separate containers or machines would
differ in their host keys. benchmarks/hosts.py runs the same over network namespaces with
rate-limited links.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from psring.core.fold import canonical_fold, host_layout, two_level_fold
from psring.settings import load
from tests.conftest import end, run_tree, spawn
from tests.rendezvous.test_store import free_port

pytestmark = [pytest.mark.slow]  # it starts processes

JOB = str(Path(__file__).resolve().parents[1] / "support" / "jobs" / "hier_job.py")


def test_host_layout_needs_several_hosts_with_as_many_ranks_each() -> None:
    assert host_layout(["a", "a", "b", "b"]) == ((0, 1), (2, 3))
    assert host_layout(["a", "b", "a", "b"]) == ((0, 2), (1, 3))  # hosts in the order of their lowest rank
    assert host_layout(["b", "b", "b", "a", "a", "a"]) == ((0, 1, 2), (3, 4, 5))
    assert host_layout(["a", "a", "a", "a"]) is None  # one host: the flat ring (and its shared memory)
    assert host_layout(["a", "b", "c"]) is None  # one rank per host: the flat ring is already optimal
    assert host_layout(["a", "a", "b"]) is None  # uneven hosts
    assert host_layout(["a", None, "b", "b"]) is None  # a rank that could not tell
    assert host_layout([]) is None


def test_two_level_fold_is_the_fold_of_host_folds() -> None:
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((6, 1001)).astype(np.float32)
    hosts = ((0, 2, 4), (1, 3, 5))
    p0 = (xs[0] + xs[2]) + xs[4]
    p1 = (xs[1] + xs[3]) + xs[5]
    assert np.array_equal(two_level_fold(xs, "sum", np.empty(1001, np.float32), hosts), p0 + p1)
    assert np.array_equal(canonical_fold(xs, "avg", np.empty(1001, np.float32), hosts=hosts), (p0 + p1) / np.float32(6))
    assert np.array_equal(two_level_fold(xs, "max", np.empty(1001, np.float32), hosts), xs.max(axis=0))
    # it is another order than the flat one (that is the point), and it does not depend on windows
    flat = canonical_fold(xs, "sum", np.empty(1001, np.float32))
    assert not np.array_equal(flat, p0 + p1)
    window = canonical_fold(xs[:, 100:300], "sum", np.empty(200, np.float32), offset=100, total=1001, hosts=hosts)
    assert np.array_equal(window, (p0 + p1)[100:300])


def test_the_setting_reads_on_off_auto() -> None:
    assert load({}).hierarchical == "auto"
    assert load({"PSRING_HIERARCHICAL": "1"}).hierarchical == "on"
    assert load({"PSRING_HIERARCHICAL": "OFF"}).hierarchical == "off"
    with pytest.raises(ValueError, match="PSRING_HIERARCHICAL"):
        load({"PSRING_HIERARCHICAL": "sometimes"})


def _run(
    topology: str, n: int, hosts: str, hierarchical: str = "auto", **extra: str
) -> tuple[list[list[str]], str]:
    """The job's 'HIER' lines, one per rank (rank, two-level matches, flat matches, total, digest, host-reduced
    blocks, the calls not in the flat order), and its output."""
    env = {**os.environ, "HIER_HOSTS": hosts, "PSRING_HIERARCHICAL": hierarchical, **extra}
    cmd = [sys.executable, "-m", "psring", "launch", "-n", str(n), "--topology", topology, "--", sys.executable, JOB]
    proc = run_tree(cmd, timeout=150, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    rows = [line.split("HIER ", 1)[1].split() for line in proc.stdout.splitlines() if "HIER " in line]
    assert sorted(int(r[0]) for r in rows) == list(range(n)), output[-4000:]
    return rows, output


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n,hosts", [(4, "block:2"), (6, "block:3"), (6, "block:2"), (4, "interleave:2")])
def test_ring_and_ps_fold_in_the_two_level_order_across_hosts(n: int, hosts: str) -> None:
    """Every size (small path, one block, several blocks) and op on the ring's hierarchical path and
    on parameter-server shards gives the two-level order's bits, and SyncSGD the same parameters."""
    digests = set()
    for topology in ("ring", "ps"):
        rows, _ = _run(topology, n, hosts)
        for _rank, two, _flat, total, digest, blocks, _odd in rows:
            assert two == total, (
                f"{topology}: {int(total) - int(two)} of {total} all_reduces not in the two-level order"
            )
            # ps: the two sizes from 256 KiB (PSRING_PS_HOST_REDUCE), 4 ops each, and the three calls in
            # flight at once: one 8 MiB block each
            assert int(blocks) == (8 + 3 if topology == "ps" else 0), (topology, blocks)
            digests.add(digest)
    assert len(digests) == 1, f"ring and ps SyncSGD parameters differ: {digests}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,hosts", [(4, "block:2"), (6, "block:2")])
def test_ps_reduces_within_the_host_in_blocks_and_off_pushes_every_tensor(n: int, hosts: str) -> None:
    """The parameter server's host-reduced all_reduce (#36) in blocks smaller than the tensor (several
    in flight through the boards' two slots), with 2 and 3 hosts (3: the hosts' subgroup's shards
    fold in host order, not from a ring chunk's owner): the two-level order's bits; turned off, the
    same bits with every rank pushing its own tensor."""
    digests = set()
    # 100_003 floats: one block; 1_500_001: six; the three 300_000 in flight at once: two each
    for limit, want in (("256K", 4 * (1 + 6) + 3 * 2), ("0", 0)):
        rows, _ = _run("ps", n, hosts, PSRING_PS_HOST_BLOCK="1M", PSRING_PS_HOST_REDUCE=limit)
        for _rank, two, _flat, total, digest, blocks, _odd in rows:
            assert two == total, f"{int(total) - int(two)} of {total} all_reduces not in the two-level order"
            assert int(blocks) == want, (limit, blocks)
            digests.add(digest)
    assert len(digests) == 1, f"SyncSGD parameters differ: {digests}"


@pytest.mark.timeout(200)
def test_ranks_that_set_another_host_reduce_size_take_the_path_for_the_same_calls() -> None:
    """Rank 0 says PSRING_PS_HOST_REDUCE=2M, the others 256K: every rank takes the largest, so only the
    1_500_001-float calls (one block each, 4 ops) are reduced within the host, on every rank."""
    rows, _ = _run("ps", 4, "block:2", HIER_RANK0_HOST_REDUCE="2M")
    for _rank, two, _flat, total, _digest, blocks, _odd in rows:
        assert two == total and int(blocks) == 4, (two, total, blocks)


@pytest.mark.timeout(300)
def test_off_keeps_the_flat_order_on_both_topologies() -> None:
    digests = set()
    for topology in ("ring", "ps"):
        rows, _ = _run(topology, 4, "block:2", hierarchical="off")
        for rank, two, flat, total, digest, blocks, odd in rows:
            # (odd: the calls not in the flat order, as size/op)
            assert flat == total and int(two) < int(total), (topology, rank, two, flat, total, odd)
            assert blocks == "0", (topology, blocks)  # the flat order: no host-reduced all_reduce
            digests.add(digest)
    assert len(digests) == 1, f"ring and ps SyncSGD parameters differ: {digests}"


@pytest.mark.timeout(200)
def test_on_with_uneven_hosts_says_why_it_stays_flat() -> None:
    rows, output = _run("ring", 3, "block:2", hierarchical="on")  # hosts of 2 and 1 ranks
    assert all(flat == total for _r, _two, flat, total, _d, _b, _odd in rows), rows
    assert "PSRING_HIERARCHICAL=on, but the ranks' hosts hold [1, 2] ranks" in output, output[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_a_rank_lost_mid_hierarchical_all_reduce_is_named_on_every_other_rank(topology: str) -> None:
    """The ring's hierarchical all_reduce, and the ps's reduced within the host (rank 3 waits on the
    dead rank's post on their host's board, ranks 0 and 1 on the shards)."""
    port = free_port()
    procs = []
    try:
        for r in range(4):
            env = {"RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            env["PSRING_TOPOLOGY"] = topology  # ps: rank 0 serves the store and every shard
            procs.append(spawn([JOB], {**env, "HIER_HOSTS": "block:2", "HIER_CRASH": "2"}))
        outs = [proc.communicate(timeout=60)[0] for proc in procs]
        assert procs[2].returncode == 9, outs[2]
    finally:
        for proc in procs:
            end(proc)
    died = float(next(x for x in outs[2].splitlines() if x.startswith("DIED ")).split()[1])
    for r in (0, 1, 3):
        line = next((x for x in outs[r].splitlines() if x.startswith("LOST ")), None)
        assert line is not None and "rank 2" in line and "none" not in line, outs[r][-2000:]
        assert float(line.split()[2]) - died < 10.0, line


@pytest.mark.timeout(120)
def test_a_mismatch_in_a_host_reduced_ps_all_reduce_is_named_not_hung() -> None:
    """Rank 1 all_reduces a larger tensor than its host's other rank and the other host's ranks: its
    host's board (or the shards) say so on every rank, well before the timeout."""
    port = free_port()
    procs = []
    try:
        for r in range(4):
            env = {"RANK": str(r), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            env |= {"PSRING_TOPOLOGY": "ps", "HIER_HOSTS": "block:2", "HIER_MISMATCH": "1", "PSRING_STALL_S": "2"}
            procs.append(spawn([JOB], env))
        outs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            end(proc)
    for r in range(4):  # every rank names it, and the group goes on: the barrier after it passes
        line = next((x for x in outs[r].splitlines() if x.startswith("MISMATCH ")), None)
        assert line is not None and "MismatchError" in line and "float32[1001000]" in line, outs[r][-2000:]
        assert "BARRIER" not in outs[r], outs[r][-2000:]
