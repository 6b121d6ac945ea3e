"""The ring's threaded data plane: large all_reduces on two blocking sockets, off the event loop.

``allreduce`` (``PlaneAllReduce``: the algorithm the chooser picks), ``links`` (``PlaneLinks``: the
data links a rank dials and accepts, and their shared memory), ``dataplane`` (``DataPlane``: the receive
thread, which also folds, and the schedule of jobs), ``rightlink`` (``RightLink``: the link to the right
neighbour and the send thread), ``native`` (``NativeJobs``: the jobs that run in C, on the receive thread
or a caller's), ``job`` (what both threads share: the frame format, a ``Job``, the jobs' ``Turns``).
"""
