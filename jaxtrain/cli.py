"""The `jaxtrain` command (and `python scripts/train.py`, which runs the same code).

jaxtrain train --simulated-devices 8 --mesh data=2,fsdp=2,tensor=2 --model gpt-tiny --steps 100 n_layers=4
jaxtrain train --model gpt-tiny --help-config > run.toml   # every key: type, choices or bounds, help, value
jaxtrain train --config run.toml steps=50   # a TOML run config, then flags, then key=value (later wins)
jaxtrain train --config runs/x/ckpt/config.toml --checkpoint-dir runs/y   # rerun a run: it wrote its config.toml
jaxtrain comm --simulated-devices 8 --mesh data=2,tensor=4 --model gpt-tiny   # bytes sent per step, no training
jaxtrain plan --model gpt-1b --mesh tpu-v5p-512 --chip v5p --batch-size 512 --seq-len 2048   # memory, comm, time
jaxtrain plan --model gpt-1b --mesh tpu-v5p-128 --aot-topology v5p:4x4x4 --batch-size 256   # + libtpu's figures
jaxtrain comm --model gpt-tiny --mesh gpu-1x8 --aot-topology h100:8   # bytes sent per step, as XLA:GPU compiles it
jaxtrain meshes                        # the shipped mesh layouts
jaxtrain inspect runs/x/ckpt           # a checkpoint's steps, arrays, shapes, dtypes and sizes, from metadata alone
jaxtrain export runs/x/ckpt/400 runs/x-params-400   # the params alone, for evaluation or fine-tuning on any mesh
jaxtrain generate --restore runs/x/ckpt --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95
jaxtrain tokenizer train --vocab-size 4096 --out tok.json corpus/*.txt   # a byte-level BPE, trained here
jaxtrain tokenize --tokenizer tok.json --out shards --workers 2 corpus/   # token shards: --data tokens:shards
jaxtrain import-hf Llama-3.2-1B runs/llama-1b   # a Hugging Face Llama/Mistral/Qwen/BERT directory -> a params export
jaxtrain export-hf runs/x runs/x-hf             # a decoder or BERT checkpoint -> a Hugging Face model directory
jaxtrain export-hf runs/lora runs/lora-peft --adapters-only   # a LoRA run's adapters -> a peft adapter directory

Exit status: 0 done; 2 bad input (a one-line error saying what to change, as argparse's own); 74 a checkpoint could
not be written (fix the storage and rerun: it resumes); 128 + N stopped by signal N after saving (143 SIGTERM, 130
SIGINT); 130 also for Ctrl-C outside training; 1 any other error, printed as one line with its type, `--debug` for
the traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxtrain.devices import enable_compilation_cache, use_simulated_devices  # imports no JAX
from jaxtrain.errors import CHECKPOINT_WRITE_FAILED_EXIT, UserInputError  # imports no JAX
from jaxtrain.settings import Accepts

if TYPE_CHECKING:  # jaxtrain modules are imported lazily here: JAX must see --simulated-devices before it starts
    from jaxtrain.run_config import RunConfig

BAD_INPUT_EXIT = 2  # as argparse's own
UNEXPECTED_ERROR_EXIT = 1  # an error jaxtrain did not foresee: a bug, or bad input it does not check yet
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def command(run: Callable[[list[str]], int]) -> Callable[[Sequence[str]], int]:
    """A subcommand that never shows a bare traceback: bad input (`UserInputError`) is one line and exit 2,
    Ctrl-C is exit 130, and any other exception one line with its type and exit 1. With `--debug` in the arguments
    every error also prints its traceback."""

    @functools.wraps(run)
    def guarded(argv: Sequence[str]) -> int:
        argv = list(argv)
        debug = "--debug" in argv
        try:
            return run(argv)
        except KeyboardInterrupt:
            _traceback(debug)
            print("interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
        except UserInputError as err:
            _traceback(debug)
            return _error(err)
        except Exception as err:  # noqa: BLE001 - the last resort: whatever it is, one line, not a traceback
            _traceback(debug)
            lines = str(err).strip().splitlines() or [""]
            text = f"{type(err).__name__}: {lines[0]}{' ...' if len(lines) > 1 else ''}"
            return _error(text + ("" if debug else " (rerun with --debug for the traceback)"), UNEXPECTED_ERROR_EXIT)

    return guarded


def _traceback(debug: bool) -> None:
    if debug:
        traceback.print_exc()


def flag_type(kind: type = int, **bounds: float) -> Callable[[str], Any]:
    """An argparse type: a `kind` within `bounds` (`at_least`, `above`, `at_most`, `below`, as config fields take
    them), else argparse's usage error saying what was expected, e.g. `flag_type(at_least=1)`."""
    accepts = Accepts(**bounds)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accepts.accepts(value, kind):
            raise argparse.ArgumentTypeError(f"expected {accepts.expected(kind)}, got '{text}'")
        return value

    return parse


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")


