"""Layer 5: synchronous SGD over a Group, and the main job.

- ``sgd``: SyncSGD (buckets, either topology, identical parameters); ``placement``: where its parameters
  live and who runs the optimizer (``Replicated``, ``Sharded``, ``Reformed``: elastic over the ring), the
  strategy its group provides; ``local``: the model as a rank holds it (``LocalModel``: flat buckets, their
  views, optimizer state, sparse tables) and the checks of what goes in and out of it; ``compressors``:
  TopK and PowerSGD, SyncSGD's compressors with error feedback (``compression=psring.TopK(0.01)``);
  ``localsgd``: local SGD / DiLoCo's local half (``LocalSteps``: a rank's own copy, the inner optimizer,
  the pseudo-gradient every ``local_steps``); ``streaming``: streaming DiLoCo's schedule (``fragments=K``:
  which fragment starts its exchange after which inner step, the one in flight, when it is applied).
- ``data``, ``model``, ``job``: the main job (``psring train``): digits, an MLP, a worker rank.
- ``embed``: the second main job (``psring train --model embed``): a recommendation model whose two
  embedding tables are sparse tables, on generated data.
- ``bench_ranks``: the rank program ``psring bench`` starts (all_reduce and SyncSGD timings).
- ``checkpoint``: where the main job keeps its checkpoints (a directory, or a cluster's store).
"""
