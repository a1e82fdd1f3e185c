"""The model registry: `--model NAME` or `--model NAME-PRESET` (e.g. `gpt`, `gpt-small`, `mlp`).

The library never imports a model package. Models arrive here by `register_model`, called by the package that
defines them when it is imported: the project's own `jaxtrain_models` package (the models/ folder of a checkout), or
a user's. The first lookup of a name that is not registered loads the packages that installed projects declare under
the `jaxtrain.models` entry-point group (this project declares `jaxtrain_models`), so `jaxtrain train --model gpt`
works without anyone importing `jaxtrain_models` first.
What a model must provide: `register_model`'s docstring, and docs/models.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
from collections.abc import Callable, Mapping

from jaxtrain.errors import UserInputError

ENTRY_POINT_GROUP = "jaxtrain.models"
# The data a model trains on. "custom": data no source in `jaxtrain.data` makes, which the run brings as its dataset
# (`build(cfg, dataset=...)`, `train(cfg, dataset=...)`), e.g. an application's replay buffer; its batch is the model's.
TASKS = ("lm", "classification", "clicks", "mlm", "text_classification", "custom")
# The tasks whose examples are sequences of data.seq_len tokens: a step's tokens are rows x seq_len, and the mesh may
# split the sequence (a context axis).
SEQUENCE_TASKS = ("lm", "mlm", "text_classification")


class ModelRegistrationError(UserInputError):
    """A model that cannot be registered as given: a bad name, task, preset or module."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model: its Flax NNX module class (built as `module(config, rngs=...)`), its named config
    presets, the preset a bare name means, the data it trains on (one of `TASKS`), and whether parameters without
    logical names are replicated (else refused)."""

    name: str
    module: type
    presets: Mapping[str, Callable[[], object]]
    default_preset: str
    task: str  # one of TASKS: "lm" (token sequences), "classification" (features + labels), "clicks", "mlm", ...
    replicate_unnamed: bool = False


_MODELS: dict[str, ModelSpec] = {}
_entry_points_loaded = False


# Long: the docstring is the contract a model author reads (what a model provides), with a runnable example;
# the code is 15 lines.
def register_model(
    name: str,
    module: type,
    presets: Mapping[str, Callable[[], object]],
    *,
    task: str = "lm",
    default_preset: str | None = None,
    replicate_unnamed: bool = False,
) -> ModelSpec:
    """Make `--model NAME[-PRESET]` (and `jaxtrain.config("NAME-PRESET")`) build `module(presets[PRESET](),
    rngs=nnx.Rngs(seed))`.

    What the model provides:

    - `module(config, rngs=...)` builds it; nothing in it knows about meshes or the run config.
    - `loss(batch) -> (loss, metrics)`: a scalar mean over the batch's examples and a dict of scalar metrics (may be
      empty). The batch is the task's: `lm` {"tokens": int32 (B, T + 1)}; `classification` {"x": float32 (B, F),
      "y": int32 (B,)}; `clicks` the recommender batch of `jaxtrain.data.clicks`; `mlm` {"tokens": int32 (B, T) with
      the chosen positions replaced, "targets": int32 (B, T) the original tokens, "loss_weights": float32 (B, T) 1
      where chosen, and where the source packs documents "segment_ids": int32 (B, T), 0 padding}
      (`jaxtrain.data.masking`); `text_classification` {"tokens": int32 (B, T), "segment_ids": int32 (B, T) 1 on
      tokens and 0 on padding, "labels": int32 (B,)} (`jaxtrain.data.text_classes`); `custom` whatever the dataset
      the run brings gives (no data source makes it: the run passes `dataset=` to `build` or `train`).
    - Logical names on every parameter, one per dimension (a name or None), which the sharding rules map to mesh
      axes: `nnx.Param(value, out_sharding=("embed", "mlp"))`, or for Flax layers `kernel_init=
      nnx.with_partitioning(init, ("embed", "mlp"))`. A parameter without names is refused, naming it, unless
      `replicate_unnamed=True`: then every device keeps the whole of it.
    - A config dataclass per preset (`presets`: preset name -> a callable returning one, e.g. the class itself),
      whose fields become `key=value` overrides. Optional fields the data reads: `vocab_size` (lm, mlm,
      text_classification), `in_features` (classification) and `n_classes` (classification, text_classification).
      Optional `train_flops(batch_size, seq_len, weight_gradients=True) -> float`, the model FLOPs of a step for
      throughput and MFU (`weight_gradients=False`: with every weight frozen, as under adapters, which add their
      own); without it, they come from XLA's cost analysis of the compiled step, which counts the body of a loop once
      (a model that scans its layers is undercounted).

    `default_preset`: what a bare `NAME` means (default: the first preset). Registering a name again replaces it
    (re-running a notebook cell). Returns the `ModelSpec`.

    >>> import dataclasses, jax, optax
    >>> from flax import nnx
    >>> import jaxtrain
    >>> @dataclasses.dataclass(frozen=True)
    ... class BigramConfig:
    ...     vocab_size: int = 256
    >>> class Bigram(nnx.Module):
    ...     def __init__(self, cfg: BigramConfig, rngs: nnx.Rngs):
    ...         table = 0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.vocab_size))
    ...         self.table = nnx.Param(table, out_sharding=("vocab", None))
    ...     def loss(self, batch):
    ...         tokens = batch["tokens"]  # (B, T + 1)
    ...         logits = self.table[...][tokens[:, :-1]]  # (B, T, V)
    ...         return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), {}
    >>> jaxtrain.register_model("bigram", Bigram, {"base": BigramConfig})   # doctest: +ELLIPSIS
    ModelSpec(name='bigram', ...)
    >>> cfg = jaxtrain.config("bigram", mesh="data=-1", steps=5)
    """
    _check_name(name)
    if task not in TASKS:
        raise ModelRegistrationError(f"model '{name}': task='{task}' is not one of {', '.join(TASKS)}.")
    if not callable(module) or not callable(getattr(module, "loss", None)):
        raise ModelRegistrationError(
            f"model '{name}': {module!r} is not a model class with a loss(batch) -> (loss, metrics) method."
        )
    _check_presets(name, presets)
    default = default_preset or next(iter(presets))
    if default not in presets:
        raise ModelRegistrationError(f"model '{name}': default_preset='{default}' is not one of {', '.join(presets)}.")
    spec = ModelSpec(name, module, dict(presets), default, task, replicate_unnamed)
    _MODELS[name] = spec
    return spec


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "-" in name:
        raise ModelRegistrationError(
            f"model name {name!r}: a name must be a non-empty string without '-' (it separates the preset)."
        )


def _check_presets(name: str, presets: Mapping[str, Callable[[], object]]) -> None:
    """Each preset a callable returning a config dataclass: its fields are the `key=value` overrides."""
    if not presets:
        raise ModelRegistrationError(f"model '{name}' has no presets: give at least one, e.g. {{'tiny': MyConfig}}.")
    for preset, make in presets.items():
        made = make() if callable(make) else None
        if not dataclasses.is_dataclass(made) or isinstance(made, type):
            got = f"it returns a {type(made).__name__}" if callable(make) else "it is not callable"
            raise ModelRegistrationError(
                f"model '{name}', preset '{preset}': {make!r} should be a callable returning a config dataclass "
                f"instance (e.g. the dataclass itself), but {got}."
            )


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
        close = difflib.get_close_matches(name, _MODELS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        available = ", ".join(sorted(_MODELS)) or "none"
        raise UserInputError(
            f"unknown model '{name}'. Available: {available}.{hint} A model of your own: jaxtrain.register_model."
        )
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
    registered_first = dict(_MODELS)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()  # importing the package registers its models
    # A model a user registered before the packages loaded keeps its name: the user chose it, not the import order.
    _MODELS.update(registered_first)
