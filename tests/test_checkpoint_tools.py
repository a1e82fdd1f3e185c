"""Params-only exports restore onto any mesh and read no optimizer state; `describe_checkpoint` (`jaxtrain inspect`)
reports steps, arrays and totals from metadata alone; bad paths are clear errors on the command line too."""

import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts
from test_checkpoint import config, run_train

from jaxtrain.cli import main
from jaxtrain.training.checkpoint import (
    CheckpointError,
    describe_checkpoint,
    export_params,
    is_params_export,
    restore_params,
)
from jaxtrain.training.setup import build

MESH = "data=2,fsdp=2,tensor=2"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of gpt-tiny on data=2,fsdp=2,tensor=2, checkpointed at step 2; the run directory and final state."""
    directory = tmp_path_factory.mktemp("run") / "ckpt"
    _, state = run_train(MESH, directory, extra=["steps=2"])
    return directory, jax.device_get(state)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "params-2"
    assert export_params(trained[0] / "2", out) == out
    return out


def abstract_params(mesh, devices, extra=()):
    run = build(config(mesh, "unused", extra), log=lambda *_: None, devices=jax.devices()[:devices])
    return run.shardings.abstract_model_state()["params"]


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bytes_read() -> int:
    """Bytes tensorstore has read from local files so far in this process."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v["value"] for m in metrics for v in m["values"])


@pytest.mark.parametrize("mesh,devices", [("single", 1), ("fsdp=4", 4)])
def test_params_restore_onto_another_mesh_from_an_export_or_a_checkpoint(mesh, devices, trained, exported):
    directory, final = trained
    target = abstract_params(mesh, devices)
    for source in (exported, directory / "2"):
        params, meta = restore_params(source, target)
        assert meta["step"] == 2 and meta["config"]["mesh"] == MESH
        for got, want in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(final["params"])):
            np.testing.assert_array_equal(got, want)
        assert {d for x in jax.tree.leaves(params) for d in x.devices()} == set(jax.devices()[:devices])
    assert restore_params(exported, target)[1]["kind"] == "params"


def test_export_holds_and_reads_only_the_params(trained, tmp_path):
    step_dir, out = trained[0] / "2", tmp_path / "export"
    before = bytes_read()
    export_params(step_dir, out)
    read = bytes_read() - before
    state_data = disk_bytes(step_dir / "state")
    # The params are a third of the state (Adam keeps two moments per parameter): reading the optimizer state too
    # would read about all of it.
    assert read < state_data / 2, (read, state_data)
    assert is_params_export(out) and not is_params_export(step_dir)
    assert disk_bytes(out) < disk_bytes(step_dir) / 2
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # Orbax's temporary directory was renamed into place
    assert "optimizer state" not in describe_checkpoint(out)


def test_inspect_lists_steps_arrays_and_totals(trained, exported, tmp_path):
    directory, final = trained
    run_dir = tmp_path / "ckpt"
    shutil.copytree(directory, run_dir)
    shutil.copytree(run_dir / "2", run_dir / "4.orbax-checkpoint-tmp-1764492000")  # a save cut short
    report = describe_checkpoint(run_dir)
    assert "complete steps: 2\n" in report
    assert "interrupted saves (incomplete, never restored): 4.orbax-checkpoint-tmp-1764492000" in report
    assert f"training checkpoint {run_dir / '2'}: step 2, model gpt-tiny, trained on mesh {MESH}" in report
    assert_lists_arrays(report, final["params"], "params")
    assert_lists_arrays(report, final["opt_state"], "opt_state")
    assert_total(report, "params", final["params"], "parameters")
    assert_total(report, "optimizer state", final["opt_state"], "values")

    report = describe_checkpoint(exported)
    assert f"params export {exported}: step 2, model gpt-tiny, trained on mesh {MESH}" in report
    assert_lists_arrays(report, final["params"], "params")
    assert_total(report, "params", final["params"], "parameters")


def assert_lists_arrays(report: str, tree, prefix: str) -> None:
    rows = {tuple(line.split()) for line in report.splitlines()}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = f"{prefix}/{jax.tree_util.keystr(path, simple=True, separator='/')}"
        assert (name, *str(x.shape).split(), str(x.dtype), f"{x.nbytes:,}") in rows, name


