"""GRPO's rollouts on Ray's rollout workers (jaxtrain.asynchronous.rollout_workers): rewards and meshes a worker
cannot take are refused in one line before Ray starts; with staleness 0 the workers' rollouts are the in-process
ones; with staleness 1 and a worker three times slower no batch is staler than 1 and GRPO's steps stay finite; bad
input a worker finds (a prompt too long) is one line too. The in-process rollouts themselves: tests/test_grpo.py."""

import contextlib
import functools
import json

import jax
import numpy as np
import pytest

from jaxtrain.inference.generate import ByteTokenizer
from jaxtrain.posttrain.grpo_train import grpo_step
from jaxtrain.posttrain.rewards import resolve_rewards
from jaxtrain.posttrain.rollout_source import rollout_source
from jaxtrain.posttrain.rollouts import Prompts, RolloutError, Rollouts, RolloutShapes
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.setup import build

ray = pytest.importorskip("ray", reason="Ray's rollout workers need the async extra: pip install -e '.[async]'")

SEQ_LEN = 16
RUN = ["batch_size=8", f"seq_len={SEQ_LEN}", "warmup_steps=0", "progress=false", "grpo.group_size=4"]
RUN += ["grpo.max_new_tokens=4", "learning_rate=0.01", "mesh=data=1", "engine.kind=ray"]
WORDS = ["hello", "abc", "what is", "jax", "tiny", "12+3="]
# A worker resolves rewards by name; this one (the first byte is ASCII) holds about half a fresh model's draws.
REWARD = r"format:[\x00-\x7f].*"


def prompts() -> Prompts:
    return Prompts.from_records([{"prompt": w, "answer": w[::-1]} for w in WORDS], ByteTokenizer())


@functools.cache
def learner(*overrides: str, devices: int = 1):
    """The learner's run on `devices` devices, and its initial state (host arrays: the steps donate the state's)."""
    cfg = apply_overrides(default_config("llama-tiny"), [*RUN, *overrides])
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:devices], dataset=RolloutShapes(SEQ_LEN))
    return run, jax.device_get(run.shardings.init_state(run.optimizer, 0))


def fresh_state(run, host_state):
    return jax.device_put(host_state, run.shardings.state_shardings)


def ray_rollouts(run, state, records=None):
    """The rollout workers' sampler, inside the test's Ray session."""
    from jaxtrain.asynchronous.rollout_workers import RayRollouts

    sampler = RayRollouts(run, state["params"], records or prompts(), [REWARD], ByteTokenizer().decode)
    return contextlib.closing(sampler)


@pytest.mark.parametrize(
    "mesh,reward,match",
    [
        ("data=1", lambda c, r: 1.0, r"^reward '<lambda>' is a function of this process only .* engine.kind=spmd\.$"),
        ("data=2", REWARD, r"^engine.devices_per_worker=1 cannot hold mesh 'data=2': a rollout worker lays the"),
    ],
    ids=["a lambda reward", "a mesh larger than a worker"],
)
def test_what_a_worker_cannot_take_is_refused_before_ray_starts(mesh, reward, match):
    run, _ = learner(f"mesh={mesh}", devices=int(mesh[-1]))
    with pytest.raises(RolloutError, match=match) as caught:
        with rollout_source(run, None, prompts(), resolve_rewards(reward), ByteTokenizer().decode):
            pass
    assert "\n" not in str(caught.value) and not ray.is_initialized()


def test_rewards_reach_the_workers_by_name():
    """A worker resolves each reward in its own process: a module-level function by its module:function."""
    from jaxtrain.asynchronous.rollout_workers import portable_rewards

    names = portable_rewards(resolve_rewards(["exact_match", REWARD, "json:dumps"]))
    assert names == ["jaxtrain.posttrain.rewards:exact_match", REWARD, "json:dumps"]


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for the module: starting Ray costs seconds."""
    from jaxtrain.asynchronous.cluster import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), logging_level="warning")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_without_staleness_the_workers_rollouts_are_the_in_process_ones(ray_session):
    """engine.max_staleness=0: batches 0..2, each sampled from the learner's params of the moment with a step between
    them, are the in-process sampler's tokens; their log-probs were equal to the bit (a worker runs the learner's
    program on a one-device mesh of its own), and are held to a float32 ulp or two."""
    run, host = learner("engine.workers=1", "engine.max_staleness=0")
    state = fresh_state(run, host)
    local = Rollouts(run, state["params"], prompts(), resolve_rewards(REWARD), ByteTokenizer().decode)
    with ray_rollouts(run, state) as sampler:
        for number in range(3):
            got, want = sampler(state["params"], number), local(state["params"], number)
            assert got.staleness == 0
            np.testing.assert_array_equal(got.batch["tokens"], want.batch["tokens"])
            np.testing.assert_allclose(got.batch["old_log_probs"], want.batch["old_log_probs"], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(got.rewards, want.rewards)
            state, _ = run.train_step(state, sampler.place(got.batch))


@pytest.mark.slow
def test_with_a_slow_worker_no_batch_is_staler_than_the_bound(ray_session):
    """Two workers, worker 1 three times slower, staleness at most 1: five GRPO steps, each on a batch at most one
    version old (batch 2 is one: it was handed out while the learner trained on batch 1), with a finite loss."""
    run, host = learner("engine.workers=2", "engine.max_staleness=1", "engine.slow_workers=1:3")
    state = fresh_state(run, host)
    records = []
    with ray_rollouts(run, state) as sampler:
        for number in range(5):
            state, record = grpo_step(run, state, sampler, number)
            records.append(record)
    assert [r["staleness"] for r in records][2] == 1 and max(r["staleness"] for r in records) <= 1
    assert all(np.isfinite(r["loss"]) and r["nonfinite"] == 0 for r in records)
    assert sum(sampler.used) == 5


@pytest.mark.slow
def test_bad_input_a_worker_finds_is_one_line(ray_session):
    run, host = learner("engine.workers=1")
    long = Prompts.from_records([{"prompt": "x" * 14}], ByteTokenizer())
    with pytest.raises(RolloutError, match=r"^prompt 0 \('x{14}'\) has 14 tokens, .* shorten the prompt\.$"):
        ray_rollouts(run, fresh_state(run, host), long)


@pytest.mark.slow
def test_grpo_train_samples_on_ray_with_engine_kind_ray(ray_session, tmp_path):
    """The loop itself (`grpo_train`, as `jaxtrain train engine.kind=ray` runs it): 4 steps on two workers within
    staleness 1, each record in the metrics file with its staleness."""
    from jaxtrain.posttrain.grpo_train import grpo_train

    metrics = tmp_path / "metrics.jsonl"
    overrides = ["engine.workers=2", "engine.max_staleness=1", "train.steps=4", f"tracking.metrics_file={metrics}"]
    cfg = apply_overrides(default_config("llama-tiny"), [*RUN, *overrides])
    out = grpo_train(cfg, prompts(), REWARD, log=lambda *_: None, devices=jax.devices()[:1])
    staleness = [r["staleness"] for r in out["history"]]
    assert len(staleness) == 4 and max(staleness) <= 1 and all(np.isfinite(r["loss"]) for r in out["history"])
    assert [json.loads(line)["staleness"] for line in metrics.read_text().splitlines()] == staleness
