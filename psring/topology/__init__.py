"""Layer 4: collectives. ``group`` is the interface both topologies implement (with ``collective``:
one call in flight); ``ring`` and ``ps`` are the topologies; ``blocking`` is the facade for
ordinary (non-async) code; ``recorder`` the per-collective flight recorder.
"""
