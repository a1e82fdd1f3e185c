"""`jaxtrain.ops.projection.project` (GPT/Llama's projections, MoE's experts): autodiff's gradients (float32;
bfloat16 as close to exact as autodiff's), no dot left in XLA:CPU's slow transposed-left form, recomputed float32
activations written out before the weight gradient's transpose (on CPU only), and the `save_dots` policy keeping
its outputs."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops import projection
from jaxtrain.ops.projection import project
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.setup import setup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from xla_cpu_transposed_fusion import transposed_fusions  # noqa: E402
from xla_cpu_weight_gradient import major_contracting_dots  # noqa: E402

# The model's projections: queries, output, MLP in and out; MoE's expert MLPs (a weight per expert).
SPECS = {
    "btd,dhk->bthk": ((2, 16, 32), (32, 4, 8)),
    "bthk,hkd->btd": ((2, 16, 4, 8), (4, 8, 32)),
    "btd,df->btf": ((2, 16, 32), (32, 64)),
    "btf,fd->btd": ((2, 16, 64), (64, 32)),
    "egcd,edf->egcf": ((4, 2, 8, 32), (4, 32, 64)),
    "egcf,efd->egcd": ((4, 2, 8, 64), (4, 64, 32)),
}


def operands(spec, dtype=jnp.float32):
    x_shape, w_shape = SPECS[spec]
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal(x_shape), dtype), jnp.asarray(
        rng.standard_normal(w_shape) * 0.1, jnp.float32
    )


def loss(product, spec):
    return lambda x, w: jnp.sum(jnp.sin(product(spec, x, w).astype(jnp.float32)))


def einsum(spec, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype))


@pytest.mark.parametrize("spec", SPECS)
def test_gradients_equal_autodiffs_in_float32(spec):
    x, w = operands(spec)
    ours = jax.grad(loss(project, spec), argnums=(0, 1))(x, w)
    theirs = jax.grad(loss(einsum, spec), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(project(spec, x, w), einsum(spec, x, w), rtol=1e-6)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_gradients_are_as_close_to_exact_as_autodiffs():
    spec = "btd,df->btf"
    x, w = operands(spec, jnp.bfloat16)
    exact = jax.grad(loss(einsum, spec), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    )
    ours = jax.grad(loss(project, spec), argnums=(0, 1))(x, w)
    theirs = jax.grad(loss(einsum, spec), argnums=(0, 1))(x, w)
    for a, b, e in zip(ours, theirs, exact):
        # The weight gradient keeps the compute dtype until its cast to the parameter's, as autodiff's does: a
        # float32 one made the TPU compiler reduce FSDP gradients in float32 (tests/test_hlo_tpu.py).
        assert a.dtype == b.dtype
        error = {name: float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e))) for name, g in (("ours", a), ("theirs", b))}
        assert error["ours"] < max(2 * error["theirs"], 1e-2), error


def mlp_gradient(product):
    def mlp_loss(weights, x):
        hidden = jax.nn.gelu(product("btd,df->btf", x, weights[0]))
        return jnp.sum(product("btf,fd->btd", hidden, weights[1]).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(mlp_loss))


def test_cpu_runs_no_weight_gradient_dot_in_the_slow_form():
    rng = np.random.default_rng(0)
    weights = tuple(jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in ((64, 256), (256, 64)))
    x = jnp.asarray(rng.standard_normal((4, 64, 64)), jnp.bfloat16)
    counts = {
        name: major_contracting_dots(mlp_gradient(product).lower(weights, x).compile().as_text())
        for name, product in (("einsum", einsum), ("project", project))
    }
    # Autodiff's two weight gradients are transposed-left dots; ours none. If XLA:CPU stops making the first,
    # `project`'s custom gradient may no longer be worth its code: measure with benchmarks/xla_cpu_weight_gradient.py.
    assert counts == {"einsum": 2, "project": 0}, counts


def rematted_mlp_gradient(dtype=jnp.float32):
    """A 2-block GELU MLP recomputed in the backward (`remat=full`, as the GPT's blocks): its jitted gradient, the
    gradient's inputs, and the (rows, widths) of the transposes its weight gradients read."""
    batch, seq, d_model, d_ff = 3, 32, 64, 256  # B*T differs from both widths, so a transposed write is unambiguous

    @jax.checkpoint
    def block(weights, x):
        hidden = project("btd,df->btf", x, weights[0])
        return x + project("btf,fd->btd", jax.nn.gelu(hidden), weights[1])

    def mlp_loss(weights, x):
        for _ in range(2):
            x = block(weights, x)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    rng = np.random.default_rng(0)
    weights = tuple(jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in ((d_model, d_ff), (d_ff, d_model)))
    x = jnp.asarray(rng.standard_normal((batch, seq, d_model)), dtype)
    return jax.jit(jax.grad(mlp_loss)), (weights, x), (batch * seq, (d_model, d_ff))


def test_cpu_writes_recomputed_activations_out_before_transposing_them(monkeypatch):
    gradient, args, shape = rematted_mlp_gradient()
    compiled = gradient.lower(*args).compile()
    counts = {"ours": transposed_fusions(compiled.as_text(), *shape)}
    ours = compiled(*args)
    monkeypatch.setattr(projection, "unfused_on_cpu", lambda x: x)
    gradient, args, shape = rematted_mlp_gradient()
    compiled = gradient.lower(*args).compile()
    counts["without"] = transposed_fusions(compiled.as_text(), *shape)
    # Without the barrier XLA:CPU fuses the recomputed GELU output into the transpose that w2's gradient reads, one
    # per block (`jaxtrain.ops.cotangent`); with it every transpose is a plain one.
    assert counts == {"ours": {"transpose_only": 4, "with_math": 0}, "without": {"transpose_only": 2, "with_math": 2}}
    for a, b in zip(ours, compiled(*args)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_weight_gradients_barrier_is_for_float32_on_cpu_only(monkeypatch):
    def barriers(dtype, platform="cpu"):
        gradient, args, _ = rematted_mlp_gradient(dtype)
        return gradient.trace(*args).lower(lowering_platforms=(platform,)).as_text().count("optimization_barrier")

    ours = {
        case: barriers(*case) for case in ((jnp.float32,), (jnp.bfloat16,), (jnp.float32, "tpu"), (jnp.float32, "cuda"))
    }
    monkeypatch.setattr(projection, "unfused_on_cpu", lambda x: x)
    without = {case: barriers(*case) for case in ours}
    # remat's own barriers are in both; ours add two per weight gradient (its cotangent and its activations; 2 blocks
    # x 2 projections) on CPU in float32.
    assert ours[(jnp.float32,)] == without[(jnp.float32,)] + 8
    assert all(ours[case] == without[case] for case in ours if case != (jnp.float32,)), (ours, without)


def recomputed_dots(remat: str) -> list[str]:
    """The einsums of the dots that gpt-tiny's compiled backward computes again, from their metadata."""
    cfg = apply_overrides(
        default_config("gpt-tiny"),
        [f"remat={remat}", "mesh=data=1", "batch_size=2", "seq_len=16", "data.source=synthetic"],
    )
    run = setup(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    lines = run.train_step.as_text().splitlines()
    return sorted(
        re.search(r'/([a-z,]+->[a-z]+)/dot_general"', line).group(1)
        for line in lines
        if " dot(" in line and "rematted_computation" in line
    )


def test_save_dots_keeps_the_projections():
    # save_dots computes attention's two batched dots again (scores and their mix), as its policy says, and no
    # projection: a dots policy alone would see `project`'s custom VJP, not its dot, and recompute the five
    # projections whose outputs the backward uses, as full does.
    assert recomputed_dots("none") == []
    assert recomputed_dots("save_dots") == ["bgrs,bsgk->brgk", "brgk,bsgk->bgrs"]
    projections = ["btd,df->btf", "btd,dgk->btgk", "btd,dgk->btgk", "btd,dhk->bthk", "bthk,hkd->btd"]
    assert recomputed_dots("full") == sorted(["bgrs,bsgk->brgk", "brgk,bsgk->bgrs", *projections])
