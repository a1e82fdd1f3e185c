"""Compile-only devices of hardware this machine does not have: a TPU topology (with libtpu) or a node of NVIDIA
GPUs (with the CUDA plugin), for `jit(...).lower(...).compile()` to compile a program exactly as on the real chips.

Names: a TPU slice is `<chip>:<topology>` (`v5p:4x4x4` is 64 TPU v5p chips, `v5e:16x16` 256 v5e chips; the
topology is the chips along each ICI dimension, as Cloud TPU writes it); a GPU node is `<chip>:<gpus>` or
`<chip>:<hosts>x<gpus>` (`h100:8`, `h200:2x8`). `auto` picks the name for a chip and a device count. Multi-slice
TPU programs get `slices` copies of the topology joined by DCN, as the layout's `dcn_axes` ask.

    >>> target = compile_target("v5p:2x2x2")          # doctest: +SKIP
    >>> run = build(cfg, devices=target.devices)      # doctest: +SKIP
    >>> run.train_step.memory_analysis()              # the TPU compiler's own figures   # doctest: +SKIP

The GPU specs (gpu_targets/*.txtpb) are XLA's own, as the CUDA plugin carries them; the GPU compiler does not refuse
a program larger than the device's memory, so callers compare the footprint with `target.chip.hbm_bytes`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
import os
import re
from collections.abc import Sequence

from jaxtrain.analysis.chips import CHIPS, Chip
from jaxtrain.errors import UserInputError

TPU_CHIPS = ("v4", "v5e", "v5p", "v6e")
GPU_CHIPS = ("h100", "h200", "a100")
_GPUS_PER_HOST = 8
_NAME = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+)*)$")


class TargetError(UserInputError):
    """A compile target that is unknown, malformed, or needs a package that is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices of one kind of hardware: what `build(cfg, devices=...)` takes."""

    name: str  # as given: "v5p:4x4x4", "h100:2x8"
    platform: str  # "tpu" or "gpu"
    chip: Chip
    devices: tuple  # jax.Device, compile-only: they run nothing
    slices: int  # TPU slices or GPU hosts: the groups of devices joined by the slow links

    def describe(self) -> str:
        """'v5p:4x4x4 (64 TPU v5 devices, compile-only)', with the slices or hosts when there are several."""
        per = "slices" if self.platform == "tpu" else "hosts"
        over = f" in {self.slices} {per}" if self.slices > 1 else ""
        return f"{self.name} ({len(self.devices)} {self.devices[0].device_kind} devices{over}, compile-only)"


def compile_target(name: str, slices: int = 1) -> Target:
    """The compile-only devices called `name` (see the module docstring), `slices` TPU slices of it when more than
    one. JAX must not have started a GPU or TPU backend in this process (compile-only devices live beside the CPU
    backend); call this before anything else runs JAX."""
    chip_name, dims = parse_target(name)
    use_cpu_backend_only()
    if chip_name in TPU_CHIPS:
        return _tpu_target(name, chip_name, dims, slices)
    if slices != 1:
        raise TargetError(
            f"compile target '{name}' with {slices} slices: GPU hosts are named in the target, e.g. "
            f"'{chip_name}:{slices}x{_GPUS_PER_HOST}' for {slices} hosts of {_GPUS_PER_HOST} GPUs."
        )
    return _gpu_target(name, chip_name, dims)


def parse_target(name: str) -> tuple[str, tuple[int, ...]]:
    """('v5p', (4, 4, 4)) from 'v5p:4x4x4'; ('h100', (2, 8)) from 'h100:2x8'."""
    match = _NAME.match(name.strip().lower())
    known = ", ".join([*(f"{c}:<topology>" for c in TPU_CHIPS), *(f"{c}:<gpus> or <hosts>x<gpus>" for c in GPU_CHIPS)])
    if not match:
        raise TargetError(f"compile target '{name}' is not '<chip>:<shape>' (e.g. v5p:4x4x4, h100:8). Known: {known}.")
    chip_name, shape = match.groups()
    if chip_name not in (*TPU_CHIPS, *GPU_CHIPS):
        raise TargetError(f"compile target '{name}': unknown chip '{chip_name}'. Known: {known}.")
    dims = tuple(int(d) for d in shape.split("x"))
    if 0 in dims:  # libtpu divides by each dimension: a zero kills the process (SIGFPE) instead of raising
        raise TargetError(
            f"compile target '{name}' has a dimension of 0: every dimension counts chips or GPUs and is at least 1, "
            f"e.g. {chip_name}:{'4x4x4' if chip_name in ('v4', 'v5p') else '4x4' if chip_name in TPU_CHIPS else '8'}."
        )
    if chip_name in GPU_CHIPS and (len(dims) > 2 or dims[-1] > _GPUS_PER_HOST):
        raise TargetError(
            f"compile target '{name}': a GPU target is <gpus per host> (1-{_GPUS_PER_HOST}) or <hosts>x<gpus per "
            f"host>, e.g. {chip_name}:8 or {chip_name}:2x8."
        )
    return chip_name, dims


def auto_target(chip: Chip, devices: int, slices: int = 1) -> str:
    """The target name of `devices` chips of `chip` in `slices` slices or hosts: the standard slice shape for a
    TPU (v5p 64 chips: 'v5p:4x4x4'; v5e 256: 'v5e:16x16'), hosts of up to 8 GPUs for a GPU."""
    if chip.name not in (*TPU_CHIPS, *GPU_CHIPS):
        raise TargetError(f"no compile target for chip '{chip.name}': use one of {', '.join(TPU_CHIPS + GPU_CHIPS)}.")
    if devices % slices:
        raise TargetError(f"{devices} devices do not split into {slices} slices or hosts of equal size.")
    per_slice = devices // slices
    if chip.name in GPU_CHIPS:
        if per_slice > _GPUS_PER_HOST:
            raise TargetError(
                f"{devices} {chip.name} GPUs in {slices} host(s) is {per_slice} per host; a host has at most "
                f"{_GPUS_PER_HOST}: give the layout dcn_axes across hosts (e.g. [dcn_axes] data = "
                f"{math.ceil(per_slice / _GPUS_PER_HOST) * slices})."
            )
        return f"{chip.name}:{per_slice}" if slices == 1 else f"{chip.name}:{slices}x{per_slice}"
    if per_slice & (per_slice - 1) or per_slice < (4 if chip.name in ("v4", "v5p") else 1):
        raise TargetError(
            f"{per_slice} {chip.name} chips per slice is not a standard slice size (a power of two"
            f"{', at least 4' if chip.name in ('v4', 'v5p') else ''}): name the topology, e.g. --aot-topology "
            f"{chip.name}:{'2x2x2' if chip.name in ('v4', 'v5p') else '4x4'}."
        )
    return f"{chip.name}:{'x'.join(map(str, _slice_shape(per_slice, 3 if chip.name in ('v4', 'v5p') else 2)))}"


def _slice_shape(chips: int, dims: int) -> list[int]:
    """Powers of two as equal as they go, smallest first: 64 over 3 dims is 4x4x4, 128 is 4x4x8, 8 over 2 is 2x4."""
    shape = [1] * dims
    for _ in range(chips.bit_length() - 1):
        shape[shape.index(min(shape))] *= 2
    return sorted(shape)


def use_cpu_backend_only() -> None:
    """Keep JAX to its CPU backend, where compile-only devices live: call it before JAX starts a backend (a process
    that has already started one keeps it). Left to itself, JAX would also start the CUDA plugin's runtime, which
    fails without a GPU and then refuses to make GPU topologies."""
    import jax
    from jax._src import xla_bridge  # no public way to ask whether the backends have started

    if not getattr(xla_bridge, "backends_are_initialized", lambda: True)():
        jax.config.update("jax_platforms", "cpu")


def installed(module: str) -> bool:
    """Whether `module` can be imported: `find_spec` of a submodule raises where its parent package is absent
    (`jax_plugins` without the gpu-aot extra), which means not installed too."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _tpu_target(name: str, chip_name: str, dims: Sequence[int], slices: int) -> Target:
    from jax.experimental import topologies

    if not installed("libtpu"):
        raise TargetError(
            f"compiling for '{name}' needs libtpu, the TPU compiler, which is not installed: "
            "pip install 'jaxtrain[tpu-aot]' (it compiles for TPU topologies without the hardware)."
        )
    _libtpu_without_a_tpu_vm(chip_name, math.prod(dims))
    kwargs = {"wrap": wraparound(chip_name, dims), **({"num_slices": slices} if slices > 1 else {})}
    try:
        topology = topologies.get_topology_desc(
            topology_name=f"{chip_name}:{'x'.join(map(str, dims))}", platform="tpu", **kwargs
        )
    except Exception as err:  # libtpu reports an unknown topology as a JaxRuntimeError: INVALID_ARGUMENT
        raise TargetError(f"libtpu does not know the topology '{name}': {str(err).splitlines()[0]}") from None
    return Target(name, "tpu", CHIPS[chip_name], tuple(topology.devices), slices)


