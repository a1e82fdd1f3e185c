"""What `jaxtrain plan` prints: an estimate's memory table, collectives, roofline time and verdict, with the
compiled step's figures beside the estimates when it was measured and the changes that fit when it does not."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from jaxtrain.analysis.chips import CHIPS, Chip, ChipError, chip, chip_for_device_kind
from jaxtrain.aot.targets import Target, TargetError
from jaxtrain.errors import UserInputError
from jaxtrain.formatting import fmt_bytes, format_table
from jaxtrain.planner.estimate import USABLE_HBM, Estimate, Memory, estimate, fits_with
from jaxtrain.planner.hardware import AUTO, target_for
from jaxtrain.planner.measure import CompilerRefused, Measured, measure
from jaxtrain.planner.transfers import Transfer, comm_by_axes
from jaxtrain.registry import SEQUENCE_TASKS, resolve_model
from jaxtrain.run_config import RunConfig
from jaxtrain.sharding.mesh import MeshLayout, parse_layout


def plan_report(
    cfg: RunConfig, chip_name: str | None, devices: int | None, check: bool = True, aot_topology: str | None = None
) -> str:
    """What `jaxtrain plan` prints: the estimate for `devices` chips called `chip_name` (default: this machine's
    chips and count, or the layout's fixed size), the changes that would make it fit, and, when `check`, the
    compiled step's figures beside the estimates: compiled on this process's devices when it has enough, or, with
    `aot_topology` (a TPU topology or GPU node such as 'v5p:4x4x4', 'h100:8', or 'auto': see
    `jaxtrain.planner.hardware.target_for`), by that hardware's compiler on compile-only devices, with the
    compiler's memory figures and a fit verdict from them.

    >>> cfg = apply_overrides(default_config("gpt-1b"), ["mesh=tpu-v5p-512", "batch_size=512"])  # doctest: +SKIP
    >>> print(plan_report(cfg, "v5p", 256))                                                      # doctest: +SKIP
    >>> print(plan_report(cfg, None, None, aot_topology="v5p:4x8x8"))  # needs libtpu             # doctest: +SKIP
    """
    layout = parse_layout(cfg.mesh)
    if aot_topology is not None:
        if not check:
            raise TargetError(f"--no-check skips the compile --aot-topology {aot_topology} asks for: drop one.")
        target = target_for(layout, aot_topology, chip_name, devices)  # before anything else starts JAX
        est = estimate(cfg, target.chip, len(target.devices), layout)
        return _with_check(est, *target_check(cfg, est, target))
    if devices is None:
        devices = _layout_devices(cfg.mesh, layout)
    spec = chip(chip_name) if chip_name else chip_for_device_kind(jax.devices()[0].device_kind)
    if spec is None:
        raise ChipError(f"say which chip to plan for with --chip: one of {', '.join(CHIPS)}.")
    est = estimate(cfg, spec, devices, layout)
    return _with_check(est, *local_check(cfg, est, check))


def _layout_devices(name: str, layout: MeshLayout) -> int:
    """The device count a plan without --devices is for: the layout's own size when every axis is fixed, else this
    process's devices, which must fill the layout's wildcard axis (planning a pod's layout on a laptop needs
    --devices: it is not a question about the laptop's one CPU)."""
    sizes = [*layout.axes.values(), *layout.dcn_axes.values()]
    fixed = math.prod(size for size in sizes if size != -1)
    if -1 not in sizes:
        return fixed
    if jax.device_count() % fixed:
        wildcard = next(axis for axis, size in layout.axes.items() if size == -1)
        raise UserInputError(
            f"mesh layout '{name}' fills '{wildcard}=-1' from the device count, and this process has "
            f"{jax.device_count()}, not a multiple of the other axes' {fixed}: say how many chips to plan for with "
            f"--devices (a multiple of {fixed}), or compile for a target with --aot-topology."
        )
    return jax.device_count()


def local_check(cfg: RunConfig, est: Estimate, check: bool) -> tuple[Measured | None, list[str]]:
    """The step compiled on this process's devices, when it has enough."""
    if not check:
        return None, ["check: skipped (--no-check)"]
    if est.devices > jax.device_count():
        return None, [
            f"check: not compiled: the mesh has {est.devices} devices, this process {jax.device_count()} "
            f"(--simulated-devices {est.devices} compiles it on that many CPU devices, --aot-topology {AUTO} with "
            "the chip's own compiler)"
        ]
    measured = measure(cfg, jax.devices()[: est.devices])
    where = f"on {est.devices} {measured.platform} devices"
    return measured, [f"check: {_compiled(measured, where)} (figures beside the estimates)"]


def _with_check(est: Estimate, measured: Measured | None, check: Sequence[str]) -> str:
    return "\n".join([format_estimate(est, fits_with(est), measured), *check])


def target_check(cfg: RunConfig, est: Estimate, target: Target) -> tuple[Measured | None, list[str]]:
    """The step compiled for `target`: the compiler's memory per device and the fit verdict from it, or the
    compiler's refusal."""
    try:
        m = measure(cfg, target.devices)
    except CompilerRefused as refused:
        return None, [
            f"check: the {refused.platform.upper()} compiler refused the train step for {target.describe()} after "
            f"{refused.seconds:.1f} s: {refused.reason}",
            "compiled verdict: does not fit: the compiler refused it for lack of HBM",
        ]
    figures = [
        ("arguments", m.arguments, ""),
        ("outputs", m.outputs, f"{fmt_bytes(m.aliased)} of them in donated arguments' buffers"),
        ("temporaries", m.temporaries, ""),
        ("live at most", m.peak, "arguments + outputs - donated + temporaries: the fit is judged on this"),
    ]
    if m.xla_peak:
        figures.append(("XLA's peak", m.xla_peak, "the compiler's own estimate"))
    host = [
        ("host args", m.host_arguments, "in host memory, apart from the above: the optimizer state offloaded"),
        ("host temps", m.host_temporaries, "in host memory: activations offloaded, and the compiler's staging"),
    ]
    figures += [figure for figure in host if figure[1]]
    return m, [
        f"check: {_compiled(m, f'for {target.describe()}')} (figures beside the estimates)",
        f"  the {target.platform.upper()} compiler's memory per device",
        *(f"    {label:<13} {fmt_bytes(b):<10} {why}".rstrip() for label, b, why in figures),
        f"compiled verdict: {_fit(m.peak, est.chip, 'live')}",
        f"  {_COMPILER_LIMITS[target.platform]}",
    ]


def _fit(peak: float, spec: Chip, what: str) -> str:
    """'fits: peak 1.2 GiB of 85.5 GiB usable (90% of v5p's 95.0 GiB HBM), 1% used', or 'does not fit: ...'."""
    usable = USABLE_HBM * spec.hbm_bytes
    share = f"{what} {fmt_bytes(peak)} of {fmt_bytes(usable)} usable ({USABLE_HBM:.0%} of {spec.name}'s " + (
        f"{fmt_bytes(spec.hbm_bytes)} HBM)"
    )
    return f"fits: {share}, {peak / usable:.0%} used" if peak <= usable else f"does not fit: {share}"


# What the compiler itself says about memory, and so what the compiled verdict rests on.
_COMPILER_LIMITS = {
    "tpu": "the TPU compiler accepted it: it refuses a program larger than the chip's HBM",
    "gpu": "the verdict is jaxtrain's: XLA:GPU compiles a program larger than the GPU's memory without complaint",
}


def _compiled(measured: Measured, where: str) -> str:
    """'compiled the train step for <where> in 3.1 s', or that JAX's compilation cache supplied it."""
    how = "read the compiled train step from JAX's compilation cache" if measured.cached else "compiled the train step"
    return f"{how} {where} in {measured.compile_s:.1f} s"


def format_estimate(
    est: Estimate, changes: Sequence[tuple[str, Estimate]] = (), measured: Measured | None = None
) -> str:
    """The memory table, collectives, roofline time and verdict of `est`; compiled figures beside the estimates
    when `measured` is given; `changes` (from `fits_with`) when it does not fit."""
    lines = [f"plan: {describe(est)}"]
    lines += _memory_table(est.memory, measured)
    lines += _comm_table(est.transfers, measured)
    lines += _time_lines(est)
    lines += _verdict(est, changes)
    return "\n".join(lines)


def describe(est: Estimate) -> str:
    """One line: model, batch, mesh, chip."""
    t, d, live = est.cfg.train, est.cfg.data, [f"{a}={n}" for a, n in est.mesh_shape.items() if n > 1]
    remat = getattr(est.cfg.model, "remat", None)
    seq = f" x seq {d.seq_len}" if resolve_model(est.cfg.model_name)[0].task in SEQUENCE_TASKS else ""
    hosts = f"; across hosts: {' '.join(sorted(est.slow_axes))}" if est.slow_axes else ""
    return (
        f"{est.cfg.model_name}, batch {d.batch_size}{seq}, grad_accum {t.grad_accum}"
        f"{f', remat {remat}' if remat else ''}; mesh '{est.layout.name}' ({' '.join(live) or 'one device'}; "
        f"{est.devices} x {est.chip.name}{hosts})"
    )


def _time_lines(est: Estimate) -> list[str]:
    c = est.chip
    fast, slow = est.comm_s(slow=False), est.comm_s(slow=True)
    hidden, exposed = est.step_s
    traced = ", 3 x the traced forward pass: the config has no train_flops" if est.model_flops_traced else ""
    return [
        f"time per step (roofline of {c.name}: {c.peak_bf16 / 1e12:.0f} TFLOP/s bf16, HBM "
        f"{c.hbm_bw / 1e9:.0f} GB/s, fast links {c.ici_bw / 1e9:.0f} GB/s, slow links {c.dcn_bw / 1e9:.2f} GB/s "
        "per chip)",
        f"  compute        {est.flops:.3e} FLOPs ({est.model_flops:.3e} model FLOPs{traced}) "
        f"{format_ms(est.compute_s)}",
        f"  HBM traffic    {fmt_bytes(est.hbm_bytes)} {format_ms(est.memory_s)}",
        f"  communication  fast links {format_ms(fast)}, slow links {format_ms(slow)}",
        f"  step           {format_ms(hidden)} (communication hidden) to {format_ms(exposed)} (none hidden); "
        f"MFU {est.mfu[1]:.0%} to {est.mfu[0]:.0%}",
    ]


def _verdict(est: Estimate, changes: Sequence[tuple[str, Estimate]]) -> list[str]:
    lines = [f"verdict: {_fit(est.memory.peak, est.chip, 'peak')}"]
    if est.fits:
        return lines
    if not changes:
        return [*lines, "  no change tried fits (more FSDP, remat, gradient accumulation): use more chips"]
    lines.append("  changes that fit, re-estimated (fastest first):")
    for label, e in changes:
        lines.append(f"    {label}: peak {fmt_bytes(e.memory.peak)}, step {format_ms(e.step_s[1])}, MFU {e.mfu[1]:.0%}")
    return lines


def format_ms(seconds: float) -> str:
    """Milliseconds, or microseconds below one (a small model's step would read 0.00 ms)."""
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.2f} us"


def _ratio(estimate: float, measured: float | None) -> str:
    return f"{estimate / measured:.2f}" if measured else "-"


def _memory_table(m: Memory, measured: Measured | None) -> list[str]:
    compiled = f"compiled ({measured.platform})" if measured else ""
    rows = [("memory per device", "estimate", compiled, "est/compiled" if measured else "")]
    parts = [
        ("params", m.params),
        ("optimizer state", m.opt_state),
        ("step and policy state", m.other_state),
        ("batch", m.batch),
    ]
    rows += [(f"  {label}", fmt_bytes(b), "", "") for label, b in parts]
    got = measured.arguments if measured else None
    rows.append(("= arguments", fmt_bytes(m.arguments), fmt_bytes(got) if got else "", _ratio(m.arguments, got)))
    rows += [
        ("  gradients", fmt_bytes(m.grads), "", ""),
        ("  activations saved for backward", fmt_bytes(m.activations), "", ""),
        ("  working set of one layer", fmt_bytes(m.working), "", ""),
    ]
    got = measured.peak if measured else None
    rows.append(("= peak", fmt_bytes(m.peak), fmt_bytes(got) if got else "", _ratio(m.peak, got)))
    host = [
        ("host memory: optimizer state", m.host_opt_state, measured and measured.host_arguments),
        ("host memory: activations saved for backward", m.host_activations, measured and measured.host_temporaries),
    ]
    rows += [(label, fmt_bytes(b), fmt_bytes(got) if got else "", _ratio(b, got)) for label, b, got in host if b]
    return [line.rstrip() for line in format_table([r if measured else r[:2] for r in rows])]


def _comm_table(transfers: Sequence[Transfer], measured: Measured | None) -> list[str]:
    """Estimated collectives; with `measured`, per set of axes the estimate (as XLA on that platform does it)
    beside the compiled program's bytes."""
    lines = ["communication per step (bytes each device sends)"]
    if not transfers and not (measured and measured.comm):
        return lines + ["  none"]
    rows = [("axes", "collective", "what", "estimate")]
    # A row can send nothing on the chip and only on XLA:CPU (partial sums the accelerators add up first).
    rows += [(" ".join(t.axes), t.kind, t.what, fmt_bytes(t.bytes)) for t in transfers if t.bytes]
    lines += ["  " + line.rstrip() for line in format_table(rows)]
    if measured:
        lines += _comm_beside_compiled(transfers, measured)
    return lines


def _comm_beside_compiled(transfers: Sequence[Transfer], measured: Measured) -> list[str]:
    on_platform = [t.on_cpu() for t in transfers] if measured.platform == "cpu" else transfers
    estimated = comm_by_axes(on_platform)
    rows = [("axes", "estimate", f"compiled ({measured.platform})", "est/compiled")]
    for axes in sorted(set(estimated) | set(measured.comm), key=lambda a: -measured.comm.get(a, 0.0)):
        got, est = measured.comm.get(axes, 0.0), estimated.get(axes, 0.0)
        rows.append((" ".join(axes) or "-", fmt_bytes(est), fmt_bytes(got), _ratio(est, got)))
    cpu = measured.platform == "cpu"
    note = " (XLA:CPU all-reduces where accelerators reduce-scatter: estimated that way)" if cpu else ""
    return [
        f"  per set of axes, beside the compiled step{note}",
        *("  " + line.rstrip() for line in format_table(rows)),
    ]
