"""`jaxtrain plan --aot-topology` and `jaxtrain comm --aot-topology`, in this process: the step compiled for a TPU
topology (libtpu) or a node of NVIDIA GPUs (the CUDA plugin) without the hardware, the compiler's own memory figures
printed as `memory_analysis()` gives them, the fit verdict from them against the chip's HBM, multi-slice layouts, and
bad targets refused in one line before anything compiles."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import tempfile
from pathlib import Path

import pytest
from helpers import TINY, aot_run, aot_target

import jaxtrain.aot.targets
import jaxtrain.placement.shardings
from jaxtrain.analysis.chips import CHIPS
from jaxtrain.cli import BAD_INPUT_EXIT, main
from jaxtrain.formatting import fmt_bytes
from jaxtrain.planner import USABLE_HBM

GPT_TINY = ["--model", "gpt-tiny", *TINY]
# 4096 rows of 2048 tokens over 8 devices: each layer's attention scores alone (512 rows x 4 heads x 2048^2, f32)
# are 32 GiB per device, beyond any chip's HBM; gpt-tiny keeps the compile short.
# Over the HBM by its attention scores, (B, H, T, T) with the reference attention; with splash (auto on TPU) the
# same step fits.
OVERSIZED = ["--model", "gpt-tiny", *TINY, "batch_size=4096", "seq_len=2048", "attention=reference"]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`jaxtrain ARGV` in this process: exit status, stdout, stderr."""
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


@functools.cache
def reference_memory(name: str, mesh: str, slices: int = 1, model: str = "gpt-tiny", overrides: tuple[str, ...] = ()):
    """`memory_analysis()` of the step compiled for `name` apart from the command: what it must print."""
    return aot_run(aot_target(name, slices), mesh, overrides, model).train_step.memory_analysis()


def compiler_figures(m) -> dict[str, str]:
    """The check's memory lines, label -> printed bytes, as they must read for `memory_analysis()` `m`."""
    live = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {
        "arguments": fmt_bytes(m.argument_size_in_bytes),
        "outputs": fmt_bytes(m.output_size_in_bytes),
        "temporaries": fmt_bytes(m.temp_size_in_bytes),
        "live at most": fmt_bytes(live),
        "XLA's peak": fmt_bytes(m.peak_memory_in_bytes),
    }


def printed_figures(out: str) -> dict[str, str]:
    """The check's memory lines as printed, label -> bytes."""
    block = out.split("compiler's memory per device\n", 1)[1].split("compiled verdict:")[0]
    return dict(re.findall(r"^ {4}(\S.*?) {2,}([\d.]+ (?:B|KiB|MiB|GiB|TiB))", block, flags=re.M))


# XLA:GPU takes ~10 s over gpt-tiny's step (3 s over mlp-tiny's); XLA:TPU 2-5 s.
MLP_TINY = ("mlp-tiny", ("data.source=synthetic",))


@pytest.mark.parametrize(
    "flags,name,platform,model",
    [
        (["--aot-topology", "v5p:2x2x2"], "v5p:2x2x2", "tpu", ("gpt-tiny", ())),
        (["--aot-topology", "h100:8"], "h100:8", "gpu", MLP_TINY),
        pytest.param(["--aot-topology", "h200:8"], "h200:8", "gpu", ("gpt-tiny", ()), marks=pytest.mark.slow),
        (["--aot-topology", "auto", "--chip", "v5p"], "v5p:2x2x2", "tpu", ("gpt-tiny", ())),  # 8 v5p: 2x2x2
    ],
    ids=["tpu", "gpu", "gpu-gpt", "auto"],
)
def test_plan_prints_the_compilers_figures(flags, name, platform, model, capsys):
    reference = reference_memory(name, "fsdp=8", 1, *model)
    argv = ["plan", *flags, "--mesh", "fsdp=8", "--model", model[0], *TINY, *model[1]]
    status, out, err = run_cli(argv, capsys)
    assert status == 0, err
    target = aot_target(name)
    assert f"check: compiled the train step for {target.describe()} in " in out
    assert printed_figures(out) == compiler_figures(reference)
    live = compiler_figures(reference)["live at most"]
    hbm = CHIPS[target.chip.name].hbm_bytes
    assert f"compiled verdict: fits: live {live} of {fmt_bytes(USABLE_HBM * hbm)} usable (90% of " in out
    assert f"compiled ({platform})" in out  # the compiled columns beside the estimates, memory and communication
    assert "per set of axes, beside the compiled step" in out and re.search(r"^  fsdp +\S+ \S+ +\S+ \S+", out, re.M)