# The flags that set a config key (any other key is given as key=value): flag, its key, argparse's options.
CONFIG_FLAGS = (
    ("--steps", "train.steps", {"type": int}),
    ("--batch-size", "data.batch_size", {"type": int, "help": "global batch size, across all devices"}),
    ("--seq-len", "data.seq_len", {"type": int}),
    (
        "--data",
        "data.source",
        {"help": "builtin | synthetic | digits | clicks | tokens:DIR | pairs:FILE.jsonl | path/to/text.txt"},
    ),
    ("--seed", "train.seed", {"type": int}),
    ("--metrics-file", "tracking.metrics_file", {"help": "append one JSON object per logged step to this file"}),
    (
        "--tensorboard-dir",
        "tracking.tensorboard_dir",
        {"help": "also write the logged metrics as TensorBoard scalars here (needs tensorboardX)"},
    ),
    ("--wandb-project", "tracking.wandb_project", {"help": "also log the metrics to this W&B project (needs wandb)"}),
    (
        "--profile-steps",
        "tracking.profile_steps",
        {"metavar": "START:STOP", "help": "trace steps START to STOP-1 with jax.profiler (e.g. 10:13)"},
    ),
    ("--profile-dir", "tracking.profile_dir", {"help": "where the trace goes (TensorBoard's profile plugin, XProf)"}),
    ("--log-every", "train.log_every", {"type": int}),
    ("--eval-every", "train.eval_every", {"type": int}),
    (
        "--grad-accum",
        "train.grad_accum",
        {"type": int, "help": "gradient accumulation: sequential pieces per optimizer step"},
    ),
    (
        "--schedule",
        "pipeline.schedule",
        {"help": "pipeline schedule when the mesh has a pipeline axis: gpipe | 1f1b (default) | interleaved"},
    ),
    (
        "--microbatches",
        "pipeline.microbatches",
        {"type": int, "help": "pipeline microbatches per step (default: one per stage)"},
    ),
    (
        "--virtual-stages",
        "pipeline.virtual_stages",
        {"type": int, "help": "interleaved schedule: layer chunks per device (V)"},
    ),
    (
        "--checkpoint-dir",
        "checkpoint.dir",
        {"help": "save checkpoints and the run's config.toml here; rerunning the same command resumes from the newest"},
    ),
    (
        "--checkpoint-every",
        "checkpoint.every",
        {"type": int, "help": "steps between checkpoints (and one at the end)"},
    ),
    (
        "--restore",
        "checkpoint.restore",
        {"help": "start from this checkpoint step directory, or fine-tune from a params export, on any mesh"},
    ),
    (
        "--allow-config-change",
        "checkpoint.allow_change",
        {
            "metavar": "KEY,KEY",
            "help": "resume in --checkpoint-dir although these config keys differ from the checkpoint's (recorded)",
        },
    ),
    # The asynchronous engine (jaxtrain.asynchronous, docs/asynchronous.md); engine.* keys set the rest.
    ("--engine", "engine.kind", {"help": "spmd (default): one program over the mesh; ray: parameter-server workers"}),
    ("--workers", "engine.workers", {"type": int, "help": "--engine ray: worker processes, each on its own mesh"}),
    ("--ps-shards", "engine.server_shards", {"type": int, "help": "--engine ray: parameter-server shards"}),
    (
        "--slow-worker",
        "engine.slow_workers",
        {"metavar": "I:FACTOR[,...]", "help": "--engine ray: worker I runs FACTOR times slower, by waiting"},
    ),
)
# Flag (as argparse names its value) -> config key.
FLAG_KEYS = {flag.removeprefix("--").replace("-", "_"): key for flag, key, _ in CONFIG_FLAGS}
# How the processes of a job find each other (jaxtrain.training.distributed): flag, argparse's options.
PROCESS_FLAGS = (
    ("--coordinator", {"help": "host:port of process 0, which every process of the job contacts"}),
    ("--num-processes", {"type": flag_type(at_least=1), "help": "processes in the job"}),
    ("--process-id", {"type": flag_type(at_least=0), "help": "this process's id, 0 .. num-processes - 1"}),
    (
        "--coordinator-bind",
        {
            "metavar": "HOST:PORT",
            "help": "where process 0 listens (default: the coordinator address, given or detected: its host only)",
        },
    ),
    (
        "--init-timeout",
        {"type": flag_type(at_least=1), "help": "seconds to wait for every process to join (default 300)"},
    ),
    (
        "--heartbeat-timeout",
        {"type": flag_type(at_least=1), "help": "seconds of silence after which a process is declared dead (100)"},
    ),
    (
        "--auto-cluster",
        {
            "action": "store_true",
            "help": "let JAX detect the job (TPU pod, SLURM, Open MPI, Kubernetes); process 0 listens on the "
            "coordinator it detects, that host's address only",
        },
    ),
    # JAX's mutual TLS between the processes of the job.
    *(
        (f"--mtls-{part}", {"metavar": "FILE", "help": f"mutual TLS between processes: the {part} file"})
        for part in ("cert", "key", "ca")
    ),
)


