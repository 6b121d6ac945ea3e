"""``psring store``, ``psring server`` and ``psring launch``: the processes a job is made of."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from .. import settings as settings_mod
from ..rendezvous.launch import launch
from ..rendezvous.store import COMPACT_MIN_BYTES, start_store
from ..settings import TOPOLOGY_NAMES, Settings
from ..topology.ps.shards.server import run_shards
from ..transport.loop import new_event_loop
from .cluster import cli_server_daemon


def _bytes_arg(raw: str) -> int:
    try:
        return settings_mod.parse_bytes(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r}: {exc}") from None


def _run(coro: object) -> int:
    loop = new_event_loop()
    try:
        return int(loop.run_until_complete(coro) or 0)  # type: ignore[arg-type]
    finally:
        loop.close()


async def _serve_store(host: str, port: int, secret: str | None, data_dir: str | None, compact_bytes: int) -> int:
    server = await start_store(
        host, port, secret=secret.encode() if secret else None, data_dir=data_dir, compact_bytes=compact_bytes
    )
    kept = f", keeping its keys in {data_dir} (epoch {server.epoch})" if data_dir else ""
    print(f"psring store listening on {host}:{server.port}{kept}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    if args.compact_bytes < 1:
        raise ValueError(f"--compact-bytes {args.compact_bytes}: must be at least 1 byte")
    return _run(_serve_store(args.host, args.port, args.secret, args.data_dir, args.compact_bytes))


async def _serve_shards(args: argparse.Namespace) -> int:
    if args.shard is not None:
        num, ids = (args.num_shards or args.shards), [args.shard]
    else:
        num, ids = args.shards, None
    return await run_shards(
        args.store,
        num,
        shard_ids=ids,
        job=args.job,
        secret=args.secret.encode() if args.secret else None,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        restore=args.restore,
        store_timeout=args.store_timeout,
    )


def _cmd_server(args: argparse.Namespace) -> int:
    if args.cluster:
        return cli_server_daemon(args)
    for flag, value in (("--metrics-port", args.metrics_port), ("--name", args.name)):
        if value is not None and flag == "--metrics-port":
            raise ValueError(f"{flag} applies to a server daemon (--cluster); a standalone server has no metrics")
    return _run(_serve_shards(args))


def _cmd_launch(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(
            "psring launch: give the command to run after --, as in: psring launch -n 2 -- python train.py",
            file=sys.stderr,
        )
        return 2
    if args.n < 1:
        print(f"psring launch: -n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print(f"psring launch: --max-restarts must be 0 or more, got {args.max_restarts}", file=sys.stderr)
        return 2
    if args.elastic and args.max_restarts:
        print("psring launch: --elastic goes on without a failed rank; --max-restarts starts every rank again: "
              "give one of them", file=sys.stderr)  # fmt: skip
        return 2
    env = settings_mod.process_env()
    if args.servers is not None:
        env["PSRING_SERVERS"] = str(args.servers)
    if args.colocate:
        env["PSRING_PS_COLOCATE"] = "1"
    try:
        return _run(
            launch(
                args.n,
                cmd,
                topology=args.topology,
                env=env,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                master_addr=args.master_addr,
                master_port=args.master_port,
                max_restarts=args.max_restarts,
                elastic=args.elastic,
            )
        )
    except KeyboardInterrupt:
        return 130


def register(sub: argparse._SubParsersAction, env: Settings) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = sub.add_parser("store", help="run a rendezvous store", formatter_class=fmt)
    p.add_argument("--host", default=env.host or "0.0.0.0", help="address to bind (PSRING_HOST)")
    p.add_argument("--port", type=int, default=env.port or 29500, help="port (PSRING_PORT)")
    p.add_argument("--secret", default=env.secret, help="shared secret (PSRING_SECRET, PSRING_SECRET_FILE)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="keep the keys here (fsync'd log + snapshot): a restarted store has its job table back",
    )
    p.add_argument(
        "--compact-bytes",
        type=_bytes_arg,
        default=COMPACT_MIN_BYTES,
        help="--data-dir: compact the log into a snapshot once it is this large (bytes; 16M, 256K)",
    )
    p.set_defaults(func=_cmd_store)

    p = sub.add_parser("server", help="run parameter-server shard(s) for the ps topology", formatter_class=fmt)
    p.add_argument(
        "--store",
        default=env.store,
        required=env.store is None,
        help="the store, HOST:PORT (or tcp://, file://; PSRING_STORE)",
    )
    p.add_argument("--shards", type=int, default=1, help="shards this process hosts (all of them)")
    p.add_argument("--shard", type=int, default=None, help="host only shard i (with --num-shards)")
    p.add_argument("--num-shards", type=int, default=None, help="total shards when --shard is given")
    p.add_argument("--host", default=env.bind_host or "0.0.0.0", help="bind (PSRING_BIND_HOST)")
    p.add_argument("--port", type=int, default=env.port, help="port (PSRING_PORT)")
    p.add_argument("--job", default=env.job, help="job name (PSRING_JOB)")
    p.add_argument("--secret", default=env.secret, help="shared secret (PSRING_SECRET, PSRING_SECRET_FILE)")
    p.add_argument("--timeout", dest="store_timeout", type=float, default=60.0, help="seconds to reach the store")
    p.add_argument(
        "--checkpoint-dir",
        default=env.checkpoint_dir,
        help="write parameter-mode checkpoints here (PSRING_CHECKPOINT_DIR)",
    )
    p.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every K steps (and on SIGTERM)")
    p.add_argument("--restore", action="store_true", help="resume from the checkpoints in --checkpoint-dir")
    p.add_argument("--cluster", action="store_true", help="a server daemon: host the shards of submitted ps jobs")
    p.add_argument("--advertise", default=env.advertise_host, help="address others use (PSRING_ADVERTISE_HOST)")
    p.add_argument("--name", default=env.name, help="daemon id (--cluster; PSRING_NAME)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.set_defaults(func=_cmd_server)

    p = sub.add_parser(
        "launch", help="run a command as this node's ranks (torchrun's flags and env)", formatter_class=fmt
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="n", type=int, required=True, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (one launcher each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (node 0 serves the store)")
    p.add_argument("--master-addr", default=None, help="node 0's address, as the other nodes reach it")
    p.add_argument("--master-port", type=int, default=None, help="the store's port on node 0 (one node: ephemeral)")
    p.add_argument("--topology", choices=TOPOLOGY_NAMES, default=env.topology, help="PSRING_TOPOLOGY for the ranks")
    p.add_argument("--servers", type=int, default=env.servers, help="parameter-server shards (ps; PSRING_SERVERS)")
    p.add_argument(
        "--colocate",
        action="store_true",
        default=env.ps_colocate,
        help="ps: the ranks host the shards in their own processes, no server processes (PSRING_PS_COLOCATE=1)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="on a rank's failure stop every rank and start the job again, up to K times (torchrun's meaning)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="a rank that fails does not stop the others: an elastic job (SyncSGD(elastic=True)) goes on without "
        "it, and a worker may join it (init_group(join=True)); the launcher fails only if every rank did",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    p.set_defaults(func=_cmd_launch)
