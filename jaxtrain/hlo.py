"""Read the collectives out of a compiled program's HLO text: which kind, how many bytes, over which devices.

This is how tests prove a sharding does what it claims, and how the communication report counts bytes. A collective
inside a `while` body (a scanned layer stack) runs once per iteration; `executions` uses XLA's known trip count.

    >>> text = compiled.as_text()                     # doctest: +SKIP
    >>> [c.kind for c in collectives(text)]           # doctest: +SKIP
    ['all-gather', 'all-reduce', ...]
"""

from __future__ import annotations

import dataclasses
import math
import re

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
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%([^\s,}]+)")
_WHILE_BODY = re.compile(r" while\(.*body=%([^\s,]+)")
_TRIP_COUNT = re.compile(r'known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result array, per device
    group_size: int  # devices taking part in each group
    executions: int  # times it runs per call of the program (trip count of enclosing loops)
    computation: str
    op_name: str

    @property
    def bytes(self) -> int:
        """Result bytes per device, per execution."""
        return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in self.shapes)


def _group_size(line: str) -> int:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return 2 if pairs else 0


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
        name, result_type, kind = match.groups()
        shapes = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(result_type)
        )
        op_name = re.search(r'op_name="([^"]*)"', line)
        found.append(
            Collective(
                name,
                kind,
                shapes,
                _group_size(line),
                runs.get(current, 1),
                current,
                op_name.group(1) if op_name else "",
            )
        )
    return found


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """Per kind: instructions in the program, executions per step, and bytes per device per step."""
    summary: dict[str, dict[str, int]] = {}
    for c in found:
        entry = summary.setdefault(c.kind, {"ops": 0, "executions": 0, "bytes": 0})
        entry["ops"] += 1
        entry["executions"] += c.executions
        entry["bytes"] += c.bytes * c.executions
    return summary
