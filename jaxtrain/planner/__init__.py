"""Plan a run for hardware this machine does not have: per-device memory, collectives per step and a roofline step
time for a model, a mesh layout of any size and a chip, from abstract shapes (nothing is allocated; a pipeline's
stage balancing compiles one layer and the head on this machine to weigh them). Where enough devices exist, or for
a TPU topology or GPU node this machine lacks (`target_for`, with libtpu or the CUDA plugin), `measure` compiles
the real train step to check the estimate.

    >>> from jaxtrain.planner import estimate, fits_with, format_estimate, plan_report
    >>> cfg = apply_overrides(default_config("gpt-1b"), ["mesh=tpu-v5p-256", "batch_size=512", "seq_len=2048"])
    >>> est = estimate(cfg, chip("v5p"), devices=256)                         # doctest: +SKIP
    >>> print(format_estimate(est, fits_with(est)))                           # doctest: +SKIP
    >>> print(plan_report(cfg, "v5p", 256))       # the same, as `jaxtrain plan` prints it   # doctest: +SKIP

Modules, each importing only those above it: `transfers` (a collective), `tiling` (an array's bytes in a chip's
memory), `layouts` (what a device holds of a traced value), `residuals` (which of autodiff's residuals a compiler
holds), `weights` (how params are gathered and their gradients reduced, in the dtype they are used in), `tracing`
(the step's jaxpr read for residuals, FLOPs and collectives), `stages` (a pipelined step from the schedule's tick
table), `estimate` (memory, time, verdict, `fits_with`), `hardware` (the compile-only
devices a run is checked on), `measure` (the compiled check), `report` (the text).
"""

from jaxtrain.planner.estimate import USABLE_HBM, Estimate, Memory, estimate, fits_with
from jaxtrain.planner.hardware import target_for
from jaxtrain.planner.measure import CompilerRefused, Measured, measure, measure_run
from jaxtrain.planner.report import format_estimate, plan_report
from jaxtrain.planner.transfers import Transfer, comm_by_axes

__all__ = [
    "USABLE_HBM",
    "CompilerRefused",
    "Estimate",
    "Measured",
    "Memory",
    "Transfer",
    "comm_by_axes",
    "estimate",
    "fits_with",
    "format_estimate",
    "measure",
    "measure_run",
    "plan_report",
    "target_for",
]
