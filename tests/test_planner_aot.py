"""The planner held to the TPU and GPU compilers: each model x layout pair is compiled for a TPU v5p topology or an
8-GPU node (compile-only devices, `aot_target`) and its estimate for that chip must agree with the compiler's own
figures: arguments within 5%, the peak within 20%, the bytes each device sends per set of mesh axes within 25%.
benchmarks/planner_vs_compiler.py prints the same figures as JSON."""

from __future__ import annotations

import pytest
from helpers import aot_target

from jaxtrain.planner import comm_by_axes, estimate, measure
from jaxtrain.run_config import apply_overrides, default_config

ARGUMENTS_TOLERANCE, PEAK_TOLERANCE, COMM_TOLERANCE = 0.05, 0.20, 0.25
# Sets of axes carrying less than this share of a step's traffic are not compared (ids gathered for a lookup).
COMM_MIN_SHARE = 0.05
# The planner models attention unfused and the loss over whole logits (jaxtrain.ops.plain), as `reference` and the
# unchunked loss compute them; the compilers are held to that program. With splash or cuDNN and the chunked loss the
# compiled peak is lower (plans are upper bounds).
PLAIN = ["attention=reference", "chunked_loss=false"]
LM = ["batch_size=32", "seq_len=1024", *PLAIN]
# gpt-tiny made wide enough (d_model 128, 384 tokens) that its activations, not the compilers' fixed buffers, set
# the peak, with a vocabulary larger than a microbatch's rows, as real ones are (a toy table is gathered whole).
CHEAP = [
    *("batch_size=64", "seq_len=384", "vocab_size=4096", "d_model=128", "n_heads=1", "d_ff=512", "dtype=bfloat16"),
    *PLAIN,
]


# A real model's run: bfloat16 compute, every layer recomputed, sequences of 2048, the fused kernels.
REAL_1B = ["seq_len=2048", "dtype=bfloat16", "remat=full"]


def _pair(target: str, model: str, mesh: str, overrides: list[str], slow: bool = True, tag: str = ""):
    marks = [pytest.mark.slow] * slow
    return pytest.param(target, model, mesh, overrides, id=f"{target}-{model}{tag}-{mesh}", marks=marks)


PAIRS = [
    _pair("v5p:2x2x2", "gpt-tiny", "fsdp=8", CHEAP, slow=False),
    _pair("h100:8", "gpt-tiny", "fsdp=8", CHEAP, slow=False),
    # 64 TPU chips, and a hybrid mesh of GPUs with the Llama blocks below. gpt-small on fsdp=8 (TPU, H100) and on the
    # hybrid mesh of H100s, gpt-medium on the hybrid mesh of TPUs and on fsdp=8 of H200s, and moe-small on H100s passed
    # when they ran here; the slow set dropped them to fit CI's time (90-110 s each on its 2 cores).
    _pair("v5p:4x4x4", "gpt-1b", "tpu-v5p-128", ["batch_size=256", "seq_len=2048", *PLAIN]),
    # Llama's blocks: grouped-query heads (4 kv heads of 12) and SwiGLU, whose two input matrices' gradients the
    # compiler sums before one all-reduce over tensor.
    _pair("h100:8", "gpt-small", "data=2,fsdp=2,tensor=2", [*LM, "n_kv_heads=4", "mlp=swiglu"], tag="-gqa-swiglu"),
    # Llama 3.2 1B as it trains on an H100 node: cuDNN attention and the chunked loss, which the planner reads as
    # plain math and an analytic model of the loss (jaxtrain.planner.loss). Measured 2026-12-06: arguments 1.00,
    # peak 1.10 (the cuDNN kernel holds less than the plain scores' stand-in), bytes sent 1.00. The compile is 9 s.
    _pair("h100:8", "llama-1b", "fsdp=8", [*REAL_1B, "batch_size=32", "attention=cudnn"], slow=False),
    # 8-bit matmuls and gathers (jaxtrain/placement/precision.py): the planner traces the plain model and counts the
    # chosen weights' gathers as 8-bit codes and, for int8 on GPU, their gradients' reductions as int32 sums.
    # Measured 2026-12-07 on 4 of llama-1b's layers: arguments 1.00, peak 1.13, bytes 0.999 (int8 and fp8 + gather).
    _pair("v5p:2x2x2", "gpt-tiny", "fsdp=8", [*CHEAP, "precision.matmuls=int8", "precision.gather=8bit"], tag="-int8"),
    _pair(
        "h100:8",
        "llama-1b",
        "fsdp=8",
        [*REAL_1B, "batch_size=32", "attention=cudnn", "n_layers=4", "precision.matmuls=int8"],
        tag="-int8",
    ),
    _pair(
        "h100:8",
        "llama-1b",
        "fsdp=8",
        [*REAL_1B, "batch_size=32", "attention=cudnn", "n_layers=4", "precision.matmuls=fp8", "precision.gather=8bit"],
        tag="-fp8-gather8",
    ),
]

