"""`jaxtrain plan --search` (jaxtrain/planner/search.py): the meshes it enumerates are every valid one and only
those; what it keeps fits and is ranked by the estimate; the files it writes load back to the same layout; a chip
count no mesh fills, a batch no mesh splits and a model that fits nowhere are each one line naming the value."""

import dataclasses

import jax
import pytest
from helpers import aot_target

from jaxtrain.analysis.chips import chip
from jaxtrain.cli import main
from jaxtrain.errors import UserInputError
from jaxtrain.planner.estimate import estimate
from jaxtrain.planner.measure import Measured
from jaxtrain.planner.search import (
    BatchSplitError,
    FitsNowhereError,
    NoMeshError,
    check_best,
    enumerate_meshes,
    format_search,
    model_splits,
    search,
    sizes_of,
    write_mesh,
    write_run_config,
)
from jaxtrain.run_config import apply_overrides, default_config, load_config
from jaxtrain.sharding.mesh import MESH_AXES, build_mesh, load_layout_file, parse_layout

TINY = ["batch_size=8", "seq_len=32"]
PLAN = ["plan", "--search", "--model", "gpt-tiny", "--chip", "v5p", "--batch-size", "8", "--seq-len", "32"]


def _names(model: str, devices: int, overrides=()) -> set[str]:
    splits = model_splits(apply_overrides(default_config(model), [*TINY, *overrides]))
    return {m.name for m in enumerate_meshes(splits, devices)}


def test_enumeration_is_every_valid_mesh_and_only_those():
    # gpt-tiny: 4 heads (and kv heads), mlp 256, vocab 256, embed 64, 2 layers, seq 32, 8 rows. Every split of 4
    # chips over data, pipeline, fsdp, context and tensor but pipeline=4 (4 stages of 2 layers); no expert axis.
    singles = {"data=4", "fsdp=4", "context=4", "tensor=4"}
    axes = ["data", "pipeline", "fsdp", "context", "tensor"]
    pairs = {f"{a}=2,{b}=2" for i, a in enumerate(axes) for b in axes[i + 1 :]}
    assert _names("gpt-tiny", 4) == singles | pairs
    # Grouped-query attention: tensor divides the 2 kv heads of llama-tiny too, so tensor=4 is out.
    assert _names("llama-tiny", 4) == (singles | pairs) - {"tensor=4"}
    # A batch of 2 rows: the batch axes split it at most 2 ways.
    assert _names("gpt-tiny", 4, ["batch_size=2"]) == {
        n for n in singles | pairs if n not in ("data=4", "fsdp=4", "data=2,fsdp=2")
    }
    # The expert axis only for a mixture of experts (moe-tiny: 8 experts).
    assert any("expert" in n for n in _names("moe-tiny", 4)) and not any("expert" in n for n in _names("gpt-tiny", 8))


def test_gpus_across_hosts_put_the_first_axis_they_divide_across_them():
    splits = model_splits(apply_overrides(default_config("gpt-tiny"), ["batch_size=64", "seq_len=32"]))
    meshes = enumerate_meshes(splits, 16, hosts=2)
    assert meshes
    for mesh in meshes:
        (slow, hosts), sizes = *mesh.dcn_axes.items(), sizes_of(mesh)
        before = list(MESH_AXES[: MESH_AXES.index(slow)])
        assert hosts == 2 and sizes[slow] % 2 == 0 and all(sizes[a] % 2 for a in before if sizes[a] > 1), mesh
    assert next(m for m in meshes if m.name == "data=2,fsdp=8").axes == {"fsdp": 8}


# A v5p of 9.2 MiB: gpt-tiny's state fits, and on 2 devices fsdp=2 fits as it is (8.0 MiB at batch 8 of 32 tokens)
# where data=2 and tensor=2 (8.6 MiB) do not, so the search tries remat and accumulation on the faster of those. Its
# layers replicated (rules.layers=): no pipeline axis, so the search is a few estimates (about 7 s on 2 busy cores).
SMALL = dataclasses.replace(chip("v5p"), name="v5p-9MiB", hbm_bytes=9.2 * 2**20)


@pytest.fixture(scope="module")
def found():
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, "rules.layers="])
    return search(cfg, SMALL, 2, keep=2)


def test_search_keeps_only_what_fits_ranked_by_the_estimate(found):
    assert len(found.ranked) >= 2 and all(est.fits for _, est in found.ranked)
    times = [est.step_s[1] for _, est in found.ranked]
    assert times == sorted(times)
    assert found.counts["fit"] < found.counts["estimates"]  # some did not fit and were dropped
    settings = [dict(o.split("=") for o in c.overrides) for c, _ in found.ranked]
    assert any(s["remat"] != "none" or s["grad_accum"] != "1" for s in settings)  # saved memory to fit
    candidate, est = found.ranked[-1]  # a row is the estimate of its own layout and settings
    again = estimate(apply_overrides(found.cfg, candidate.overrides), SMALL, 2, candidate.mesh)
    assert again.step_s == est.step_s and again.memory.peak == est.memory.peak


def test_written_mesh_and_config_load_back_to_the_same_layout(found, tmp_path):
    rank = 0
    candidate, est = found.ranked[rank]
    mesh_file = write_mesh(tmp_path / "mesh.toml", found, rank)
    config_file = write_run_config(tmp_path / "run.toml", found, rank, mesh_file)
    layout = load_layout_file(mesh_file)
    assert layout.axes == dict(candidate.mesh.axes) and "plan --search" in layout.description
    cfg = load_config(config_file)
    assert cfg.mesh == str(mesh_file)
    assert dataclasses.replace(cfg, mesh="") == dataclasses.replace(found.config(rank), mesh="")  # the same run
    mesh = build_mesh(parse_layout(cfg.mesh), jax.devices()[:2])
    assert {a: n for a, n in mesh.shape.items() if n > 1} == dict(candidate.mesh.axes)
    again = estimate(cfg, SMALL, 2)
    assert again.memory.peak == est.memory.peak and again.step_s == est.step_s
    with pytest.raises(UserInputError, match="exists"):
        write_mesh(mesh_file, found, rank)


