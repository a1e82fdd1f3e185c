"""AlphaZero's network for small board games: an observation (e.g. Connect Four's 6x7x2 planes) -> move logits and a
value in [-1, 1] for the player to move. The loss is AlphaZero's: cross-entropy against the search's visit
distribution plus the squared error against the game's outcome. Its task is "custom": it trains on the positions of
its own games, which the application brings as its dataset (self-play, search and the replay buffer live with it, in
`scripts/alphazero.py` and `scripts/alphazero_app/`); this file knows nothing of them or of meshes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.settings import Settings, setting
from jaxtrain.sharding.constraints import constrain

from .mlp import Dense


@dataclasses.dataclass(frozen=True)
class AlphaZeroConfig(Settings):
    section: ClassVar[str] = "model"

    rows: int = setting(6, "board rows (Connect Four: 6)", at_least=1)
    columns: int = setting(7, "board columns (Connect Four: 7)", at_least=1)
    planes: int = setting(2, "observation planes per cell (one per player)", at_least=1)
    n_actions: int = setting(7, "moves a position can offer", at_least=2)
    hidden: int = setting(128, "width of the shared body", at_least=1)
    n_layers: int = setting(3, "hidden layers of the body", at_least=1)

    @property
    def in_features(self) -> int:
        return self.rows * self.columns * self.planes

    def num_params(self) -> int:
        sizes = [self.in_features] + [self.hidden] * self.n_layers
        body = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
        return body + (self.hidden + 1) * (self.n_actions + 1)

    def train_flops(self, batch_size: int, seq_len: int = 1, weight_gradients: bool = True) -> float:
        return (4.0 + 2.0 * weight_gradients) * self.num_params() * batch_size


PRESETS = {"connect4": lambda: AlphaZeroConfig(), "tiny": lambda: AlphaZeroConfig(hidden=32, n_layers=1)}


class AlphaZeroNet(nnx.Module):
    """observation -> [hidden, ReLU] x n_layers -> (policy logits, tanh value)."""

    def __init__(self, cfg: AlphaZeroConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.body = nnx.List(
            [Dense(cfg.in_features, cfg.hidden, ("features", "mlp"), rngs)]
            + [Dense(cfg.hidden, cfg.hidden, ("embed", "mlp"), rngs) for _ in range(cfg.n_layers - 1)]
        )
        self.policy = Dense(cfg.hidden, cfg.n_actions, ("mlp", "classes"), rngs)
        self.value = Dense(cfg.hidden, 1, ("mlp", None), rngs)

    def __call__(self, observation: jax.Array) -> tuple[jax.Array, jax.Array]:  # (B, R, C, P) -> (B, A), (B,)
        x = observation.reshape(observation.shape[0], -1).astype(jnp.float32)
        for layer in self.body:
            x = constrain(jax.nn.relu(layer(x)), ("batch", "mlp"))
        return self.policy(x), jnp.tanh(self.value(x)[:, 0])

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """batch: {"observation": (B, R, C, P), "policy": (B, A) visit distribution, "value": (B,) outcome}."""
        logits, value = self(batch["observation"])
        policy_loss = optax.softmax_cross_entropy(logits, batch["policy"]).mean()
        value_loss = jnp.mean((value - batch["value"]) ** 2)
        return policy_loss + value_loss, {"policy_loss": policy_loss, "value_loss": value_loss}
