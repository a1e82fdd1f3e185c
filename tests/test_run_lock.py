"""One writer per checkpoint directory: a second run is refused at start naming the holder, a lock left by a killed
process of this host is taken over with a warning, one written on another host is not, and a run leaves no lock
behind. (A second writer refused while a real first one trains: tests/test_checkpoint.py's SIGINT test.)"""

import json
import os
import socket
import subprocess

import pytest
from test_checkpoint import config

from jaxtrain.training.loop import train
from jaxtrain.training.run_lock import LOCK_NAME, RunLock, RunLockedError, holding


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_second_writer_is_refused_at_start_naming_the_holder(tmp_path):
    holder = RunLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(RunLockedError) as refused:
            train(config("data=8", tmp_path), log=lambda line: pytest.fail(f"got as far as: {line}"))
        message = str(refused.value)
        assert f"checkpoint directory {tmp_path} is in use" in message
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "another --checkpoint-dir" in message
    finally:
        holder.release()
    assert not (tmp_path / LOCK_NAME).exists()  # released: gone, and the next run takes it
    with holding(str(tmp_path)):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert {"host", "pid", "started", "command"} <= set(record)


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over_with_a_warning(tmp_path):
    left = {"host": socket.gethostname(), "pid": dead_pid(), "started": "2026-12-01T09:00:00+00:00"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(left))
    warnings = []
    with holding(str(tmp_path), warnings.append):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != left["pid"]
    [warning] = warnings
    assert warning.startswith(f"warning: taking over the lock of {tmp_path} from pid {left['pid']} on host")
    assert "ended without releasing it" in warning


def test_a_lock_of_another_host_is_not_taken_over(tmp_path):
    left = json.dumps({"host": "gpu-node-7.example", "pid": 4242, "started": "2026-12-01T09:00:00+00:00"})
    (tmp_path / LOCK_NAME).write_text(left)
    with pytest.raises(RunLockedError) as refused:
        with holding(str(tmp_path)):
            pytest.fail("took the lock")
    message = str(refused.value)
    assert "pid 4242 on host gpu-node-7.example" in message
    assert f"remove {tmp_path / LOCK_NAME} and rerun" in message
    assert (tmp_path / LOCK_NAME).read_text() == left  # untouched


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the run failed"):
        with holding(str(tmp_path)):
            assert (tmp_path / LOCK_NAME).exists()
            raise RuntimeError("the run failed")
    assert not (tmp_path / LOCK_NAME).exists()
    with holding(str(tmp_path), lambda line: pytest.fail(line)):  # taken again, without a warning
        pass
