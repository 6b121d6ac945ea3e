"""psring: synchronous data-parallel SGD over a parameter server or a peer-to-peer ring.

Public API (see DESIGN.md): ``init_group`` (async) and ``init`` (blocking) return a
Group with all_reduce, broadcast, barrier, all_gather, reduce_scatter, reduce,
scatter, gather, send/recv, new_group and close. Errors derive from PsringError.
"""

__version__ = "0.1.0"

from . import optim
from .cluster import Client, Job, JobError
from .errors import (
    AuthError,
    CollectiveTimeoutError,
    GroupClosedError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    PsringError,
    StoreError,
)
from .facade import BlockingGroup, Handle, init
from .group import Group, init_group
from .sgd import SyncSGD
from .store import FileStoreClient, StoreClient, StoreServer, start_store

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
    "ProtocolError",
    "PsringError",
    "StoreClient",
    "StoreError",
    "StoreServer",
    "SyncSGD",
    "init",
    "init_group",
    "optim",
    "start_store",
]
