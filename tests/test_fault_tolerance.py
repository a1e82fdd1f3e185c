"""Fault tolerance: a run killed at any moment (SIGKILL, also mid-save) resumes to the same numbers; failed writes are
reported and leave the previous checkpoint intact; non-finite steps in a row roll back to the last checkpoint."""

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kill_when, logged_rows, newest
from orbax.checkpoint._src.path import async_path

from jaxtrain.placement.model import ModelParts
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.checkpoint import CheckpointWriteError, restore
from jaxtrain.training.loop import train
from jaxtrain.training.recovery import Diverged
from jaxtrain.training.run_lock import LOCK_NAME
from jaxtrain.training.setup import Run, build

ROOT = Path(__file__).resolve().parent.parent
EVERY = 10  # steps between checkpoints in the kill test
STEPS = 50


def train_command(directory: Path, metrics: Path) -> list[str]:
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--simulated-devices", "8", "--model", "gpt-tiny"]
    command += ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"]
    command += ["--log-every", "1", "--eval-every", "1000", "--checkpoint-every", str(EVERY), "--no-progress"]
    return [*command, "--checkpoint-dir", str(directory), "--metrics-file", str(metrics), "warmup_steps=2"]


def logged_losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, loss) of every complete line."""
    return [(r["step"], r["loss"]) for r in logged_rows(metrics)]


def saving(directory: Path) -> bool:
    return any(directory.glob("*.orbax-checkpoint-tmp*"))


def final_params(directory: Path) -> list[np.ndarray]:
    cfg = apply_overrides(default_config("gpt-tiny"), ["batch_size=8", "seq_len=32", "mesh=data=8"])
    state, _ = restore(directory / str(STEPS), build(cfg, log=lambda *_: None).shardings.abstract_model_state())
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def test_sigkill_at_random_moments_loses_nothing(tmp_path, optimized_subprocesses):
    """Kill -9 the train command at random moments, two of them while an asynchronous save is being written, and
    rerun the same command each time: every logged loss equals the uninterrupted run's, the final state is
    bit-equal, and each restart redoes at most one save interval (plus the steps that ran during the lost write)."""
    reference = tmp_path / "reference"  # the uninterrupted run, beside the killed ones: its own directory and lock
    command, errors = train_command(reference, reference / "m.jsonl"), (tmp_path / "reference.err").open("w")
    uninterrupted = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, cwd=ROOT)  # no pipe to fill

    directory, metrics = tmp_path / "killed", tmp_path / "killed.jsonl"
    command, rng = train_command(directory, metrics), random.Random(0)

    def reached(step: int) -> bool:
        return max((s for s, _ in logged_losses(metrics)), default=0) >= step

    # Spread over the run: at a random step, then while the first save after step 20 is being written, ...
    first, third = rng.randint(13, 19), rng.randint(33, 39)
    kills = [
        lambda: reached(first),
        lambda: reached(20) and saving(directory),
        lambda: reached(third),
        lambda: reached(40) and saving(directory),
    ]
    redone = []  # (steps the next process redoes, whether a write was cut short)
    for kill in kills:
        resumed_from = newest(directory)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert kill_when(process, kill), process.stderr.read()
        out = process.stdout.read()
        if resumed_from:  # picked up right after the newest complete checkpoint, from the killed process's lock
            assert f"resuming at step {resumed_from} from a checkpoint" in out
            assert f"warning: taking over the lock of {directory} from pid" in out
        steps = [step for step, _ in logged_losses(metrics)]
        assert steps == list(range(1, steps[-1] + 1))  # each step once: a rerun drops the rows it redoes
        redone.append((steps[-1] - newest(directory), saving(directory)))
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert finished.returncode == 0, finished.stderr
    uninterrupted.wait()
    errors.close()
    assert uninterrupted.returncode == 0, (tmp_path / "reference.err").read_text()
    want = dict(logged_losses(reference / "m.jsonl"))
    assert sorted(want) == list(range(1, STEPS + 1))

    got = logged_losses(metrics)
    assert [step for step, _ in got] == list(range(1, STEPS + 1))
    for step, loss in got:
        assert loss == pytest.approx(want[step], rel=1e-6), step
    for a, b in zip(final_params(directory), final_params(reference)):
        np.testing.assert_array_equal(a, b)
    # A kill mid-write also loses the steps run while it wrote, fewer than one interval: the next save waits for it.
    assert all(steps < (2 * EVERY if mid_write else EVERY) for steps, mid_write in redone), redone
    assert not saving(directory)  # the interrupted writes were cleaned up


RUN = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "log_every=1", "eval_every=1000"]
RUN += ["progress=false", "mesh=data=8"]


def config(directory: Path | None, extra=()):
    where = [f"checkpoint.dir={directory}"] if directory else []
    return apply_overrides(default_config("gpt-tiny"), [*RUN, *where, *extra])


@pytest.fixture
def poisoned_batches(monkeypatch):
    """Train batches whose index is in the returned set give a NaN loss (their tokens are all NUL, a byte the
    built-in text never has, and the wrapped loss turns that into NaN)."""
    bad: set[int] = set()
    make_loss, make_batch = ModelParts.loss_fn, Run.batch

    def loss_fn(self, params, batch):
        loss, metrics = make_loss(self, params, batch)
        return jnp.where(jnp.all(batch["tokens"] == 0), jnp.nan, loss), metrics

    def batch(self, split, index):
        batch = make_batch(self, split, index)
        if split == "train" and index in bad:
            batch = {k: jax.device_put(jnp.zeros_like(v), v.sharding) for k, v in batch.items()}
        return batch

    monkeypatch.setattr(ModelParts, "loss_fn", loss_fn)
    monkeypatch.setattr(Run, "batch", batch)
    return bad


def test_nonfinite_steps_in_a_row_roll_back_and_skip_the_data(poisoned_batches, tmp_path):
    """Batches 5-7 are poisoned: steps 6-8 are skipped and counted; at the third in a row the run restores step 4's
    checkpoint and continues with batch 8, so step 5 is trained on batch 8."""
    poisoned_batches.update({5, 6, 7})
    metrics = tmp_path / "m.jsonl"
    cfg = config(tmp_path / "ckpt", ["steps=10", "checkpoint.every=4", "rollback_after=3", f"metrics_file={metrics}"])
    logs = []
    summary = train(cfg, log=logs.append)
    assert summary["rollbacks"] == 1 and summary["nonfinite_total"] == 3
    assert any("rolled back to the checkpoint of step 4; continuing at batch 8" in line for line in logs), logs
    records = summary["history"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10]
    assert [r["nonfinite"] for r in records[5:7]] == [1, 1] and all(np.isfinite(r["loss"]) for r in records[7:])
    assert records[-1]["nonfinite_total"] == 3
    # The file keeps one row per step: the skipped steps' rows went with the state they described.
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [{k: v for k, v in r.items() if k != "run"} for r in rows] == records[:4] + records[7:]
    assert rows[4]["nonfinite_total"] == 3  # the rollback shows in the row after it

    run = build(cfg, log=lambda *_: None)  # step 5 after the rollback: step 4's params on batch 8
    state, meta = restore(tmp_path / "ckpt" / "4", run.shardings.abstract_model_state())
    expected = run.compiled_eval(run.shardings.state_from_model_order(state)["params"], run.batch("train", 8))["loss"]
    assert records[7]["loss"] == pytest.approx(float(expected), rel=1e-6)
    _, meta = restore(tmp_path / "ckpt" / "10", run.shardings.abstract_model_state())
    assert (meta["step"], meta["data_offset"], meta["nonfinite_total"], meta["rollbacks"]) == (10, 4, 3, 1)


def test_rolling_back_to_one_checkpoint_a_fourth_time_stops_the_run(poisoned_batches, tmp_path):
    """Every batch from 4 on is poisoned: each rollback to step 4 skips 2 batches, and the next ones diverge too;
    after 3 rollbacks to step 4 the fourth streak stops the run, and nothing after step 4 was ever saved."""
    poisoned_batches.update(range(4, 100))
    directory, logs = tmp_path / "ckpt", []
    with pytest.raises(Diverged) as stopped:
        train(config(directory, ["steps=10", "checkpoint.every=4", "rollback_after=2"]), log=logs.append)
    assert str(stopped.value).startswith(
        "2 non-finite steps in a row (steps 5-6), after rolling back to step 4 3 times already: the run diverges"
    )
    where = "warning: 2 non-finite steps in a row (steps 5-6): rolled back to the checkpoint of step 4; continuing"
    assert [line for line in logs if "rolled back" in line] == [
        f"{where} at batch {batch} (the 2 batches since are skipped)." for batch in (6, 8, 10)
    ]
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["4"]


def checkpoint_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_retention_holds_exactly_after_rollbacks_and_resumes(poisoned_batches, tmp_path):
    """checkpoint.keep=2, checkpoint.keep_every=4, a checkpoint every 2 steps to step 12: the newest two and every
    4th, exactly, after a rollback, after a resume past an unreadable checkpoint (moved aside, never deleted), and
    after a resume from an older one."""
    directory = tmp_path / "ckpt"
    cfg = config(directory, ["steps=12", "checkpoint.every=2", "checkpoint.keep=2", "checkpoint.keep_every=4"])
    cfg = apply_overrides(cfg, ["rollback_after=2"])
    poisoned_batches.update({7, 8})  # steps 8 and 9: no save at 8, back to step 6, on with batch 9
    assert train(cfg, log=lambda *_: None)["rollbacks"] == 1
    assert checkpoint_steps(directory) == [4, 8, 10, 12]

    for data in (directory / "12" / "state").rglob("d/*"):  # step 12 unreadable: resume at 10, save 12 again
        data.write_bytes(b"")
    train(cfg, log=lambda *_: None)
    assert checkpoint_steps(directory) == [4, 8, 10, 12]
    [aside] = directory.glob("12.unreadable-*")
    assert not any(data.stat().st_size for data in aside.rglob("d/*"))  # the unreadable one, kept as it was

    for step in ("10", "12"):  # a crash after step 8's save, as far as the directory shows
        shutil.rmtree(directory / step)
    train(cfg, log=lambda *_: None)
    assert checkpoint_steps(directory) == [4, 8, 10, 12]


def test_nonfinite_steps_without_a_checkpoint_stop_with_advice(poisoned_batches):
    poisoned_batches.update({2, 3})
    with pytest.raises(Diverged, match="2 non-finite steps in a row \\(steps 3-4\\) and no checkpoint to roll back"):
        train(config(None, ["steps=8", "rollback_after=2"]), log=lambda *_: None)


def test_isolated_nonfinite_steps_are_skipped_and_counted(poisoned_batches):
    poisoned_batches.update({1, 4})
    summary = train(config(None, ["steps=6"]), log=lambda *_: None)
    assert summary["nonfinite_total"] == 2 and summary["rollbacks"] == 0 and np.isfinite(summary["loss"])


@pytest.fixture
def disk_full_at_step(monkeypatch):
    """Make the asynchronous write of checkpoint N fail as a full disk does: Orbax's commit of that step raises
    ENOSPC in its background thread."""
    failing: set[int] = set()
    write_text = async_path.write_text

    async def full_disk(path, text):
        if any(f"/{step}.orbax-checkpoint-tmp" in str(path) for step in failing):
            raise OSError(28, "No space left on device", str(path))
        return await write_text(path, text)

    monkeypatch.setattr(async_path, "write_text", full_disk)
    return failing


def test_failed_write_stops_the_run_naming_the_path(disk_full_at_step, tmp_path):
    disk_full_at_step.add(4)
    directory = tmp_path / "ckpt"
    with pytest.raises(CheckpointWriteError) as failure:
        train(config(directory, ["steps=8", "checkpoint.every=2"]), log=lambda *_: None)
    message = str(failure.value)
    assert f"saving checkpoint {directory / '4'} failed" in message and "No space left on device" in message
    assert f"the newest complete checkpoint, {directory / '2'}, is intact" in message
    assert sorted(p.name for p in directory.iterdir()) == [
        "2",
        "config.toml",
    ]  # the partial write is gone, step 2 untouched
    run = build(config(directory, ["steps=8"]), log=lambda *_: None)
    _, meta = restore(directory / "2", run.shardings.abstract_model_state())
    assert meta["step"] == 2


def test_failed_write_can_be_survived(disk_full_at_step, tmp_path):
    disk_full_at_step.add(4)
    directory, logs = tmp_path / "ckpt", []
    summary = train(config(directory, ["steps=8", "checkpoint.every=2", "checkpoint.on_failure=continue"]), logs.append)
    assert summary["steps"] == 8
    assert any("saving checkpoint" in line and "Training continues" in line for line in logs), logs
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [
        2,
        6,
        8,
    ]  # keep=3; 4 was never written


def without_dac_override(command: list[str]) -> list[str]:
    """`command`, run so that file permissions bind it: as root, with the DAC capabilities dropped (setpriv)."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no directory is unwritable to this test's processes")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", "--", *command]


