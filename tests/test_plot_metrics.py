"""scripts/plot_metrics.py: runs' metrics files -> one PNG, a line per run and a panel per chosen key, smoothed on
request; clear errors for bad input."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plot_metrics.py"
spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
plot_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_metrics)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, steps: int, decay: float, val_every: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0 * decay**step, "tokens_per_sec": 1000.0 + step, "mfu": 0.01 * step}
        if val_every and step % val_every == 0:
            record["val_loss"] = 5.2 * decay**step
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def test_two_runs_make_one_png(tmp_path, capsys):
    write_run(tmp_path / "fsdp" / "metrics.jsonl", 20, 0.95, val_every=5)
    write_run(tmp_path / "tensor.jsonl", 12, 0.9)
    with open(tmp_path / "tensor.jsonl", "a") as f:
        f.write('{"step": 13, "lo')  # a write in progress: left out, not an error
    out = tmp_path / "plots" / "compare.png"
    assert plot_metrics.main([str(tmp_path / "fsdp"), str(tmp_path / "tensor.jsonl"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape == (400, 1500, 4)  # 3 panels of 5 x 4 inches at 100 dpi
    colours = {tuple(c) for c in np.round(image[..., :3] * 255).astype(int).reshape(-1, 3)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # matplotlib's first two line colours: both runs


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "does not exist"),
        ("", "has no logged steps yet"),
        ('{"step": 1, "loss": 2.0}\nnot json\n', "line 2: not JSON"),
    ],
)
def test_bad_metrics_files_are_clear_errors(tmp_path, capsys, content, message):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert plot_metrics.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_runs_with_the_same_label_need_labels(tmp_path, capsys):
    for run in ("a", "b"):
        write_run(tmp_path / run / "x" / "metrics.jsonl", 3, 0.9)
    runs = [str(tmp_path / r / "x") for r in ("a", "b")]
    assert plot_metrics.main([*runs, "--out", str(tmp_path / "x.png")]) == 2
    assert "use --labels" in capsys.readouterr().err
    assert plot_metrics.main([*runs, "--labels", "a,b", "--out", str(tmp_path / "x.png")]) == 0


def test_any_logged_keys_each_get_a_panel(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0 + s, "learning_rate": 1e-3 * s} for s in range(1, 9)]
    records[3]["val_accuracy"] = 0.5  # a key logged only as its validation counterpart
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "keys.png"
    keys = "grad_norm,learning_rate,loss,accuracy"
    assert plot_metrics.main([str(path), "--keys", keys, "--smooth", "0.6", "--out", str(out)]) == 0
    import matplotlib.image

    assert matplotlib.image.imread(out).shape == (400, 2000, 4)  # 4 panels of 5 x 4 inches


def test_smoothing_is_a_debiased_moving_average():
    assert plot_metrics.smoothed([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert plot_metrics.smoothed([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])
    assert plot_metrics.smoothed([1.0, 5.0], 0.0) == [1.0, 5.0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--keys", "loss,gradnorm"], "no run logged gradnorm; the logged keys are: grad_norm, loss"),
        (["--keys", ","], "names no key"),
        (["--smooth", "1.5"], "must be in [0, 1)"),
    ],
)
def test_bad_keys_and_smoothing_are_clear_errors(tmp_path, capsys, args, message):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0, "grad_norm": 1.0}\n')
    assert plot_metrics.main([str(path), *args, "--out", str(tmp_path / "x.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
