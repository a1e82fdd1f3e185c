"""The train command end to end, and its error messages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_train(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_train_command_writes_metrics(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run_train(
        "--simulated-devices",
        "8",
        "--mesh",
        "data=2,fsdp=2,tensor=2",
        "--model",
        "gpt-tiny",
        "--steps",
        "6",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--log-every",
        "1",
        "--eval-every",
        "3",
        "--metrics-file",
        str(metrics),
        "--no-progress",
        "--verbose",
        "n_layers=3",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "tokens_per_sec", "mfu", "grad_norm", "learning_rate"} <= set(r) for r in records)
    assert "val_loss" in records[2] and "val_loss" in records[5]
    out = result.stdout
    assert "Mesh data=2 fsdp=2 tensor=2: 8 cpu devices" in out and "bytes/device" in out
    assert "blocks/w_in" in out and "(3, 64, 256)" in out  # the override reached the model
    assert "compiled step memory per device" in out and "done: steps 6" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["n_layer=3"], "unknown config key 'n_layer'. Did you mean: n_layers, model.n_layers?"),
        (["--mesh", "data=3"], "multiplies to 3 devices, but 8 devices are available"),
        (["--data", "missing.txt"], "data file 'missing.txt' does not exist"),
        (
            "--mesh pipeline=2,data=4 --schedule interleaved --virtual-stages 2 --microbatches 3".split(),
            "pipeline.microbatches must be a multiple of 2 (got 3)",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    result = run_train("--simulated-devices", "8", "--steps", "1", "--no-progress", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_pipeline_flags_reach_the_config():
    result = run_train("--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "8", "--help-config")
    assert result.returncode == 0, result.stderr
    for line in ('pipeline.schedule = "interleaved"', "pipeline.virtual_stages = 2", "pipeline.microbatches = 8"):
        assert line in result.stdout
