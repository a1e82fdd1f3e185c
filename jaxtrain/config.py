"""Run configuration: frozen dataclasses, named presets, and `key=value` overrides with helpful errors.

>>> cfg = apply_overrides(default_config("gpt-tiny"), ["n_layers=3", "optimizer.learning_rate=0.01"])
>>> cfg.model.n_layers, cfg.optimizer.learning_rate
(3, 0.01)
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from jaxtrain.errors import UserInputError
from models import resolve_model


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (or plain SGD) with linear warmup, cosine decay to `min_lr_ratio * learning_rate`, and global-norm
    clipping (`clip_norm` <= 0: none)."""

    name: str = "adamw"  # adamw | sgd
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`source`: builtin (text shipped with Python) | synthetic (random data of the model's shapes) | digits (CSV) |
    clicks (synthetic click logs, for recommenders) | a text file path."""

    source: str = "builtin"
    batch_size: int = 32  # global, across all devices and processes
    seq_len: int = 128
    val_fraction: float = 0.1
    # How labelled training data is split over the `replica` mesh axis: uniform (shuffled) | stratified (each
    # replica gets the global class mix) | by_label (each replica a few classes: non-IID, the federated setting).
    # Synchronous training does not care; local SGD / FedAvg does. Text and synthetic data take only uniform.
    partition: str = "uniform"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    grad_accum: int = 1  # gradient accumulation: the global batch is split into this many sequential pieces
    # How gradients are averaged over the data-parallel axes. xla: the compiler places the reductions (per layer,
    # inside the backward loop, where they can overlap compute). fused: one all-reduce of the whole gradient per
    # step. ring | hierarchical | parameter_server: explicit algorithms (jaxtrain/comm.py), in buckets of
    # grad_bucket_mb, over ps_servers servers, with messages in grad_compression (none | bf16). All but xla need
    # every parameter replicated over the data-parallel axes.
    grad_sync: str = "xla"
    grad_bucket_mb: float = 4.0
    ps_servers: int = 1
    grad_compression: str = "none"
    # When gradients meet the params (jaxtrain/updates.py): synchronous | local_sgd | diloco | stale. local_sgd and
    # diloco train each index of the `replica` mesh axis apart for sync_every steps, then average (diloco: an outer
    # Nesterov step of outer_lr, outer_momentum); stale applies each gradient `staleness` steps late.
    sync: str = "synchronous"
    sync_every: int = 4
    staleness: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # Pipeline parallelism, used when the mesh has a pipeline axis: the schedule (gpipe | 1f1b | interleaved),
    # microbatches per step (0: one per stage), chunks per device for interleaved, and how layers are assigned to
    # stages (cost: balance estimated FLOPs, counting the embedding and head; uniform: equal layer counts), and
    # what each forward keeps for its backward (residuals: autodiff's; inputs: the stage input, recomputing).
    schedule: str = "1f1b"
    microbatches: int = 0
    virtual_stages: int = 1
    stage_balance: str = "cost"
    pipeline_stash: str = "residuals"
    # Checkpoints (jaxtrain.checkpoint): a directory turns them on; the same command resumes from its newest one.
    checkpoint_dir: str = ""
    checkpoint_every: int = 100
    checkpoint_keep: int = 3  # the newest K ...
    checkpoint_keep_every: int = 0  # ... plus every M-th step (0: none)
    restore: str = ""  # start from this checkpoint step directory when checkpoint_dir has none
    # Comma-separated config keys that may differ from the checkpoint's when resuming in checkpoint_dir (e.g.
    # "optimizer.learning_rate,train.steps"); the change is recorded in the run's history. Empty: none may.
    allow_config_change: str = ""
    # A save that fails (disk full, permission denied): stop the run (exit 74, the previous checkpoint intact), or
    # continue, log it, and try again at the next save. The final save must succeed either way.
    checkpoint_failure: str = "stop"
    # Updates with a non-finite loss or gradient are skipped and counted; this many in a row restore the newest
    # checkpoint and skip the batches since (0: never roll back).
    rollback_after: int = 10
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 0
    metrics_file: str = ""
    tensorboard_dir: str = ""  # also write the logged metrics as TensorBoard scalars here (needs tensorboardX)
    progress: bool = True
    verbose: bool = False  # the preflight's full tables (parameters, device grid, collectives), not a summary


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


class ConfigError(UserInputError):
    """An override that names no field, or a value of the wrong type."""


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


def _resolve_key(cfg: RunConfig, key: str) -> tuple[str, str]:
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


def _parse_value(text: str, current: Any, key: str) -> Any:
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        raise ConfigError(f"override {key}={text}: expected a {type(current).__name__}.") from None
    return text


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply `key=value` strings. Keys: a field name if unique (`n_layers`), or `section.field`; `rules.NAME=axes`."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not key=value.")
        key = key.strip()
        if key.startswith("rules."):
            cfg = dataclasses.replace(cfg, rules={**cfg.rules, key.removeprefix("rules."): value})
            continue
        if key in ("mesh",):
            cfg = dataclasses.replace(cfg, mesh=value)
            continue
        section, name = _resolve_key(cfg, key)
        part = getattr(cfg, section)
        try:
            new_part = dataclasses.replace(part, **{name: _parse_value(value, getattr(part, name), key)})
        except (TypeError, ValueError) as err:  # the section's own validation (e.g. d_model % n_heads)
            raise ConfigError(f"override {item}: {err}") from None
        cfg = dataclasses.replace(cfg, **{section: new_part})
    return cfg


def describe_config(cfg: RunConfig) -> str:
    """Every key with its current value, one per line (what --help-config prints)."""
    lines = [f"model: {cfg.model_name}", f"mesh = {cfg.mesh}"]
    for key in _all_keys(cfg):
        section, name = key.split(".", 1)
        lines.append(f"{key} = {getattr(getattr(cfg, section), name)!r}")
    lines += [f"rules.{k} = {v!r}" for k, v in cfg.rules.items()]
    return "\n".join(lines)
