"""Malformed invocations of the command line: each is refused with a non-zero status and one message that names the
offending value, never a traceback, and (in-process cases) before anything compiles. A few need a fresh process:
--simulated-devices (JAX's device count is fixed once set) and the last-resort handler seen through scripts/train.py.
"""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxtrain.placement.shardings
import jaxtrain.training.checkpoint
from jaxtrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--simulated-devices", "8", "--model", "gpt-tiny", "--steps", "2", "--batch-size", "8"]
TRAIN += ["--seq-len", "16", "--no-progress"]
DIGITS = [*TRAIN[:4], "mlp-tiny", *TRAIN[5:]]  # the same with a classifier, for digits CSVs
DIGITS_LINE = ",".join(["0", "5", "16", *["3"] * 61, "7"])  # a valid row: 64 pixels 0..16, then the label


def write_bad_files(d: Path) -> None:
    """Every malformed mesh layout and data file the cases below name, in directory `d`."""
    rows = [DIGITS_LINE] * 40
    table = {
        "badcell.csv": {2: DIGITS_LINE.replace("5", "x", 1)},
        "label99.csv": {3: DIGITS_LINE[:-1] + "99"},
        "ragged.csv": {4: DIGITS_LINE.partition(",")[2]},
        "pixel17.csv": {5: DIGITS_LINE.replace("16", "17", 1)},
    }
    for name, bad in table.items():
        (d / name).write_text("\n".join(bad.get(i, row) for i, row in enumerate(rows)) + "\n")
    (d / "empty.csv").write_text("")
    (d / "fake.csv.gz").write_text("\n".join(rows))  # named .gz, not gzip
    (d / "good.csv.gz").write_bytes(gzip.compress("\n".join(rows).encode()))
    (d / "latin1.txt").write_bytes("Caf\xe9 au lait, cr\xe8me br\xfbl\xe9e. ".encode("latin-1") * 40)
    (d / "datadir").mkdir()
    (d / "dir.csv").mkdir()
    layouts = {
        "syntax.toml": "[axes]\ndata = 8\nfsdp = \n",
        "axes-int.toml": "axes = 8\n",
        "bool-size.toml": "[axes]\ndata = true\nfsdp = 8\n",
        "description.toml": "description = 5\n[axes]\ndata = 8\n",
        "rules-int.toml": "rules = 3\n[axes]\ndata = 8\n",
    }
    for name, text in layouts.items():
        (d / name).write_text(text)
    (d / "latin1.toml").write_bytes("# r\xe9seau\n[axes]\ndata = 8\n".encode("latin-1"))
    (d / "mesh-dir.toml").mkdir()


