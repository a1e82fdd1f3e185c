"""Attention implementations (jaxtrain.ops.attention): each equals `reference` in value and gradient, with packed
documents and a sliding window, grouped-query heads, on one device and under tensor and data parallelism; documents
do not see each other; `chunked` memory grows linearly in T; the TPU and GPU kernels compile for their hardware;
bad choices are refused by name."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_target, assert_gradients_close
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.ops.attention import (
    CPU_CHUNKED_FROM_SEQ,
    IMPLEMENTATIONS,
    AttentionError,
    attention,
    causal_mask,
    chunked_attention,
    masked_attention,
    resolve_implementation,
)
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import build_mesh, parse_inline
from jaxtrain.sharding.rules import ShardingRules

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 160, 4, 2, 16
WINDOW = 37
# The CPU implementations, and splash in the Pallas interpreter; "chunked-32" runs five blocks of 32 tokens (the
# default block covers the whole test sequence), so block skipping, the online softmax and padding all take part.
IMPLS = {
    "xla": functools.partial(attention, implementation="xla"),
    "chunked": functools.partial(attention, implementation="chunked"),
    "chunked-32": functools.partial(chunked_attention, block_size=32),
    "chunked-48": functools.partial(chunked_attention, block_size=48),  # 160 = 3 x 48 + 16: a padded last block
    "splash": functools.partial(attention, implementation="splash", interpret=True),
}
MASKS = {"causal": (False, None), "segments": (True, None), "window": (False, WINDOW), "both": (True, WINDOW)}
# Rules with the kv heads on `tensor` like the query heads, or replicated (then the kernels repeat k/v per device).
KV_ON_TENSOR = ShardingRules.default().with_overrides({"kv_heads": "tensor"})
KV_REPLICATED = ShardingRules.default().with_overrides({"kv_heads": ""})


def inputs(seed: int = 0, seq: int = SEQ) -> tuple[jax.Array, ...]:
    """q, k, v, and the cotangent the gradient test pulls back."""
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, seq, HEADS, HEAD_DIM), (BATCH, seq, KV_HEADS, HEAD_DIM), (BATCH, seq, KV_HEADS, HEAD_DIM)]
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    return q, k, v, jnp.asarray(rng.normal(size=shapes[0]), jnp.float32)


def documents(seq: int = SEQ) -> jax.Array:
    """Two rows of packed documents: three of uneven length, and two (the first id 0, padding's)."""
    return jnp.asarray(np.stack([np.repeat([1, 2, 3], [50, 71, seq - 121]), np.repeat([0, 5], [90, seq - 90])]))


def value_and_grads(fn, mask: str, q, k, v, cotangent):
    """The output and the gradients of <output, cotangent> w.r.t. q, k, v, as numpy arrays."""
    use_segments, window = MASKS[mask]
    segments = documents() if use_segments else None

    def loss(q, k, v):
        out = fn(q, k, v, segment_ids=segments, sliding_window=window)
        return jnp.vdot(out, cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


def vjp_loss(fn, cotangent):
    """<fn(q, k, v), cotangent>: its gradient is the vector-Jacobian product of `fn`."""
    return lambda q, k, v: jnp.vdot(fn(q, k, v), cotangent)


@functools.cache
def reference_results(mask: str) -> list[np.ndarray]:
    return value_and_grads(functools.partial(attention, implementation="reference"), mask, *inputs())


def slow_unless(case: tuple, default: set[tuple]) -> object:
    """A parameter that runs in the default suite when in `default`, else in the slow set (compiles cost seconds)."""
    return pytest.param(*case, marks=() if case in default else pytest.mark.slow)


# Default: every implementation with documents and window at once, and the plain causal mask in blocks.
EQUALS_REFERENCE = [
    slow_unless((impl, mask), {*((i, "both") for i in IMPLS), ("chunked-32", "causal")})
    for impl in IMPLS
    for mask in MASKS
]


def textbook_attention(q, k, v, segment_ids=None, sliding_window=None):
    """Attention as written down: every query head with its own copy of its group's keys and values, one softmax
    over (B, H, T, T) scores, autodiff's gradient. `reference` must equal it."""
    repeats = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    mask = causal_mask(q.shape[1], segment_ids, sliding_window)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
    return jnp.einsum("bhts,bshk->bthk", probs.astype(v.dtype), v).astype(q.dtype)


@pytest.mark.parametrize("mask", ["causal", "both"])
def test_reference_is_the_textbook_formula(mask):
    """Value and gradient in float32 (1e-5), and in bfloat16 within bfloat16's rounding: `reference` runs the
    scores' backward products in the inputs' dtype and folds each group's query heads into rows."""
    reference = functools.partial(attention, implementation="reference")
    assert_gradients_close(reference_results(mask), value_and_grads(textbook_attention, mask, *inputs()), rtol=1e-5)
    low = [x.astype(jnp.bfloat16) for x in inputs()]
    got, want = value_and_grads(reference, mask, *low), value_and_grads(textbook_attention, mask, *low)
    for a, b in zip(got, want, strict=True):
        a, b = a.astype(np.float32), b.astype(np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


@pytest.mark.parametrize("impl, mask", EQUALS_REFERENCE)
def test_equals_reference(impl, mask):
    assert_gradients_close(value_and_grads(IMPLS[impl], mask, *inputs()), reference_results(mask), rtol=1e-5)


def test_plain_kernels_compute_a_fused_implementation_as_the_reference_recomputed():
    """`kernels="plain"` (what the planner reads, jaxtrain.ops.plain): the chunked kernel's numbers without its
    loop or custom gradient, the scores computed again in the backward pass (a remat region), as the kernel does."""
    plain = functools.partial(attention, implementation="chunked", kernels="plain")
    assert_gradients_close(value_and_grads(plain, "both", *inputs()), reference_results("both"), rtol=1e-5)
    q, k, v, _ = inputs()
    primitives = {e.primitive.name for e in jax.make_jaxpr(plain)(q, k, v).jaxpr.eqns}
    fused = {e.primitive.name for e in jax.make_jaxpr(IMPLS["chunked"])(q, k, v).jaxpr.eqns}
    assert "checkpoint" in primitives or "remat2" in primitives, primitives
    assert "custom_vjp_call" in fused and not {"custom_vjp_call", "scan", "while"} & primitives, (fused, primitives)


def sharded_value_and_grads(impl: str, mesh_spec: str, rules: ShardingRules, devices: int) -> list[np.ndarray]:
    """value_and_grads with segments and window on a mesh: q, k, v laid out as a model's attention has them."""
    mesh = build_mesh(parse_inline(mesh_spec), jax.devices()[:devices])

    def fn(q, k, v, **kwargs):
        with activation_sharding(mesh, rules):
            return IMPLS[impl](q, k, v, **kwargs)

    q, k, v, cotangent = inputs()
    kv_spec = PartitionSpec("data", None, "tensor" if rules is KV_ON_TENSOR else None)
    q_spec = PartitionSpec("data", None, "tensor")
    q, cotangent = (jax.device_put(x, NamedSharding(mesh, q_spec)) for x in (q, cotangent))
    k, v = (jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v))
    return value_and_grads(fn, "both", q, k, v, cotangent)


MESHES = {"data2-tensor2": ("data=2,tensor=2", KV_ON_TENSOR, 4), "data2-tensor4": ("data=2,tensor=4", KV_REPLICATED, 8)}


@pytest.mark.parametrize(
    "impl, mesh",
    [
        slow_unless((impl, mesh), {("splash", "data2-tensor2"), ("chunked-32", "data2-tensor4")})
        for impl in ("xla", "chunked-32", "splash")
        for mesh in MESHES
    ],
)
def test_equals_reference_under_tensor_and_data_parallelism(impl, mesh):
    """data2-tensor4 splits 4 query heads over tensor=4 but cannot split 2 kv heads: they stay replicated."""
    got = sharded_value_and_grads(impl, *MESHES[mesh])
    assert_gradients_close(got, reference_results("both"), rtol=1e-5)


@pytest.mark.parametrize(
    "impl, check_vma", [("splash", False), pytest.param("chunked-32", True, marks=pytest.mark.slow)]
)
def test_equals_reference_inside_a_pipeline_stage(impl, check_vma):
    """Inside a shard_map manual over `pipeline` (as the pipeline schedules run layers), the kernels' own
    shard_map covers the other axes; chunked's loop carries also type-check (check_vma=True)."""
    mesh = build_mesh(parse_inline("pipeline=2,data=2,tensor=2"))
    segments = documents()

    def stage(q, k, v):  # one stage's slice: leading dim 1
        with activation_sharding(mesh, KV_ON_TENSOR):
            return IMPLS[impl](q[0], k[0], v[0], segment_ids=segments, sliding_window=WINDOW)[None]

    @jax.vmap
    def reference(q, k, v):
        return attention(q, k, v, implementation="reference", segment_ids=segments, sliding_window=WINDOW)

    staged = jax.shard_map(
        stage, mesh=mesh, in_specs=PartitionSpec("pipeline"), out_specs=PartitionSpec("pipeline"),
        axis_names={"pipeline"}, check_vma=check_vma,
    )  # fmt: skip
    q, k, v, cotangent = (jnp.stack(pair) for pair in zip(inputs(), inputs(seed=1)))
    grads = [jax.jit(jax.grad(vjp_loss(fn, cotangent), argnums=(0, 1, 2)))(q, k, v) for fn in (staged, reference)]
    got, want = ([np.asarray(g) for g in pair] for pair in grads)
    assert_gradients_close(got, want, rtol=1e-5)


@pytest.mark.parametrize(
    "impl",
    [slow_unless((impl,), {("reference",), ("chunked-32",)}) for impl in ("reference", "xla", "chunked-32", "splash")],
)
def test_a_document_does_not_see_the_others_in_its_row(impl):
    """Replacing row 0's first document (tokens 0-49) changes its outputs and no other document's."""
    q, k, v, _ = inputs()
    new_q, new_k, new_v, _ = inputs(seed=1)
    first = slice(0, 50)
    swapped = [x.at[0, first].set(y[0, first]) for x, y in ((q, new_q), (k, new_k), (v, new_v))]
    run = jax.jit(lambda q, k, v: IMPLS.get(impl, functools.partial(attention, implementation=impl))(
        q, k, v, segment_ids=documents()
    ))  # fmt: skip
    before, after = np.asarray(run(q, k, v)), np.asarray(run(*swapped))
    np.testing.assert_allclose(after[0, 50:], before[0, 50:], atol=1e-6)
    np.testing.assert_array_equal(after[1], before[1])
    assert np.abs(after[0, first] - before[0, first]).min() > 0


def test_masked_attention_serves_a_kv_cache():
    """Three new tokens at positions 7-9 against a 12-slot cache (slots 10-11 unwritten) equal rows 7-9 of the full
    causal attention."""
    q, k, v, _ = inputs(seq=12)
    full = jax.jit(functools.partial(attention, implementation="reference"))(q[:, :10], k[:, :10], v[:, :10])
    slots, positions = jnp.arange(12), jnp.arange(7, 10)
    mask = jnp.broadcast_to(slots[None, :] <= positions[:, None], (BATCH, 3, 12))
    np.testing.assert_allclose(jax.jit(masked_attention)(q[:, 7:10], k, v, mask), full[:, 7:10], atol=1e-6)
    with pytest.raises(AttentionError, match=r"mask \(2, 3, 11\) must be \(batch or 1, queries, keys\)"):
        masked_attention(q[:, 7:10], k, v, mask[:, :, :11])


def grad_temp_bytes(impl: str, seq: int) -> int:
    """Temporary bytes of the compiled gradient of attention at `seq` (batch 1, 2 heads, 1 kv head, head dim 16)."""
    shapes = [jax.ShapeDtypeStruct((1, seq, heads, 16), jnp.float32) for heads in (2, 1, 1)]
    grad = jax.grad(lambda q, k, v: attention(q, k, v, implementation=impl).sum(), argnums=(0, 1, 2))
    return jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly_in_seq():
    """Measured: 11,981,672 -> 13,374,312 temporary bytes (x1.12) from T=4096 to 8192."""
    ratio = grad_temp_bytes("chunked", 8192) / grad_temp_bytes("chunked", 4096)
    print(f"chunked temporary bytes 8192/4096: {ratio:.2f}")
    assert ratio <= 2.3


@pytest.mark.slow
def test_reference_memory_grows_quadratically_in_seq():
    """What chunked avoids: measured 403,210,240 -> 1,611,726,848 temporary bytes (x4.00) from T=4096 to 8192."""
    ratio = grad_temp_bytes("reference", 8192) / grad_temp_bytes("reference", 4096)
    print(f"reference temporary bytes 8192/4096: {ratio:.2f}")
    assert ratio >= 3.5


def compile_on(target_name: str, impl: str, mesh_spec: str, segments: bool) -> str:
    """The compiled HLO of attention's gradient for `target_name`'s devices, bf16, q/k/v sharded as a model's."""
    target = aot_target(target_name)
    mesh = build_mesh(parse_inline(mesh_spec), target.devices)
    spec = NamedSharding(mesh, PartitionSpec("data", None, "tensor"))
    shapes = [jax.ShapeDtypeStruct((4, 1000, h, 128), jnp.bfloat16, sharding=spec) for h in (4, 2, 2)]
    ids = jax.ShapeDtypeStruct((4, 1000), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("data")))

    def loss(q, k, v, segment_ids):
        with activation_sharding(mesh, KV_ON_TENSOR):
            out = attention(q, k, v, implementation=impl, segment_ids=segment_ids if segments else None)
        return out.astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes, ids).compile().as_text()


