"""Every ``PSRING_*`` environment variable, and the one place the environment is read.

Each field of :class:`Settings` is one variable: its name, type, default, meaning and
whether it is a tuning knob (measured defaults a user should not need to touch) are in
the field's declaration, so ``psring --help-env`` and the docs print this table. The
rest of psring receives a resolved, frozen :class:`Settings` (``current()`` resolves the
process environment once per distinct environment; components take ``settings=`` so
tests and embedders can pass their own) and never looks at ``os.environ`` itself.

The launcher variables torch.distributed, Slurm and Kubernetes define (RANK,
WORLD_SIZE, MASTER_ADDR, SLURM_PROCID, ...) are read here too (:func:`scheduler_env`);
what they mean is decided in :mod:`psring.rendezvous.scheduler`.

Precedence, everywhere: an explicit argument, then the environment, then the default.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the topologies psring ships, in the order commands list them (topology.Group.registry holds their classes)
TOPOLOGY_NAMES = ("ring", "ps")

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(raw: str) -> int:
    """A non-negative whole number of bytes: ``4194304``, ``4M``, ``64K``, ``1G``."""
    text = raw.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text and text[-1] in "KMG" else (text, "")
    try:
        value = int(number) * _SUFFIX[unit]
    except ValueError:
        raise ValueError("expected a whole number of bytes (as in 4194304, 4M, 64K)") from None
    if value < 0:
        raise ValueError("expected a number that is not negative")
    return value


def parse_count(raw: str) -> int:
    """A non-negative whole number."""
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("expected a whole number") from None
    if value < 0:
        raise ValueError("expected a number that is not negative")
    return value


def parse_positive(raw: str) -> int:
    """A whole number, 1 or more."""
    value = parse_count(raw)
    if value < 1:
        raise ValueError("expected a whole number, 1 or more")
    return value


def parse_auto(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, or None for ``auto`` (what psring picks, as when the variable is unset)."""

    def parse_or_auto(raw: str) -> Any:
        return None if raw.strip().lower() == "auto" else parse(raw)

    parse_or_auto.__doc__ = f"auto, or {parse.__doc__ or parse.__name__}"
    return parse_or_auto


def parse_port(raw: str) -> int:
    value = parse_count(raw)
    if value > 65535:
        raise ValueError("expected a port (0 to 65535)")
    return value