def test_a_tpu_program_over_the_hbm_is_refused_by_the_compiler(capsys):
    """libtpu refuses a program over the chip's HBM at compile time: the plan prints the estimate, the refusal and
    the verdict, and exits 0 (it answered the question)."""
    target = aot_target("v5p:2x2x2").describe()  # first: skips (or fails under CI) without the tpu-aot extra
    status, out, err = run_cli(["plan", "--aot-topology", "v5p:2x2x2", "--mesh", "fsdp=8", *OVERSIZED], capsys)
    assert status == 0, err
    assert "verdict: does not fit" in out
    assert f"check: the TPU compiler refused the train step for {target} after " in out
    assert "RESOURCE_EXHAUSTED" in out and "exceeds available HBM" in out
    assert out.rstrip().endswith("compiled verdict: does not fit: the compiler refused it for lack of HBM")


@pytest.mark.slow  # the GPU compiler works through the oversized program: ~20 s
def test_a_gpu_program_over_the_memory_compiles_and_does_not_fit(capsys):
    """XLA:GPU compiles a program several times an H100's memory without complaint: the verdict from its figures
    flips to does-not-fit where the small step fits."""
    status, out, err = run_cli(["plan", "--aot-topology", "h100:8", "--mesh", "fsdp=8", *OVERSIZED], capsys)
    assert status == 0, err
    live = float(re.search(r"live at most +([\d.]+) GiB", out).group(1))
    assert live * 2**30 > CHIPS["h100"].hbm_bytes
    assert f"compiled verdict: does not fit: live {live} GiB of 72.0 GiB usable (90% of h100's 80.0 GiB HBM)" in out
    assert "XLA:GPU compiles a program larger than the GPU's memory without complaint" in out


TWO_SLICES = 'description = "FSDP in each slice, data across two"\n[axes]\nfsdp = 8\n[dcn_axes]\ndata = 2\n'


@functools.cache
def two_slice_plan() -> tuple[str, str]:
    """(the layout file, what `jaxtrain plan --aot-topology auto --chip v5p` printed for it): one compile for the
    tests that read it."""
    layout = Path(tempfile.mkdtemp(prefix="two-slices-")) / "two-slices.toml"
    layout.write_text(TWO_SLICES)
    printed = io.StringIO()
    argv = ["plan", "--aot-topology", "auto", "--chip", "v5p", "--mesh", str(layout), *GPT_TINY, "batch_size=16"]
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return str(layout), printed.getvalue()


def compiled_comm(out: str, axes: str) -> str:
    """The compiled bytes of one set of axes in the table beside the compiled step."""
    table = out.split("per set of axes, beside the compiled step\n", 1)[1]
    return re.search(rf"^  {axes} +\S+ \S+ +(\S+ \S+)", table, flags=re.M).group(1)


@pytest.mark.slow  # two compiles of 16 devices
def test_multi_slice_layout_compiles_for_slices_joined_by_dcn():
    """A layout with dcn_axes on `auto`: v5p:2x2x2 twice, FSDP in each slice, data parallel across them."""
    layout, out = two_slice_plan()
    reference = reference_memory("v5p:2x2x2", layout, 2, "gpt-tiny", ("batch_size=16",))
    assert "for v5p:2x2x2 (16 TPU v5 devices in 2 slices, compile-only)" in out
    assert "across hosts: data" in out and re.search(r"^  data +all-reduce +gradients", out, flags=re.M)
    assert printed_figures(out) == compiler_figures(reference)
    assert compiled_comm(out, "fsdp") != "0 B"


@pytest.mark.slow
def test_multi_slice_compiled_traffic_crosses_the_slices():
    # libtpu compiles a multi-slice program per slice; the gradient all-reduce across slices is a pair of host
    # transfers to the megascale runtime, which jaxtrain.analysis.hlo counts over the DCN axis.
    _, out = two_slice_plan()
    assert compiled_comm(out, "data") != "0 B"


def test_comm_reports_the_step_compiled_for_a_tpu(capsys):
    target = aot_target("v5p:2x2x2").describe()  # first: skips (or fails under CI) without the tpu-aot extra
    argv = ["comm", "--aot-topology", "v5p:2x2x2", "--mesh", "data=2,fsdp=4", *GPT_TINY]
    status, out, err = run_cli(argv, capsys)
    assert status == 0, err
    assert out.startswith(f"compiled the train step for {target} in ")
    assert "communication per step: bytes each device sends" in out
    assert re.search(r"^ *fsdp +all-gather", out, flags=re.M) and re.search(r"^ *data\b", out, flags=re.M), out


