"""The store's memory on disk (``psring store --data-dir D``): a snapshot plus an fsync'd log.

Why this shape: the store's state is small (job records, specs, attempts, checkpoints kept in the
store) and written a few times a second, so every change is appended to ``D/log`` and fsync'd
before the store answers (concurrent writers share one fsync: group commit); a restart loads
``D/snapshot`` and replays the log over it. When the log outgrows the snapshot it is compacted:
the whole state is written to ``snapshot.tmp``, fsync'd, renamed over ``snapshot`` (atomic) and the
log is emptied; changes wait meanwhile (reads do not), so the snapshot holds exactly what the log
held. Replaying a log over a snapshot that already holds its effects gives the same
state (each record sets or deletes one key), so a crash between the rename and the truncation
loses nothing. A torn last record (a crash mid-append) fails its checksum and is cut off: it was
never acknowledged.

Record: 4-byte length, 4-byte CRC-32 of the body, then the body, msgpack ``[key, value | None,
token | None, response | None]`` (``None`` value: deleted). The token and the response let a
client that retries a request after a lost connection get the first answer, even across a
restart. ``D/lock`` is held (flock) while a store uses the directory: two stores on one data dir
are refused. ``D/epoch`` counts the store's starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from typing import Any

import msgpack

from ..errors import StoreDiskError

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
#: the log is compacted once it is this large and larger than the snapshot (the default; --compact-bytes)
COMPACT_MIN_BYTES = 16 << 20
#: request tokens remembered (and their answers) for retried requests
TOKENS_KEPT = 100_000
#: bytes a probe of a data dir that refused a write writes (StoreLog.probe): a record's worth and more
PROBE_BYTES = 64 << 10
#: seconds between tries to compact after the disk refused a snapshot
COMPACT_RETRY_S = 10.0


class DiskError(StoreDiskError):
    """The store's data dir refused a write: the change was not made (the store answers with this)."""

    def __init__(self, path: str, exc: OSError) -> None:
        what = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        super().__init__(
            f"the store cannot write its data dir: {exc.strerror or exc} ({what}) on {path}; the change was not "
            "made (the store goes on once the disk takes writes again)"
        )
        self.path = path
        self.errno = exc.errno
        self.reason = f"{exc.strerror or exc} ({what}) on {path}"

    def since(self) -> StoreDiskError:
        """What a request after the refused change is told while the disk still refuses writes."""
        return StoreDiskError(
            f"the store cannot write its data dir: {self.reason}; it answers no request until the disk takes "
            "writes again"
        )


