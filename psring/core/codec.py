"""Codecs: how a float32 all_reduce travels narrower, and how its partial sums are folded.

A :class:`Codec` is what the ring, the parameter server's shards and SyncSGD are handed instead of
a name: its wire dtype, the scale the ranks agree on before a call, how a rank's tensor is encoded
and decoded, and the fold. The codec owns the fold because the same bits on every rank and on both
topologies come from rounding every partial sum where the ring sends it (see
:mod:`psring.core.compress` for fp16's rules): a shard that folds the workers' encoded pieces with
``codec.fold`` gets the ring's result exactly. That is why it is not a wrapper that encodes before
and decodes after an unchanged all_reduce (Horovod's ``Compressor``).

A scaled codec's ranks first max-all_reduce ``codec.amax(x)`` (one number for fp16, one per block of
:data:`INT8_BLOCK` elements for int8) and derive the same scale ``e`` from it everywhere. A call's
descriptor carries the codec and its scale in the op field (``"avg:fp16@12"``; int8's a digest of its
scales), so every frame of the call says how to read its payload and a peer that disagrees fails the
call by name. ``encode``/``decode`` take the ``offset`` of their first element in the whole tensor
(the ring and the shards handle windows of it; int8's scale differs block by block).

A new codec is a subclass here and one entry in :data:`CODECS`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError
from . import compress
from .arrays import BLOCK
from .fold import canonical_fold, ring_chunk_bounds
from .reduceop import OPS

#: the reduce ops a codec carries (sums of what travels; avg divides at the end)
CODED_OPS = ("sum", "avg")


class Codec:
    """One way a float32 all_reduce (op sum or avg) travels; see the module's docstring."""

    #: the name users pass (``compression="fp16"``) and frames carry
    name: str = ""
    #: the dtype of what travels
    wire: np.dtype = np.dtype(np.float32)
    #: whether the ranks agree on a scale before each call (a max all_reduce of ``amax``); a codec
    #: with float32's range (bf16) needs none and always runs at e = 0
    scaled: bool = True
    #: CPU per float32 element on this kind of machine, ns: (encode, decode, amax), measured in one
    #: process on 4M elements (numpy, a 2-core VM); what ``psring advise`` weighs a codec's bytes against
    cpu_ns: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def check(self, dtype: np.dtype, op: str) -> None:
        """Refuse, naming it, an input this codec cannot carry (float32 only; sum or avg)."""
        if dtype != np.float32:
            raise TypeError(f"compression={self.name!r} needs float32 arrays, got {dtype}")
        if op not in CODED_OPS:
            raise ValueError(f"compression={self.name!r} works with op='sum' or op='avg', not op={op!r}")

    def amax(self, x: np.ndarray) -> np.ndarray:
        """What this rank contributes to the scale's agreement (a max over the ranks): its largest |x|."""
        flat = x.reshape(-1)  # a block at a time: no tensor's worth of |x|
        if not flat.size:
            return np.array([0.0], np.float32)
        most = [np.max(np.abs(flat[i : i + CODE_BLOCK])) for i in range(0, flat.size, CODE_BLOCK)]
        return np.array([np.max(most)], np.float32)  # (a NaN anywhere stays the answer)

    def amax_size(self, n: int) -> int:
        """How many float32 values the agreement of an n-element call max-reduces (0: no agreement)."""
        return 1 if self.scaled else 0

    def scale(self, amax: np.ndarray, n_ranks: int) -> Any:
        """The scale every rank uses, from the agreed (max over the ranks) ``amax``."""
        return 0

    def encode(self, x: np.ndarray, e: Any, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        """A rank's float32 contribution as it travels (dtype ``wire``)."""
        raise NotImplementedError

    def decode(self, q: np.ndarray, e: Any, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        """What travelled, back as float32 (exactly: decoding rounds nothing)."""
        raise NotImplementedError

    def fold(
        self,
        parts: Sequence[np.ndarray] | np.ndarray,
        op: str,
        e: Any,
        out: np.ndarray,
        offset: int = 0,
        total: int | None = None,
    ) -> np.ndarray:
        """Fold the ranks' encoded pieces ``parts[0..N-1]`` into ``out`` (encoded) as the ring does;
        the pieces may be a window ``[offset, offset + out.size)`` of a tensor of ``total`` elements.

        Element i of ring chunk c: ``((x'_c + x'_c+1) + ...) + x'_c-1`` in float32 (x' a rank's decoded
        contribution), every partial sum encoded and decoded again where the ring sends it to the next
        rank, the last one divided for avg, then encoded once more: what every rank receives."""
        n_ranks = len(parts)
        lo, hi = offset, offset + out.size
        last = OPS[op]
        for c, (a, b) in enumerate(ring_chunk_bounds(out.size if total is None else total, n_ranks)):
            a, b = max(a, lo) - lo, min(b, hi) - lo
            if a >= b:
                continue
            at = lo + a
            acc = self.decode(parts[c][a:b], e, offset=at)
            for k in range(1, n_ranks):
                np.add(acc, self.decode(parts[(c + k) % n_ranks][a:b], e, offset=at), out=acc)
                if k < n_ranks - 1:
                    self.decode(self.encode(acc, e, offset=at), e, out=acc, offset=at)  # what the next hop gets
            last.finish(acc, n_ranks)
            self.encode(acc, e, out=out[a:b], offset=at)
        return out

    def descriptor(self, op: str, e: Any) -> str:
        """The op field of a call that travels with this codec at scale ``e``."""
        return f"{op}:{self.name}@{e}"

    def parse_scale(self, text: str) -> Any:
        """The scale a descriptor's ``@`` field names; ProtocolError if it is not one."""
        try:
            e = int(text)
        except ValueError:
            e = None
        if e is None or not -compress.MAX_EXP <= e <= compress.MAX_EXP:
            raise ProtocolError(f"scale {text!r} is not a {self.name} scale")
        return e

    def wire_scale(self, e: Any, lo: int, hi: int) -> Any:
        """What a parameter-server push of elements ``[lo, hi)`` carries of the scale (its header's
        ``scale``): the shard decodes the folded gradient with it."""
        return e

    def read_scale(self, value: Any) -> Any:
        """The scale a push's header carries (``wire_scale``); ProtocolError if malformed."""
        if type(value) is not int:
            raise ProtocolError(f"a {self.name} push's scale {value!r} is not an exponent")
        return self.parse_scale(str(value))

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"


class Fp16(Codec):
    """float16 on the wire at a power-of-two scale the ranks agree on (:mod:`psring.core.compress`)."""

    name = "fp16"
    wire = np.dtype(np.float16)
    cpu_ns = (3.8, 2.0, 0.3)

    def scale(self, amax: np.ndarray, n_ranks: int) -> int:
        return compress.scale_exponent(float(amax[0]), n_ranks)

    def encode(self, x: np.ndarray, e: int, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        return compress.quantize(x, e, out)

    def decode(self, q: np.ndarray, e: int, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        return compress.dequantize(q, e, out)

    def fold(
        self,
        parts: Sequence[np.ndarray] | np.ndarray,
        op: str,
        e: int,
        out: np.ndarray,
        offset: int = 0,
        total: int | None = None,
    ) -> np.ndarray:
        return compress.fold_fp16(parts, op, e, out, offset, total)


class Bf16(Codec):
    """bfloat16 on the wire: float32's top 16 bits, rounded to nearest even (float32's exponent range:
    no scale to agree on, nothing flushed to zero); numpy has no bfloat16, so it travels as uint16."""

    name = "bf16"
    wire = np.dtype(np.uint16)
    scaled = False
    cpu_ns = (1.3, 0.2, 0.0)

    def encode(self, x: np.ndarray, e: Any, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        done = _in_blocks(self.encode, x, e, out, offset, self.wire)
        if done is not None:
            return done
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))  # to nearest, ties even
        top = (rounded >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            top[nan] = 0x7FC0  # a NaN stays a NaN (rounding its mantissa could carry into the sign)
        if out is None:
            return top.reshape(np.shape(x))
        out[...] = top.reshape(out.shape)
        return out

    def decode(self, q: np.ndarray, e: Any, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        done = _in_blocks(self.decode, q, e, out, offset, np.dtype(np.float32))
        if done is not None:
            return done
        wide = (np.asarray(q, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        if out is None:
            return wide
        out[...] = wide
        return out


#: int8's scales are per block of this many elements (of the whole tensor, from its first)
INT8_BLOCK = 1024
#: elements a codec encodes, decodes or measures at a time (arrays.BLOCK, a multiple of INT8_BLOCK):
#: elementwise (int8's scale by the offset's block), so the same bits as at once
CODE_BLOCK = BLOCK
assert CODE_BLOCK % INT8_BLOCK == 0


def _in_blocks(
    fn: Any, x: np.ndarray, e: Any, out: np.ndarray | None, offset: int, dtype: np.dtype
) -> np.ndarray | None:
    """``fn(x, e, out, offset)`` block by block of :data:`CODE_BLOCK` elements of ``x``, into ``out``
    (or a new array shaped as ``x``); None where it must run at once (small, or ``out`` not contiguous)."""
    n = int(np.size(x))
    if n <= CODE_BLOCK or (out is not None and not out.flags.c_contiguous):
        return None
    src = np.asarray(x).reshape(-1)
    result = np.empty(np.shape(x), dtype) if out is None else out
    dst = result.reshape(-1)
    for i in range(0, n, CODE_BLOCK):
        fn(src[i : i + CODE_BLOCK], e, dst[i : i + CODE_BLOCK], offset + i)
    return result
#: int8 exponents stay within +-this (2**100 keeps every product and partial sum a normal float32)
INT8_MAX_EXP = 100


@dataclass(frozen=True)
class Int8Scale:
    """int8's scale exponents, one per block of INT8_BLOCK elements, from block ``first`` on (the
    whole tensor's from 0; a parameter-server push's window of them)."""

    first: int
    exps: bytes  # int8 exponents

    def factors(self, offset: int, n: int) -> np.ndarray:
        """2**e of each element of ``[offset, offset + n)`` (float32, exact powers of two)."""
        if n == 0:
            return np.empty(0, np.float32)
        b0, b1 = offset // INT8_BLOCK, (offset + n - 1) // INT8_BLOCK
        exps = np.frombuffer(self.exps, np.int8)
        if b0 < self.first or b1 - self.first >= exps.size:
            raise ProtocolError(
                f"int8 scales cover blocks {self.first}..{self.first + exps.size - 1}, not elements "
                f"{offset}..{offset + n - 1}"
            )
        powers = np.ldexp(np.float32(1.0), exps[b0 - self.first : b1 - self.first + 1].astype(np.int32))
        each = np.repeat(powers.astype(np.float32), INT8_BLOCK)
        start = offset - b0 * INT8_BLOCK
        return each[start : start + n]

    def window(self, lo: int, hi: int) -> Int8Scale:
        """The scales of the blocks elements ``[lo, hi)`` lie in."""
        if hi <= lo:
            return Int8Scale(lo // INT8_BLOCK, b"")
        b0, b1 = lo // INT8_BLOCK, (hi - 1) // INT8_BLOCK
        return Int8Scale(b0, self.exps[b0 - self.first : b1 - self.first + 1])

    def digest(self) -> int:
        return zlib.crc32(self.exps)


class Int8(Codec):
    """int8 on the wire, one power-of-two scale per block of INT8_BLOCK elements, agreed by the ranks
    (a max all_reduce of every block's largest |x|): the scale leaves room for the sum of every rank's
    value and its rounding, so partial sums are integers that fit and the fold adds them exactly; only
    each rank's own encoding and avg's last division round. One byte an element (and 4 bytes a block
    for the agreement)."""

    name = "int8"
    wire = np.dtype(np.int8)
    cpu_ns = (1.1, 0.45, 0.6)

    def amax_size(self, n: int) -> int:
        return -(-n // INT8_BLOCK)

    def amax(self, x: np.ndarray) -> np.ndarray:
        n = x.size
        if not n:
            return np.zeros(0, np.float32)
        flat = x.reshape(-1)
        out = np.empty(-(-n // INT8_BLOCK), np.float32)
        pad = np.zeros(min(n, CODE_BLOCK) + INT8_BLOCK, np.float32)  # a block of them at a time
        for i in range(0, n, CODE_BLOCK):
            part = flat[i : i + CODE_BLOCK]
            blocks = -(-part.size // INT8_BLOCK)
            np.abs(part, out=pad[: part.size])
            pad[part.size : blocks * INT8_BLOCK] = 0.0
            first = i // INT8_BLOCK
            out[first : first + blocks] = pad[: blocks * INT8_BLOCK].reshape(blocks, INT8_BLOCK).max(axis=1)
        return out

    def scale(self, amax: np.ndarray, n_ranks: int) -> Int8Scale:
        room = 127.0 / n_ranks - 0.5  # n_ranks * (|x| * 2**e + 1/2) <= 127: every sum fits int8
        if room <= 0:
            raise ValueError(f"compression='int8' carries sums of at most 126 ranks, not {n_ranks}")
        if not np.all(np.isfinite(amax)):
            bad = int(np.flatnonzero(~np.isfinite(amax))[0])
            raise ValueError(
                f"compression='int8' cannot carry non-finite values: block {bad} (elements "
                f"{bad * INT8_BLOCK}..{(bad + 1) * INT8_BLOCK - 1}) holds one on some rank"
            )
        exps = np.zeros(amax.size, np.int8)
        for b, a in enumerate(amax.tolist()):
            if a > 0:
                e = max(-INT8_MAX_EXP, min(INT8_MAX_EXP, math.floor(math.log2(room / a))))
                if a * 2.0**e > room:  # the float log2 rounded up: one step less
                    e -= 1
                if e < -INT8_MAX_EXP:
                    raise ValueError(
                        f"compression='int8' carries |x| up to about 2**{INT8_MAX_EXP}; block {b} holds {a:g}"
                    )
                exps[b] = e
        return Int8Scale(0, exps.tobytes())

    def encode(self, x: np.ndarray, e: Int8Scale, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        done = _in_blocks(self.encode, x, e, out, offset, self.wire)
        if done is not None:
            return done
        flat = np.ascontiguousarray(x, np.float32).reshape(-1)
        scaled = flat * e.factors(offset, flat.size)  # exact: powers of two
        np.rint(scaled, out=scaled)  # to nearest, ties even
        np.clip(scaled, -127, 127, out=scaled)  # never met with agreed scales (room for every sum)
        q = scaled.astype(np.int8)
        if out is None:
            return q.reshape(np.shape(x))
        out[...] = q.reshape(out.shape)
        return out

    def decode(self, q: np.ndarray, e: Int8Scale, out: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        done = _in_blocks(self.decode, q, e, out, offset, np.dtype(np.float32))
        if done is not None:
            return done
        flat = np.asarray(q).reshape(-1)
        wide = flat.astype(np.float32) / e.factors(offset, flat.size)  # exact: powers of two
        if out is None:
            return wide.reshape(np.shape(q))
        out[...] = wide.reshape(out.shape)
        return out

    def fold(
        self,
        parts: Sequence[np.ndarray] | np.ndarray,
        op: str,
        e: Any,
        out: np.ndarray,
        offset: int = 0,
        total: int | None = None,
    ) -> np.ndarray:
        """The ring's result with no scale needed: partial sums are exact integers (the agreed scales
        leave room for them), so the fold is integer addition; avg's last step is the ring's --
        rint(float32(sum) / N), which equals its decode, divide, encode at any power-of-two scale."""
        wide = [np.asarray(p, np.int8).astype(np.int32) for p in parts]
        acc = canonical_fold(wide, "sum", np.empty(out.shape, np.int32))  # exact: any order gives it
        if np.any(np.abs(acc) > 127):
            raise ProtocolError("an int8 sum left int8's range: the ranks did not agree on the scales")
        if OPS[op].mean:
            f = acc.astype(np.float32)
            OPS[op].finish(f, len(parts))
            np.rint(f, out=f)
            out[...] = f.astype(np.int8)
        else:
            out[...] = acc.astype(np.int8)
        return out

    def descriptor(self, op: str, e: Int8Scale) -> str:
        return f"{op}:{self.name}@{e.digest()}"

    def parse_scale(self, text: str) -> Any:
        try:
            digest = int(text)
        except ValueError:
            digest = -1
        if not 0 <= digest < 1 << 32:
            raise ProtocolError(f"scale {text!r} is not an int8 scales' digest")
        return digest

    def wire_scale(self, e: Int8Scale, lo: int, hi: int) -> Any:
        w = e.window(lo, hi)
        return [w.first, w.exps]

    def read_scale(self, value: Any) -> Int8Scale:
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and type(value[0]) is int and value[0] >= 0
        if not ok or not isinstance(value[1], bytes):
            raise ProtocolError(f"an int8 push's scale {value!r} is not [first block, exponents]")
        exps = np.frombuffer(value[1], np.int8)
        if exps.size and np.max(np.abs(exps.astype(np.int32))) > INT8_MAX_EXP:
            raise ProtocolError(f"an int8 push's scale exponents leave +-{INT8_MAX_EXP}")
        return Int8Scale(value[0], value[1])


FP16 = Fp16()
BF16 = Bf16()
INT8 = Int8()
#: the codecs all_reduce, SyncSGD and the shards accept, by name
CODECS: dict[str, Codec] = {c.name: c for c in (FP16, BF16, INT8)}


def codec_named(compression: str | Codec | None) -> Codec | None:
    """The codec ``compression`` names (None: none); a ValueError naming the choices otherwise."""
    if compression is None or isinstance(compression, Codec):
        return compression
    found = CODECS.get(compression) if isinstance(compression, str) else None
    if found is None:
        raise ValueError(f"compression={compression!r} is not one of: None, {', '.join(map(repr, CODECS))}")
    return found


def parse_descriptor(op: object) -> tuple[str, Codec, Any] | None:
    """(base op, codec, scale) of a coded call's op field (int8's scale: its scales' digest); None for
    a plain op; ProtocolError if malformed (an unknown codec, a scale out of range)."""
    if not isinstance(op, str) or ":" not in op:
        return None
    base, _, rest = op.partition(":")
    name, at, exp = rest.partition("@")
    codec = CODECS.get(name)
    if base not in CODED_OPS or codec is None or not at:
        raise ProtocolError(f"op {op!r} is not a valid compressed reduction (like 'avg:fp16@12')")
    try:
        e = codec.parse_scale(exp)
    except ProtocolError:
        raise ProtocolError(f"op {op!r} is not a valid compressed reduction (like 'avg:fp16@12')") from None
    return base, codec, e


__all__ = [
    "BF16",
    "CODECS",
    "FP16",
    "INT8",
    "INT8_BLOCK",
    "Bf16",
    "Codec",
    "Fp16",
    "Int8",
    "Int8Scale",
    "codec_named",
    "parse_descriptor",
]
