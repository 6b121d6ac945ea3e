"""Wire frames: a msgpack header map followed by exactly ``nbytes`` raw payload bytes.

Pure functions and one streaming decoder; nothing here sees a socket. The payload
is never packed into msgpack: encoding returns the header bytes and a memoryview of
the array (no copy), and the decoder stops at the end of the header so the caller
can read the payload straight into its destination buffer.

Every header field is validated before a payload byte is read: the message kind,
the dtype (one of :data:`psring.core.arrays.DTYPES`), the shape (``prod(shape) *
itemsize == nbytes``) and ``nbytes`` against the frame limit (``PSRING_MAX_FRAME``,
default 2 GiB). Arrays travel little-endian, in C order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..errors import ProtocolError
from ..settings import Settings
from .arrays import DTYPES, byte_view, dtype_name, prod

#: bump when the frame layout or the meaning of a field changes (3: a call descriptor's sixth field,
#: ``after``, names the call before it where that one was partial -- topology.collective.after_of;
#: 4: ``ps_link``, a worker's probe of its link to a shard and its word on the send buffer)
WIRE_VERSION = 4

#: every message kind a frame may carry
KINDS = frozenset(
    {
        # connection layer
        "hello",
        "challenge",
        "auth",
        "welcome",
        "reject",
        "ping",
        "bye",
        "pool",
        "free",
        # group layer
        "data",
        "abort",
        "stall",
        # store
        "store_req",
        "store_resp",
        # parameter server
        "ps_req",
        "ps_param",
        "ps_data",
        "ps_link",
    }
)

DEFAULT_MAX_FRAME = 2 << 30
DEFAULT_MAX_HEADER = 64 << 10
MAX_NDIM = 32


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every incoming frame."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_header: int = DEFAULT_MAX_HEADER

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        if settings.max_frame < 1:
            raise ValueError(f"PSRING_MAX_FRAME={settings.max_frame} must be positive")
        return cls(max_frame=settings.max_frame)


def encode_header(header: dict[str, Any]) -> bytes:
    """Pack a header map. Fields must be msgpack-native (str, int, float, bytes, lists)."""
    return msgpack.packb(header, use_bin_type=True)


def tensor_fields(x: np.ndarray) -> dict[str, Any]:
    """The dtype/shape/nbytes fields describing a C-contiguous host array."""
    return {"dtype": dtype_name(x.dtype), "shape": list(x.shape), "nbytes": x.nbytes}


def encode_tensor(header: dict[str, Any], x: np.ndarray) -> tuple[bytes, memoryview]:
    """Header bytes plus a zero-copy payload view of ``x`` (made C-contiguous if it was not)."""
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    header = {**header, **tensor_fields(x)}
    return encode_header(header), byte_view(x)


def decode_tensor(header: dict[str, Any], payload: Any) -> np.ndarray:
    """View a received payload buffer as the array its (validated) header describes."""
    dtype = DTYPES[header["dtype"]]
    buf = np.frombuffer(payload, dtype=np.uint8, count=header["nbytes"])
    return buf.view(dtype).reshape(header["shape"])


def _fail(field: str, value: Any, expected: str) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"frame header field {field!r} is {shown}, expected {expected}")


def validate_header(obj: Any, limits: Limits) -> dict[str, Any]:
    """Check a decoded header; return it, or raise ProtocolError naming the bad field."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame header is a msgpack {type(obj).__name__}, expected a map")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise _fail("kind", kind, "a known message kind")
    nbytes = obj.get("nbytes", 0)
    if type(nbytes) is not int or nbytes < 0:
        raise _fail("nbytes", nbytes, "a non-negative integer")
    if nbytes > limits.max_frame:
        raise ProtocolError(
            f"frame header field 'nbytes' is {nbytes}, over the frame limit of "
            f"{limits.max_frame} bytes (raise PSRING_MAX_FRAME to allow it)"
        )
    dtype = obj.get("dtype")
    shape = obj.get("shape")
    if dtype is not None:
        if dtype not in DTYPES:
            raise _fail("dtype", dtype, "one of " + ", ".join(DTYPES))
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
            raise _fail("shape", shape, f"a list of at most {MAX_NDIM} sizes")
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise _fail("shape", shape, "non-negative integer sizes")
        expected = prod(tuple(shape)) * DTYPES[dtype].itemsize
        if expected != nbytes:
            raise ProtocolError(
                f"frame header field 'nbytes' is {nbytes}, but shape {list(shape)} of {dtype} needs {expected} bytes"
            )
    elif shape is not None:
        raise _fail("dtype", dtype, "a dtype name when 'shape' is given")
    obj.setdefault("nbytes", nbytes)
    return obj


