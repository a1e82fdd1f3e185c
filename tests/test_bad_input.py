"""Malformed invocations of the command line: each is refused with a non-zero status and one message that names the
offending value, never a traceback, and (in-process cases) before anything compiles. The table covers run configs,
mesh layouts, data files, corpora and token shards, Hugging Face directories, generation requests and the AlphaZero
application's flags. A few need a fresh process:
--simulated-devices (JAX's device count is fixed once set) and the last-resort handler seen through scripts/train.py.
"""

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jaxtrain.placement.shardings
import jaxtrain.training.checkpoint
from jaxtrain.cli import main
from jaxtrain.data.shards import tokenize
from jaxtrain.data.tokenizer import train_bpe
from jaxtrain.interop.exporting import write_hf
from jaxtrain.interop.importing import import_hf, params_shardings
from jaxtrain.run_config import default_config

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
    (
        ["plan", "--model", "gpt-tiny", "--aot-topology", "v5p:0x4x4"],
        "'v5p:0x4x4' has a dimension of 0",
    ),  # libtpu: SIGFPE
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


# Tokenizer training and tokenization: malformed corpora, never an overwrite, a resume of the same inputs only; and
# training on corrupt token shards, refused as they are opened instead of trained to NaN.
TOKENIZE = ["tokenize", "--tokenizer", "{d}/tok.json", "--no-progress", "--out"]
TRAIN_BPE = ["tokenizer", "train", "--vocab-size", "300", "--out"]
CORPUS_TEXT = "def f(x):\n    return x + 1\n\n" * 40


