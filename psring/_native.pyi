"""Types of the C extension psring._native (psring/native/: module.c says where each engine is): the
same-host board's hot loop, the TCP small-message links' exchange, and the data plane's ring over TCP on
one thread."""

from typing import Any

import numpy as np
from typing_extensions import Buffer

_Array = Buffer | np.ndarray[Any, Any]

class NBoard:
    def __init__(
        self,
        own: Buffer,
        own_slot_bytes: int,
        peers: list[tuple[Buffer, int]],
        page: int,
        head: int,
        tag_max: int,
        ack_at: int,
        sleep_at: int,
    ) -> None: ...
    def post(self, k: int, tag: Buffer, payload: Buffer) -> int: ...
    def all_at(self, k: int, field: int) -> bool: ...
    def spin(self, k: int, field: int, hot: int, budget_s: float) -> bool: ...
    def differs(self, k: int, tag: Buffer, nbytes: int) -> int: ...
    def fold(self, k: int, me: int, own: _Array, out: _Array, kind: str, op: str) -> bool: ...
    def exchange(
        self,
        k: int,
        tag: Buffer,
        x: _Array,
        out: _Array,
        kind: str,
        op: str,
        me: int,
        hot: int,
        budget_s: float,
        split: bool = ...,
    ) -> int: ...
    def stream(
        self,
        k: int,
        me: int,
        x: _Array,
        out: _Array,
        kind: str,
        op: str,
        piece: int,
        depth: int,
        hot: int,
        budget_s: float,
        nt: int,
        yield_us: int = ...,
        nap_us: int = ...,
        stores: int = ...,
    ) -> int: ...
    def stream_stores(self) -> tuple[bool, float, float]: ...
    def cancel_stream(self, flag: bool) -> None: ...
    def close(self) -> None: ...

def tcp_read(
    links: list[Any], ranks: list[int], head: Buffer, size: int, out: _Array, yields: int, spin_s: float, wait_s: float
) -> int: ...
def tcp_exchange(
    links: list[Any],
    ranks: list[int],
    head: Buffer,
    x: _Array,
    bufs: _Array,
    me: int,
    out: _Array,
    kind: str,
    op: str,
    yields: int,
    spin_s: float,
    wait_s: float,
) -> tuple[int, int, int]: ...
def tcp_scatter(
    links: list[Any],
    sheads: list[bytes],
    sends: list[Any],
    rheads: list[bytes],
    dests: list[Any],
    hot: int,
    wait_s: float,
    then: tuple[Any, ...] | None = ...,
) -> tuple[int, tuple[int, ...], tuple[bool, ...], int]: ...
def tcp_two_hop(
    links: list[Any],
    x: _Array,
    out: _Array,
    rows: _Array,
    order: Buffer,
    bounds: Buffer,
    first: int,
    h1: Buffer,
    h2: Buffer,
    kind: str,
    op: str,
    hot: int,
    wait_s: float,
) -> tuple[int, tuple[int, ...], tuple[bool, ...], int]: ...
def fold_chunk(rows: _Array, first: int, out: _Array, kind: str, op: str, own: _Array) -> None: ...

class NRing:
    theirs: bytes
    why: str
    err: int
    sent: int
    def __init__(
        self,
        send_fd: int,
        recv_fd: int,
        seq: int,
        call: Buffer,
        x: _Array,
        out: _Array,
        steps: list[tuple[int, int, int]],
        own: list[tuple[int, int]],
        kind: str,
        op: str,
        avg: int,
    ) -> None: ...
    def run(self, reader: Any, hot: int, wait_s: float) -> int: ...
    def finish(self, wait_s: float) -> bool: ...
