"""The cluster commands: ``psring worker``, ``submit``, ``status``, ``doctor``, ``trace`` (and ``server --cluster``)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import re
import sys
from typing import Any

from ..cluster.client import Client
from ..cluster.daemons import ServerDaemon, WorkerDaemon, _Daemon
from ..cluster.doctor import doctor, job_report
from ..cluster.trace import read_events, to_chrome_trace
from ..core.arrays import keep_freed_memory
from ..errors import PsringError
from ..settings import TOPOLOGY_NAMES, Settings
from ..transport.loop import new_event_loop
from .train import add_train_flags, print_summary, train_settings


# ------------------------------------------------------------------------ CLI
def _run(coro: Any) -> Any:

    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _serve(daemon: _Daemon, label: str) -> int:
    keep_freed_memory()  # a daemon's process is psring's: reuse freed memory (see keep_freed_memory)
    faulthandler.enable()  # a crash leaves every thread's stack in the daemon's log
    try:
        _run(daemon.serve())  # type: ignore[attr-defined]
    except (PsringError, OSError) as exc:
        if daemon.signalled_by is not None:  # told to stop, and its store was away: a clean stop all the same
            print(f"psring {label} {daemon.id}: stopped ({daemon.signalled_by}; {exc})", flush=True)
            return 0
        print(f"psring {label}: {exc}", flush=True)
        return 1
    return 0


def _daemon_args(args: Any) -> dict[str, Any]:
    return {
        "secret": args.secret,
        "host": args.host,
        "port": args.port,
        "advertise": args.advertise,
        "name": args.name,
        "metrics_port": args.metrics_port,
    }


def cli_worker(args: Any) -> int:
    return _serve(WorkerDaemon(args.store, trace_dir=args.trace_dir, **_daemon_args(args)), "worker")


def cli_server_daemon(args: Any) -> int:
    return _serve(ServerDaemon(args.store, checkpoint_dir=args.checkpoint_dir, **_daemon_args(args)), "server")


def cli_submit(args: Any) -> int:
    train = train_settings(args)
    try:
        extra = json.loads(args.args) if args.args else {}
    except ValueError as exc:
        print(f"psring submit: --args is not JSON: {exc}", flush=True)
        return 2
    try:
        client = Client(args.store, secret=args.secret)
    except (PsringError, OSError) as exc:
        print(f"psring submit: {exc}", flush=True)
        return 1
    try:
        job = client.submit(
            args.topology,
            args.workers,
            servers=args.servers,
            entrypoint=args.entrypoint,
            args=extra,
            train=train,
            wait_for_workers=not args.no_wait,
            timeout=args.timeout,
            max_restarts=args.max_restarts,
            elastic=args.elastic,
        )
        print(f"psring submit: job {job.id} placed ({args.topology}, {args.workers} workers)", flush=True)
        for rec in job.stream():
            if "restart" in rec:
                print(f"psring submit: {rec['why']}; restarting (restart {rec['restart']} of {rec['of']})", flush=True)
                continue
            text = f"epoch {rec.get('epoch')} step {rec.get('step')}/{rec.get('total')} loss {rec.get('loss', 0):.4f}"
            if "acc" in rec:
                text += f" acc {rec['acc']:.4f}"
            print(f"[job {job.id}] {text}", flush=True)
        result = job.wait()
    except PsringError as exc:
        print(f"psring submit: {exc}", flush=True)
        return 1
    except ValueError as exc:  # the job's arguments (Client.submit checks them before anything runs)
        print(f"psring submit: {exc}", flush=True)
        return 2
    finally:
        client.close()
    if args.entrypoint is None and isinstance(result, dict) and "test_accuracy" in result:
        print_summary(result)
    else:
        print(json.dumps(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def cli_dashboard(args: Any) -> int:
    import asyncio
    import signal

    from ..cluster.dashboard import Dashboard

    def fail(message: str) -> int:
        print(f"psring dashboard: {message}", file=sys.stderr, flush=True)
        return 2

    token = None
    if args.token_file:
        try:
            with open(args.token_file) as fh:
                token = fh.read().strip()
        except OSError as exc:
            return fail(f"--token-file {args.token_file}: {exc.strerror or exc}")
        if not token:
            return fail(f"--token-file {args.token_file} is empty")
    try:
        dash = Dashboard(
            args.store, args.secret, host=args.page_host, port=args.page_port, expose=args.expose, token=token,
            interval=args.interval,
        )  # fmt: skip
    except ValueError as exc:
        return fail(str(exc))

    async def run() -> int:
        try:
            await dash.start()
        except (PsringError, OSError, ValueError) as exc:
            with contextlib.suppress(Exception):  # cleanup before reporting the start's failure
                await dash.close()
            return fail(str(exc))
        print(f"psring dashboard: {dash.url} (store {args.store})", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await dash.close()
        return 0

    loop = new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def cli_status(args: Any) -> int:
    try:
        client = Client(args.store, secret=args.secret)
    except (PsringError, OSError) as exc:
        print(f"psring status: {exc}", flush=True)
        return 1
    try:
        status = client.status()
    finally:
        client.close()
    if args.json:
        print(json.dumps(status))
        return 0
    print(f"{'role':8} {'id':40} {'address':24} {'state':9} job")
    for role in ("workers", "servers"):
        for r in status[role]:
            print(
                f"{role[:-1]:8} {r['id']:40} {str(r['host']) + ':' + str(r['port']):24} {r['state']:9} {r.get('job')}"
            )
    for j in status["jobs"]:
        restarts = f", {j.get('attempt')} restart(s)" if j.get("attempt") else ""
        print(
            f"job {j['id']}: {j['state']} {j['topology']} {len(j.get('workers', []))} workers {j.get('kind')}{restarts}"
        )
        if j.get("reason"):
            print(f"  {j['reason']}")
    return 0


def cli_doctor(args: Any) -> int:
    if args.job is not None:
        lines, stuck = _run(job_report(args.store, args.job, args.secret, timeout=args.check_timeout))
        for line in lines:
            print(line, flush=True)
        return 1 if stuck else 0
    problems = _run(doctor(args.store, args.secret, timeout=args.check_timeout))
    for p in problems:
        print(f"problem: {p}", flush=True)
    if not problems:
        print("psring doctor: no problems found", flush=True)
    return 1 if problems else 0


def cli_trace(args: Any) -> int:

    events = read_events(args.dir)
    if not events:
        print(f"psring trace: no event logs (*.jsonl) in {args.dir}", flush=True)
        return 1
    with open(args.output, "w") as fh:
        json.dump(to_chrome_trace(events), fh)
    ranks = {(e.get("job"), e["rank"]) for e in events}
    print(f"psring trace: {len(events)} collectives of {len(ranks)} rank(s) -> {args.output}", flush=True)
    return 0


def cli_advise(args: Any) -> int:
    from ..cluster import advise as adv

    def fail(message: str) -> int:
        print(f"psring advise: {message}", file=sys.stderr, flush=True)
        return 2

    def names(text: str) -> list[str]:
        return [n.strip() for n in text.split(",") if n.strip()]

    try:
        sizes = adv.parse_sizes(args.sizes) if args.sizes else adv.model_sizes(args.model or "mlp")
        server_names: list[str] | None = None  # --server-hosts as host names
        server_count: int | None = None
        if args.server_hosts is not None:
            if re.fullmatch(r"\s*-?\d+\s*", args.server_hosts):
                server_count = int(args.server_hosts)
                if server_count < 0:
                    return fail(f"--server-hosts must be >= 0, got {server_count}")
            else:
                server_names = names(args.server_hosts)
                if not server_names or len(set(server_names)) != len(server_names):
                    return fail(f"--server-hosts {args.server_hosts!r}: give a count or distinct host names")
        if args.hosts is not None:
            m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", args.hosts)
            worker_names = None if m else names(args.hosts)
            half_count = re.match(r"\s*\d+\s*[xX]", args.hosts) is not None  # "4x", "2x4x": a count gone wrong
            if not m and (
                half_count or not worker_names or not all(re.fullmatch(r"[\w.:\-]+", n) for n in worker_names)
            ):
                return fail(f"--hosts {args.hosts!r}: give N, NxR (N hosts, R ranks each) or host names, "
                            "e.g. 4, 2x4 or node1,node2")  # fmt: skip
            if args.rate is None:
                return fail("--hosts needs --rate (each host's link: 1gbit, 25gbit, ...)")
            links = adv.Links(adv.parse_seconds(args.latency), adv.parse_rate(args.rate))
            if m:
                hosts, per_host = int(m[1]), int(m[2] or 1)
            else:
                assert worker_names is not None
                if len(set(worker_names)) != len(worker_names):
                    return fail(f"--hosts {args.hosts!r} names a host twice")
                hosts, per_host = len(worker_names), args.ranks_per_host
                taken = sorted(set(server_names or ()) & set(worker_names))
                if taken:
                    return fail(f"--server-hosts names {', '.join(taken)}, which --hosts runs workers on: "
                                "a server host must be free of workers")  # fmt: skip
            servers = server_count if server_count is not None else len(server_names or ())
            measured = None
        else:
            if args.store is None:
                return fail("give --store HOST:PORT (measure a cluster's links) or --hosts N|NxR|names --rate R")
            if args.rate is not None:
                return fail("--rate describes hosts (--hosts); with --store the links are measured")
            measured, servers_seen = _probe_cluster(args, server_names)
            hosts = len(set(measured["hosts"]))
            per_host = max(measured["hosts"].count(h) for h in set(measured["hosts"]))
            links = adv.fit_links(measured["world"], tuple(measured["small"]), tuple(measured["large"]))
            if hosts == 1:  # every rank on one host: what was measured is the local path
                links = adv.Links(links.latency, links.bandwidth, links.latency, links.bandwidth, links.per_message)
            if server_names is not None:
                servers = len(server_names)
            else:
                servers = servers_seen if server_count is None else server_count
        layout = adv.Layout(hosts, per_host, servers, args.straggler_ms / 1e3, args.backup)
        if args.step_ms is not None and not args.step_ms > 0:
            return fail(f"--step-ms must be a positive time (one step's compute, ms), got {args.step_ms}")
        result = adv.advise(sizes, layout, links, None if args.step_ms is None else args.step_ms / 1e3)
    except ValueError as exc:
        return fail(str(exc))
    if measured is not None:
        result["measured"] = measured
    if args.json:
        print(json.dumps(result), flush=True)
        return 0
    lay = result["layout"]
    step = links.latency + links.per_message
    print(
        f"{lay['workers']} workers on {lay['hosts']} host(s) ({lay['ranks_per_host']} each), "
        f"{lay['server_hosts']} host(s) free for servers; links: {step * 1e6:.0f} us a message, "
        f"{links.bandwidth * 8 / 1e9:.2f} Gbit/s each way" + (" (measured)" if measured else " (as told)")
    )
    print(f"a step's tensors: {len(sizes)}, {sum(sizes) / (1 << 20):.2f} MiB in all")
    for name, t in sorted(result["predicted_s"].items(), key=lambda kv: kv[1]):
        mark = "  <- recommended" if name == result["recommended"] else ""
        if name in result["model_only"]:
            mark = f"  (the model only: {result['model_only'][name]})"
        print(f"  {name:<16} {t * 1e3:10.2f} ms{mark}")
    print(f"recommended: {result['recommended']}: {result['reason']}")
    print("run it with: " + " ".join(f"{k}={v}" for k, v in result["settings"].items()))
    comp = result["compression"]
    print(f"compression: {comp['reason']}" + (f" (compression={comp['recommended']!r})" if comp["recommended"] else ""))
    local = result["local_steps"]
    if local is None:
        print("local steps: give --step-ms (one step's compute) for how often to talk (SyncSGD(local_steps=H))")
    else:
        flags = f"--local-steps {local['local_steps']}"
        flags += f" --fragments {local['fragments']}" if local["fragments"] > 1 else ""
        flags += f" --compression {local['compression']}" if local["compression"] else ""
        print(f"local steps: {local['reason']}" + (f" (psring train {flags})" if local["local_steps"] > 1 else ""))
    k, n = lay["server_hosts"], lay["workers"]
    # a shard sets the send buffers of its end itself
    env = "".join(f"{key}={value} " for key, value in result["settings"].items() if key == "PSRING_PS_SNDBUF")
    if result["recommended"] == "ps dedicated":
        print(f"  and on server host i (0 to {k - 1}): {env}psring server --store HOST:PORT --shard i --num-shards {k}")
    elif result["recommended"] == "BytePS split":
        print(
            f"  and on server host i (0 to {k - 1}): {env}psring server --store HOST:PORT --shard {n}+i "
            f"--num-shards {n + k}"
        )
    return 0


def _probe_cluster(args: Any, server_names: list[str] | None) -> tuple[dict[str, Any], int]:
    """Run the probe on the cluster's idle workers: the measured times and the hosts free for
    servers (server daemons' hosts without a worker). Server host names that a worker daemon runs
    on are refused before anything runs."""
    with Client(args.store, secret=args.secret) as client:
        status = client.status()
        live = [w for w in status["workers"] if w["state"] != "lost"]
        worker_hosts = {w["host"] for w in live} | {w.get("hostname", "") for w in live} - {""}
        taken = sorted(set(server_names or ()) & worker_hosts)
        if taken:
            raise ValueError(f"--server-hosts names {', '.join(taken)}, where a worker daemon of {args.store} "
                             "runs: a server host must be free of workers")  # fmt: skip
        idle = [w for w in status["workers"] if w["state"] == "idle"]
        workers = args.workers if args.workers is not None else len(idle)
        if workers < 2:
            raise ValueError(f"the probe needs at least 2 idle worker daemons at {args.store}; {len(idle)} are idle")
        measured = client.submit("ring", workers, entrypoint="psring.cluster.advise:probe").wait(timeout=600)
        servers = len({s["host"] for s in status.get("servers", []) if s.get("state") != "lost"} - worker_hosts)
    return measured, servers


def register(sub: argparse._SubParsersAction, env: Settings) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter

    def common(p: Any) -> None:
        p.add_argument("--store", default=env.store, required=env.store is None, help="the store (PSRING_STORE)")
        p.add_argument("--secret", default=env.secret, help="shared secret (PSRING_SECRET, PSRING_SECRET_FILE)")

    p = sub.add_parser("worker", help="worker daemon: registers, waits for jobs, runs them", formatter_class=fmt)
    common(p)
    p.add_argument("--host", default=env.bind_host or "0.0.0.0", help="bind address (PSRING_BIND_HOST)")
    p.add_argument("--port", type=int, default=env.port, help="declared port (PSRING_PORT)")
    p.add_argument("--advertise", default=env.advertise_host, help="address others use (PSRING_ADVERTISE_HOST)")
    p.add_argument("--name", default=env.name, help="daemon id (default host-pid-random; PSRING_NAME)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--trace-dir", default=env.trace_dir, help="write per-collective event logs (PSRING_TRACE_DIR)")
    p.set_defaults(func=cli_worker)

    p = sub.add_parser("submit", help="run a training job on a running cluster", formatter_class=fmt)
    common(p)
    p.add_argument("--topology", choices=TOPOLOGY_NAMES, default=env.topology, help="PSRING_TOPOLOGY")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=env.servers, help="parameter-server shards (ps; PSRING_SERVERS)")
    p.add_argument("--dataset", choices=("digits",), default="digits")
    add_train_flags(p)
    p.add_argument("--entrypoint", default=None, help="package.module:function run on every worker with a Group")
    p.add_argument("--args", default=None, help="JSON keyword arguments for the entrypoint")
    p.add_argument("--no-wait", action="store_true", help="fail at once if not enough idle daemons")
    p.add_argument("--timeout", type=float, default=env.timeout, help="seconds for any one collective (PSRING_TIMEOUT)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a rank fails, stop every rank and place the job again, up to this many times",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="the main job: save a checkpoint every N optimizer steps"
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="a rank that fails or whose daemon is lost does not stop the others (the main job: SyncSGD(elastic=True), "
        "ring or ps); not with --max-restarts",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cli_submit)

    p = sub.add_parser("status", help="daemons and jobs of a cluster", formatter_class=fmt)
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cli_status)

    p = sub.add_parser(
        "doctor", help="pre-flight checks of a cluster; --job: what a running job's ranks wait in", formatter_class=fmt
    )
    common(p)
    p.add_argument(
        "--timeout", dest="check_timeout", type=float, default=5.0, help="seconds each check may take"
    )
    p.add_argument(
        "--job",
        default=None,
        help="a cluster job's id, or a job's name (PSRING_JOB): print what its ranks wait in (exit 1 if stuck)",
    )
    p.set_defaults(func=cli_doctor)

    p = sub.add_parser(
        "dashboard", help="a live web page of a cluster (read only), and its JSON API", formatter_class=fmt
    )
    common(p)
    p.add_argument(
        "--host", dest="page_host", default="127.0.0.1", help="the page's address; anything but loopback needs --expose"
    )
    p.add_argument("--port", dest="page_port", type=int, default=8265, help="the page's port (0: any free one)")
    p.add_argument(
        "--expose", action="store_true", help="allow a non-loopback --host; every request then needs the token"
    )
    p.add_argument("--token-file", default=None, help="with --expose: read the token here instead of making one")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads of the store")
    p.set_defaults(func=cli_dashboard)

    p = sub.add_parser(
        "advise",
        help="measure the links (--store) or take them as told (--hosts), predict each topology, recommend one",
        formatter_class=fmt,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--store", default=env.store,
        help="a cluster's store: probe its idle worker daemons' links with a ring job (PSRING_STORE)",
    )  # fmt: skip
    where.add_argument("--hosts", help="describe hosts instead: N or NxR (N hosts, R ranks each), with --rate")
    p.add_argument("--secret", default=env.secret, help="shared secret (PSRING_SECRET, PSRING_SECRET_FILE)")
    p.add_argument("--workers", type=int, default=None, help="--store: probe this many workers (default: all idle)")
    p.add_argument("--rate", default=None, help="--hosts: each host's link rate (1gbit, 25gbit, 125MB)")
    p.add_argument("--latency", default="50us", help="--hosts: one message's latency between hosts")
    p.add_argument(
        "--server-hosts", default=None,
        help="hosts free for servers (no worker on them): a count or host names; "
        "--store: by default the server daemons on hosts without a worker",
    )  # fmt: skip
    p.add_argument("--ranks-per-host", type=int, default=1, help="--hosts as names: ranks on each")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--sizes", default=None, help="the step's tensors (bytes; 25M,4M,...); default the main job's")
    what.add_argument("--model", default=None, help="mlp, embed (psring train's), or a torch module pkg.mod:attr")
    p.add_argument("--straggler-ms", type=float, default=0.0, help="a rank late by a uniform 0-2x this, each step")
    p.add_argument("--backup", type=int, default=1, help="backup workers the ps would run with, where stragglers are")
    p.add_argument("--step-ms", type=float, default=None,
                   help="one training step's compute (ms): advise local SGD's H, fragments and codec too")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cli_advise)

    p = sub.add_parser("trace", help="turn event logs into a Chrome trace", formatter_class=fmt)
    p.add_argument("dir", help="directory of *.jsonl event logs (PSRING_TRACE_DIR, --trace-dir)")
    p.add_argument("-o", "--output", default="psring-trace.json")
    p.set_defaults(func=cli_trace)