# (argv with {d} for the files' directory, a substring of the message that names the offending value)
CASES = [
    # Numbers: finite, in range, integers where counts are meant. All are refused as the config is made.
    ([*TRAIN, "optimizer.learning_rate=nan"], "optimizer.learning_rate=nan: expected a finite number >= 0"),
    ([*TRAIN, "optimizer.learning_rate=inf"], "optimizer.learning_rate=inf: expected a finite number >= 0"),
    ([*TRAIN, "learning_rate=-1"], "optimizer.learning_rate=-1.0: expected a finite number >= 0"),
    ([*TRAIN, "weight_decay=nan"], "optimizer.weight_decay=nan"),
    ([*TRAIN, "beta2=1.5"], "optimizer.beta2=1.5: expected a finite number >= 0 and < 1"),
    ([*TRAIN, "min_lr_ratio=-1"], "optimizer.min_lr_ratio=-1.0"),
    ([*TRAIN, "warmup_steps=-3"], "optimizer.warmup_steps=-3"),
    ([*TRAIN, "--seq-len", "0"], "data.seq_len=0: expected an integer >= 1"),
    ([*TRAIN, "--batch-size", "0"], "data.batch_size=0: expected an integer >= 1"),
    ([*TRAIN, "val_fraction=1.5"], "data.val_fraction=1.5"),
    ([*TRAIN, "--steps", "-5"], "train.steps=-5: expected an integer >= 1"),
    ([*TRAIN, "--steps", "0"], "train.steps=0"),
    ([*TRAIN, "--log-every", "0"], "train.log_every=0"),
    ([*TRAIN, "--eval-every", "0"], "train.eval_every=0"),
    ([*TRAIN, "eval_batches=0"], "train.eval_batches=0"),
    ([*TRAIN, "--grad-accum", "0"], "train.grad_accum=0"),
    ([*TRAIN, "--seed", "-1"], "train.seed=-1"),
    ([*TRAIN, "--checkpoint-every", "-1"], "checkpoint.every=-1: expected an integer >= 0 (steps between"),
    ([*TRAIN, "checkpoint.keep=0"], "checkpoint.keep=0"),
    ([*TRAIN, "rollback_after=-1"], "train.rollback_after=-1"),
    ([*TRAIN, "updates.average_every=0"], "updates.average_every=0"),
    ([*TRAIN, "--microbatches", "-1"], "pipeline.microbatches=-1"),
    ([*TRAIN, "allreduce.bucket_mb=0"], "allreduce.bucket_mb=0.0"),
    ([*TRAIN, "allreduce.hubs=0"], "allreduce.hubs=0"),
    ([*TRAIN, "outer_momentum=1.5"], "updates.outer_momentum=1.5"),
    ([*TRAIN, "n_layers=2.5"], "model.n_layers=2.5: expected an integer >= 1 (transformer blocks)."),
    ([*TRAIN, "d_model=0"], "model.d_model=0"),
    ([*TRAIN, "d_model=36"], "d_model=36 must be divisible by n_heads=4 into an even number of channels"),
    ([*TRAIN, "rope_base=0"], "model.rope_base=0.0"),
    # Choices, listed; also those only a pipeline or an explicit gradient sync would read.
    ([*TRAIN, "dtype=banana"], "model.dtype='banana' is not one of float32, bfloat16, float16"),
    ([*TRAIN, "dtype=float8"], "model.dtype='float8' is not one of"),
    ([*TRAIN, "dtype=fp16"], "model.dtype='fp16' is not one of"),
    ([*TRAIN, "--schedule", "zigzag"], "pipeline.schedule='zigzag' is not one of gpipe, 1f1b, interleaved"),
    ([*TRAIN, "pipeline.balance=even"], "pipeline.balance='even' is not one of cost, uniform"),
    ([*TRAIN, "pipeline.stash=everything"], "pipeline.stash='everything' is not one of residuals, inputs"),
    ([*TRAIN, "allreduce.compression=fp8"], "allreduce.compression='fp8' is not one of none, bf16"),
    ([*TRAIN, "checkpoint.on_failure=ignore"], "checkpoint.on_failure='ignore' is not one of stop, continue"),
    # Flags jaxtrain used to ignore.
    ([*TRAIN, "--coordinator-bind", "everywhere"], "coordinator bind address 'everywhere' is not host:port"),
    ([*TRAIN, "--init-timeout", "0"], "--init-timeout: expected an integer >= 1, got '0'"),
    ([*TRAIN, "--heartbeat-timeout", "-5"], "--heartbeat-timeout: expected an integer >= 1, got '-5'"),
    ([*TRAIN, "--num-processes", "0"], "--num-processes: expected an integer >= 1, got '0'"),
    ([*TRAIN, "--coordinator", "10.0.0.5:http", "--num-processes", "2", "--process-id", "1"], "'10.0.0.5:http' is not"),
    (["meshes", "bogus"], "unrecognized arguments: bogus"),
    # Every command that builds a run checks the same way.
    (["comm", *TRAIN[1:], "--batch-size", "0"], "data.batch_size=0: expected an integer >= 1"),
    (["plan", *TRAIN[1:], "--chip", "v5p", "dtype=fp16"], "model.dtype='fp16' is not one of"),
    (["plan", *TRAIN[1:], "--chip", "v5p", "--devices", "0"], "--devices: expected an integer >= 1, got '0'"),
    (["plan", "--model", "gpt-tiny", "--aot-topology", "v5p:0x4x4"], "'v5p:0x4x4' has a dimension of 0"),  # libtpu: SIGFPE
    (
        ["plan", *TRAIN[1:], "--chip", "v5p", "--mesh", "fsdp=-1,tensor=3"],
        "say how many chips to plan for with --devices",
    ),
    # Mesh layouts: the file, and the line and column of a syntax error; tables and sizes of the right type.
    ([*TRAIN, "--mesh", "{d}/syntax.toml"], "syntax.toml' is not valid TOML: Invalid value (at line 3, column 8)"),
    ([*TRAIN, "--mesh", "{d}/axes-int.toml"], "`axes` is an integer 8, but must be a table"),
    ([*TRAIN, "--mesh", "{d}/latin1.toml"], "latin1.toml' is not UTF-8 text: byte 0xe9 on line 1"),
    ([*TRAIN, "--mesh", "{d}/bool-size.toml"], "axis 'data' in axes has size true (a boolean)"),
    ([*TRAIN, "--mesh", "{d}/description.toml"], "`description` is an integer 5, but must be a string"),
    ([*TRAIN, "--mesh", "{d}/rules-int.toml"], "`rules` is an integer 3, but must be a table"),
    ([*TRAIN, "--mesh", "{d}/mesh-dir.toml"], "mesh-dir.toml' is a directory"),
    ([*TRAIN, "--mesh", "data=4,data=8"], "axis 'data' is given twice"),
    # Data files: the file, and the line (and column) of a bad value.
    ([*DIGITS, "--data", "{d}/badcell.csv"], "badcell.csv' line 3, column 2: 'x' is not an integer"),
    ([*DIGITS, "--data", "{d}/label99.csv"], "label99.csv' line 4, column 65: label 99 is not a digit 0..9"),
    ([*DIGITS, "--data", "{d}/ragged.csv"], "ragged.csv' line 5 has 64 values; expected 65"),
    ([*DIGITS, "--data", "{d}/pixel17.csv"], "pixel17.csv' line 6, column 3: pixel value 17 is outside 0..16"),
    ([*DIGITS, "--data", "{d}/empty.csv"], "empty.csv' is empty"),
    ([*DIGITS, "--data", "{d}/fake.csv.gz"], "fake.csv.gz' is not a readable gzip file"),
    ([*DIGITS, "--data", "{d}/dir.csv"], "dir.csv' is a directory"),
    ([*DIGITS, "--data", "{d}/good.csv.gz", "in_features=32"], "the model takes 32 features and 10 classes"),
    ([*DIGITS, "--data", "{d}/good.csv.gz", "n_classes=5"], "the model takes 64 features and 5 classes"),
    ([*TRAIN, "--data", "{d}/datadir"], "datadir' is a directory"),
    ([*TRAIN, "--data", "{d}/latin1.txt"], "latin1.txt' is not UTF-8 text: byte 0xe9 on line 1 (offset 3)"),
    ([*TRAIN, "--checkpoint-dir", "{d}/empty.csv"], "checkpoint.dir={d}/empty.csv is a file, not a directory"),
    ([*TRAIN, "--metrics-file", "{d}/datadir"], "metrics_file={d}/datadir is a directory"),
    ([*TRAIN, "--tensorboard-dir", "{d}/empty.csv"], "tensorboard_dir={d}/empty.csv is a file"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bad")
    write_bad_files(directory)
    return directory


@pytest.fixture
def no_compiling(monkeypatch) -> list:
    """Any step compiled is recorded and refused: bad input must be caught before."""
    compiled = []

    def refuse(*args, **kwargs):
        compiled.append(args)
        raise AssertionError("a step was compiled")

    monkeypatch.setattr(jaxtrain.placement.shardings.Shardings, "compile", refuse)
    return compiled


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`jaxtrain ARGV` in this process: its exit status and everything it printed."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse's errors
        status = stop.code
    except KeyboardInterrupt:  # not handled: say so rather than stop the test session
        status = "KeyboardInterrupt escaped"
    out = capsys.readouterr()
    return status, out.out + out.err


@pytest.mark.parametrize("argv,names", CASES, ids=[" ".join(a[len(TRAIN) :] or a) for a, _ in CASES])
def test_malformed_invocation_is_one_clear_error(argv, names, bad_files, no_compiling, capsys):
    status, printed = run_cli([arg.format(d=bad_files) for arg in argv], capsys)
    assert status != 0, printed
    assert names.format(d=bad_files) in printed
    assert "Traceback" not in printed and not no_compiling


def test_overrides_are_applied_together(capsys, no_compiling):
    status, printed = run_cli([*TRAIN, "n_heads=6", "d_model=48", "--help-config"], capsys)
    assert status == 0, printed
    assert "model.n_heads = 6" in printed and "model.d_model = 48" in printed


@pytest.mark.parametrize("debug", [False, True])
def test_an_unforeseen_error_is_one_line_and_status_1(debug, monkeypatch, capsys):
    def fail(path):
        raise RuntimeError("disk on fire\nsecond line of detail")

    monkeypatch.setattr(jaxtrain.training.checkpoint, "describe_checkpoint", fail)
    status, printed = run_cli(["inspect", "runs/x", *(["--debug"] if debug else [])], capsys)
    assert status == 1
    if debug:
        assert "Traceback" in printed and "error: RuntimeError: disk on fire ...\n" in printed
    else:
        assert printed == "error: RuntimeError: disk on fire ... (rerun with --debug for the traceback)\n"


def test_ctrl_c_outside_training_is_status_130_without_traceback(monkeypatch, capsys):
    def interrupt(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxtrain.training.checkpoint, "describe_checkpoint", interrupt)
    assert run_cli(["inspect", "runs/x"], capsys) == (130, "interrupted\n")


def train_script(*args: str, inject: str = "") -> subprocess.CompletedProcess:
    """scripts/train.py ARGS in a fresh process; `inject`: Python run first (e.g. to plant a fault)."""
    run = f"{inject}\nimport runpy, sys\nsys.argv = ['train.py', *{list(args)!r}]\n"
    run += f"runpy.run_path({str(ROOT / 'scripts' / 'train.py')!r}, run_name='__main__')"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("count", ["0", "-3"])
def test_simulated_device_count_must_be_positive(count):
    result = train_script("--simulated-devices", count, "--model", "gpt-tiny", "--steps", "1")
    assert result.returncode == 2
    assert f"--simulated-devices: expected an integer >= 1, got '{count}'" in result.stderr
    assert "Traceback" not in result.stderr


FAULT = (
    "import jaxtrain.training.loop\n"
    "def fail(*a, **k): raise ZeroDivisionError('planted')\n"
    "jaxtrain.training.loop.train = fail"
)


@pytest.mark.parametrize("debug", [False, True])
def test_train_script_reports_an_unforeseen_error_in_one_line(debug):
    result = train_script("--model", "gpt-tiny", "--steps", "1", *(["--debug"] if debug else []), inject=FAULT)
    assert result.returncode == 1
    if debug:
        assert "Traceback" in result.stderr and "in fail" in result.stderr
        assert result.stderr.endswith("error: ZeroDivisionError: planted\n")
    else:
        assert result.stderr == "error: ZeroDivisionError: planted (rerun with --debug for the traceback)\n"


# The AlphaZero application's flags (scripts/alphazero.py, on the public API), in this process (8 devices): refused
# before self-play compiles. Its own small run's flags, then the one wrong value.
ALPHAZERO = ["--games", "8", "--simulations", "2", "--learner-steps", "1", "--batch-size", "16", "--iterations", "1"]
ALPHAZERO_CASES = [
    ([*ALPHAZERO, "--devices", "16"], "--devices 16: this process has 8 devices; give at most 8"),
    ([*ALPHAZERO, "--capacity", "10"], "--capacity 10 is below --batch-size 16: every batch would repeat positions"),
    ([*ALPHAZERO, "--games", "6", "--mesh", "data=4", "--devices", "4"], "--games 6 does not split over the 4 devices"),
]


@pytest.mark.parametrize("argv,names", ALPHAZERO_CASES, ids=[" ".join(a[len(ALPHAZERO) :]) for a, _ in ALPHAZERO_CASES])
def test_a_malformed_alphazero_run_is_one_clear_error(argv, names, capsys, monkeypatch):
    pytest.importorskip("pgx", reason="self-play needs the rl extra: pip install -e '.[rl]'")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import alphazero

    played = []
    monkeypatch.setattr(alphazero, "_iterate", lambda *args: played.append(args) or pytest.fail("self-play ran"))
    status = alphazero.main(argv)
    printed = capsys.readouterr().err
    assert status == 2 and names in printed and len(printed.splitlines()) == 1 and not played, printed
