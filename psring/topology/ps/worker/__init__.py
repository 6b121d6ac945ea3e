"""The parameter server's worker side: a rank that pushes to and pulls from the shards.

``group`` (``PsGroup``, the collectives), ``setup`` (making one: its shards where they live, the links,
the wire's piece; or joining a running elastic job), ``links`` (connections to the shards, reconnecting
to a restarted one), ``linkprobe`` (the links to shards on other hosts measured at set-up, and the pieces
and send buffers the job takes for them), ``params`` (``ParameterClient``: parameter mode for SyncSGD; ``SparseTables``:
sparse tables on the shards), ``admission`` (an elastic job's membership: join, admit, close joins),
``hostreduce`` (all_reduce reduced within each host before it is pushed). ``view`` (``WorkerGroup``) is
what those parts see of the group: a Protocol the group satisfies, so none of them imports it.
"""
