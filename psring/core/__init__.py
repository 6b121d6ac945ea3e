"""Layer 1: the wire format and array helpers. No sockets, no event loop.

- ``arrays``: the allowed dtypes, numpy/cupy dispatch, byte views, pooled result buffers.
- ``wire``: frames (a bounded msgpack header, then the raw payload) and their validation.
- ``fold``: the canonical reduction order every topology reproduces.
- ``reduceop``: the ``ReduceOp`` objects (sum, avg, min, max, prod) a name stands for: the fold's ufunc,
  the op of a partial fold, what happens once at the end (avg divides), the dtypes each takes.
- ``codec``: the ``Codec`` objects (fp16, ...) the ring, the shards and SyncSGD are handed: wire dtype,
  agreed scale, encode, decode and the fold, and the call descriptor that carries them.
- ``compress``: fp16's arithmetic (float16 on the wire, float32 sums, in the canonical order).
- ``optim``: the optimizers (SGD, Adam, AdamW), elementwise math that runs on workers and on shards alike.
- ``gpu``: staging cupy arrays through pinned host memory.
- ``sparse``: SparseRows (some rows of a table) and the one order rows are summed in.
"""