def _train_parser(
    prog: str = "jaxtrain train", does: str = "Train a model on a device mesh."
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{does} Settings come from the model's preset, then a --config file, then the flags, then extra "
        "key=value arguments, which override any config field (n_layers=4, optimizer.learning_rate=1e-3, "
        "rules.embed=fsdp, ...).",
    )
    parser.add_argument(
        "--model",
        help="model[-preset]: gpt, gpt-tiny, gpt-small, gpt-1b, mlp, resnet, resnet-cifar, recsys, moe, ... (default: "
        "the --config file's model_name, else gpt)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML run config (e.g. a run's CHECKPOINT_DIR/config.toml, or --help-config's output, edited)",
    )
    parser.add_argument("--mesh", help="a layout name in meshes/, a .toml path, or inline data=2,tensor=4")
    parser.add_argument(
        "--simulated-devices",
        type=flag_type(at_least=1),
        help="run on N simulated CPU devices (sets up the CPU backend before JAX starts)",
    )
    for flag, _, options in CONFIG_FLAGS:
        parser.add_argument(flag, **options)
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    parser.add_argument(
        "--verbose", action="store_true", help="full preflight: parameter table, device grid, collectives per axis"
    )
    procs = parser.add_argument_group("several processes (default: one; also JAXTRAIN_COORDINATOR etc.)")
    for flag, options in PROCESS_FLAGS:
        procs.add_argument(flag, **options)
    parser.add_argument(
        "--help-config", action="store_true", help="list every config key (type, choices, help, value) and exit"
    )
    _debug_flag(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def _train_args(argv: Sequence[str], parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse train's flags from `argv` and set JAX up for them (simulated devices, compile-only devices beside the
    CPU backend, compilation cache), before anything imports code that could start a backend."""
    args = parser.parse_intermixed_args(argv)  # key=value before, between or after the flags
    if getattr(args, "aot_topology", None) is not None:
        if args.simulated_devices is not None:
            raise UserInputError(
                "--simulated-devices and --aot-topology exclude each other: the step compiles for the target's "
                "devices. Drop one."
            )
        from jaxtrain.aot.targets import use_cpu_backend_only

        use_cpu_backend_only()
    if args.simulated_devices is not None:
        use_simulated_devices(args.simulated_devices)
    enable_compilation_cache()
    from jaxtrain.training.distributed import from_environment, initialize

    initialize(
        from_environment(
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            bind_address=args.coordinator_bind,
            init_timeout_s=args.init_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            auto=args.auto_cluster or None,
            mtls={f"{p}_file": getattr(args, f"mtls_{p}") for p in ("cert", "key", "ca") if getattr(args, f"mtls_{p}")}
            or None,
        )
    )
    return args


def _run_config(args: argparse.Namespace) -> RunConfig | None:
    """The run config that train's --config file, flags and key=value overrides describe; None after printing
    every config key (--help-config). Fine-tuning with --restore and neither --config nor --model starts from the
    model the checkpoint or export stores (its preset, settings, data source and rules). Raises UserInputError for a
    bad key or value."""
    from jaxtrain.run_config import apply_overrides, describe_config, load_config
    from jaxtrain.training.setup import with_data_vocab

    flags = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    flags += [f"mesh={args.mesh}"] * bool(args.mesh)
    flags += ["train.progress=false"] * args.no_progress + ["train.verbose=true"] * args.verbose
    if getattr(args, "restore", None) and args.config is None and args.model is None:
        from jaxtrain.training.checkpoint import find_checkpoint, trained_config  # Orbax: only when restoring

        cfg = apply_overrides(trained_config(*find_checkpoint(args.restore)), [*flags, *args.overrides])
    else:
        cfg = load_config(args.config, args.model, [*flags, *args.overrides])
    cfg = with_data_vocab(cfg)  # the model's vocabulary from tokenized data: opening the data, not resolving keys
    if args.help_config:
        print(describe_config(cfg))
        return None
    return cfg


@command
def train_main(argv: Sequence[str]) -> int:
    args = _train_args(argv, _train_parser())
    from jaxtrain.evaluation.in_loop import train  # the loop, with the generation score and tasks when asked for
    from jaxtrain.training.checkpoint import CheckpointWriteError
    from jaxtrain.training.recovery import Preempted

    try:
        cfg = _run_config(args)
        if cfg is not None and cfg.grpo.group_size:  # with engine.kind=ray too: its rollouts are sampled on Ray
            _grpo(cfg)
        elif cfg is not None and cfg.engine.kind == "ray":
            return _ray_engine(cfg)
        elif cfg is not None:
            train(cfg)
    except CheckpointWriteError as err:
        return _error(err, CHECKPOINT_WRITE_FAILED_EXIT)
    except Preempted as stop:
        print(
            f"stopped by {stop.signal_name} after step {stop.step}, checkpoint saved; rerun to resume", file=sys.stderr
        )
        return stop.exit_status
    return 0


def _ray_engine(cfg: RunConfig) -> int:
    """Train `cfg` with `jaxtrain.asynchronous.engine.train_async`. Returns 0, or `PROCESSES_LOST_EXIT` after one line
    when the run lost Ray processes it could not replace (not bad input: a restarting launcher restarts it). Without
    Ray, a one-line error saying how to install it."""
    from jaxtrain.errors import PROCESSES_LOST_EXIT

    try:
        from jaxtrain.asynchronous.engine import ProcessesLost, train_async
    except ModuleNotFoundError as err:
        if err.name != "ray":
            raise
        raise UserInputError("--engine ray needs Ray: pip install -e '.[async]' (or pip install ray).") from None
    try:
        train_async(cfg)
    except ProcessesLost as err:
        return _error(err, PROCESSES_LOST_EXIT)
    return 0


def _grpo(cfg: RunConfig) -> None:
    """`jaxtrain train` with grpo.group_size: GRPO on `grpo.prompts`, scored by `grpo.rewards`."""
    from jaxtrain.posttrain.grpo_train import grpo_train

    missing = [key for key in ("prompts", "rewards") if not getattr(cfg.grpo, key)]
    if missing:
        raise UserInputError(
            f"grpo.group_size={cfg.grpo.group_size} samples completions of prompts and scores them, and "
            f"{' and '.join(f'grpo.{key}' for key in missing)} {'is' if len(missing) == 1 else 'are'} not set: e.g. "
            "grpo.prompts=prompts.jsonl grpo.rewards=exact_match."
        )
    grpo_train(cfg, cfg.grpo.prompts, cfg.grpo.rewards.split(","))


@command
def comm_main(argv: Sequence[str]) -> int:
    """Build the run `jaxtrain train` would, compile its step, and print the bytes each device sends per step
    (per mesh axis and collective kind) without training."""
    parser = _train_parser(
        "jaxtrain comm",
        "Print the communication of a training step, from its compiled program, without training: bytes each device "
        "sends per step per mesh axis and collective kind. Takes the flags of `jaxtrain train`.",
    )
    _aot_flags(
        parser,
        "compile the step for this TPU topology or GPU node instead of this machine's devices",
        "with --aot-topology auto: the chip to compile for",
        "with --aot-topology auto: chips in the mesh (default: the layout's size)",
    )
    args = _train_args(argv, parser)
    from jaxtrain.training.setup import build, communication

    cfg = _run_config(args)
    if cfg is not None and args.aot_topology is not None:
        print(_communication_on_target(cfg, args.aot_topology, args.chip, args.devices))
    elif cfg is not None:
        if args.chip or args.devices:
            raise UserInputError("--chip and --devices choose the --aot-topology target: give one, or drop them.")
        print(communication(build(cfg)))
    return 0


def _communication_on_target(cfg: RunConfig, name: str, chip_name: str | None, devices: int | None) -> str:
    """`jaxtrain comm --aot-topology`: the report of the step as the target's compiler compiles it."""
    from jaxtrain.planner.hardware import target_for
    from jaxtrain.planner.measure import compile_train_step
    from jaxtrain.sharding.mesh import parse_layout
    from jaxtrain.training.setup import build, communication

    target = target_for(parse_layout(cfg.mesh), name, chip_name, devices)  # before anything else starts JAX
    run = build(cfg, log=lambda *_: None, devices=target.devices)
    seconds, _ = compile_train_step(run)
    return f"compiled the train step for {target.describe()} in {seconds:.1f} s\n{communication(run)}"


def _aot_flags(parser: argparse.ArgumentParser, does: str, chip_help: str, devices_help: str) -> None:
    """--aot-topology, and --chip and --devices, which choose the target for `auto`."""
    parser.add_argument(
        "--aot-topology",
        metavar="NAME",
        help=f"{does}, without the hardware: v5p:4x4x4, v5e:16x16 (TPU <chip>:<topology>, slices from the "
        "layout's dcn_axes; needs the tpu-aot extra), h100:8, h200:2x8 (GPU <chip>:[<hosts>x]<gpus>; gpu-aot), or "
        "auto (the standard one for --chip and the layout's size or --devices)",
    )
    parser.add_argument("--chip", help=f"v4, v5e, v5p, v6e, h100, h200, a100 ({chip_help})")
    parser.add_argument("--devices", type=flag_type(at_least=1), help=devices_help)


@command
def plan_main(argv: Sequence[str]) -> int:
    """Estimate a run's per-device memory, collectives and step time on a chip and mesh of any size, without its
    devices; with enough (simulated) devices, compile the step and print its figures beside the estimates."""
    parser = _train_parser(
        "jaxtrain plan",
        "Estimate per-device memory (params, gradients, optimizer state, activations, peak), collectives per mesh "
        "axis and a roofline step time and MFU of a training run on a chip and mesh of any size, without the devices; "
        "say whether it fits and, if not, which change would. With enough devices (e.g. --simulated-devices 8) it "
        "also compiles the step and prints the compiled figures beside the estimates; with --aot-topology the "
        "chip's own compiler compiles it for that TPU topology or GPU node, without the hardware, and says whether "
        "the compiled step fits. Takes the flags of `jaxtrain train`.",
    )
    _aot_flags(
        parser,
        "check the estimate with the step compiled for this TPU topology or GPU node",
        "default: the --aot-topology's chip, else this machine's accelerator",
        "chips in the mesh (default: the --aot-topology's, the layout's size, or this machine's)",
    )
    parser.add_argument("--no-check", action="store_true", help="do not compile the step, even with enough devices")
    _search_flags(parser)
    args = _train_args(argv, parser)
    from jaxtrain.planner import plan_report
    from jaxtrain.planner.search import search_report

    if args.search and args.mesh:
        raise UserInputError(f"--search chooses the mesh: drop --mesh {args.mesh}.")
    if not args.search and (args.write_mesh or args.write_config or args.compile_best):
        raise UserInputError("--write-mesh, --write-config and --compile-best go with --search: add it.")
    cfg = _run_config(args)
    if cfg is not None and args.search:
        report = search_report(
            cfg,
            args.chip,
            args.devices,
            check=not args.no_check,
            aot_topology=args.aot_topology,
            compile_best=args.compile_best or 3,
            mesh_path=args.write_mesh,
            config_path=args.write_config,
            log=lambda line: print(line, file=sys.stderr, flush=True),  # progress
        )
        print(report)
    elif cfg is not None:
        print(plan_report(cfg, args.chip, args.devices, not args.no_check, args.aot_topology))
    return 0


def _search_flags(parser: argparse.ArgumentParser) -> None:
    search = parser.add_argument_group("--search: choose the layout (docs/planning.md)")
    search.add_argument(
        "--search",
        action="store_true",
        help="instead of one mesh, try every mesh of the chips with the model's remat policies, gradient "
        "accumulations and pipeline microbatches; print those that fit, fastest first; compile the best for the "
        "--aot-topology target (or this process's devices) until one fits, and choose it",
    )
    search.add_argument(
        "--compile-best",
        type=flag_type(at_least=1),
        metavar="N",
        help="with --search: compile at most the N best layouts, in rank order, to find one that fits (default 3)",
    )
    search.add_argument("--write-mesh", metavar="PATH", help="with --search: write the chosen mesh as a TOML layout")
    search.add_argument(
        "--write-config",
        metavar="PATH",
        help="with --search: write the chosen run config (the keys that differ from the preset, and the mesh: the "
        "--write-mesh file, else inline) as TOML for jaxtrain train --config",
    )


@command
def meshes_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="jaxtrain meshes", description="List the mesh layouts shipped in meshes/.")
    _debug_flag(parser)
    parser.parse_args(argv)
    from jaxtrain.sharding.mesh import available_layouts, parse_layout

    for name in available_layouts():
        layout = parse_layout(name)
        sizes = ",".join(f"{a}={s}" for a, s in layout.axes.items())
        dcn = ",".join(f"{a}={s}" for a, s in layout.dcn_axes.items())
        print(f"{name:<20} {sizes}{'  across hosts: ' + dcn if dcn else ''}\n{'':<20} {layout.description}")
    return 0


