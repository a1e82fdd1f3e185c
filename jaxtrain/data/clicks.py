"""Synthetic click logs with a known generating rule, for recommender models (DLRM and the like).

Each example has `N_DENSE` dense features and `N_FIELDS` categorical ids (one per field, uniform in
[0, vocab_size)), and a click drawn with probability sigmoid(logit):

    logit = c + w.x + sum_f b[f, id_f] + sum_{f<g} <u[f, id_f], u[g, id_g]> + sum_f <A x, u[f, id_f]>

with a bias b and a latent vector u (LATENT dims) per id of every field, and fixed w, A. The pairwise terms average
to zero over any single id, so a logistic regression on the dense features and one-hot ids (see
`logistic_baseline`) can learn only c, w and b; a model with embeddings and a dot-product feature interaction can
learn all of it. The rule (the "world": c, w, A, b, u) is fixed whatever the run's seed, and b and u are hashes of
(field, id), so any vocabulary size costs no memory. The examples are hashes of (seed, split, step, row, slot):
like every dataset here, a batch is a pure function of (seed, split, step, row).

    >>> data = Clicks(vocab_size=128, seed=0)
    >>> batch = data.rows("train", 0, range(4), 4)
    >>> batch["ids"].shape, batch["dense"].shape, batch["click"].shape
    ((4, 8), (4, 13), (4,))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain.data.splits import SPLITS
from jaxtrain.errors import UserInputError

N_DENSE = 13  # as in the Criteo click logs
N_FIELDS = 8
LATENT = 4
# Scales of the rule's terms, chosen so that the pairwise terms matter (over a third of the logit's variance). Measured
# with vocab_size 128 on 4096 validation examples: the true probabilities classify 87% of clicks right (log loss
# 0.29); a logistic regression fit on 512K examples, 77% (0.48).
_BIAS, _DENSE_WEIGHT, _LATENT_STD, _DENSE_LATENT = -0.3, 0.3, 0.45, 0.15
_WORLD = 20240607  # the rule's key, apart from every run's seed


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs look independent and uniform."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _uniform(*keys: np.ndarray | int) -> np.ndarray:
    """Uniform numbers in (0, 1), one per broadcast element of `keys` (non-negative integers), pure in the keys."""
    shape = np.broadcast_shapes(*(np.shape(k) for k in keys))
    h = np.full(shape, _WORLD, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash intends
        for k in keys:
            h = _mix((h + np.uint64(0x9E3779B97F4A7C15)) ^ np.asarray(k, dtype=np.uint64))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53


def _normal(*keys: np.ndarray | int) -> np.ndarray:
    """Standard normal numbers, one per broadcast element of `keys` (Box-Muller on two hashed uniforms)."""
    u1, u2 = _uniform(*keys, 0), _uniform(*keys, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class Clicks:
    """Synthetic click logs: {"dense": (B, N_DENSE) float32, "ids": (B, N_FIELDS) int32, "click": (B,) int32}."""

    task = "clicks"

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size < 1:
            raise UserInputError(f"click data needs at least 1 id per field (model.vocab_size), got {vocab_size}.")
        self.vocab_size, self.seed = vocab_size, seed
        world = np.random.default_rng(_WORLD)
        self.dense_weight = world.standard_normal(N_DENSE) * _DENSE_WEIGHT  # w
        self.dense_latent = world.standard_normal((N_DENSE, LATENT)) * _DENSE_LATENT  # A, as x @ A

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "dense": jax.ShapeDtypeStruct((batch_size, N_DENSE), np.float32),
            "ids": jax.ShapeDtypeStruct((batch_size, N_FIELDS), np.int32),
            "click": jax.ShapeDtypeStruct((batch_size,), np.int32),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        row = np.asarray(rows, dtype=np.int64)[:, None]  # (R, 1)
        key = (self.seed, SPLITS[split], step, row)
        ids = (_uniform(*key, 0, np.arange(N_FIELDS)) * self.vocab_size).astype(np.int64)  # (R, F)
        dense = _normal(*key, 1, np.arange(N_DENSE))  # (R, N_DENSE)
        click = _uniform(*key, 2)[:, 0] < self.probability(dense, ids)
        return {"dense": dense.astype(np.float32), "ids": ids.astype(np.int32), "click": click.astype(np.int32)}

    def logit(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The true click logit of each example. dense: (R, N_DENSE), ids: (R, N_FIELDS) -> (R,)."""
        fields = np.arange(ids.shape[1])
        bias = _normal(fields, ids, 0)  # (R, F)
        latent = _normal(fields[:, None], ids[..., None], 1 + np.arange(LATENT)) * _LATENT_STD  # (R, F, LATENT)
        total = latent.sum(1)  # (R, LATENT)
        pairs = 0.5 * ((total * total).sum(-1) - (latent * latent).sum((1, 2)))  # sum over f < g of <u_f, u_g>
        dense_pairs = ((dense @ self.dense_latent) * total).sum(-1)  # sum over f of <A x, u_f>
        return _BIAS + dense @ self.dense_weight + bias.sum(1) + pairs + dense_pairs

    def probability(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The true click probability of each example."""
        return 1.0 / (1.0 + np.exp(-self.logit(dense, ids)))


def batches(data: Clicks, split: str, steps: int, batch_size: int) -> dict[str, np.ndarray]:
    """Batches 0 .. steps-1 of `split`, concatenated: the examples a run of `steps` steps sees."""
    parts = [data.rows(split, step, range(batch_size), batch_size) for step in range(steps)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def logistic_baseline(train: dict[str, np.ndarray], test: dict[str, np.ndarray], vocab_size: int) -> dict[str, float]:
    """A logistic regression on the dense features and one-hot ids, fit to convergence on `train` (full batch,
    L-BFGS, a small L2 penalty so unseen ids stay at 0), scored on `test`: {"accuracy", "loss"} (mean log loss)."""
    n_fields = train["ids"].shape[1]

    def logits(params, x):
        per_id = jnp.take_along_axis(params["ids"], x["ids"].T, axis=1).sum(0)  # (R,)
        return x["dense"] @ params["dense"] + per_id + params["bias"]

    def loss(params, x):
        data_loss = optax.sigmoid_binary_cross_entropy(logits(params, x), x["click"]).mean()
        return data_loss + 1e-5 * jnp.sum(params["ids"] ** 2)

    params = {
        "ids": jnp.zeros((n_fields, vocab_size)),
        "dense": jnp.zeros(train["dense"].shape[1]),
        "bias": jnp.zeros(()),
    }
    train = jax.tree.map(jnp.asarray, train)
    solver = optax.lbfgs()

    def train_loss(params):
        return loss(params, train)

    value_and_grad = optax.value_and_grad_from_state(train_loss)

    @jax.jit
    def fit(params):
        def step(carry, _):
            params, state = carry
            value, grad = value_and_grad(params, state=state)
            updates, state = solver.update(grad, state, params, value=value, grad=grad, value_fn=train_loss)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(step, (params, solver.init(params)), length=200)[0][0]

    params = fit(params)
    test = jax.tree.map(jnp.asarray, test)
    z = logits(params, test)
    return {
        "accuracy": float(jnp.mean((z > 0) == (test["click"] == 1))),
        "loss": float(optax.sigmoid_binary_cross_entropy(z, test["click"]).mean()),
    }
