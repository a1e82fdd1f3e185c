"""Low-precision matmuls (`precision.*`: jaxtrain/ops/quantized_matmul.py, jaxtrain/placement/precision.py): int8 and
FP8 training through qwix and FSDP's all-gather in 8 bits. The matmul against float math, one device against a
sharded mesh, the 8-bit operands and gathers in the programs compiled for CPU, TPU v5p and H100, LoRA on 8-bit base
matmuls, and the settings refused. (The learning curves over 500 steps: benchmarks/precision.py, docs/precision.md.)"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_run, aot_target, curve, gradients, make_run

from jaxtrain.analysis.hlo import DTYPE_BYTES, collectives
from jaxtrain.errors import UserInputError
from jaxtrain.ops.quantized_matmul import Recipe

HYBRID = "data=2,fsdp=2,tensor=2"
LLAMA = ("dtype=float32", "seq_len=16")
SPEC = "btd,dhk->bthk"

# The error of a quantized matmul relative to the float one's norm, at most, in the value and in each gradient.
# Round to nearest leaves each operand within half a step (absmax / 127 for int8; FP8 e4m3 keeps 3 mantissa bits,
# e5m2 2). Measured on the test's 64-wide random operands: int8 0.88% (value), 0.82-0.92% (gradients) per channel,
# 1.16-1.23% per tensor; fp8 3.7-3.9% (value), 5.2-5.7% (gradients). The bounds leave 60% headroom. With
# backward=high the gradients are the float ones (the straight-through estimator), to float32 rounding.
OP_RTOL = {"int8": 0.02, "fp8": 0.09}
# One device against data=2,fsdp=2,tensor=2 in float32: the float parts of the step sum in another order (1e-7), and
# a value that lands on a rounding boundary then takes the neighbouring 8-bit code on one of them. Measured on
# llama-tiny: losses within 5e-5 over 3 steps, gradients within 0.8% (int8) and 0.5% (fp8) of each leaf's norm;
# in float (precision off) the same pair agrees within 4e-7.
MESH_LOSS_RTOL, MESH_GRAD_RTOL = 2e-4, 0.02


def relative(a, b) -> float:
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


@pytest.mark.parametrize("matmuls", ["int8", "fp8"])
@pytest.mark.parametrize("scales", ["channel", "tensor"])
@pytest.mark.parametrize("backward", ["quantized", "high"])
def test_the_quantized_matmul_and_its_gradients_stay_near_float_math(matmuls, scales, backward):
    x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 4, 16), jnp.float32) / 8
    probe = jax.random.normal(jax.random.key(2), (2, 8, 4, 16), jnp.float32)  # a cotangent that is not all ones
    got, got_grads = value_and_grads(Recipe(matmuls, scales, backward), x, w, probe)
    want, want_grads = value_and_grads(None, x, w, probe)
    assert relative(got, want) < OP_RTOL[matmuls]
    for g, r in zip(got_grads, want_grads):
        assert relative(g, r) < OP_RTOL[matmuls]
        assert g.dtype == r.dtype
    if backward == "high":
        for g, r in zip(got_grads, want_grads):
            assert relative(g, r) < 1e-6


@functools.partial(jax.jit, static_argnums=0)
def value_and_grads(recipe: Recipe | None, x, w, probe):
    """The matmul (float einsum where `recipe` is None), and the gradients of its inner product with `probe`."""

    def matmul(x, w):
        return jnp.einsum(SPEC, x, w) if recipe is None else recipe.einsum(SPEC, x, w, ())

    return matmul(x, w), jax.grad(lambda x, w: (matmul(x, w) * probe).sum(), (0, 1))(x, w)


@functools.cache
def llama(mesh: str, overrides: tuple[str, ...] = ()):
    return make_run(mesh, [*LLAMA, *overrides], model="llama-tiny", devices=1 if mesh == "single" else 8)


@pytest.mark.parametrize("matmuls", ["int8", "fp8"])
def test_one_device_equals_a_sharded_mesh(matmuls):
    """The loss and every gradient leaf of the first batch (the compiled gradient program: the step adds AdamW, the
    same on both)."""
    precision = (f"precision.matmuls={matmuls}",)
    (loss, got), (want_loss, want) = gradients(llama(HYBRID, precision)), gradients(llama("single", precision))
    np.testing.assert_allclose(loss, want_loss, rtol=MESH_LOSS_RTOL)
    for g, r in zip(got, want):
        assert np.linalg.norm(g - r) <= MESH_GRAD_RTOL * np.linalg.norm(r)


def gather_bytes(run, dtypes: tuple[str, ...], program: str = "train_step") -> int:
    """All-gather bytes per device of `run`'s compiled `program`, of its arrays of `dtypes` (the compilers combine
    gathers of several types into one)."""
    return sum(
        DTYPE_BYTES[dtype] * math.prod(dims) * c.executions
        for c in collectives(getattr(run, program).as_text())
        if c.kind == "all-gather"
        for dtype, dims in c.shapes
        if dtype in dtypes
    )


def test_fsdp_gathers_int8_codes_and_trains_as_the_plain_gather_does():
    """gpt-tiny in bfloat16 on fsdp=8 (CPU), the gradient program: with precision.gather=8bit the layers' weights
    cross in int8; the loss is the plain run's within the weights' quantization error, and so are the gradients."""
    plain = make_run("fsdp=8", ["dtype=bfloat16", "seq_len=16"])
    eight = make_run("fsdp=8", ["dtype=bfloat16", "seq_len=16", "precision.gather=8bit"])
    # The embedding and output head are not targets: they cross in bfloat16 in both runs (with the scales, float32).
    wide = ("bf16", "f32")
    layers_plain = gather_bytes(plain, wide, "compiled_grad") - gather_bytes(eight, wide, "compiled_grad")
    codes = gather_bytes(eight, ("s8",), "compiled_grad")
    assert 0 < codes <= 0.55 * layers_plain, (codes, layers_plain)
    (loss, got), (want_loss, want) = gradients(eight), gradients(plain)
    np.testing.assert_allclose(loss, want_loss, rtol=0.01)
    for g, r in zip(got, want):
        assert np.linalg.norm(g - r) <= 0.05 * np.linalg.norm(r)


def test_adapters_train_over_int8_base_matmuls():
    """LoRA with precision.matmuls=int8: the frozen bases' matmuls take int8 operands (the CPU program's dots), the
    adapters train, and the losses follow the float-base run's."""
    lora = ["lora.rank=4", "lora.alpha=8", "dtype=float32", "seq_len=16"]
    float_base = make_run("single", lora, devices=1)
    int8_base = make_run("single", [*lora, "precision.matmuls=int8"], devices=1)
    text = int8_base.train_step.as_text()
    assert re.search(r"s32\[[^\]]*\][^ ]* dot\(", text), "no int8 dot in the CPU program"
    got, want = curve(int8_base, 3), curve(float_base, 3)
    assert got["loss"][-1] < got["loss"][0]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=0.02)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["precision.targets=w_x", "precision.matmuls=int8"], r"precision.targets='w_x': 'w_x' names no weight"),
        (["precision.targets=embedding", "precision.matmuls=int8"], r"'embedding' is read without .*project"),
        (["precision.scales=tensor"], r"precision.scales='tensor' set with precision.matmuls=none"),
        (["precision.gather=8bit"], r"precision.gather=8bit with mesh=data=8: there is no FSDP all-gather"),
        (
            ["lora.rank=4", "lora.quantize=int8", "precision.matmuls=int8"],
            r"precision.matmuls=int8 with lora.quantize=int8",
        ),
    ],
)
def test_settings_it_cannot_honour_are_one_line_errors(overrides, message):
    with pytest.raises(UserInputError, match=message) as caught:
        make_run("data=8", overrides).train_step  # noqa: B018 - the refusal may come when the step is traced
    assert "\n" not in str(caught.value)


