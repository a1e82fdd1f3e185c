"""Draw training curves from one or several runs' metrics (the JSONL that `train.metrics_file` writes) into one PNG:
loss (dashed: validation loss), tokens/s and MFU against the step, one colour per run.

    python scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out runs/compare.png
    python scripts/plot_metrics.py runs/a runs/b --labels "data parallel,fsdp"   # a directory: its metrics.jsonl

Needs matplotlib (pip install -e .[plot]).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxtrain.errors import UserInputError  # noqa: E402

PANELS = (  # (metric, axis label, scale): one panel each; val_loss shares the loss panel
    ("loss", "loss", 1.0),
    ("tokens_per_sec", "tokens / s", 1.0),
    ("mfu", "MFU (%)", 100.0),
)


class PlotError(UserInputError):
    """A metrics file that is missing, empty or not JSON lines."""


def metrics_file(path: str | Path) -> Path:
    """`path` itself, or for a run directory the `metrics.jsonl` (else the one *.jsonl) inside it."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "metrics.jsonl"] if (path / "metrics.jsonl").is_file() else sorted(path.glob("*.jsonl"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "none"
            raise PlotError(f"run directory '{path}' should hold one metrics .jsonl file (found: {found}); name it.")
        path = candidates[0]
    if not path.is_file():
        raise PlotError(f"metrics file '{path}' does not exist: pass what train.metrics_file (--metrics-file) wrote.")
    return path


def read_metrics(path: Path) -> list[dict]:
    """One record per logged step. A last line without its newline is a write in progress and is left out."""
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise PlotError(f"{path}, line {number}: not JSON ({err.msg}); is this a metrics .jsonl file?") from None
    if not any("step" in r for r in records):
        raise PlotError(f"metrics file '{path}' has no logged steps yet (it is empty or holds no 'step' records).")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`, over the records that hold a finite value (null marks a non-finite one)."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(runs: dict[str, list[dict]], out: Path) -> Path:
    """Draw `runs` (label -> records) into the PNG `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install -e .[plot]") from None
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for (label, records), colour in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        for ax, (key, name, scale) in zip(axes, PANELS):
            steps, values = series(records, key)
            ax.plot(steps, [v * scale for v in values], color=colour, label=label)
            ax.set(xlabel="step", ylabel=name)
        steps, values = series(records, "val_loss")
        if steps:
            axes[0].plot(steps, values, color=colour, linestyle="--", marker=".", label=f"{label} (validation)")
    axes[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="metrics .jsonl files or run directories")
    parser.add_argument("--labels", help="comma-separated, one per run (default: each file's directory or name)")
    parser.add_argument("--out", default="metrics.png", help="the PNG to write (default: metrics.png)")
    args = parser.parse_args(argv)
    try:
        files = [metrics_file(r) for r in args.runs]
        labels = args.labels.split(",") if args.labels else [_label(f) for f in files]
        if len(set(labels)) != len(files):
            raise PlotError(f"{len(files)} runs need {len(files)} different labels, not {labels}: use --labels.")
        out = plot({label: read_metrics(f) for label, f in zip(labels, files)}, Path(args.out))
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _label(path: Path) -> str:
    return path.parent.name if path.name == "metrics.jsonl" else path.stem


if __name__ == "__main__":
    sys.exit(main())
