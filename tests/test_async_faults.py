"""The Ray engine under faults (docs/asynchronous.md, "Checkpoints and dead processes"): a killed server shard
restores every shard from the newest checkpoint, SIGINT and SIGTERM save and stop, a run out of replacements exits
with a code a restarting launcher restarts, and a killed driver leaves no Ray process behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtrain.run_config import apply_overrides, default_config

ray = pytest.importorskip("ray", reason="the ray engine needs the async extra: pip install -e '.[async]'")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "progress=false", "eval_every=1000"]


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for the in-process runs: starting Ray costs seconds."""
    from jaxtrain.asynchronous.cluster import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), logging_level="warning")
    yield
    ray.shutdown()


def async_config(*overrides: str):
    return apply_overrides(default_config("gpt-tiny"), [*TINY, "engine.kind=ray", "log_every=1", *overrides])


class Scripted:
    """A run's log and metrics callbacks that kill server shard 1 at update `kill_at`, then, once the shards are
    restored and have gone `then` updates further, send this process `then_signal`."""

    def __init__(self, kill_at: int, then: int | None = None, then_signal: int = signal.SIGINT):
        self.kill_at, self.then, self.then_signal = kill_at, then, then_signal
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self.restored_at: int | None = None

    def log(self, line: str) -> None:
        self.lines.append(line)
        if found := re.match(r"server shard (\d+): pid (\d+)", line):
            self.pids[int(found.group(1))] = int(found.group(2))
        if found := re.match(r"server shards restored at update (\d+)", line):
            self.restored_at = int(found.group(1))

    def on_metrics(self, record: dict) -> None:
        step = record["step"]
        if step == self.kill_at and self.restored_at is None and 1 in self.pids:
            os.kill(self.pids.pop(1), signal.SIGKILL)
        if self.then is not None and self.restored_at is not None and step == self.restored_at + self.then:
            signal.raise_signal(self.then_signal)


@pytest.mark.slow  # two runs, 45 s: the default suite keeps the cheaper test below, which finds the dead shard
def test_a_killed_server_shard_restores_every_shard_and_sigint_saves_what_they_hold(ray_session, tmp_path):
    """kill -9 server shard 1 at update 8 (checkpoints every 5): the driver restores both shards from update 5 and
    goes on; Ctrl-C 3 updates later saves that update and stops (Preempted, exit status 130). The rerun resumes there
    and finishes, and the batch log holds each update once, no batch twice."""
    from jaxtrain.asynchronous.engine import BATCH_LOG, train_async
    from jaxtrain.training.recovery import Preempted

    cfg = async_config("workers=1", "engine.server_shards=2", "steps=20", f"checkpoint.dir={tmp_path}",
                       "checkpoint.every=5")  # fmt: skip
    script = Scripted(kill_at=8, then=3)
    with pytest.raises(Preempted) as stopped:
        train_async(cfg, log=script.log, on_metrics=script.on_metrics)
    output = "\n".join(script.lines)
    assert "server shard 1 died" in output and script.restored_at == 5, output
    assert stopped.value.exit_status == 130 and stopped.value.step == 8
    assert (tmp_path / "8").is_dir(), sorted(p.name for p in tmp_path.iterdir())

    resumed: list[str] = []
    summary = train_async(cfg, log=resumed.append)
    assert any("resuming at update 8" in line for line in resumed), resumed
    assert summary["steps"] == 20
    rows = [json.loads(line) for line in (tmp_path / BATCH_LOG).read_text().splitlines()]
    assert [row["update"] for row in rows] == list(range(1, 21))
    assert len({row["batch"] for row in rows}) == 20


def test_a_killed_server_shard_without_a_checkpoint_dir_stops_the_run_naming_it(ray_session):
    from jaxtrain.asynchronous.engine import ProcessesLost, train_async

    script = Scripted(kill_at=3)
    with pytest.raises(ProcessesLost, match=r"server shard 1 died.*--checkpoint-dir"):
        train_async(async_config("workers=1", "engine.server_shards=2", "steps=400"), script.log, script.on_metrics)


# The command line, in a process of its own: exit statuses, signals to the driver, orphans.


def start_train(tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, str(ROOT / "scripts" / "train.py"), "--model", "gpt-tiny", "--engine", "ray"]
    args += ["--workers", "2", "--batch-size", "8", "--seq-len", "32", "--log-every", "1", "--no-progress"]
    args += ["--steps", "100000", "warmup_steps=1", "eval_every=100000", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def read_until(run: subprocess.Popen, pattern: str, lines: list[str]) -> re.Match:
    """Read the run's output into `lines` until a line matches `pattern`."""
    for line in run.stdout:
        lines.append(line)
        if found := re.match(pattern, line):
            return found
    raise AssertionError("".join(lines[-40:]))


def finish(run: subprocess.Popen, lines: list[str]) -> int:
    lines.extend(run.stdout)
    return run.wait(timeout=120)


@pytest.mark.slow
def test_a_worker_dead_after_the_restart_budget_exits_with_a_code_a_launcher_restarts(tmp_path):
    """engine.worker_restarts=0 and worker 1 killed: one line naming it, exit 75 (not 2, which
    scripts/launch_local.py never restarts)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from launch_local import NOT_RESTARTED

    run = start_train(tmp_path, "engine.worker_restarts=0")
    lines: list[str] = []
    pid = int(read_until(run, r"worker 1: pid (\d+)", lines).group(1))
    read_until(run, r"step\s+3\b", lines)
    os.kill(pid, signal.SIGKILL)
    status = finish(run, lines)
    errors = [line for line in lines if line.startswith("error:")]
    assert status == 75 and status not in NOT_RESTARTED, "".join(lines[-20:])
    assert len(errors) == 1 and "worker 1 died, after 0 replacements" in errors[0], errors


@pytest.mark.slow
def test_sigterm_of_the_driver_saves_and_exits_143(tmp_path):
    run = start_train(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1000")
    lines: list[str] = []
    step = int(read_until(run, r"step\s+(\d+)\b", lines).group(1))
    run.send_signal(signal.SIGTERM)
    status = finish(run, lines)
    output = "".join(lines)
    assert status == 143, output[-3000:]
    saved = int(re.search(r"checkpoint at update (\d+)", output).group(1))
    assert saved >= step and (tmp_path / "ckpt" / str(saved)).is_dir()
    assert f"stopped by SIGTERM after step {saved}" in output and "SIGTERM received" not in output


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path):
    """kill -9 of the driver: within 30 s none of the processes it started (Ray's GCS, raylet, agents, workers and
    shards) is left, as `ps` would list them."""
    run = start_train(tmp_path)
    lines: list[str] = []
    read_until(run, r"step\s+2\b", lines)
    started = psutil.Process(run.pid).children(recursive=True)
    assert len(started) >= 5, started
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while (alive := [p for p in started if p.is_running()]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [(p.pid, p.name()) for p in alive]