def assert_total(report: str, label: str, tree, noun: str) -> None:
    leaves = jax.tree.leaves(tree)
    values, nbytes = sum(x.size for x in leaves), sum(x.nbytes for x in leaves)
    assert f"{label}: {len(leaves)} arrays, {values:,} {noun}, {nbytes:,} bytes" in report


def test_inspect_reads_no_array_data(trained, tmp_path):
    step_dir = tmp_path / "2"
    shutil.copytree(trained[0] / "2", step_dir)
    before = disk_bytes(step_dir / "state")
    for data in step_dir.glob("state/ocdbt.process_*/d/*"):  # the array data; Orbax's index and headers stay
        data.write_bytes(b"")
    assert disk_bytes(step_dir / "state") < before / 10  # the arrays are gone ...
    intact, damaged = describe_checkpoint(trained[0] / "2"), describe_checkpoint(step_dir)
    assert intact.splitlines()[1:-1] == damaged.splitlines()[1:-1]  # ... yet the report is the same


def test_bad_paths_are_clear_errors(trained, exported, tmp_path):
    directory = trained[0]
    with pytest.raises(CheckpointError, match=f"{exported} already exists: an export never overwrites"):
        export_params(directory / "2", exported)
    with pytest.raises(CheckpointError, match=f"no checkpoint at {tmp_path}: expected a step directory"):
        export_params(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match=f"is a run directory: give one of its steps, e.g. {directory / '2'}"):
        export_params(directory, tmp_path / "out")
    with pytest.raises(CheckpointError, match=f"no checkpoint at {tmp_path}: expected a run directory"):
        describe_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="expected a params export .* or a step directory"):
        restore_params(tmp_path / "nowhere", abstract_params(MESH, 8))
    mismatch = "does not match the model: params/blocks/attn_norm is \\(2, 64\\) there, \\(2, 32\\) here"
    with pytest.raises(CheckpointError, match=mismatch):
        restore_params(exported, abstract_params(MESH, 8, ["d_model=32"]))


def test_inspect_and_export_commands(trained, tmp_path, capsys):
    directory = trained[0]
    assert main(["inspect", str(directory)]) == 0
    assert "complete steps: 2" in capsys.readouterr().out
    out = tmp_path / "export"
    assert main(["export", str(directory / "2"), str(out)]) == 0
    assert is_params_export(out) and f"to {out}" in capsys.readouterr().out
    assert main(["export", str(directory / "2"), str(out)]) == 2
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert f"error: {out} already exists" in err and f"error: no checkpoint at {tmp_path / 'nowhere'}" in err
    assert "Traceback" not in err


def test_fine_tuning_starts_from_an_export_with_a_new_optimizer(exported, tmp_path):
    """`--restore EXPORT`: step 1 on another mesh trains the exported params, at step 0 with fresh Adam moments."""
    extra = ["steps=1", f"restore={exported}"]
    losses, state = run_train("fsdp=4", tmp_path / "fine-tune", devices=4, extra=extra)
    run = build(config("fsdp=4", tmp_path / "unused", extra), log=lambda *_: None, devices=jax.devices()[:4])
    params, _ = restore_params(exported, run.shardings.abstract_model_state()["params"])
    first_loss = run.compiled_eval(params, run.batch("train", 0))["loss"]
    assert losses[1] == pytest.approx(float(first_loss), rel=1e-6)
    counts = [int(count) for _, count in optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")]
    assert int(state["step"]) == 1 and counts and set(counts) == {1}


def test_fine_tuning_from_the_command_line_builds_the_model_the_export_stores(exported, capsys):
    """`jaxtrain train --restore EXPORT` without --model: gpt-tiny, as exported (the default gpt could not restore
    it: its shapes differ)."""
    args = ["train", "--restore", str(exported), "--steps", "1", "--mesh", "fsdp=8", "--batch-size", "8"]
    assert main([*args, "--seq-len", "32", "--no-progress", "eval_every=1000"]) == 0
    assert "params: 131,392 " in capsys.readouterr().out  # gpt-tiny's count
