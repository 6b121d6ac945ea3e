"""psring: synchronous data-parallel SGD over a parameter server or a peer-to-peer ring.

Public API (see docs/design.md): ``init_group`` (async) and ``init`` (blocking) return a
Group with all_reduce, broadcast, barrier, all_gather, reduce_scatter, reduce,
scatter, gather, send/recv, new_group and close. Errors derive from PsringError.

Where things live, bottom to top (each layer imports only the ones below it):
``core`` (frames, arrays, the canonical fold, optimizers) -> ``transport`` (connections,
shared memory, the data plane) -> ``rendezvous`` (the store, ranks, launchers) ->
``topology`` (Group, ring, ps) -> ``training`` (SyncSGD, the main job) -> ``cluster``
(daemons, jobs) -> ``torch`` (PyTorch integration) -> ``cli``. ``settings`` reads every
PSRING_* variable; ``errors`` is the error tree; ``optim`` is the public path of the optimizers
(``core.optim``); ``version`` holds ``__version__``.
"""

from . import optim
from .cluster.client import Client, Job
from .cluster.daemons import JobError
from .core.sparse import SparseRows
from .errors import (
    AuthError,
    CollectiveTimeoutError,
    GroupClosedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    PsringError,
    StoreDiskError,
    StoreError,
)
from .rendezvous.client import FileStoreClient, StoreClient
from .rendezvous.store import StoreServer, start_store
from .topology.api import init_group
from .topology.blocking import BlockingGroup, Handle, init
from .topology.group import Group
from .training.compressors import PowerSGD, TopK
from .training.sgd import SyncSGD
from .version import __version__

__all__ = [
    "AuthError",
    "BlockingGroup",
    "Client",
    "CollectiveTimeoutError",
    "FileStoreClient",
    "Group",
    "GroupClosedError",
    "Handle",
    "Job",
    "JobError",
    "MismatchError",
    "PeerLostError",
    "PowerSGD",
    "ProtocolError",
    "PsringError",
    "SparseRows",
    "StoreClient",
    "StoreDiskError",
    "StoreError",
    "StoreServer",
    "SyncSGD",
    "TopK",
    "__version__",
    "init",
    "init_group",
    "optim",
    "start_store",
]