def test_the_best_that_compiles_and_fits_is_chosen(found):
    tried = dataclasses.replace(found, measured={}, check_lines=[], chosen=None)
    answers = iter([None, 2**20, 2**20])  # the best refused (as XLA:TPU refuses a program over the HBM), then 1 MiB

    def check(cfg, est):
        peak = next(answers)
        if peak is None:
            return None, ["refused"]
        return Measured("tpu", peak, 0.0, 0.0, 0.0, 0.0, {}, 1.0, False), [f"compiled {cfg.mesh}"]

    check_best(tried, check, limit=3)
    assert tried.chosen == 1 and tried.measured[0] == "refused" and 2 not in tried.measured
    assert tried.check_lines == [f"compiled {tried.ranked[1][0].mesh.name}"]
    assert "<- chosen" in format_search(tried).splitlines()[4]


@pytest.mark.parametrize(
    "argv,error,names",
    [
        (["--devices", "11"], "no mesh of gpt-tiny fills 11 chips", ["batch 8 rows", "heads 4"]),
        (["--devices", "7"], "batch size 8 splits evenly over no mesh", ["7 chips", "e.g. 14"]),
    ],
)
def test_bad_counts_and_batches_are_one_line(argv, error, names, capsys):
    assert main([*PLAN, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and error in err[0], err
    assert all(n in err[0] for n in names), err


def test_a_model_that_fits_nowhere_says_by_how_much_and_what_would(capsys):
    # Llama 3.1 8B on 8 v5e (16 GiB): its params, AdamW state and gradients alone are 16 bytes a parameter.
    argv = ["plan", "--search", "--model", "llama-8b", "--chip", "v5e", "--devices", "8", "--seq-len", "128"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama-8b fits no layout of 8 x v5e" in err[0], err
    assert "over the 14.4 GiB usable" in err[0] and "more chips (at least 2x: 16)" in err[0]
    assert "offloading the optimizer state" in err[0] and "smaller batch" in err[0]


def test_estimated_layouts_that_fit_nowhere_say_the_smallest_peak():
    # gpt-tiny's state (2.0 MiB) passes the cheap bound for 2.2 MiB usable; its activations then fit no setting.
    cfg = apply_overrides(default_config("gpt-tiny"), ["batch_size=2", "seq_len=32", "rules.layers="])
    tiny = dataclasses.replace(chip("v5p"), name="v5p-2.5MiB", hbm_bytes=2.5 * 2**20)
    with pytest.raises(FitsNowhereError) as refused:
        search(cfg, tiny, 1)
    message = str(refused.value)
    assert "fits no layout of 1 x v5p-2.5MiB: the smallest peak" in message and "\n" not in message
    assert "over the 2.2 MiB usable" in message and "more chips" in message
    assert "offloading the optimizer state" in message and "none down to batch 1 fits there" in message


def test_cli_searches_simulated_devices_and_writes_its_files(tmp_path, capsys):
    # Without --chip, the simulated CPU devices plan as this CPU shared between them (--no-check: the compile of
    # the best is the slow test's, on a TPU target; `check_best`'s choice is tested above).
    mesh, config = tmp_path / "mesh.toml", tmp_path / "run.toml"
    argv = ["plan", "--search", "--model", "gpt-tiny", "--devices", "2", "--batch-size", "8", "--seq-len", "32"]
    argv += ["rules.layers=", "--no-check", "--write-mesh", str(mesh), "--write-config", str(config)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 2 x cpu" in out and "<- chosen" in out and "check: skipped (--no-check)" in out
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: rank 1, "))
    cfg = load_config(config)
    assert cfg.mesh == str(mesh) and f"{load_layout_file(mesh).name}" == "mesh"
    assert chosen.startswith(f"chosen: rank 1, {','.join(f'{a}={n}' for a, n in load_layout_file(mesh).axes.items())}")


def test_search_flags_are_checked_before_searching(tmp_path, capsys):
    (tmp_path / "taken.toml").write_text("")
    cases = [
        ([*PLAN, "--devices", "8", "--write-mesh", str(tmp_path / "taken.toml")], "taken.toml exists"),
        ([*PLAN, "--devices", "8", "--mesh", "data=8"], "--search chooses the mesh: drop --mesh data=8"),
        ([*PLAN[:1], *PLAN[2:], "--write-config", "x.toml"], "go with --search"),
    ]
    for argv, error in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and error in err[0], err


def test_errors_are_user_input_errors():
    for kind in (NoMeshError, BatchSplitError, FitsNowhereError):
        assert issubclass(kind, ValueError)


@pytest.mark.slow
def test_llama_1b_on_v5p_64_chooses_a_layout_that_compiles_and_fits(tmp_path, capsys):
    aot_target("v5p:4x4x4")  # skips without libtpu
    argv = ["plan", "--search", "--model", "llama-1b", "--aot-topology", "v5p:4x4x4", "--batch-size", "256"]
    argv += ["--seq-len", "2048", "--compile-best", "2", "--write-mesh", str(tmp_path / "m.toml")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "<- chosen" in out and "compiled verdict: fits" in out
    assert load_layout_file(tmp_path / "m.toml").axes
