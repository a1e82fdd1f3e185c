"""Models on their own: no mesh, analytic parameter counts that the FLOP counts rely on, and presets' sizes."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxtrain.plan import split_model
from models import MODELS, resolve_model


@pytest.mark.parametrize("name", [f"{m}-{p}" for m, spec in MODELS.items() for p in spec.presets])
def test_analytic_parameter_count_matches_the_model(name):
    spec, preset = resolve_model(name)
    cfg = spec.presets[preset]()
    abstract = split_model(lambda rngs: spec.module(cfg, rngs)).abstract_params
    assert sum(math.prod(p.shape) for p in jax.tree.leaves(abstract)) == cfg.num_params()


def test_preset_sizes():
    def billions(name):
        spec, preset = resolve_model(name)
        return spec.presets[preset]().num_params() / 1e9

    assert 0.12 < billions("gpt-small") < 0.17  # GPT-2 small's blocks; the untied output head adds 39M
    assert 0.9 < billions("gpt-1b") < 1.1


def test_gpt_runs_without_any_mesh():
    spec, _ = resolve_model("gpt-tiny")
    with nnx.use_eager_sharding(False):
        model = spec.module(spec.presets["tiny"](), nnx.Rngs(0))
    tokens = jnp.zeros((2, 17), jnp.int32)
    loss, _ = model.loss({"tokens": tokens})
    assert model(tokens[:, :-1]).shape == (2, 16, 256) and jnp.isfinite(loss)