def test_fp8_on_a_chip_without_fp8_matmuls_is_refused():
    with pytest.raises(UserInputError, match=r"precision.matmuls=fp8 on TPU v5.*use precision.matmuls=int8"):
        aot_run(aot_target("v5p:2x2x2"), "fsdp=8", ("precision.matmuls=fp8",))


def test_the_tpu_program_multiplies_int8_and_gathers_int8():
    """gpt-tiny on v5p:2x2x2 under fsdp=8: the TPU compiler's matmuls (convolutions) take s8 operands, and the
    layers' weights are gathered as s8 codes."""
    run = aot_run(
        aot_target("v5p:2x2x2"), "fsdp=8", ("dtype=bfloat16", "precision.matmuls=int8", "precision.gather=8bit")
    )
    text = run.train_step.as_text()
    assert "s8" in operand_types(text, "convolution")
    assert gather_bytes(run, ("s8",)) > 0


def operand_types(hlo: str, op: str) -> set[str]:
    """The element types of the operands of every `op` (dot, convolution) in the optimized HLO `hlo`."""
    defined = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", hlo, re.M))
    return {defined.get(o, "?") for pair in re.findall(rf" {op}\((%[\w.\-]+), (%[\w.\-]+)\)", hlo) for o in pair}


# Llama 3.2 1B's widths, 1 of its 16 layers (the rest repeat it), as it trains: the GPU compile takes seconds.
LLAMA_1B = ("seq_len=2048", "dtype=bfloat16", "remat=full", "batch_size=8", "n_layers=1")


@pytest.mark.slow
def test_llama_1b_on_h100_multiplies_fp8_and_gathers_half_the_bytes():
    target = aot_target("h100:8")
    plain = aot_run(target, "fsdp=8", LLAMA_1B, model="llama-1b")
    fp8 = aot_run(target, "fsdp=8", (*LLAMA_1B, "precision.matmuls=fp8", "precision.gather=8bit"), model="llama-1b")
    text = fp8.train_step.as_text()
    types = operand_types(text, "dot")
    assert "f8e4m3fn" in types and "f8e5m2" in types, types  # e4m3 forward, e5m2 gradients
    # What crosses for the layers: the plain run's bfloat16 gathers less those that stay (embedding, head).
    untouched = gather_bytes(fp8, ("bf16", "f32"))
    layers_plain = gather_bytes(plain, ("bf16", "f32")) - untouched
    layers_fp8 = gather_bytes(fp8, ("f8e4m3fn",))
    assert 0 < layers_fp8 <= 0.55 * layers_plain, (layers_fp8, layers_plain)
