"""A connection's receive path: headers parsed from a staging buffer, a large payload read straight into
its destination (the buffer the router posted for it, else a fresh one), frames handed to the connection.

uvloop reads into the buffer :meth:`FrameReader.get_buffer` hands out (``asyncio.BufferedProtocol``): a
small one until the peer has proved itself (a flood of connections costs little), the full one after.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..core import wire
from ..errors import ProtocolError
from .slots import SharedMemory

#: payloads at least this large (still to read) are read straight into their destination
DIRECT_READ_MIN = 32 << 10
HANDSHAKE_STAGING_SIZE = 4 << 10
#: bytes each connection reads at a time once the peer has proved itself
STAGING_SIZE = 256 << 10


class Reading(Protocol):
    """What the receive path needs of its connection."""

    router: Any
    shm: SharedMemory

    @property
    def handshaking(self) -> bool: ...

    def transport_gone(self) -> bool: ...

    def frame(self, header: dict[str, Any], payload: Any, slot: int | None) -> None: ...

    def abort(self, exc: BaseException) -> None: ...

    def resume_reading(self) -> None: ...


class FrameReader:
    """The frames of one connection's byte stream (``conn.reader``; see the module's docstring)."""

    def __init__(self, conn: Reading, limits: wire.Limits) -> None:
        self.conn = conn
        self._decoder = wire.HeaderDecoder(limits)
        self._staging = bytearray(HANDSHAKE_STAGING_SIZE)
        self._stage = memoryview(self._staging)
        self._start = 0
        self._end = 0
        # the payload being read
        self._header: dict[str, Any] | None = None
        self._dest: memoryview | None = None
        self._dest_obj: Any = None
        self._dest_off = 0
        self._direct = False
        self._pool_slot: int | None = None  # the peer's slot holding the payload just parsed
        #: welcomed, but the handshake coroutine has not run yet: what follows waits unparsed
        self.held = False
        self.replaying = False  # parsing what was held, from the handshake's end

    @property
    def mid_stream(self) -> bool:
        """Whether bytes were read that are not parsed yet, or a payload is half read."""
        return self._end != self._start or self._header is not None

    def get_buffer(self, sizehint: int) -> memoryview:
        dest = self._dest
        if dest is not None and self._start == self._end:
            remaining = len(dest) - self._dest_off
            if remaining >= DIRECT_READ_MIN:
                self._direct = True
                return dest[self._dest_off :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < 4096:
            # compact: move the unparsed tail to the front
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start : self._end]
            self._start, self._end = 0, n
        return self._stage[self._end :]

    def updated(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer get_buffer handed out: parse on (frames go to the connection)."""
        if self._direct:
            self._direct = False
            self._dest_off += nbytes
            if self._dest is not None and self._dest_off == len(self._dest):
                self._finish()
            return
        self._end += nbytes
        self._process()

    def use_full_staging(self) -> None:
        """After the handshake: move the bytes already read past it into the full-size receive buffer."""
        n = self._end - self._start
        staging = bytearray(STAGING_SIZE)
        staging[:n] = self._stage[self._start : self._end]
        self._staging, self._stage = staging, memoryview(staging)
        self._start, self._end = 0, n

    def replay(self) -> None:
        """After the handshake: parse, in order, the frames the peer sent right after its welcome (held
        back until now), and read on. A refusal or a bad frame among them ends the connection (and the dial)."""
        if not self.held:
            return
        self.held, self.replaying = False, True
        try:
            self._process()
        except Exception as exc:
            self.conn.abort(exc)
            raise
        finally:
            self.replaying = False
        self.conn.resume_reading()

    def _process(self) -> None:
        stage = self._stage
        while self._start < self._end and not self.held:
            if self._dest is None:
                header, used = self._decoder.feed(stage[self._start : self._end])
                self._start += used
                if header is None:
                    break
                self._begin(header)
            else:
                take = min(self._end - self._start, len(self._dest) - self._dest_off)
                self._dest[self._dest_off : self._dest_off + take] = stage[self._start : self._start + take]
                self._dest_off += take
                self._start += take
                if self._dest_off == len(self._dest):
                    self._finish()
            if self.conn.transport_gone():
                return
        if self._start == self._end:
            self._start = self._end = 0

    def _begin(self, header: dict[str, Any]) -> None:
        nbytes = header["nbytes"]
        if nbytes and self.conn.handshaking:
            # nothing is allocated for a party that has not proved itself yet
            kind = header["kind"]
            raise ProtocolError(f"a {kind!r} frame with a {nbytes}-byte payload before the handshake completed")
        self._header = header
        if "pool" in header:  # the payload is in a slot of the peer's pool, not on the socket
            self._dest_obj = self.conn.shm.payload_in(header, nbytes)
            self._pool_slot = header["pool"]
            self._finish()
            return
        dest: memoryview | None = None
        if (
            nbytes
            and not self.conn.handshaking
            and self.conn.router is not None
            and header["kind"] not in ("ping", "bye")
        ):
            dest = self.conn.router.buffer_for(self.conn, header)
            if dest is not None and len(dest) != nbytes:
                dest = None
        if dest is None:
            obj = np.empty(nbytes, dtype=np.uint8)
            dest = memoryview(obj)  # type: ignore[arg-type]  # numpy arrays are buffers
            self._dest_obj = obj
        else:
            self._dest_obj = dest
        self._dest = dest
        self._dest_off = 0
        if nbytes == 0:
            self._finish()

    def _finish(self) -> None:
        header, payload = self._header, self._dest_obj
        self._header = self._dest = self._dest_obj = None
        self._dest_off = 0
        assert header is not None
        slot, self._pool_slot = self._pool_slot, None
        self.conn.frame(header, payload, slot)