@command
def inspect_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxtrain inspect",
        description="Describe a checkpoint from its metadata, without reading array data: a run directory's steps, "
        "then every array (shape, dtype, bytes) with totals, the step, the model and the mesh.",
    )
    parser.add_argument("path", help="a run directory (--checkpoint-dir), one of its step directories, or an export")
    _debug_flag(parser)
    args = parser.parse_args(argv)
    _host_only()
    from jaxtrain.training.checkpoint import describe_checkpoint

    print(describe_checkpoint(args.path))
    return 0


@command
def export_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxtrain export",
        description="Write a training checkpoint's params, without the optimizer state, as a new checkpoint for "
        "evaluation or fine-tuning; it restores onto any mesh.",
    )
    parser.add_argument("step_dir", help="a step directory of a training run, e.g. runs/x/ckpt/400")
    parser.add_argument("out_dir", help="where to write the export (must not exist)")
    _debug_flag(parser)
    args = parser.parse_args(argv)
    _host_only()
    from jaxtrain.training.checkpoint import export_params

    out = export_params(args.step_dir, args.out_dir)
    print(f"wrote the params of {args.step_dir} to {out} (see: jaxtrain inspect {out})")
    return 0


@command
def generate_main(argv: Sequence[str]) -> int:
    """Continue prompts with a trained language model: token ids in and out (--prompt-ids), or text (--prompt)."""
    args = _generate_parser().parse_args(argv)
    if args.simulated_devices is not None:
        use_simulated_devices(args.simulated_devices)
    enable_compilation_cache()
    from jaxtrain.inference.generate import Generator, encode_prompts

    prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids else None  # a typo is an error before restoring
    generator = Generator.restore(args.restore, args.mesh)
    tokenizer = None if prompt_ids else generator.tokenizer
    warn = functools.partial(print, "warning:", file=sys.stderr)
    prompts = prompt_ids or encode_prompts(tokenizer, args.prompt, warn)
    result = generator.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=args.eos_id,
    )
    for number, row in enumerate(result.tokens):
        if not tokenizer:
            print(" ".join(map(str, row)))
            continue
        if len(prompts) > 1:  # texts span lines: a header says where each begins
            print(f"--- prompt {number + 1}: {args.prompt[number]!r}")
        print(tokenizer.decode(row))
    return 0


