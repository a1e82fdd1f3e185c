"""Where metrics go: a JSON-lines file (one object per logged step), TensorBoard scalars, a progress bar or plain
log lines, and a callback."""

from __future__ import annotations

import json
import math
import sys
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
    `tensorboard_dir` (if given), shows progress on `stream` (if given) and passes the record to `on_record`."""

    def __init__(
        self,
        path: str | None,
        total_steps: int,
        progress: bool = True,
        stream: TextIO | None = sys.stderr,
        tensorboard_dir: str | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_line(Path(path))
            self.file = open(path, "a")
        self.board = tensorboard_writer_class()(tensorboard_dir) if tensorboard_dir else None
        self.on_record = on_record
        self.stream = stream
        self.bar = (
            tqdm(total=total_steps, file=stream, unit="step", dynamic_ncols=True) if progress and stream else None
        )
        self.step = 0

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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.file:
            self.file.close()


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write leaves half a line; the resumed run appends after the last whole one."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


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
