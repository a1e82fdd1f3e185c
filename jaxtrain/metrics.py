"""Where metrics go: a JSON-lines file (one object per logged step), TensorBoard scalars, a progress bar or plain
log lines, and a callback.

The file holds one row per step of the run's trajectory, in order, each step at most once. A resumed run drops the
rows after the step it resumes from (it redoes those steps, to the same numbers), and a rollback to a checkpoint drops
the rows after that checkpoint's step: their updates were skipped as non-finite and their state discarded, and the
rollback stays visible in the rows that follow (`nonfinite_total` counts the skipped updates) and in the log. A
consumer (a plot, a dataframe) can then take the file as a function of the step. TensorBoard gets the same through
its own mechanism, a purge of the events from the step training continues at. A new run never writes into a file, or
a TensorBoard directory, that holds another run's metrics: it is refused, naming the file; nothing is deleted.
"""

from __future__ import annotations

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


class MetricsError(UserInputError):
    """A metrics destination that cannot be written."""


def tensorboard_writer_class() -> type:
    """tensorboardX's `SummaryWriter` (an optional dependency, imported only when asked for)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise MetricsError(
            "train.tensorboard_dir is set, but tensorboardX is not installed: pip install 'jaxtrain[tensorboard]' "
            "(or pip install tensorboardX), or leave train.tensorboard_dir empty."
        ) from None
    return SummaryWriter


class MetricsLog:
    """Appends one JSON object per call to `path` (if given), adds each value as a TensorBoard scalar in
    `tensorboard_dir` (if given), shows progress on `stream` (if given) and passes the record to `on_record`.

    `resumed_at`: None for a new run, whose `path` and `tensorboard_dir` must not hold another run's metrics
    (`MetricsError`); for a run resumed at that step, the rows of later steps are dropped (see the module's doc)."""

    def __init__(
        self,
        path: str | None,
        total_steps: int,
        progress: bool = True,
        stream: TextIO | None = sys.stderr,
        tensorboard_dir: str | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        resumed_at: int | None = None,
    ):
        self.path = Path(path) if path else None
        self.tensorboard_dir = tensorboard_dir
        if resumed_at is None:
            check_new_run_outputs(path, tensorboard_dir)
        self.file = self.board = None
        self.step = resumed_at or 0
        self._open(self.step)
        self.on_record = on_record
        self.stream = stream
        self.bar = (
            tqdm(total=total_steps, initial=self.step, file=stream, unit="step", dynamic_ncols=True)
            if progress and stream
            else None
        )

    def _open(self, step: int) -> None:
        """Open the outputs to continue after `step`: the file without the rows of later steps, TensorBoard purging
        their events."""
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep_rows_through(self.path, step)
            self.file = open(self.path, "a")
        if self.tensorboard_dir:
            # A new event file each time, named uniquely: tensorboardX names them by the second and opens with "wb".
            self.board = tensorboard_writer_class()(
                self.tensorboard_dir, purge_step=step + 1 if step else None, filename_suffix=f".{time.time_ns()}"
            )

    def rewind(self, step: int) -> None:
        """Training went back to `step` (a rollback): continue the outputs from there, as a run resumed there does."""
        self._close_outputs()
        self._open(step)
        if self.bar is not None:
            self.bar.update(step - self.step)
        self.step = step

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in metrics.items():  # a non-finite value is drawn as such, not dropped as in the JSON
                self.board.add_scalar(key, float(value), step)
            self.board.flush()
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
        if self.bar is not None:
            self.bar.close()
        self._close_outputs()


def check_new_run_outputs(path: str | None, tensorboard_dir: str | None) -> None:
    """Refuse (`MetricsError`) a metrics file or TensorBoard directory that holds another run's metrics, for a new
    run; nothing is changed."""
    rows = _rows(Path(path)) if path and Path(path).is_file() else []
    if rows:
        steps = f"steps {rows[0][1]['step']}-{rows[-1][1]['step']}" if len(rows) > 1 else f"step {rows[0][1]['step']}"
        raise MetricsError(
            f"metrics file {path} already holds {len(rows)} rows ({steps}) of another run, and this run starts anew "
            "(no checkpoint of its own to resume), so their rows would mix. Give another --metrics-file, or move "
            f"{path} away (delete it if it is not needed: e.g. left by this command, killed before its first "
            "checkpoint)."
        )
    events = sorted(Path(tensorboard_dir).glob("events.out.tfevents.*")) if tensorboard_dir else []
    if events:
        raise MetricsError(
            f"train.tensorboard_dir {tensorboard_dir} already holds event files of another run ({events[0].name}"
            f"{f' and {len(events) - 1} more' if len(events) > 1 else ''}), and this run starts anew: give another "
            "directory, or move those files away."
        )


def keep_rows_through(path: Path, step: int) -> None:
    """Rewrite metrics file `path` with only the rows of steps up to `step`, also dropping half a line (what a
    process killed mid-write leaves). The new file replaces the old by a rename: a kill mid-rewrite loses nothing."""
    if not path.is_file():
        return
    data = path.read_bytes()
    rows = _rows(path)
    kept = [line for line, record in rows if record["step"] <= step]
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
                "appends to its own metrics files only; give train.metrics_file (--metrics-file) another path."
            )
        rows.append((line, record))
    return rows


def _plain(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _short(record: dict[str, Any]) -> str:
    parts = []
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("val_loss", "val {:.4f}"),
        ("accuracy", "acc {:.3f}"),
        ("tokens_per_sec", "{:,.0f} tok/s"),
        ("mfu", "MFU {:.1%}"),
    ):
        if record.get(key) is not None:
            parts.append(fmt.format(record[key]))
    return "  ".join(parts)