def test_splash_compiles_for_tpu():
    hlo = compile_on("v5p:2x2x2", "splash", "data=4,tensor=2", segments=True)
    assert 'custom_call_target="tpu_custom_call"' in hlo
    assert "splash_mha_fwd_segmented" in hlo


def cudnn_found() -> bool:
    from jax._src.cudnn import fused_attention_stablehlo

    try:
        fused_attention_stablehlo.check_cudnn_version()
        return True
    except RuntimeError:
        return False


def test_cudnn_compiles_for_gpu_or_says_what_it_needs():
    """With nvidia-cudnn-cu12 installed (the gpu-aot extra brings it) the fused kernel is in the HLO; without it the
    error names the package. CI installs the extra, so there cuDNN must be found."""
    aot_target("h100:8")  # first: the CUDA plugin, once initialised, finds cuDNN on the Python path
    if not cudnn_found():
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("cuDNN not found, though CI installs the gpu-aot extra that brings nvidia-cudnn-cu12")
        with pytest.raises(AttentionError, match="nvidia-cudnn-cu12"):
            compile_on("h100:8", "cudnn", "data=4,tensor=2", segments=False)
        return
    hlo = compile_on("h100:8", "cudnn", "data=4,tensor=2", segments=False)
    assert 'custom_call_target="__cudnn$fmhaSoftmax"' in hlo
    assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in hlo