def write_bad_corpora(d) -> None:
    """A tokenizer, and every malformed corpus the cases below name, in directory `d`."""
    for i in range(4):
        (d / f"good{i}.txt").write_text(f"# module {i}\n{CORPUS_TEXT}", encoding="utf-8")
    train_bpe([d / "good0.txt"], 300, d / "tok.json")
    (d / "existing.json").write_text("keep me")
    (d / "binary.txt").write_bytes(b"text, then a byte that is not UTF-8: \xff\x00\x01")
    (d / "empty.txt").write_text("")
    (d / "null.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    (d / "number.jsonl").write_text('{"text": "fine"}\n\n{"text": "fine"}\n{"text": 5}\n')
    (d / "notjson.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), d / "ints.parquet")
    pq.write_table(pa.table({"text": ["a b", "c d", None, "e f"]}), d / "nulls.parquet", row_group_size=2)
    # An interrupted tokenization (no manifest yet) whose input then changed: resuming it would mix two versions.
    (d / "changing.txt").write_text(CORPUS_TEXT, encoding="utf-8")
    tokenize(d / "tok.json", [d / "changing.txt", d / "good1.txt"], d / "resume", val_fraction=0.5, progress=False)
    (d / "resume" / "manifest.json").unlink()
    (d / "changing.txt").write_text(CORPUS_TEXT + "one more line\n", encoding="utf-8")
    write_corrupt_shards(d)


def write_corrupt_shards(d) -> None:
    """Tokenized shards with every third id of one shard overwritten by 60,000 (a uint16 past the 300 tokens):
    `corrupt` with the manifest's checksums, `corrupt-old` as a manifest written before checksums has it."""
    tokenize(d / "tok.json", [d / f"good{i}.txt" for i in range(4)], d / "corrupt", val_fraction=0.5, progress=False)
    shard = d / "corrupt" / "train-00000.tokens.npy"
    tokens = np.load(shard)
    tokens[::3] = 60_000
    np.save(shard, tokens)
    shutil.copytree(d / "corrupt", d / "corrupt-old")
    manifest = json.loads((d / "corrupt-old" / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for record in split["shards"]:
            del record["crc32"]
    (d / "corrupt-old" / "manifest.json").write_text(json.dumps(manifest))


DATA_CASES = [
    # tokenizer train: never overwrites; UTF-8 text with something in it; a vocabulary the trainer can reserve.
    ([*TRAIN_BPE, "{d}/existing.json", "{d}/good0.txt"], "tokenizer '{d}/existing.json' already exists"),
    ([*TRAIN_BPE, "{d}/tok2.json", "{d}/binary.txt"], "'{d}/binary.txt' is not UTF-8 text: byte 0xff on line 1"),
    ([*TRAIN_BPE, "{d}/tok2.json", "{d}/empty.txt"], "'{d}/empty.txt' hold no text to learn from"),
    (
        ["tokenizer", "train", "--vocab-size", "10000000000", "--out", "{d}/tok2.json", "{d}/good0.txt"],
        "--vocab-size 10000000000 is too large",
    ),
    # tokenize: every JSON line's and Parquet row's text is a string, named by line or row when it is not.
    ([*TOKENIZE, "{d}/o1", "{d}/null.jsonl"], "'{d}/null.jsonl' line 2: 'text' is null, not a string"),
    ([*TOKENIZE, "{d}/o2", "{d}/number.jsonl"], "'{d}/number.jsonl' line 4: 'text' is 5, not a string"),
    ([*TOKENIZE, "{d}/o3", "{d}/notjson.jsonl"], "'{d}/notjson.jsonl' line 2: expected a JSON object"),
    ([*TOKENIZE, "{d}/o4", "{d}/ints.parquet"], "'{d}/ints.parquet' column 'text' holds int64, not strings"),
    ([*TOKENIZE, "{d}/o5", "{d}/nulls.parquet"], "'{d}/nulls.parquet' row 2: 'text' is null, not a string"),
    # tokenize: where it writes, what it reads, and a resume of the same inputs only.
    ([*TOKENIZE, "{d}/tok.json", "{d}/good0.txt"], "--out '{d}/tok.json' is a file"),
    ([*TOKENIZE, "{d}/o6", "{d}/empty.txt"], "the inputs '{d}/empty.txt' hold no text"),
    ([*TOKENIZE, "{d}/o7", "{d}", "{d}/good1.txt"], "input '{d}/good1.txt' is given more than once"),
    ([*TOKENIZE, "{d}/o8", "{d}/good1.txt", "{d}/good1.txt"], "input '{d}/good1.txt' is given more than once"),
    (
        [*TOKENIZE, "{d}/resume", "--val-fraction", "0.5", "{d}/changing.txt", "{d}/good1.txt"],
        "input '{d}/changing.txt' changed since the tokenization in '{d}/resume' began",
    ),
    # Training on corrupt shards: refused as they are opened, not trained to NaN.
    ([*TRAIN, "--data", "tokens:{d}/corrupt"], "shard '{d}/corrupt/train-00000.tokens.npy' has CRC-32 "),
    ([*TRAIN, "--data", "tokens:{d}/corrupt-old"], "'{d}/corrupt-old/train-00000.tokens.npy' holds token id 60000"),
]


@pytest.fixture(scope="module")
def bad_corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad-data")
    write_bad_corpora(directory)
    return directory


@pytest.mark.parametrize("argv,names", DATA_CASES, ids=[" ".join(a).replace("{d}/", "") for a, _ in DATA_CASES])
def test_malformed_data_is_one_clear_error(argv, names, bad_corpora, capsys):
    status, printed = run_cli([arg.format(d=bad_corpora) for arg in argv], capsys)
    assert status == 2, printed
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names.format(d=bad_corpora) in errors[0], printed
    assert "Traceback" not in printed


def test_a_refused_tokenizer_train_leaves_the_existing_file_alone(bad_corpora, capsys):
    before = (bad_corpora / "existing.json").read_bytes()
    run_cli([*TRAIN_BPE, str(bad_corpora / "existing.json"), str(bad_corpora / "good0.txt")], capsys)
    assert (bad_corpora / "existing.json").read_bytes() == before
    assert not list(bad_corpora.glob(".*tmp*"))  # nor a temporary beside it


# Hugging Face directories and generation requests: safetensors headers that lie about their data, indexes that point
# outside the model directory, prompts the tokenizer does not know and continuations longer than the model's context.
# The directories are edits of a tiny randomly initialised llama-tiny written by `write_hf` (nothing is downloaded).
WORDS = ["<unk>", "to", "be", "or", "not", "that", "is", "the", "question"]
SHARD_BYTES = 200_000  # llama-tiny's 558 kB of float32 weights in 3 files
EMBED = "model.embed_tokens.weight"  # the first tensor of model.safetensors, bytes 0..65536
NORM = "model.layers.0.input_layernorm.weight"  # the second, bytes 65536..65792: 64 float32
LAST = "model.norm.weight"  # the last, bytes 558080..558336


def tiny_hf_model(directory: Path, max_file_bytes: int = 10**9) -> Path:
    """A randomly initialised llama-tiny as a Hugging Face model directory, with a word-level tokenizer.json (ids
    0-8, `<unk>` for any other word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = default_config("llama-tiny")
    shapes = params_shardings(cfg, "data=1", jax.devices()[:1]).abstract_state["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(np.float32), shapes)
    write_hf(params, cfg.model, directory, max_file_bytes=max_file_bytes)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def read_file(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and data bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_file(path: Path, header: dict | list | bytes, data: bytes, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.unlink()  # a copy's files are links to the original's
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def set_entry(name: str, **fields) -> Callable[[dict, bytes], tuple[dict, bytes]]:
    """An edit that changes fields of tensor `name`'s header entry."""
    return lambda header, data: ({**header, name: {**header[name], **fields}}, data)


# Header edits of model.safetensors: name -> edit(header, data) -> (header or raw header bytes, data).
HEADERS = {
    "truncated": lambda h, d: (h, d[:-128]),  # the last tensor's end offset is past the file
    "overlap": set_entry(NORM, data_offsets=[0, 256]),  # inside the embedding's bytes
    "negative": set_entry(NORM, data_offsets=[-256, 0]),
    "short-range": set_entry(NORM, dtype="F16"),  # 64 float16 are 128 bytes; the range holds 256
    "unknown-dtype": set_entry(NORM, dtype="Q7"),
    "no-dtype": lambda h, d: ({**h, NORM: {k: v for k, v in h[NORM].items() if k != "dtype"}}, d),
    "negative-shape": set_entry(NORM, shape=[-64]),
    "entry-not-object": lambda h, d: ({**h, NORM: 5}, d),
    "header-not-object": lambda h, d: ([1, 2], d),
    "header-not-json": lambda h, d: (b"{not json", d),
    "metadata-not-strings": lambda h, d: ({**h, "__metadata__": {"format": 1}}, d),
    "trailing-bytes": lambda h, d: (h, d + bytes(64)),
}


def edited_headers(base: Path, d: Path) -> None:
    """A copy of `base` under `d` for each header edit, its model.safetensors edited."""
    for name, edit in HEADERS.items():
        copy = d / name
        shutil.copytree(base, copy, copy_function=os.link)
        header, data = edit(*read_file(copy / "model.safetensors"))
        write_file(copy / "model.safetensors", header, data)
    copy = d / "header-past-end"
    shutil.copytree(base, copy, copy_function=os.link)
    write_file(copy / "model.safetensors", *read_file(copy / "model.safetensors"), length=2**62)
    copy = d / "tiny-file"
    shutil.copytree(base, copy, copy_function=os.link)
    (copy / "model.safetensors").unlink()
    (copy / "model.safetensors").write_bytes(b"\x05\x00")


def edited_configs(base: Path, d: Path) -> None:
    """Copies of `base` under `d` whose config.json is not a JSON object."""
    for name, text in {"config-not-json": "{hidden_size: 64", "config-not-object": "[64]"}.items():
        copy = d / name
        shutil.copytree(base, copy, copy_function=os.link)
        (copy / "config.json").unlink()
        (copy / "config.json").write_text(text)


def edited_indexes(sharded: Path, d: Path) -> None:
    """Copies of the sharded model `sharded` under `d` whose index, or a shard, points outside their directory or
    is malformed."""
    index_name = "model.safetensors.index.json"
    index = json.loads((sharded / index_name).read_text())
    second = sorted(set(index["weight_map"].values()))[1]

    def copy_with(name: str, weight_map_value: str | None = None, index_text: str | None = None) -> Path:
        copy = d / name
        shutil.copytree(sharded, copy, copy_function=os.link)
        if weight_map_value is not None:
            mapped = {k: weight_map_value if v == second else v for k, v in index["weight_map"].items()}
            index_text = json.dumps({**index, "weight_map": mapped})
        if index_text is not None:
            (copy / index_name).unlink()
            (copy / index_name).write_text(index_text)
        return copy

    # The shard it names, outside the directory, is a good one: only where it lies is wrong.
    os.link(sharded / second, d / "outside.safetensors")
    copy_with("index-parent", "../outside.safetensors")
    copy_with("index-absolute", str(d / "outside.safetensors"))
    linked = copy_with("index-symlink")
    (linked / second).unlink()
    (linked / second).symlink_to(d / "outside.safetensors")
    copy_with("index-not-json", index_text="{weight_map")
    copy_with("index-no-map", index_text=json.dumps({"metadata": {}}))
    copy_with("index-not-string", index_text=json.dumps({"weight_map": {EMBED: 3}}))
    twice = copy_with("index-twice")  # the embedding in two files: which one holds the model's?
    (twice / "extra.safetensors").write_bytes((sharded / sorted(set(index["weight_map"].values()))[0]).read_bytes())
    mapped = {**index["weight_map"], "extra": "extra.safetensors"}
    (twice / index_name).unlink()
    (twice / index_name).write_text(json.dumps({**index, "weight_map": mapped}))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf-bad")
    base = tiny_hf_model(d / "base")
    edited_headers(base, d)
    edited_configs(base, d)
    edited_indexes(tiny_hf_model(d / "sharded", SHARD_BYTES), d)
    import_hf(base, d / "imported", devices=jax.devices()[:1])
    return d


FILE = "{d}/%s/model.safetensors"
INDEX = "{d}/%s/model.safetensors.index.json"
GENERATE = ["generate", "--restore", "{d}/imported", "--mesh", "data=1"]
# (argv with {d} for the models' directory and {o} for a new output directory, a substring of the message that
# names the offending value)
MODEL_CASES = [
    (["import-hf", "{d}/truncated", "{o}"], FILE % "truncated" + f": tensor {LAST}: data_offsets [558080, 558336] "),
    (["import-hf", "{d}/truncated", "{o}"], "end past the 558208 bytes of data the file holds"),
    (["import-hf", "{d}/overlap", "{o}"], f"tensor {EMBED}: data_offsets [0, 65536] overlap tensor {NORM} at [0, 256]"),
    (["import-hf", "{d}/negative", "{o}"], f"tensor {NORM}: data_offsets [-256, 0]: expected [start, end], "),
    (["import-hf", "{d}/short-range", "{o}"], f"{NORM}: data_offsets [65536, 65792] hold 256 bytes, but F16 x "),
    (["import-hf", "{d}/unknown-dtype", "{o}"], f"tensor {NORM}: dtype 'Q7' is not one of F64, F32, F16, BF16"),
    (["import-hf", "{d}/no-dtype", "{o}"], f"tensor {NORM}: dtype None is not one of F64, F32"),
    (["import-hf", "{d}/negative-shape", "{o}"], f"tensor {NORM}: shape [-64]: expected a list of integers >= 0"),
    (["import-hf", "{d}/entry-not-object", "{o}"], f"tensor {NORM}: header entry 5 is not an object"),
    (["import-hf", "{d}/header-not-object", "{o}"], FILE % "header-not-object" + ": the header is a list, not"),
    (["import-hf", "{d}/header-not-json", "{o}"], FILE % "header-not-json" + ": the header is not JSON ("),
    (["import-hf", "{d}/metadata-not-strings", "{o}"], "__metadata__ {{'format': 1}}: expected strings"),
    (["import-hf", "{d}/trailing-bytes", "{o}"], "64 bytes after the last tensor's data"),
    (["import-hf", "{d}/header-past-end", "{o}"], "header length 4611686018427387904 runs past the end of"),
    (["import-hf", "{d}/tiny-file", "{o}"], FILE % "tiny-file" + ": the file is 2 bytes: too short"),
    (["import-hf", "{d}/config-not-json", "{o}"], "config-not-json/config.json is not JSON (Expecting property name"),
    (["import-hf", "{d}/config-not-object", "{o}"], "config-not-object/config.json holds a JSON list, not an object"),
    (["import-hf", "{d}/index-parent", "{o}"], INDEX % "index-parent" + ": weight_map names '../outside."),
    (["import-hf", "{d}/index-absolute", "{o}"], "{d}/outside.safetensors', which lies outside {d}/index-abs"),
    (["import-hf", "{d}/index-symlink", "{o}"], "a link to {d}/outside.safetensors, which lies outside"),
    (["import-hf", "{d}/index-not-json", "{o}"], INDEX % "index-not-json" + " is not JSON ("),
    (["import-hf", "{d}/index-no-map", "{o}"], INDEX % "index-no-map" + " has no weight_map"),
    (["import-hf", "{d}/index-not-string", "{o}"], f"weight_map['{EMBED}'] is 3, not a file name"),
    (["import-hf", "{d}/index-twice", "{o}"], f"tensor {EMBED} is in both "),
    ([*GENERATE, "--prompt-ids", "1,2,3", "--max-new-tokens", "1000000000"], "max_new_tokens=1000000000 is more"),
    (
        [*GENERATE, "--prompt-ids", "1,2,3", "--max-new-tokens", "1000000000"],
        "than 262141: the model's context is 262144",
    ),
    ([*GENERATE, "--prompt", "xyzzy plugh"], "prompt 1 ('xyzzy plugh') is only unknown tokens (<unk> for 'xyzzy'"),
]


@pytest.mark.parametrize(
    "argv,names", MODEL_CASES, ids=[f"{a[0]} {a[-1] if a[0] == 'generate' else a[1]}" for a, _ in MODEL_CASES]
)
def test_malformed_model_or_request_is_one_clear_error(argv, names, models, no_compiling, capsys, tmp_path):
    status, printed = run_cli([arg.format(d=models, o=tmp_path / "out") for arg in argv], capsys)
    assert status == 2, printed
    assert names.format(d=models) in printed, printed
    assert len(printed.strip().splitlines()) == 1 and "Traceback" not in printed and not no_compiling
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", [*HEADERS, "header-past-end", "tiny-file"])
def test_the_safetensors_library_refuses_every_header_refused_here(name, models):
    """Our rules are the library's (safetensors' `Metadata::validate`): a file it reads, we read, and the reverse."""
    safetensors = pytest.importorskip("safetensors", reason="installed with the hf extra: pip install -e '.[hf]'")
    from jaxtrain.interop.tensor_files import TensorFileError, read_header

    with pytest.raises(TensorFileError):
        read_header(models / name / "model.safetensors")
    with pytest.raises(safetensors.SafetensorError), safetensors.safe_open(models / name / "model.safetensors", "np"):
        pass
    with safetensors.safe_open(models / "base" / "model.safetensors", "np") as reference:
        ours = read_header(models / "base" / "model.safetensors")
        assert sorted(ours) == sorted(reference.keys())
        assert all(list(ours[k].shape) == reference.get_slice(k).get_shape() for k in ours)


def test_a_hugging_face_cache_snapshot_reads_through_its_links_into_blobs(models, tmp_path):
    """The hub's cache keeps each file once under `blobs/` and links a snapshot's files to it: inside the model."""
    from jaxtrain.interop.tensor_files import TensorFiles

    repo = tmp_path / "models--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        os.link(models / "base" / name, repo / "blobs" / name)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", name))
    assert TensorFiles(snapshot).tensors.keys() == TensorFiles(models / "base").tensors.keys()
