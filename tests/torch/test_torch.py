"""psring.torch: torch tensors through psring, DistributedOptimizer, the torch example (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs torch==2.13.0 from disk)")

import psring.torch as pt  # noqa: E402

from ..conftest import run_tree  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(170)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(n: int, topology: str, args: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", str(n), "--topology", topology, "--", *args]
    return run_tree(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_tensors_cross_without_copies() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = pt.to_array(t)
    assert isinstance(a, np.ndarray) and a.shape == (2, 3) and a.dtype == np.float32
    a[0, 0] = 42.0
    assert t[0, 0].item() == 42.0  # the same memory
    back = pt.from_array(a)
    back[1, 2] = -1.0
    assert t[1, 2].item() == -1.0
    for dtype in (torch.float16, torch.float64, torch.int8, torch.int64, torch.uint8, torch.bool):
        x = torch.zeros(3, dtype=dtype)
        assert pt.from_array(pt.to_array(x)).dtype == dtype
    with pytest.raises(TypeError, match="bfloat16 tensors have no numpy dtype"):
        pt.to_array(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        pt.to_array([1, 2])
    with pytest.raises(TypeError, match="works with the blocking facade"):
        pt.all_reduce(object(), t)


SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch, psring, psring.torch as pt
    g = psring.init()
    r, n = g.rank, g.world_size
    t = torch.full((3, 4), float(r + 1))
    y = pt.all_reduce(g, t)
    assert torch.equal(y, torch.full((3, 4), float(n * (n + 1) // 2))) and torch.equal(t, torch.full((3, 4), r + 1.0))
    assert torch.equal(pt.all_reduce(g, t, op="avg", compression="fp16"), torch.full((3, 4), (n + 1) / 2))
    h = pt.broadcast(g, torch.arange(5) * (r + 1), src=1, async_op=True)
    assert torch.equal(h.wait(), torch.arange(5) * 2) and h.done()
    parts = pt.all_gather(g, torch.tensor([r, r]))
    assert [p.tolist() for p in parts] == [[k, k] for k in range(n)]
    assert pt.reduce_scatter(g, torch.ones(n * 2)).tolist() == [float(n)] * 2
    red = pt.reduce(g, torch.ones(2), dst=0)
    assert (red.tolist() == [float(n)] * 2) if r == 0 else red is None
    if r == 0:
        pt.send(g, torch.tensor([7.5, 8.5]), dst=1)
    elif r == 1:
        assert pt.recv(g, src=0).tolist() == [7.5, 8.5]

    # parameters and optimizer state: rank 0's win
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model.train()
    model(torch.randn(5, 4))  # moves BatchNorm's running stats: buffers differ per rank too
    pt.broadcast_parameters(model, g)
    digest = sum(float(v.double().sum()) for v in model.state_dict().values())
    assert len({float(d[0]) for d in g.all_gather(np.array([digest]))}) == 1

    # an unused parameter, two backward passes per step, overlap on
    extra = torch.nn.Parameter(torch.zeros(3))
    base = torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1, momentum=0.9)
    opt = pt.DistributedOptimizer(base, g, backward_passes_per_step=2, bucket_bytes=64)
    assert len(opt.buckets) > 1 and opt.overlap
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            torch.manual_seed(100 * step + 10 * micro + r)
            model(torch.randn(6, 4)).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        for p, mine in zip(model.parameters(), grads):
            others = g.all_gather(mine.numpy())
            assert torch.allclose(p.grad, torch.from_numpy(sum(others) / n), atol=1e-6)
        assert torch.equal(extra.grad, torch.zeros(3))
    digest = sum(float(p.double().sum()) for p in model.parameters())
    assert len({float(d[0]) for d in g.all_gather(np.array([digest]))}) == 1

    # optimizer state: momentum buffers and hyper-parameters follow rank 0
    if r != 0:
        for grp in base.param_groups:
            grp["lr"] = 0.5
        base.state.clear()
    pt.broadcast_optimizer_state(opt, g)
    assert base.param_groups[0]["lr"] == 0.1 and len(base.state) > 0
    buf = base.state[next(model.parameters())]["momentum_buffer"]
    assert len({float(d[0]) for d in g.all_gather(np.array([float(buf.double().sum())]))}) == 1
    # sparse gradients (nn.Embedding(sparse=True)): their rows summed in rank order and averaged
    emb = torch.nn.Embedding(20, 3, sparse=True)
    pt.broadcast_parameters(emb, g)
    sopt = pt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), g, sparse_params=[emb.weight])
    ids = torch.tensor([r, r + 5, 5, 5])  # row 5 on every rank, twice
    emb(ids).sum().backward()
    mine = emb.weight.grad.to_dense().clone()
    sopt.step()
    assert emb.weight.grad.is_sparse
    others = g.all_gather(mine.numpy())
    assert torch.allclose(emb.weight.grad.to_dense(), torch.from_numpy(sum(others) / n), atol=1e-6)
    assert len({float(d[0]) for d in g.all_gather(np.array([float(emb.weight.double().sum())]))}) == 1
    try:
        pt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), g, sparse_params=[torch.zeros(2, 2)])
    except ValueError as exc:
        assert "sparse_params must be the optimizer's parameters" in str(exc)
    else:
        raise AssertionError("a sparse_params tensor outside the optimizer was accepted")
    print("ALL OK rank", r, flush=True)
    g.close()
    """
)


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_torch_collectives_parameters_and_optimizer(tmp_path, topology: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = launch(3, topology, [sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum("ALL OK rank" in line for line in proc.stdout.splitlines()) == 3


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_example_equals_a_single_process_full_batch_run(tmp_path, topology: str) -> None:
    example = os.path.join(ROOT, "examples", "torch_mnist_like.py")
    dist_out, single_out = tmp_path / "dist.npz", tmp_path / "single.npz"
    proc = launch(4, topology, [sys.executable, example, "--epochs", "2", "--out", str(dist_out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epoch 1 loss" in proc.stdout
    single = run_tree(
        [sys.executable, example, "--single", "--world", "4", "--epochs", "2", "--out", str(single_out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert single.returncode == 0, single.stderr
    a, b = np.load(dist_out), np.load(single_out)
    assert sorted(a.files) == sorted(b.files) and a.files
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
    moved = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    assert moved < 1e-5


BACKUP_SCRIPT = textwrap.dedent(
    """
    import time, numpy as np, torch, psring, psring.torch as pt
    g = psring.init()
    r, n = g.rank, g.world_size
    torch.manual_seed(r)  # different initial weights: the shards take rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), g, backup=1)
    digest = lambda: float(sum(p.detach().double().sum() for p in model.parameters()))
    assert len({float(d[0]) for d in g.all_gather(np.array([digest()]))}) == 1  # rank 0's, on every rank
    w = torch.linspace(-1, 1, 8)[:, None]
    losses = []
    while opt.step_count < 60:  # the job's steps: the straggler skips those done without it
        step = opt.step_count
        torch.manual_seed(1000 * step + r)
        x = torch.randn(32, 8)
        loss = (model(x) - x @ w).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if r == n - 1 and step % 3 == 0:
            time.sleep(0.15)  # the straggler: the others' steps complete without it
        opt.step()
        losses.append(float(loss.detach()))
    g.barrier()
    assert len({float(d[0]) for d in g.all_gather(np.array([digest()]))}) == 1  # the same parameters everywhere
    if r != n - 1:  # the straggler's own losses are of the steps it made, which load decides: not a measure
        assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), (losses[:10], losses[-10:])
    left_out = g.all_gather(np.array([opt.skipped + g.stats().get("backup_dropped", 0)]))
    assert int(left_out[n - 1][0]) > 0, left_out  # the straggler was left out of some steps
    try:
        opt.synchronize()
    except RuntimeError as exc:
        assert "averaged on the shards" in str(exc)
    else:
        raise AssertionError("synchronize() with backup did not refuse")
    opt.param_groups[0]["lr"] = 0.01  # a scheduler would do this: refused, not ignored
    try:
        opt.step()
    except ValueError as exc:
        assert "hyperparameters changed" in str(exc) and "0.01" in str(exc)
    else:
        raise AssertionError("a changed learning rate was silently ignored")
    for bad, kind in ((lambda: torch.optim.RMSprop(model.parameters()), TypeError),
                      (lambda: torch.optim.Adam(model.parameters(), amsgrad=True), ValueError)):
        try:
            pt.DistributedOptimizer(bad(), g, backup=1)
        except kind as exc:
            assert "backup" in str(exc), exc
        else:
            raise AssertionError(f"{bad} was accepted with backup")
    print("BACKUP OK rank", r, flush=True)
    g.close()
    """
)


@pytest.mark.timeout(170)
def test_distributed_optimizer_with_a_backup_worker_leaves_a_straggler_out(tmp_path) -> None:
    script = tmp_path / "backup.py"
    script.write_text(BACKUP_SCRIPT)
    proc = launch(3, "ps", [sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum("BACKUP OK rank" in line for line in proc.stdout.splitlines()) == 3


def test_distributed_optimizer_refuses_backup_over_the_ring(tmp_path) -> None:
    script = tmp_path / "ring.py"
    script.write_text(textwrap.dedent(
        """
        import torch, psring, psring.torch as pt
        g = psring.init()
        model = torch.nn.Linear(2, 1)
        try:
            pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), g, backup=1)
        except ValueError as exc:
            assert "needs the ps topology" in str(exc), exc
            print("REFUSED rank", g.rank, flush=True)
        g.close()
        """
    ))
    proc = launch(2, "ring", [sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum("REFUSED rank" in line for line in proc.stdout.splitlines()) == 2


def test_ddp_benchmark_smoke() -> None:
    args = "--params 100K --steps 2 --warmup 1 --rounds 1 --json".split()
    proc = run_tree(
        [sys.executable, os.path.join(ROOT, "benchmarks", "torch_ddp.py"), *args],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["workers"] == 2 and result["params"] >= 100_000
    assert set(result["median_step_ms"]) == {"ddp", "ring", "ps"}
    assert all(ms > 0 for ms in result["median_step_ms"].values())


CUDA_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch, psring, psring.torch as pt
    g = psring.init()
    r, n = g.rank, g.world_size
    dev = torch.device("cuda")
    t = torch.full((1 << 20,), float(r + 1), device=dev)  # 4 MiB
    y = pt.all_reduce(g, t)
    assert y.device.type == "cuda" and torch.equal(y, torch.full_like(t, float(n * (n + 1) // 2)))
    b = pt.broadcast(g, torch.arange(5, device=dev) * (r + 1), src=1)
    assert b.device.type == "cuda" and torch.equal(b, torch.arange(5, device=dev) * 2)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    pt.broadcast_parameters(model, g)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), g, bucket_bytes=32 << 10)
    for step in range(3):
        opt.zero_grad()
        torch.manual_seed(100 * step + r)
        model(torch.randn(32, 64, device=dev)).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        for p, mine in zip(model.parameters(), grads):
            assert p.grad.device.type == "cuda"
            others = g.all_gather(mine.cpu().numpy())
            assert torch.allclose(p.grad.cpu(), torch.from_numpy(sum(others) / n), atol=1e-6)
    digest = sum(float(p.double().sum()) for p in model.parameters())
    assert len({float(d[0]) for d in g.all_gather(np.array([digest]))}) == 1
    print("CUDA OK rank", r, flush=True)
    g.close()
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_cuda_tensors_and_distributed_optimizer_on_the_gpu(tmp_path, topology: str) -> None:
    pytest.importorskip("cupy", reason="CUDA tensors travel through cupy")
    script = tmp_path / "cuda_rank.py"
    script.write_text(CUDA_SCRIPT)
    proc = launch(2, topology, [sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sum("CUDA OK rank" in line for line in proc.stdout.splitlines()) == 2


FEWER_BYTES_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch, psring, psring.torch as pt
    from psring.optim import SGD as OuterSGD
    g = psring.init()
    r = g.rank

    def run(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        pt.broadcast_parameters(model, g)
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), g, **kw)
        for step in range(8):
            torch.manual_seed(1000 * step + r)
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        opt.use_global()  # local SGD: the global parameters (streaming: the fragment in flight landed)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        ranks = g.all_gather(flat)
        assert all(np.array_equal(x, ranks[0]) for x in ranks), kw  # every rank the same bits
        return flat

    plain = run()
    for kw in ({"compression": psring.PowerSGD(2)}, {"compression": psring.TopK(0.1)}, {"compression": "int8"},
               {"local_steps": 4, "outer": OuterSGD(lr=0.7, momentum=0.9, nesterov=True)},
               {"local_steps": 4, "outer": OuterSGD(lr=0.7, momentum=0.9, nesterov=True), "compression": "bf16"},
               {"local_steps": 4, "outer": OuterSGD(lr=0.7, momentum=0.9, nesterov=True), "compression": "int8",
                "fragments": 2}):
        got = run(**kw)
        assert np.isfinite(got).all() and not np.array_equal(got, plain), kw
        print("RESULT", sorted(kw), float(np.float64(got).sum()).hex(), flush=True)
    # local_steps=1, outer SGD(lr=1): plain, to float rounding
    same = run(local_steps=1, outer=OuterSGD(lr=1.0))
    assert np.allclose(same, plain, atol=1e-6)
    print("FEWER OK rank", r, flush=True)
    g.close()
    """
)


def test_distributed_optimizer_takes_compressors_and_local_sgd_with_the_same_bits_on_both_topologies(
    tmp_path,
) -> None:
    script = tmp_path / "fewer.py"
    script.write_text(FEWER_BYTES_SCRIPT)
    results = {}
    for topology in ("ring", "ps"):
        proc = launch(2, topology, [sys.executable, str(script)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sum("FEWER OK rank" in line for line in proc.stdout.splitlines()) == 2
        results[topology] = sorted(line.split("RESULT", 1)[1] for line in proc.stdout.splitlines() if "RESULT" in line)
    assert results["ring"] == results["ps"] and len(results["ring"]) == 12  # ring == ps, bit for bit
