"""Checkpoints: a resumed run equals an uninterrupted one; a checkpoint restores onto other meshes; bad paths and
mismatched models are clear errors."""

import hashlib
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

from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.checkpoint import CheckpointError, Checkpoints, describe_checkpoint, restore
from jaxtrain.training.loop import train
from jaxtrain.training.run_identity import RunIdentityError
from jaxtrain.training.run_lock import RunLockedError
from jaxtrain.training.setup import build

ROOT = Path(__file__).resolve().parent.parent
RUN = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "steps=6", "log_every=1"]
RUN += ["eval_every=1000", "progress=false", "checkpoint.every=2"]


def digest(directory: Path) -> dict[str, str]:
    """Every file under `directory` by relative path, with the SHA-256 of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def config(mesh, directory, extra=()):
    return apply_overrides(default_config("gpt-tiny"), [*RUN, f"mesh={mesh}", f"checkpoint.dir={directory}", *extra])


def run_train(mesh, directory, devices=8, extra=(), log=lambda *_: None):
    result = train(config(mesh, directory, extra), log=log, devices=jax.devices()[:devices])
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
    state, meta = restore(directory / "6", run.shardings.abstract_model_state())
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
        restore(directory / "6", run.shardings.abstract_model_state())


def test_truncated_newest_checkpoint_falls_back_to_the_previous(uninterrupted, tmp_path, caplog):
    """Step 6's array data cut in half: step 4 restores, with a one-line warning naming step 6 and the cause, and step
    6 is moved aside, bytes intact, for the run will save a step 6 of its own."""
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], directory)
    truncate_arrays(directory / "6")
    truncated = digest(directory / "6")
    run = build(config("data=8", directory), log=lambda *_: None)
    with Checkpoints(directory, 2) as checkpoints:
        state, meta = checkpoints.restore_latest(run.shardings.abstract_model_state())
        assert meta["step"] == 4 and checkpoints.steps() == [2, 4]
    [skipped, moved] = [r.getMessage() for r in caplog.records]
    assert skipped.startswith(f"skipping checkpoint {directory / '6'}, which does not read back: ")
    assert "OUT_OF_RANGE" in skipped and "\n" not in skipped and len(skipped) < 600  # not TensorStore's whole spec
    [aside] = directory.glob("6.unreadable-*")
    assert moved.startswith(f"moved unreadable checkpoint {directory / '6'} to {aside}")
    assert digest(aside) == truncated
    assert f"moved aside, unreadable (never restored; delete when not needed): {aside.name}" in describe_checkpoint(
        directory
    )


def truncate_arrays(step_dir: Path) -> None:
    for data in (step_dir / "state").rglob("d/*"):  # the array data files
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def test_a_refusal_stops_the_search_and_nothing_is_moved(uninterrupted, tmp_path):
    """A checkpoint refused by `accept` (another run's) is not skipped like an unreadable one: the search stops, and
    the unreadable newer one stays where it is."""
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], directory)
    truncate_arrays(directory / "6")

    def accept(path, meta):
        if path.name == "4":
            raise RunIdentityError(f"{path} is another run's")

    run = build(config("data=8", directory), log=lambda *_: None)
    with Checkpoints(directory, 2) as checkpoints:
        with pytest.raises(RunIdentityError, match="4 is another run's"):
            checkpoints.restore_latest(run.shardings.abstract_model_state(), accept)
        assert checkpoints.steps() == [2, 4, 6]
    assert not list(directory.glob("*.unreadable-*"))


def test_no_checkpoint_that_reads_back_is_an_error(uninterrupted, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0], directory)
    for step in ("2", "4", "6"):
        truncate_arrays(directory / step)
    before = digest(directory)
    with pytest.raises(CheckpointError, match="none of the checkpoints in .* reads back \\(steps 2, 4, 6;"):
        run_train("data=8", directory)
    assert digest(directory) == before


def test_restore_from_a_training_step_continues_that_run(uninterrupted, tmp_path):
    """--restore runs/x/ckpt/4 into a new checkpoint directory: a new run that starts at step 4 with that step's
    optimizer state and data position, so its losses and final state are the original run's; its history says
    where it came from, and the original directory is untouched."""
    source, losses, final = uninterrupted
    before = digest(source)
    directory = tmp_path / "new"
    logs = []
    resumed, state = run_train("data=2,fsdp=2,tensor=2", directory, extra=[f"restore={source / '4'}"], log=logs.append)
    assert f"starting a new run from step 4 of {source / '4'}" in "\n".join(logs)
    assert sorted(resumed) == [5, 6]
    np.testing.assert_allclose([resumed[5], resumed[6]], [losses[5], losses[6]], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(final)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    with Checkpoints(directory, 2) as checkpoints:
        assert checkpoints.steps() == [6]
    _, meta = restore(
        directory / "6", build(config("data=8", directory), log=lambda *_: None).shardings.abstract_model_state()
    )
    assert meta["history"] == [{"step": 4, "restored_from": str(source / "4"), "changed": {}}]
    assert digest(source) == before


def train_command(directory: Path, metrics: Path, steps: int = 20) -> list[str]:
    """The train command of `config("data=8", directory, [f"steps={steps}"])`, checkpointing every 5 steps."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--simulated-devices", "8", "--model", "gpt-tiny"]
    command += ["--mesh", "data=8", "--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--log-every", "1"]
    command += ["--checkpoint-dir", str(directory), "--checkpoint-every", "5", "--no-progress"]
    return [*command, "--metrics-file", str(metrics), "warmup_steps=1", "learning_rate=0.01", "eval_every=1000"]


