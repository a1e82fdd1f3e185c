"""Bidirectional attention (`causal=False`, an encoder's): every implementation that runs here, and context
parallelism's ring and allgather on 2 and 4 devices, equal attention as written down in value and gradient, over
whole rows and over packed documents with padding; the GPU and TPU kernels compile without a causal mask; a sliding
window without causality is refused in one line."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import aot_target, assert_gradients_close
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.ops.attention import AttentionError, attention, chunked_attention
from jaxtrain.ops.sequence import zigzag_order
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import build_mesh, parse_inline
from jaxtrain.sharding.rules import ShardingRules

# Grouped-query heads (G < H) throughout; 160 positions: five blocks of 32, or three of 48 and a padded fourth, and
# for splash a sequence the kernel pads to 256 (the padding must stay invisible without causality to hide it).
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 160, 4, 2, 16
IMPLS = {
    "reference": functools.partial(attention, implementation="reference"),
    "xla": functools.partial(attention, implementation="xla"),
    "chunked": functools.partial(attention, implementation="chunked"),  # one block: the whole sequence
    "chunked-32": functools.partial(chunked_attention, block_size=32),
    "chunked-48": functools.partial(chunked_attention, block_size=48),
    "splash": functools.partial(attention, implementation="splash", interpret=True),
}


def inputs() -> tuple[np.ndarray, ...]:
    """q, k, v, and the cotangent the gradient pulls back."""
    rng = np.random.default_rng(0)
    q_shape, kv_shape = (BATCH, SEQ, HEADS, HEAD_DIM), (BATCH, SEQ, KV_HEADS, HEAD_DIM)
    return tuple(rng.normal(size=s).astype(np.float32) for s in (q_shape, kv_shape, kv_shape, q_shape))


def documents() -> np.ndarray:
    """Row 0: two packed documents, then padding (id 0); row 1: one document, then padding."""
    return np.stack([np.repeat([1, 2, 0], [70, 60, SEQ - 130]), np.repeat([3, 0], [120, SEQ - 120])]).astype(np.int32)


SEGMENTS = {"whole": None, "packed": documents}


def textbook(q, k, v, segment_ids=None):
    """Bidirectional attention as written down: each query head with its group's keys and values, one softmax over
    (B, H, T, T) scores, masked to the query's document (padding, id 0, sees only padding)."""
    repeats = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    if segment_ids is not None:
        scores = jnp.where((segment_ids[:, :, None] == segment_ids[:, None, :])[:, None], scores, -1e30)
    return jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), v)


def value_and_grads(fn, q, k, v, cotangent, segment_ids) -> list[np.ndarray]:
    """fn's output and the gradients of <output, cotangent> w.r.t. q, k, v."""

    def loss(q, k, v):
        out = fn(q, k, v, segment_ids=segment_ids)
        return jnp.vdot(out, cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


@functools.cache
def expected(segments: str) -> list[np.ndarray]:
    ids = SEGMENTS[segments]
    return value_and_grads(textbook, *inputs(), None if ids is None else ids())


@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_equals_the_textbook_formula(impl, segments):
    ids = SEGMENTS[segments]
    fn = functools.partial(IMPLS[impl], causal=False)
    got = value_and_grads(fn, *inputs(), None if ids is None else jnp.asarray(ids()))
    assert_gradients_close(got, expected(segments), rtol=1e-5)


def test_a_query_sees_later_keys():
    """What separates the two: the first query's output moves when the last key changes, only without causality."""
    q, k, v, _ = (jnp.asarray(x) for x in inputs())
    changed = v.at[:, -1].add(1.0)
    for causal, moves in ((True, False), (False, True)):
        before, after = (attention(q, k, v_, implementation="reference", causal=causal) for v_ in (v, changed))
        assert bool(jnp.any(before[:, 0] != after[:, 0])) == moves


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
@pytest.mark.parametrize("ways", [2, 4])
def test_context_parallel_equals_the_textbook_formula(ways, algorithm):
    """The sequence split over `context`, in the zig-zag layout the model's batch is in: the layout's slots hold the
    natural positions `zigzag_order` names, so output and gradients are the textbook's in that order."""
    mesh = build_mesh(parse_inline(f"context={ways}"), jax.devices()[:ways])
    order = zigzag_order(SEQ, ways)
    split = NamedSharding(mesh, PartitionSpec(None, "context"))
    q, k, v, cotangent, ids = (jax.device_put(x[:, order], split) for x in (*inputs(), documents()))

    def fn(q, k, v, **kwargs):
        with activation_sharding(mesh, ShardingRules.default()):
            return attention(q, k, v, causal=False, context_parallel=algorithm, **kwargs)

    got = value_and_grads(fn, q, k, v, cotangent, ids)
    assert_gradients_close(got, [x[:, order] for x in expected("packed")], rtol=1e-5)


@pytest.mark.parametrize("call", [attention, chunked_attention], ids=["attention", "chunked_attention"])
def test_a_window_without_causality_is_refused_in_one_line(call):
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(AttentionError, match="sliding_window needs causal attention: got sliding_window=4") as error:
        call(q, q, q, causal=False, sliding_window=4)
    assert "\n" not in str(error.value)


def compiled_gradient(target_name: str, impl: str, mesh_spec: str, seq: int) -> str:
    """The compiled HLO of bidirectional attention's gradient on `target_name`'s devices: bf16, batch over data,
    heads over tensor."""
    target = aot_target(target_name)
    mesh = build_mesh(parse_inline(mesh_spec), target.devices)
    spec = NamedSharding(mesh, PartitionSpec("data", None, "tensor"))
    shapes = [jax.ShapeDtypeStruct((4, seq, h, 128), jnp.bfloat16, sharding=spec) for h in (4, 2, 2)]
    rules = ShardingRules.default().with_overrides({"kv_heads": "tensor"})

    def loss(q, k, v):
        with activation_sharding(mesh, rules):
            return attention(q, k, v, implementation=impl, causal=False).astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile().as_text()


def test_cudnn_compiles_without_a_causal_mask():
    """cuDNN's fused kernel, forward and backward, with no mask (causal attention's says CAUSAL). Packed documents
    need a live Hopper GPU to compile, which this machine lacks."""
    hlo = compiled_gradient("h100:8", "cudnn", "data=4,tensor=2", 1024)
    kernels = [line for line in hlo.splitlines() if "__cudnn$fmhaSoftmax" in line]
    masks = [re.findall(r'"mask_type": "(\w+)"', line) for line in kernels]
    assert len(kernels) >= 2 and all(found == ["NO_MASK"] for found in masks), masks  # forward and backward


def test_splash_compiles_for_tpu_without_a_causal_mask():
    hlo = compiled_gradient("v5p:2x2x2", "splash", "data=4,tensor=2", 1000)
    assert "splash_mha_fwd" in hlo and 'custom_call_target="tpu_custom_call"' in hlo
