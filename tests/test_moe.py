"""The mixture-of-experts decoder: routing with capacity against a plain loop, hybrid expert-parallel meshes compute
the 1-device run, tokens reach their experts by all-to-all over the expert axis, and the auxiliary loss balances
the experts' load."""

import itertools

import jax
import numpy as np
import pytest
from helpers import assert_curves_close, cached_run, curve, make_run, reference_curve

from jaxtrain.analysis.comm_report import communication_report
from jaxtrain.parallel.pipeline import PipelineError
from jaxtrain.run_config import ConfigError, apply_overrides, default_config
from jaxtrain.training.loop import train
from jaxtrain_models.moe import grouped_experts, route

MESHES = ["data=2,expert=4", "data=2,expert=2,tensor=2"]
NO_DROPS = ["capacity_factor=4"]  # n_experts / top_k = 8 / 2: every expert can take every token of a group
DROPLESS = ["routing=dropless"]


def loop_route(logits: np.ndarray, k: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference routing, one token at a time: per group, each token in sequence order takes slots for its choices,
    best first (causal: no later token can take an earlier one's slot); a full expert drops the token. Gates: the
    top-k probabilities, renormalised when k > 1."""
    groups, size, experts = logits.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    dispatch = np.zeros((groups, size, experts, capacity))
    combine = np.zeros_like(dispatch)
    load = np.zeros(experts)
    for g in range(groups):
        order = np.argsort(-probs[g], axis=-1, kind="stable")[:, :k]  # (S, K)
        gates = np.take_along_axis(probs[g], order, axis=-1)
        gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
        used = np.zeros(experts, dtype=int)
        for s, choice in itertools.product(range(size), range(k)):
            e = order[s, choice]
            load[e] += 1
            if used[e] < capacity:
                dispatch[g, s, e, used[e]] = 1
                combine[g, s, e, used[e]] = gates[s, choice]
                used[e] += 1
    return dispatch, combine, load


@pytest.mark.parametrize("k,capacity", [(1, 3), (2, 4), (2, 10)])
def test_routing_matches_a_token_by_token_loop(k, capacity):
    logits = np.random.default_rng(k).normal(size=(3, 10, 4)).astype(np.float32)
    dispatch, combine, stats = route(logits, k, capacity)
    want_dispatch, want_combine, want_load = loop_route(logits.astype(np.float64), k, capacity)
    np.testing.assert_array_equal(dispatch, want_dispatch)
    np.testing.assert_allclose(combine, want_combine, rtol=1e-6)
    np.testing.assert_array_equal(stats["load"], want_load)
    assert stats["dropped"] == want_load.sum() - want_dispatch.sum()
    assert (stats["dropped"] > 0) == (capacity < 10)  # small capacities drop tokens, capacity = S never does


def test_grouped_experts_equal_each_token_through_its_experts():
    """Dropless experts against a per-token dense reference (float64): each token through each of its k experts'
    MLPs, weighted by its gates. Expert 3 gets no token: an empty group of the grouped matmul."""
    rng = np.random.default_rng(0)
    x, w_in, w_down = rng.normal(size=(3, 10, 8)), rng.normal(size=(5, 8, 16)) / 3, rng.normal(size=(5, 16, 8)) / 4
    choice = rng.choice([0, 1, 2, 4], size=(3, 10, 2))
    gates = rng.uniform(size=(3, 10, 2))
    got = grouped_experts(*(np.float32(a) for a in (x, gates)), choice, np.float32(w_in), np.float32(w_down))
    gelu = jax.jit(jax.nn.gelu)
    want = np.zeros_like(x)
    for g, s, k in itertools.product(range(3), range(10), range(2)):
        e = choice[g, s, k]
        want[g, s] += gates[g, s, k] * np.asarray(gelu(x[g, s] @ w_in[e])) @ w_down[e]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_dropless_logits_equal_capacity_routing_that_drops_nothing():
    """The same params, routed dropless and with room for every token (capacity_factor 4): the same logits; and
    with drops (capacity_factor 1.25) dropless keeps what capacity routing drops."""
    import dataclasses

    from flax import nnx

    from jaxtrain.registry import resolve_model

    spec, preset = resolve_model("moe-tiny")
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)

    def run(**overrides):
        with nnx.use_eager_sharding(False):
            return spec.module(dataclasses.replace(spec.presets[preset](), **overrides), nnx.Rngs(0))(tokens)

    (dropless, stats), (roomy, _), (tight, tight_stats) = run(routing="dropless"), run(capacity_factor=4.0), run()
    np.testing.assert_allclose(dropless, roomy, rtol=1e-5, atol=1e-5)
    assert float(np.sum(stats["dropped"])) == 0 and float(np.sum(tight_stats["dropped"])) > 0
    assert np.abs(np.asarray(dropless) - np.asarray(tight)).max() > 1e-3
    np.testing.assert_array_equal(stats["load"].sum(-1), 2 * 32 * 2)  # every token-choice routed, per layer


def test_auxiliary_loss_is_one_when_uniform_and_more_when_skewed():
    uniform = np.zeros((2, 8, 4), np.float32) + np.eye(4, dtype=np.float32)[np.arange(8) % 4] * 1e-3
    assert route(uniform, 1, 8)[2]["aux"] == pytest.approx(1.0, abs=1e-3)
    skewed = np.zeros((2, 8, 4), np.float32)
    skewed[..., 0] = 3.0  # every token prefers expert 0, with probability e^3 / (e^3 + 3) = 0.87
    assert route(skewed, 1, 8)[2]["aux"] == pytest.approx(4 * np.exp(3) / (np.exp(3) + 3), rel=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="top_k=3 must be between 1 and n_experts=2"):
        apply_overrides(default_config("moe"), ["n_experts=2", "top_k=3"])
    with pytest.raises(ConfigError, match="capacity_factor=0.0 must be positive"):
        apply_overrides(default_config("moe"), ["capacity_factor=0"])


def test_a_pipeline_axis_is_refused_clearly():
    # The experts' layers run in the model's own scan, which a pipeline cannot take apart.
    with pytest.raises(PipelineError, match="never runs its layers with scan_layers"):
        make_run("pipeline=2,data=4", NO_DROPS, model="moe")


def run_on(mesh: str):
    return cached_run(mesh, tuple(NO_DROPS), "moe")


@pytest.mark.parametrize("mesh", MESHES)
def test_losses_match_single_device(mesh):
    assert_curves_close(curve(run_on(mesh)), reference_curve(tuple(NO_DROPS), "moe"))


def test_dropless_on_an_expert_parallel_mesh_equals_one_device():
    assert_curves_close(
        curve(cached_run("data=2,expert=4", tuple(DROPLESS), "moe")), reference_curve(tuple(DROPLESS), "moe")
    )


@pytest.mark.parametrize("mesh", MESHES)
def test_tokens_reach_their_experts_by_all_to_all(mesh):
    """Per layer, four all-to-alls over the expert axis (dispatch and combine, forward and backward), each moving one
    device's tokens sorted by expert, (E, G / devices, C, D); over that axis nothing else but all-reduces (of the
    gradients and routing statistics): no gathers or permutes of tokens."""
    run = run_on(mesh)
    cfg, mesh_shape = run.cfg, run.shardings.mesh.shape
    rows = {(r.axes, r.kind): r for r in communication_report(run.train_step, run.shardings.mesh).rows}
    to_all = rows[(("expert",), "all-to-all")]
    assert to_all.executions == 4 * cfg.model.n_layers
    sequences = cfg.data.batch_size // (mesh_shape["data"] * mesh_shape["expert"])
    tokens = cfg.model.n_experts * sequences * cfg.model.capacity(cfg.data.seq_len) * cfg.model.d_model * 4
    n = mesh_shape["expert"]
    assert to_all.mean == pytest.approx(to_all.executions * tokens * (n - 1) / n)  # what each device sends
    assert {kind for axes, kind in rows if "expert" in axes} == {"all-to-all", "all-reduce"}, sorted(rows)


def test_losses_report_balance_and_no_drops():
    run = run_on("single")
    state = run.shardings.init_state(run.optimizer, 0)
    _, metrics = run.train_step(state, run.batch("train", 0))
    assert float(metrics["dropped"]) == 0.0
    assert 1.0 <= float(metrics["expert_load"]) < run.cfg.model.n_experts
    aux = float(metrics["aux_loss"]) * run.cfg.model.aux_loss_weight
    assert float(metrics["loss"]) == pytest.approx(float(metrics["cross_entropy"]) + aux, rel=1e-6)


@pytest.mark.slow
def test_auxiliary_loss_balances_the_experts():
    """300 steps of moe-tiny (8 experts, top 2, capacity factor 1.25) on the builtin text, with and without the
    auxiliary loss (weight 0.03), the same data. The load, most tokens routed to one expert over the mean, averaged
    over the last 100 steps and on held-out text: measured about 1.3 with it and about 3 without."""
    loads = {}
    for weight in (0.03, 0.0):
        overrides = ["steps=300", "batch_size=16", "seq_len=64", "log_every=10", "eval_every=300", "eval_batches=8"]
        cfg = apply_overrides(default_config("moe"), [*overrides, f"aux_loss_weight={weight}", "progress=false"])
        summary = train(cfg, log=lambda *_: None, devices=jax.devices()[:1])
        late = [h["expert_load"] for h in summary["history"] if h["step"] > 200]
        loads[weight] = (np.mean(late), summary["val_expert_load"])
    print("expert load (last 100 steps, held out): with", loads[0.03], "without", loads[0.0])
    assert max(loads[0.03]) < 1.5
    assert min(loads[0.0]) > 1.5


def test_the_loss_counts_weighted_targets_and_refuses_packed_documents():
    """Chat data's loss weights count in the MoE's cross-entropy as in the dense decoder's: a weighted mean of each
    target's loss (here by hand from the logits, float64); packed documents are refused, since a row's tokens share
    the experts' capacity."""
    from flax import nnx

    from jaxtrain.registry import resolve_model

    cfg = apply_overrides(default_config("moe-tiny"), [*NO_DROPS, "dtype=float32"])
    spec, _ = resolve_model("moe-tiny")
    with nnx.use_eager_sharding(False):  # no mesh: the model alone
        model = spec.module(cfg.model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (2, 17)).astype(np.int32)
    weights = (rng.random((2, 17)) < 0.5).astype(np.float32)
    _, metrics = model.loss({"tokens": tokens, "loss_weights": weights})
    logits = np.asarray(model(tokens[:, :-1])[0], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    losses = logz - np.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    expected = np.sum(weights[:, 1:] * losses) / np.sum(weights[:, 1:])
    assert float(metrics["cross_entropy"]) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ConfigError, match="data.packing=segments with an MoE model"):
        model.loss({"tokens": tokens, "segment_ids": np.ones_like(tokens)})
