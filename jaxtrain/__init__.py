"""jaxtrain: declarative distributed training for JAX. A model names its dimensions, a mesh layout names the devices'
axes, rules map one to the other, and one compiled step trains the model on the mesh.

>>> import jaxtrain
>>> jaxtrain.use_simulated_devices(8)      # 8 CPU devices, before JAX runs anything (skip it on accelerators)
>>> cfg = jaxtrain.config("gpt-tiny", mesh="data=2,fsdp=2,tensor=2", steps=20, progress=False)
>>> summary = jaxtrain.train(cfg)          # doctest: +SKIP
>>> summary["loss"], summary["tokens_per_sec"]                                    # doctest: +SKIP
>>> print(jaxtrain.plan(cfg, chip="v5p", devices=8, check=False))               # doctest: +SKIP

The API: `config`, `train`, `plan`, `use_simulated_devices`, `enable_compilation_cache`, `register_model` and
`available_models`, and the types a caller meets: `RunConfig`, `ModelSpec`, and the errors (every bad input is a
`UserInputError` with a message saying what to change). Importing `jaxtrain` imports no JAX; the names that need it
load on first use.

For an application with a loop of its own (scripts/alphazero.py: self-play, a replay buffer, a learner), the pieces
`train` is made of: `build` (the run's mesh, shardings, data and compiled step, as a `Run`), and the checkpoint and
resume code every run shares: `run_lock`, `check_resume`, `open_checkpoints`, `resume`, `save_checkpoint`,
`Progress` and `stop_signals` (an application's own trees and settings go in the same checkpoints).

What the notebooks use beside these: data of your own (`TokenWindows` over token ids in memory, `builtin_text`, a BPE
from `train_bpe`, shards from `tokenize`), text from a trained model (`Generator`), a run's cost
(`communication_report` of its compiled step, `format_bytes`) and its checkpoints (`describe_checkpoint`, and
`restore_checkpoint` onto any plan's shardings).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxtrain.devices import DeviceSetupError, enable_compilation_cache, use_simulated_devices
from jaxtrain.errors import ConfigError, UserInputError
from jaxtrain.registry import ModelRegistrationError, ModelSpec, available_models, register_model

if TYPE_CHECKING:
    from jaxtrain.analysis.comm_report import communication_report
    from jaxtrain.data.datasets import TokenWindows, builtin_text
    from jaxtrain.data.shards import tokenize
    from jaxtrain.data.tokenizer import train_bpe
    from jaxtrain.formatting import fmt_bytes as format_bytes
    from jaxtrain.inference.generate import Generator
    from jaxtrain.placement.model import PlacementError
    from jaxtrain.run_config import RunConfig
    from jaxtrain.training.checkpoint import CheckpointWriteError, describe_checkpoint
    from jaxtrain.training.checkpoint import restore as restore_checkpoint
    from jaxtrain.training.loop import train
    from jaxtrain.training.recovery import (
        Preempted,
        Progress,
        check_resume,
        open_checkpoints,
        resume,
        save_checkpoint,
        stop_signals,
    )
    from jaxtrain.training.run_lock import holding as run_lock
    from jaxtrain.training.setup import build

# Names loaded on first use (PEP 562): each imports JAX and most of the library. "module:attribute" where the
# public name is not the module's.
_LAZY = {
    "RunConfig": "jaxtrain.run_config",
    "train": "jaxtrain.evaluation.in_loop",
    "PlacementError": "jaxtrain.placement.model",
    "Preempted": "jaxtrain.training.recovery",
    "CheckpointWriteError": "jaxtrain.training.checkpoint",
    # An application's own loop (scripts/alphazero.py) is built from these.
    "build": "jaxtrain.training.setup",
    "run_lock": "jaxtrain.training.run_lock:holding",
    "check_resume": "jaxtrain.training.recovery",
    "open_checkpoints": "jaxtrain.training.recovery",
    "resume": "jaxtrain.training.recovery",
    "save_checkpoint": "jaxtrain.training.recovery",
    "Progress": "jaxtrain.training.recovery",
    "stop_signals": "jaxtrain.training.recovery",
    # What the notebooks use (notebooks/*.ipynb import nothing else; tests/test_docs.py checks it).
    "TokenWindows": "jaxtrain.data.datasets",
    "builtin_text": "jaxtrain.data.datasets",
    "train_bpe": "jaxtrain.data.tokenizer",
    "tokenize": "jaxtrain.data.shards",
    "Generator": "jaxtrain.inference.generate",
    "communication_report": "jaxtrain.analysis.comm_report",
    "format_bytes": "jaxtrain.formatting:fmt_bytes",
    "describe_checkpoint": "jaxtrain.training.checkpoint",
    "restore_checkpoint": "jaxtrain.training.checkpoint:restore",
}

__all__ = [
    "CheckpointWriteError",
    "ConfigError",
    "DeviceSetupError",
    "Generator",
    "ModelRegistrationError",
    "ModelSpec",
    "PlacementError",
    "Preempted",
    "Progress",
    "RunConfig",
    "TokenWindows",
    "UserInputError",
    "available_models",
    "build",
    "builtin_text",
    "check_resume",
    "communication_report",
    "config",
    "describe_checkpoint",
    "enable_compilation_cache",
    "format_bytes",
    "open_checkpoints",
    "plan",
    "register_model",
    "restore_checkpoint",
    "resume",
    "run_lock",
    "save_checkpoint",
    "stop_signals",
    "tokenize",
    "train",
    "train_bpe",
    "use_simulated_devices",
]


def config(
    model: str | os.PathLike | RunConfig = "gpt", /, *, overrides: Sequence[str] = (), **settings: object
) -> RunConfig:
    """The run config of `model` (`gpt-tiny`, `mlp`, a model you registered, ...): its preset with `settings`, then
    `overrides`, applied. Given a `RunConfig` instead, that config with them applied; given the path of a run config
    file (`run.toml`, or the `config.toml` a run wrote beside its checkpoints), that file's config with them applied.

    `settings`: config keys by their unique short names (`steps=20`, `learning_rate=1e-3`, `batch_size=8`), `mesh=`
    (a shipped layout's name, a .toml path, or inline "data=2,tensor=2") and `rules={"embed": "fsdp"}`; a dotted key
    as `**{"optimizer.learning_rate": 1e-3}`. `overrides`: "key=value" strings as the command line takes them; they
    win over `settings`. An unknown or ambiguous key, or a value of the wrong type, out of range or not among the
    choices, is the `ConfigError` the command line reports. `jaxtrain train --help-config` lists every key.

    >>> cfg = config("gpt-tiny", mesh="data=2,tensor=2", steps=20, **{"optimizer.learning_rate": 1e-3})
    >>> cfg.train.steps, cfg.optimizer.learning_rate, cfg.mesh
    (20, 0.001, 'data=2,tensor=2')
    >>> config(cfg, mesh="cpu8-data").mesh
    'cpu8-data'
    >>> config("runs/a/ckpt/config.toml", **{"checkpoint.dir": "runs/b/ckpt"})              # doctest: +SKIP
    >>> config("gpt-tiny", stpes=20)
    Traceback (most recent call last):
    jaxtrain.errors.ConfigError: unknown config key 'stpes'. Did you mean: steps, dtype?
    """
    from jaxtrain.run_config import apply_overrides, default_config, load_config

    given = [item for key, value in settings.items() for item in _as_overrides(key, value)]
    if isinstance(model, str | os.PathLike) and str(model).endswith(".toml"):
        return load_config(model, overrides=[*given, *overrides])
    base = default_config(model) if isinstance(model, str) else model
    return apply_overrides(base, [*given, *overrides])


def _as_overrides(key: str, value: object) -> list[str]:
    """As the command line spells it: `rules={"embed": ("fsdp", "tensor")}` -> ["rules.embed=fsdp,tensor"]."""
    if key == "rules" and isinstance(value, Mapping):
        return [f"rules.{name}={_rule_text(key, axes)}" for name, axes in value.items()]
    if isinstance(value, bool):
        return [f"{key}={str(value).lower()}"]
    if isinstance(value, str | int | float):
        return [f"{key}={value}"]
    raise ConfigError(f"config key '{key}' was given {value!r}: give a str, int, float or bool, as key=value takes.")


def _rule_text(key: str, axes: object) -> str:
    if isinstance(axes, str):
        return axes
    if isinstance(axes, Sequence) and all(isinstance(a, str) for a in axes):
        return ",".join(axes)
    raise ConfigError(f"{key}: {axes!r} is not mesh axes: give a name, names separated by commas, or a tuple of names.")


def plan(
    cfg: RunConfig,
    chip: str | None = None,
    devices: int | None = None,
    *,
    check: bool = True,
    aot_topology: str | None = None,
) -> str:
    """The planner's report on `cfg` (what `jaxtrain plan` prints): per-device memory, collectives per mesh axis, a
    roofline step time and MFU on `devices` chips of kind `chip` (`v5p`, `h100`, ...; default: this machine's
    accelerators and count, or the layout's fixed size), whether it fits and which changes would make it fit. With
    `check` and enough devices in this process, it also compiles the step and prints XLA's figures beside the
    estimates. `aot_topology` (`v5p:4x4x4`, `h100:8`, ...: the command line's --aot-topology) compiles the step
    for that TPU slice or GPU node on compile-only devices instead, which needs the `tpu-aot` or `gpu-aot` extra.

    >>> big = config("gpt-1b", mesh="tpu-v5p-128", batch_size=256, seq_len=2048)
    >>> print(plan(big, chip="v5p"))                                                     # doctest: +SKIP
    >>> print(plan(big, aot_topology="v5p:4x4x4"))  # compiled by the TPU compiler       # doctest: +SKIP
    """
    from jaxtrain.planner import plan_report

    return plan_report(cfg, chip, devices, check=check, aot_topology=aot_topology)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxtrain' has no attribute '{name}'")
    module, _, attribute = _LAZY[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