def start_and_wait(command: list[str], ready) -> subprocess.Popen:
    """Start `command` and return once `ready()` holds."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_until(ready, process, lambda: (process.kill(), process.communicate()[1])[1])
    return process


def has_rows(metrics: Path, rows: int) -> bool:
    return metrics.exists() and len(metrics.read_text().splitlines()) >= rows


def logged(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps  # each step once, in order
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_saves_and_the_rerun_continues_exactly(signum, tmp_path):
    """The train command, stopped by Ctrl-C (SIGINT; a scheduler's SIGTERM alike), finishes its step, saves, and exits
    with 128 + the signal's number without a traceback; the same command resumes to the losses of an uninterrupted
    run. While it trains, a second run into its checkpoint directory is refused at start, naming it, and the first
    one's checkpoints are untouched."""
    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ckpt"
    process = start_and_wait(train_command(directory, metrics), lambda: (directory / "5").is_dir())
    # Paused while a second run is refused: on an idle machine the remaining steps take less time than that check.
    process.send_signal(signal.SIGSTOP)
    complete = {p.name: digest(p) for p in directory.iterdir() if p.name.isdigit()}
    with pytest.raises(RunLockedError, match=f"is in use: pid {process.pid} on host"):
        run_train("data=8", directory, extra=["steps=20"], log=lambda line: pytest.fail(f"got as far as: {line}"))
    kept = {name: digest(directory / name) for name in complete if (directory / name).is_dir()}
    assert kept and kept == {name: complete[name] for name in kept}  # (retention may have removed an old one)
    process.send_signal(signum)  # pending until the process runs again
    process.send_signal(signal.SIGCONT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    stopped = int(stderr.split(f"stopped by {signal.Signals(signum).name} after step ")[1].split(",")[0])
    with Checkpoints(directory, 5) as checkpoints:
        assert stopped in checkpoints.steps() and stopped < 20
    assert max(logged(metrics)) == stopped

    rerun = train_command(directory, metrics)
    with subprocess.Popen(rerun, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as resumed:
        reference = run_train("data=8", tmp_path / "reference", extra=["steps=20"])[0]  # while the rerun starts up
        stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert f"resuming at step {stopped}" in stdout
    losses = logged(metrics)
    assert sorted(losses) == list(range(1, 21))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), step


@pytest.mark.slow  # the first Ctrl-C's save is in the default suite
def test_a_second_ctrl_c_exits_at_once(tmp_path):
    """The first Ctrl-C is acknowledged on stderr; a second one after that exits at once with 130, no save. (Two
    signals sent while the main thread is inside XLA reach Python's handler as one: wait for the acknowledgement.)"""
    metrics, directory, errors = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "stderr"
    with errors.open("w") as stderr:
        command = train_command(directory, metrics, steps=400)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
        wait_until(lambda: has_rows(metrics, 3), process, errors.read_text)
        process.send_signal(signal.SIGINT)
        wait_until(lambda: "SIGINT: stopping after this step" in errors.read_text(), process, errors.read_text)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    assert process.returncode == 130 and "Traceback" not in errors.read_text()
    assert "interrupted again: exiting now, without saving" in errors.read_text()
    saved = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.exists() else []
    assert all(step % 5 == 0 for step in saved), saved  # the periodic saves only, none for the stop


def wait_until(ready, process: subprocess.Popen, describe) -> None:
    """Return once `ready()` holds; fail, with `describe()` (the process's stderr), if it exits or 120 s pass."""
    deadline = time.time() + 120
    while not ready():
        assert process.poll() is None and time.time() < deadline, describe()
        time.sleep(0.01)


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
    state, _ = restore(piped / "6", run.shardings.abstract_model_state())
    for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(final))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
