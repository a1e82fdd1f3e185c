"""Run config files: `--config run.toml`, read with the overrides' keys and checks; the `config.toml` every run with a
checkpoint directory writes, which reruns the run; `--help-config`, itself a config file of the run it lists."""

import dataclasses
import json
import os
import tomllib

import pytest
from test_checkpoint import run_train

import jaxtrain.training.loop
from jaxtrain.cli import FLAG_KEYS, main
from jaxtrain.registry import available_models
from jaxtrain.run_config import (
    CONFIG_FILE,
    ConfigError,
    ConfigWriteError,
    apply_overrides,
    default_config,
    describe_config,
    load_config,
    resolve_key,
    write_config,
)

MESH = "data=2,fsdp=2,tensor=2"
TINY = "--model gpt-tiny --batch-size 8 --seq-len 32 --log-every 1 --no-progress".split()


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`jaxtrain ARGV` in this process: its exit status and everything it printed."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse's errors
        status = stop.code
    out = capsys.readouterr()
    return status, out.out + out.err


@pytest.fixture
def no_training(monkeypatch):
    """Fails the test if the command gets as far as training."""

    def refuse(*_, **__):
        raise AssertionError("train() was reached: the bad input was not refused as it was parsed")

    monkeypatch.setattr(jaxtrain.training.loop, "train", refuse)


