"""A DLRM-style recommender: embedding tables for categorical ids, MLPs for dense features, dot-product interaction.

    dense (B, N) --bottom MLP--> z (B, E) ---------------------------------------+
    ids (B, F) --table lookups--> e (B, F, E) --pairwise dots of [z, e_1..e_F]--> top MLP --> click logit (B,)

The tables hold nearly all the parameters (real ones have billions of rows) and each example reads a few rows, so
their rows are split over devices (`table_rows`: model parallel), and each device updates its own rows from its own
lookups: table gradients never move. The MLPs are small and compute-heavy: replicated (`fc_in`, `fc_out`), they run
data parallel over every device (`dense_batch`). In between, the ids are spread over the devices that split the
rows (`lookup_batch`: the batch axes but those), each looks the same examples up in its own rows, and the rows
found are summed over those devices and handed on split over the whole batch.
The tables are stacked into one (F, R, E) array of equal-sized tables, so all F lookups are one gather that the
compiler partitions as masked local lookups plus that sum. (A flat (F*R, E) table with id offsets would not do:
reshaping row-split tables gathers them whole.)

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = DLRM(PRESETS["tiny"](), nnx.Rngs(0))
    >>> model(jnp.zeros((2, 13)), jnp.zeros((2, 8), jnp.int32)).shape
    (2,)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.errors import UserInputError
from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain


@dataclasses.dataclass(frozen=True)
class RecsysConfig(Settings):
    section: ClassVar[str] = "model"

    n_dense: int = setting(13, "dense features per example", at_least=1)
    n_tables: int = setting(8, "categorical fields, one embedding table each", at_least=1)
    vocab_size: int = setting(128, "rows of every table (ids per field)", at_least=1)
    embed_dim: int = setting(16, "width of each embedding", at_least=1)
    hidden: int = setting(64, "width of the MLPs' hidden layers", at_least=1)
    bottom_layers: int = setting(1, "hidden layers of the bottom MLP, before its projection to embed_dim", at_least=0)
    top_layers: int = setting(2, "hidden layers of the top MLP, before its click logit", at_least=0)
    dtype: str = setting("float32", "compute dtype; params stay float32", choices=COMPUTE_DTYPES)

    @property
    def n_pairs(self) -> int:
        """Feature pairs the interaction scores: each of the F tables' vectors and the dense vector with another."""
        return (self.n_tables + 1) * self.n_tables // 2

    def mlp_sizes(self) -> tuple[list[int], list[int]]:
        """Layer widths, inputs first, of the bottom and the top MLP."""
        bottom = [self.n_dense] + [self.hidden] * self.bottom_layers + [self.embed_dim]
        top = [self.embed_dim + self.n_pairs] + [self.hidden] * self.top_layers + [1]
        return bottom, top

    def num_params(self) -> int:
        mlps = sum(a * b + b for sizes in self.mlp_sizes() for a, b in zip(sizes[:-1], sizes[1:]))
        return self.n_tables * self.vocab_size * self.embed_dim + mlps

    def train_flops(self, batch_size: int, seq_len: int = 1, weight_gradients: bool = True) -> float:
        """Model FLOPs of one training step: 6 x MLP params per example (4 x without the weights' gradients) plus
        the interaction's dot products (a lookup is not a matmul and does not count)."""
        mlp_params = self.num_params() - self.n_tables * self.vocab_size * self.embed_dim
        interaction = 2.0 * self.n_pairs * self.embed_dim
        return ((4.0 + 2.0 * weight_gradients) * mlp_params + 3.0 * interaction) * batch_size


PRESETS = {
    "tiny": lambda: RecsysConfig(),
    # Tables dominate (8 x 8192 x 32 = 2.1M of 2.1M params): for memory tests and learning with more ids.
    "tables": lambda: RecsysConfig(vocab_size=8192, embed_dim=32),
    # For planning: 8 tables of 4M rows x 128 (4.3G params, 17 GB in float32, 52 GB with Adam's moments).
    "large": lambda: RecsysConfig(vocab_size=2**22, embed_dim=128, hidden=1024, bottom_layers=2, top_layers=3),
}


class Dense(nnx.Module):
    """A replicated (data-parallel) fully connected layer."""

    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        init = jax.random.normal(rngs.params(), (n_in, n_out)) * (2.0 / n_in) ** 0.5  # He init for ReLU
        self.kernel = nnx.Param(init, out_sharding=("fc_in", "fc_out"))
        self.bias = nnx.Param(jnp.zeros((n_out,)), out_sharding=("fc_out",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


def mlp(layers: nnx.List, x: jax.Array) -> jax.Array:
    """ReLU between layers, none after the last."""
    for i, layer in enumerate(layers):
        x = layer(x)
        if i < len(layers) - 1:
            x = constrain(jax.nn.relu(x), ("dense_batch", "fc_out"))
    return x


class DLRM(nnx.Module):
    """Bottom MLP on dense features, one embedding table per field, pairwise dot products, top MLP -> logit."""

    def __init__(self, cfg: RecsysConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        # Small enough that the dot products of random rows start near 0, large enough that their gradients
        # (which scale with the other rows) do not.
        tables = jax.random.normal(rngs.params(), (cfg.n_tables, cfg.vocab_size, cfg.embed_dim)) * 0.1
        self.tables = nnx.Param(tables, out_sharding=("tables", "table_rows", "table_embed"))
        bottom, top = cfg.mlp_sizes()
        self.bottom = nnx.List([Dense(a, b, rngs) for a, b in zip(bottom[:-1], bottom[1:])])
        self.top = nnx.List([Dense(a, b, rngs) for a, b in zip(top[:-1], top[1:])])

    def __call__(self, dense: jax.Array, ids: jax.Array) -> jax.Array:  # (B, N), (B, F) -> click logits (B,)
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        z = mlp(self.bottom, constrain(dense.astype(dtype), ("dense_batch", None)))  # (B, E)
        looked_up = constrain(ids, ("lookup_batch", "tables"))
        rows = self.tables[...][jnp.arange(cfg.n_tables), looked_up].astype(dtype)  # (B, F, E)
        rows = constrain(rows, ("dense_batch", "tables", "table_embed"))
        vectors = jnp.concatenate([z[:, None, :], rows], axis=1)  # (B, F + 1, E)
        dots = jnp.einsum("bie,bje->bij", vectors, vectors)  # (B, F + 1, F + 1)
        upper_i, upper_j = jnp.triu_indices(cfg.n_tables + 1, k=1)
        features = jnp.concatenate([z, dots[:, upper_i, upper_j]], axis=1)  # (B, E + pairs)
        return mlp(self.top, features)[:, 0].astype(jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean binary cross-entropy of the clicks; also accuracy. batch: {"dense": (B, N), "ids": (B, F),
        "click": (B,)}."""
        self._check(batch)
        logits = self(batch["dense"], batch["ids"])
        loss = optax.sigmoid_binary_cross_entropy(logits, batch["click"]).mean()
        accuracy = jnp.mean((logits > 0) == (batch["click"] == 1))
        return loss, {"accuracy": accuracy}

    def _check(self, batch: dict[str, jax.Array]) -> None:
        expected = {"dense": ("n_dense", self.cfg.n_dense), "ids": ("n_tables", self.cfg.n_tables)}
        for key, (field, width) in expected.items():
            if key not in batch or batch[key].shape[-1] != width:
                got = batch[key].shape if key in batch else "nothing"
                raise UserInputError(
                    f"the recommender takes '{key}' of width {width} (model.{field}={width}), but the data gives "
                    f"{got}. Use data.source=clicks, or match the model to the data."
                )