# The BERT encoder (models/bert.py) made as wide as CHEAP's gpt-tiny: bidirectional attention, its MLM head's whole
# logits (the label picked by a one-hot, as the decoder's plain loss: picked by take_along_axis, XLA scatters its
# gradient into a float32 (B, T, V) buffer and the v5p peak was 274 MB against 196 estimated), and on the GPUs the
# sequence split over a context axis (attention's K and V gathered, `allgather`). 32 rows, so a device looks up fewer
# tokens than the 4,096-entry table holds, as real vocabularies are. Measured 2026-12-07, estimate / compiled:
# h100:8 passes; v5p:2x2x2 on data=2,fsdp=2,tensor=2 agrees on arguments and peak, but XLA:TPU all-reduces the
# table's float32 gradient over (data, fsdp), 1.75 MB where the planner counts 0.026 MB, a small-table case it does
# not model (on fsdp=4,tensor=2 the fsdp bytes are 3.70 MB against 5.00 MB compiled).
ENCODER = ["batch_size=32", "seq_len=384", "vocab_size=4096", "d_model=128", "n_heads=2", "d_ff=512", "dtype=bfloat16"]
SMALL_TABLE_GAP = pytest.mark.xfail(strict=True, reason="XLA:TPU all-reduces a small table's gradient (see ENCODER)")
PAIRS += [
    pytest.param(
        "v5p:2x2x2",
        "bert-tiny",
        "data=2,fsdp=2,tensor=2",
        [*ENCODER, "attention=reference"],
        id="v5p:2x2x2-bert-tiny-encoder-data=2,fsdp=2,tensor=2",
        marks=[pytest.mark.slow, SMALL_TABLE_GAP],
    ),  # fmt: skip
    _pair("h100:8", "bert-tiny", "context=2,fsdp=2,tensor=2", ENCODER, tag="-encoder"),
]


@pytest.mark.parametrize("target,model,mesh,overrides", PAIRS)
def test_estimate_agrees_with_the_compiler(target, model, mesh, overrides):
    cfg, devices, est = _planned(target, model, mesh, overrides)
    got = measure(cfg, devices)
    assert got.platform == est.compiler
    assert est.memory.arguments == pytest.approx(got.arguments, rel=ARGUMENTS_TOLERANCE)
    assert est.memory.peak == pytest.approx(got.peak, rel=PEAK_TOLERANCE)
    expected, total = comm_by_axes(est.transfers), sum(got.comm.values())
    assert sum(expected.values()) == pytest.approx(total, rel=COMM_TOLERANCE)
    for axes, sent in got.comm.items():
        if sent >= COMM_MIN_SHARE * total:
            assert expected.get(axes, 0.0) == pytest.approx(sent, rel=COMM_TOLERANCE), axes


@pytest.mark.slow
def test_pipeline_estimate_agrees_with_the_compiler():
    """gpt-small over 2 stages x fsdp 4 of a v5p slice, 2 microbatches of 1F1B. The pipeline axis carries each
    tick's activations and gradients and the sums over the stages; the other collectives sit in the tick loop's
    branches, which the compiled count takes to run at every tick where they run at those with work: the compiled
    figure lies between the estimate and the estimate times ticks / ticks with work."""
    cfg, devices, est = _planned("v5p:2x2x2", "gpt-small", "pipeline=2,fsdp=4", LM)
    got = measure(cfg, devices)
    assert est.memory.arguments == pytest.approx(got.arguments, rel=ARGUMENTS_TOLERANCE)
    assert est.memory.peak == pytest.approx(got.peak, rel=PEAK_TOLERANCE)
    expected, s, total = comm_by_axes(est.transfers), est.stages, sum(got.comm.values())
    assert expected[("pipeline",)] == pytest.approx(got.comm[("pipeline",)], rel=COMM_TOLERANCE)
    static = s.schedule.ticks / min(s.forward_ticks, s.backward_ticks, s.schedule.microbatches)
    for axes, sent in got.comm.items():
        if axes != ("pipeline",) and sent >= COMM_MIN_SHARE * total:
            assert expected[axes] / (1 + COMM_TOLERANCE) <= sent <= expected[axes] * static * (1 + COMM_TOLERANCE)


def _planned(target: str, model: str, mesh: str, overrides: list[str]):
    """(config, the target's compile-only devices, the estimate for its chip)."""
    aot = aot_target(target)
    cfg = apply_overrides(default_config(model), [*overrides, f"mesh={mesh}", "data.source=synthetic"])
    return cfg, aot.devices, estimate(cfg, aot.chip, len(aot.devices))
