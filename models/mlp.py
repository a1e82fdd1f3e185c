"""A small multi-layer perceptron classifier (e.g. 8x8 digits -> 10 classes)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain


@dataclasses.dataclass(frozen=True)
class MLPConfig(Settings):
    section: ClassVar[str] = "model"

    in_features: int = setting(64, "inputs per example", at_least=1)
    hidden: int = setting(256, "width of each hidden layer", at_least=1)
    n_hidden_layers: int = setting(2, "hidden layers", at_least=1)
    n_classes: int = setting(10, "classes the labels take", at_least=1)
    dtype: str = setting("float32", "compute dtype; params stay float32", choices=COMPUTE_DTYPES)

    def num_params(self) -> int:
        sizes = [self.in_features] + [self.hidden] * self.n_hidden_layers + [self.n_classes]
        return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))

    def train_flops(self, batch_size: int, seq_len: int = 1, weight_gradients: bool = True) -> float:
        """Model FLOPs of one training step (forward + backward = 6 x params per example; 4 x without the weights'
        gradients)."""
        return (4.0 + 2.0 * weight_gradients) * self.num_params() * batch_size


PRESETS = {
    "digits": lambda: MLPConfig(),
    "tiny": lambda: MLPConfig(hidden=64, n_hidden_layers=1),
}


class Dense(nnx.Module):
    def __init__(self, n_in: int, n_out: int, names: tuple[str, str], rngs: nnx.Rngs):
        init = jax.random.normal(rngs.params(), (n_in, n_out)) * (2.0 / n_in) ** 0.5  # He init for ReLU
        self.kernel = nnx.Param(init, out_sharding=names)
        self.bias = nnx.Param(jnp.zeros((n_out,)), out_sharding=(names[1],))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


class MLP(nnx.Module):
    """features -> [hidden, ReLU] x n_hidden_layers -> class logits."""

    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layers = nnx.List(
            [Dense(cfg.in_features, cfg.hidden, ("features", "mlp"), rngs)]
            + [Dense(cfg.hidden, cfg.hidden, ("embed", "mlp"), rngs) for _ in range(cfg.n_hidden_layers - 1)]
        )
        self.head = Dense(cfg.hidden, cfg.n_classes, ("mlp", "classes"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (B, F) -> logits (B, C) float32
        x = x.astype(jnp.dtype(self.cfg.dtype))
        for layer in self.layers:
            x = constrain(jax.nn.relu(layer(x)), ("batch", "mlp"))
        return self.head(x).astype(jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean cross-entropy; also reports accuracy. batch: {"x": (B, F), "y": (B,)}."""
        logits = self(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"accuracy": accuracy}