class HeaderDecoder:
    """Streaming decoder for one header at a time, bounded to header-sized input.

    ``feed(data)`` consumes bytes of ``data`` up to the end of a header and returns
    ``(header, used)``: ``header`` is the validated map once complete (else None) and
    ``used`` is how many bytes of ``data`` it consumed. Bytes after the header (the
    payload) are left for the caller.
    """

    __slots__ = ("_fed", "_limits", "_origin", "_unpacker")

    def __init__(self, limits: Limits | None = None) -> None:
        self._limits = limits or Limits()
        # made when bytes come (an Unpacker weighs ~44 KiB: idle connections hold none), then
        # kept: making one per frame cost more than decoding a small message's header
        self._unpacker: msgpack.Unpacker | None = None
        self._fed = 0  # bytes of the current header fed so far
        self._origin = 0  # the unpacker's position where the current header starts

    def _new_unpacker(self) -> msgpack.Unpacker:
        cap = self._limits.max_header
        return msgpack.Unpacker(
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_buffer_size=cap,
            max_str_len=cap,
            max_bin_len=cap,
            max_array_len=4096,
            max_map_len=64,
            max_ext_len=0,
        )

    @property
    def pending(self) -> int:
        """Bytes of an incomplete header held so far."""
        return self._fed

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[dict[str, Any] | None, int]:
        # Feed small pieces first: a header is ~100 bytes, and the bytes after it are
        # payload that should not be copied through the unpacker's buffer.
        used = 0
        step = 256
        total = len(data)
        unpacker = self._unpacker
        if unpacker is None:
            unpacker = self._unpacker = self._new_unpacker()
            self._origin = 0
        fed_before = self._fed
        while True:
            room = self._limits.max_header - self._fed
            take = min(step, room, total - used)
            if take > 0:
                unpacker.feed(data[used : used + take])
                self._fed += take
                used += take
            try:
                obj = unpacker.unpack()
            except msgpack.OutOfData:
                if self._fed >= self._limits.max_header:
                    raise ProtocolError(
                        f"frame header is longer than the {self._limits.max_header}-byte limit"
                    ) from None
                if used >= total:
                    return None, used
                step *= 4
                continue
            except Exception as exc:  # FormatError, StackError, ValueError on a limit, ...
                self._unpacker = None  # its state is unknown now
                raise ProtocolError(f"frame header is not valid msgpack: {exc}") from exc
            header_len = unpacker.tell() - self._origin
            extra = self._fed - header_len  # payload bytes fed along: hand them back
            if extra:
                unpacker.read_bytes(extra)
            self._fed = 0
            self._origin = unpacker.tell()
            return validate_header(obj, self._limits), header_len - fed_before


def decode_header(head: bytes, limits: Limits | None = None) -> dict[str, Any]:
    """Decode and validate exactly one header held whole in memory."""
    try:
        obj = msgpack.unpackb(head, raw=False, use_list=False, strict_map_key=True)
    except Exception as exc:  # a peer's bytes: msgpack raises many kinds
        raise ProtocolError(f"frame header is not valid msgpack: {exc}") from exc
    return validate_header(obj, limits or Limits())


