"""Checkpoints: a resumed run equals an uninterrupted one; a checkpoint restores onto other meshes; bad paths and
mismatched models are clear errors."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.checkpoint import CheckpointError, Checkpoints, restore
from jaxtrain.config import apply_overrides, default_config
from jaxtrain.run import build, train

ROOT = Path(__file__).resolve().parent.parent
RUN = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "steps=6", "log_every=1"]
RUN += ["eval_every=1000", "progress=false", "checkpoint_every=2"]


def config(mesh, directory, extra=()):
    return apply_overrides(default_config("gpt-tiny"), [*RUN, f"mesh={mesh}", f"checkpoint_dir={directory}", *extra])


def run_train(mesh, directory, devices=8, extra=()):
    result = train(config(mesh, directory, extra), log=lambda *_: None, devices=jax.devices()[:devices])
    return {r["step"]: r["loss"] for r in result["history"]}, result["state"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 steps on data=2,fsdp=2,tensor=2 with checkpoints at 2, 4 and 6."""
    directory = tmp_path_factory.mktemp("whole") / "ckpt"
    losses, state = run_train("data=2,fsdp=2,tensor=2", directory)
    with Checkpoints(directory, 2) as checkpoints:
        assert checkpoints.steps() == [2, 4, 6]
    return directory, losses, jax.device_get(state)


def crashed_after_step_4(uninterrupted, tmp_path):
    """A copy of the run's checkpoints as a process killed after step 4's save left them."""
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], directory)
    shutil.rmtree(directory / "6")
    return directory


def test_resume_continues_exactly(uninterrupted, tmp_path):
    _, losses, final = uninterrupted
    resumed_losses, resumed_state = run_train("data=2,fsdp=2,tensor=2", crashed_after_step_4(uninterrupted, tmp_path))
    assert sorted(resumed_losses) == [5, 6]  # only the steps after the checkpoint are redone
    np.testing.assert_allclose([resumed_losses[5], resumed_losses[6]], [losses[5], losses[6]], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(jax.device_get(resumed_state)), jax.tree.leaves(final)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mesh,devices", [("data=8", 8), ("fsdp=4", 4), ("single", 1)])
def test_restore_onto_another_mesh(mesh, devices, uninterrupted):
    directory, _, final = uninterrupted
    cfg = config(mesh, directory)
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:devices])
    state, meta = restore(directory / "6", run.plan.abstract_model_state())
    assert meta["step"] == 6 and meta["config"]["mesh"] == "data=2,fsdp=2,tensor=2"
    for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(got, want)
    assert {d for x in jax.tree.leaves(state) for d in x.devices()} <= set(jax.devices()[:devices])


def test_resume_on_another_mesh_and_a_pipeline(uninterrupted, tmp_path):
    """Saved under data=2,fsdp=2,tensor=2, resumed under an uneven pipeline layout: same losses."""
    _, losses, _ = uninterrupted
    directory = crashed_after_step_4(uninterrupted, tmp_path)
    resumed, _ = run_train("pipeline=2,data=2", directory, devices=4, extra=["microbatches=2"])
    np.testing.assert_allclose([resumed[5], resumed[6]], [losses[5], losses[6]], rtol=1e-5)


def test_missing_restore_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"):
        run_train("data=8", tmp_path / "fresh", extra=[f"restore={tmp_path / 'nowhere'}"])


def test_checkpoint_of_another_model_is_refused(uninterrupted):
    directory = uninterrupted[0]
    run = build(config("data=8", directory, ["d_model=32"]), log=lambda *_: None)
    with pytest.raises(CheckpointError, match="does not match the model: .* is \\(2, 64\\) there, \\(2, 32\\) here"):
        restore(directory / "6", run.plan.abstract_model_state())


def test_truncated_newest_checkpoint_falls_back_to_the_previous(uninterrupted, tmp_path, caplog):
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], directory)
    for data in (directory / "6" / "state").rglob("d/*"):  # the array data files
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    run = build(config("data=8", directory), log=lambda *_: None)
    with Checkpoints(directory, 2) as checkpoints:
        state, meta = checkpoints.restore_latest(run.plan.abstract_model_state())
    assert meta["step"] == 4
    assert f"skipping checkpoint {directory / '6'}" in caplog.text


def test_sigterm_saves_and_resume_continues(tmp_path):
    """The train command, stopped by SIGTERM mid-run, saves, exits with 143, and the same command resumes."""
    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ckpt"
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--simulated-devices", "8", "--model", "gpt-tiny"]
    command += ["--mesh", "data=8", "--steps", "40", "--batch-size", "8", "--seq-len", "32", "--log-every", "1"]
    command += ["--checkpoint-dir", str(directory), "--checkpoint-every", "1000", "--no-progress"]
    command += ["--metrics-file", str(metrics)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    with Checkpoints(directory, 1000) as checkpoints:
        saved = checkpoints.steps()
    assert len(saved) == 1 and 3 <= saved[0] < 40
    resumed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-(40 - saved[0]) :] == list(range(saved[0] + 1, 41))  # picked up right after the saved step


@pytest.mark.slow  # resume onto another mesh and a pipeline stays in the default suite
def test_padded_pipeline_layout_saves_and_restores_in_model_order(tmp_path):
    """3 layers on 2 stages are stored padded to (2, 2) rows in stage order; checkpoints hold model order both ways:
    a data-parallel checkpoint resumes under the pipeline, and the pipeline's own checkpoint restores data-parallel."""
    layers = ["n_layers=3"]
    plain = tmp_path / "plain"
    losses, final = run_train("data=8", plain, extra=layers)
    piped = tmp_path / "piped"
    shutil.copytree(plain, piped)
    shutil.rmtree(piped / "6")
    resumed, piped_state = run_train("pipeline=2,data=4", piped, extra=[*layers, "microbatches=2"])
    assert piped_state["params"]["blocks"]["w_in"].shape[0] == 4  # stored as stages (2 layers, 1 + padding)
    np.testing.assert_allclose([resumed[5], resumed[6]], [losses[5], losses[6]], rtol=1e-5)
    run = build(config("data=8", piped, layers), log=lambda *_: None)
    state, _ = restore(piped / "6", run.plan.abstract_model_state())
    for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(final))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
