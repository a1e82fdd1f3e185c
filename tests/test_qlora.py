"""QLoRA (`lora.quantize`, jaxtrain/posttrain/quantized.py): the base weights stored as int8 or 4-bit codes with a
scale per output channel, dequantized in the matmul by qwix. Logits near the float base's, what the params and the
compiled TPU step hold, the same losses and adapter gradients on a sharded mesh as on one device, training that
follows LoRA's and leaves the codes bit-identical, and merging (its bad settings: tests/test_lora.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import aot_run, aot_target, assert_adapters_match_one_device, curve, make_run, with_random_adapters

from jaxtrain.placement.place import place_model
from jaxtrain.posttrain.adapters import adapt
from jaxtrain.run_config import LoraConfig, default_config

LORA = ("lora.rank=4", "lora.alpha=8", "seq_len=24")
HYBRID = "data=2,fsdp=2,tensor=2"
GPT_BATCH = {"tokens": jax.ShapeDtypeStruct((2, 25), jnp.int32)}
TOKENS = jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) % 256

# The logits' error relative to their norm, at most. Rounding to nearest leaves each weight within half a step of
# itself, step = a channel's absmax / 127.5 (int8) or / 7.5 (int4): for a gpt-tiny channel (64 normal weights,
# absmax ~2.5 sigma) a relative RMS error of 2.5 / (127.5 sqrt 12) = 0.57% (int8), 9.6% (int4), and nf4's levels
# land near int4's. The logits' relative error tracks the weights' in a two-layer residual model: measured 0.70%
# (int8), 11.9% (int4), 10.8% (nf4) for weights off by 0.68%, 11.6%, 9.7% at worst. The bounds leave 25-40% headroom.
LOGITS_RTOL = {"int8": 0.01, "int4": 0.15, "nf4": 0.15}


@functools.cache
def gpt_tiny_parts():
    return place_model("gpt-tiny", default_config("gpt-tiny").model, "data=1", devices=jax.devices()[:1]).model


@functools.cache
def qlora_run(mesh: str, quantize: str = "int8"):
    """gpt-tiny (float32) with rank-4 adapters on attention and MLP and its base stored as `quantize`."""
    return make_run(mesh, [*LORA, f"lora.quantize={quantize}"], devices=1 if mesh == "single" else 8)


def relative_error(got: jax.Array, reference: jax.Array) -> float:
    return float(jnp.linalg.norm(got - reference) / jnp.linalg.norm(reference))


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_quantized_base_logits_are_near_the_float_bases(kind):
    parts = gpt_tiny_parts()
    model, base = adapt(parts, LoraConfig(rank=4, alpha=8.0, quantize=kind), GPT_BATCH), parts.init_params(0)
    params = model.init_params(0, base=base)  # quantizes the float weights; B = 0 adds nothing
    got, reference = jax.jit(lambda p, b: (model.module(p)(TOKENS), nnx.merge(parts.graphdef, b)(TOKENS)))(params, base)
    error = relative_error(got, reference)
    print(f"{kind}: logits off by {error:.2%} of their norm")
    assert 0 < error <= LOGITS_RTOL[kind]


def test_params_hold_codes_and_scales_split_as_their_weights_and_the_optimizer_the_adapters():
    shardings = qlora_run(HYBRID).shardings
    model, state = shardings.model, shardings.abstract_state
    w_q = state["params"]["blocks"]["w_q"]  # (layers, embed, heads, kv)
    assert (w_q["base"]["qvalue"].shape, w_q["base"]["qvalue"].dtype) == ((2, 64, 4, 16), jnp.int8)
    assert w_q["base"]["scale"].shape == (2, 1, 4, 16)  # a scale per output channel, per layer
    assert model.logical_names["blocks"]["w_q"]["base"] == {
        "qvalue": ("layers", "embed", "heads", "kv"),
        "scale": ("layers", None, "heads", "kv"),
    }
    assert tuple(w_q["base"]["qvalue"].sharding.spec) == (None, "fsdp", "tensor", None)
    assert tuple(w_q["base"]["scale"].sharding.spec) == (None, None, "tensor", None)
    # The float weights a checkpoint to fine-tune from holds, split as the codes are.
    restore_target = model.base_params(state["params"])["blocks"]["w_q"]
    assert (restore_target.shape, restore_target.dtype) == ((2, 64, 4, 16), jnp.float32)
    adapters = jax.tree.leaves(model.trainable(state["params"]))
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]  # AdamW's mu and nu; counts are scalars
    assert sorted(x.shape for x in moments) == sorted(2 * [x.shape for x in adapters])
    paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0] if x.ndim]
    assert paths and all("lora_a" in p or "lora_b" in p for p in paths), paths


def test_four_bit_codes_are_stored_two_to_a_byte():
    state = qlora_run(HYBRID, "nf4").shardings.abstract_state
    w_q, w_out = state["params"]["blocks"]["w_q"]["base"], state["params"]["blocks"]["w_out"]["base"]
    # Paired along the last contracted dim: embed for "btd,dhk->bthk", kv for "bthk,hkd->btd".
    assert (w_q["qvalue"].shape, w_q["qvalue"].dtype) == ((2, 32, 4, 16), jnp.uint8)
    assert (w_out["qvalue"].shape, w_out["qvalue"].dtype) == ((2, 4, 8, 64), jnp.uint8)
    assert tuple(w_q["qvalue"].sharding.spec)[:3] == (None, "fsdp", "tensor")


@functools.cache
def start_state() -> dict:
    """One device's initial train state with every adapter factor drawn at random (`with_random_adapters`)."""
    return with_random_adapters(qlora_run("single"))


