"""Draw training curves from one or several runs' metrics (the JSONL that `tracking.metrics_file` writes) into one PNG:
one panel per logged key against the step (default: loss, tokens/s and MFU), one colour per run; a key's
validation counterpart (`val_loss` for `loss`) is drawn dashed in its panel.

    python scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out runs/compare.png
    python scripts/plot_metrics.py runs/a runs/b --labels "data parallel,fsdp"   # a directory: its metrics.jsonl
    python scripts/plot_metrics.py runs/a --keys loss,grad_norm,learning_rate --smooth 0.9

Needs matplotlib (pip install -e .[plot]).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxtrain.errors import UserInputError  # noqa: E402

DEFAULT_KEYS = ("loss", "tokens_per_sec", "mfu")
# How a known key is shown: (axis label with its unit, scale). Any other logged key is plotted as it is, by name.
UNITS = {
    "loss": ("loss (nats / token)", 1.0),
    "tokens_per_sec": ("tokens / s", 1.0),
    "mfu": ("MFU (%)", 100.0),
    "accuracy": ("accuracy (%)", 100.0),
    "grad_norm": ("gradient norm (L2)", 1.0),
    "learning_rate": ("learning rate", 1.0),
    "step_time_s": ("step time (s)", 1.0),
    "nonfinite_total": ("non-finite updates skipped", 1.0),
}


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
        raise PlotError(
            f"metrics file '{path}' does not exist: pass what tracking.metrics_file (--metrics-file) wrote."
        )
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
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average of `weight` (0: none), debiased at the start."""
    out, average = [], 0.0
    for n, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**n))
    return out


def check_keys(runs: dict[str, list[dict]], keys: list[str]) -> None:
    """Every key must be logged by some run (or have its validation counterpart logged)."""
    logged = {k for records in runs.values() for r in records for k, v in r.items() if isinstance(v, (int, float))}
    missing = [k for k in keys if k not in logged and f"val_{k}" not in logged]
    if missing:
        raise PlotError(
            f"no run logged {', '.join(missing)}; the logged keys are: {', '.join(sorted(logged - {'step'}))}."
        )


def plot(runs: dict[str, list[dict]], out: Path, keys: list[str] = DEFAULT_KEYS, smooth: float = 0.0) -> Path:
    """Draw `runs` (label -> records) into the PNG `out`: a panel per key, smoothed by `smooth` (0 to 1)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install -e .[plot]") from None
    check_keys(runs, list(keys))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for (label, records), colour in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        for ax, key in zip(axes[0], keys):
            name, scale = UNITS.get(key, (key, 1.0))
            for shown, style in ((key, "-"), (f"val_{key}", "--")):
                steps, values = series(records, shown)
                if not steps:
                    continue
                values = [v * scale for v in values]
                suffix = " (validation)" if shown != key else ""
                if smooth:
                    ax.plot(steps, values, color=colour, linestyle=style, alpha=0.25)
                    values = smoothed(values, smooth)
                ax.plot(steps, values, color=colour, linestyle=style, label=f"{label}{suffix}")
            ax.set(xlabel="step", ylabel=name)
    axes[0][0].legend()
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
    parser.add_argument(
        "--keys",
        default=",".join(DEFAULT_KEYS),
        help=f"comma-separated logged keys, a panel each ({','.join(DEFAULT_KEYS)})",
    )
    parser.add_argument("--smooth", type=float, default=0.0, help="exponential smoothing weight in [0, 1) (0: none)")
    args = parser.parse_args(argv)
    try:
        keys = [k.strip() for k in args.keys.split(",") if k.strip()]
        if not keys:
            raise PlotError(f"--keys {args.keys!r} names no key: give logged keys such as loss,grad_norm.")
        if not 0 <= args.smooth < 1:
            raise PlotError(f"--smooth {args.smooth}: the weight must be in [0, 1), e.g. 0.9 (0: no smoothing).")
        files = [metrics_file(r) for r in args.runs]
        labels = args.labels.split(",") if args.labels else [_label(f) for f in files]
        if len(set(labels)) != len(files):
            raise PlotError(f"{len(files)} runs need {len(files)} different labels, not {labels}: use --labels.")
        out = plot({label: read_metrics(f) for label, f in zip(labels, files)}, Path(args.out), keys, args.smooth)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _label(path: Path) -> str:
    return path.parent.name if path.name == "metrics.jsonl" else path.stem


if __name__ == "__main__":
    sys.exit(main())