def parse_seconds_or_zero(raw: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not value >= 0:
        raise ValueError("expected a number that is not negative")
    return value


def parse_seconds(raw: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not value > 0:
        raise ValueError("expected a positive number")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_switch(raw: str) -> bool:
    """1/true/yes/on or 0/false/no/off."""
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected 1 or 0 (on or off)")


#: the largest shard weight (PSRING_PS_WEIGHTS)
MAX_WEIGHT = 1 << 20


def parse_weights(raw: str) -> tuple[int, ...] | None:
    """Comma-separated whole numbers from 1 to MAX_WEIGHT, one per shard (``1,1,1,1,3,3``); empty: none."""
    text = raw.strip()
    if not text:
        return None
    try:
        weights = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError("expected whole numbers separated by commas, one per shard (as in 1,1,3,3)") from None
    if not all(1 <= w <= MAX_WEIGHT for w in weights):
        raise ValueError(f"expected weights from 1 to {MAX_WEIGHT}")
    return weights


def parse_text(raw: str) -> str:
    return raw


def choice(*options: str, aliases: Mapping[str, str] | None = None) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        text = raw.strip().lower()
        text = (aliases or {}).get(text, text)
        if text not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return text

    parse.__doc__ = " | ".join(options)
    return parse


def _var(name: str, default: Any, parse: Callable[[str], Any], meaning: str, *, tuning: bool = False) -> Any:
    return field(default=default, metadata={"env": name, "parse": parse, "meaning": meaning, "tuning": tuning})


@dataclass(frozen=True)
class Settings:
    """Every PSRING_* setting, resolved (see the module docstring)."""

    # ------------------------------------------------------------ the job
    topology: str = _var(
        "PSRING_TOPOLOGY", "ring", choice(*TOPOLOGY_NAMES), "topology when none is given: ring or ps"
    )
    store: str | None = _var(
        "PSRING_STORE",
        None,
        parse_text,
        "the store: host:port, tcp://, env:// (MASTER_ADDR/MASTER_PORT), file://dir or etcd://h1:2379,h2:2379",
    )
    store_serve: bool = _var(
        "PSRING_STORE_SERVE",
        True,
        parse_switch,
        "rank 0 serves the store at its address when none answers there and the address is its own (as "
        "TCPStore's master); 0: never -- a worker daemon's ranks, whose store is the cluster's, set so",
    )
    job: str = _var("PSRING_JOB", "default", parse_text, "job name: the ranks of one job meet under it in the store")
    secret: str | None = _var("PSRING_SECRET", None, parse_text, "shared secret every process of a job must know")
    secret_file: str | None = _var(
        "PSRING_SECRET_FILE", None, parse_text, "a file holding the secret (a Docker or Kubernetes secret)"
    )
    timeout: float = _var("PSRING_TIMEOUT", 300.0, parse_seconds, "seconds any one collective may take")
    store_reconnect: float = _var(
        "PSRING_STORE_RECONNECT_S",
        60.0,
        parse_seconds_or_zero,
        "seconds a store client keeps reconnecting, with backoff, when the store goes away (0: it does not)",
    )
    stall: float = _var(
        "PSRING_STALL_S",
        5.0,
        parse_seconds,
        "seconds a call waits before the ranks compare what they called: a mismatch is raised at once, "
        "a late rank warned about every this many seconds (inf: never)",
    )
    servers: int | None = _var("PSRING_SERVERS", None, parse_count, "ps: server shards (unset: one per worker)")
    ps_colocate: bool = _var(
        "PSRING_PS_COLOCATE", False, parse_switch, "ps: every worker process hosts its share of the shards"
    )
    ps_dedicated: int = _var(
        "PSRING_PS_DEDICATED",
        0,
        parse_count,
        "ps with PSRING_PS_COLOCATE: this many more shards, the last ids, run on dedicated server hosts "
        "(psring server --shard i --num-shards workers+this)",
    )
    ps_weights: tuple[int, ...] | None = _var(
        "PSRING_PS_WEIGHTS",
        None,
        parse_weights,
        "ps: each shard's share of every large tensor, one whole number per shard (1,1,1,1,3,3; rank 0's word "
        "counts; unset: equal slices, which psring advise finds best for the BytePS split too)",
    )
    checkpoint_dir: str | None = _var(
        "PSRING_CHECKPOINT_DIR", None, parse_text, "ps: where local shards write parameter checkpoints"
    )
    trace_dir: str | None = _var(
        "PSRING_TRACE_DIR", None, parse_text, "write one JSON line per collective here (psring trace reads them)"
    )
    # ------------------------------------------------------------ addresses
    port: int = _var("PSRING_PORT", 0, parse_port, "the port this process listens on (0: any free port)")
    host: str | None = _var("PSRING_HOST", None, parse_text, "psring store: the address it binds (unset: 0.0.0.0)")
    bind_host: str | None = _var(
        "PSRING_BIND_HOST",
        None,
        parse_text,
        "the address ranks and servers bind (unset: loopback when advertising loopback, else 0.0.0.0)",
    )
    advertise_host: str | None = _var(
        "PSRING_ADVERTISE_HOST",
        None,
        parse_text,
        "the address others use to reach this process (unset: the one routed towards the store)",
    )
    name: str | None = _var("PSRING_NAME", None, parse_text, "a daemon's id in the cluster (unset: host-pid-random)")
    # ------------------------------------------------------------ transport
    same_host: bool = _var(
        "PSRING_SAME_HOST",
        True,
        lambda raw: True if raw.strip().lower() == "auto" else parse_switch(raw),
        "shared memory and Unix links between processes on one host: auto (on) or off",
    )
    hierarchical: str = _var(
        "PSRING_HIERARCHICAL",
        "auto",
        choice(
            "auto", "on", "off", aliases={"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
        ),
        "ring all_reduce across hosts: reduce within each host, then across hosts (auto: when ranks share hosts)",
    )
    host_id: str | None = _var(
        "PSRING_HOST_ID",
        None,
        parse_text,
        "which host a rank counts as for hierarchical all_reduce (unset: the kernel, network and pid namespaces)",
    )
    checksum: str | None = _var(
        "PSRING_CHECKSUM",
        None,
        choice("crc32", "crc32c", "none", aliases={"0": "none", "off": "none", "no": "none", "": "none"}),
        "checksum every payload: crc32c (needs the crc32c package), crc32, or none",
    )
    tls_cert: str | None = _var("PSRING_TLS_CERT", None, parse_text, "TLS: this process's certificate (PEM)")
    tls_key: str | None = _var("PSRING_TLS_KEY", None, parse_text, "TLS: its private key (PEM)")
    tls_ca: str | None = _var("PSRING_TLS_CA", None, parse_text, "TLS: the CA that signs every peer (mutual TLS)")
    heartbeat_interval: float = _var(
        "PSRING_HEARTBEAT_INTERVAL", 1.0, parse_seconds, "seconds between heartbeats on an idle link", tuning=True
    )
    heartbeat_timeout: float = _var(
        "PSRING_HEARTBEAT_TIMEOUT", 10.0, parse_seconds,
        "a link silent this long is lost (3x as long while bulk bytes arrive: a thin link delays its pings)",
        tuning=True
    )
    max_frame: int = _var("PSRING_MAX_FRAME", 2 << 30, parse_bytes, "the largest frame accepted", tuning=True)
    buffer_pool: int = _var(
        "PSRING_BUFFER_POOL",
        512 << 20,
        parse_bytes,
        "bytes of large results kept for reuse, and of freed heap memory psring's own processes (servers, "
        "daemons, `psring train`'s ranks) keep mapped instead of faulting in fresh pages (0: none)",
        tuning=True,
    )
    spin_us: int = _var(
        "PSRING_SPIN_US",
        500,
        parse_count,
        "microseconds a lone rank polls for a small call's peers (same-host links, boards, TCP; a ps worker: "
        "its answer) before sleeping",
        tuning=True,
    )
    native: bool = _var(
        "PSRING_NATIVE",
        True,
        parse_switch,
        "the C extension's hot loops (psring._native: the same-host boards' post, poll and fold, the TCP "
        "small-message exchange, the data plane's ring over TCP on one thread) where it "
        "was built; off: the pure-Python path (the same bits)",
        tuning=True,
    )
    # ------------------------------------------------------------ ring
    # The ring's defaults are the fastest of the alternatives measured side by side on 2 cores (the plane
    # from 8 MiB, 4 MiB pieces, 8 slots, spinning 500 us, the board up to 16 MiB): docs/defaults.md#ring.
    ring_piece: int = _var(
        "PSRING_RING_PIECE", 1 << 20, parse_bytes, "ring: pipeline piece on the event loop", tuning=True
    )
    ring_rooted_min: int = _var(
        "PSRING_RING_ROOTED_MIN",
        3,
        parse_count,
        "ring: world size from which small calls use a root (0: never)",
        tuning=True,
    )
    ring_tcp_mesh: int = _var(
        "PSRING_RING_TCP_MESH",
        16,
        parse_count,
        "ring: across hosts, jobs of up to this many ranks send small messages on TCP links of their own, "
        "read from the caller's thread (0: never)",
        tuning=True,
    )
    ring_board: int = _var(
        "PSRING_RING_BOARD",
        16 << 20,
        parse_bytes,
        "ring: all_reduces up to this size between ranks of one host go through shared-memory boards (0: never)",
        tuning=True,
    )
    ring_stream: int = _var(
        "PSRING_RING_STREAM",
        16 << 20,
        parse_bytes,
        "ring: all_reduces from this size between ranks of one host stream through the boards a block at a time, "
        "in C, where every rank offers it (0: never; else the plane)",
        tuning=True,
    )
    ring_threads: bool = _var(
        "PSRING_RING_THREADS", True, parse_switch, "ring: the threaded data plane for large all_reduces", tuning=True
    )
    ring_plane_min: int = _var(
        "PSRING_RING_PLANE_MIN",
        8 << 20,
        parse_bytes,
        "ring: all_reduces from this size take the data plane",
        tuning=True,
    )
    ring_shm_min: int | None = _var(
        "PSRING_RING_SHM_MIN",
        None,
        parse_bytes,
        "ring: the same with shared-memory links and 3+ ranks (unset: 1M, or PSRING_RING_PLANE_MIN if that is set)",
        tuning=True,
    )
    # Over TCP the plane's threads beat the loop from far smaller sizes: docs/defaults.md#the-plane-over-tcp.
    ring_tcp_plane_min: int = _var(
        "PSRING_RING_TCP_PLANE_MIN",
        256 << 10,
        parse_bytes,
        "ring: the same with 4+ ranks whose links are TCP (ranks on several hosts, or PSRING_SAME_HOST=off); "
        "never above PSRING_RING_PLANE_MIN",
        tuning=True,
    )
    # In C the plane beats the loop from right above the one-hop sizes: docs/defaults.md#the-planes-job-in-c.
    ring_native_plane_min: int = _var(
        "PSRING_RING_NATIVE_PLANE_MIN",
        (64 << 10) + 1,
        parse_bytes,
        "ring: the same at any number of ranks whose links are TCP when every rank runs the plane's jobs in C "
        "(psring._native, PSRING_NATIVE); never above PSRING_RING_PLANE_MIN (the default: right above the "
        "one-hop sizes)",
        tuning=True,
    )
    # A busy machine's cores go to threads that sleep in the kernel: docs/defaults.md#the-planes-send-thread.
    ring_send_thread: int = _var(
        "PSRING_RING_SEND_THREAD",
        16 << 20,
        parse_bytes,
        "ring: the data plane's jobs in C from this size send from a thread of their own while the calling "
        "thread receives and folds, each sleeping in the kernel when it waits (0: never; a rank's own choice, "
        "the frames are the same)",
        tuning=True,
    )
    ring_send_thread_buf: int = _var(
        "PSRING_RING_SEND_THREAD_BUF",
        256 << 10,
        parse_bytes,
        "ring: the send buffer (SO_SNDBUF; the kernel doubles it) of the data plane's TCP link to the right "
        "while a job with a send thread runs (0: the kernel's own sizing; links whose rate x round trip is "
        "larger want more)",
        tuning=True,
    )
    # Two hops wait on peers twice a call, not 2(N-1) times, for the same bytes: the sizes where that won
    # are in docs/defaults.md#two-hops.
    ring_two_hop_min: int = _var(
        "PSRING_RING_TWO_HOP_MIN",
        48 << 10,
        parse_bytes,
        "ring: between hosts, all_reduces of 4+ ranks from this size (up to PSRING_RING_TWO_HOP; of 2 ranks: "
        "above 64 KiB, up to 1.5 MiB) take two hops "
        "over the TCP small-message links instead of the one-hop exchange or the data plane's ring (every rank "
        "must agree: the largest is used)",
        tuning=True,
    )
    ring_two_hop: int = _var(
        "PSRING_RING_TWO_HOP",
        4 << 20,
        parse_bytes,
        "ring: the largest all_reduce that takes two hops (and a ring chunk of at most 1 MiB: 4 MiB at 4 ranks; "
        "every rank must agree: the smallest is used; 0: never)",
        tuning=True,
    )
    ring_plane_piece: int = _var(
        "PSRING_RING_PLANE_PIECE", 4 << 20, parse_bytes, "ring: the data plane's piece", tuning=True
    )
    ring_shm_slots: int = _var(
        "PSRING_RING_SHM_SLOTS",
        8,
        parse_count,
        "ring: shared-memory slots per same-host data link (1-256)",
        tuning=True,
    )
    # ------------------------------------------------------------ parameter server
    # Fewer, larger pieces cost less CPU on one host: docs/defaults.md#parameter-server.
    ps_piece: int = _var(
        "PSRING_PS_PIECE",
        4 << 20,
        parse_bytes,
        "ps: the unit pushed, folded and pulled (workers = servers)",
        tuning=True,
    )
    # Between hosts a shard answers a piece only once every worker's copy is in, so a slice of one piece
    # crosses the link twice in a row; smaller pieces overlap the two: docs/defaults.md#parameter-server.
    ps_wire_piece: int = _var(
        "PSRING_PS_WIRE_PIECE",
        256 << 10,
        parse_bytes,
        "ps: where some worker reaches a shard on another host, a collective goes in pieces small enough for "
        "8 per shard's slice, down to this size (0: PSRING_PS_PIECE throughout)",
        tuning=True,
    )
    # More pieces help slow links and cost CPU on fast ones: docs/defaults.md#parameter-server.
    ps_wire_pieces: int | None = _var(
        "PSRING_PS_WIRE_PIECES",
        None,
        parse_auto(parse_positive),
        "ps: where some worker reaches a shard on another host, the pieces of each shard's slice (more: a "
        "shorter first and last piece on slow links, more CPU per byte; every worker must agree). "
        "auto: 8, or 32 where the links rank 0 measures at set-up run at 2.5 Gbit/s or less",
        tuning=True,
    )
    # Small send buffers share a link evenly among the flows that cross it, but cap a connection at
    # buffer / round trip: only where they cover the link (docs/defaults.md#parameter-server).
    ps_sndbuf: int | None = _var(
        "PSRING_PS_SNDBUF",
        None,
        parse_auto(parse_bytes),
        "ps: the kernel send buffer (SO_SNDBUF) of every connection between a worker and a shard on another "
        "host, both ends (small: the flows that share a link take even shares; 0: the kernel sizes it). "
        "auto: 128K where the links rank 0 measures at set-up run at 10 Gbit/s or less and 4 round trips "
        "of them fit in it, else 0",
        tuning=True,
    )
    ps_host_reduce: int = _var(
        "PSRING_PS_HOST_REDUCE",
        256 << 10,
        parse_bytes,
        "ps across hosts with several ranks on each: all_reduces from this size are reduced within each host "
        "before they are pushed, as BytePS does (0: off; needs PSRING_HIERARCHICAL not off)",
    )
    ps_host_block: int = _var(
        "PSRING_PS_HOST_BLOCK",
        8 << 20,
        parse_bytes,
        "ps: the bytes of a block of a host-reduced all_reduce (two in flight, each rank's board holds two)",
        tuning=True,
    )
    ps_shm_slots: int = _var(
        "PSRING_PS_SHM_SLOTS", 16, parse_count, "ps: slots in a process's shared-memory pool (0: none)", tuning=True
    )
    ps_shm_min: int = _var(
        "PSRING_PS_SHM_MIN", 256 << 10, parse_bytes, "ps: pieces from this size travel in shared memory", tuning=True
    )
    server_backlog: int = _var(
        "PSRING_SERVER_BACKLOG",
        1 << 30,
        parse_bytes,
        "ps: a worker not reading past this many bytes is dropped",
        tuning=True,
    )
    server_buffer: int = _var(
        "PSRING_SERVER_BUFFER",
        512 << 20,
        parse_bytes,
        "ps: a worker's pushes wait unread past this many bytes",
        tuning=True,
    )
    max_tensor: int = _var(
        "PSRING_MAX_TENSOR", 64 << 30, parse_bytes, "ps: the largest tensor a server accepts", tuning=True
    )
    # ------------------------------------------------------------ GPU
    gpu_overlap: bool = _var(
        "PSRING_GPU_OVERLAP",
        False,
        parse_switch,
        "cupy all_reduce: copy off the device while the network runs",
        tuning=True,
    )

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode("utf-8", "surrogateescape") if self.secret else None

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    @property
    def spin_s(self) -> float:
        return self.spin_us / 1e6

    @property
    def ring_shm_plane_min(self) -> int:
        return self.ring_shm_min if self.ring_shm_min is not None else 1 << 20

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def variables() -> list[dataclasses.Field[Any]]:
    """The fields of Settings, each one PSRING_* variable."""
    return [f for f in dataclasses.fields(Settings) if "env" in f.metadata]


def load(env: Mapping[str, str]) -> Settings:
    """Resolve every variable in ``env``; a bad value raises ValueError naming the variable."""
    values: dict[str, Any] = {}
    for f in variables():
        name = f.metadata["env"]
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            values[f.name] = f.metadata["parse"](raw.strip())
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from None
    if values.get("checksum") == "none":
        values["checksum"] = None
    if "ring_shm_min" not in values and "ring_plane_min" in values:
        values["ring_shm_min"] = values["ring_plane_min"]  # one knob moves both thresholds
    if not 1 <= values.get("ring_shm_slots", 8) <= 256:
        raise ValueError(f"PSRING_RING_SHM_SLOTS={env.get('PSRING_RING_SHM_SLOTS')!r} must be 1 to 256")
    if values.get("checksum") == "crc32c":
        try:
            import crc32c  # noqa: F401
        except ImportError:
            raise ValueError("PSRING_CHECKSUM=crc32c needs the crc32c package (pip install crc32c)") from None
    if not values.get("secret") and values.get("secret_file"):
        values["secret"] = _read_secret_file(values["secret_file"])
    return Settings(**values)


def child_env(env: Mapping[str, str], **changes: Any) -> dict[str, str]:
    """``env`` with the settings named in ``changes`` (Settings' field names) written as their
    PSRING_* variables (None: not given, ``env``'s stays), checked by resolving the result: the one channel a
    launcher hands its children their job's settings through (``psring train --timeout 30``
    becomes PSRING_TIMEOUT=30 for every rank, shard and the launcher's own waits alike)."""
    fields = {f.name: f for f in variables()}
    out = dict(env)
    for name, value in changes.items():
        if name not in fields:
            raise TypeError(f"child_env: no setting named {name!r}")
        var = fields[name].metadata["env"]
        if value is None:
            continue
        if isinstance(value, bool):
            out[var] = "1" if value else "0"
        else:
            out[var] = repr(value) if isinstance(value, float) else str(value)
    load(out)  # a value its children could not read fails here, in the launcher, once
    return out


def _read_secret_file(path: str) -> str:
    try:
        with open(path) as fh:
            secret = fh.read().strip()
    except OSError as exc:
        raise ValueError(f"PSRING_SECRET_FILE={path!r} cannot be read: {exc}") from None
    if not secret:
        raise ValueError(f"PSRING_SECRET_FILE={path!r} is empty")
    return secret


_lock = threading.Lock()
_cache: tuple[tuple[tuple[str, str], ...], Settings] | None = None


def current() -> Settings:
    """The process environment's settings, resolved once per distinct set of PSRING_* values."""
    global _cache
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PSRING_")))
    cached = _cache
    if cached is not None and cached[0] == key:
        return cached[1]
    resolved = load(dict(key))
    with _lock:
        _cache = (key, resolved)
    return resolved


#: variables of the launchers psring works under (torchrun, Slurm, Kubernetes, its own)
SCHEDULER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODEID",
    "SLURM_JOB_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "KUBERNETES_SERVICE_HOST",
    "HOSTNAME",
    "JOB_COMPLETION_INDEX",
)


def scheduler_env() -> dict[str, str]:
    """The launcher variables set in this process (a snapshot)."""
    return {k: os.environ[k] for k in SCHEDULER_VARIABLES if k in os.environ}


def process_env() -> dict[str, str]:
    """A copy of this process's whole environment, for a launcher to hand to the processes it starts."""
    return dict(os.environ)


def _shown(f: dataclasses.Field[Any]) -> str:
    """A field's default as a user would write it."""
    default = f.default
    if default is None:
        return "auto" if f.metadata["parse"].__name__ == "parse_or_auto" else "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if f.metadata["parse"] is parse_bytes and isinstance(default, int) and default:
        for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if default % scale == 0:
                return f"{default // scale}{unit}"
    return str(default)


def help_text() -> str:
    """The table ``psring --help-env`` prints."""
    lines = ["psring reads these environment variables (explicit arguments and flags win over them):", ""]
    width = max(len(f.metadata["env"]) for f in variables())
    for f in variables():
        tag = "  [tuning]" if f.metadata["tuning"] else ""
        lines.append(f"  {f.metadata['env']:<{width}}  {_shown(f):>7}  {f.metadata['meaning']}{tag}")
    lines += [
        "",
        "The middle column is the default. [tuning]: a measured default; change it only to measure something else.",
        "Launcher variables read too: " + ", ".join(SCHEDULER_VARIABLES) + ".",
    ]
    return "\n".join(lines)


def markdown() -> str:
    """docs/settings.md, generated from this module (a test keeps the file in step with it)."""
    lines = [
        "# Settings",
        "",
        "Every environment variable psring reads, generated from `psring/settings.py` (the one module that",
        "reads the environment); `psring --help-env` prints the same table. Explicit arguments and",
        "command-line flags win over these; a bad value stops the process with the variable's name and",
        "what was expected. *Tuning* variables have measured defaults: change them only to measure",
        "something else.",
        "",
        "| variable | default | meaning | tuning |",
        "|---|---|---|---|",
    ]
    for f in variables():
        meaning = f.metadata["meaning"].replace("|", "\\|")
        lines.append(f"| `{f.metadata['env']}` | {_shown(f)} | {meaning} | {'yes' if f.metadata['tuning'] else ''} |")
    lines += [
        "",
        "The launcher variables psring reads, with torch.distributed's, Slurm's and Kubernetes' meanings:",
        ", ".join(f"`{v}`" for v in SCHEDULER_VARIABLES) + ".",
        "",
    ]
    return "\n".join(lines)


__all__ = [
    "TOPOLOGY_NAMES",
    "Settings",
    "current",
    "help_text",
    "load",
    "markdown",
    "process_env",
    "scheduler_env",
    "variables",
]