def test_loss_and_adapter_gradients_on_a_sharded_mesh_match_one_device():
    assert_adapters_match_one_device(qlora_run("single"), qlora_run(HYBRID), start_state())


def test_training_follows_loras_curve_and_leaves_the_codes_bit_identical():
    run = qlora_run(HYBRID)
    model, state = run.shardings.model, run.shardings.init_state(run.optimizer, run.cfg.train.seed)
    before = jax.device_get(state["params"])  # a copy: the steps donate `state`
    losses = []
    for step in range(5):
        state, metrics = run.train_step(state, run.batch("train", step))
        losses.append(float(metrics["loss"]))
    lora = curve(make_run("single", list(LORA), devices=1))["loss"]
    print("QLoRA int8", np.round(losses, 4), "LoRA", np.round(lora, 4))
    assert losses[-1] < losses[0] - 0.1, "the loss falls"
    # The same model and data, the base off by int8 rounding (0.7% of the logits): the curves stay within 0.5%.
    np.testing.assert_allclose(losses, lora, rtol=5e-3)
    frozen_before, frozen_after = model.split(before)[1], model.split(state["params"])[1]
    for old, new in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
        np.testing.assert_array_equal(new, old)  # codes, scales, embedding, norms, head


def test_merge_dequantizes_and_folds_the_adapters_in():
    model, params = qlora_run("single").shardings.model, start_state()["params"]
    merged = model.merge(params)
    w_q = params["blocks"]["w_q"]
    base = np.asarray(w_q["base"]["qvalue"], np.float32) * w_q["base"]["scale"]  # int8 codes times their scales
    expected = base + 2.0 * np.einsum("ldr,lrhk->ldhk", w_q["lora_a"], w_q["lora_b"])
    assert merged["blocks"]["w_q"].dtype == jnp.float32
    np.testing.assert_allclose(merged["blocks"]["w_q"], expected, rtol=1e-6, atol=1e-7)
    adapted, from_merged = jax.jit(lambda p, m: (model.module(p)(TOKENS), nnx.merge(model.graphdef, m)(TOKENS)))(
        params, merged
    )
    np.testing.assert_allclose(from_merged, adapted, rtol=1e-5, atol=1e-5)


# Shapes whose per-device arrays fill TPU tiles (no padding), so bytes are the arrays' own.
TPU_MODEL = ("n_layers=2", "d_model=512", "n_heads=4", "d_ff=2048", "seq_len=128", "batch_size=8")


def tpu_argument_bytes(quantize: str) -> tuple[int, int]:
    """(the compiled train step's argument bytes per device, the float32 base weights' bytes per device) of
    `TPU_MODEL` with rank-8 adapters on v5p:2x2x2, fsdp=8, the base stored as `quantize`."""
    run = aot_run(aot_target("v5p:2x2x2"), "fsdp=8", (*TPU_MODEL, "lora.rank=8", f"lora.quantize={quantize}"))
    model = run.shardings.model
    bases = model.base_params(run.shardings.abstract_state["params"])
    weights = [bases[path[0]][path[1]] for path in model.targets]
    float_bytes = sum(int(np.prod(w.sharding.shard_shape(w.shape))) * 4 for w in weights)
    return run.train_step.memory_analysis().argument_size_in_bytes, float_bytes


def test_int8_base_takes_a_quarter_of_float32s_device_memory_on_tpu():
    """The arguments of the step with an int8 base against a float32 one: everything else is the same, so the
    difference is the base's, whose float32 bytes per device the shapes give. (Params are float32 in jaxtrain: a
    bfloat16 base would take half of float32's, so int8 is half of bfloat16 where it is a quarter of float32.)"""
    float_args, float_base = tpu_argument_bytes("none")
    int8_args, _ = tpu_argument_bytes("int8")
    int8_base = float_base - (float_args - int8_args)
    ratio = int8_base / float_base
    print(f"v5p fsdp=8 base bytes/device: float32 {float_base:,}, int8 {int8_base:,}, ratio {ratio:.3f}")
    assert 0.25 <= ratio <= 0.27  # 1 byte of 4, plus the float32 scales (one per output channel)
