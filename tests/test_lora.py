"""LoRA adapters (jaxtrain.posttrain.adapters): the same adapter gradients and losses on every kind of mesh as on
one device, a base model left exactly as it was, no gradient of a base weight in the compiled program, the optimizer
state of the adapters alone, merging, and the bad inputs."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_adapters_match_one_device, make_run, with_random_adapters

from jaxtrain.analysis.hlo import collectives
from jaxtrain.analysis.matmuls import matmuls
from jaxtrain.placement.place import place_model
from jaxtrain.posttrain.adapters import AdapterError, adapt
from jaxtrain.run_config import ConfigError, LoraConfig, apply_overrides, default_config
from jaxtrain.sharding.rules import is_layer_stack, is_logical_names

# seq_len=24: a device's tokens (48 on these meshes) match no model width, so no activation has a weight's size, and
# a dot or a reducing collective of a weight's size forms or reduces the weight's gradient.
SHAPES = ("seq_len=24",)
LORA = ("lora.rank=4", "lora.alpha=8", *SHAPES)
HYBRID, PIPELINE, CONTEXT = "data=2,fsdp=2,tensor=2", "pipeline=2,data=2,tensor=2", "context=2,data=2"
DEVICES = {"single": 1, HYBRID: 8, PIPELINE: 8, CONTEXT: 4}


@functools.cache
def lora_run(mesh: str):
    """gpt-tiny (float32) with rank-4 adapters on its attention and MLP weights, built once per mesh."""
    return make_run(mesh, list(LORA), devices=DEVICES[mesh])


@functools.cache
def start_state() -> dict:
    """One device's initial train state with every adapter factor drawn at random (`with_random_adapters`)."""
    return with_random_adapters(lora_run("single"))


@pytest.mark.parametrize("mesh", [HYBRID, PIPELINE, CONTEXT])
def test_loss_and_adapter_gradients_match_one_device(mesh):
    assert_adapters_match_one_device(lora_run("single"), lora_run(mesh), start_state())


def test_training_moves_the_adapters_and_leaves_every_base_weight_bit_identical():
    run = lora_run(HYBRID)
    model, state = run.shardings.model, run.shardings.init_state(run.optimizer, run.cfg.train.seed)
    before = jax.device_get(state["params"])  # a copy: the steps donate `state`
    for step in range(3):
        state, metrics = run.train_step(state, run.batch("train", step))
        assert metrics["nonfinite"] == 0
    (adapters_before, base_before), (adapters_after, base_after) = model.split(before), model.split(state["params"])
    for old, new in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after)):
        np.testing.assert_array_equal(new, old)  # the embedding, norms, head and every base weight
    moved = [
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(adapters_after))
    ]
    assert all(moved), "every adapter factor trained"


def test_optimizer_state_holds_the_adapters_only():
    shardings = lora_run(HYBRID).shardings
    model, state = shardings.model, shardings.abstract_state
    adapters = jax.tree.leaves(model.trainable(state["params"]))
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]  # AdamW's mu and nu; counts are scalars
    assert sorted(x.shape for x in moments) == sorted(2 * [x.shape for x in adapters])
    paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0] if x.ndim]
    assert all("lora_a" in p or "lora_b" in p for p in paths), paths


def weight_gradient_work(compiled, shardings) -> tuple[int, int]:
    """(dots, reducing collectives) of `compiled` whose per-device result has as many elements as a frozen weight
    matrix's per-device share, of one layer or of all: the work of forming and reducing a weight's gradient."""
    model, params = shardings.model, shardings.abstract_state["params"]
    frozen, names = (model.split(t)[1] if model.freezes else t for t in (params, model.logical_names))
    sizes = set()
    for x, dims in zip(jax.tree.leaves(frozen), jax.tree.leaves(names, is_leaf=is_logical_names)):
        share, stacked = x.sharding.shard_shape(x.shape), int(is_layer_stack(dims))
        if len(dims) - stacked >= 2:  # a matrix (norm scales and biases are not)
            sizes |= {int(np.prod(share)), int(np.prod(share[stacked:]))}
    text = compiled.as_text()
    dots = [m for m in matmuls(text) if m.batch * m.m * m.n in sizes]
    reduced = [
        c
        for c in collectives(text)
        if c.kind in ("all-reduce", "reduce-scatter", "all-to-all")
        and sum(int(np.prod(d)) for _, d in c.shapes) in sizes
    ]
    return len(dots), len(reduced)


