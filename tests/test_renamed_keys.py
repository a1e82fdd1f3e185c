"""Keys renamed when TrainConfig was split (`run_config.RENAMED`): an old key in a file or on the command line is
translated with one notice naming the new key; a checkpoint's stored config, and the config.toml a run wrote before
the rename, translate silently, and a run checkpointed by the previous version (tests/data/old_checkpoint, written by
commit f68e069) resumes with the same command and continues with the same losses."""

import dataclasses
import json
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.cli import main
from jaxtrain.run_config import (
    RENAMED,
    RENAMED_VALUES,
    SECTIONS,
    apply_overrides,
    config_from_table,
    default_config,
    load_config,
    renamed_key,
    resolve_key,
)
from jaxtrain.training import run_identity

ROOT = Path(__file__).resolve().parent.parent
OLD = Path(__file__).resolve().parent / "data" / "old_checkpoint"
NOTICE = re.compile(r"^notice: (\S+) is now (\S+) \(translated; write the new name\)$", re.M)


def notices(text: str) -> dict[str, str]:
    found = NOTICE.findall(text)
    assert len(found) == len({old for old, _ in found}), f"an old key was noticed twice: {found}"
    return dict(found)


def test_no_old_key_is_also_a_new_key():
    cfg = default_config("gpt-tiny")
    new_keys = {f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))}
    assert not set(RENAMED) & new_keys
    assert set(RENAMED.values()) <= new_keys
    assert renamed_key("sync") == "updates.policy" and renamed_key("grad_sync") == "allreduce.algorithm"
    assert renamed_key("staleness") is None  # still a field's short name: resolves as it is
    assert renamed_key("steps") is None and renamed_key("train.steps") is None


@pytest.mark.parametrize("model", ["gpt", "llama", "moe", "mlp", "resnet", "recsys", "alphazero"])
def test_new_short_names_are_unique(model):
    cfg = default_config(model)
    for new in RENAMED.values():
        assert ".".join(resolve_key(cfg, new.split(".", 1)[1])) == new


def test_old_keys_in_a_file_load_to_the_new_ones_with_one_notice_each(tmp_path, capsys):
    path = tmp_path / "old.toml"
    path.write_text(
        'model_name = "gpt-tiny"\nsync_every = 3\n[train]\nsteps = 7\ngrad_sync = "parameter_server"\n'
        f'checkpoint_dir = "{tmp_path / "ckpt"}"\nsync = "diloco"\nps_servers = 2\n[engine]\nps_shards = 2\n'
    )
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.allreduce.algorithm, cfg.allreduce.hubs) == (7, "star", 2)
    assert (cfg.updates.policy, cfg.updates.average_every) == ("diloco", 3)
    assert (cfg.checkpoint.dir, cfg.engine.server_shards) == (str(tmp_path / "ckpt"), 2)
    assert notices(capsys.readouterr().err) == {
        "sync_every": "updates.average_every",
        "train.grad_sync": "allreduce.algorithm",
        "train.checkpoint_dir": "checkpoint.dir",
        "train.sync": "updates.policy",
        "train.ps_servers": "allreduce.hubs",
        "engine.ps_shards": "engine.server_shards",
    }


def test_old_keys_on_the_command_line(capsys):
    cfg = apply_overrides(default_config("gpt-tiny"), ["train.grad_sync=ring", "sync_every=3", "grad_sync=fused"])
    assert (cfg.allreduce.algorithm, cfg.updates.average_every) == ("fused", 3)
    assert notices(capsys.readouterr().err) == {
        "train.grad_sync": "allreduce.algorithm",
        "sync_every": "updates.average_every",
        "grad_sync": "allreduce.algorithm",
    }
    assert apply_overrides(cfg, ["grad_sync=parameter_server"]).allreduce.algorithm == "star"


def test_the_command_takes_old_keys(tmp_path, capsys):
    status = main(["train", "--model", "gpt-tiny", f"train.checkpoint_dir={tmp_path}", "--help-config"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert tomllib.loads(out.out)["checkpoint"]["dir"] == str(tmp_path)
    assert notices(out.err) == {"train.checkpoint_dir": "checkpoint.dir"}


def old_table() -> dict:
    """The config.toml the previous version wrote for the fixture's run: every moved key in `[train]`."""
    return tomllib.loads((OLD / "ckpt" / "config.toml").read_text())


def test_a_config_written_before_the_rename_reads_back_silently(capsys):
    table = old_table()
    assert "grad_sync" in table["train"] and "checkpoint" not in table  # the old shape
    cfg = config_from_table(table, "old config.toml")
    assert capsys.readouterr().err == ""
    moved = {
        new: table["train" if old.startswith("train.") else "engine"][old.split(".")[1]] for old, new in RENAMED.items()
    }
    for key, value in moved.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == RENAMED_VALUES.get((key, value), value), key
    assert cfg.train.steps == 6 and cfg.model.n_layers == 1


def test_a_stored_config_before_the_rename_defines_the_same_run():
    """run_identity compares a checkpoint's stored config under the new names: unchanged, nothing differs."""
    table = old_table()
    cfg = config_from_table(table, "old config.toml")
    assert run_identity.differences(table, cfg) == {}
    changed = dataclasses.replace(cfg, updates=dataclasses.replace(cfg.updates, policy="stale"))
    assert run_identity.differences(table, changed) == {"updates.policy": ("synchronous", "stale")}
    allowed = apply_overrides(changed, ["checkpoint.allow_change=train.sync"])
    assert run_identity.allowed_changes(allowed) == {"updates.policy"}


def test_the_docs_list_every_renamed_key():
    text = (ROOT / "docs" / "running.md").read_text()
    for old, new in RENAMED.items():
        assert f"| `{old}` | `{new}` |" in text, f"docs/running.md's renamed-keys table lacks {old} -> {new}"
    for (key, value), new in RENAMED_VALUES.items():
        assert f"| `{key}` = `{value}` | `{new}` |" in text


def test_a_checkpoint_of_the_previous_version_resumes_with_the_same_losses(tmp_path, capsys):
    """The previous version's run stopped after step 4 (its checkpoint and config.toml); the same command, old
    spellings included, resumes it at step 5 and trains steps 5-6 to the losses the uninterrupted old run had."""
    old = json.loads((OLD / "losses.json").read_text())
    directory, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    shutil.copytree(OLD / "ckpt", directory)
    command = [
        "train", "--model", "gpt-tiny", "--mesh", "data=8", "--steps", "6", "--checkpoint-dir", str(directory),
        "--checkpoint-every", "2", "--metrics-file", str(metrics), "--no-progress", "--log-every", "1",
        "data.source=synthetic", "batch_size=8", "seq_len=8", "n_layers=1", "d_model=16", "n_heads=2", "d_ff=32",
        "vocab_size=32", "checkpoint_keep=3", "eval_every=100", "eval_batches=1",
    ]  # fmt: skip
    status = main(command)
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert notices(out.err) == {"checkpoint_keep": "checkpoint.keep"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == [5, 6]  # resumed after the old checkpoint, not started again
    np.testing.assert_allclose([losses[5], losses[6]], [old["losses"]["5"], old["losses"]["6"]], rtol=1e-6)
    assert {row["run"] for row in rows} == {old["run"]}  # the same run continues