def test_the_config_a_run_writes_reruns_it_exactly(tmp_path, capsys):
    # The first run is test_checkpoint's: its compiled programs are in the session's compilation cache.
    first, second = tmp_path / "first", tmp_path / "second"
    losses, _ = run_train(MESH, first, extra=[f"metrics_file={tmp_path / 'first.jsonl'}"])
    written = tomllib.loads((first / CONFIG_FILE).read_text())
    assert (written["model_name"], written["mesh"], written["train"]["steps"]) == ("gpt-tiny", MESH, 6)

    rerun = ["train", "--config", str(first / CONFIG_FILE), "--checkpoint-dir", str(second)]
    status, printed = run_cli([*rerun, f"metrics_file={tmp_path / 'second.jsonl'}"], capsys)
    assert status == 0, printed
    rows = [json.loads(line) for line in (tmp_path / "second.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and {row["step"]: row["loss"] for row in rows} == losses  # exactly
    assert {row["run"] for row in rows} == {json.loads(open(tmp_path / "first.jsonl").readline())["run"]}
    again = tomllib.loads((second / CONFIG_FILE).read_text())
    assert (again["checkpoint"].pop("dir"), written["checkpoint"].pop("dir")) == (str(second), str(first))
    assert again["tracking"].pop("metrics_file") != written["tracking"].pop("metrics_file")
    assert again == written
    assert not [p.name for p in first.iterdir() if p.name.endswith(".tmp")]  # the write left no temporary file


@pytest.mark.parametrize("model", available_models())
def test_a_written_config_reads_back_to_the_same_config(model, tmp_path):
    cfg = apply_overrides(default_config(model), [f"checkpoint.dir={tmp_path}", "learning_rate=1", "rules.x=a,b"])
    assert load_config(write_config(cfg)) == cfg  # types as they were: 1.0 a float, tuples tuples


@pytest.mark.parametrize("model", available_models())
def test_help_config_is_a_config_file_of_the_run_it_lists(model, tmp_path):
    cfg = apply_overrides(default_config(model), ["steps=7", "mesh=data=2,tensor=4", "rules.params.embed=fsdp"])
    text = describe_config(cfg)
    (tmp_path / "run.toml").write_text(text)
    assert load_config(tmp_path / "run.toml") == cfg
    assert "train.steps = 7  # default 200" in text  # a value that is not the preset's shows the default
    lines = text.splitlines()
    for key in [*tomllib.loads(text)["train"], *tomllib.loads(text)["model"]]:  # every key, a comment line above it
        line = next(i for i, line in enumerate(lines) if line.split(" = ")[0].endswith(f".{key}"))
        assert lines[line - 1].startswith("# ") and len(lines[line - 1]) > 6, lines[line - 1]


def test_help_config_shows_type_choices_bounds_and_help(capsys):
    status, printed = run_cli(["train", "--model", "gpt-tiny", "--help-config"], capsys)
    assert status == 0, printed
    for shown in [
        '# str: one of float32, bfloat16, float16 · compute dtype; params stay float32\nmodel.dtype = "float32"',
        "# int >= 1 · transformer blocks\nmodel.n_layers = 2",
        "# float >= 0, < 1 · first-moment decay of AdamW, Lion and Muon's AdamW\noptimizer.beta1 = 0.9",
        '# str: one of gpipe, 1f1b, interleaved · pipeline schedule\npipeline.schedule = "1f1b"',
        "# bool · a progress bar, not log lines\ntrain.progress = true",
    ]:
        assert shown in printed


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_precedence_preset_file_flags_overrides(tmp_path):
    path = write(
        tmp_path, 'model_name = "gpt-tiny"\nsteps = 5\nlog_every = 2\n[model]\nd_model = 48\n[train]\nseed = 3\n'
    )
    cfg = load_config(path)
    assert (cfg.model_name, cfg.train.steps, cfg.train.log_every, cfg.model.d_model) == ("gpt-tiny", 5, 2, 48)
    assert cfg.train.seed == 3 and cfg.model.n_layers == default_config("gpt-tiny").model.n_layers
    assert load_config(path, overrides=["train.steps=6", "steps=7"]).train.steps == 7  # flags, then key=value
    # A section's changes from the file and the command line are checked together: 48 % 6 == 0, 64 % 6 != 0.
    assert load_config(path, overrides=["n_heads=6"]).model.n_heads == 6
    assert load_config(path, model="gpt-cpu", overrides=["d_model=64"]).model_name == "gpt-cpu"  # --model wins


def test_the_cli_reads_the_file_under_its_flags(tmp_path, capsys):
    text = 'model_name = "gpt-tiny"\nmesh = "data=8"\n[train]\nsteps = 5\n[pipeline]\nschedule = "gpipe"\n'
    path = write(tmp_path, text)
    status, printed = run_cli(["train", "--config", str(path), "--steps", "6", "--help-config"], capsys)
    assert status == 0, printed
    listed = tomllib.loads(printed)
    assert (listed["model_name"], listed["mesh"], listed["train"]["steps"], listed["pipeline"]["schedule"]) == (
        "gpt-tiny",
        "data=8",
        6,
        "gpipe",
    )


@pytest.mark.parametrize(
    "text,says",
    [
        ("[train]\nstepz = 3\n", ["train.stepz = 3", "Did you mean: train.steps", "train.steps takes int >= 1"]),
        ('[train]\ndtype = "fp16"\n', ["train.dtype = 'fp16'", "Did you mean: model.dtype"]),
        ("n_layer = 3\n", ["unknown config key 'n_layer'", "n_layers"]),
        ("[trian]\nsteps = 3\n", ["unknown table [trian]. Did you mean [train]?"]),
        ('[train]\nsteps = "3"\n', ["train.steps='3': expected an integer >= 1 (optimizer steps of the whole run)"]),
        ("[train]\nsteps = 2.5\n", ["train.steps=2.5: expected an integer >= 1"]),
        ('[train]\nprogress = "no"\n', ["train.progress='no': expected true or false"]),
        ("[optimizer]\nbeta1 = 1.0\n", ["optimizer.beta1=1.0: expected a finite number >= 0 and < 1"]),
        ('[model]\ndtype = "fp16"\n', ["model.dtype='fp16' is not one of float32, bfloat16, float16"]),
        ('[optimizer]\nname = "adam"\n', ["optimizer.name='adam' is not one of adamw, sgd, adafactor, lion, muon"]),
        ('[updates]\npolicy = "async"\n', ["updates.policy='async' is not one of synchronous, local_sgd, diloco"]),
        ('[data]\npartition = "iid"\n', ["data.partition='iid' is not one of uniform, stratified, by_label"]),
        ("mesh = 8\n", ["mesh=8: expected a string"]),
        ("train = 3\n", ["train=3: expected a table ([train])"]),
        ("[rules]\nembed = 3\n", ["rules.embed=3: expected mesh axes"]),
        ("model_name = 3\n", ["model_name=3: expected a model name"]),
        ('model_name = "gpt-tinyy"\n', ["model_name='gpt-tinyy'", "Did you mean tiny?"]),
        ("steps = \n", ["is not valid TOML", "line 1, column 9"]),
    ],
)
def test_a_bad_file_is_refused_as_it_is_read(text, says, tmp_path, capsys, no_training):
    path = write(tmp_path, text)
    model = [] if "model_name" in text else ["--model", "gpt-tiny"]  # --model would win over the file's
    status, printed = run_cli(["train", *model, "--config", str(path)], capsys)
    assert status == 2, printed
    assert f"config file '{path}'" in printed and "Traceback" not in printed
    for fragment in says:
        assert fragment in printed


def test_every_bad_value_of_a_file_is_named_at_once(tmp_path):
    path = write(tmp_path, '[model]\ndtype = "fp16"\nn_layers = 0\n[updates]\npolicy = "x"\n')
    with pytest.raises(
        ConfigError, match=r"model.dtype='fp16' .*; model.n_layers=0: .*; updates.policy='x' is not one"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "override,choices",
    [
        ("dtype=fp16", "model.dtype='fp16' is not one of float32, bfloat16, float16"),
        ("optimizer.name=adam", "optimizer.name='adam' is not one of adamw, sgd, adafactor, lion, muon"),
        ("updates.policy=async", "updates.policy='async' is not one of synchronous, local_sgd, diloco, stale"),
        ("allreduce.algorithm=nccl", "allreduce.algorithm='nccl' is not one of xla, fused, ring, hierarchical, star"),
        ("schedule=zb", "pipeline.schedule='zb' is not one of gpipe, 1f1b, interleaved"),
        ("data.partition=iid", "data.partition='iid' is not one of uniform, stratified, by_label"),
        ("remat=some", "model.remat='some' is not one of none, full, save_dots"),
    ],
)
def test_a_bad_choice_is_refused_as_it_is_parsed_naming_the_choices(override, choices, capsys, no_training):
    status, printed = run_cli(["train", *TINY, override], capsys)
    assert (status, "Traceback" in printed) == (2, False), printed
    assert choices in printed


def test_yaml_is_refused_saying_why(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"run configs are TOML, not YAML \(YAML 1.1 reads 1e-3 as a string"):
        load_config(path)


def test_a_failed_write_keeps_the_previous_config(tmp_path, monkeypatch):
    cfg = apply_overrides(default_config("gpt-tiny"), [f"checkpoint.dir={tmp_path}"])
    write_config(cfg)
    before = (tmp_path / CONFIG_FILE).read_text()

    def disk_full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(ConfigWriteError, match=f"cannot write the run config {tmp_path}/config.toml: No space left"):
        write_config(dataclasses.replace(cfg, mesh="data=8"))
    assert (tmp_path / CONFIG_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_FILE]


def test_every_config_flag_names_a_key():
    cfg = default_config("gpt-tiny")
    assert {".".join(resolve_key(cfg, key)) for key in FLAG_KEYS.values()} == set(FLAG_KEYS.values())