@command
def tokenizer_main(argv: Sequence[str]) -> int:
    """`jaxtrain tokenizer train`: a byte-level BPE trained on local text files, saved as a tokenizer.json."""
    parser = argparse.ArgumentParser(
        prog="jaxtrain tokenizer",
        description="Train a byte-level BPE tokenizer (GPT-2's scheme, with <|endoftext|>) on local text files.",
    )
    parser.add_argument("action", choices=["train"])
    parser.add_argument("--vocab-size", type=flag_type(at_least=1), required=True, help="tokens, bytes included")
    parser.add_argument("--out", required=True, help="the tokenizer.json to write (must not exist)")
    parser.add_argument("files", nargs="+", metavar="FILE", help="text files to learn the merges from")
    _debug_flag(parser)
    args = parser.parse_args(argv)
    from jaxtrain.data.tokenizer import padded_vocab, train_bpe

    tokenizer = train_bpe(args.files, args.vocab_size, args.out)
    print(
        f"wrote {args.out}: {tokenizer.vocab_size} tokens (a model's vocab_size: {padded_vocab(tokenizer.vocab_size)})"
    )
    return 0


@command
def import_hf_main(argv: Sequence[str]) -> int:
    parser = _interop_parser(
        "jaxtrain import-hf",
        "Import a Hugging Face model directory (config.json, safetensors weights, tokenizer files) of "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, BertForMaskedLM or "
        "BertForSequenceClassification as a params export: restorable onto any mesh (jaxtrain train --restore OUT "
        "fine-tunes it; jaxtrain generate --restore OUT generates from a decoder). "
        "Each device's shard is read alone from the files.",
        ("directory", "the Hugging Face model directory"),
        ("out_dir", "where to write the export (must not exist)"),
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="the params' dtype (default: the weights')")
    args = _interop_args(parser, argv)
    from jaxtrain.interop.importing import import_hf

    out = import_hf(args.directory, args.out_dir, dtype=args.dtype, mesh=args.mesh)
    print(f"imported {args.directory} to {out} (see: jaxtrain inspect {out})")
    return 0


