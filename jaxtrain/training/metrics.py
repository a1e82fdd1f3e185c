"""Where metrics go: a JSON-lines file (one object per logged step), TensorBoard scalars, a Weights & Biases run
(`jaxtrain.training.tracking`), a progress bar or plain log lines, and a callback.

The file holds one row per step of the run's trajectory, in order, each step at most once, and each row names its
run: `"run"`, the fingerprint of the config that defines the trajectory (`run_identity.fingerprint`), the same for a
run and every rerun of it. A run that (re)starts at step n keeps its own rows up to n and drops its own later ones: a
resumed run redoes those steps to the same numbers (also a rerun that never reached its first checkpoint, from step 0),
and after a rollback to a checkpoint their updates were skipped as non-finite and their state discarded; the rollback
stays visible in the rows that follow (`nonfinite_total` counts the skipped updates) and in the log. A consumer (a
plot, a dataframe) can then take the file as a function of the step. A row of another run (another fingerprint, or
none) is never dropped nor mixed with: the run is refused, naming the file. TensorBoard gets the same through its own
mechanisms: event files named by their run, and a purge of the run's events from the step training continues at.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from jaxtrain.errors import UserInputError
from jaxtrain.training.tracking import WandbSink


class MetricsError(UserInputError):
    """A metrics destination that cannot be written."""


def tensorboard_writer_class() -> type:
    """tensorboardX's `SummaryWriter` (an optional dependency, imported only when asked for)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise MetricsError(
            "tracking.tensorboard_dir is set, but tensorboardX is not installed: pip install 'jaxtrain[tensorboard]' "
            "(or pip install tensorboardX), or leave tracking.tensorboard_dir empty."
        ) from None
    return SummaryWriter


# The default progress stream: sys.stderr as it is when a log is made, not when this module was imported (a
# default of sys.stderr itself would keep a stream that tests, or a caller redirecting stderr, have since closed).
STDERR = object()


class MetricsLog:
    """Appends one JSON object per call to `path` (if given), adds each value as a TensorBoard scalar in
    `tensorboard_dir` (if given), shows progress on `stream` (if given) and passes the record to `on_record`.

    `run`: the run's fingerprint, written in every row; `start`: the step training (re)starts after. Rows of `run`
    after `start` are dropped; a row or event file of another run is a `MetricsError` (see the module's doc)."""

    def __init__(
        self,
        path: str | None,
        total_steps: int,
        progress: bool = True,
        stream: TextIO | None | object = STDERR,
        tensorboard_dir: str | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        run: str = "",
        start: int = 0,
        wandb: WandbSink | None = None,
    ):
        self.path = Path(path) if path else None
        self.tensorboard_dir = Path(tensorboard_dir) if tensorboard_dir else None
        self.run = run
        check_outputs(path, tensorboard_dir, run)
        self.file = self.board = None
        self.step = start
        self._open(start)
        self.on_record = on_record
        self.wandb = wandb
        stream = sys.stderr if stream is STDERR else stream
        self.stream = stream
        self.bar = (
            tqdm(total=total_steps, initial=start, file=stream, unit="step", dynamic_ncols=True)
            if progress and stream
            else None
        )

    def _open(self, step: int) -> None:
        """Open the outputs to continue after `step`: the file without this run's rows of later steps, TensorBoard
        purging this run's events of later steps."""
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep_rows_through(self.path, self.run, step)
            self.file = open(self.path, "a")
        if self.tensorboard_dir:
            earlier = any(_event_files(self.tensorboard_dir))
            # A new event file each time, named by the run and uniquely: tensorboardX names them by the second only,
            # and opens them with "wb".
            self.board = tensorboard_writer_class()(
                self.tensorboard_dir,
                purge_step=step + 1 if earlier else None,
                filename_suffix=f".jaxtrain-{self.run}-{time.time_ns()}",
            )

    def rewind(self, step: int) -> None:
        """Training went back to `step` (a rollback): continue the outputs from there, as a run resumed there does."""
        self._close_outputs()
        self._open(step)
        if self.bar is not None:
            self.bar.update(step - self.step)
        self.step = step

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}, "run": self.run}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in metrics.items():  # a non-finite value is drawn as such, not dropped as in the JSON
                self.board.add_scalar(key, float(value), step)
            self.board.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.on_record is not None:
            self.on_record(record)
        if self.bar is not None:
            self.bar.update(step - self.step)
            self.bar.set_postfix_str(_short(record), refresh=True)
        elif self.stream:
            print(f"step {step:>6}  {_short(record)}", file=self.stream, flush=True)
        self.step = step

    def _close_outputs(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.file:
            self.file.close()

    def close(self) -> None:
        """Close every output, each even if closing an earlier one failed: TensorBoard's writer flushes its queue and
        W&B waits for its files (`WandbSink.close`), on every way out of a run."""
        with contextlib.ExitStack() as closing:  # callbacks run last first: the bar, the file and board, W&B
            if self.wandb is not None:
                closing.callback(self.wandb.close)
            closing.callback(self._close_outputs)
            if self.bar is not None:
                closing.callback(self.bar.close)


def check_outputs(path: str | None, tensorboard_dir: str | None, run: str) -> None:
    """Refuse (`MetricsError`) a metrics file or TensorBoard directory holding metrics of a run other than `run`;
    nothing is changed."""
    if path and Path(path).is_dir():
        raise MetricsError(
            f"tracking.metrics_file={path} is a directory: give the path of a file, e.g. {path}/metrics.jsonl."
        )
    if tensorboard_dir and Path(tensorboard_dir).exists() and not Path(tensorboard_dir).is_dir():
        raise MetricsError(f"tracking.tensorboard_dir={tensorboard_dir} is a file: give the path of a directory.")
    others = [record for _, record in _rows(Path(path))] if path and Path(path).is_file() else []
    others = [record for record in others if record.get("run") != run]
    if others:
        names = sorted({str(record.get("run", "unnamed")) for record in others})
        first, last = others[0]["step"], others[-1]["step"]
        rows = f"{len(others)} rows (steps {first}-{last})" if len(others) > 1 else f"a row (step {first})"
        raise MetricsError(
            f"metrics file {path} holds {rows} of another run ({', '.join(names)}; this one is {run}), which this "
            f"run will not mix with nor drop. Give another --metrics-file, or move {path} away."
        )
    foreign = [f for f in _event_files(Path(tensorboard_dir)) if _event_run(f) != run] if tensorboard_dir else []
    if foreign:
        raise MetricsError(
            f"tracking.tensorboard_dir {tensorboard_dir} holds event files of another run ({foreign[0].name}"
            f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}): give another directory, or move them."
        )