@pytest.mark.parametrize(
    "command,flags,message",
    [
        ("plan", ["--aot-topology", "v5p:8"], "libtpu does not know the topology 'v5p:8': INVALID_ARGUMENT"),
        (
            "plan",
            ["--aot-topology", "v5p:3x3x3"],
            "the compile target 'v5p:3x3x3' has 27: use --aot-topology v5p:2x2x2",
        ),
        (
            "plan",
            ["--aot-topology", "tpu9:2x2"],
            "compile target 'tpu9:2x2': unknown chip 'tpu9'. Known: v4:<topology>",
        ),
        ("plan", ["--aot-topology", "h100:16"], "a GPU target is <gpus per host> (1-8) or <hosts>x<gpus per host>"),
        ("plan", ["--aot-topology", "v5p:2x2x2", "--chip", "h100"], "--chip h100 contradicts the compile target"),
        ("plan", ["--aot-topology", "h100:8", "--devices", "16"], "--devices 16 contradicts the compile target"),
        (
            "plan",
            ["--aot-topology", "v5p:2x2x2", "--mesh", "data=2,fsdp=8"],
            "mesh layout 'data=2,fsdp=8' has 16 devices but the compile target 'v5p:2x2x2' has 8: use --aot-topology "
            "v5p:2x2x4 (or auto)",
        ),
        ("plan", ["--aot-topology", "h100:2x8", "--mesh", "gpu-4x8"], "mesh layout 'gpu-4x8' spans 4 hosts"),
        ("plan", ["--aot-topology", "auto"], "--aot-topology auto needs --chip"),
        ("plan", ["--aot-topology", "auto", "--chip", "v5p", "--mesh", "tpu-v5p-128"], "needs the device count"),
        ("plan", ["--aot-topology", "h100:8", "--simulated-devices", "8"], "exclude each other"),
        ("plan", ["--aot-topology", "h100:8", "--no-check"], "--no-check skips the compile"),
        ("comm", ["--aot-topology", "v5p:2x2x2", "--chip", "v5e"], "--chip v5e contradicts the compile target"),
        ("comm", ["--chip", "v5e"], "--chip and --devices choose the --aot-topology target"),
    ],
)
def test_a_bad_target_is_one_line_before_anything_compiles(command, flags, message, capsys, monkeypatch):
    aot_target("v5p:2x2x2"), aot_target("h100:8")  # skip where an extra is missing
    monkeypatch.setattr(
        jaxtrain.placement.shardings.Shardings, "compile", lambda *_, **__: pytest.fail("a step compiled")
    )
    status, out, err = run_cli([command, "--mesh", "fsdp=8", *flags, *GPT_TINY], capsys)
    assert status == BAD_INPUT_EXIT, out + err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    "name,package,extra", [("v5p:2x2x2", "libtpu", "tpu-aot"), ("h100:8", "jax_plugins.xla_cuda12", "gpu-aot")]
)
def test_a_missing_compiler_says_which_extra_to_install(name, package, extra, capsys, monkeypatch):
    find_spec = jaxtrain.aot.targets.importlib.util.find_spec
    monkeypatch.setattr(
        jaxtrain.aot.targets.importlib.util, "find_spec", lambda n, *a: None if n == package else find_spec(n, *a)
    )
    status, _, err = run_cli(["plan", "--aot-topology", name, "--mesh", "fsdp=8", *GPT_TINY], capsys)
    assert status == BAD_INPUT_EXIT
    assert err.count("\n") == 1 and f"pip install 'jaxtrain[{extra}]'" in err


def test_a_missing_plugin_package_says_which_extra_to_install(capsys, monkeypatch):
    """Without the gpu-aot extra there is no `jax_plugins` package at all: `find_spec` of the plugin then raises,
    which must read as "not installed", not as a traceback."""

    def find_spec(name, *args):
        raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")

    monkeypatch.setattr(jaxtrain.aot.targets.importlib.util, "find_spec", find_spec)
    status, _, err = run_cli(["plan", "--aot-topology", "h100:8", "--mesh", "fsdp=8", *GPT_TINY], capsys)
    assert status == BAD_INPUT_EXIT
    assert err.count("\n") == 1 and "pip install 'jaxtrain[gpu-aot]'" in err
