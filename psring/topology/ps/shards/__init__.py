"""The parameter server's shard side (a process of them: ``python -m psring.topology.ps``, ``psring server``).

``server`` (a process's shards behind one port, registered in the store), ``shard`` (one shard: joins,
routing, losses) with ``folding`` (a collective's pieces folded in the canonical order, pacing) and
``pending`` (one collective on one shard), ``paramstore`` (parameters and optimizer state held on the
shards: a ``bucket`` each, written and read back by ``checkpoint``), ``tables`` (sparse tables' rows on
the shards), ``relay`` (one result to many workers). Knows nothing of the worker side.
"""