def keep_rows_through(path: Path, run: str, step: int) -> None:
    """Rewrite metrics file `path` without `run`'s rows of steps after `step`, and without half a line (what a process
    killed mid-write leaves). The new file replaces the old by a rename: a kill mid-rewrite loses nothing."""
    if not path.is_file():
        return
    data = path.read_bytes()
    rows = _rows(path)
    kept = [line for line, record in rows if record.get("run") != run or record["step"] <= step]
    if len(kept) == len(rows) and (not data or data.endswith(b"\n")):
        return
    partial = path.with_name(f".{path.name}.rewrite")
    partial.write_text("".join(kept))
    os.replace(partial, path)


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The complete lines of metrics file `path` with their records; a line that is no metrics record (a JSON
    object with an integer step) is a `MetricsError`: the file is then not one jaxtrain wrote."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if not line.endswith("\n"):
            break  # half a line: a write cut short
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsError(
                f"metrics file {path}, line {number}, is not a metrics record ({line.strip()[:80]!r}): jaxtrain "
                "appends to its own metrics files only; give tracking.metrics_file (--metrics-file) another path."
            )
        rows.append((line, record))
    return rows


def _event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*")) if directory.is_dir() else []


def _event_run(path: Path) -> str | None:
    """The run an event file was written for (its name ends `.jaxtrain-<run>-<ns>`), None if it names none."""
    tail = path.name.rsplit(".jaxtrain-", 1)
    return tail[1].rsplit("-", 1)[0] if len(tail) == 2 else None


def _plain(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _short(record: dict[str, Any]) -> str:
    parts = []
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("val_loss", "val {:.4f}"),
        ("reward_mean", "reward {:.3f}"),
        ("val_reward_mean", "val reward {:.3f}"),
        ("accuracy", "acc {:.3f}"),
        ("tokens_per_sec", "{:,.0f} tok/s"),
        ("mfu", "MFU {:.1%}"),
    ):
        if record.get(key) is not None:
            parts.append(fmt.format(record[key]))
    return "  ".join(parts)
