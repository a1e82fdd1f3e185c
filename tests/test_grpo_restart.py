"""GRPO killed with SIGKILL and rerun (`jaxtrain train grpo.group_size=...`): the rerun resumes from the newest
checkpoint and logs the rewards and losses an uninterrupted run logs. The in-process resume (a deleted checkpoint):
tests/test_grpo.py; SIGKILL of ordinary training: tests/test_fault_tolerance.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import kill_when, logged_rows, newest

ROOT = Path(__file__).resolve().parent.parent
PER_BATCH = 16  # completions per batch of rollouts: batch_size
# The reward, imported by the subprocess from tmp_path. Under STALL_AFTER_BATCHES=n it hangs on the first completion
# of batch n (calls count from this process's start), so the test kills a run that is surely mid-run, after a
# checkpoint, however loaded the machine: a timed kill of a run of half a second could miss.
REWARDS = f"""import os, time

calls = 0


def first_byte_low(completion, record):
    global calls
    calls += 1
    stall = os.environ.get("STALL_AFTER_BATCHES")
    if stall and calls > int(stall) * {PER_BATCH}:
        time.sleep(600)
    return float(bool(completion) and ord(completion[0]) < 64)
"""
KEYS = ("reward_mean", "loss", "grad_norm")


def grpo_command(directory: Path, prompts: Path) -> list[str]:
    """8 optimizer steps on 4 batches of rollouts (grpo.num_iterations=2), a checkpoint after each batch, on a
    one-layer llama-tiny (its compile is a fifth shorter than two layers')."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--simulated-devices", "1", "--mesh", "data=1"]
    command += ["--model", "llama-tiny", "model.n_layers=1", "seq_len=16", "--batch-size", str(PER_BATCH)]
    command += ["--steps", "8", "grpo.group_size=8", "grpo.max_new_tokens=2", "grpo.num_iterations=2"]
    command += ["learning_rate=0.05", "warmup_steps=0", "progress=false", f"grpo.prompts={prompts}"]
    command += ["grpo.rewards=restart_rewards:first_byte_low", f"checkpoint.dir={directory}", "checkpoint.every=2"]
    return [*command, f"tracking.metrics_file={directory}.jsonl"]


def test_a_grpo_run_killed_with_sigkill_and_rerun_logs_what_an_uninterrupted_one_logs(tmp_path):
    """Kill -9 a GRPO run while it samples its third batch of rollouts (checkpoint 4 complete), rerun the same
    command: it takes over the dead run's lock, resumes at step 4 as the same run, and the metrics file holds steps
    2, 4 (the killed process's) and 6, 8 (the rerun's), whose reward_mean, loss and grad_norm equal an uninterrupted
    run's bit for bit (measured: bit-equal in each of 6 runs of the test). 18-38 s on 2 CPU cores shared with other
    work (load 4 to 6): the killed run compiles (60% of it), the rerun and the uninterrupted run then load its
    compiled programs side by side."""
    (tmp_path / "restart_rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["hello", "abc", "what is", "jax", "12+3="]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def start(directory: Path, **extra: str) -> subprocess.Popen:
        command = grpo_command(directory, prompts)
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**env, **extra}
        )

    directory = tmp_path / "killed"
    killed = start(directory, STALL_AFTER_BATCHES="2")
    if not kill_when(killed, lambda: newest(directory) == 4):
        killed.kill()  # it may be stalled with no checkpoint 4
        pytest.fail(f"the run ended, or wrote no checkpoint 4 in 120 s:\n{killed.communicate()[1]}")
    assert [r["step"] for r in logged_rows(Path(f"{directory}.jsonl"))] == [2, 4]

    # The rerun and the uninterrupted run side by side: each loads the programs the killed run compiled.
    reference = tmp_path / "reference"
    rerun, whole = start(directory), start(reference)
    outputs = [process.communicate(timeout=120) for process in (rerun, whole)]
    for process, (_, err) in zip((rerun, whole), outputs):
        assert process.returncode == 0, err
    out = outputs[0][0]
    assert "resuming at step 4 from a checkpoint" in out
    assert f"warning: taking over the lock of {directory} from pid {killed.pid} " in out

    got, want = logged_rows(Path(f"{directory}.jsonl")), logged_rows(Path(f"{reference}.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 4, 6, 8]
    assert len({r["run"] for r in got}) == 1  # resumed as the same run, not a new one
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]
    assert len({r["reward_mean"] for r in want}) > 1  # the reward varies: its equality shows something
