"""A connection's TCP socket, tuned and read: its kernel send buffer, the round trip the kernel measured.

Functions of a :class:`~psring.transport.connection.Connection` (any object with its ``transport``),
kept apart from it: they touch the socket under the transport, which the connection's framing never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any


def tcp_socket(conn: Any) -> socket.socket | None:
    """The open TCP socket under ``conn``'s transport (None: closed, or a Unix socket or none)."""
    transport: asyncio.BaseTransport | None = conn.transport
    if transport is None or transport.is_closing():
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


def dialed_itself(transport: asyncio.BaseTransport) -> bool:
    """Whether a dialed TCP socket's two ends are one address: nothing listened at a port in the
    kernel's ephemeral range and the kernel gave the dialing socket that very port (a TCP simultaneous
    open with itself)."""
    sock = transport.get_extra_info("socket")
    try:
        return sock is not None and sock.getsockname() == sock.getpeername()
    except OSError:  # closed under us: the handshake will say so
        return False


def reset(transport: asyncio.Transport) -> None:
    """Close a TCP connection with a reset (SO_LINGER 0), not a FIN: its port is free at once instead of
    held in TIME_WAIT (a self-connect's port is one a server restarted there must bind)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # closed under us
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def set_send_buffer(sock: socket.socket, nbytes: int) -> bool:
    """SO_SNDBUF of ``sock`` (Linux doubles it; setting it turns off the kernel's own sizing); 0: the
    largest the kernel allows (net.core.wmem_max). False where the socket is closed."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes or _wmem_max())
    except (OSError, ValueError):  # a socket closed under us
        return False
    return True


def _wmem_max(default: int = 4 << 20) -> int:
    """net.core.wmem_max: the largest send buffer a process may ask for."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


def limit_send_buffer(conn: Any, nbytes: int) -> bool:
    """Bound the kernel's send buffer of this TCP connection to ``nbytes`` (SO_SNDBUF, which also
    turns off the kernel's sizing of it; Linux doubles it for its own bookkeeping): the bytes in
    flight and queued in the kernel stay about that, so connections that share a link take even
    shares of it -- at the price of at most ``nbytes`` / the round trip each. False where this is
    no TCP socket (or not open)."""
    sock = tcp_socket(conn) if nbytes > 0 else None
    return sock is not None and set_send_buffer(sock, nbytes)


def kernel_round_trip(conn: Any) -> float | None:
    """The least round trip (seconds) the kernel has measured on this TCP connection (Linux's
    TCP_INFO min_rtt; its smoothed one where the kernel is older): the wire's, without either
    process's time. None where this is no TCP socket or the kernel does not say."""
    sock = tcp_socket(conn)
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, ValueError):  # a socket closed under us
        return None
    # struct tcp_info (linux/tcp.h): tcpi_rtt at byte 68, tcpi_min_rtt at 148, both microseconds
    for offset in (148, 68):
        if len(raw) >= offset + 4:
            (micros,) = struct.unpack_from("I", raw, offset)
            if 0 < micros < 0xFFFFFFFF:
                return float(micros) / 1e6
    return None
