"""Which processes count as "on the same host": the test every same-host path agrees on.

The ring's Unix links and shared-memory data links and the parameter server's shared-memory
pools are used only between processes with equal host keys, and only where
PSRING_SAME_HOST is not off.
"""

from __future__ import annotations

import os
import socket

from ..settings import Settings


def same_host_paths(settings: Settings) -> bool:
    """Whether this process may use same-host paths at all (PSRING_SAME_HOST, and a host key)."""
    return settings.same_host and host_key() is not None


def host_key() -> str | None:
    """What two processes must share for Unix links between them: the kernel (boot id), the
    network namespace (abstract socket names live there) and the pid namespace (so that
    published pids compare with the kernel's credentials). None where that cannot be told."""
    if not hasattr(socket, "SO_PEERCRED") or not hasattr(socket, "SOCK_SEQPACKET"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        pid = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{net}/{pid}"


def elsewhere(peer_host: object) -> bool:
    """Whether a peer whose handshake named host key ``peer_host`` runs on another host (or this one
    cannot tell its own)."""
    me = host_key()
    return me is None or peer_host != me
