"""Frame codec: round trips, split points, and every kind of bad header."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psring import ProtocolError
from psring import settings as psring_settings
from psring.core import wire
from psring.core.arrays import DTYPES

DTYPE_NAMES = sorted(DTYPES)


def frame_bytes(header: dict, x: np.ndarray) -> bytes:
    head, payload = wire.encode_tensor(header, x)
    return head + bytes(payload)


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * DTYPES[dtype].itemsize, dtype=np.uint8)
    return raw.view(DTYPES[dtype]).reshape(shape)


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@given(dtype=st.sampled_from(DTYPE_NAMES), shape=shapes, seed=st.integers(0, 2**16))
@settings(max_examples=200, deadline=None)
def test_round_trip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...], seed: int) -> None:
    x = random_array(dtype, shape, seed)
    header, payload = wire.decode_frame(frame_bytes({"kind": "data", "tag": (0, 1)}, x))
    y = wire.decode_tensor(header, payload)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == x.tobytes()


def test_zero_d_and_empty() -> None:
    for x in (np.array(3.5, np.float64), np.empty((0, 4), np.int16), np.empty((0,), bool)):
        header, payload = wire.decode_frame(frame_bytes({"kind": "data"}, x))
        y = wire.decode_tensor(header, payload)
        assert y.shape == x.shape and y.dtype == x.dtype and np.array_equal(y, x)


def test_large_shape_header_only() -> None:
    # a header describing 1 GiB validates without any payload present
    head = wire.encode_header({"kind": "data", "dtype": "float32", "shape": [1 << 28], "nbytes": 1 << 30})
    header, used = wire.HeaderDecoder().feed(head + b"xyz")
    assert header is not None and header["nbytes"] == 1 << 30 and used == len(head)


def test_non_contiguous_input_is_made_contiguous_without_touching_input() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2]
    header, payload = wire.decode_frame(frame_bytes({"kind": "data"}, view))
    assert np.array_equal(wire.decode_tensor(header, payload), view)
    assert np.array_equal(base, np.arange(24, dtype=np.float32).reshape(4, 6))


def test_encode_does_not_copy_payload() -> None:
    x = np.arange(1000, dtype=np.float64)
    _head, payload = wire.encode_tensor({"kind": "data"}, x)
    assert np.shares_memory(np.frombuffer(payload, np.uint8), x)


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_decoder_waits_then_yields_at_every_split(data: st.DataObject) -> None:
    x = random_array("float32", (5,), 1)
    raw = frame_bytes({"kind": "data", "tag": ("g", 3, 0)}, x)
    head_len = len(wire.encode_header({**{"kind": "data", "tag": ("g", 3, 0)}, **wire.tensor_fields(x)}))
    cuts = sorted(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=8)))
    decoder = wire.HeaderDecoder()
    pos = 0
    header = None
    for end in [*cuts, len(raw)]:
        if end <= pos:
            continue
        chunk = raw[pos:end]
        got, used = decoder.feed(chunk)
        if got is not None:
            header = got
            assert pos + used == head_len
            break
        assert used == len(chunk)
        pos = end
    assert header is not None and header["shape"] == (5,)


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_one_decoder_reads_a_stream_of_frames_at_any_split(data: st.DataObject) -> None:
    """A connection keeps one decoder (and its unpacker) for every frame: the payload bytes
    fed along with a header must never leak into the next header."""
    frames = []
    for i in range(data.draw(st.integers(2, 6))):
        n = data.draw(st.integers(0, 600))
        frames.append(({"kind": "data", "tag": ("g", i, 0), "pad": "x" * (i * 97 % 300)}, np.full(n, i, np.uint8)))
    raw = b"".join(frame_bytes(h, x) for h, x in frames)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=12))))
    decoder = wire.HeaderDecoder()
    got: list[tuple[dict, bytes]] = []
    buf = b""
    need = None  # payload bytes still owed by the last header
    for chunk in (raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)):
        buf += chunk
        while buf:
            if need is None:
                header, used = decoder.feed(buf)
                buf = buf[used:]
                if header is None:
                    assert not buf
                    break
                need = header
                continue
            if len(buf) < need["nbytes"]:
                break
            got.append((need, buf[: need["nbytes"]]))
            buf, need = buf[need["nbytes"] :], None
        if need is not None and need["nbytes"] == 0:
            got.append((need, b""))
            need = None
    if need is not None and need["nbytes"] == 0:
        got.append((need, b""))
    assert [(h["tag"], p) for h, p in got] == [(h["tag"], x.tobytes()) for h, x in frames]


def test_one_byte_at_a_time() -> None:
    raw = frame_bytes({"kind": "data"}, np.arange(3, dtype=np.int8))
    decoder = wire.HeaderDecoder()
    for i in range(len(raw)):
        header, used = decoder.feed(raw[i : i + 1])
        if header is not None:
            assert used == 1 and header["nbytes"] == 3
            assert i == len(raw) - 4
            return
    pytest.fail("header never completed")


@pytest.mark.parametrize(
    "header, pattern",
    [
        ({"kind": "nonsense"}, r"^frame header field 'kind' is 'nonsense'"),
        ({"kind": "data", "dtype": "complex64", "shape": [1], "nbytes": 8}, r"field 'dtype' is 'complex64'"),
        ({"kind": "data", "dtype": "float32", "shape": [3], "nbytes": 8}, r"shape \[3\] of float32 needs 12 bytes"),
        ({"kind": "data", "dtype": "float32", "shape": [-1], "nbytes": 0}, r"field 'shape'"),
        ({"kind": "data", "nbytes": -5}, r"field 'nbytes' is -5"),
        ({"kind": "data", "nbytes": 3 << 30}, r"over the frame limit of 2147483648 bytes"),
        ({"kind": "data", "shape": [2]}, r"field 'dtype' is None"),
    ],
)
def test_bad_headers_name_the_field(header: dict, pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        wire.HeaderDecoder().feed(msgpack.packb(header))


def test_not_a_map() -> None:
    with pytest.raises(ProtocolError, match=r"^frame header is a msgpack int, expected a map$"):
        wire.HeaderDecoder().feed(b"GET / HTTP/1.1\r\n")


@given(garbage=st.binary(min_size=1, max_size=300))
@settings(max_examples=300, deadline=None)
def test_garbage_never_crashes(garbage: bytes) -> None:
    decoder = wire.HeaderDecoder()
    try:
        decoder.feed(garbage)
    except ProtocolError:
        pass


def test_oversized_header_is_refused() -> None:
    limits = wire.Limits(max_header=1024)
    big = msgpack.packb({"kind": "data", "pad": "x" * 5000})
    decoder = wire.HeaderDecoder(limits)
    with pytest.raises(ProtocolError, match="longer than the 1024-byte limit"):
        decoder.feed(big)


def test_truncated_frame() -> None:
    raw = frame_bytes({"kind": "data"}, np.arange(10, dtype=np.int32))
    with pytest.raises(ProtocolError, match="truncated frame"):
        wire.decode_frame(raw[:-3])
    with pytest.raises(ProtocolError, match="header incomplete"):
        wire.decode_frame(raw[:5])


def test_frame_limit_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSRING_MAX_FRAME", "100")
    limits = wire.Limits.from_settings(psring_settings.current())
    with pytest.raises(ProtocolError, match="over the frame limit of 100 bytes"):
        wire.HeaderDecoder(limits).feed(msgpack.packb({"kind": "data", "nbytes": 101}))
    monkeypatch.setenv("PSRING_MAX_FRAME", "lots")
    with pytest.raises(ValueError, match="PSRING_MAX_FRAME='lots': expected a whole number of bytes"):
        psring_settings.current()
    monkeypatch.setenv("PSRING_MAX_FRAME", "0")
    with pytest.raises(ValueError, match="PSRING_MAX_FRAME=0 must be positive"):
        wire.Limits.from_settings(psring_settings.current())


def test_message_header_is_validated() -> None:
    msg = wire.encode_message(("0", 3, 1, ("all_reduce", "float32", (2,), "sum", None, None)), b"12345678")
    head, payload = wire.decode_message(memoryview(msg))
    assert head == ("0", 3, 1, ("all_reduce", "float32", (2,), "sum", None, None)) and bytes(payload) == b"12345678"
    for bad in (b"", b"\x01", b"\xff\x0fxx", b"\x03\x00\xc1\xc1\xc1", b"\x02\x00\x92\x01"):
        with pytest.raises(ProtocolError):
            wire.decode_message(memoryview(bad))
    packed = msgpack.packb(("0", -1, 0, ("barrier", None, None, None, None, None)))
    with pytest.raises(ProtocolError, match="gid, seq, phase"):
        wire.decode_message(memoryview(len(packed).to_bytes(2, "little") + packed))


def test_header_maker_gives_message_headers_bytes_for_every_seq() -> None:
    call = ("all_reduce", "float32", (3, 4), "sum", None, None)
    make = wire.header_maker("0", 2, call)
    for seq in (0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1):
        assert make(seq) == wire.message_header(("0", seq, 2, call)), seq
    assert wire.decode_message(memoryview(make(300)))[0] == ("0", 300, 2, call)
    with pytest.raises(ProtocolError, match="over the"):
        wire.header_maker("0", 2, ("all_reduce", "x" * 5000, (), "sum", None, None))
