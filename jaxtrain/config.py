"""Run configuration: frozen dataclasses, named presets, and `key=value` overrides with helpful errors.

>>> cfg = apply_overrides(default_config("gpt-tiny"), ["n_layers=3", "optimizer.learning_rate=0.01"])
>>> cfg.model.n_layers, cfg.optimizer.learning_rate
(3, 0.01)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any, ClassVar

from jaxtrain.data.datasets import PARTITIONS
from jaxtrain.errors import ConfigError, UserInputError
from jaxtrain.parallel.grad_sync import ALGORITHMS, COMPRESSIONS
from jaxtrain.parallel.schedules import SCHEDULES
from jaxtrain.parallel.updates import POLICIES
from jaxtrain.registry import resolve_model
from jaxtrain.settings import Settings, accepts_of, problem, scalar_types, setting

OPTIMIZERS = ("adamw", "sgd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Settings):
    """AdamW (or plain SGD) with linear warmup, cosine decay to `min_lr_ratio * learning_rate`, and global-norm
    clipping (`clip_norm` <= 0: none)."""

    section: ClassVar[str] = "optimizer"

    name: str = setting("adamw", "sgd: plain SGD with decoupled weight decay", choices=OPTIMIZERS)
    learning_rate: float = setting(3e-3, "the peak, after warmup", at_least=0)
    warmup_steps: int = setting(20, "steps of linear warmup from 0", at_least=0)
    min_lr_ratio: float = setting(0.1, "the cosine decay ends at this fraction of learning_rate", at_least=0, at_most=1)
    weight_decay: float = setting(0.1, "decoupled weight decay", at_least=0)
    beta1: float = setting(0.9, "AdamW's first-moment decay", at_least=0, below=1)
    beta2: float = setting(0.95, "AdamW's second-moment decay", at_least=0, below=1)
    clip_norm: float = setting(1.0, "global-norm gradient clipping; <= 0: none")


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    """`source`: builtin (text shipped with Python) | synthetic (random data of the model's shapes) | digits (CSV) |
    clicks (synthetic click logs, for recommenders) | a text file path."""

    section: ClassVar[str] = "data"

    source: str = setting("builtin", "builtin, synthetic, digits, clicks, or a text or digits-CSV file path")
    batch_size: int = setting(32, "global, across all devices and processes", at_least=1)
    seq_len: int = setting(128, "tokens per example", at_least=1)
    val_fraction: float = setting(0.1, "the part of a text source held out for validation", above=0, below=1)
    # How labelled training data is split over the `replica` mesh axis: uniform (shuffled) | stratified (each
    # replica gets the global class mix) | by_label (each replica a few classes: non-IID, the federated setting).
    # Synchronous training does not care; local SGD / FedAvg does. Text and synthetic data take only uniform.
    partition: str = setting("uniform", "how labelled data is split over replicas", choices=PARTITIONS)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Settings):
    section: ClassVar[str] = "train"

    steps: int = setting(200, "optimizer steps of the whole run", at_least=1)
    grad_accum: int = setting(1, "sequential pieces of the global batch per optimizer step", at_least=1)
    # How gradients are averaged over the data-parallel axes. xla: the compiler places the reductions (per layer,
    # inside the backward loop, where they can overlap compute). fused: one all-reduce of the whole gradient per
    # step. ring | hierarchical | parameter_server: explicit algorithms (jaxtrain/comm.py), in buckets of
    # grad_bucket_mb, over ps_servers servers, with messages in grad_compression (none | bf16). All but xla need
    # every parameter replicated over the data-parallel axes.
    grad_sync: str = setting("xla", "how gradients are averaged", choices=("xla", "fused", *ALGORITHMS))
    grad_bucket_mb: float = setting(4.0, "explicit gradient syncs: MiB per bucket", above=0)
    ps_servers: int = setting(1, "grad_sync=parameter_server: servers", at_least=1)
    grad_compression: str = setting("none", "explicit gradient syncs: message dtype", choices=tuple(COMPRESSIONS))
    # When gradients meet the params (jaxtrain/updates.py): synchronous | local_sgd | diloco | stale. local_sgd and
    # diloco train each index of the `replica` mesh axis apart for sync_every steps, then average (diloco: an outer
    # Nesterov step of outer_lr, outer_momentum); stale applies each gradient `staleness` steps late.
    sync: str = setting("synchronous", "when gradients meet the params", choices=POLICIES)
    sync_every: int = setting(4, "local_sgd, diloco: local steps between averages", at_least=1)
    staleness: int = setting(1, "sync=stale: steps a gradient arrives late", at_least=0)
    outer_lr: float = setting(0.7, "diloco: the outer Nesterov step", above=0)
    outer_momentum: float = setting(0.9, "diloco: the outer momentum", at_least=0, below=1)
    # Pipeline parallelism, used when the mesh has a pipeline axis: the schedule (gpipe | 1f1b | interleaved),
    # microbatches per step (0: one per stage), chunks per device for interleaved, and how layers are assigned to
    # stages (cost: balance estimated FLOPs, counting the embedding and head; uniform: equal layer counts), and
    # what each forward keeps for its backward (residuals: autodiff's; inputs: the stage input, recomputing).
    schedule: str = setting("1f1b", "pipeline schedule", choices=SCHEDULES)
    microbatches: int = setting(0, "pipeline microbatches per step; 0: one per stage", at_least=0)
    virtual_stages: int = setting(1, "interleaved schedule: layer chunks per device", at_least=1)
    stage_balance: str = setting("cost", "how layers are assigned to pipeline stages", choices=("cost", "uniform"))
    pipeline_stash: str = setting(
        "residuals", "what a pipeline forward keeps for its backward", choices=("residuals", "inputs")
    )
    # Checkpoints (jaxtrain.training.checkpoint): a directory turns them on; the same command resumes from its
    # newest one.
    checkpoint_dir: str = setting("", "save checkpoints here and resume from the newest; empty: no checkpoints")
    checkpoint_every: int = setting(100, "steps between checkpoints; 0: only at the end", at_least=0)
    checkpoint_keep: int = setting(3, "how many of the newest checkpoints are kept", at_least=1)
    checkpoint_keep_every: int = setting(0, "also keep every M-th step's checkpoint; 0: none", at_least=0)
    restore: str = setting("", "start from this checkpoint step directory when checkpoint_dir has none")
    # Comma-separated config keys that may differ from the checkpoint's when resuming in checkpoint_dir (e.g.
    # "optimizer.learning_rate,train.steps"); the change is recorded in the run's history. Empty: none may.
    allow_config_change: str = setting("", "config keys that may differ from the checkpoint's, comma-separated")
    # A save that fails (disk full, permission denied): stop the run (exit 74, the previous checkpoint intact), or
    # continue, log it, and try again at the next save. The final save must succeed either way.
    checkpoint_failure: str = setting("stop", "what a failed save does", choices=("stop", "continue"))
    # Updates with a non-finite loss or gradient are skipped and counted; this many in a row restore the newest
    # checkpoint and skip the batches since (0: never roll back).
    rollback_after: int = setting(10, "non-finite steps in a row before a rollback; 0: never", at_least=0)
    log_every: int = setting(10, "steps between logged metrics", at_least=1)
    eval_every: int = setting(100, "steps between validations", at_least=1)
    eval_batches: int = setting(4, "batches per validation", at_least=1)
    seed: int = setting(0, "seeds the params and the data order", at_least=0)
    metrics_file: str = setting("", "append one JSON object per logged step to this file")
    tensorboard_dir: str = setting("", "also write the logged metrics as TensorBoard scalars here (tensorboardX)")
    progress: bool = setting(True, "a progress bar, not log lines")
    verbose: bool = setting(False, "the preflight's full tables (parameters, device grid, collectives)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model_name: str
    model: Any  # the model's own config dataclass
    mesh: str = "data=-1"
    rules: dict[str, str] = dataclasses.field(default_factory=dict)
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()


SECTIONS = ("model", "optimizer", "data", "train")


# The data a model trains on by default, by its task; language models take DataConfig()'s.
TASK_DATA = {
    "classification": DataConfig(source="digits", batch_size=64),
    "clicks": DataConfig(source="clicks", batch_size=256),
}


def default_config(model: str = "gpt") -> RunConfig:
    """The preset run for `model` (`gpt`, `gpt-small`, `mlp`, ...)."""
    spec, preset = resolve_model(model)
    data = TASK_DATA.get(spec.task, DataConfig())
    return RunConfig(model_name=f"{spec.name}-{preset}", model=spec.presets[preset](), data=data)


def _all_keys(cfg: RunConfig) -> list[str]:
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))]


def resolve_key(cfg: RunConfig, key: str) -> tuple[str, str]:
    """`n_layers` or `model.n_layers` -> ("model", "n_layers"); unknown keys list close matches."""
    full_keys = _all_keys(cfg)
    if "." in key and key in full_keys:
        section, name = key.split(".", 1)
        return section, name
    owners = [k for k in full_keys if k.split(".", 1)[1] == key]
    if len(owners) == 1:
        section, name = owners[0].split(".", 1)
        return section, name
    if len(owners) > 1:
        raise ConfigError(f"override '{key}' is ambiguous: say which of {', '.join(owners)}.")
    candidates = full_keys + [k.split(".", 1)[1] for k in full_keys]
    close = difflib.get_close_matches(key, candidates, n=4, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else " Run with --help-config to list every key."
    raise ConfigError(f"unknown config key '{key}'.{hint}")


def _parse_value(text: str, part: Any, name: str, key: str) -> Any:
    """`text` as the declared type of field `name` of config `part` (`key` when named in an error); fields of
    other types (tuples) take the text and parse it themselves."""
    kind = scalar_types(type(part)).get(name)
    try:
        if kind is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        if kind in (int, float):
            return kind(text)
    except (KeyError, ValueError):
        raise ConfigError(f"{problem(key, text, accepts_of(part.__dataclass_fields__[name]), kind)}.") from None
    return text


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply `key=value` strings. Keys: a field name if unique (`n_layers`), or `section.field`; `rules.NAME=axes`.

    All overrides of a section are applied together and then checked, so `n_heads=6 d_model=48` holds although
    the preset's d_model is not divisible by 6; a later override of the same key wins."""
    changes: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    top: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not key=value.")
        key = key.strip()
        if key.startswith("rules."):
            top["rules"] = {**top.get("rules", cfg.rules), key.removeprefix("rules."): value}
        elif key == "mesh":
            top["mesh"] = value
        else:
            section, name = resolve_key(cfg, key)
            changes[section][name] = _parse_value(value, getattr(cfg, section), name, f"{section}.{name}")
    parts = {section: _replace(getattr(cfg, section), given) for section, given in changes.items() if given}
    return dataclasses.replace(cfg, **top, **parts)


def _replace(part: Any, changes: dict[str, Any]) -> Any:
    """`part` with `changes`, checked together (by `Settings`, and by a registered model's own `__post_init__`)."""
    try:
        return dataclasses.replace(part, **changes)
    except UserInputError:  # says what is wrong already
        raise
    except (TypeError, ValueError) as err:  # a model config that checks itself with Python's errors
        given = " ".join(f"{name}={value}" for name, value in changes.items())
        raise ConfigError(f"overrides {given}: {err}") from None


def describe_config(cfg: RunConfig) -> str:
    """Every key with its current value, one per line (what --help-config prints)."""
    lines = [f"model: {cfg.model_name}", f"mesh = {cfg.mesh}"]
    for key in _all_keys(cfg):
        section, name = key.split(".", 1)
        lines.append(f"{key} = {getattr(getattr(cfg, section), name)!r}")
    lines += [f"rules.{k} = {v!r}" for k, v in cfg.rules.items()]
    return "\n".join(lines)
