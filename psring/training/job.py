"""``psring train``: synchronous data-parallel SGD on real data (scikit-learn's digits).

Starts everything locally (a store, for ps the server shards, N worker processes).
Each worker trains a numpy (or cupy) MLP with a hand-written backward pass on its
shard of the data, and steps with :class:`psring.SyncSGD`: over the ring, gradients
are averaged with all_reduce and the optimizer runs on every rank; over ps, the
shards average and apply the same optimizer. Ranks -- and both topologies -- end with
bit-identical parameters, which the job checks rather than assumes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..core.arrays import cupy_module
from ..core.optim import SGD, Adam
from ..errors import PeerLostError
from ..topology.api import init_group
from . import embed
from .compressors import compression_from
from .data import load_digits_split, shard_indices
from .model import accuracy, forward_backward, init_params
from .sgd import SyncSGD

logger = logging.getLogger(__name__)

#: the main job's settings and their defaults: what ``psring train`` and ``psring submit`` (and
#: Client.submit's ``train=``) accept, one table for all three
TRAIN_DEFAULTS: dict[str, Any] = {
    "epochs": 20,
    "batch_size": 32,
    "lr": 0.1,
    "momentum": 0.9,
    "optimizer": "sgd",
    "compression": None,
    "accumulate": 1,
    # local SGD / DiLoCo: inner steps a round, and the outer optimizer (Nesterov SGD) on the pseudo-gradients
    "local_steps": 1,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "fragments": 1,  # streaming DiLoCo: the model in K fragments, exchanged in turn (with local_steps > 1)
    "device": "cpu",
    "seed": 0,
    "out": None,
    "checkpoint_every": 10,
    "model": "mlp",  # or "embed": the recommendation model with two sparse tables (psring.training.embed)
}


def train_spec(overrides: dict[str, Any]) -> dict[str, Any]:
    """TRAIN_DEFAULTS with ``overrides``; an unknown name is a ValueError naming the known ones."""
    unknown = set(overrides) - set(TRAIN_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown train settings {sorted(unknown)} (known: {sorted(TRAIN_DEFAULTS)})")
    return {**TRAIN_DEFAULTS, **overrides}


def local_sgd(spec: dict[str, Any]) -> dict[str, Any]:
    """SyncSGD's local SGD arguments from the spec: none for one local step, else local_steps and the
    outer optimizer (Nesterov SGD at outer_lr and outer_momentum, DiLoCo's)."""
    steps = int(spec.get("local_steps") or 1)
    if steps == 1:
        return {}
    lr, momentum = float(spec.get("outer_lr", 0.7)), float(spec.get("outer_momentum", 0.9))
    out = {"local_steps": steps, "outer": SGD(lr=lr, momentum=momentum, nesterov=momentum > 0)}
    fragments = int(spec.get("fragments") or 1)
    return {**out, "fragments": fragments} if fragments > 1 else out


def make_optimizer(spec: dict[str, Any]) -> Any:

    if spec["optimizer"] == "adam":
        return Adam(lr=spec["lr"])
    return SGD(lr=spec["lr"], momentum=spec["momentum"])


def load_data(spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The main job's (train x, train y, test x, test y) for spec["model"]."""
    return embed.make_data(spec["seed"]) if spec.get("model") == "embed" else load_digits_split(spec["seed"])


PROGRESS = "PSRING-PROGRESS "
REPORT_S = 1.0  # how often each rank reports its step times and link bytes (where asked to)


class _Run:
    """One rank's training run: its data, model and optimizer, and what it measured."""

    def __init__(
        self,
        group: Any,
        spec: dict[str, Any],
        emit: Callable[[dict[str, Any]], None],
        report: Callable[[dict[str, Any]], None] | None = None,
        data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.group, self.spec, self.emit, self.report = group, spec, emit, report
        #: when, steps, compute, comm and bytes sent at the last report
        self._reported = (time.perf_counter(), 0, 0.0, 0.0, 0)
        #: --model embed: the recommendation model whose two tables are sparse (psring.training.embed)
        self.embed = spec.get("model") == "embed"
        self.xtr, self.ytr, self.xte, self.yte = data if data is not None else load_data(spec)
        self.xp: Any = np
        if spec["device"] == "cuda":
            self.xp = cupy_module()
            self.xtr, self.ytr, self.xte, self.yte = (
                self.xp.asarray(v) for v in (self.xtr, self.ytr, self.xte, self.yte)
            )
        # ranks start from different seeds and agree on rank 0's parameters in start()
        start = embed.init_params if self.embed else init_params
        self.params = {k: self.xp.asarray(v) for k, v in start(spec["seed"] + group.rank).items()}
        self.opt = SyncSGD(
            group,
            self.params,
            make_optimizer(spec),
            accumulate=spec.get("accumulate", 1),
            compression=compression_from(spec.get("compression")),
            **local_sgd(spec),
            elastic=bool(spec.get("elastic")),
            backup=int(spec.get("backup") or 0),
            sparse=embed.SPARSE if self.embed else (),
        )
        self.comm = self.compute = 0.0
        self.steps = 0  # batches done (with accumulate=k, k per optimizer step), resumed runs included
        self.history: list[dict[str, Any]] = []
        per_rank = math.ceil(len(self.xtr) / group.world_size)
        self.per_epoch = math.ceil(per_rank / spec["batch_size"])
        self.total_steps = self.per_epoch * spec["epochs"]
        self.t_start = time.perf_counter()
        self.checkpoints: Any = None
        self.resumed_at: int | None = None  # the batch this run resumed from (None: a fresh start)
        #: elastic: the batch the next epoch starts at on every worker (None: epoch * per_epoch, as
        #: before any epoch ended; the epochs' lengths follow the workers there)
        self._boundary: int | None = None

    async def start(self, checkpoints: Any = None) -> None:
        """Agree on the starting parameters: rank 0's, or a checkpoint's (every rank loads the
        same), or what a restored parameter server holds; then continue from that step."""
        self.checkpoints = checkpoints
        saved = await checkpoints.load() if checkpoints is not None else None
        if saved is not None:
            self.opt.load_state_dict(saved["sgd"])
            self.history = list(saved.get("history", []))
        self.params = await self.opt.start()
        #: micro-batches an exchange takes (accumulate=k, local SGD's H inner steps): where workers may join
        #: and checkpoints are taken
        self.per_exchange = self.opt.accumulate * (self.opt.local.every if self.opt.local is not None else 1)
        self.steps = self.opt.step_count * self.per_exchange
        #: elastic: the epoch this worker starts with (a worker that joined a running job: the one
        #: the boundary that admitted it named)
        self.first_epoch = int((self.opt.joined_with or {}).get("epoch", 0))
        if self.opt.joined_with is not None:
            assert self.opt.joined_at is not None
            self._boundary = self.opt.joined_at * self.per_exchange
            return  # a new worker: the shards' parameters of the step it was admitted at
        if saved is not None or self.steps:
            self.resumed_at = self.steps
            # epochs after the checkpoint's last one are run again: their records come again too
            self.history = [h for h in self.history if h["step"] <= self.steps]

    async def save(self) -> None:
        """Rank 0 writes a checkpoint (between optimizer steps). Where it holds every rank's own state
        (local SGD's inner optimizers, a compressor's error feedback) every rank takes part in making it."""
        if self.checkpoints is None:
            return
        if self.group.rank == 0:
            await self.checkpoints.save({"sgd": await self.opt.state_dict(), "history": self.history})
        elif self.opt.state_dict_needs_every_rank:
            await self.opt.state_dict()  # (its all_gathers of every rank's own state)

    def report_progress(self) -> None:
        """This rank's recent steps: seconds per step computing and communicating (the straggler
        computes longest, the others wait for it in the exchange), and bytes per link so far."""
        assert self.report is not None
        now = time.perf_counter()
        _t, steps, compute, comm, sent = self._reported
        n = max(self.steps - steps, 1)
        sent_now = int(self.group.stats().get("bytes_sent", 0))
        self._reported = (now, self.steps, self.compute, self.comm, sent_now)
        busy = (self.compute - compute) + (self.comm - comm)
        self.report(
            {
                "rank": self.group.rank,
                "step": self.steps,
                "compute_s": (self.compute - compute) / n,
                "comm_s": (self.comm - comm) / n,
                # what a step sends (codecs, compressors and local SGD show here) and the share of the
                # recent steps' time spent computing
                "bytes_per_step": (sent_now - sent) / n,
                "compute_use": (self.compute - compute) / busy if busy > 0 else None,
                "links": self.group.link_stats(),
            }
        )

    def _progress(self, epoch: int, loss: float, **extra: Any) -> None:
        if (self.opt.live_group() if self.opt.elastic else self.group).rank == 0:
            self.emit(
                {
                    "step": self.steps,
                    "total": self.total_steps,
                    "epoch": epoch + 1,
                    "loss": loss,
                    **extra,
                    "elapsed": time.perf_counter() - self.t_start,
                    "mb": sum(v for k, v in self.group.stats().items() if k.startswith("bytes_")) / 1e6,
                    **({"departed": self._elastic_record()["departed"]} if self.opt.elastic else {}),  # type: ignore[index]
                }
            )

    async def epoch(self, epoch: int) -> None:
        """The epoch's batches from where the run stands (a resumed run starts mid-epoch)."""
        spec, batch_size = self.spec, self.spec["batch_size"]
        # elastic: the workers still there share the epoch out (a worker lost mid-epoch takes the
        # rest of its share of that epoch with it)
        group = self.opt.live_group() if self.opt.elastic else self.group
        idx = shard_indices(len(self.xtr), epoch, spec["seed"], group.rank, group.world_size)
        every = int(spec.get("checkpoint_every") or 0)
        losses = []
        first = 0 if self.opt.elastic else (self.steps - epoch * self.per_epoch) * batch_size
        # the step the epoch's first batch is (backup: a worker that is ahead skips the batches taken
        # without it); elastic: where the last epoch ended on every worker, or the boundary that admitted
        # a new worker (the epochs' lengths follow the workers there, not per_epoch)
        begin = self._boundary if self._boundary is not None else epoch * self.per_epoch + first // batch_size
        for i, start in enumerate(range(first, len(idx), batch_size)):
            if self.opt.backup and self.opt.step_count * self.opt.accumulate > begin + i:
                continue  # backup workers: the others took this batch's step without this (late) worker
            batch = self.xp.asarray(idx[start : start + batch_size])
            if self.embed:  # the rows this batch needs, from the shards (ps) or this rank's tables (ring)
                t_pull = time.perf_counter()
                pairs = self.xtr[batch]
                u_rows = await self.opt.pull_rows("users", pairs[:, 0])
                v_rows = await self.opt.pull_rows("items", pairs[:, 1])
                self.comm += time.perf_counter() - t_pull
                t0 = time.perf_counter()
                loss, grads = embed.forward_backward(u_rows, v_rows, self.params["bias"], pairs, self.ytr[batch])
            else:
                t0 = time.perf_counter()
                loss, grads = forward_backward(self.params, self.xtr[batch], self.ytr[batch])
            t1 = time.perf_counter()
            self.params = await self.opt.step(grads)
            self.compute += t1 - t0
            self.comm += time.perf_counter() - t1
            losses.append(loss)
            self.steps = self.opt.batches_done if self.opt.backup else self.steps + 1
            if self.steps % 10 == 0 or start + batch_size >= len(idx):
                self._progress(epoch, float(np.mean(losses[-10:])))
            if self.report is not None and time.perf_counter() - self._reported[0] >= REPORT_S:
                self.report_progress()
            if every and self.steps % (every * self.per_exchange) == 0 and start + batch_size < len(idx):
                await self.save()
        if self.opt.elastic:
            group = self.opt.live_group()  # every survivor has had the same results: the same group
        try:
            if self.opt.elastic:
                # a loss meets the ranks unevenly here: one that finished the step meets it in this
                # report-only all_reduce, on the old group, while the others meet it in the step and then
                # make the all_reduce on the survivors' group (the ring's re-formed one, the ps's live
                # subgroup) without it: their calls differ (ring: MismatchError; ps: a wait that never
                # ends). No collective here, as at the boundary's admission: each rank reports its own
                # mean (what rank 0 prints)
                mean_loss = float(np.mean(losses)) if losses else float("nan")
            else:
                # the mean of the workers' means, over those that ran a batch (backup: a straggler may have
                # skipped a whole epoch's)
                mine = np.array([np.mean(losses), 1.0] if losses else [0.0, 0.0])
                total, ran = await group.all_reduce(mine, op="sum")
                mean_loss = float(total / ran) if ran else float("nan")
        except PeerLostError as exc:
            links = getattr(group, "links", None)
            server_lost = exc.rank is None and links is not None and links.reconnect_servers
            worker_lost = self.opt.elastic and exc.rank is not None  # elastic: the next step goes on without it
            if not (server_lost or worker_lost):
                raise
            # a server shard or (elastic) a worker went away during this report-only all_reduce (every
            # worker's copy of it failed or finished as one collective, so the next is numbered alike
            # everywhere): report this worker's own mean; the next step reconnects, or drops the worker
            logger.warning("%r: epoch %d's loss all_reduce lost a %s (%s); reporting the local mean", group,
                           epoch + 1, "worker" if worker_lost else "server", exc)  # fmt: skip
            mean_loss = float(np.mean(losses)) if losses else float("nan")
        acc = await self._accuracy()
        self.history.append({"epoch": epoch + 1, "loss": mean_loss, "test_accuracy": acc, "step": self.steps})
        self._progress(epoch, mean_loss, acc=acc)
        # new workers join at epoch boundaries that are exchange boundaries too (accumulate=k: no micro-batches
        # summed and not yet exchanged; local SGD: at an outer step's end; every worker ran as many, so all
        # admit or none does)
        if self.opt.elastic and epoch + 1 < spec["epochs"] and self.steps % self.per_exchange == 0:
            await self.opt.admit_waiting({"epoch": epoch + 1})
        if self.opt.elastic:
            # every worker's: a step ends an epoch (local SGD: an inner one, counted alike on every worker)
            taken = self.opt.local.inner_steps if self.opt.local is not None else self.opt.step_count
            self._boundary = taken * self.opt.accumulate
        if self.opt.elastic and epoch + 2 >= spec["epochs"]:  # that was the last boundary: a worker that
            await self.opt.close_joins()  # asks to join from now on is told so at once
        if every and self.steps % self.per_exchange == 0:
            await self.save()

    async def _evaluated(self) -> dict[str, Any]:
        """The parameters a test measures: local SGD's global ones (the same on every rank; a rank's
        own copy between outer steps is not the model), else the current ones."""
        return await self.opt.global_params() if self.opt.local is not None else self.params

    async def _accuracy(self) -> float:
        if not self.embed:
            return accuracy(await self._evaluated(), self.xte, self.yte)
        u_rows = await self.opt.pull_rows("users", self.xte[:, 0])
        v_rows = await self.opt.pull_rows("items", self.xte[:, 1])
        return embed.accuracy(u_rows, v_rows, self.params["bias"], self.yte)

    async def summary(self) -> dict[str, Any] | None:
        """Rank 0's summary (None elsewhere). Every rank must hold identical parameters: this
        checks it rather than assumes it."""
        group = self.opt.live_group() if self.opt.elastic else self.group
        host = {k: (v if isinstance(v, np.ndarray) else v.get()) for k, v in (await self._evaluated()).items()}
        for name in self.opt.sparse:  # the tables too (over ps, pulled from the shards)
            host[name] = await self.opt.pull_rows(name, np.arange(self.opt.model.table_shape[name][0]))
        data = np.frombuffer(b"".join(host[k].tobytes() for k in sorted(host)), np.uint8).astype(np.int64)
        digest = int((data * (np.arange(data.size) % 251 + 1)).sum())
        digests = await group.all_gather(np.array([digest], np.int64))
        wall = time.perf_counter() - self.t_start
        stats = group.stats()
        mine_stats = [stats["bytes_sent"], stats["bytes_received"], stats.get("backup_dropped", 0), self.opt.skipped]
        all_stats = await group.all_gather(np.array(mine_stats, np.int64))
        servers: list[list[int]] = []
        if group.per_shard():  # what the shards received and sent = the sum over workers of the reverse
            mine = np.array(group.per_shard(), np.int64).reshape(-1, 2)
            total = await group.all_reduce(mine, op="sum")
            servers = [[int(r), int(s)] for s, r in total]
        if group.rank != 0:
            return None
        spec, steps = self.spec, max(self.steps - (self.resumed_at or 0), 1)  # timed here, this run
        return {
            "topology": group.topology,
            "workers": group.world_size,
            "servers": getattr(group, "num_servers", 0),
            "timeout": group.timeout,  # the job's PSRING_TIMEOUT, as the ranks resolved it
            "optimizer": spec["optimizer"],
            "compression": spec.get("compression"),
            "accumulate": spec.get("accumulate", 1),
            "test_accuracy": self.history[-1]["test_accuracy"],
            "final_loss": self.history[-1]["loss"],
            "wall_s": wall,
            "steps": self.steps,
            "resumed_at": self.resumed_at,
            "ms_per_step_compute": 1e3 * self.compute / steps,
            "ms_per_step_comm": 1e3 * self.comm / steps,
            # the share of a step's time spent computing (the rest waited on the exchange)
            "compute_use": self.compute / max(self.compute + self.comm, 1e-12),
            "local_steps": spec.get("local_steps", 1),
            "fragments": spec.get("fragments", 1),
            "bytes_per_worker": [[int(s[0]), int(s[1])] for s in all_stats],
            "bytes_per_server": servers,
            "ranks_agree": len({int(d[0]) for d in digests}) == 1,
            # rank 0's parameters (tables too) in one number: equal runs -- ring and ps, numpy and cupy
            # where the contract says bit for bit -- print the same one
            "params_digest": int(digests[0][0]),
            "elastic": self._elastic_record(),
            # backup workers: per worker, the steps its gradients came too late for, and those it skipped
            "backup": (
                {
                    "workers": self.opt.backup,
                    "late": [int(s[2]) for s in all_stats],
                    "skipped": [int(s[3]) for s in all_stats],
                }
                if self.opt.backup
                else None
            ),
            "param_digest": digest,
            "history": self.history,
        }

    def _elastic_record(self) -> dict[str, Any] | None:
        if not self.opt.elastic:
            return None
        world, members = getattr(self.group, "links", self.group).world_size, self.opt.members
        return {
            "departed": sorted(set(range(world)) - set(members)),
            "joined": sorted(r for r in members if r >= world),
        }


async def worker(
    spec: dict[str, Any],
    progress: Callable[[dict[str, Any]], None] | None = None,
    checkpoints: Any = None,
    env: Mapping[str, str] | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """One rank of the main job; rank 0 returns (and writes to spec["out"], if set) the summary.
    Its settings come from ``env`` (default: the process's environment).

    ``progress`` receives rank 0's progress records (default: printed as PSRING-PROGRESS lines);
    ``report``, every rank's step times and link bytes, about once a second (``_Run.report_progress``).
    ``checkpoints`` (psring.training.checkpoint): where rank 0 saves one every
    ``spec["checkpoint_every"]`` optimizer steps and at each epoch's end, and where the run
    resumes from when one is there.
    """

    def emit(record: dict[str, Any]) -> None:
        if progress is not None:
            progress(record)
        else:
            print(PROGRESS + json.dumps(record), flush=True)

    options: dict[str, Any] = {"join": True} if spec.get("join") else {}  # a new worker for a running elastic job
    # the data first: loading it (scikit-learn's import, seconds on a busy machine) blocks this thread,
    # and once the group is up that would starve the heartbeats the other ranks wait for
    data = load_data(spec)
    group = await init_group(env=env, **options)  # its settings (timeout, ...) are env's PSRING_*
    try:
        run = _Run(group, spec, emit, report, data)
        await run.start(checkpoints)
        first = run.first_epoch if run.opt.elastic else run.steps // run.per_epoch
        for epoch in range(first, spec["epochs"]):
            await run.epoch(epoch)
        if report is not None:
            run.report_progress()  # the last steps too
        summary = await run.summary()
        if summary is not None and spec.get("out"):
            with open(spec["out"], "w") as fh:
                json.dump(summary, fh)
        return summary
    finally:
        await group.close()
