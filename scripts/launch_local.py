"""Run one training job as N processes on this machine, each with M simulated CPU devices, joined by JAX's
distributed runtime (collectives over gloo): what a pod does across hosts, on a laptop.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \\
        --model gpt-tiny --mesh data=2,fsdp=2,tensor=2 --steps 20

Everything after `--` goes to scripts/train.py in every process. Process i's output lines are prefixed `[i]`. If a
process fails, the others get `--grace` seconds to stop on their own (JAX's heartbeat notices a dead peer), then
are terminated; the exit status is the first failure's.

Automatic restart: with `--max-restarts N` a failed job is started again, up to N times, and resumes from the newest
checkpoint in its `--checkpoint-dir` (required), as a rerun by hand would. With `--elastic` it restarts with the
processes that survived (those that did not fail first), so a mesh with a -1 axis absorbs the smaller device count;
the data order is topology-independent, so the run continues where the checkpoint left it. Bad input (exit 2) and a
stop by signal after saving (128 + N) are not restarted: a rerun would fail the same way, or someone asked to stop.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 --max-restarts 3 --elastic -- \
        --model gpt-tiny --mesh data=-1 --steps 200 --checkpoint-dir runs/x
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxtrain.cli import flag_type  # noqa: E402  (imports no JAX)

TRAIN = Path(__file__).resolve().parent / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(processes: int, devices: int, port: int, train_args: list[str]) -> list[list[str]]:
    """The command of each process: the same training arguments, its own id, one coordinator on localhost."""
    common = [sys.executable, str(TRAIN), "--simulated-devices", str(devices)]
    common += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    return [[*common, "--process-id", str(i), *train_args] for i in range(processes)]


def _relay(index: int, stream, out) -> None:
    for line in stream:
        out.write(f"[{index}] {line}")
        out.flush()


# Exit statuses a restart cannot help: bad input (a rerun fails alike), and stops asked for by a signal after saving.
NOT_RESTARTED = {2, 128 + 2, 128 + 15}


def describe_exit(code: int) -> str:
    """How a process ended, as the job's log names it: a process killed by a signal cannot say so itself, and its
    peers may only see a broken collective (gloo aborts them), so the launcher is the one that can name it."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name} (status {code})"
    return f"exited with status {code}"


def launch(processes: int, devices: int, train_args: list[str], grace: float = 60.0) -> tuple[int, list[int]]:
    """Start every process, relay their output, and return the job's exit status and the processes that failed
    first (on their own, before the others were stopped)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    running = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for cmd in commands(processes, devices, free_port(), train_args)
    ]
    relays = [
        threading.Thread(target=_relay, args=(i, p.stdout, sys.stdout), daemon=True) for i, p in enumerate(running)
    ]
    for relay in relays:
        relay.start()
    for index, process in enumerate(running):
        print(f"[launch] process {index}: pid {process.pid}", flush=True)
    failed_at, first = None, []
    while any(p.poll() is None for p in running):
        failed = [i for i, p in enumerate(running) if p.poll() not in (None, 0)]
        if failed_at is None and failed:
            failed_at, first = time.monotonic(), failed
            ended = describe_exit(running[failed[0]].returncode)
            print(f"[launch] process {failed[0]} {ended}; the others get {grace:.0f} s", flush=True)
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in running:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    for relay in relays:
        relay.join(timeout=5)
    codes = [p.returncode for p in running]
    return next((c for c in codes if c != 0), 0), first


def supervise(
    processes: int, devices: int, train_args: list[str], max_restarts: int, elastic: bool, grace: float
) -> int:
    """Run the job; restart it after a failure up to `max_restarts` times (with only the survivors if `elastic`).
    Returns the last attempt's exit status."""
    for attempt in range(max_restarts + 1):
        status, failed = launch(processes, devices, train_args, grace)
        if status == 0 or status in NOT_RESTARTED or attempt == max_restarts:
            return status
        survivors = processes - len(failed) if elastic else processes
        if survivors < 1:
            return status
        print(f"[launch] restart {attempt + 1} of {max_restarts}: {survivors} processes, from the newest checkpoint",
              flush=True)  # fmt: skip
        processes = survivors
    return status


def check_restartable(max_restarts: int, elastic: bool, train_args: list[str]) -> str | None:
    """Why these restart settings cannot work, or None. A restart resumes from the checkpoint directory that the
    training arguments name (a flag, a key=value, or a --config file that may hold one)."""
    if elastic and not max_restarts:
        return "--elastic changes the process count of a restart: give --max-restarts N too"
    names_checkpoints = any(
        key in arg for arg in train_args for key in ("--checkpoint-dir", "checkpoint.dir=", "--config")
    )
    if max_restarts and not names_checkpoints:
        return (
            f"--max-restarts {max_restarts} restarts from the newest checkpoint, but the training arguments name no "
            "--checkpoint-dir: add one (e.g. -- ... --checkpoint-dir runs/x --checkpoint-every 50)"
        )
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=flag_type(at_least=1), required=True)
    parser.add_argument("--devices-per-process", type=flag_type(at_least=1), required=True)
    parser.add_argument(
        "--grace", type=flag_type(float, at_least=0), default=60.0, help="seconds the others get after a process fails"
    )
    parser.add_argument(
        "--max-restarts", type=flag_type(at_least=0), default=0, help="restart a failed job up to N times (0)"
    )
    parser.add_argument("--elastic", action="store_true", help="restart with the processes that survived")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then scripts/train.py's arguments")
    args = parser.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    problem = check_restartable(args.max_restarts, args.elastic, train_args)
    if problem:
        parser.error(problem)
    return supervise(args.processes, args.devices_per_process, train_args, args.max_restarts, args.elastic, args.grace)


if __name__ == "__main__":
    sys.exit(main())
