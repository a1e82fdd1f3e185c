"""The compile-only hardware a run is checked on (`jaxtrain plan --aot-topology`): a named TPU topology or GPU node,
or `auto`, the standard one for the layout's size and slices on a chip. Checked against the mesh layout, the chip
and the device count asked for before any device is made, so a mismatch is one clear line, not a compile error.

    >>> target = target_for(parse_layout("tpu-v5e-2x256"), "auto", chip_name="v5e", devices=512)  # doctest: +SKIP
    >>> target.describe()               # 'v5e:16x16 (512 TPU v5 lite devices in 2 slices, compile-only)'
"""

from __future__ import annotations

import math

from jaxtrain.analysis.chips import CHIPS, chip
from jaxtrain.aot.targets import TPU_CHIPS, Target, TargetError, auto_target, compile_target, parse_target
from jaxtrain.sharding.mesh import MeshError, MeshLayout

AUTO = "auto"  # the topology that matches the layout and the chip


def target_for(layout: MeshLayout, name: str, chip_name: str | None = None, devices: int | None = None) -> Target:
    """The compile-only devices called `name` (or `auto`) for a run on `layout`: TPU slices as many as the layout's
    `dcn_axes` multiply to; GPU hosts as the name says. `chip_name` and `devices`, when given, must agree with the
    target (for `auto` they choose it). Raises TargetError (bad input) naming what disagrees and what would fit."""
    slices = math.prod(layout.dcn_axes.values())
    if name.strip().lower() == AUTO:
        name = _auto_name(layout, chip_name, devices, slices)
    target_chip, dims = parse_target(name)
    if chip_name is not None and chip(chip_name).name != target_chip:
        raise TargetError(
            f"--chip {chip_name} contradicts the compile target '{name}', which is {target_chip} hardware: drop "
            f"--chip (the target names the chip) or name a {chip(chip_name).name} target."
        )
    tpu = target_chip in TPU_CHIPS
    count = math.prod(dims) * (slices if tpu else 1)
    if devices is not None and devices != count:
        raise TargetError(
            f"--devices {devices} contradicts the compile target '{name}'"
            f"{f' in {slices} slices' if tpu and slices > 1 else ''}, which has {count} devices: drop --devices (the "
            "target sets the count) or name a target of that size."
        )
    _check_layout(layout, name, count, hosts=slices if tpu else (dims[0] if len(dims) == 2 else 1))
    return compile_target(name, slices if tpu else 1)


def _auto_name(layout: MeshLayout, chip_name: str | None, devices: int | None, slices: int) -> str:
    if chip_name is None:
        raise TargetError(f"--aot-topology {AUTO} needs --chip, the chip to compile for: one of {', '.join(CHIPS)}.")
    if devices is None:
        wildcard = [axis for axis, size in layout.axes.items() if size == -1]
        if wildcard:
            raise TargetError(
                f"--aot-topology {AUTO} needs the device count: mesh layout '{layout.name}' fills '{wildcard[0]}=-1' "
                "from it. Give --devices N, or name the topology (e.g. --aot-topology v5p:4x4x4)."
            )
        devices = _layout_size(layout)
    return auto_target(chip(chip_name), devices, slices)


def _check_layout(layout: MeshLayout, name: str, count: int, hosts: int) -> None:
    """The layout spans the target: its fixed size is the target's, and its `dcn_axes` cross the target's slices
    or hosts (a GPU layout of 4 hosts does not split over 2)."""
    slow = math.prod(layout.dcn_axes.values())
    chip_name = parse_target(name)[0]
    if slow > 1 and slow != hosts:
        raise TargetError(
            f"mesh layout '{layout.name}' spans {slow} hosts (dcn_axes "
            f"{','.join(f'{a}={s}' for a, s in layout.dcn_axes.items())}) but the compile target '{name}' has "
            f"{hosts}: name {slow} hosts, e.g. --aot-topology {chip_name}:{slow}x{count // hosts}, or use "
            f"--aot-topology {AUTO} --chip {chip_name}."
        )
    if all(size != -1 for size in layout.axes.values()) and _layout_size(layout) != count:
        size = _layout_size(layout)
        raise TargetError(
            f"mesh layout '{layout.name}' has {size} devices but the compile target '{name}' has {count}: "
            f"{_suggest(chip_name, size, slow)}or a layout of {count} devices (one axis -1 fills any target)."
        )
    try:
        layout.resolve(count)
    except MeshError as err:
        raise TargetError(f"compile target '{name}' ({count} devices): {err}") from None


def _suggest(chip_name: str, devices: int, slices: int) -> str:
    """'use --aot-topology v5p:4x4x4 (or auto), ' for a size with a standard target, else nothing."""
    try:
        return f"use --aot-topology {auto_target(CHIPS[chip_name], devices, slices)} (or {AUTO}), "
    except TargetError:
        return ""


def _layout_size(layout: MeshLayout) -> int:
    return math.prod([*layout.axes.values(), *layout.dcn_axes.values()])
