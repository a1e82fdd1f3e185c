"""Trainer and sampler agree: the log-probability the generator gives each token it samples is the one the trainer
recomputes from the same params (`GPT.target_log_probs` on prompt + continuation), on one device and on
data=2,tensor=2, in float32 and bfloat16; and it is the model's own, untempered and untruncated.

Not bit for bit: XLA:CPU picks a matmul or reduction kernel by shape, and the decoding step's (B, 1) attention over
the KV cache and the trainer's whole-sequence forward sum in different orders (the attention's probabilities times
values, the softmax's sum over the vocabulary), so a few log-probs differ in the last bits. Measured here (these
prompts, 4 new tokens, log-probs near -2 to -6): on one device at most 4.8e-7 (1 ulp; 6 of 24 in float32, 1 of 24
in bfloat16), on data=2,tensor=2 all equal, in both dtypes; with 6 new tokens and a fresh init's embedding at most
9.5e-7, with 24 new tokens 1.4e-6, and then the mesh's differ too.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import cached_run

from jaxtrain.inference.generate import Generation, Generator, generation_shardings
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import build_mesh, parse_layout
from jaxtrain.training.setup import Run

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 8], [200, 1, 64]]  # ragged: the rows' new tokens start at different positions
NEW = 4
# A few float32 ulps of log-probs near -5 (one is 4.8e-7): about three times the most measured (module docstring).
ATOL = 4e-6
EMBEDDING_SCALE = 3.0  # a peakier distribution than a fresh init's nearly uniform one, as a trained model has


def llama_tiny(dtype: str) -> tuple[Run, dict]:
    """llama-tiny (grouped-query attention, tied embeddings) computing in `dtype`, and its params."""
    run = cached_run("single", () if dtype == "float32" else (f"dtype={dtype}",), model="llama-tiny")
    params = jax.device_get(run.shardings.init_state(run.optimizer, 0)["params"])
    return run, {**params, "embedding": params["embedding"] * EMBEDDING_SCALE}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def run_and_params(request):
    return llama_tiny(request.param)


def generator_on(run, params, layout: str, devices: int) -> Generator:
    mesh = build_mesh(parse_layout(layout), jax.devices()[:devices])
    return Generator(generation_shardings(run.placed.on_mesh(mesh)), params, run.cfg)


def trainer_log_probs(generator: Generator, result: Generation) -> list[np.ndarray]:
    """What the trainer computes for each new token: `target_log_probs` of prompt + continuation, on the generator's
    mesh under its activation rules, rows right-padded to one batch as a training batch would be."""
    sequences = [prompt + tokens for prompt, tokens in zip(PROMPTS, result.tokens)]
    rows = -(-len(sequences) // generator.batch_ways) * generator.batch_ways
    padded = np.zeros((rows, max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
    shardings = generator.shardings

    def log_probs(params, tokens):
        with activation_sharding(shardings.mesh, shardings.rules):
            return nnx.merge(shardings.model.graphdef, params).target_log_probs({"tokens": tokens})

    program = jax.jit(log_probs, out_shardings=shardings.replicated)
    per_token = np.asarray(program(generator.params, jax.device_put(padded, shardings.batch_sharding(padded.shape))))
    # Target t of a row is token t + 1: a prompt of n tokens has its first new token at target n - 1.
    return [per_token[row, len(p) - 1 : len(p) - 1 + len(c)] for row, (p, c) in enumerate(zip(PROMPTS, result.tokens))]


@pytest.mark.parametrize("layout,devices", [("data=1", 1), ("data=2,tensor=2", 4)])
def test_the_samplers_log_probs_are_the_trainers(run_and_params, layout, devices):
    generator = generator_on(*run_and_params, layout, devices)
    for settings in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 1}):  # one compiled program for both
        result = generator.generate(PROMPTS, max_new_tokens=NEW, **settings)
        assert [len(lp) for lp in result.log_probs] == [len(t) for t in result.tokens] == [NEW] * len(PROMPTS)
        sampled, trained = np.concatenate(result.log_probs), np.concatenate(trainer_log_probs(generator, result))
        assert sampled.dtype == np.float32 and (sampled < 0).all()
        np.testing.assert_allclose(sampled, trained, rtol=0, atol=ATOL)


def test_log_probs_are_the_models_whatever_the_sampling_settings():
    """At temperature 0.5 and top-k 3 each token's log-prob is still log_softmax of the raw logits, not of the tempered,
    truncated distribution it was drawn from; a row stopped at eos has as many log-probs as tokens."""
    generator = generator_on(*llama_tiny("float32"), "data=1", 1)
    settings = {"temperature": 0.5, "top_k": 3, "seed": 2, "return_logits": True}
    result = generator.generate(PROMPTS, max_new_tokens=NEW, **settings)
    logits, tokens = np.concatenate(result.logits).astype(np.float64), np.concatenate(result.tokens)
    picked = np.take_along_axis(logits, tokens[:, None], -1)[:, 0]
    model = picked - np.log(np.exp(logits).sum(-1))
    tempered = picked / 0.5 - np.log(np.exp(np.sort(logits, -1)[:, -3:] / 0.5).sum(-1))
    np.testing.assert_allclose(np.concatenate(result.log_probs), model, rtol=0, atol=1e-5)
    assert np.abs(tempered - model).max() > 0.1  # the test tells the two apart
    eos = result.tokens[0][1]
    stopped = generator.generate(PROMPTS, max_new_tokens=NEW, eos_id=eos, **settings)
    assert len(stopped.tokens[0]) <= 2
    assert [len(lp) for lp in stopped.log_probs] == [len(t) for t in stopped.tokens]
    np.testing.assert_array_equal(stopped.log_probs[0], result.log_probs[0][: len(stopped.tokens[0])])
