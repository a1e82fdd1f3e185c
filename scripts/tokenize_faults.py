"""kill -9 `jaxtrain tokenize` at random moments, then rerun it: the rerun's directory (shards, manifest, every file)
must equal an uninterrupted run's byte for byte, and no worker may outlive the killed process.

    python scripts/tokenize_faults.py --trials 5 --workers 1 2 > faults.json

Prints one JSON object: each trial (workers, when it was killed, the chunks finished by then, the processes still
running `--orphan-bound` seconds after the kill, whether the rerun equals the reference), and a summary.
Linux only: processes are found through /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

CHUNK_BYTES = 128 * 1024  # small chunks: a few seconds of work is dozens of chunks, so a kill lands mid-run


def tokenize_process(
    tokenizer: Path, inputs: list[Path], out: Path, workers: int, chunk_bytes: int
) -> subprocess.Popen:
    """`tokenize` (jaxtrain.data.shards) in a fresh process, as the command line runs it."""
    code = (
        "import sys\nfrom jaxtrain.data.shards import tokenize\n"
        f"tokenize({str(tokenizer)!r}, {[str(p) for p in inputs]!r}, {str(out)!r}, workers={workers}, "
        f"chunk_bytes={chunk_bytes}, val_fraction=0.1, progress=False)"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...), or None for a process that is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def survivors(pids: list[int], bound: float) -> list[int]:
    """Those of `pids` still running once `bound` seconds have passed (returns as soon as none is)."""
    deadline = time.monotonic() + bound
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def kill_at(process: subprocess.Popen, seconds: float) -> list[int]:
    """kill -9 `process` after `seconds` (or when it ends, if sooner); its children at that moment."""
    try:
        process.wait(seconds)
        return []
    except subprocess.TimeoutExpired:
        pass
    workers = children(process.pid)
    process.kill()
    process.wait()
    return workers


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file of a tokenized directory, by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def make_corpus(root: Path, megabytes: float) -> tuple[Path, list[Path]]:
    """About `megabytes` of Python's standard library, half as text files and half as a JSON-lines file, and a
    2,000-token BPE."""
    from jaxtrain.data.tokenizer import train_bpe

    texts, size = [], 0
    for module in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size >= megabytes * 1e6:
            break
        texts.append(module.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
    (root / "texts").mkdir()
    half = len(texts) // 2
    for i, text in enumerate(texts[:half]):
        (root / "texts" / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[half:])
    (root / "docs.jsonl").write_text(lines, encoding="utf-8")
    tokenizer = root / "tok.json"
    train_bpe(sorted((root / "texts").iterdir())[:10], 2000, tokenizer)
    return tokenizer, [root / "texts", root / "docs.jsonl"]


def finished(process: subprocess.Popen) -> None:
    if process.wait() != 0:
        raise SystemExit(f"tokenize failed: {process.stderr.read().decode()[-2000:]}")


def trial(tokenizer: Path, inputs: list[Path], out: Path, workers: int, at: float, bound: float) -> dict:
    """One kill -9 after `at` seconds, and the rerun."""
    process = tokenize_process(tokenizer, inputs, out, workers, CHUNK_BYTES)
    workers_at_kill = kill_at(process, at)
    done = len(list(out.glob("chunk-*.done"))) if out.is_dir() else 0
    killed = process.returncode == -signal.SIGKILL
    alive = survivors(workers_at_kill, bound)
    for pid in alive:  # do not leave them behind this script either
        os.kill(pid, signal.SIGKILL)
    finished(tokenize_process(tokenizer, inputs, out, workers, CHUNK_BYTES))
    return {
        "workers": workers,
        "killed_at_s": round(at, 2),
        "killed": killed,
        "chunks_done": done,
        "children": len(workers_at_kill),
        "orphans": alive,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="kills per worker count (5)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (1 2)")
    parser.add_argument("--megabytes", type=float, default=12, help="of standard-library source to tokenize (12)")
    parser.add_argument("--orphan-bound", type=float, default=30.0, help="seconds a worker may outlive a kill (30)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        tokenizer, inputs = make_corpus(root, args.megabytes)
        trials = []
        for workers in args.workers:
            start = time.monotonic()
            finished(tokenize_process(tokenizer, inputs, root / f"reference-{workers}", workers, CHUNK_BYTES))
            duration = time.monotonic() - start
            reference = snapshot(root / f"reference-{workers}")
            for k in range(args.trials):
                out = root / f"killed-{workers}-{k}"
                result = trial(tokenizer, inputs, out, workers, rng.uniform(0.2, duration), args.orphan_bound)
                trials.append({**result, "uninterrupted_s": round(duration, 2), "equal": snapshot(out) == reference})
    summary = {
        "trials": len(trials),
        "killed_mid_run": sum(t["killed"] for t in trials),
        "all_equal": all(t["equal"] for t in trials),
        "orphans": sum(len(t["orphans"]) for t in trials),
        "chunks": len([n for n in reference if n.startswith("chunk-")]),
    }
    print(json.dumps({"summary": summary, "trials": trials}, indent=1))


if __name__ == "__main__":
    main()
