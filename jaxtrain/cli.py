"""The `jaxtrain` command (and `python scripts/train.py`, which runs the same code).

jaxtrain train --simulated-devices 8 --mesh data=2,fsdp=2,tensor=2 --model gpt-tiny --steps 100 n_layers=4
jaxtrain train --help-config           # every key=value override with its current value
jaxtrain meshes                        # the shipped mesh layouts
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Flag -> config key; anything else is given as key=value.
FLAG_KEYS = {
    "steps": "train.steps",
    "batch_size": "data.batch_size",
    "seq_len": "data.seq_len",
    "data": "data.source",
    "seed": "train.seed",
    "metrics_file": "train.metrics_file",
    "log_every": "train.log_every",
    "eval_every": "train.eval_every",
    "grad_accum": "train.grad_accum",
    "schedule": "train.schedule",
    "microbatches": "train.microbatches",
    "virtual_stages": "train.virtual_stages",
    "checkpoint_dir": "train.checkpoint_dir",
    "checkpoint_every": "train.checkpoint_every",
    "restore": "train.restore",
}


# Exit status after a SIGTERM (preemption) once the checkpoint is on disk: 128 + 15, as if killed by the signal,
# so schedulers that requeue on SIGTERM see what they expect.
PREEMPTED_EXIT = 143


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxtrain train",
        description="Train a model on a device mesh. Extra key=value arguments override any config field "
        "(n_layers=4, optimizer.learning_rate=1e-3, rules.embed=fsdp, ...).",
    )
    parser.add_argument("--model", default="gpt", help="model[-preset]: gpt, gpt-tiny, gpt-small, gpt-1b, mlp, ...")
    parser.add_argument(
        "--mesh", default=None, help="a layout name in meshes/, a .toml path, or inline data=2,tensor=4"
    )
    parser.add_argument(
        "--simulated-devices",
        type=int,
        default=None,
        help="run on N simulated CPU devices (sets up the CPU backend before JAX starts)",
    )
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch-size", type=int, help="global batch size, across all devices")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--data", help="builtin | synthetic | digits | path/to/text.txt")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--metrics-file", help="append one JSON object per logged step to this file")
    parser.add_argument("--log-every", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--grad-accum", type=int, help="gradient accumulation: sequential pieces per optimizer step")
    parser.add_argument(
        "--schedule", help="pipeline schedule when the mesh has a pipeline axis: gpipe | 1f1b (default) | interleaved"
    )
    parser.add_argument("--microbatches", type=int, help="pipeline microbatches per step (default: one per stage)")
    parser.add_argument("--virtual-stages", type=int, help="interleaved schedule: layer chunks per device (V)")
    parser.add_argument(
        "--checkpoint-dir", help="save checkpoints here; rerunning the same command resumes from the newest"
    )
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (and one at the end)")
    parser.add_argument("--restore", help="start from this checkpoint (a step directory), on any mesh")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def use_simulated_devices(count: int) -> None:
    """Make JAX's CPU backend expose `count` devices. Must run before JAX initialises a backend."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:  # the backend already exists (e.g. a notebook that ran JAX code first)
        if len(jax.devices()) != count:
            raise SystemExit(
                f"--simulated-devices {count}: JAX already started with {len(jax.devices())} "
                f"devices ({err}). Restart the process/kernel."
            ) from None


def enable_compilation_cache() -> None:
    """Reuse compiled steps across runs (a small model's compile drops from seconds to a fraction of one)."""
    import jax

    cache = os.environ.get("JAXTRAIN_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxtrain" / "xla"))
    jax.config.update("jax_compilation_cache_dir", cache)


def train_main(argv: Sequence[str]) -> int:
    args = _train_parser().parse_args(argv)
    if args.simulated_devices:
        use_simulated_devices(args.simulated_devices)
    enable_compilation_cache()
    from jaxtrain.config import apply_overrides, default_config, describe_config
    from jaxtrain.errors import UserInputError
    from jaxtrain.run import Preempted, train

    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    if args.mesh:
        overrides.append(f"mesh={args.mesh}")
    if args.no_progress:
        overrides.append("train.progress=false")
    try:
        cfg = apply_overrides(default_config(args.model), [*overrides, *args.overrides])
        if args.help_config:
            print(describe_config(cfg))
            return 0
        train(cfg)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Preempted as stop:
        print(f"stopped by SIGTERM after step {stop.step}, checkpoint saved; rerun to resume", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def meshes_main(argv: Sequence[str]) -> int:
    from jaxtrain.mesh import available_layouts, parse_layout

    for name in available_layouts():
        layout = parse_layout(name)
        sizes = ",".join(f"{a}={s}" for a, s in layout.axes.items())
        dcn = ",".join(f"{a}={s}" for a, s in layout.dcn_axes.items())
        print(f"{name:<20} {sizes}{'  across hosts: ' + dcn if dcn else ''}\n{'':<20} {layout.description}")
    return 0


COMMANDS = {"train": train_main, "meshes": meshes_main}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command '{argv[0]}'", file=sys.stderr)
        print(f"usage: jaxtrain {{{','.join(COMMANDS)}}} ...   (jaxtrain train --help)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
