"""Layer 6: long-running daemons and the jobs placed on them through the store.

- ``daemons``: ``psring worker`` and ``psring server --cluster``.
- ``client``: submitting jobs and following them; ``doctor``: pre-flight checks.
- ``metrics``: Prometheus counters; ``trace``: Chrome traces from flight-recorder logs.
- ``dashboard``: ``psring dashboard``, a live web page of the cluster and its JSON API.
- ``advise``: ``psring advise``, a cost model of each topology and the probe that measures the links.
"""