def wraparound(chip_name: str, dims: Sequence[int]) -> tuple[bool, bool, bool]:
    """Which sides of a TPU slice close into rings, as Google's system characteristics list them (XPK; MaxText's
    accelerator_to_spec_map): a v4 or v5p slice whose every side is a multiple of 4 is a torus (whole cubes joined
    by optical switches), a smaller one an open mesh; v5e and v6e close a side of 16 chips. libtpu's default is an
    open mesh, and over one it compiles a gather across the whole slice as an all-reduce of a zero-filled buffer:
    twice the bytes of the all-gather it compiles over the torus the hardware has."""
    if chip_name in ("v4", "v5p"):
        return (all(d % 4 == 0 for d in dims),) * 3
    return (*(d == 16 for d in dims), False)


def _libtpu_without_a_tpu_vm(chip_name: str, chips: int) -> None:
    """libtpu looks for the TPU VM it runs on and prints warnings when there is none; there is none by design here.
    It also takes a lock file that lets one process at a time own the chips, which made a second `jaxtrain plan
    --aot-topology` fail ("Internal error when accessing libtpu multi-process lockfile") while one ran: only the
    compiler is used here, and it owns no chip. A real TPU VM sets the first three itself; any set is left alone."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip_name}-{chips * (2 if chip_name in ('v4', 'v5p') else 1)}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _gpu_target(name: str, chip_name: str, dims: Sequence[int]) -> Target:
    from jax.experimental import topologies

    if not installed("jax_plugins.xla_cuda12"):
        raise TargetError(
            f"compiling for '{name}' needs the CUDA plugin, which is not installed: pip install 'jaxtrain[gpu-aot]' "
            "(it compiles for NVIDIA GPUs without a GPU or a driver)."
        )
    hosts, gpus = (1, *dims) if len(dims) == 1 else dims
    spec = importlib.resources.files("jaxtrain.aot").joinpath(f"gpu_targets/{chip_name}.txtpb").read_text()
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x{hosts}x{gpus}")
    except Exception as err:
        raise TargetError(
            f"the CUDA plugin could not make compile-only devices for '{name}': {str(err).splitlines()[0]}. "
            "Make GPU targets before JAX runs anything else in the process, or set JAX_PLATFORMS=cpu."
        ) from None
    return Target(name, "gpu", CHIPS[chip_name], tuple(topology.devices), hosts)
