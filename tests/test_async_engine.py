"""The asynchronous parameter-server engine on Ray (`jaxtrain.asynchronous`): its bookkeeping without Ray, then real
runs on one local Ray session shared by the module (workers and server shards are separate processes)."""

import random

import jax
import numpy as np
import pytest

from jaxtrain.asynchronous.dispatch import Dispatcher, staleness_report
from jaxtrain.asynchronous.shards import ShardingError, assign_leaves, join, split
from jaxtrain.run_config import ConfigError, apply_overrides, default_config

TINY = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "progress=false", "eval_every=1000"]


def async_config(*overrides: str):
    return apply_overrides(default_config("gpt-tiny"), [*TINY, "engine.kind=ray", *overrides])


# The bookkeeping, without Ray.


def test_shards_split_by_bytes_and_join_back():
    sizes = [400, 10, 300, 200, 90]
    owned = assign_leaves(sizes, 2)
    assert sorted(i for part in owned for i in part) == list(range(5))
    assert [sum(sizes[i] for i in part) for part in owned] == [500, 500]
    assert join(split(list("abcde"), owned), owned) == list("abcde")
    with pytest.raises(ShardingError, match="engine.server_shards=6.*at most 5"):
        assign_leaves(sizes, 6)


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_bounded_staleness_holds_whatever_the_arrival_order(bound):
    """Four workers finishing in random order: no applied gradient is older than the bound, every batch is applied
    once, and with a bound of 0 there is never more than one gradient in flight."""
    rng = random.Random(bound)
    dispatcher = Dispatcher(4, max_staleness=bound, pull_every=3)
    while dispatcher.version < 60:
        for worker in range(4):
            if worker not in dispatcher.in_flight:
                dispatcher.assign(worker)
        assert len(dispatcher.in_flight) <= bound + 1
        dispatcher.complete(rng.choice(sorted(dispatcher.in_flight)))
    assert max(row.staleness for row in dispatcher.log) <= bound
    assert sorted(row.batch for row in dispatcher.log) == list(range(60))


def test_unbounded_staleness_lets_fast_workers_take_more_batches():
    """Worker 0 is three times slower: the others take about three times its batches, and its gradients are the
    stale ones."""
    dispatcher = Dispatcher(4)
    clock, busy_until = 0.0, {}
    while dispatcher.version < 120:
        for worker in range(4):
            if worker not in dispatcher.in_flight:
                dispatcher.assign(worker)
                busy_until[worker] = clock + (3.0 if worker == 0 else 1.0) + worker * 1e-3
        worker = min(busy_until, key=busy_until.get)
        clock = busy_until.pop(worker)
        dispatcher.complete(worker)
    report = staleness_report(dispatcher.log, 4)
    slow, *fast = report["gradients_per_worker"]
    assert all(2.5 * slow <= n <= 3.5 * slow for n in fast)
    assert report["staleness_max"] == max(row.staleness for row in dispatcher.log if row.worker == 0)


def test_sync_rounds_average_one_gradient_per_worker_and_a_dead_worker_is_redone():
    dispatcher = Dispatcher(3, mode="sync")
    jobs = [dispatcher.assign(w) for w in range(3)]
    assert [j.batch for j in jobs] == [0, 1, 2] and all(j.pull and j.read_version == 0 for j in jobs)
    assert dispatcher.complete(0) == [] and dispatcher.assign(0) is None  # waits for the round
    dispatcher.drop(1)  # died computing batch 1: its replacement redoes it, on the same params
    assert dispatcher.assign(1).batch == 1
    dispatcher.complete(2)
    rows = dispatcher.complete(1)
    assert [(r.update, r.batch, r.staleness) for r in rows] == [(1, 0, 0), (1, 1, 0), (1, 2, 0)]
    assert dispatcher.unapplied() == []


