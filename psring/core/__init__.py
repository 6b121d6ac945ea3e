"""Layer 1: the wire format and array helpers. No sockets, no event loop.

- ``arrays``: the allowed dtypes, numpy/cupy dispatch, byte views, pooled result buffers.
- ``wire``: frames (a bounded msgpack header, then the raw payload) and their validation.
- ``fold``: the canonical reduction order every topology reproduces.
- ``compress``: fp16 on the wire with float32 arithmetic, in the same order.
- ``optim``: the optimizers (SGD, Adam, AdamW), elementwise math that runs on workers and on shards alike.
- ``gpu``: staging cupy arrays through pinned host memory.
- ``sparse``: SparseRows (some rows of a table) and the one order rows are summed in.
"""
