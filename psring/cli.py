"""The ``psring`` command line: store, launch, bench (and the jobs built on them).

Every option that has an environment variable names it in its help; the
environment is read once, here, and passed down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from . import cluster
from .facade import new_event_loop


def _run(coro: object) -> int:
    loop = new_event_loop()
    try:
        return int(loop.run_until_complete(coro) or 0)  # type: ignore[arg-type]
    finally:
        loop.close()


async def _serve_store(host: str, port: int, secret: str | None) -> int:
    from .store import start_store

    server = await start_store(host, port, secret=secret.encode() if secret else None)
    print(f"psring store listening on {host}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    return _run(_serve_store(args.host, args.port, args.secret))


async def _serve_shards(args: argparse.Namespace) -> int:
    from .config import advertise_host, routable_host_towards
    from .server import serve_forever, start_servers
    from .store import connect_store, parse_store_address

    secret = args.secret.encode() if args.secret else None
    address = parse_store_address(args.store)
    if args.shard is not None:
        num = args.num_shards or args.shards
        ids = [args.shard]
    else:
        num, ids = args.shards, None
    if num is None or num < 1:
        raise ValueError(f"--shards must be at least 1, got {num}")
    store = await connect_store(address, secret=secret, timeout=args.timeout, role="server")
    advertise = os.environ.get("PSRING_ADVERTISE_HOST") or (
        routable_host_towards(address.host) if address.scheme == "tcp" else advertise_host()
    )
    server = await start_servers(
        store,
        num,
        job=args.job,
        secret=secret,
        host=args.host,
        port=args.port,
        advertise=advertise,
        shard_ids=ids,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        restore=args.restore,
    )
    restored = sum(len(s.params.buckets) for s in server.shards.values() if s.params is not None) if args.restore else 0
    print(
        f"psring server: shard(s) {sorted(server.shards)} of {num} for job {args.job!r} on {server.address}"
        + (f", restored {restored} bucket(s) from {args.checkpoint_dir}" if args.restore else ""),
        flush=True,
    )
    await serve_forever(server)
    return 0


def _cmd_server(args: argparse.Namespace) -> int:
    if args.cluster:
        from .cluster import cli_server_daemon

        return cli_server_daemon(args)
    return _run(_serve_shards(args))


def _cmd_launch(args: argparse.Namespace) -> int:
    from .launch import launch

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
    env = dict(os.environ)
    if args.servers is not None:
        env["PSRING_SERVERS"] = str(args.servers)
    if args.colocate:
        env["PSRING_PS_COLOCATE"] = "1"
    try:
        return _run(launch(args.n, cmd, topology=args.topology, env=env))
    except KeyboardInterrupt:
        return 130


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import cli

    return cli(args)


def _cmd_bench_sgd(args: argparse.Namespace) -> int:
    from .bench import cli_sgd

    return cli_sgd(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psring", description="Synchronous data-parallel SGD over a ring or a parameter server."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("store", help="run a rendezvous store", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default=os.environ.get("PSRING_HOST", "0.0.0.0"), help="address to bind (PSRING_HOST)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PSRING_PORT") or 29500), help="port (PSRING_PORT)")
    p.add_argument("--secret", default=os.environ.get("PSRING_SECRET"), help="shared secret (PSRING_SECRET)")
    p.set_defaults(func=_cmd_store)

    p = sub.add_parser(
        "server",
        help="run parameter-server shard(s) for the ps topology",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", required=True, help="the store, HOST:PORT (or tcp://, file://)")
    p.add_argument("--shards", type=int, default=1, help="shards this process hosts (all of them)")
    p.add_argument("--shard", type=int, default=None, help="host only shard i (with --num-shards)")
    p.add_argument("--num-shards", type=int, default=None, help="total shards when --shard is given")
    p.add_argument("--host", default=os.environ.get("PSRING_BIND_HOST", "0.0.0.0"), help="bind (PSRING_BIND_HOST)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PSRING_PORT") or 0), help="port (PSRING_PORT)")
    p.add_argument("--job", default=os.environ.get("PSRING_JOB", "default"), help="job name (PSRING_JOB)")
    p.add_argument("--secret", default=os.environ.get("PSRING_SECRET"), help="shared secret (PSRING_SECRET)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to reach the store")
    p.add_argument("--checkpoint-dir", default=None, help="write parameter-mode checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every K steps (and on SIGTERM)")
    p.add_argument("--restore", action="store_true", help="resume from the checkpoints in --checkpoint-dir")
    p.add_argument("--cluster", action="store_true", help="a server daemon: host the shards of submitted ps jobs")
    p.add_argument("--advertise", default=os.environ.get("PSRING_ADVERTISE_HOST"), help="address others use")
    p.add_argument("--name", default=os.environ.get("PSRING_NAME"), help="daemon id (--cluster)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.set_defaults(func=_cmd_server)

    p = sub.add_parser(
        "launch",
        help="run a command as N local ranks (torchrun-like)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-n", "--nproc", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument(
        "--topology",
        choices=("ring", "ps"),
        default=os.environ.get("PSRING_TOPOLOGY", "ring"),
        help="PSRING_TOPOLOGY for the ranks",
    )
    p.add_argument("--servers", type=int, default=None, help="parameter-server shards (ps; PSRING_SERVERS)")
    p.add_argument(
        "--colocate",
        action="store_true",
        help="ps: the ranks host the shards in their own processes, no server processes (PSRING_PS_COLOCATE=1)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("bench", help="benchmarks", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser(
        "allreduce",
        help="time all_reduce over N local processes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--topology", choices=("ring", "ps"), default="ring")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--servers", type=int, default=None, help="parameter-server shards (ps)")
    b.add_argument(
        "--colocate", action="store_true", help="ps: each worker process hosts its shards (PSRING_PS_COLOCATE=1)"
    )
    b.add_argument("--sizes", default="4,1M,16M,64M", help="comma-separated byte sizes (K, M, G suffixes)")
    b.add_argument("--dtype", default="float32")
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.add_argument("--plot", default=None, help="write a PNG of busbw against size")
    b.set_defaults(func=_cmd_bench)
    b = bsub.add_parser(
        "sgd",
        help="time SyncSGD steps on synthetic gradients of a realistic model shape",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--params", default="25M", help="total float32 parameters (K, M suffixes: decimal)")
    b.add_argument("--tensors", type=int, default=160, help="how many tensors they are split into")
    b.add_argument("--topology", choices=("ring", "ps"), default="ring")
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--servers", type=int, default=None, help="parameter-server shards (ps)")
    b.add_argument("--steps", type=int, default=5)
    b.add_argument("--compression", choices=("none", "fp16"), default="none", help="fp16: gradients as float16")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_bench_sgd)
    _register_jobs(sub)
    return parser


def _register_jobs(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Commands defined by higher layers (train, ...), when present."""
    try:
        from . import train
    except ImportError:
        return
    train.register(sub)
    cluster.register(sub)


def load_secret_file() -> None:
    """PSRING_SECRET_FILE (a Docker or Kubernetes secret mounted as a file) sets PSRING_SECRET."""
    path = os.environ.get("PSRING_SECRET_FILE")
    if path and not os.environ.get("PSRING_SECRET"):
        try:
            with open(path) as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise SystemExit(f"psring: PSRING_SECRET_FILE={path!r} cannot be read: {exc}") from None
        if not secret:
            raise SystemExit(f"psring: PSRING_SECRET_FILE={path!r} is empty")
        os.environ["PSRING_SECRET"] = secret


def main(argv: Sequence[str] | None = None) -> int:
    load_secret_file()
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"psring {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