def decode_frame(data: bytes, limits: Limits | None = None) -> tuple[dict[str, Any], bytes]:
    """Decode one whole frame held in memory (tests and tools; not the data path)."""
    decoder = HeaderDecoder(limits)
    header, used = decoder.feed(data)
    if header is None:
        raise ProtocolError(f"truncated frame: header incomplete after {len(data)} bytes")
    payload = data[used : used + header["nbytes"]]
    if len(payload) != header["nbytes"]:
        raise ProtocolError(f"truncated frame: header says nbytes={header['nbytes']}, {len(payload)} bytes follow")
    return header, payload


# ----------------------------------------------------------------- messages
#: a message is one frame held whole in one datagram-like unit (psring.transport.unixmesh): a 2-byte
#: header length, a msgpack array header (gid, seq, phase, call), then the payload bytes.
#: The payload's size is the message's rest; the receiver checks it against the call
#: descriptor (kind, dtype, shape, op, root, after) it expects, which names dtype and shape.
MESSAGE_MAX_HEADER = 4096


def message_header(head: tuple[Any, ...]) -> bytes:
    """A message's first bytes: the header's length and the msgpack header (the payload follows)."""
    packed = msgpack.packb(head, use_bin_type=True)
    if len(packed) > MESSAGE_MAX_HEADER:
        raise ProtocolError(f"message header of {len(packed)} bytes is over the {MESSAGE_MAX_HEADER}-byte limit")
    return len(packed).to_bytes(2, "little") + packed


def header_maker(gid: str, phase: int, call: tuple[Any, ...]) -> Callable[[int], bytes]:
    """``message_header((gid, seq, phase, call))`` as a function of ``seq`` alone, for a call made many
    times: the same bytes, with only ``seq`` packed each time."""
    pre = b"\x94" + msgpack.packb(gid, use_bin_type=True)  # an array of 4, and its first item
    post = msgpack.packb(phase) + msgpack.packb(call, use_bin_type=True)
    if len(pre) + 9 + len(post) > MESSAGE_MAX_HEADER:  # (a seq packs to 9 bytes at most)
        message_header((gid, 1 << 63, phase, call))  # the error it raises
    packb = msgpack.packb

    def make(seq: int) -> bytes:
        body = b"".join((pre, packb(seq), post))
        return len(body).to_bytes(2, "little") + body

    return make


def encode_message(head: tuple[Any, ...], payload: Any = None) -> bytes:
    """One message: header length, msgpack header, payload (one copy of the payload)."""
    header = message_header(head)
    return header if payload is None else b"".join((header, payload))


def decode_message(msg: memoryview) -> tuple[tuple[str, int, int, tuple[Any, ...]], memoryview]:
    """Split and validate a message: ((gid, seq, phase, call), payload view into msg)."""
    if len(msg) < 2:
        raise ProtocolError(f"message of {len(msg)} bytes is shorter than its 2-byte header length")
    hlen = msg[0] | (msg[1] << 8)
    if hlen > MESSAGE_MAX_HEADER or 2 + hlen > len(msg):
        raise ProtocolError(f"message header length {hlen} does not fit a {len(msg)}-byte message")
    try:
        head = msgpack.unpackb(msg[2 : 2 + hlen], raw=False, use_list=False, strict_map_key=True)
    except Exception as exc:  # a peer's bytes: msgpack raises many kinds
        raise ProtocolError(f"message header is not valid msgpack: {exc}") from exc
    if not (
        type(head) is tuple
        and len(head) == 4
        and type(head[0]) is str
        and type(head[1]) is int
        and head[1] >= 0
        and type(head[2]) is int
        and type(head[3]) is tuple
        and len(head[3]) == 6
    ):
        raise ProtocolError(f"message header {str(head)[:80]} is not (gid, seq, phase, call descriptor)")
    return head, msg[2 + hlen :]
