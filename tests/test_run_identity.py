"""A checkpoint directory holds one run: resuming it with a config that changes the run's trajectory is refused
before anything is written (every file byte-identical after), unless the change is allowed by name, and then it is
recorded in the run's history; what says only how a step runs (the mesh, cadences, outputs) may change freely."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
from test_checkpoint import ROOT, config, digest, run_train

from jaxtrain.errors import UserInputError
from jaxtrain.run_config import (
    AllReduceConfig,
    CheckpointConfig,
    ConfigError,
    PipelineConfig,
    TrackingConfig,
    TrainConfig,
    UpdatesConfig,
    apply_overrides,
    default_config,
)
from jaxtrain.training import run_identity
from jaxtrain.training.checkpoint import newest_meta
from jaxtrain.training.loop import train

MESH = "data=2,fsdp=2,tensor=2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 6 steps with checkpoints at 2, 4 and 6 and a metrics file (the configs of test_checkpoint)."""
    root = tmp_path_factory.mktemp("saved")
    run_train(MESH, root / "ckpt", extra=[f"metrics_file={root / 'm.jsonl'}"])
    return root


def test_every_train_key_is_classified():
    """Each key of the sections the training loop and its parts take is either free or defines the trajectory, by a
    decision written down here: a new key makes this test fail until it is classified."""
    parts = (TrainConfig, AllReduceConfig, UpdatesConfig, PipelineConfig, CheckpointConfig, TrackingConfig)
    keys = {cls.key(f.name) for cls in parts for f in dataclasses.fields(cls)}
    assert keys - run_identity.FREE_KEYS == {
        "train.steps",
        "train.seed",
        "updates.policy",
        "updates.average_every",
        "updates.staleness",
        "updates.outer_lr",
        "updates.outer_momentum",
        "allreduce.compression",
    }
    every_key = set(run_identity._flat(run_identity.config_json(default_config("gpt-tiny"))))
    assert run_identity.FREE_KEYS <= every_key
    assert {"model_name", "model.d_model", "model.dtype", "optimizer.learning_rate", "data.batch_size"} <= {
        k for k in every_key if run_identity.defines_trajectory(k)
    }


@pytest.mark.parametrize(
    "change,key,stored,now",
    [
        ("d_model=32", "model.d_model", "64", "32"),
        ("dtype=bfloat16", "model.dtype", '"float32"', '"bfloat16"'),
        ("batch_size=16", "data.batch_size", "8", "16"),
        ("learning_rate=0.02", "optimizer.learning_rate", "0.01", "0.02"),
        ("steps=12", "train.steps", "6", "12"),
        ("seed=1", "train.seed", "0", "1"),
    ],
)
def test_a_resume_that_changes_the_run_is_refused_and_writes_nothing(saved, change, key, stored, now):
    before = digest(saved)
    with pytest.raises(run_identity.RunIdentityError) as refused:
        train(
            config(MESH, saved / "ckpt", [change, f"metrics_file={saved / 'm.jsonl'}"]),
            log=lambda line: pytest.fail(f"got as far as: {line}"),  # refused before the preflight
        )
    message = str(refused.value)
    assert f"{key}: {stored} in the checkpoint, {now} now" in message
    assert f"its newest checkpoint, {saved / 'ckpt' / '6'}" in message
    assert "another --checkpoint-dir" in message and f"--restore {saved / 'ckpt' / '6'}" in message
    assert f"--allow-config-change {key}" in message
    assert digest(saved) == before  # checkpoints, metrics and all: byte for byte


def test_every_differing_key_is_named_at_once(saved):
    with pytest.raises(run_identity.RunIdentityError) as refused:
        train(config(MESH, saved / "ckpt", ["n_layers=3", "seed=5", "learning_rate=0.5"]), log=lambda *_: None)
    message = str(refused.value)
    for line in (
        "model.n_layers: 2 in the checkpoint, 3 now",
        "optimizer.learning_rate: 0.01 in the checkpoint, 0.5 now",
        "train.seed: 0 in the checkpoint, 5 now",
    ):
        assert line in message
    assert "--allow-config-change model.n_layers,optimizer.learning_rate,train.seed" in message


def test_the_command_line_refuses_with_one_message_and_status_2(saved, tmp_path):
    """The same refusal from `jaxtrain train`: exit status 2, one error, no traceback, before compiling."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--simulated-devices", "8", "--model", "gpt-tiny"]
    command += ["--mesh", MESH, "--steps", "6", "--batch-size", "8", "--seq-len", "32", "--checkpoint-dir"]
    command += [str(saved / "ckpt"), "--no-progress", "warmup_steps=1", "learning_rate=0.01", "d_model=32"]
    before = digest(saved)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, env=os.environ)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: cannot resume in") and "Traceback" not in done.stderr
    assert "model.d_model: 64 in the checkpoint, 32 now" in done.stderr
    assert "compiled step" not in done.stdout
    assert digest(saved) == before


def test_an_allowed_change_resumes_and_is_recorded_in_the_history(saved, tmp_path):
    """--allow-config-change seed: the resume goes ahead, the change is in the history of every later checkpoint,
    also those of a later resume that no longer needs the flag."""
    directory = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", directory)
    for step in ("4", "6"):
        shutil.rmtree(directory / step)
    logs = []
    run_train(MESH, directory, extra=["seed=1", "checkpoint.allow_change=seed"], log=logs.append)
    assert "resuming at step 2 with changes checkpoint.allow_change allows: train.seed 0 -> 1" in "\n".join(logs)
    entry = {"step": 2, "changed": {"train.seed": {"from": 0, "to": 1}}}
    assert newest_meta(directory)[1]["history"] == [entry]
    shutil.rmtree(directory / "6")
    run_train(MESH, directory, extra=["seed=1"])  # resumes at 4, whose config has seed 1: nothing to allow
    path, meta = newest_meta(directory)
    assert path.name == "6" and meta["history"] == [entry] and meta["config"]["train"]["seed"] == 1


def test_an_allowed_change_of_shapes_still_cannot_resume(saved):
    """The config may allow d_model to change, but the arrays cannot: the run stops naming the first one."""
    with pytest.raises(run_identity.RunIdentityError, match="a run cannot change its arrays' shapes") as refused:
        run_train(MESH, saved / "ckpt", extra=["d_model=32", "checkpoint.allow_change=d_model"])
    assert "params/blocks/attn_norm is (2, 64) there, (2, 32) here" in str(refused.value)


def test_unknown_keys_in_allow_config_change_are_errors(saved):
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat'. Did you mean: .*learning_rate"):
        train(config(MESH, saved / "ckpt", ["checkpoint.allow_change=seed,learning_rat"]), log=lambda *_: None)


def test_free_keys_are_not_compared(saved):
    cfg = apply_overrides(
        config(MESH, saved / "ckpt"),
        ["mesh=fsdp=4", "log_every=3", "eval_every=2", "checkpoint.every=5", "progress=true", "rules.embed=fsdp"],
    )
    stored = newest_meta(saved / "ckpt")[1]["config"]
    assert run_identity.differences(stored, cfg) == {}
    assert isinstance(run_identity.RunIdentityError("x"), UserInputError)  # the command line's exit status 2
