"""Codecs: how a float32 all_reduce travels narrower, and how its partial sums are folded.

A :class:`Codec` is what the ring, the parameter server's shards and SyncSGD are handed instead of
a name: its wire dtype, the scale the ranks agree on before a call, how a rank's tensor is encoded
and decoded, and the fold. The codec owns the fold because the same bits on every rank and on both
topologies come from rounding every partial sum where the ring sends it (see
:mod:`psring.core.compress` for fp16's rules): a shard that folds the workers' encoded pieces with
``codec.fold`` gets the ring's result exactly. That is why it is not a wrapper that encodes before
and decodes after an unchanged all_reduce (Horovod's ``Compressor``).

A call's descriptor carries the codec and its scale in the op field (``"avg:fp16@12"``), so every
frame of the call says how to read its payload and a peer that disagrees fails the call by name.

A new codec is a subclass here and one entry in :data:`CODECS`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ProtocolError
from . import compress
from .fold import ring_chunk_bounds
from .reduceop import OPS

#: the reduce ops a codec carries (sums of what travels; avg divides at the end)
CODED_OPS = ("sum", "avg")


class Codec:
    """One way a float32 all_reduce (op sum or avg) travels; see the module's docstring."""

    #: the name users pass (``compression="fp16"``) and frames carry
    name: str = ""
    #: the dtype of what travels
    wire: np.dtype = np.dtype(np.float32)
    #: whether the ranks agree on a scale before each call (a one-element max all_reduce); a codec
    #: with float32's range (bf16) needs none and always runs at e = 0
    scaled: bool = True

    def check(self, dtype: np.dtype, op: str) -> None:
        """Refuse, naming it, an input this codec cannot carry (float32 only; sum or avg)."""
        if dtype != np.float32:
            raise TypeError(f"compression={self.name!r} needs float32 arrays, got {dtype}")
        if op not in CODED_OPS:
            raise ValueError(f"compression={self.name!r} works with op='sum' or op='avg', not op={op!r}")

    def scale(self, amax: float, n_ranks: int) -> int:
        """The scale exponent every rank uses, from the largest magnitude on any rank."""
        return 0

    def encode(self, x: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
        """A rank's float32 contribution as it travels (dtype ``wire``)."""
        raise NotImplementedError

    def decode(self, q: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
        """What travelled, back as float32 (exactly: decoding rounds nothing)."""
        raise NotImplementedError

    def fold(
        self,
        parts: Sequence[np.ndarray] | np.ndarray,
        op: str,
        e: int,
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
            acc = self.decode(parts[c][a:b], e)
            for k in range(1, n_ranks):
                np.add(acc, self.decode(parts[(c + k) % n_ranks][a:b], e), out=acc)
                if k < n_ranks - 1:
                    self.decode(self.encode(acc, e), e, out=acc)  # what the next ring hop receives
            last.finish(acc, n_ranks)
            self.encode(acc, e, out=out[a:b])
        return out

    def descriptor(self, op: str, e: int) -> str:
        """The op field of a call that travels with this codec at scale ``e``."""
        return f"{op}:{self.name}@{e}"

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"


class Fp16(Codec):
    """float16 on the wire at a power-of-two scale the ranks agree on (:mod:`psring.core.compress`)."""

    name = "fp16"
    wire = np.dtype(np.float16)

    def scale(self, amax: float, n_ranks: int) -> int:
        return compress.scale_exponent(amax, n_ranks)

    def encode(self, x: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
        return compress.quantize(x, e, out)

    def decode(self, q: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
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

    def encode(self, x: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
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

    def decode(self, q: np.ndarray, e: int, out: np.ndarray | None = None) -> np.ndarray:
        wide = (np.asarray(q, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        if out is None:
            return wide
        out[...] = wide
        return out


FP16 = Fp16()
BF16 = Bf16()
#: the codecs all_reduce, SyncSGD and the shards accept, by name
CODECS: dict[str, Codec] = {c.name: c for c in (FP16, BF16)}


def codec_named(compression: str | Codec | None) -> Codec | None:
    """The codec ``compression`` names (None: none); a ValueError naming the choices otherwise."""
    if compression is None or isinstance(compression, Codec):
        return compression
    found = CODECS.get(compression) if isinstance(compression, str) else None
    if found is None:
        raise ValueError(f"compression={compression!r} is not one of: None, {', '.join(map(repr, CODECS))}")
    return found


def parse_descriptor(op: object) -> tuple[str, Codec, int] | None:
    """(base op, codec, scale exponent) of a coded call's op field; None for a plain op;
    ProtocolError if malformed (an unknown codec, a scale out of range)."""
    if not isinstance(op, str) or ":" not in op:
        return None
    base, _, rest = op.partition(":")
    name, _, exp = rest.partition("@")
    try:
        e: int | None = int(exp)
    except ValueError:
        e = None
    codec = CODECS.get(name)
    if base not in CODED_OPS or codec is None or e is None or not -compress.MAX_EXP <= e <= compress.MAX_EXP:
        raise ProtocolError(f"op {op!r} is not a valid compressed reduction (like 'avg:fp16@12')")
    return base, codec, e


__all__ = ["BF16", "CODECS", "FP16", "Bf16", "Codec", "Fp16", "codec_named", "parse_descriptor"]