class StoreLog:
    """A data directory: load what it holds, then append every change durably."""

    def __init__(self, directory: str, compact_bytes: int = COMPACT_MIN_BYTES) -> None:
        """``compact_bytes``: the log is compacted once it is this large (and larger than the snapshot)."""
        if type(compact_bytes) is not int or compact_bytes < 1:
            raise ValueError(f"compact_bytes={compact_bytes!r} must be a positive whole number of bytes")
        self.compact_bytes = compact_bytes
        self.directory = os.path.abspath(directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ValueError(f"--data-dir {directory}: cannot use it ({exc.strerror})") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ValueError(f"--data-dir {directory}: another psring store is using it") from None
        if not os.access(self.directory, os.W_OK):
            self._release()
            raise ValueError(f"--data-dir {directory}: not writable")
        self._log_path = os.path.join(self.directory, "log")
        self._snapshot_path = os.path.join(self.directory, "snapshot")
        self.epoch = self._next_epoch()
        self._fd = -1
        # positions in the stream of every byte ever appended (never reset: a writer waiting for its
        # record to reach the disk compares against them across a compaction); the log file holds
        # the bytes from _base on
        self.written = 0  # appended
        self.synced = 0  # known to be on disk
        self._base = 0  # where the log file starts (the last compaction's `written`)
        self.snapshot_bytes = 0
        self._flushing: asyncio.Task[None] | None = None
        self._compacted = asyncio.Event()  # set while no compaction runs: changes wait on it
        self._compacted.set()
        self._compact_after = 0.0  # (after a compaction the disk refused: not before then)

    # ------------------------------------------------------------------ load
    def _next_epoch(self) -> int:
        path = os.path.join(self.directory, "epoch")
        try:
            with open(path) as fh:
                epoch = int(fh.read().strip() or 0) + 1
        except (OSError, ValueError):
            epoch = 1
        _write_atomically(path, str(epoch).encode(), self.directory)
        return epoch

    def load(self) -> tuple[dict[str, bytes], OrderedDict[str, Any]]:
        """The keys and the remembered request tokens the directory holds; opens the log to append."""
        data: dict[str, bytes] = {}
        tokens: OrderedDict[str, Any] = OrderedDict()
        try:
            with open(self._snapshot_path, "rb") as fh:
                raw = fh.read()
            snap = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            data = {str(k): bytes(v) for k, v in snap["data"].items()}
            for token, response in snap.get("tokens", []):
                tokens[token] = response
            self.snapshot_bytes = len(raw)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"--data-dir {self.directory}: the snapshot cannot be read ({exc})") from None
        good, records = self._replay(data, tokens)
        self._fd = os.open(self._log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if os.fstat(self._fd).st_size > good:  # a torn tail: never acknowledged, cut it off
            logger.warning("store: cutting a torn record off the end of %s (%d bytes kept)", self._log_path, good)
            os.ftruncate(self._fd, good)
            os.fsync(self._fd)
        self.written = self.synced = good
        logger.info(
            "store: loaded %d keys from %s (snapshot + %d logged changes), epoch %d",
            len(data), self.directory, records, self.epoch,
        )  # fmt: skip
        return data, tokens

    def _replay(self, data: dict[str, bytes], tokens: OrderedDict[str, Any]) -> tuple[int, int]:
        try:
            with open(self._log_path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return 0, 0
        pos = records = 0
        while pos + _HEAD.size <= len(raw):
            size, crc = _HEAD.unpack_from(raw, pos)
            body = raw[pos + _HEAD.size : pos + _HEAD.size + size]
            if len(body) != size or zlib.crc32(body) != crc:
                break
            try:
                key, value, token, response = msgpack.unpackb(body, raw=False)
            except (ValueError, TypeError, msgpack.UnpackException):
                break
            if value is None:
                data.pop(key, None)
            else:
                data[key] = bytes(value)
            if token is not None:
                _remember(tokens, token, response)
            pos += _HEAD.size + size
            records += 1
        return pos, records

    # ------------------------------------------------------------------ write
    def append(self, key: str, value: bytes | None, token: str | None, response: Any) -> None:
        """Append one change (``value`` None: the key was deleted); durable after :meth:`sync`.

        A write the disk refuses (ENOSPC, EIO) raises :class:`DiskError` and leaves nothing of the
        record in the log: what it wrote of it is cut off, so a later append (the disk has room again)
        follows the last whole record, and a restart replays everything acknowledged."""
        body = msgpack.packb([key, value, token, response], use_bin_type=True)
        record = _HEAD.pack(len(body), zlib.crc32(body)) + body
        view = memoryview(record)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.written - self._base)  # (the log opens O_APPEND: the next write follows)
            raise DiskError(self._log_path, exc) from None
        self.written += len(record)

    def probe(self) -> bool:
        """Whether the directory takes a write now: a block written, synced and removed."""
        path = os.path.join(self.directory, "probe")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def sync(self) -> None:
        """Return once everything appended so far is on disk (one fsync for every waiting writer)."""
        target = self.written
        while self.synced < target:
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.ensure_future(self._flush())
            await asyncio.shield(self._flushing)

    async def _flush(self) -> None:
        upto = self.written
        try:
            await asyncio.to_thread(os.fsync, self._fd)
        except OSError as exc:
            # what was written since the last good fsync may or may not be on disk: cut it off, and
            # every writer waiting on this fsync answers with the error (none of their changes stand)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.synced - self._base)
            self.written = self.synced
            raise DiskError(self._log_path, exc) from None
        self.synced = max(self.synced, upto)

    def wants_compaction(self) -> bool:
        return (
            self._compacted.is_set()
            and time.monotonic() >= self._compact_after
            and self.written - self._base > max(self.compact_bytes, self.snapshot_bytes)
        )

    async def writable(self) -> None:
        """Return when a change may be made and appended: not while a compaction runs. A change made
        meanwhile would be in neither the snapshot being written nor, once the log is emptied after
        it, the log (lost at the next restart). The store calls it before it changes its memory, and
        appends with no await in between."""
        while not self._compacted.is_set():
            await self._compacted.wait()

    async def compact(self, data: dict[str, bytes], tokens: OrderedDict[str, Any]) -> None:
        """Write the whole state as the new snapshot and empty the log. No change is made meanwhile
        (:meth:`writable` holds them): the snapshot is of every change appended, each on disk first,
        and the log is emptied of exactly those. A disk that refuses the snapshot leaves the log as it
        is (it still holds everything) and compaction waits for room."""
        self._compacted.clear()
        try:
            try:
                await self.sync()  # the snapshot must not be older than anything acknowledged
            except DiskError:  # the writers it failed were told so; nothing to compact now
                self._compact_after = time.monotonic() + COMPACT_RETRY_S
                return
            snap = msgpack.packb({"data": data, "tokens": list(tokens.items())}, use_bin_type=True)
            try:
                await asyncio.to_thread(_write_atomically, self._snapshot_path, snap, self.directory)
            except OSError as exc:  # the log still holds everything: compaction waits for room
                with contextlib.suppress(OSError):
                    os.unlink(self._snapshot_path + ".tmp")
                self._compact_after = time.monotonic() + COMPACT_RETRY_S
                logger.warning("store: cannot compact %s (%s); the log keeps every change", self.directory, exc)
                return
            self.snapshot_bytes = len(snap)
            try:
                os.ftruncate(self._fd, 0)
                self._base = self.written
                await asyncio.to_thread(os.fsync, self._fd)
            except OSError as exc:  # (replaying the log over a snapshot that holds its effects is harmless)
                logger.warning("store: compacted %s but its log was not emptied (%s)", self.directory, exc)
            logger.info("store: compacted %s (%d keys, %d bytes)", self.directory, len(data), len(snap))
        finally:
            self._compacted.set()

    def _release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._release()


def _remember(tokens: OrderedDict[str, Any], token: str, response: Any) -> None:
    tokens[token] = response
    tokens.move_to_end(token)
    while len(tokens) > TOKENS_KEPT:
        tokens.popitem(last=False)


def _write_atomically(path: str, content: bytes, directory: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(content)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["StoreLog"]