def test_a_server_shard_applies_the_mean_gradient_with_a_staleness_scaled_step():
    """A shard (the plain class, no Ray) with SGD: the mean of two gradients is applied, `scale` 0.5 moves the params
    half as far, and a NaN loss skips the update but not the version."""
    from jaxtrain.asynchronous.server import ServerShard
    from jaxtrain.run_config import OptimizerConfig

    sgd = OptimizerConfig(name="sgd", learning_rate=1.0, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    shard = ServerShard(sgd, 10, [("embed",)], [np.zeros(3, np.float32)])
    shard.apply(0.0, 1.0, [np.ones(3, np.float32)], [3 * np.ones(3, np.float32)])
    np.testing.assert_allclose(shard.params()[1][0], -2.0)
    shard.apply(0.0, 0.5, [np.ones(3, np.float32)])
    np.testing.assert_allclose(shard.params()[1][0], -2.5)
    shard.apply(float("nan"), 1.0, [np.ones(3, np.float32)])
    assert shard.params()[0] == 3 and shard.applied_count() == 4
    np.testing.assert_allclose(shard.params()[1][0], -2.5)


def test_engine_settings_are_checked():
    from jaxtrain.asynchronous.engine import check_engine
    from jaxtrain.training.loop import train

    with pytest.raises(ConfigError, match="slow_workers='4:3'.*0..3"):
        async_config("workers=4", "slow_workers=4:3")
    with pytest.raises(ConfigError, match="'1:0.5' is not I:FACTOR"):
        async_config("slow_workers=1:0.5")
    with pytest.raises(ConfigError, match="engine.kind=ray: this is the SPMD loop"):
        train(async_config())
    with pytest.raises(ConfigError, match="pipeline axis"):
        check_engine(async_config("mesh=pipeline=2,data=2"))
    with pytest.raises(ConfigError, match="updates.policy=stale with --engine ray"):
        check_engine(async_config("updates.policy=stale"))


# Real runs on Ray.

ray = pytest.importorskip("ray", reason="the ray engine needs the async extra: pip install -e '.[async]'")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for the module: starting Ray costs seconds."""
    from jaxtrain.asynchronous.cluster import runtime_env

    ray.init(num_cpus=4, include_dashboard=False, runtime_env=runtime_env(), logging_level="warning")
    yield
    ray.shutdown()


def test_one_worker_without_staleness_is_synchronous_training(ray_session):
    """1 worker, 2 server shards, staleness 0: the losses of `jaxtrain train` on one device, step for step."""
    from jaxtrain.asynchronous.engine import train_async
    from jaxtrain.training.loop import train

    cfg = async_config("workers=1", "engine.server_shards=2", "max_staleness=0", "steps=5", "log_every=1")
    summary = train_async(cfg, log=lambda *_: None)
    reference = train(apply_overrides(cfg, ["engine.kind=spmd"]), log=lambda *_: None, devices=jax.devices()[:1])
    got = [row["loss"] for row in summary["history"]]
    np.testing.assert_allclose(got, [row["loss"] for row in reference["history"]], rtol=1e-5)
    assert summary["staleness_max"] == 0 and summary["gradients_applied_per_shard"] == [5, 5]


def test_the_servers_apply_exactly_the_gradients_they_receive(ray_session, tmp_path):
    """3 workers with unbounded staleness: every shard applied each of the 9 gradients once, no batch twice, and
    the batch log (in the checkpoint directory) says who took which batch at which staleness."""
    from jaxtrain.asynchronous.engine import BATCH_LOG, train_async

    cfg = async_config(
        "workers=3", "engine.server_shards=2", "steps=9", f"checkpoint.dir={tmp_path}", "checkpoint.every=0"
    )
    summary = train_async(cfg, log=lambda *_: None)
    assert summary["gradients_applied_per_shard"] == [9, 9]
    batches = [row.batch for row in summary["batch_log"]]
    assert len(set(batches)) == 9 and max(batches) < 9 + 3  # the last ones handed out may be in flight at the end
    assert sum(summary["gradients_per_worker"]) == 9
    assert summary["staleness_max"] == max(row.staleness for row in summary["batch_log"])
    assert sum(summary["staleness_histogram"].values()) == 9
    assert len((tmp_path / BATCH_LOG).read_text().splitlines()) == 9


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_the_run_resumes_from_its_checkpoint(tmp_path):
    """`jaxtrain train --engine ray`: kill -9 worker 1 mid-run; a replacement takes its batch and the run finishes by
    itself. Rerun longer (train.steps allowed to change): it resumes at the last update, and the batch log holds each
    update once, no batch twice."""
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from jaxtrain.asynchronous.engine import BATCH_LOG

    root = Path(__file__).resolve().parent.parent
    args = [sys.executable, str(root / "scripts" / "train.py"), "--model", "gpt-tiny", "--engine", "ray"]
    args += ["--workers", "2", "--batch-size", "8", "--seq-len", "32", "--log-every", "1", "--no-progress"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5", "warmup_steps=1", "eval_every=1000"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.Popen(
        [*args, "--steps", "24"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines, pid = [], None
    for line in run.stdout:
        lines.append(line)
        if found := re.match(r"worker 1: pid (\d+)", line):
            pid = pid or int(found.group(1))
        if re.match(r"step\s+6\b", line):
            os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=300) == 0, "".join(lines[-40:])
    output = "".join(lines)
    assert "worker 1 died" in output and "worker_restarts 1" in output and "done: steps 24" in output

    again = subprocess.run([*args, "--steps", "30", "--allow-config-change", "train.steps"], capture_output=True,
                           text=True, env=env, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming at update 24" in again.stdout and "done: steps 30" in again.stdout
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / BATCH_LOG).read_text().splitlines()]
    assert [row["update"] for row in rows] == list(range(1, 31))
    assert len({row["batch"] for row in rows}) == 30