@command
def tokenize_main(argv: Sequence[str]) -> int:
    """`jaxtrain tokenize`: text, JSON-lines or Parquet files into token shards for `data.source=tokens`; with
    `--chat`, JSON lines of conversations rendered with a chat template, with loss weights on the assistant's tokens."""
    args = _tokenize_parser().parse_args(argv)
    from jaxtrain.data.shards import tokenize

    manifest = tokenize(
        args.tokenizer,
        args.inputs,
        args.out,
        val_fraction=args.val_fraction,
        workers=args.workers,
        documents=args.documents,
        progress=not args.no_progress,
        chat=_chat_options(args) if args.chat else None,
    )
    for split, counts in manifest["splits"].items():
        assistant = f", {counts['assistant_tokens']:,} of them the assistant's" if "chat" in manifest else ""
        print(
            f"{split}: {counts['tokens']:,} tokens{assistant}, {counts['documents']:,} documents, "
            f"{len(counts['shards'])} shards"
        )
    if "chat" in manifest:
        chat = manifest["chat"]
        limit = f"over --max-tokens {chat['max_tokens']}" if chat["max_tokens"] else "no --max-tokens"
        print(
            f"conversations: {chat['conversations']:,} read, {chat['whole']:,} whole, {chat['cut']:,} cut at a turn, "
            f"{chat['dropped']:,} dropped ({limit}, --truncate {chat['truncation']}); template {chat['template']}"
        )
    print(f"train on it: jaxtrain train --data {shlex.quote(f'tokens:{args.out}')}")  # pasted into a shell
    return 0