def test_compiled_step_forms_no_gradient_of_a_base_weight():
    """Whole-model training forms and reduces each weight's gradient; with adapters, the step on a hybrid mesh and
    the pipelined gradient form and reduce none (no dot, no collective of a frozen weight's size)."""
    base = make_run(HYBRID, list(SHAPES))
    dots, reduced = weight_gradient_work(base.train_step, base.shardings)
    assert dots > 0 and reduced > 0, "the detector sees whole-model training's weight gradients"
    assert weight_gradient_work(lora_run(HYBRID).train_step, lora_run(HYBRID).shardings) == (0, 0)
    assert weight_gradient_work(lora_run(PIPELINE).compiled_grad, lora_run(PIPELINE).shardings) == (0, 0)


def test_model_flops_leave_out_the_frozen_weights_gradients():
    """MFU counts the FLOPs the step does: with adapters, not the base weights' gradients, plus the adapters' own.
    What adapters take off our count (the model's `train_flops` without weight gradients, plus 6 per adapter param
    and token) equals what they take off the matmul FLOPs XLA compiled for one device's gradient, exactly."""
    full, adapted = make_run("single", list(SHAPES), devices=1), lora_run("single")

    def compiled(run) -> int:
        return sum(m.flops * m.executions for m in matmuls(run.compiled_grad.as_text()))

    assert compiled(full) - compiled(adapted) == full.flops_per_step - adapted.flops_per_step > 0


TOKENS = jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) % 256


def logits_of(model, params: dict, base: dict) -> tuple[jax.Array, jax.Array]:
    """(the adapted model's logits with `params`, the base model's with `base`) on `TOKENS`, in one program."""
    return jax.jit(lambda p, b: (model.module(p)(TOKENS), nnx.merge(model.graphdef, b)(TOKENS)))(params, base)


def test_new_adapters_leave_the_logits_exactly_as_the_base_model_has_them():
    run = lora_run("single")
    model, params = run.shardings.model, run.shardings.init_state(run.optimizer, 0)["params"]
    factors = jax.tree_util.tree_flatten_with_path(model.trainable(params))[0]
    assert all(np.any(x) != ("lora_b" in jax.tree_util.keystr(path)) for path, x in factors)  # B = 0, A drawn
    adapted, base = logits_of(model, params, model.base_params(params))
    np.testing.assert_array_equal(adapted, base)


