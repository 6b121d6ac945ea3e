"""PyTorch Lightning's DDP over psring: the one line is ``import psring.torch`` at the top of the
script (Lightning starts every other process by running this script again, or, with ddp_spawn,
by spawning: the import registers the backend in each), then ``process_group_backend="psring"``.

    python examples/lightning_ddp.py --devices 2                      # the ring (PSRING_TOPOLOGY=ring)
    PSRING_TOPOLOGY=ps python examples/lightning_ddp.py --devices 2   # the parameter server
    python examples/lightning_ddp.py --devices 2 --strategy ddp_spawn
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --devices 2
    python examples/lightning_ddp.py --backend gloo --devices 2      # the same run over gloo

Metrics are logged with ``sync_dist=True`` in training and validation steps (Lightning averages an
int64 batch count with AVG on every backend but gloo: psring does it as NCCL does). ``--out F``
writes each rank's final weights and logged metrics to F.RANK.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring.torch  # noqa: F401  (registers the "psring" backend in this process)


def dataset(n: int, seed: int) -> TensorDataset:
    """Two Gaussian classes in 16 dimensions, the same on every rank (the sampler splits it)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 16, generator=g) + (y[:, None].float() * 2 - 1) * 0.75
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank starts from the same weights (DDP broadcasts rank 0's anyway)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)
        self.log("val_batches", torch.tensor(1, dtype=torch.int64), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Record(L.Callback):
    """Writes each rank's final weights and metrics (in every process: with ddp_spawn the
    processes that trained are not the one that called fit)."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.t0 = 0.0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.t0 = time.perf_counter()  # the training loop's time, not the processes' start

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.out:
            return
        record = {
            "rank": trainer.global_rank,
            "backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
            "weights": [p.detach().reshape(-1).tolist() for p in module.parameters()],
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "topology": os.environ.get("PSRING_TOPOLOGY", "ring"),
            "seconds": time.perf_counter() - self.t0,
            "steps": trainer.global_step,
        }
        with open(f"{self.out}.{trainer.global_rank}.json", "w") as fh:
            json.dump(record, fh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="psring", help="psring (default) or gloo")
    p.add_argument("--devices", type=int, default=2, help="processes (CPU)")
    p.add_argument("--strategy", choices=("ddp", "ddp_spawn"), default="ddp")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=None, help="write each rank's weights and metrics to OUT.RANK.json")
    args = p.parse_args()
    strategy = DDPStrategy(
        process_group_backend=args.backend, start_method="spawn" if args.strategy == "ddp_spawn" else "popen"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
        deterministic=True, callbacks=[Record(args.out)],
    )  # fmt: skip
    model = Classifier()
    train = DataLoader(dataset(512, 1), batch_size=32, shuffle=False)
    val = DataLoader(dataset(128, 2), batch_size=32)
    trainer.fit(model, train, val)
    if trainer.global_rank == 0:
        print(json.dumps({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}), flush=True)


if __name__ == "__main__":
    main()
