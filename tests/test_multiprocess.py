"""Several real processes on localhost (JAX's distributed runtime, gloo collectives): the same numbers as one
process, checkpoints that move between process layouts, and a dead peer that stops the job instead of hanging it."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from launch_local import commands, free_port  # noqa: E402
from test_fault_tolerance import without_dac_override  # noqa: E402

from jaxtrain.run_config import apply_overrides, default_config  # noqa: E402
from jaxtrain.training.loop import train  # noqa: E402
from jaxtrain.training.run_lock import LOCK_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MESH = "data=2,fsdp=2,tensor=2"
ARGS = ["--model", "gpt-tiny", "--batch-size", "8", "--seq-len", "32", "--log-every", "1", "--no-progress"]
ARGS += ["warmup_steps=1", "learning_rate=0.01", "eval_every=1000"]


def launch(processes: int, devices: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", str(processes)]
    command += ["--devices-per-process", str(devices), "--", *ARGS, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def logged(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def one_process(steps: int, directory: Path | None = None) -> dict[int, float]:
    overrides = [f"mesh={MESH}", f"steps={steps}", "batch_size=8", "seq_len=32", "log_every=1", "eval_every=1000"]
    overrides += ["warmup_steps=1", "learning_rate=0.01", "progress=false"]
    if directory:
        overrides += [f"checkpoint.dir={directory}", "checkpoint.every=4"]
    summary = train(apply_overrides(default_config("gpt-tiny"), overrides), log=lambda *_: None)
    return {r["step"]: r["loss"] for r in summary["history"]}


@pytest.fixture(scope="module")
def reference():
    """8 steps in this process on 8 devices, mesh data=2,fsdp=2,tensor=2."""
    return one_process(8)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The same 8 steps as 2 processes x 4 devices, the mesh spanning both, checkpointed at steps 4 and 8."""
    directory = tmp_path_factory.mktemp("two")
    metrics = directory / "m.jsonl"
    done = launch(2, 4, "--mesh", MESH, "--steps", "8", "--checkpoint-dir", str(directory / "ckpt"),
                  "--checkpoint-every", "4", "--metrics-file", str(metrics))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout, logged(metrics), directory / "ckpt"


def test_two_processes_compute_what_one_does(reference, two_processes):
    output, losses, _ = two_processes
    assert "owner process of each mesh position" in output  # the preflight, printed by process 0
    assert sorted(losses) == list(range(1, 9))  # one metrics file, written by process 0 only
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5)


@pytest.mark.parametrize("layout", ["1x8", pytest.param("4x2", marks=pytest.mark.slow)])
def test_a_two_process_checkpoint_resumes_under_other_process_counts(layout, reference, two_processes, tmp_path):
    """Written by 2 processes at step 4, continued to step 8 by 1 process (8 devices) or by 4 processes x 2."""
    directory = tmp_path / "ckpt"
    shutil.copytree(two_processes[2], directory)
    shutil.rmtree(directory / "8")
    if layout == "1x8":
        resumed = one_process(8, directory)
    else:
        metrics = tmp_path / "m.jsonl"
        done = launch(4, 2, "--mesh", MESH, "--steps", "8", "--checkpoint-dir", str(directory),
                      "--metrics-file", str(metrics))  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        resumed = logged(metrics)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5)


@pytest.mark.slow  # two launches and a kill: ~40 s
def test_a_dead_peer_stops_the_job_and_a_rerun_resumes(tmp_path):
    """SIGKILL process 1 of a job under the launcher (no restarts, a grace longer than the bound): the launcher names
    the lost process and how it ended, process 0 stops by itself within 2 minutes, and a rerun resumes from the last
    checkpoint. The survivor cannot always name its peer: between collectives JAX's coordination service misses the
    peer's heartbeats and says so, but inside a collective gloo aborts the process at once (a C++ abort, seen in CI:
    "gloo/transport/tcp/pair.cc ... Received data size doesn't match"), before any Python runs. The launcher, which
    sees every process end, is what names the lost one."""
    directory, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = ["--mesh", "data=8", "--steps", "400", "--checkpoint-dir", str(directory), "--checkpoint-every", "5"]
    args += ["--metrics-file", str(metrics), "--heartbeat-timeout", "10"]
    command = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--devices-per-process"]
    command += ["4", "--grace", "150", "--", *ARGS, *args]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, pids, killed = [], {}, None
    for line in job.stdout:
        lines.append(line)
        if found := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids[int(found.group(1))] = int(found.group(2))
        if line.startswith("[0] step      8") and killed is None:
            os.kill(pids[1], signal.SIGKILL)
            killed = time.time()
    output = "".join(lines)
    assert job.wait(timeout=60) != 0 and killed is not None, output[-3000:]
    assert time.time() - killed < 120, output[-3000:]  # the survivor stopped by itself, not at the grace's end
    assert "[launch] process 1 was killed by SIGKILL (status -9)" in output, output[-3000:]
    saved = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    assert saved >= 5
    # Fewer steps, to finish soon: a change of the schedule's length, so it must be allowed by name.
    rerun = launch(2, 4, *args, "--steps", str(saved + 2), "--allow-config-change", "train.steps")
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"resuming at step {saved}" in rerun.stdout