def _tokenize_parser() -> argparse.ArgumentParser:
    from jaxtrain.data.chat import TRUNCATIONS
    from jaxtrain.data.chat_template import BUILTIN_TEMPLATES
    from jaxtrain.data.shards import DOCUMENTS

    parser = argparse.ArgumentParser(
        prog="jaxtrain tokenize",
        description="Tokenize text files, folders of them, and JSON-lines or Parquet files with a 'text' field into "
        "shards of token ids with document boundaries and a manifest; train on them with --data tokens:OUT. "
        "Rerun the same command after an interruption to finish. With --chat: JSON lines of conversations "
        "('messages', or 'prompt' and 'completion'), rendered with the model's chat template; the loss counts the "
        "assistant's tokens only (docs/data.md, 'Chat and instruction data').",
    )
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json, an HF model directory, or a .model")
    parser.add_argument("--out", required=True, help="the directory to write (new, or an interrupted one's)")
    parser.add_argument(
        "--val-fraction",
        type=flag_type(float, above=0, below=1),
        default=0.01,
        help="the part of the documents held out for validation (0.01)",
    )
    parser.add_argument("--workers", type=flag_type(at_least=1), default=1, help="worker processes (1)")
    parser.add_argument(
        "--documents",
        choices=DOCUMENTS,
        default="file",
        help="in a text file, a document is the whole file or each blank-line paragraph",
    )
    chat = parser.add_argument_group("chat and instruction data")
    chat.add_argument("--chat", action="store_true", help="the inputs are JSON lines of conversations")
    chat.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help=f"a built-in template ({', '.join(BUILTIN_TEMPLATES)}), a .jinja file or a tokenizer_config.json; "
        "default: the tokenizer directory's own (chat_template.jinja, or tokenizer_config.json's chat_template)",
    )
    chat.add_argument(
        "--max-tokens",
        type=flag_type(at_least=2),
        help="the longest conversation kept whole, in tokens (e.g. data.seq_len + 1); default: any length",
    )
    chat.add_argument(
        "--truncate",
        choices=TRUNCATIONS,
        default="turn",
        help="a longer conversation: cut after its last assistant turn that fits (turn), or drop it (drop)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="text/JSON-lines/Parquet files or folders")
    _debug_flag(parser)
    return parser


def _chat_options(args: argparse.Namespace):
    """The chat options of `jaxtrain tokenize --chat` (jaxtrain.data.chat.ChatOptions)."""
    from jaxtrain.data.chat import ChatOptions
    from jaxtrain.data.chat_template import find_chat_template

    template = find_chat_template(args.tokenizer, args.chat_template)
    return ChatOptions(template, args.max_tokens, args.truncate)


@command
def export_hf_main(argv: Sequence[str]) -> int:
    parser = _interop_parser(
        "jaxtrain export-hf",
        "Write a decoder or BERT checkpoint as a Hugging Face model directory: config.json naming the architecture "
        "that computes it, safetensors weights in files of at most --max-shard-mb with their index, and the tokenizer "
        "files of a model imported with import-hf. Gathered one tensor at a time from the mesh. A run trained with "
        "adapters (lora.rank > 0) exports merged (each adapter folded into its weight), or with --adapters-only as a "
        "peft adapter directory (adapter_config.json, adapter_model.safetensors) for PeftModel.from_pretrained.",
        ("path", "a run directory (its newest step), a step directory or a params export"),
        ("out_dir", "where to write the model directory (must not exist)"),
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    parser.add_argument(
        "--max-shard-mb",
        type=flag_type(float, above=0),
        help="largest safetensors file (5000; not with --adapters-only)",
    )
    peft = parser.add_argument_group("adapters (a run trained with lora.rank > 0)")
    peft.add_argument("--adapters-only", action="store_true", help="write the adapters for peft, not the model")
    peft.add_argument(
        "--base-model",
        metavar="NAME",
        help="adapter_config.json's base_model_name_or_path (default: the directory the base was imported from)",
    )
    args = _interop_args(parser, argv)
    if args.adapters_only:
        return _export_peft(args)
    if args.base_model:
        raise UserInputError(f"--base-model {args.base_model}: it names the base of adapters; add --adapters-only.")
    from jaxtrain.interop.exporting import export_hf

    max_mb = 5000.0 if args.max_shard_mb is None else args.max_shard_mb
    out = export_hf(args.path, args.out_dir, dtype=args.dtype, max_file_bytes=int(max_mb * 1e6), mesh=args.mesh)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"exported {args.path} to {out}: {architecture}.from_pretrained reads it")
    return 0


def _export_peft(args: argparse.Namespace) -> int:
    """`jaxtrain export-hf --adapters-only`: the run's adapters as a peft adapter directory."""
    if args.max_shard_mb is not None:
        raise UserInputError(
            f"--max-shard-mb {args.max_shard_mb:g} with --adapters-only: peft reads its adapters from one file; drop "
            "--max-shard-mb."
        )
    from jaxtrain.interop.peft_export import export_peft

    out = export_peft(args.path, args.out_dir, dtype=args.dtype, mesh=args.mesh, base_model=args.base_model)
    print(f"exported the adapters of {args.path} to {out} (PeftModel.from_pretrained(model, {str(out)!r}) reads them)")
    return 0


def _interop_parser(prog: str, does: str, *positional: tuple[str, str]) -> argparse.ArgumentParser:
    """The parser of import-hf and export-hf: their two paths, the mesh the params are laid out on, devices."""
    parser = argparse.ArgumentParser(prog=prog, description=does)
    for name, what in positional:
        parser.add_argument(name, help=what)
    parser.add_argument(
        "--mesh", default="fsdp=-1", help="the layout the params are read onto (default fsdp=-1: 1/n on each device)"
    )
    parser.add_argument(
        "--simulated-devices", type=flag_type(at_least=1), help="N simulated CPU devices (before JAX starts)"
    )
    _debug_flag(parser)
    return parser


def _interop_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.simulated_devices is not None:
        use_simulated_devices(args.simulated_devices)
    return args


def _generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxtrain generate",
        description="Continue prompts with a trained language model, rebuilt from the config its checkpoint stores: "
        "the prompt batch is prefilled at once, then one token a step with a KV cache sharded like training's "
        "activations. With --prompt-ids, prints each continuation's token ids (space-separated, a line per prompt); "
        "with --prompt, its text (byte-level, as jaxtrain's text data), after a header line per prompt when there "
        "are several.",
    )
    parser.add_argument("--restore", required=True, help="a step directory, a params export, or a run directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeat for several)")
    prompt.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="token ids 1,2,3, used exactly as given; several prompts: repeat the flag, or separate them by ';'",
    )
    parser.add_argument("--max-new-tokens", type=flag_type(at_least=1), default=64, help="tokens to add (64)")
    parser.add_argument(
        "--temperature", type=flag_type(float, at_least=0), default=0.0, help="0 (default) is greedy decoding"
    )
    parser.add_argument("--top-k", type=flag_type(at_least=0), default=0, help="sample among the k likeliest (0: all)")
    parser.add_argument(
        "--top-p", type=flag_type(float, above=0, at_most=1), default=1.0, help="nucleus sampling mass (1: all)"
    )
    parser.add_argument("--seed", type=flag_type(at_least=0), default=0, help="seeds the sampling")
    parser.add_argument("--eos-id", type=flag_type(at_least=0), help="stop a prompt's continuation at this token id")
    parser.add_argument("--mesh", help="a layout name in meshes/, a .toml path, or inline data=2,tensor=2 (data=-1)")
    parser.add_argument(
        "--simulated-devices",
        type=flag_type(at_least=1),
        help="run on N simulated CPU devices (sets up the CPU backend before JAX starts)",
    )
    _debug_flag(parser)
    return parser