def test_merged_weights_give_the_adapted_models_logits():
    model, params = lora_run("single").shardings.model, start_state()["params"]
    merged = model.merge(params)
    w_q = params["blocks"]["w_q"]  # (layers, d, h, k) = base + alpha / rank * A (layers, d, r) B (layers, r, h, k)
    expected = w_q["base"] + 2.0 * np.einsum("ldr,lrhk->ldhk", w_q["lora_a"], w_q["lora_b"])
    np.testing.assert_allclose(merged["blocks"]["w_q"], expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(merged["blocks"]["w_q"], w_q["base"])
    adapted, from_merged = logits_of(model, params, merged)
    np.testing.assert_allclose(from_merged, adapted, rtol=1e-5, atol=1e-5)


GPT_BATCH = {"tokens": jax.ShapeDtypeStruct((2, 25), jnp.int32)}


def gpt_tiny_parts():
    return place_model("gpt-tiny", default_config("gpt-tiny").model, "data=1", devices=jax.devices()[:1]).model


def test_dropout_draws_a_mask_per_step_while_training_only():
    model = adapt(gpt_tiny_parts(), LoraConfig(rank=4, alpha=8.0, dropout=0.5), GPT_BATCH)
    # Compiled for speed, not for fast code: random bits take XLA:CPU long to optimise.
    fast = {"xla_backend_optimization_level": 0}
    trained, frozen = model.split(jax.jit(lambda: model.init_params(0)).lower().compile(fast)())
    trained = jax.tree.map(lambda x: x + 0.05, trained)  # B nonzero: the adapters change the output
    batch = {"tokens": jnp.concatenate([TOKENS, TOKENS[:, :1]], axis=1)}

    def loss(step: jax.Array, training: bool) -> jax.Array:
        fn = model.training_loss_fn if training else model.loss_fn
        return fn(model.join(trained, model.for_step(frozen, step)), batch)[0]

    training, evaluation = (
        jax.jit(functools.partial(loss, training=t)).lower(jnp.int32(0)).compile(fast) for t in (True, False)
    )
    steps = [jnp.int32(s) for s in (0, 0, 1)]
    assert training(steps[0]) == training(steps[1]) != training(steps[2])  # a mask per step, the same when repeated
    assert evaluation(steps[0]) == evaluation(steps[2]) != training(steps[0])  # evaluation drops nothing


def error_of(call) -> str:
    """The message of the `UserInputError` `call` raises, checked to be one line."""
    with pytest.raises((ConfigError, AdapterError)) as raised:
        call()
    assert "\n" not in str(raised.value)
    return str(raised.value)


@pytest.mark.parametrize(
    "call, expected",
    [
        (
            lambda: apply_overrides(default_config("gpt-tiny"), ["lora.alpha=32"]),
            r"lora.alpha=32.0 set with lora.rank=0",
        ),
        (
            lambda: apply_overrides(default_config("gpt-tiny"), ["lora.rank=4", "lora.quantize=int3"]),
            r"lora.quantize='int3' is not one of none, int8, int4, nf4",
        ),
        (
            lambda: apply_overrides(default_config("gpt-tiny"), ["lora.quantize=int8"]),
            r"lora.quantize='int8' set with lora.rank=0",
        ),
        # 4-bit codes pair up along the down weight's contracted dim, d_ff.
        (
            lambda: make_run("single", ["d_ff=255", "lora.rank=4", "lora.quantize=nf4"], devices=1),
            r"lora.quantize=nf4: weight 'blocks/w_down' has a contracted dim of odd size 255",
        ),
        (lambda: adapt(gpt_tiny_parts(), LoraConfig(), GPT_BATCH), r"lora.rank=0: expected an integer >= 1"),
        (
            lambda: adapt(gpt_tiny_parts(), LoraConfig(rank=4, targets="w_q,w_x"), GPT_BATCH),
            r"'w_x' names no weight matrix.*groups attention, mlp.*w_q \(blocks/w_q\)",
        ),
        # The embedding is a gather, not a projection: its adapter would be left out of the model.
        (
            lambda: adapt(gpt_tiny_parts(), LoraConfig(rank=4, targets="w_q,embedding"), GPT_BATCH),
            r"weight 'embedding' is read without jaxtrain.ops.projection.project",
        ),
        # The MLP classifier multiplies its weights itself (x @ kernel): adapters cannot go on it.
        (
            lambda: make_run("single", ["lora.rank=4", "lora.targets=kernel"], model="mlp-tiny", devices=1),
            r"weight 'layers/0/kernel' is read without jaxtrain.ops.projection.project",
        ),
        (
            lambda: make_run("replica=2,data=4", ["lora.rank=4", "updates.policy=local_sgd"]),
            r"lora.rank=4 with updates.policy=local_sgd",
        ),
    ],
)
def test_bad_input_is_a_one_line_error_naming_it(call, expected):
    assert re.search(expected, error_of(call))
