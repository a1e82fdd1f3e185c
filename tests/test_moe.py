"""The mixture-of-experts decoder: routing with capacity against a plain loop, dropless experts against each token
through its experts, in one program and split over devices, hybrid expert-parallel meshes compute the 1-device run,
tokens reach their experts by all-to-all over the expert axis, and the auxiliary loss balances the experts' load."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_curves_close,
    assert_gradients_close,
    cached_run,
    curve,
    gradients,
    make_run,
    reference_curve,
)

from jaxtrain.analysis.comm_report import communication_report
from jaxtrain.ops import expert_dispatch
from jaxtrain.ops.expert_dispatch import ExpertParallelError, dropless_experts, grouped_experts
from jaxtrain.parallel.pipeline import PipelineError
from jaxtrain.run_config import ConfigError, apply_overrides, default_config
from jaxtrain.sharding.constraints import activation_sharding
from jaxtrain.sharding.mesh import build_mesh, parse_inline
from jaxtrain.sharding.rules import ShardingRules
from jaxtrain.training.loop import train
from jaxtrain_models.moe import route

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


def each_token_through_its_experts(x, gates, choice, w_in, w_down) -> np.ndarray:
    """The dropless experts' reference, in float64: each token x[g, s] through each of its k experts' MLPs
    (choice[g, s, k]), weighted by its gates."""
    gelu = jax.jit(jax.nn.gelu)
    out = np.zeros(x.shape)
    for g, s, k in itertools.product(*map(range, choice.shape)):
        e = choice[g, s, k]
        out[g, s] += gates[g, s, k] * np.asarray(gelu(x[g, s] @ w_in[e]), np.float64) @ w_down[e]
    return out


def expert_inputs(groups: int, experts: int, choose_from=None, seed: int = 0) -> tuple[np.ndarray, ...]:
    """x (G, 6, 8), gates and choice (G, 6, 2) and expert weights w_in (E, 8, 16), w_down (E, 16, 8), float64;
    each token's two experts differ, drawn from `choose_from` (default: all)."""
    rng = np.random.default_rng(seed)
    x, gates = rng.normal(size=(groups, 6, 8)), rng.uniform(size=(groups, 6, 2))
    w_in, w_down = rng.normal(size=(experts, 8, 16)) / 3, rng.normal(size=(experts, 16, 8)) / 4
    pool = np.arange(experts) if choose_from is None else np.asarray(choose_from)
    choice = np.stack([rng.permutation(pool)[:2] for _ in range(groups * 6)]).reshape(groups, 6, 2)
    return x, gates, choice.astype(np.int32), w_in, w_down


def test_grouped_experts_equal_each_token_through_its_experts():
    """Dropless experts in one program against the per-token reference. Expert 3 gets no token: an empty group of
    the grouped matmul."""
    x, gates, choice, w_in, w_down = expert_inputs(3, 5, choose_from=[0, 1, 2, 4])
    got = grouped_experts(np.float32(x), np.float32(gates), choice, np.float32(w_in), np.float32(w_down))
    want = each_token_through_its_experts(x, gates, choice, w_in, w_down)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


EXPERT_MESHES = ["data=2,expert=4", "expert=8", "data=2,fsdp=2,expert=2", "data=2,expert=2,tensor=2"]


def split_experts_value_and_grads(mesh_spec: str, x, gates, choice, w_in, w_down, exchange: str = "auto"):
    """The dropless experts' output and the gradients of sum(y cos y) for x, gates, w_in and w_down (float32), with
    the active rules splitting them over `mesh_spec` (None: one program, no mesh)."""
    mesh = None if mesh_spec is None else build_mesh(parse_inline(mesh_spec), jax.devices())

    def loss(x, gates, w_in, w_down):
        if mesh is None:
            y = grouped_experts(x, gates, choice, w_in, w_down)
        else:
            with activation_sharding(mesh, ShardingRules.default()):
                y = dropless_experts(x, gates, choice, w_in, w_down, exchange=exchange)
        return jnp.sum(y * jnp.cos(y)), y

    args = [np.float32(a) for a in (x, gates, w_in, w_down)]
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    return np.asarray(y), [np.asarray(g) for g in grads]


def skewed_expert_inputs(groups: int = 8) -> tuple[np.ndarray, ...]:
    """`expert_inputs` for 8 experts, where group 0 routes every token to experts 0 and 1 (on data=2,expert=4 all
    to one device: a sender's full buffer), and no token of groups 4-7 chooses expert 5 (an empty expert there)."""
    x, gates, choice, w_in, w_down = expert_inputs(groups, 8)
    choice[0] = [0, 1]
    choice[4:] = np.where(choice[4:] == 5, 6 + (choice[4:, :, ::-1] == 6), choice[4:])
    return x, gates, choice, w_in, w_down


