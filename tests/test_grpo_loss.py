"""GRPO by hand: `jaxtrain.posttrain.grpo`'s advantages, ratios, clipped loss under each aggregation, k3 KL and
gradient against a NumPy float64 reference written here, on a fixed batch of rollouts whose ratios are clipped on both
sides and whose completions have different lengths; against TRL's own `GRPOTrainer._compute_loss` (compiled from the
installed trl's source and called on the same batch, without a trainer); sharded over 8 devices equal to one; bad
input is one line.

Agreement (float32 ours, float64 theirs) is max |ours - theirs| / max |theirs| for arrays, and for the loss
|ours - theirs| / Σ_t |w_t ℓ_t|, its terms' total size: the loss sums terms of both signs (advantages sum to 0 in a
group), so it is ~20x smaller than its terms and a plain relative error would measure that cancellation, not the code
(1.1e-6 for DAPO's here; 5e-8 as measured)."""

import ast
import functools
import importlib.util
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.posttrain.grpo import GrpoError, GrpoLoss, group_advantages, k3_kl

PROMPTS, G, T = 4, 4, 12
B = PROMPTS * G
BUDGET = 16  # dr_grpo's max_completion_length: the generation budget, more than the padded T
RTOL = 1e-6
LOSSES = {  # each with the advantage scale its paper pairs it with
    "deepseekmath": (GrpoLoss(aggregation="grpo", beta=0.04, kl_ratio_weighted=False), "std"),
    "dapo": (GrpoLoss(aggregation="dapo", epsilon_high=0.28), "std"),
    "dapo_kl": (GrpoLoss(aggregation="dapo", beta=0.04), "batch"),
    "dr_grpo": (GrpoLoss(aggregation="dr_grpo", max_completion_length=BUDGET, beta=0.04), "none"),
}


def rollouts() -> dict[str, np.ndarray]:
    """A fixed batch: 4 prompts x 4 completions, rewards binary, continuous and all-equal (a group with std 0), ratios
    exp(±0.6) around 1 (clipped on both sides for both signs of advantage), completions of 0 to T tokens."""
    rng = np.random.default_rng(0)
    rewards = np.concatenate([[1.0, 0.0, 0.0, 1.0], rng.normal(size=G), [0.5] * G, [0.0, 0.0, 0.0, 1.0]])
    lengths = np.concatenate([[T, 0, 1], rng.integers(1, T + 1, B - 3)])
    log_probs = -rng.exponential(1.0, (B, T))
    return {
        "rewards": rewards.astype(np.float32),
        "log_probs": log_probs.astype(np.float32),
        "old_log_probs": (log_probs - rng.uniform(-0.6, 0.6, (B, T))).astype(np.float32),
        "reference_log_probs": (log_probs + rng.normal(0.0, 0.3, (B, T))).astype(np.float32),
        "mask": (np.arange(T) < lengths[:, None]).astype(np.float32),
    }


def batch(scale: str = "std") -> dict[str, np.ndarray]:
    """The rollouts with their advantages (jaxtrain's, float32: both sides of a comparison get the same inputs)."""
    data = rollouts()
    data["advantages"] = np.asarray(group_advantages(data["rewards"], G, scale))
    return data


def as64(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key: value.astype(np.float64) for key, value in data.items()}