# A two-process launch, a kill, a heartbeat timeout and a restart: ~60 s. (The same without --elastic, restarting
# 2 processes, passed when it ran here; dropped from the slow set to fit CI's time.)
@pytest.mark.slow
def test_the_launcher_restarts_a_killed_job_by_itself(reference16, tmp_path):
    """kill -9 process 1 of 2 mid-run: `launch_local.py --max-restarts 1 --elastic` restarts the job from its newest
    checkpoint with the 1 process that survived (mesh data=-1 over its 4 devices), and the run finishes by itself
    with the losses of an uninterrupted run."""
    directory, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    command = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--processes", "2", "--devices-per-process"]
    command += ["4", "--max-restarts", "1", "--grace", "5", "--elastic", "--", *ARGS, "--mesh", "data=-1"]
    command += ["--steps", "16", "--checkpoint-dir", str(directory), "--checkpoint-every", "4"]
    command += ["--metrics-file", str(metrics), "--heartbeat-timeout", "10"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, pids = [], {}
    for line in job.stdout:
        lines.append(line)
        if found := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids.setdefault(int(found.group(1)), int(found.group(2)))
        if line.startswith("[0] step      6") and "killed" not in pids:
            os.kill(pids[1], signal.SIGKILL)
            pids["killed"] = True
    assert job.wait(timeout=60) == 0, "".join(lines[-40:])
    output = "".join(lines)
    assert "restart 1 of 1: 1 processes" in output and "resuming at step 4" in output
    losses = logged(metrics)
    assert sorted(losses) == list(range(1, 17))
    for step, loss in losses.items():  # a smaller mesh sums in another order: float32 rounding only
        assert loss == pytest.approx(reference16[step], rel=1e-4)


@pytest.fixture(scope="module")
def reference16():
    """16 steps in this process on 8 devices, mesh data=8."""
    overrides = ["mesh=data=8", "steps=16", "batch_size=8", "seq_len=32", "log_every=1", "eval_every=1000"]
    overrides += ["warmup_steps=1", "learning_rate=0.01", "progress=false"]
    summary = train(apply_overrides(default_config("gpt-tiny"), overrides), log=lambda *_: None)
    return {r["step"]: r["loss"] for r in summary["history"]}


def test_a_process_id_outside_the_job_is_refused_before_joining():
    command = commands(2, 2, free_port(), [*ARGS, "--steps", "1"])[1]
    command[command.index("--process-id") + 1] = "2"
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "process id 2 is not in 0..1 for 2 processes" in done.stderr


def test_a_process_with_the_wrong_count_fails_fast():
    """Process 0 expects 2 processes; one that believes in 3 and says it is the third is turned away at once."""
    port = free_port()
    first = commands(2, 2, port, [*ARGS, "--steps", "1", "--init-timeout", "60"])[0]
    wrong = commands(3, 2, port, [*ARGS, "--steps", "1"])[2]
    coordinator = subprocess.Popen(first, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        start = time.time()
        done = subprocess.run(wrong, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode != 0 and time.time() - start < 30
        assert "joining coordinator 127.0.0.1" in done.stderr  # what it tried, said before JAX's own abort
        assert "Unexpected task registered with task=2" in done.stderr
    finally:
        coordinator.kill()
        coordinator.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_to_every_process_saves_at_one_step(signum, tmp_path):
    """Preemption of a multi-process job: JAX's preemption notifier (not our handler) catches SIGTERM, every process
    agrees on the step to stop after, saves it, and exits with 143. Ctrl-C (SIGINT to each process) is passed on to
    the notifier: the same, with 130."""
    directory, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*ARGS, "--mesh", "data=8", "--steps", "400", "--checkpoint-dir", str(directory)]
    args += ["--checkpoint-every", "1000", "--metrics-file", str(metrics)]
    processes = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for c in commands(2, 4, free_port(), args)
    ]
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    for process in processes:
        process.send_signal(signum)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [p.returncode for p in processes] == [128 + signum] * 2, outputs[0][-2000:]
    saved = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and saved[0] < 400
    assert all(f"stopped by {signal.Signals(signum).name} after step {saved[0]}" in out for out in outputs)
    assert not any("Traceback" in out for out in outputs)


@pytest.mark.slow  # two processes compile and fail; the one-process case is in the default suite
def test_an_unwritable_directory_ends_every_process_with_74_within_30_s(tmp_path):
    """2 processes; the checkpoint directory is read-only once the run holds its lock, so process 0 cannot create
    the first save's step directory while process 1 waits for it in Orbax's barrier: both exit with status 74
    within 30 s of the error, process 1 naming process 0's failure."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / LOCK_NAME).touch()
    directory.chmod(0o555)
    args = [*ARGS, "--mesh", "data=8", "--steps", "8", "--checkpoint-dir", str(directory), "--checkpoint-every", "2"]
    runs = [subprocess.Popen(without_dac_override(c), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, start_new_session=True) for c in commands(2, 4, free_port(), args)]  # fmt: skip
    lines: list[tuple[float, str]] = []
    readers = [threading.Thread(target=lambda r=r: lines.extend((time.monotonic(), x) for x in r.stderr)) for r in runs]
    for reader in readers:
        reader.start()
    try:
        statuses = [run.wait(timeout=180) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    ended = time.monotonic()
    for reader in readers:
        reader.join()
    stderr = "".join(line for _, line in lines)
    assert statuses == [74, 74], stderr[-3000:]
    failed = f"saving checkpoint {directory / '2'} failed (PermissionError: [Errno 13] Permission denied"
    assert f"error: {failed}" in stderr and f"error: process 0: {failed}" in stderr
    reported = min(t for t, line in lines if line.startswith("error:"))
    assert ended - reported <= 30, ended - reported


@pytest.mark.slow  # a two-process launch: ~30 s
def test_a_slowed_process_is_named_as_the_straggler(tmp_path):
    """Synchronous SPMD over 2 processes, process 1 slowed 3x by waiting: process 0's log names process 1."""
    done = launch(2, 4, "--mesh", "data=8", "--steps", "12", "--slow-worker", "1:3")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[0] straggler at step 10: process 1 takes" in done.stdout
