"""What the ring's path mixins need from RingGroup and from each other: read by type checkers only.

``RingGroup`` is assembled from mixins (``board``, ``small``, ``pipeline``, ``fp16``, ``plane``, ``hier``),
each of which calls into the group's plumbing and into its siblings. Each mixin names this class
as its base under ``TYPE_CHECKING`` (and ``object`` at run time), so the interface between them
is written down once, here, and checked (mypy in CI): a signature that drifts is an error.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ...core.fold import Layout
from ...transport.connection import Connection
from ..collective import Collective
from ..group import Group
from .net import PeerNet
from .paths import Path


class RingHost(Group):
    """The ring group as its mixins see it (never instantiated)."""

    net: PeerNet
    #: the world ranks of this group's members, by local rank; and the reverse
    members: list[int]
    _local: dict[int, int]
    _mesh_slots: dict[tuple[int, int], Any]
    _mesh_early: dict[tuple[int, int, int], tuple[tuple[Any, ...], bytes]]

    # ------------------------------------------------ ring/board.py: small all_reduces through shared memory
    @abc.abstractmethod
    def _board(self, x: Any, compression: str | None) -> Any: ...

    @abc.abstractmethod
    async def _board_all_reduce(self, board: Any, x: np.ndarray, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    def _board_quick(self, x: Any, op: str, compression: str | None) -> tuple[bool, Any] | None: ...

    @abc.abstractmethod
    def _stream_kind(self, x: Any, op: str, compression: str | None) -> str | None: ...

    @abc.abstractmethod
    async def _stream_all_reduce(self, board: Any, x: np.ndarray, op: str, kind: str) -> np.ndarray: ...

    @abc.abstractmethod
    def on_board_wake(self) -> None: ...

    @abc.abstractmethod
    def on_board_here(self, peer: int, seq: int, call: tuple[Any, ...]) -> None: ...

    @abc.abstractmethod
    def _checked(self, x: np.ndarray, op: str) -> np.ndarray: ...

    @abc.abstractmethod
    def _idle(self) -> bool: ...

    @abc.abstractmethod
    def _spin_budget(self, nbytes: int) -> float: ...

    @abc.abstractmethod
    def _number_now(self, x: np.ndarray, op: str) -> tuple[np.ndarray, int, tuple[Any, ...], float]: ...

    @abc.abstractmethod
    def _books_now(self, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None) -> None: ...

    # ------------------------------------------------ ring/tcpnow.py: small all_reduces between hosts
    tcp_now: int
    tcp_adopted: int
    tcp_native: int

    #: by (dtype, shape, op): what every one-hop call of that kind shares (False: it takes another way)
    _tcp_plans: dict[tuple[Any, ...], tuple[Any, ...] | bool]

    @abc.abstractmethod
    def _tcp_soon(
        self, x: Any, op: str, compression: str | None, on_loop: bool = False
    ) -> tuple[bool, Any] | None: ...

    @abc.abstractmethod
    def _tcp_quick(
        self, x: Any, op: str, compression: str | None, on_loop: bool = False
    ) -> tuple[bool, Any] | None: ...

    #: the peers in the order this rank sends to them
    _tcp_order: tuple[int, ...]

    #: the buffer _alone_rows gives out (replaced by a larger one when a call needs more)
    _scratch: np.ndarray | None

    @abc.abstractmethod
    def _alone_rows(self, n: int, count: int, dtype: np.dtype) -> np.ndarray: ...

    # ------------------------------------------------ ring/twohop.py: medium all_reduces between hosts
    #: by (dtype, shape, op): what every two-hop call of that kind shares
    _two_hop_plans: dict[tuple[Any, ...], Any]

    @abc.abstractmethod
    def _two_hop_soon(
        self, x: Any, op: str, compression: str | None, on_loop: bool = False
    ) -> tuple[bool, Any] | None: ...

    @abc.abstractmethod
    def _two_hop_fast(self, x: np.ndarray, op: str, on_loop: bool = False) -> tuple[bool, Any] | None: ...

    @abc.abstractmethod
    async def _two_hop_all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray: ...

    # ------------------------------------------------ ring/plane.py: the data plane
    @abc.abstractmethod
    def _plane_soon(self, x: Any, op: str, compression: str | None) -> tuple[bool, Any] | None: ...

    # ------------------------------------------------ ring/small.py: the same-host links
    @abc.abstractmethod
    def _check_early(self, coll: Collective) -> None: ...

    @abc.abstractmethod
    async def _mesh_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int,
        spans: dict[int, tuple[int, int]] | None = None,
    ) -> None: ...

    # ------------------------------------------------ ring/group.py: plumbing and the path decision
    @abc.abstractmethod
    async def _link(self, local_rank: int) -> Connection: ...

    @abc.abstractmethod
    async def _links(self, local_ranks: list[int]) -> list[Connection]: ...

    @abc.abstractmethod
    def _header(self, coll: Collective, *tag: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _all_reduce_path(self, nbytes: int, fp16: bool = False) -> Path: ...

    # ------------------------------------------------ small.py: the one-hop paths
    @abc.abstractmethod
    async def _direct_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int | None = None,
    ) -> None: ...

    @abc.abstractmethod
    async def _gather_and_fold(
        self,
        coll: Collective,
        x: np.ndarray,
        op: str,
        dst: int | None = None,
        hosts: Layout | None = None,
        path: Path = Path.DIRECT,
    ) -> Any: ...

    @abc.abstractmethod
    async def _rooted(
        self, coll: Collective, x: np.ndarray, fold: Callable[[np.ndarray], np.ndarray]
    ) -> np.ndarray: ...

    # ------------------------------------------------ pipeline.py: the pipelined ring
    @abc.abstractmethod
    def _wait_piece(self, coll: Collective, conn_count: int) -> tuple[asyncio.Future[None], Callable[[], None]]: ...

    @abc.abstractmethod
    async def _ring_pass(
        self,
        coll: Collective,
        right: Connection,
        chunk_pieces: list[list[tuple[int, int]]],
        ag_chunks: list[int],
        sends: np.ndarray,
        rs_into: np.ndarray,
        ag_into: np.ndarray,
        rs_arrived: Callable[[int, int, int, int], Callable[..., None]],
        ag_arrived: Callable[[int, int, int, int], Callable[..., None]],
    ) -> None: ...

    # ------------------------------------------------ hier.py
    @abc.abstractmethod
    def _hier_hosts(self) -> Layout | None: ...
