"""Small shared test helpers: build a run on some devices, take steps or gradients, compare with a reference."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxtrain.config import apply_overrides, default_config
from jaxtrain.run import Setup, build

TINY = ["batch_size=8", "seq_len=32", "train.steps=10", "warmup_steps=1", "learning_rate=0.01"]


def make_run(mesh: str, overrides: list[str] = (), model: str = "gpt-tiny", devices: int = 8) -> Setup:
    """A run whose steps compile when first used."""
    cfg = apply_overrides(default_config(model), [*TINY, *overrides, f"mesh={mesh}"])
    return build(cfg, log=lambda *_: None, devices=jax.devices()[:devices])


@functools.cache
def cached_run(mesh: str, overrides: tuple[str, ...] = (), model: str = "gpt-tiny") -> Setup:
    """`make_run` once per test session for each (mesh, overrides, model), on 1 device for "single", else 8: tests
    that share a run share its compiled steps (each compile costs seconds)."""
    return make_run(mesh, overrides, model=model, devices=1 if mesh == "single" else 8)


@functools.cache
def reference_losses(overrides: tuple[str, ...] = (), model: str = "gpt-tiny") -> np.ndarray:
    """The first 5 training losses on one device: what every mesh must reproduce."""
    return losses(cached_run("single", overrides, model))


def losses(run: Setup, steps: int = 5, params=None) -> np.ndarray:
    """The first `steps` training losses of `run`, from its own initialisation or from `params` (model order)."""
    state = run.plan.init_state(run.optimizer, run.cfg.train.seed, params)
    out = []
    for step in range(steps):
        state, metrics = run.train_step(state, run.batch("train", step))
        out.append(float(metrics["loss"]))
    return np.array(out)


def gradients(run: Setup) -> tuple[float, list[np.ndarray]]:
    """Loss and gradient leaves (in the model's own layer order) of the initial params on the first batch."""
    params = run.plan.init_state(run.optimizer, run.cfg.train.seed)["params"]
    (loss, _), grads = run.compiled_grad(params, run.batch("train", 0))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(jax.device_get(run.plan.params_in_model_order(grads)))]


def assert_gradients_close(got: list[np.ndarray], reference: list[np.ndarray], rtol: float = 1e-5) -> None:
    """Each gradient leaf within `rtol` of the reference, relative to the leaf's norm (elementwise relative error
    is meaningless for entries that are zero up to rounding)."""
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        assert g.shape == r.shape
        assert np.linalg.norm(g - r) <= rtol * np.linalg.norm(r), (np.linalg.norm(g - r), np.linalg.norm(r))
