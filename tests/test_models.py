"""Models on their own: no mesh, analytic parameter counts that the FLOP counts rely on, and presets' sizes; the
decoders are causal, and the training loss is the next-token cross-entropy computed by hand."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cached_run, reference_curve

from jaxtrain.placement.model import split_model
from jaxtrain.registry import available_models, resolve_model


@pytest.mark.parametrize("name", [f"{m}-{p}" for m, spec in available_models().items() for p in spec.presets])
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


def build(name: str, **overrides) -> nnx.Module:
    spec, preset = resolve_model(name)
    with nnx.use_eager_sharding(False):
        return spec.module(dataclasses.replace(spec.presets[preset](), **overrides), nnx.Rngs(0))


@pytest.mark.parametrize(
    "name,overrides",
    [
        pytest.param("gpt-tiny", {}, id="gpt-tiny"),
        pytest.param("moe-tiny", {"capacity_factor": 4.0}, id="moe-tiny-no-drops"),
        pytest.param("moe-tiny", {}, id="moe-tiny-with-drops"),  # slots go in token order: drops are causal too
        pytest.param("moe-tiny", {"routing": "dropless"}, id="moe-tiny-dropless"),
    ],
)
def test_logits_never_see_later_tokens(name, overrides):
    """Changing the token at position t changes the logits at t and never those before it."""
    model = build(name, **overrides)
    forward = nnx.jit(lambda m, tokens: m(tokens))
    vocab = model.cfg.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 32))

    def logits(tokens):
        out = forward(model, tokens)
        return np.asarray(out[0] if isinstance(out, tuple) else out)  # MoE returns its routing statistics too

    before = logits(tokens)
    for t in (1, 16, 31):
        changed = tokens.copy()
        changed[:, t] = (changed[:, t] + 1) % vocab
        after = logits(changed)
        np.testing.assert_allclose(after[:, :t], before[:, :t], rtol=0, atol=1e-6, err_msg=f"position {t}")
        assert np.abs(after[:, t] - before[:, t]).max() > 1e-2  # the changed token itself is seen


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean of -log softmax(logits)[target] over (B, T), in float64: logits (B, T, V), targets (B, T)."""
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_probs, targets[..., None], axis=-1).mean())


def test_next_token_loss_by_hand():
    """The loss of tokens (B, T + 1) is the cross-entropy of the logits of tokens[:, :-1] against tokens[:, 1:]."""
    model = build("gpt-tiny")
    # A head that predicts token + 1 from token (its column v is the embedding of v - 1), confidently, over rows that
    # count up: the right targets get a low loss, the input tokens or the ones after next a high one.
    model.head[...] = jnp.roll(model.embedding[...], 1, axis=0).T * 4
    starts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 1))
    tokens = (starts + np.arange(17)) % model.cfg.vocab_size
    loss = float(model.loss({"tokens": jnp.asarray(tokens)})[0])
    logits = np.asarray(model(jnp.asarray(tokens[:, :-1])))  # (B, T, V)
    assert loss == pytest.approx(cross_entropy(logits, tokens[:, 1:]), rel=1e-5)
    # The check tells the shift apart: against each input token itself, or the one after the next, it is far off.
    for wrong in (tokens[:, :-1], np.roll(tokens, -1, axis=1)[:, 1:]):
        assert cross_entropy(logits, wrong) > loss + 2  # measured: 2.12 against 5.52 and 5.65


def test_training_loss_is_the_next_token_loss_of_the_batch():
    """The train step's loss at step 0 is the loss by hand of the model's initial params on batch 0."""
    run = cached_run("single")
    with nnx.use_eager_sharding(False):
        model = nnx.merge(run.shardings.model.graphdef, run.shardings.model.init_params(run.cfg.train.seed))
    tokens = np.asarray(run.batch("train", 0)["tokens"])  # (B, T + 1)
    logits = np.asarray(model(jnp.asarray(tokens[:, :-1])))
    assert reference_curve()["loss"][0] == pytest.approx(cross_entropy(logits, tokens[:, 1:]), rel=1e-6)
