"""Where metrics go: a JSON-lines file (one object per logged step), a progress bar, or plain log lines."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class MetricsLog:
    """Appends one JSON object per call to `path` (if given) and shows progress on `stream` (if given)."""

    def __init__(
        self,
        path: str | None,
        total_steps: int,
        progress: bool = True,
        stream: TextIO | None = sys.stderr,
    ):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_line(Path(path))
            self.file = open(path, "a")
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
        if self.bar is not None:
            self.bar.update(step - self.step)
            self.bar.set_postfix_str(_short(record), refresh=True)
        elif self.stream:
            print(f"step {step:>6}  {_short(record)}", file=self.stream, flush=True)
        self.step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
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