@pytest.mark.parametrize("mesh", EXPERT_MESHES)
def test_experts_split_over_devices_equal_one_program(mesh):
    """Dropless experts with the experts split over devices (CPU: the padded exchange) equal the per-token reference
    (float64) within 2e-5, and their gradients the one-program path's within 1e-5 of each gradient's norm (measured:
    at most 2.3e-7, with tensor=2 splitting the hidden units)."""
    inputs = skewed_expert_inputs()
    y, grads = split_experts_value_and_grads(mesh, *inputs)
    np.testing.assert_allclose(y, each_token_through_its_experts(*inputs), rtol=2e-5, atol=2e-5)
    assert_gradients_close(grads, split_experts_value_and_grads(None, *inputs)[1], rtol=1e-5)


def ragged_all_to_all_as_documented(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all-gathers and an all-to-all (which XLA:CPU
    runs): sender i's slice operand_i[input_offsets_i[me] :][: send_sizes_i[me]] lands at
    all_to_all(output_offsets)[i] of this device's output, recv_sizes[i] rows; the other rows keep `output`'s."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # (n, N, D)
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # (n,)
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # (n,)
    row = jnp.arange(output.shape[0])
    inside = (row >= landing[:, None]) & (row < (landing + recv_sizes)[:, None])  # (n, M)
    sender = jnp.argmax(inside, axis=0)
    source = jnp.clip(starts[sender] + row - landing[sender], 0, operand.shape[0] - 1)
    return jnp.where(jnp.any(inside, axis=0)[:, None], operands[sender, source], output)


def test_ragged_all_to_all_as_documented_matches_its_docstring_example():
    """The docstring's example on two devices, rows of one value: operands [1, 2, 2] and [3, 4, 0]."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    operand, output = jnp.array([1, 2, 2, 3, 4, 0])[:, None], jnp.zeros((8, 1), jnp.int32)
    offsets_and_sizes = [[0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1]]  # both devices' four, one after other
    exchange = functools.partial(ragged_all_to_all_as_documented, axis_name="x")
    got = jax.shard_map(exchange, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))(
        operand, output, *map(jnp.array, offsets_and_sizes)
    )
    np.testing.assert_array_equal(got[:, 0], [1, 3, 0, 0, 2, 2, 4, 0])


def test_the_ragged_exchange_routes_rows_where_they_belong(monkeypatch):
    """The ragged exchange (TPU's and GPU's, which XLA:CPU cannot compile) with ragged_all_to_all replaced by the
    documented semantics above: its offsets and sizes deliver every row to its expert and back, for value and
    gradient, as the padded exchange does."""
    monkeypatch.setattr(expert_dispatch, "active_platform", lambda: "tpu")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", ragged_all_to_all_as_documented)
    inputs = skewed_expert_inputs()
    y, grads = split_experts_value_and_grads("data=2,expert=4", *inputs, exchange="ragged")
    np.testing.assert_allclose(y, each_token_through_its_experts(*inputs), rtol=2e-5, atol=2e-5)
    assert_gradients_close(grads, split_experts_value_and_grads(None, *inputs)[1], rtol=1e-5)


def test_bad_expert_splits_and_exchanges_are_refused():
    x, gates, choice, w_in, w_down = (np.float32(a) for a in expert_inputs(8, 6))
    with pytest.raises(ExpertParallelError, match="n_experts=6 does not split 4 ways .* use n_experts divisible by 4"):
        split_experts_value_and_grads("data=2,expert=4", x, gates, choice, w_in, w_down)
    x, gates, choice, w_in, w_down = expert_inputs(8, 8)
    with pytest.raises(ExpertParallelError, match="exchange=ragged needs .* XLA:CPU .* use expert_exchange=padded"):
        split_experts_value_and_grads("data=2,expert=4", x, gates, choice, w_in, w_down, exchange="ragged")
    with pytest.raises(ExpertParallelError, match="expert_exchange='all' is unknown"):
        dropless_experts(x, gates, choice, w_in, w_down, exchange="all")
    with pytest.raises(ConfigError, match="model.expert_exchange='all' is not one of auto, ragged, padded"):
        apply_overrides(default_config("moe"), ["expert_exchange=all"])


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


DROPLESS_MESH = "data=2,expert=4"


def test_dropless_on_an_expert_parallel_mesh_equals_one_device():
    """moe-tiny routed dropless on data=2,expert=4 (the tokens exchanged over the expert axis; on CPU the padded
    exchange) and on one device: 5 steps' losses and gradient norms within 1e-5, the first step's expert load
    alike, and nothing dropped. (Each gradient: the slow test below; the kernel's, on four meshes, above.)"""
    run, single = cached_run(DROPLESS_MESH, tuple(DROPLESS), "moe"), cached_run("single", tuple(DROPLESS), "moe")
    assert_curves_close(curve(run), reference_curve(tuple(DROPLESS), "moe"))
    (_, metrics), (_, want) = (
        r.train_step(r.shardings.init_state(r.optimizer, 0), r.batch("train", 0)) for r in (run, single)
    )
    assert float(metrics["expert_load"]) == pytest.approx(float(want["expert_load"]), rel=1e-6)
    assert 1.0 <= float(metrics["expert_load"]) < run.cfg.model.n_experts and float(metrics["dropped"]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [DROPLESS_MESH, "expert=8", "data=2,fsdp=2,expert=2"])
def test_dropless_gradients_on_expert_parallel_meshes_equal_one_device(mesh):
    """Each gradient of moe-tiny's loss, routed dropless, on the first batch within 1e-5 of its norm of one
    device's (measured: at most 3e-7), and the loss within 1e-6."""
    (loss, grads), (want_loss, want_grads) = (
        gradients(cached_run(m, tuple(DROPLESS), "moe")) for m in (mesh, "single")
    )
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert_gradients_close(grads, want_grads, rtol=1e-5)


def test_dropless_tokens_reach_their_experts_by_all_to_all():
    """On data=2,expert=4 the dropless step moves tokens as capacity routing does: four all-to-alls per layer over
    the expert axis (forward and backward, there and back), each of one device's padded buffers, n x P rows with
    P = its tokens x min(top_k, E/n): what capacity routing moves with room for every token (capacity_factor 4).
    Over the expert axis besides: the all-gather of the rows routed to each expert ((n, E) integers) and what the
    capacity step has too (gradient and metric all-reduces). Sorting the whole batch instead, the step had 10
    all-reduces of 2.4 MB a device over the expert axis."""
    run = cached_run(DROPLESS_MESH, tuple(DROPLESS), "moe")
    cfg, n = run.cfg, run.shardings.mesh.shape["expert"]
    dropless, roomy = (
        {(r.axes, r.kind): r for r in communication_report(r.train_step, r.shardings.mesh).rows}
        for r in (run, run_on(DROPLESS_MESH))
    )
    exchange = (("expert",), "all-to-all")
    to_all = dropless.pop(exchange)
    assert to_all.executions == 4 * cfg.model.n_layers
    slots = (
        cfg.data.batch_size
        * cfg.data.seq_len
        // run.shardings.mesh.size
        * min(cfg.model.top_k, cfg.model.n_experts // n)
    )
    assert to_all.mean == pytest.approx(to_all.executions * n * slots * cfg.model.d_model * 4 * (n - 1) / n)
    assert to_all.mean == pytest.approx(roomy[exchange].mean)
    counts = dropless.pop((("expert",), "all-gather"))
    assert counts.mean <= counts.executions * n * cfg.model.n_experts * 4
    touching = {key: r.mean for key, r in dropless.items() if "expert" in key[0]}
    # Within the few scalars the routing statistics differ by (capacity routing counts what it drops).
    assert touching == pytest.approx({key: roomy[key].mean for key in touching}, abs=64), sorted(dropless)


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
@pytest.mark.parametrize("routing,mesh,steps", [("capacity", None, 300), ("dropless", DROPLESS_MESH, 200)])
def test_auxiliary_loss_balances_the_experts(routing, mesh, steps):
    """`steps` steps of moe-tiny (8 experts, top 2; capacity factor 1.25 on one device, or dropless on data=2,expert=4)
    on the builtin text, with and without the auxiliary loss (weight 0.03), the same data. The load, most tokens
    routed to one expert over the mean, averaged over the last third of the steps and on held-out text, measured with
    it and without: capacity (300 steps) 1.37 and 1.48, 3.94 and 3.93; dropless 1.41 and 1.35, 2.77 and 2.73 at 200
    steps (1.26 and 1.30, 2.91 and 2.87 at 300, 30 s longer)."""
    loads = {}
    for weight in (0.03, 0.0):
        overrides = [f"steps={steps}", "batch_size=16", "seq_len=64", "log_every=10", f"eval_every={steps}"]
        overrides += ["eval_batches=8", f"routing={routing}", f"aux_loss_weight={weight}", "progress=false"]
        cfg = apply_overrides(default_config("moe"), [*overrides, *([f"mesh={mesh}"] if mesh else [])])
        summary = train(cfg, log=lambda *_: None, devices=jax.devices() if mesh else jax.devices()[:1])
        late = [h["expert_load"] for h in summary["history"] if h["step"] > steps * 2 // 3]
        loads[weight] = (np.mean(late), summary["val_expert_load"])
    print("expert load (last third of the steps, held out): with", loads[0.03], "without", loads[0.0])
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
