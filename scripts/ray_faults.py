"""Fault trials of the Ray engine (`jaxtrain train --engine ray`), as docs/asynchronous.md promises them: kill -9 of a
server shard, of a worker and of the driver, and SIGINT and SIGTERM of the driver, each `--trials` times at a random
update (seeded). Prints one JSON object per trial, then a summary:

    kind            what was done to whom
    at_update       the update the driver had logged when it was done
    exit            the driver's exit status (None: it was killed)
    seconds_to_end  from the fault to the driver's end (shard and worker: the run goes on to its last update)
    updates_lost    applied updates not in the newest checkpoint when the run stopped (driver faults), or made again
                    after the shards were restored (a shard); a dead worker loses none, its batch is redone
    orphans         processes the driver started that were still running 30 s after it ended

    python scripts/ray_faults.py --trials 3 --seed 0 > faults.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("server_shard", "worker", "driver_kill", "driver_sigint", "driver_sigterm")
ORPHAN_WINDOW_S = 30.0


def trial(kind: str, at_update: int, steps: int, rng: random.Random, directory: Path) -> dict:
    """One run, one fault at `at_update`; what came of it."""
    args = [sys.executable, str(ROOT / "scripts" / "train.py"), "--model", "gpt-tiny", "--engine", "ray"]
    args += ["--workers", "2", "--ps-shards", "2", "--batch-size", "8", "--seq-len", "32", "--log-every", "1"]
    args += ["--steps", str(steps), "--checkpoint-dir", str(directory), "--checkpoint-every", "20", "--no-progress"]
    args += ["warmup_steps=1", "eval_every=100000"]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    lines, pids = [], {"worker": [], "server_shard": []}
    for line in run.stdout:
        lines.append(line)
        if found := re.match(r"(worker|server shard) \d+: pid (\d+)", line):
            pids[found.group(1).replace(" ", "_")].append(int(found.group(2)))
        if re.match(rf"step\s+{at_update}\b", line):
            break
    started = psutil.Process(run.pid).children(recursive=True)
    fault = time.monotonic()
    if kind in ("server_shard", "worker"):
        os.kill(rng.choice(pids[kind]), signal.SIGKILL)
    else:
        run.send_signal({"driver_kill": signal.SIGKILL, "driver_sigint": signal.SIGINT}.get(kind, signal.SIGTERM))
    lines.extend(run.stdout)
    status = run.wait()
    ended = time.monotonic()
    while (alive := [p for p in started if p.is_running()]) and time.monotonic() - ended < ORPHAN_WINDOW_S:
        time.sleep(0.5)
    output = "".join(lines)
    return {
        "kind": kind,
        "at_update": at_update,
        "exit": None if status == -signal.SIGKILL else status,
        "seconds_to_end": round(ended - fault, 1),
        "updates_lost": updates_lost(kind, output, directory),
        "finished": f"done: steps {steps}" in output,
        "orphans": [f"{p.pid}:{p.name()}" for p in alive],
    }


def updates_lost(kind: str, output: str, directory: Path) -> int:
    logged = [int(step) for step in re.findall(r"^step\s+(\d+)", output, re.M)]
    if kind == "worker":
        return 0
    if kind == "server_shard":
        found = re.search(r"died at update (\d+).*\n(?:.*\n)*?server shards restored at update (\d+)", output)
        return int(found.group(1)) - int(found.group(2)) if found else -1
    saved = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
    return max(logged, default=0) - max(saved, default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="trials of each kind (3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=120, help="updates of each run (120)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    for kind in KINDS:
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory() as directory:
                result = trial(kind, rng.randint(5, args.steps // 2), args.steps, rng, Path(directory) / "ckpt")
            print(json.dumps(result), flush=True)
            results.append(result)
    summary = {
        kind: {
            "exits": [r["exit"] for r in results if r["kind"] == kind],
            "max_seconds_to_end": max(r["seconds_to_end"] for r in results if r["kind"] == kind),
            "updates_lost": [r["updates_lost"] for r in results if r["kind"] == kind],
            "finished": sum(r["finished"] for r in results if r["kind"] == kind),
            "orphans": sum(len(r["orphans"]) for r in results if r["kind"] == kind),
        }
        for kind in KINDS
    }
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