def run_timed(command: list[str], timeout: float = 120) -> tuple[int, str, float | None]:
    """Run `command` (killed after `timeout` s); its exit status, its stderr, and the seconds from the stderr line
    saying a checkpoint failed ('error: ... checkpoint ...') to the exit (None if there is no such line)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in process.stderr))
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    ended = time.monotonic()
    reader.join()
    reported = next((t for t, line in lines if line.startswith("error:") and "checkpoint" in line), None)
    return process.returncode, "".join(line for _, line in lines), None if reported is None else ended - reported


def test_a_directory_unwritable_when_saving_ends_the_run_with_74_within_30_s(tmp_path):
    """The checkpoint directory turns read-only once the run holds its lock: the first save cannot create its step
    directory; the error names the path and the cause, and the process exits with status 74 within 30 s (Orbax's
    writer threads used to wait 300 s for the directory)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / LOCK_NAME).touch()  # the lock file is all the run writes there before its first save
    directory.chmod(0o555)
    status, stderr, seconds = run_timed(without_dac_override(train_command(directory, tmp_path / "m.jsonl")))
    assert status == 74, stderr[-3000:]
    assert f"error: saving checkpoint {directory / str(EVERY)} failed (PermissionError: [Errno 13]" in stderr
    assert "no earlier checkpoint exists" in stderr
    assert seconds is not None and seconds <= 30, seconds


def test_a_directory_unwritable_from_the_start_is_refused_before_compiling(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    directory.chmod(0o555)
    status, stderr, _ = run_timed(without_dac_override(train_command(directory, tmp_path / "m.jsonl")))
    assert status == 74, stderr[-3000:]
    assert stderr.startswith(f"error: cannot use checkpoint directory {directory}: [Errno 13] Permission denied")
