"""Device meshes with named axes, from a file in `meshes/`, an inline spec or Python.

A layout gives each mesh axis a size. Layouts for many hosts or slices give two sizes per axis: `axes` inside one
host/slice (fast links: ICI, NVLink) and `dcn_axes` across them (slow links: DCN, InfiniBand). The device array is
built by JAX's mesh utilities so that neighbours on a mesh axis are neighbours on the hardware.

    >>> layout = parse_layout("data=2,fsdp=-1")
    >>> mesh = build_mesh(layout)          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxtrain.errors import UserInputError
from jaxtrain.files import read_bytes, utf8_text

# Slowest links first, fastest last: `tensor` talks every layer, `data` once per step. `replica` is data parallelism
# across the slowest links (hosts, slices): the batch is split over it as over `data`, but the gradient all-reduce
# can treat it apart (allreduce.algorithm=hierarchical reduces inside the faster axes first). `context` splits the
# sequence (context parallelism): its ring attention passes key/value blocks between neighbours every layer, so it
# sits next to `tensor`, among the fast links.
MESH_AXES = ("replica", "data", "pipeline", "fsdp", "expert", "context", "tensor")


def _meshes_dir() -> Path:
    """The shipped layouts: the package data jaxtrain/meshes where jaxtrain is installed (pyproject.toml maps meshes/
    there), else the meshes/ folder of the checkout this module runs from (a copy not installed, e.g. on a device)."""
    try:
        return Path(str(importlib.resources.files("jaxtrain.meshes")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "meshes"


MESHES_DIR = _meshes_dir()


class MeshError(UserInputError):
    """A mesh layout that cannot be built on the devices at hand."""


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Sizes of the named mesh axes, plus optional sharding-rule overrides that belong to the layout.

    `axes` are sizes within one host or slice; `dcn_axes` (optional) are sizes across hosts or slices. The mesh
    axis size is their product. One size in `axes` may be -1: it takes whatever devices are left.
    """

    axes: Mapping[str, int]
    dcn_axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rules: Mapping[str, object] = dataclasses.field(default_factory=dict)
    name: str = "inline"
    description: str = ""

    def __post_init__(self):
        for label, sizes in (("axes", self.axes), ("dcn_axes", self.dcn_axes)):
            for axis, size in sizes.items():
                if axis not in MESH_AXES:
                    raise MeshError(
                        f"mesh layout '{self.name}': unknown axis name '{axis}' in {label}. "
                        f"Known axes: {', '.join(MESH_AXES)}."
                    )
                if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                    raise MeshError(
                        f"mesh layout '{self.name}': axis '{axis}' in {label} has size {_toml_value(size)}; use a "
                        "positive integer, or -1 for the remaining devices."
                    )
        wildcards = [a for a, s in self.axes.items() if s == -1]
        if len(wildcards) > 1:
            raise MeshError(
                f"mesh layout '{self.name}': axes {wildcards} are all -1, but only one axis may take the remaining "
                "devices. Give all but one an explicit size."
            )
        if any(s == -1 for s in self.dcn_axes.values()):
            raise MeshError(f"mesh layout '{self.name}': -1 is allowed in `axes` only, not in `dcn_axes`.")

    def resolve(self, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
        """Per-axis (within-slice, across-slice) sizes for `num_devices`, with -1 filled in and all axes present."""
        dcn = {a: self.dcn_axes.get(a, 1) for a in MESH_AXES}
        num_slices = math.prod(dcn.values())
        if num_devices % num_slices:
            raise MeshError(
                f"mesh layout '{self.name}': dcn_axes multiply to {num_slices} slices/hosts, which does not divide "
                f"the {num_devices} devices."
            )
        per_slice = num_devices // num_slices
        ici = {a: self.axes.get(a, 1) for a in MESH_AXES}
        known = math.prod(s for s in ici.values() if s != -1)
        wildcard = next((a for a, s in ici.items() if s == -1), None)
        if wildcard is not None:
            if per_slice % known:
                raise MeshError(
                    f"mesh layout '{self.name}': the fixed axis sizes multiply to {known}, which does not divide "
                    f"the {per_slice} devices per slice, so '{wildcard}=-1' cannot be filled."
                )
            ici[wildcard] = per_slice // known
        total = math.prod(ici.values()) * num_slices
        if total != num_devices:
            sizes = ",".join(f"{a}={ici[a] * dcn[a]}" for a in MESH_AXES if ici[a] * dcn[a] > 1) or "all axes 1"
            raise MeshError(
                f"mesh layout '{self.name}' ({sizes}) multiplies to {total} devices, but {num_devices} devices are "
                f"available. Change the sizes so they multiply to {num_devices}, "
                "or set one axis to -1 to fill the rest."
            )
        return ici, dcn


def parse_inline(spec: str) -> MeshLayout:
    """Parse `data=2,fsdp=2,tensor=2` (within-host sizes) into a layout."""
    axes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        axis = key.strip()
        if not sep:
            raise MeshError(f"inline mesh '{spec}': '{item}' is not axis=size (e.g. data=2,tensor=4).")
        if axis in axes:
            raise MeshError(f"inline mesh '{spec}': axis '{axis}' is given twice; give each axis one size.")
        try:
            axes[axis] = int(value)
        except ValueError:
            raise MeshError(f"inline mesh '{spec}': size of '{axis}' is '{value}', not an integer.") from None
    return MeshLayout(axes=axes, name=spec)


def load_layout_file(path: str | Path) -> MeshLayout:
    """Read a TOML mesh layout: `[axes]`, optional `[dcn_axes]` and `[rules]`, and a `description`."""
    path = Path(path)
    data = _read_toml(path)
    unknown = set(data) - {"description", "axes", "dcn_axes", "rules"}
    if unknown:
        raise MeshError(
            f"mesh layout '{path}': unknown keys {sorted(unknown)}; allowed: description, axes, dcn_axes, rules."
        )
    for key, kind, example in _LAYOUT_KEYS:
        if key in data and not isinstance(data[key], kind):
            raise MeshError(
                f"mesh layout '{path}': `{key}` is {_toml_type(data[key])} {data[key]!r}, but must be "
                f"{_toml_type(kind())}, e.g. {example}."
            )
    try:
        return MeshLayout(
            axes=data.get("axes", {}),
            dcn_axes=data.get("dcn_axes", {}),
            rules=data.get("rules", {}),
            name=path.stem,
            description=data.get("description", ""),
        )
    except MeshError as err:
        raise MeshError(f"{err} (in {path})") from None


# Each key of a layout file, the TOML type it must have, and an example of it.
_LAYOUT_KEYS = (
    ("axes", dict, "[axes] then data = 2 and fsdp = -1 on lines of their own"),
    ("dcn_axes", dict, "[dcn_axes] then replica = 2"),
    ("rules", dict, '[rules] then embed = "fsdp"'),
    ("description", str, 'description = "FSDP over all devices"'),
)


def _toml_value(value: object) -> str:
    """`value` as TOML writes it, with its type where Python would hide it: true (a boolean), "2" (a string)."""
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    return f"{value!r} ({_toml_type(value)})" if not isinstance(value, int) else str(value)


def _toml_type(value: object) -> str:
    return {dict: "a table", str: "a string", bool: "a boolean", int: "an integer", float: "a float"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _read_toml(path: Path) -> dict:
    """The TOML document at `path`, or a MeshError naming the file and what is wrong with it (missing, a directory,
    not UTF-8, a syntax error with its line and column)."""
    shipped = f" The shipped layout of that name is --mesh {path.stem}." if path.stem in available_layouts() else ""
    missing = f"mesh layout file '{path}' does not exist.{shipped}"
    text = utf8_text(read_bytes(path, "mesh layout file", MeshError, missing), path, "mesh layout file", MeshError)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its message ends "(at line L, column C)"
        raise MeshError(f"mesh layout file '{path}' is not valid TOML: {err}.") from None


def available_layouts() -> list[str]:
    """Names of the layouts shipped in `meshes/`."""
    return sorted(p.stem for p in MESHES_DIR.glob("*.toml"))


def parse_layout(spec: str) -> MeshLayout:
    """A layout from a name in `meshes/`, a path to a `.toml` file, or an inline `axis=size,...` spec."""
    if "=" in spec:
        return parse_inline(spec)
    if spec.endswith(".toml") or "/" in spec:
        return load_layout_file(spec)
    shipped = MESHES_DIR / f"{spec}.toml"
    if shipped.is_file():
        return load_layout_file(shipped)
    raise MeshError(
        f"unknown mesh '{spec}': not a layout in {MESHES_DIR} ({', '.join(available_layouts())}), "
        "not a .toml path, and not an inline spec such as data=2,tensor=4."
    )


def build_mesh(layout: MeshLayout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `jax.sharding.Mesh` for `layout` over `devices` (default: all devices), with every axis in MESH_AXES.

    Axes are `AxisType.Auto`: the compiler propagates shardings, and models may add `with_sharding_constraint`
    hints. We pick Auto over Explicit because our models stay mesh-agnostic and our kernels use `shard_map`.
    """
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = layout.resolve(len(devices))
    ici_shape = [ici[a] for a in MESH_AXES]
    dcn_shape = [dcn[a] for a in MESH_AXES]
    if math.prod(dcn_shape) > 1:
        device_array = _hybrid_device_array(ici_shape, dcn_shape, devices)
    else:
        device_array = _single_slice_device_array(ici_shape, devices)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def abstract_mesh(layout: MeshLayout, num_devices: int) -> AbstractMesh:
    """The axis names and sizes `build_mesh` would give `num_devices` devices, without the devices: enough to plan
    shardings (`NamedSharding(abstract, spec).shard_shape`) for hardware this machine does not have."""
    ici, dcn = layout.resolve(num_devices)
    sizes = tuple(ici[a] * dcn[a] for a in MESH_AXES)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _single_slice_device_array(shape: list[int], devices: list[jax.Device]) -> np.ndarray:
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError):
        # Topologies mesh_utils has no physical model for (CPU, some GPU hosts): device id order is the best guess.
        return np.asarray(devices, dtype=object).reshape(shape)


def _hybrid_device_array(ici_shape: list[int], dcn_shape: list[int], devices: list[jax.Device]) -> np.ndarray:
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:  # TPU multi-slice: slices are the granules
        return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, allow_split_physical_axes=True)
    if len({d.process_index for d in devices}) > 1:  # GPU clusters, multi-process CPU: each host is a granule
        return mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, process_is_granule=True, allow_split_physical_axes=True
        )
    # One process of simulated devices: consecutive blocks of devices stand in for the slices. As in
    # create_hybrid_device_mesh, each axis is (across-slice major, within-slice minor).
    n = len(ici_shape)
    blocks = np.asarray(devices, dtype=object).reshape(dcn_shape + ici_shape)
    interleaved = blocks.transpose([i for axis in range(n) for i in (axis, n + axis)])
    return interleaved.reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def describe_mesh(mesh: Mesh) -> str:
    """Shape, axis names and which device sits where (non-trivial axes only)."""
    live = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    platform = mesh.devices.flat[0].platform
    header = (
        f"Mesh {' '.join(f'{a}={mesh.shape[a]}' for a in live) or '(single device)'}: {mesh.size} {platform} devices"
    )
    if not live:
        return header + f"\n  device {mesh.devices.flat[0].id}"
    grid = mesh.devices.reshape([mesh.shape[a] for a in live])
    lines = [header]
    last = live[-1]
    for index in np.ndindex(*grid.shape[:-1]):
        where = " ".join(f"{a}={i}" for a, i in zip(live[:-1], index))
        ids = " ".join(f"{d.id:>3}" for d in grid[index])
        lines.append(f"  {where + ' ' if where else ''}{last}->[{ids} ]")
    return "\n".join(lines)