def _prompt_ids(given: list[str]) -> list[list[int]]:
    """--prompt-ids values ('1,2,3', or several prompts '1,2;3,4') as lists of token ids."""
    prompts = []
    for text in (part for value in given for part in value.split(";")):
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise UserInputError(
                f"--prompt-ids '{text}': expected comma-separated integer token ids, e.g. --prompt-ids 1,2,3."
            ) from None
    return prompts


def _host_only() -> None:
    """Keep JAX on the CPU: inspecting and exporting read files on the host, and the accelerators may be busy
    training (JAX would otherwise claim most of a GPU's memory on start)."""
    import jax

    jax.config.update("jax_platforms", "cpu")


def _error(err: Exception | str, status: int = BAD_INPUT_EXIT) -> int:
    """Report an error without a traceback; by default exit status 2 (bad input), like argparse."""
    print(f"error: {err}", file=sys.stderr)
    return status


COMMANDS = {
    "train": train_main,
    "comm": comm_main,
    "plan": plan_main,
    "meshes": meshes_main,
    "inspect": inspect_main,
    "export": export_main,
    "generate": generate_main,
    "tokenizer": tokenizer_main,
    "tokenize": tokenize_main,
    "import-hf": import_hf_main,
    "export-hf": export_hf_main,
}


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