def test_cudnn_segment_offsets_follow_jax_packed_layout():
    """The one piece of the cuDNN packed path that runs without a GPU: runs of ids -> (offsets, lengths) as JAX's
    fused-attention test packs them ([0, 170, 340, -1] and [170, 170, 172] there)."""
    from jaxtrain.ops.attention import _segment_offsets

    offsets, lengths = _segment_offsets(jnp.asarray([[0, 0, 1, 1, 1, 2], [7, 7, 7, 7, 7, 7]]))
    np.testing.assert_array_equal(offsets, [[0, 2, 5, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[2, 3, 1, -1, -1, -1], [6, -1, -1, -1, -1, -1]])


def test_auto_picks_per_platform_and_length():
    assert resolve_implementation("auto", "tpu", 128) == "splash"
    assert resolve_implementation("auto", "gpu", 128, dtype=jnp.float32) == "xla"  # cuDNN takes bf16/fp16 only
    # Packed documents need a Hopper GPU, which JAX cannot see from this CPU-only process.
    assert resolve_implementation("auto", "gpu", 128, dtype=jnp.bfloat16, packed=True) == "xla"
    assert resolve_implementation("auto", "cpu", CPU_CHUNKED_FROM_SEQ - 1) == "reference"
    assert resolve_implementation("auto", "cpu", CPU_CHUNKED_FROM_SEQ) == "chunked"
    for name in IMPLEMENTATIONS[1:]:
        assert resolve_implementation(name, "cpu", 128) == name


@pytest.mark.parametrize(
    "kwargs, kv_heads, message",
    [
        ({"implementation": "flash"}, 2, r"'flash' is unknown; choose one of auto, reference, xla, cudnn, splash"),
        ({"implementation": "cudnn"}, 2, r"'cudnn' needs a GPU, but this program runs on cpu"),
        ({"implementation": "splash"}, 2, r"'splash' needs a TPU, but this program runs on cpu"),
        ({"implementation": "reference"}, 3, r"3 kv heads do not divide 4 query heads"),
        ({"sliding_window": 0}, 2, r"sliding_window 0 must be a positive int"),
        ({"segment_ids": jnp.zeros((2, 5), jnp.int32)}, 2, r"segment_ids \(2, 5\) must be \(batch, seq\)"),
        ({"kernels": "fast"}, 2, r"kernels='fast': use one of fused, plain"),
    ],
    ids=["unknown", "cudnn-on-cpu", "splash-on-cpu", "gqa", "window", "segments", "kernels"],
)
def test_bad_choices_are_refused_by_name(kwargs, kv_heads, message):
    q = jnp.zeros((2, 8, 4, 16))
    kv = jnp.zeros((2, 8, kv_heads, 16))
    with pytest.raises(AttentionError, match=message):
        attention(q, kv, kv, **kwargs)


def test_causal_mask_is_the_documented_one():
    """Query t sees keys t - W < s <= t of its own document."""
    mask = np.asarray(causal_mask(6, jnp.asarray([[1, 1, 1, 2, 2, 2]]), sliding_window=2))[0]
    expected = np.array([[t - 2 < s <= t and (s < 3) == (t < 3) for s in range(6)] for t in range(6)])
    np.testing.assert_array_equal(mask, expected)
