"""Where a training run keeps its checkpoints, and how one is written: a SyncSGD ``state_dict`` plus
what the loop itself needs (its history), as one ``.npz`` (arrays by name, the rest as JSON).

- :class:`DirCheckpoints`: a file in a directory (``psring train --checkpoint-dir``), written
  atomically (a temporary file, fsync, rename).
- :class:`StoreCheckpoints`: a key in the rendezvous store (a cluster job, whose workers share
  no disk): fine for models of a few MiB (the store takes values up to 64 MiB).

Rank 0 saves; every rank loads the same checkpoint when the run starts again.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from typing import Any

import numpy as np

FORMAT = "psring.checkpoint/1"


#: a state_dict's entries of every rank's own arrays, nested in lists and dicts (local SGD's inner
#: optimizer state by rank and bucket, a compressor's error feedback by rank): arrays by path in the file
NESTED = ("inner", "feedback")


def _flatten(value: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` with its arrays moved into ``arrays`` (by path) and a ``{"array": path}`` left in place."""
    if isinstance(value, np.ndarray):
        arrays[path] = value
        return {"array": path}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{path}/{i}", arrays) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _flatten(v, f"{path}/{k}", arrays) for k, v in value.items()}
    return value


def _unflatten(value: Any, data: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"array"}:
        return data[value["array"]]
    if isinstance(value, list):
        return [_unflatten(v, data) for v in value]
    if isinstance(value, dict):
        return {k: _unflatten(v, data) for k, v in value.items()}
    return value


def to_bytes(state: dict[str, Any]) -> bytes:
    """One run's checkpoint: ``state["sgd"]`` (a SyncSGD state_dict) and JSON-able extras."""
    sgd = state["sgd"]
    arrays = {f"params/{k}": np.asarray(v) for k, v in sgd["params"].items()}
    for key, by_name in sgd["optimizer_state"].items():
        arrays.update({f"state/{key}/{k}": np.asarray(v) for k, v in by_name.items()})
    tables = sgd.get("tables") or {}  # sparse tables: each one's rows and their optimizer state
    for name, table in tables.items():
        arrays[f"tables/{name}/rows"] = np.asarray(table["rows"])
        arrays.update({f"tables/{name}/state/{k}": np.asarray(v) for k, v in table["state"].items()})
    nested = {key: _flatten(sgd[key], f"nested/{key}", arrays) for key in NESTED if key in sgd}
    meta = {
        "format": FORMAT,
        "sgd": {k: v for k, v in sgd.items() if k not in ("params", "optimizer_state", "tables", *NESTED)},
        "nested": nested,
        "state_keys": sorted(sgd["optimizer_state"]),
        "tables": {name: sorted(table["state"]) for name, table in tables.items()},
        "extra": {k: v for k, v in state.items() if k != "sgd"},
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays, **{"meta.json": np.array(json.dumps(meta, default=str))})  # type: ignore[arg-type]
    return buf.getvalue()


def from_bytes(raw: bytes) -> dict[str, Any]:
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        meta = json.loads(str(data["meta.json"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a psring checkpoint (format {meta.get('format')!r})")
        params = {name[len("params/") :]: data[name] for name in data.files if name.startswith("params/")}
        state: dict[str, dict[str, np.ndarray]] = {k: {} for k in meta["state_keys"]}
        for name in data.files:
            if name.startswith("state/"):
                _, key, param = name.split("/", 2)
                state[key][param] = data[name]
        tables = {
            name: {"rows": data[f"tables/{name}/rows"], "state": {k: data[f"tables/{name}/state/{k}"] for k in keys}}
            for name, keys in meta.get("tables", {}).items()
        }
        nested = {key: _unflatten(skeleton, data) for key, skeleton in meta.get("nested", {}).items()}
    sgd = {**meta["sgd"], **nested, "params": params, "optimizer_state": state}
    if tables:
        sgd["tables"] = tables
    return {"sgd": sgd, **meta["extra"]}


class DirCheckpoints:
    """``DIR/checkpoint.npz``, replaced atomically; the step is inside."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "checkpoint.npz")

    def _write(self, raw: bytes) -> None:
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    async def save(self, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self._write, to_bytes(state))

    async def load(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as fh:
                return from_bytes(fh.read())
        except FileNotFoundError:
            return None

    def __repr__(self) -> str:
        return f"DirCheckpoints({self.directory!r})"


class StoreCheckpoints:
    """A key in the rendezvous store (psring's, or any client with ``get``/``set``)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store = store
        self.key = key

    async def save(self, state: dict[str, Any]) -> None:
        await self.store.set(self.key, to_bytes(state))

    async def load(self) -> dict[str, Any] | None:
        raw = await self.store.get(self.key)
        return from_bytes(raw) if raw is not None else None

    def __repr__(self) -> str:
        return f"StoreCheckpoints({self.key!r})"


__all__ = ["DirCheckpoints", "StoreCheckpoints", "from_bytes", "to_bytes"]
