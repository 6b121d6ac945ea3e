"""A shard's checkpoints of the parameters it holds (``--checkpoint-dir``): one ``.npz`` a shard, its
buckets' parameters, optimizer state and step, written to a temporary file, fsynced and renamed into
place (then the directory fsynced), so a crash leaves the last whole checkpoint; read back with
``--restore``. When they are written (every K completed steps of a bucket, and on SIGTERM) and what
waits for them (a step's results) is the parameter store's (``paramstore``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import numpy as np

from .bucket import Bucket

logger = logging.getLogger(__name__)


class ShardCheckpoint:
    """Where one shard's checkpoint goes (``directory``: None, none is kept), how often, how many written."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.directory: str | None = None
        self.name: str | None = None  # default: the job's name
        self.every = 1
        self.written = 0

    @property
    def on(self) -> bool:
        return self.directory is not None

    def path(self) -> str:
        assert self.directory is not None
        s = self.shard
        return os.path.join(self.directory, f"psring-{self.name or s.job}-shard{s.index}-of{s.shards}.npz")

    def save(self, buckets: dict[int, Bucket]) -> None:
        """Write every ready bucket; the file is whole or the previous one stays."""
        if self.directory is None or not buckets:
            return
        arrays: dict[str, np.ndarray] = {}
        for b, bucket in buckets.items():
            if bucket.ready:
                arrays.update(bucket.to_arrays(f"b{b}."))
        path = self.path()
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        with contextlib.suppress(OSError):
            dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self.written += 1

    def restore(self) -> dict[int, Bucket]:
        """The buckets of this shard's checkpoint, if there is one (none: {}); a ValueError if it was
        written for another shard layout."""
        if self.directory is None or not os.path.exists(self.path()):
            return {}
        shard = self.shard
        out: dict[int, Bucket] = {}
        with np.load(self.path(), allow_pickle=False) as data:
            for key in [k for k in data.files if k.endswith(".meta")]:
                prefix = key[: -len("meta")]
                meta = json.loads(str(data[key]))
                bucket = Bucket(
                    meta["b"],
                    meta["n"],
                    meta["dtype"],
                    meta["size"],
                    meta["config"],
                    shard.index,
                    shard.shards,
                    shard.settings.ps_piece,
                    tuple(meta["weights"]) if meta.get("weights") else None,
                )
                if list(bucket.slice) != meta["slice"]:
                    raise ValueError(f"checkpoint {self.path()} was written for another shard layout")
                bucket.param[...] = data[f"{prefix}param"]
                bucket.start()
                for k in list(bucket.state):
                    if k != "step" and f"{prefix}state.{k}" in data.files:
                        bucket.state[k][...] = data[f"{prefix}state.{k}"]
                bucket.step = int(meta["step"])
                out[bucket.b] = bucket
        logger.info("%r restored %d bucket(s) from %s", shard, len(out), self.path())
        return out
