"""``psring train``: the main job from the command line, with its progress display and summary."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from typing import Any

from .. import settings as settings_mod
from ..core import gpu
from ..core.codec import CODECS
from ..rendezvous.launch import launch
from ..settings import TOPOLOGY_NAMES, Settings
from ..training.compressors import compression_from
from ..training.job import PROGRESS, TRAIN_DEFAULTS, train_spec
from ..transport.loop import new_event_loop


class _Progress:
    """Rank 0's progress lines, shown in the parent: a live bar (tqdm, on stderr) when there is a
    terminal to redraw it on and tqdm is installed; else one plain line per epoch on stdout, so
    a log gets the epochs and no redraws."""

    def __init__(self, label: str, quiet: bool, live: bool | None = None) -> None:
        self.label = label
        self.quiet = quiet
        self.bar: Any = None
        self.live = sys.stderr.isatty() if live is None else live

    def __call__(self, line: str) -> bool:
        if not line.startswith(PROGRESS):
            return False
        if self.quiet:
            return True
        info = json.loads(line[len(PROGRESS) :])
        rate = info["step"] / max(info["elapsed"], 1e-9)
        text = f"epoch {info['epoch']} loss {info['loss']:.4f}" + (f" acc {info['acc']:.4f}" if "acc" in info else "")
        text += f" {rate:.0f} steps/s {info['mb']:.1f} MB"
        try:
            if not self.live:
                raise ImportError("no terminal: plain lines")
            from tqdm import tqdm
        except ImportError:
            if "acc" in info:
                print(f"[{self.label}] {text}", flush=True)
            return True
        if self.bar is None:
            self.bar = tqdm(total=info["total"], desc=self.label, unit="step", dynamic_ncols=True)
        self.bar.n = info["step"]
        self.bar.set_postfix_str(text, refresh=True)
        if "acc" in info:
            self.bar.write(f"[{self.label}] {text}")
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


EMBED_LR = 0.02  # the embed model's tables take the summed loss's gradient: a smaller step


def _compression(text: str) -> str:
    """--compression's value as given, once it names a codec or a compressor (argparse's error otherwise)."""
    if text == "none":
        return text
    try:
        made = compression_from(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if isinstance(made, str) and made not in CODECS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not none, a codec ({', '.join(CODECS)}), topk:RATIO or powersgd:RANK"
        )
    return text


def learning_rate(args: argparse.Namespace) -> float:
    """--lr, or the model's default."""
    return float(args.lr) if args.lr is not None else (EMBED_LR if args.model == "embed" else TRAIN_DEFAULTS["lr"])


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The main job's flags, shared by ``psring train`` and ``psring submit`` (defaults: TRAIN_DEFAULTS)."""
    d = TRAIN_DEFAULTS
    p.add_argument("--epochs", type=int, default=d["epochs"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="samples per worker per step")
    p.add_argument("--lr", type=float, default=None, help=f"default {d['lr']} (--model embed: {EMBED_LR})")
    p.add_argument("--momentum", type=float, default=d["momentum"])
    p.add_argument(
        "--optimizer", choices=("sgd", "adam"), default=d["optimizer"], help="sgd (with --momentum) or adam"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=d["device"])
    p.add_argument("--compression", type=_compression, default="none",
                   help=f"none, a codec ({', '.join(CODECS)}) or a compressor with error feedback "
                        "(topk:RATIO, powersgd:RANK)")  # fmt: skip
    p.add_argument("--accumulate", type=int, default=d["accumulate"], help="micro-batches per optimizer step")
    p.add_argument("--local-steps", type=int, default=d["local_steps"],
                   help="local SGD / DiLoCo: inner steps on each worker's own copy between exchanges (1: plain SGD)")
    p.add_argument("--outer-lr", type=float, default=d["outer_lr"], help="with --local-steps: the outer SGD's lr")
    p.add_argument("--outer-momentum", type=float, default=d["outer_momentum"],
                   help="with --local-steps: the outer SGD's (Nesterov) momentum")  # fmt: skip
    p.add_argument("--fragments", type=int, default=d["fragments"],
                   help="with --local-steps: streaming DiLoCo, the model in K fragments exchanged in turn, each "
                        "overlapping the next inner steps (1: the whole model at once)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument(
        "--model",
        choices=("mlp", "embed"),
        default=d["model"],
        help="mlp (digits) or embed (a recommendation model whose two embedding tables are sparse)",
    )


def train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The main job's settings from the flags add_train_flags added (and --checkpoint-every)."""
    return train_spec(
        {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": learning_rate(args),
            "momentum": args.momentum,
            "optimizer": args.optimizer,
            "compression": None if args.compression == "none" else args.compression,
            "accumulate": args.accumulate,
            "local_steps": args.local_steps,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "fragments": args.fragments,
            "device": args.device,
            "seed": args.seed,
            "checkpoint_every": args.checkpoint_every,
            "model": args.model,
        }
    )


def train_once(args: argparse.Namespace, topology: str, quiet: bool = False) -> dict[str, Any] | None:

    with tempfile.TemporaryDirectory(prefix="psring-train-") as tmp:
        spec = {
            **train_settings(args),
            "out": os.path.join(tmp, "summary.json"),
            "checkpoint_dir": args.checkpoint_dir,
            "checkpoint_every": args.checkpoint_every if args.checkpoint_dir else 0,
            "elastic": args.elastic,
            "backup": args.backup,
        }
        # the job's settings reach every rank, shard and the launcher's own waits one way: PSRING_*
        env = settings_mod.child_env(
            settings_mod.process_env(),
            topology=topology,
            timeout=args.timeout,
            servers=(args.servers or args.workers) if topology == "ps" else None,
        )
        cmd = [sys.executable, "-m", "psring.training", json.dumps(spec)]
        progress = _Progress(topology, quiet)
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(
                launch(
                    args.workers,
                    cmd,
                    topology=topology,
                    env=env,
                    prefix_output=False,
                    on_line=progress,
                    max_restarts=args.max_restarts,
                    elastic=args.elastic,
                )
            )
        finally:
            loop.close()
            progress.close()
        if code == 128 + signal.SIGTERM:  # told to stop: the launcher ended every rank; exit as told
            print("psring train: stopped by SIGTERM; every worker ended", file=sys.stderr)
            raise SystemExit(code)
        if code != 0:
            print(f"psring train: a worker failed (exit code {code})", file=sys.stderr)
            return None
        with open(spec["out"]) as fh:
            return json.load(fh)


def print_summary(summary: dict[str, Any]) -> None:
    print(
        f"\nsummary ({summary['topology']}, {summary['workers']} workers"
        + (f", {summary['servers']} server shards" if summary["topology"] == "ps" else "")
        + ")"
    )
    print(f"  test accuracy      {summary['test_accuracy']:.4f}")
    print(f"  final loss         {summary['final_loss']:.4f}")
    print(f"  wall time          {summary['wall_s']:.2f} s ({summary['steps']} steps)")
    print(
        f"  time per step      {summary['ms_per_step_compute']:.2f} ms compute + "
        f"{summary['ms_per_step_comm']:.2f} ms communication (incl. the update); compute use "
        f"{100 * summary.get('compute_use', 0.0):.1f}%"
    )
    steps = int(summary.get("steps") or 0)
    if steps and summary["bytes_per_worker"]:
        print(f"  bytes per step     {summary['bytes_per_worker'][0][0] / steps / 1e3:.2f} kB sent by worker 0")
    for r, (sent, received) in enumerate(summary["bytes_per_worker"]):
        print(f"  worker {r}           sent {sent / 1e6:.2f} MB, received {received / 1e6:.2f} MB")
    for i, (sent, received) in enumerate(summary.get("bytes_per_server", [])):
        print(f"  server shard {i}     sent {sent / 1e6:.2f} MB, received {received / 1e6:.2f} MB")
    print(f"  ranks bit-identical {summary['ranks_agree']}")
    backup = summary.get("backup")
    if backup:
        print(
            f"  backup workers     {backup['workers']}: late (gradients dropped) per worker {backup['late']} steps, "
            f"skipped {backup['skipped']}"
        )
    elastic = summary.get("elastic") or {}
    if elastic.get("departed") or elastic.get("joined"):
        print(
            f"  elastic            worker(s) {elastic.get('departed', [])} left, {elastic.get('joined', [])} joined "
            "(the result depends on who was there when)"
        )


def print_compare(results: dict[str, dict[str, Any]]) -> None:
    ring, ps = results["ring"], results["ps"]
    rows = [
        ("test accuracy", f"{ring['test_accuracy']:.4f}", f"{ps['test_accuracy']:.4f}"),
        ("final loss", f"{ring['final_loss']:.6f}", f"{ps['final_loss']:.6f}"),
        ("wall time (s)", f"{ring['wall_s']:.2f}", f"{ps['wall_s']:.2f}"),
        ("compute ms/step", f"{ring['ms_per_step_compute']:.2f}", f"{ps['ms_per_step_compute']:.2f}"),
        ("comm ms/step", f"{ring['ms_per_step_comm']:.2f}", f"{ps['ms_per_step_comm']:.2f}"),
        (
            "MB sent / worker",
            f"{ring['bytes_per_worker'][0][0] / 1e6:.2f}",
            f"{ps['bytes_per_worker'][0][0] / 1e6:.2f}",
        ),
        ("ranks bit-identical", str(ring["ranks_agree"]), str(ps["ranks_agree"])),
    ]
    same = ring["param_digest"] == ps["param_digest"]
    print("\ncomparison (same seed)")
    print(f"  {'':22}{'ring':>12}{'ps':>12}")
    for name, a, b in rows:
        print(f"  {name:22}{a:>12}{b:>12}")
    print(f"  ring and ps final parameters bit-identical: {same}")


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for topo, summary in results.items():
        steps = [h["step"] for h in summary["history"]]
        ax1.plot(steps, [h["loss"] for h in summary["history"]], marker="o", label=topo)
        ax2.plot(steps, [h["test_accuracy"] for h in summary["history"]], marker="o", label=topo)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax2.set_xlabel("step")
    ax2.set_ylabel("test accuracy")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    def bad(reason: str) -> int:
        print(f"psring train: {reason}", file=sys.stderr)
        return 2

    if args.workers < 1:
        return bad(f"--workers must be at least 1, got {args.workers}")
    if not args.timeout > 0:
        return bad(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.topology == "ring" and args.servers is not None and not args.compare:
        return bad("--servers applies to --topology ps only")
    if args.servers is not None and args.servers < 1:
        return bad(f"--servers must be at least 1, got {args.servers}")
    args.lr = learning_rate(args)
    if args.epochs < 1 or args.batch_size < 1 or not args.lr > 0:
        return bad("--epochs, --batch-size and --lr must be positive")
    if args.accumulate < 1:
        return bad(f"--accumulate must be at least 1, got {args.accumulate}")
    if args.local_steps < 1:
        return bad(f"--local-steps must be at least 1, got {args.local_steps}")
    if args.local_steps > 1 and (args.backup or args.model == "embed"):
        return bad("--local-steps takes no --backup and no --model embed (not yet)")
    if args.fragments < 1 or (args.fragments > 1 and args.fragments > args.local_steps):
        return bad(f"--fragments must be from 1 to --local-steps ({args.local_steps}), got {args.fragments}")
    if args.fragments > 1 and (args.elastic or args.checkpoint_dir or args.max_restarts):
        return bad("--fragments takes no --elastic, --checkpoint-dir or --max-restarts (not yet)")
    if args.fragments > 1 and args.compression.split(":")[0] in ("topk", "powersgd"):
        return bad(f"--fragments takes a codec, not the compressor {args.compression} (not yet)")
    if args.max_restarts < 0 or args.checkpoint_every < 1:
        return bad("--max-restarts must be 0 or more and --checkpoint-every at least 1")
    if args.elastic and (args.checkpoint_dir or args.max_restarts):
        return bad("--elastic goes on without a lost worker: not with --checkpoint-dir or --max-restarts")
    if args.backup and (args.topology != "ps" or args.compare):
        return bad(f"--backup {args.backup} needs --topology ps (a shard applies each piece once all but "
                   f"{args.backup} workers pushed it; a ring all_reduce needs every rank)")  # fmt: skip
    if not 0 <= args.backup < args.workers:
        return bad(f"--backup must be from 0 to {args.workers - 1} (--workers {args.workers}), got {args.backup}")
    if args.backup and args.compression != "none":
        return bad("--backup takes no --compression (its scale is agreed over every worker before a step)")
    if args.compare and args.checkpoint_dir:
        return bad("--checkpoint-dir keeps one run's checkpoints: not with --compare")
    if args.model == "embed" and args.device != "cpu":
        return bad("--model embed trains sparse tables: on --device cpu")
    if args.device == "cuda":
        if not gpu.available():
            return bad("--device cuda needs cupy and a CUDA GPU, and none was found")
    topologies = list(TOPOLOGY_NAMES) if args.compare else [args.topology]
    results: dict[str, dict[str, Any]] = {}
    for topology in topologies:
        print(
            f"psring train: topology={topology} workers={args.workers}"
            + (f" servers={args.servers or args.workers}" if topology == "ps" else "")
            + f" epochs={args.epochs} batch={args.batch_size}/worker optimizer={args.optimizer} lr={args.lr}"
            + f" device={args.device}"
            + (f" compression={args.compression}" if args.compression != "none" else "")
            + (f" accumulate={args.accumulate}" if args.accumulate > 1 else "")
            + (f" local_steps={args.local_steps} outer_lr={args.outer_lr} outer_momentum={args.outer_momentum}"
               if args.local_steps > 1 else "")
            + (f" fragments={args.fragments}" if args.fragments > 1 else ""),
            flush=True,
        )
        summary = train_once(args, topology)
        if summary is None:
            return 1
        print_summary(summary)
        results[topology] = summary
    if args.compare:
        print_compare(results)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(results if args.compare else results[topologies[0]]))
    return 0 if all(r["ranks_agree"] for r in results.values()) else 1


def register(sub: argparse._SubParsersAction, env: Settings) -> None:
    p = sub.add_parser(
        "train",
        help="the main job: synchronous SGD on the digits data set",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--topology", choices=TOPOLOGY_NAMES, default=env.topology, help="PSRING_TOPOLOGY")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=env.servers, help="parameter-server shards (ps only; PSRING_SERVERS)")
    add_train_flags(p)
    p.add_argument("--timeout", type=float, default=env.timeout, help="seconds for any one collective (PSRING_TIMEOUT)")
    p.add_argument("--compare", action="store_true", help="train over ring and ps with the same seed, side by side")
    p.add_argument("--plot", default=None, help="write a PNG of loss and accuracy against step")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save a checkpoint here (rank 0) every --checkpoint-every steps and each epoch; resume from it",
    )
    p.add_argument("--checkpoint-every", type=int, default=10, help="optimizer steps between checkpoints")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="a lost worker costs a step, not the job: the others go on (ps: the shards average over the workers "
        "still there; ring: the survivors agree who is left and re-form). Results then depend on membership",
    )
    p.add_argument(
        "--backup",
        type=int,
        default=0,
        help="ps: backup workers -- each step completes once all but B workers pushed; a straggler's late "
        "gradients are dropped and it skips ahead (Chen et al. 2016)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a worker fails, restart every worker up to K times; they resume from --checkpoint-dir",
    )
    p.set_defaults(func=run)
