"""Layer 3: how the processes of a job find each other.

- ``store`` (server) and ``client``: the key-value rendezvous store, over TCP or a shared file system
  (the TCP client reconnects when the store restarts); ``storelog``: its keys on disk (``--data-dir``);
  ``etcd``: the same interface over an etcd v3 cluster (``etcd://h1:2379,h2:2379``); ``barrier``: the
  counting barrier every one of them uses;
  ``torchstore``: torch's c10d store (torchrun's, or the backend's) behind the same interface.
- ``scheduler``: rank, world size and the store's address from the launcher's environment
  (torchrun, Slurm, Kubernetes, psring launch).
- ``join``: who serves the store, and which rank a process gets.
- ``launch``: ``psring launch``, a torchrun-like local launcher.
"""
