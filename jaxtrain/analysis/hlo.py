"""Read the collectives out of a compiled program's HLO text: which kind, how many bytes, between which devices.

This is how tests prove a sharding does what it claims, and how the communication report counts bytes. A collective
inside a `while` body (a scanned layer stack) runs once per iteration; `executions` uses XLA's known trip count.

Devices are named by their index in the program's device assignment (replica * num_partitions + partition, XLA's
"flattened id"). A jax.jit program has one replica, so that is the partition id, which is the position in
`mesh.devices.flat` of the mesh its shardings use (checked in tests/test_comm_report.py).

    >>> text = compiled.as_text()                     # doctest: +SKIP
    >>> [(c.kind, c.groups) for c in collectives(text)]   # doctest: +SKIP
    [('all-gather', ((0, 1, 2, 3), (4, 5, 6, 7))), ...]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%([^\s,}]+)")
_WHILE_BODY = re.compile(r" while\(.*body=%([^\s,]+)")
_TRIP_COUNT = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"  # [dims]<=[reshape_dims]T(perm)
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# mesh['a'=2,'b'=4] {'b'}, with `, device_ids=(...)` after the axes when the mesh's devices are not in iota order,
# and sub-axes written 'a':(pre_size)size.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^',=]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([^',:]+)'?(?::\((\d+)\)(\d+))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result array, per device
    groups: tuple[tuple[int, ...], ...]  # devices that communicate (none for a collective-permute)
    pairs: tuple[tuple[int, int], ...]  # a collective-permute's (source, target) devices
    executions: int  # times it runs per call of the program (trip count of enclosing loops)
    computation: str
    op_name: str

    @property
    def bytes(self) -> int:
        """Result bytes per device, per execution."""
        return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in self.shapes)

    @property
    def group_size(self) -> int:
        """Devices taking part in each group (2 for a collective-permute: a sender and a receiver)."""
        return len(self.groups[0]) if self.groups else 2 if self.pairs else 0


def iota_devices(dims: Sequence[int], reshape_dims: Sequence[int], perm: Sequence[int] | None = None) -> np.ndarray:
    """The array HLO writes `[dims]<=[reshape_dims]T(perm)`: an iota shaped `reshape_dims`, transposed by `perm`,
    reshaped to `dims`."""
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    return ids.transpose(perm or range(len(reshape_dims))).reshape(dims)


def replica_groups(line: str) -> list[list[int]] | None:
    """The groups of an HLO collective's `replica_groups`, in the op's own ids, in any of the printer's forms:
    `{{0,1},{2,3}}`, iota `[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`, or `mesh['a'=2,'b'=4] {'b'}`. An empty list means
    one group of every device (`{}`); None, that the line has no replica_groups."""
    if iota := _IOTA_GROUPS.search(line):
        return iota_devices(*(_ints(g) for g in iota.groups())).tolist()
    if mesh := _MESH_GROUPS.search(line):
        return _mesh_groups(*mesh.groups())
    if listed := _LIST_GROUPS.search(line):
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    return None


def source_target_pairs(line: str) -> list[tuple[int, int]]:
    """A collective-permute's (source, target) pairs; empty when the line has none."""
    pairs = _PAIRS.search(line)
    return [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))] if pairs else []


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x] if text is not None else None


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> list[list[int]]:
    """Groups of a `mesh[...] {...}` replica-group list, as XLA's MeshAxesReplicaGroupList computes them: reshape the
    mesh's device array so each grouped (sub-)axis is a dimension, move those dimensions last, read off rows."""
    sizes = [(name, int(size)) for name, size in _MESH_AXIS.findall(axes)]
    shape = [size for _, size in sizes]
    if device_ids is None:
        devices = np.arange(math.prod(shape))
    elif iota := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids):
        devices = iota_devices(shape, _ints(iota.group(1)), _ints(iota.group(2)))
    else:
        devices = np.array(_ints(device_ids))
    refs = [(name, int(pre or 1), int(size or 0)) for name, pre, size in _GROUP_AXIS.findall(grouped)]
    dims, grouped_dims = [], []
    for name, full in sizes:
        # This axis's grouped parts from major to minor (a whole axis is the sub-axis (1)full), with filler
        # dimensions around them; grouped dimensions keep the order they were listed in.
        parts = sorted((pre, size or full, i) for i, (ref, pre, size) in enumerate(refs) if ref == name)
        listed, prefix = {}, 1
        for pre, size, i in parts:
            if pre != prefix:
                dims.append(pre // prefix)
            listed[i], prefix = len(dims), pre * size
            dims.append(size)
        if prefix != full:
            dims.append(full // prefix)
        grouped_dims += [listed[i] for i in sorted(listed)]
    rest = [d for d in range(len(dims)) if d not in grouped_dims]
    group_size = math.prod(dims[d] for d in grouped_dims)
    return devices.reshape(dims).transpose(rest + grouped_dims).reshape(-1, group_size).tolist()


def _as_devices(
    groups: Sequence[Sequence[int]], line: str, kind: str, replicas: int, partitions: int
) -> tuple[tuple[int, ...], ...]:
    """Groups (or pairs) of the op's ids as groups of device indices. What the ids mean depends on channel_id and
    use_global_device_ids (XLA's CollectiveOpGroupMode): replica ids, partition ids, or flattened ids already. No
    groups means one of every replica, partition or device."""
    if "channel_id=" not in line:  # cross-replica: the same replica groups within each partition
        found = [[r * partitions + p for r in g] for p in range(partitions) for g in groups or [range(replicas)]]
    elif "use_global_device_ids=true" in line:  # flattened ids
        found = groups or [range(replicas * partitions)]
    elif kind in ("all-to-all", "collective-permute"):  # cross-partition: the same groups within each replica
        found = [[r * partitions + p for p in g] for r in range(replicas) for g in groups or [range(partitions)]]
    else:  # cross-replica-and-partition: each group of replicas with all their partitions
        found = [[r * partitions + p for r in g for p in range(partitions)] for g in groups or [range(replicas)]]
    return tuple(tuple(g) for g in found)


def _result_arrays(result_type: str, kind: str, started: bool) -> list[tuple[str, str]]:
    """(dtype, dims) of the arrays a collective produces. An async start returns (operands, results[, context]),
    except all-reduce-start, whose shape is its results': keep the results."""
    if started and kind != "all-reduce" and result_type.startswith("("):
        result_type = _tuple_elements(result_type)[1]
    return _ARRAY.findall(result_type)


def _tuple_elements(result_type: str) -> list[str]:
    """The top-level elements of a tuple type '(a, (b, c), d)'."""
    elements, depth, start = [], 0, 1
    for i, char in enumerate(result_type):
        depth += char in "([{"
        depth -= char in ")]}"
        if (char == "," and depth == 1) or depth == 0:
            elements.append(result_type[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return elements


def _loop_multiplicity(lines: list[str]) -> dict[str, int]:
    """How many times each computation runs per program call, from while loops' known trip counts."""
    calls: dict[str, list[tuple[str, int]]] = {}
    current = None
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            calls.setdefault(current, [])
            continue
        if current is None:
            continue
        body = _WHILE_BODY.search(line)
        trip_count = _TRIP_COUNT.search(line)
        trips = int(trip_count.group(1)) if trip_count else 1
        for callee in _CALLS.findall(line):
            calls[current].append((callee, trips if body and callee == body.group(1) else 1))
    entry = next((_COMPUTATION.match(line).group(1) for line in lines if line.startswith("ENTRY")), None)
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for callee, trips in calls.get(name, []):
            visit(callee, times * trips)

    if entry:
        visit(entry, 1)
    return counts


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in the optimized HLO module `hlo_text` (from `compiled.as_text()`)."""
    lines = hlo_text.splitlines()
    replicas, partitions = (_module_count(lines, key) for key in ("replica_count", "num_partitions"))
    runs = _loop_multiplicity(lines)
    found, current = [], ""
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, result_type, kind, started = match.groups()
        shapes = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _result_arrays(result_type, kind, bool(started))
        )
        numbering = (line, kind, replicas, partitions)  # what the op's ids mean
        groups = () if kind == "collective-permute" else _as_devices(replica_groups(line) or [], *numbering)
        pairs = source_target_pairs(line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        found.append(
            Collective(
                name,
                kind,
                shapes,
                groups,
                _as_devices(pairs, *numbering) if pairs else (),
                runs.get(current, 1),
                current,
                op_name.group(1) if op_name else "",
            )
        )
    return found


def _module_count(lines: list[str], key: str) -> int:
    """`replica_count` or `num_partitions` from the HloModule line (the printer leaves out a count of 1)."""
    found = re.search(rf"\b{key}=(\d+)", lines[0]) if lines else None
    return int(found.group(1)) if found else 1


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """Per kind: instructions in the program, executions per step, and bytes per device per step."""
    summary: dict[str, dict[str, int]] = {}
    for c in found:
        entry = summary.setdefault(c.kind, {"ops": 0, "executions": 0, "bytes": 0})
        entry["ops"] += 1
        entry["executions"] += c.executions
        entry["bytes"] += c.bytes * c.executions
    return summary
