"""Layer 4: collectives. ``group`` is the interface both topologies implement (with ``runtime``: the
sequence numbers, deadlines and aborts every call shares, ``collective``: one call in flight, ``p2p``:
send and recv, ``sparsecall``: sparse_all_reduce over the group's own all_gathers, and ``now``: what a
short way answers, ``Group.try_now``); ``ring`` and
``ps`` are the topologies; ``api`` is ``init_group``; ``blocking`` is the facade for ordinary
(non-async) code; ``recorder`` the per-collective flight recorder; ``stall`` the inspector that names
what a waiting call waits on.
"""
