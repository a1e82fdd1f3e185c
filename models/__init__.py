"""Model registry: `--model NAME` or `--model NAME-PRESET` (e.g. `gpt`, `gpt-small`, `mlp`).

Each model is a plain Flax NNX module with a `loss(batch) -> (loss, metrics)` method, a frozen config dataclass
with `train_flops(batch_size, seq_len)`, and named presets. Nothing here knows about meshes.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

from jaxtrain.errors import UserInputError
from models import gpt, mlp, moe, recsys, resnet


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    module: type
    presets: dict[str, Callable[[], object]]
    default_preset: str
    task: str  # "lm" (token sequences), "classification" (feature vectors + labels) or "clicks" (recommendations)


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", gpt.GPT, gpt.PRESETS, "cpu", "lm"),
    "mlp": ModelSpec("mlp", mlp.MLP, mlp.PRESETS, "digits", "classification"),
    "resnet": ModelSpec("resnet", resnet.ResNet, resnet.PRESETS, "digits", "classification"),
    "recsys": ModelSpec("recsys", recsys.DLRM, recsys.PRESETS, "tiny", "clicks"),
    "moe": ModelSpec("moe", moe.MoE, moe.PRESETS, "tiny", "lm"),
}


def resolve_model(choice: str) -> tuple[ModelSpec, str]:
    """`gpt` -> (gpt spec, its default preset); `gpt-small` -> (gpt spec, "small")."""
    name, _, preset = choice.partition("-")
    if name not in MODELS:
        raise UserInputError(f"unknown model '{name}'. Available: {', '.join(sorted(MODELS))}.")
    spec = MODELS[name]
    preset = preset or spec.default_preset
    if preset not in spec.presets:
        close = difflib.get_close_matches(preset, spec.presets, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UserInputError(f"model '{name}' has no preset '{preset}'. Presets: {', '.join(spec.presets)}.{hint}")
    return spec, preset
