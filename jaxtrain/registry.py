"""The model registry: `--model NAME` or `--model NAME-PRESET` (e.g. `gpt`, `gpt-small`, `mlp`).

The library never imports a model package. Models arrive here by `register_model`, called by the package that
defines them when it is imported: the project's own `models` package, or a user's. The first lookup of a name that
is not registered loads the packages that installed projects declare under the `jaxtrain.models` entry-point group
(this project declares `models`), so `jaxtrain train --model gpt` works without anyone importing `models` first.

>>> import jaxtrain
>>> jaxtrain.register_model("mine", MyModel, {"tiny": MyConfig}, task="lm")   # doctest: +SKIP
>>> jaxtrain.config("mine-tiny", mesh="data=2,tensor=2")                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
from collections.abc import Callable, Mapping

from jaxtrain.errors import UserInputError

ENTRY_POINT_GROUP = "jaxtrain.models"
TASKS = ("lm", "classification", "clicks")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model: its Flax NNX module class (built as `module(config, rngs=...)`), its named config
    presets, the preset a bare name means, and the data it trains on (one of `TASKS`)."""

    name: str
    module: type
    presets: Mapping[str, Callable[[], object]]
    default_preset: str
    task: str  # "lm" (token sequences), "classification" (feature vectors + labels) or "clicks" (recommendations)


_MODELS: dict[str, ModelSpec] = {}
_entry_points_loaded = False


def register_model(
    name: str,
    module: type,
    presets: Mapping[str, Callable[[], object]],
    *,
    task: str = "lm",
    default_preset: str | None = None,
) -> ModelSpec:
    """Make `--model NAME[-PRESET]` build `module(presets[PRESET](), rngs=...)`.

    What a model provides: `loss(batch) -> (loss, metrics)`, a scalar mean over the batch's examples; parameters
    created as `nnx.Param(value, out_sharding=(logical names...))`, one name (or None) per dimension, which the
    sharding rules map to mesh axes; a frozen config dataclass per preset, optionally with `train_flops(batch_size,
    seq_len)` (without it, FLOPs come from XLA's cost analysis of the compiled step). Registering a name again
    replaces it (re-running a notebook cell). `default_preset`: what a bare `NAME` means (default: the first preset).
    """
    if "-" in name or not name:
        raise UserInputError(f"model name '{name}': a name must be non-empty without '-' (it separates the preset).")
    if task not in TASKS:
        raise UserInputError(f"model '{name}': task='{task}' is not one of {', '.join(TASKS)}.")
    if not presets:
        raise UserInputError(f"model '{name}' has no presets: give at least one, e.g. {{'tiny': MyConfig}}.")
    default = default_preset or next(iter(presets))
    if default not in presets:
        raise UserInputError(f"model '{name}': default_preset='{default}' is not one of {', '.join(presets)}.")
    spec = ModelSpec(name, module, dict(presets), default, task)
    _MODELS[name] = spec
    return spec


def available_models() -> dict[str, ModelSpec]:
    """Every registered model, the entry points' included."""
    _load_entry_points()
    return dict(_MODELS)


def resolve_model(choice: str) -> tuple[ModelSpec, str]:
    """`gpt` -> (gpt spec, its default preset); `gpt-small` -> (gpt spec, "small")."""
    name, _, preset = choice.partition("-")
    if name not in _MODELS:
        _load_entry_points()
    if name not in _MODELS:
        raise UserInputError(f"unknown model '{name}'. Available: {', '.join(sorted(_MODELS)) or 'none'}.")
    spec = _MODELS[name]
    preset = preset or spec.default_preset
    if preset not in spec.presets:
        close = difflib.get_close_matches(preset, spec.presets, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UserInputError(f"model '{name}' has no preset '{preset}'. Presets: {', '.join(spec.presets)}.{hint}")
    return spec, preset


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()  # importing the package registers its models