def error(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


# --- The reference, float64, from the papers' formulas ---------------------------------------------------------------


def np_advantages(rewards: np.ndarray, group_size: int, scale: str) -> np.ndarray:
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        out[start : start + group_size] = group - group.mean()
        if scale == "std":
            out[start : start + group_size] /= np.std(group, ddof=1) + 1e-4
        elif scale == "batch":
            out[start : start + group_size] /= np.std(rewards, ddof=1) + 1e-4
    return out


def np_terms(loss: GrpoLoss, d: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """Per token: ratio, the surrogate's loss, the KL term and the loss's derivative in log π_θ."""
    ratio = np.exp(d["log_probs"] - d["old_log_probs"])
    a = d["advantages"][:, None]
    clipped = np.clip(ratio, 1 - loss.epsilon_low, 1 + loss.epsilon_high)
    unclipped_wins = ratio * a <= clipped * a
    surrogate = -np.minimum(ratio * a, clipped * a)
    diff = d["reference_log_probs"] - d["log_probs"]
    k3 = np.exp(diff) - diff - 1
    dk3 = 1 - np.exp(diff)  # d k3 / d log π_θ
    kl, dkl = (ratio * k3, ratio * k3 + ratio * dk3) if loss.kl_ratio_weighted else (k3, dk3)
    # where the clipped term wins, ρ is held at the clip: no gradient
    dsurrogate = np.where(unclipped_wins, -ratio * a, 0.0)
    return ratio, surrogate + loss.beta * kl, kl, dsurrogate + loss.beta * dkl


def np_weights(loss: GrpoLoss, mask: np.ndarray) -> np.ndarray:
    """Each token's weight in the aggregated loss."""
    if loss.aggregation == "grpo":
        return mask / np.maximum(mask.sum(axis=1, keepdims=True), 1) / len(mask)
    if loss.aggregation == "dapo":
        return mask / mask.sum()
    return mask / (len(mask) * loss.max_completion_length)


def np_loss(loss: GrpoLoss, d: dict[str, np.ndarray]) -> tuple[float, np.ndarray, float]:
    """(loss, its gradient in log π_θ, the total size of its terms Σ |w ℓ|)."""
    _, losses, _, dlosses = np_terms(loss, d)
    weights = np_weights(loss, d["mask"])
    if loss.aggregation == "grpo":  # written as the paper's nested means, not as the weights
        value = np.mean([(losses[i] * d["mask"][i]).sum() / max(d["mask"][i].sum(), 1) for i in range(len(losses))])
    else:
        value = float(np.sum(losses * weights))
    return value, dlosses * weights, float(np.sum(np.abs(losses * weights)))


# --- Against the reference ----------------------------------------------------------------------------------------


def test_rollouts_are_clipped_on_both_sides_for_both_signs():
    """The batch exercises every branch of min(ρA, clip(ρ)A): the clip wins below and above, and outside the range
    the unclipped term wins when the advantage has the other sign."""
    d = batch()
    ratio, a, counted = np.exp(d["log_probs"] - d["old_log_probs"]), d["advantages"][:, None], d["mask"] > 0
    for region in [ratio < 0.8, ratio > 1.28, (ratio > 0.8) & (ratio < 1.2)]:
        for sign in [a < 0, a > 0]:
            assert np.sum(region & sign & counted) >= 3
    assert len(set(d["mask"].sum(axis=1))) >= 6  # lengths 0 and T among them


@pytest.mark.parametrize("scale", ["std", "batch", "none"])
def test_advantages_equal_the_reference(scale):
    rewards = rollouts()["rewards"]
    ours = group_advantages(rewards, G, scale)
    theirs = np_advantages(rewards.astype(np.float64), G, scale)
    assert ours.dtype == jnp.float32
    assert error(ours, theirs) < RTOL
    assert np.all(np.asarray(ours)[8:12] == 0)  # the group whose rewards are all equal: 0, not 0/0
    for group in np.asarray(ours).reshape(PROMPTS, G):
        assert abs(group.sum()) < 1e-5  # a baseline: each group's advantages sum to 0


def test_k3_kl_equals_the_reference_and_is_never_negative():
    d = rollouts()
    ours = np.asarray(k3_kl(d["log_probs"], d["reference_log_probs"]))
    diff = d["reference_log_probs"].astype(np.float64) - d["log_probs"]
    assert error(ours, np.exp(diff) - diff - 1) < RTOL
    assert np.all(ours >= 0)


@pytest.mark.parametrize("name", LOSSES)
def test_token_losses_equal_the_reference(name):
    loss, scale = LOSSES[name]
    d = batch(scale)
    losses, ratio, kl = loss.token_losses(d["log_probs"], d["old_log_probs"], d["reference_log_probs"], d["advantages"])
    ratio64, losses64, kl64, _ = np_terms(loss, as64(d))
    assert error(ratio, ratio64) < RTOL
    assert error(kl, kl64) < RTOL
    assert error(losses, losses64) < RTOL


@pytest.mark.parametrize("name", LOSSES)
def test_loss_metrics_and_gradient_equal_the_reference(name):
    loss, scale = LOSSES[name]
    d = batch(scale)
    args = [d[k] for k in ("old_log_probs", "reference_log_probs", "advantages", "mask")]
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(d["log_probs"], *args)
    value64, grad64, size = np_loss(loss, as64(d))
    assert abs(float(value) - value64) < RTOL * size
    assert error(grad, grad64) < RTOL
    assert np.all(np.asarray(grad)[d["mask"] == 0] == 0)  # padding has no gradient

    ratio, _, kl, _ = np_terms(loss, as64(d))
    counted, a = d["mask"] > 0, d["advantages"][:, None]
    low, high = (ratio < 1 - loss.epsilon_low) & (a < 0), (ratio > 1 + loss.epsilon_high) & (a > 0)
    expected = {
        "clip_fraction_low": np.mean(low[counted]),
        "clip_fraction_high": np.mean(high[counted]),
        "clip_fraction": np.mean((low | high)[counted]),
        "ratio": np.mean(ratio[counted]),
        "kl": np.mean(kl[counted]),
        "advantage": np.mean(d["advantages"].astype(np.float64)),
    }
    assert set(metrics) == set(expected)
    for key, want in expected.items():
        assert abs(float(metrics[key]) - want) <= RTOL * max(abs(want), 1.0), key
    assert 0 < expected["clip_fraction_low"] and 0 < expected["clip_fraction_high"]


def test_first_update_on_fresh_rollouts_is_the_policy_gradient():
    """π_old = π_θ passed as the same array: ρ = 1, and the gradient is still -A ∇log π (per token, by the weights),
    because the old log-probs are constants."""
    loss = GrpoLoss(aggregation="dapo")
    d = batch()
    grad = jax.grad(lambda lp: loss(lp, lp, None, d["advantages"], d["mask"])[0])(d["log_probs"])
    want = -d["advantages"][:, None].astype(np.float64) * np_weights(loss, d["mask"].astype(np.float64))
    assert error(grad, want) < RTOL


# --- Against TRL --------------------------------------------------------------------------------------------------


@functools.cache
def trl_functions() -> dict:
    """TRL's `GRPOTrainer._compute_loss` and the `nanstd`, `nanmin` and `nanmax` of trl/trainer/utils.py, compiled
    from the installed trl's source alone, under their own file names and line numbers: they are plain torch, and
    importing `trl.trainer.grpo_trainer` would cost ~7 s of transformers on 2 cores."""
    torch = pytest.importorskip("torch", reason="comparing with TRL needs the hf extra: pip install -e '.[hf]'")
    spec = importlib.util.find_spec("trl")  # finds the package without importing it
    if spec is None:
        pytest.skip("comparing with TRL needs trl: pip install -e '.[hf]'")
    namespace = {"torch": torch}
    wanted = {"utils.py": ("nanstd", "nanmin", "nanmax"), "grpo_trainer.py": ("_compute_loss",)}
    for file, names in wanted.items():
        path = Path(spec.origin).parent / "trainer" / file
        found = [node for node in ast.walk(ast.parse(path.read_text())) if getattr(node, "name", None) in names]
        assert sorted(node.name for node in found) == sorted(names), f"TRL moved {names} out of {path}"
        exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def trl_compute_loss(loss: GrpoLoss, d: dict[str, np.ndarray]) -> tuple[float, np.ndarray, dict[str, float]]:
    """TRL's `GRPOTrainer._compute_loss`, float64, on a stand-in for the trainer that hands it `log_probs` as the
    model's per-token log-probs: one process, no gradient accumulation, one step per generation, train mode. Returns
    (loss, its gradient in log π_θ, the metrics TRL logged)."""
    torch, compute_loss = trl_functions()["torch"], trl_functions()["_compute_loss"]
    policy = torch.tensor(d["log_probs"], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(d["mask"], dtype=torch.int64)  # TRL's completion_mask is an int mask
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *_, **__: (policy, torch.zeros_like(policy), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        use_vllm=False,
        loss_type=loss.aggregation,
        epsilon_low=loss.epsilon_low,
        epsilon_high=loss.epsilon_high,
        beta=loss.beta,
        max_completion_length=loss.max_completion_length,
        args=SimpleNamespace(use_bias_correction_kl=loss.kl_ratio_weighted, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
    )
    inputs = {
        "prompt_ids": torch.zeros((B, 2), dtype=torch.int64),
        "prompt_mask": torch.ones((B, 2), dtype=torch.int64),
        "completion_ids": torch.zeros((B, T), dtype=torch.int64),
        "completion_mask": mask,
        "advantages": torch.tensor(d["advantages"], dtype=torch.float64),
        "old_per_token_logps": torch.tensor(d["old_log_probs"], dtype=torch.float64),
        "ref_per_token_logps": torch.tensor(d["reference_log_probs"], dtype=torch.float64),
        "num_items_in_batch": mask.sum(),  # TRL's: the completion tokens of the whole generation batch
    }
    value = compute_loss(trainer, None, inputs)
    value.backward()
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return value.item(), policy.grad.numpy(), logged


@pytest.mark.parametrize("name", LOSSES)
def test_loss_gradient_and_metrics_equal_trls(name):
    loss, scale = LOSSES[name]
    d = batch(scale)
    args = [d[k] for k in ("old_log_probs", "reference_log_probs", "advantages", "mask")]
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(d["log_probs"], *args)
    value_trl, grad_trl, logged = trl_compute_loss(loss, d)
    value64, _, size = np_loss(loss, as64(d))
    assert abs(value_trl - value64) < 1e-12 * size  # TRL's float64 is the reference's, to rounding
    assert abs(float(value) - value_trl) < RTOL * size
    assert error(grad, grad_trl) < RTOL
    names = {"clip_fraction_low": "clip_ratio/low_mean", "clip_fraction_high": "clip_ratio/high_mean"}
    names |= {"clip_fraction": "clip_ratio/region_mean"} | ({"kl": "kl"} if loss.beta else {})
    for ours, theirs in names.items():
        assert abs(float(metrics[ours]) - logged[theirs]) <= RTOL * max(abs(logged[theirs]), 1.0), ours


def test_advantages_equal_trls_formula_with_its_nanstd():
    """TRL computes advantages inside its rollout step (`_generate_and_score_completions`, not callable alone): its
    lines for scale_rewards='group', with its own `nanstd` (whose Bessel correction sets the ddof)."""
    torch, nanstd = trl_functions()["torch"], trl_functions()["nanstd"]
    rewards = torch.tensor(rollouts()["rewards"], dtype=torch.float64)
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    assert error(group_advantages(rollouts()["rewards"], G), ((rewards - mean) / (std + 1e-4)).numpy()) < RTOL


# --- One device equals a mesh ----------------------------------------------------------------------------------------


def test_sharded_over_eight_devices_equals_one_device():
    """The batch dim split over data=2 x fsdp=2 x tensor=2 (2 completions a device, so each group of 4 spans two
    devices): advantages, loss, metrics and gradient equal one device's."""
    loss, _ = LOSSES["dr_grpo"]
    d = rollouts()

    @jax.jit
    def step(log_probs, old_log_probs, reference_log_probs, rewards, mask):
        advantages = group_advantages(rewards, G)
        objective = jax.value_and_grad(loss, has_aux=True)
        return advantages, objective(log_probs, old_log_probs, reference_log_probs, advantages, mask)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "tensor")))
    sharded = {k: jax.device_put(v, split) for k, v in d.items()}
    one = {k: jax.device_put(v, jax.devices()[0]) for k, v in d.items()}
    assert len(sharded["log_probs"].addressable_shards) == 8
    (adv, ((value, metrics), grad)), (adv1, ((value1, metrics1), grad1)) = step(**sharded), step(**one)
    assert grad.sharding.is_equivalent_to(split, 2)  # the gradient stays split as its log-probs
    assert error(adv, adv1) < RTOL
    assert abs(float(value) - float(value1)) <= RTOL * np_loss(loss, as64(batch("std")))[2]
    assert error(grad, grad1) < RTOL
    for key in metrics:
        assert abs(float(metrics[key]) - float(metrics1[key])) <= RTOL * max(abs(float(metrics1[key])), 1.0), key


# --- Bad input --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"aggregation": "ppo"}, r"aggregation='ppo' is not one of: grpo .*dapo .*dr_grpo"),
        ({"epsilon_low": 1.0}, r"epsilon_low=1.0 is out of range.*use 0 < epsilon_low < 1"),
        ({"epsilon_low": 0.0}, r"epsilon_low=0.0 is out of range"),
        ({"epsilon_high": -0.1}, r"epsilon_high=-0.1 is out of range: use epsilon_high > 0"),
        ({"beta": -0.01}, r"beta=-0.01 would reward .*use beta >= 0"),
        ({"aggregation": "dr_grpo"}, r"max_completion_length, which is None: set it to the generation budget"),
    ],
)
def test_bad_settings_are_one_line(settings, match):
    with pytest.raises(GrpoError, match=match) as raised:
        GrpoLoss(**settings)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("rewards", "group_size", "scale", "match"),
    [
        (np.zeros(8), 1, "std", r"G = 1: every advantage is 0 .*use G >= 2"),
        (np.zeros(8), 0, "std", r"group_size=0 is not a number .*use G >= 2"),
        (np.zeros(10), 4, "std", r"B = 10 rewards do not split into groups of G = 4"),
        (np.zeros((2, 4)), 4, "std", r"rewards have shape \(2, 4\); give one per completion"),
        (np.zeros(8), 4, "group", r"scale='group' is not one of: std .*batch .*none"),
    ],
)
def test_bad_groups_are_one_line(rewards, group_size, scale, match):
    with pytest.raises(GrpoError, match=match) as raised:
        group_advantages(rewards, group_size, scale)
    assert "\n" not in str(raised.value)


def test_bad_batches_are_one_line():
    d = batch()
    lp, old, ref, adv, mask = (
        d[k] for k in ("log_probs", "old_log_probs", "reference_log_probs", "advantages", "mask")
    )
    cases = [
        (GrpoLoss(beta=0.04), (lp, old, None, adv, mask), r"beta=0.04 weighs a KL .*reference_log_probs is None"),
        (GrpoLoss(), (lp, old[:, :5], ref, adv, mask), r"old_log_probs have shape \(16, 5\), log_probs \(16, 12\)"),
        (GrpoLoss(), (lp, old, ref, adv[:8], mask), r"advantages have shape \(8,\) .*give one per completion, \(16,\)"),
        (
            GrpoLoss(aggregation="dr_grpo", max_completion_length=8),
            (lp, old, ref, adv, mask),
            r"T = 12 tokens, more than max_completion_length=8",
        ),
    ]
    for loss, args, match in cases:
        with pytest.raises(GrpoError, match=match) as raised:
            loss(*args)
        assert "\n" not in str(raised.value)
