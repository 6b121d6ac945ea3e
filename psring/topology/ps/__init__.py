"""The parameter-server topology: workers push to and pull from sharded servers.

Worker side: ``client`` (``PsGroup``, the collectives), ``setup`` (making one: its shards, links, the
wire's piece; or joining a running elastic job), ``params`` (``ParameterClient``: parameter mode for
SyncSGD; ``SparseTables``: sparse tables on the shards),
``links`` (connections to the shards), ``hostreduce`` (all_reduce reduced within each host before it is
pushed, several ranks a host). Server side (a process of them: ``python -m psring.topology.ps``,
``psring server``): ``server`` (a process's shards behind one
port), ``shard`` (one shard: joins, routing, losses) with ``folding`` and ``pending``,
``paramstore`` (parameters and optimizer state held on the shards) and ``tables`` (sparse tables'
rows). Both sides share ``plan`` (who owns which slice) and ``relay`` (one result to many workers).
"""
