"""Read the collectives out of a compiled program's HLO text: which kind, how many bytes, between which devices.

This is how tests prove a sharding does what it claims, and how the communication report counts bytes. It reads the
programs of XLA:CPU, the CUDA plugin and the TPU compiler (libtpu), which write the same collectives differently:

- A collective inside a `while` body (a scanned layer stack) runs once per iteration. CPU and GPU programs carry the
  trip count in the loop's backend_config (`known_trip_count`); TPU programs do not, so it is read from the loop
  itself: the condition compares a counter in the loop state with a constant, the body adds a constant to it, and
  the caller starts it from a constant.
- Async collectives (`all-gather-start` ... `all-gather-done`) count once, with the shapes of their `-done`.
- The TPU compiler fuses an all-reduce with the dynamic-slices that keep each device's share into an
  all-reduce-scatter fusion; that is a reduce-scatter, counted with the shares' shapes.
- XLA's SPMD partitioner turns a matmul whose weight or result is sharded into a windowed einsum: a loop
  (`windowed_dot_general_body_ag` or `_rs`, the names XLA's own passes look for) that passes shards round a ring
  with collective-permutes while it multiplies. Those permutes, and the ones the compiler moved just before or
  after the loop, are counted as the all-gather or reduce-scatter they replace, with the bytes they move.
- A multi-slice TPU program is one slice's, which every slice runs; what crosses slices goes to the megascale
  runtime as `send`s, read as collectives between the slices (`via` DCN).

Devices are named by their index in the program's device assignment (replica * num_partitions + partition, XLA's
"flattened id"). A jax.jit program has one replica, so that is the partition id, which is the position in the
device assignment jit compiled for (the mesh's devices in order; see `jaxtrain.analysis.comm_report`).

    >>> text = compiled.as_text()                     # doctest: +SKIP
    >>> [(c.kind, c.groups) for c in collectives(text)]   # doctest: +SKIP
    [('all-gather', ((0, 1, 2, 3), (4, 5, 6, 7))), ...]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

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
    # 8-bit floats (FP8 training: jaxtrain.ops.quantized_matmul)
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1,
}
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = ")
_OPCODE = re.compile(r"([a-z][\w-]*)\(")
_NAME = re.compile(r"%([^\s,(){}]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")  # an element type, e.g. f32 or f8e4m3fn, and its dims
_CALLS = "body|condition|to_apply|calls|branch_computations|true_computation|false_computation"
_CALLED = re.compile(rf"\b(?:{_CALLS})=(\{{[^}}]*\}}|%[^\s,}}]+)")
_TRIP_COUNT = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"  # [dims]<=[reshape_dims]T(perm)
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# mesh['a'=2,'b'=4] {'b'}, with `, device_ids=(...)` after the axes when the mesh's devices are not in iota order,
# and sub-axes written 'a':(pre_size)size.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^',=]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([^',:]+)'?(?::\((\d+)\)(\d+))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# A multi-slice TPU program is one slice's; it hands what crosses slices (DCN) to the megascale runtime as sends:
# to the same partition of the slices listed ("{1,2}x{0:7}", slices counted from 1), or between device ids.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,]+)\}x\{(\d+):(\d+)\}"')
_MEGASCALE_PAIRS = re.compile(r"_xla_megascale_target=\{((?:\{\d+->\d+\},?)*)\}")
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}
DCN = "DCN send"  # Collective.via of a transfer between slices
# Loop bodies of XLA's windowed einsums (spmd/dot_handler.cc), by the collective they stand in for.
_WINDOWED = {"windowed_dot_general_body_ag": "all-gather", "windowed_dot_general_body_rs": "reduce-scatter"}
# Ops that pass a value on unchanged, for following a windowed einsum's permutes to and from its loop.
_FORWARDING = {"copy", "copy-start", "copy-done", "bitcast", "get-tuple-element", "tuple", "collective-permute-done"}
_SCALAR_FORWARDING = {"copy", "convert", "bitcast", "reshape"}
_FLIPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "EQ": "EQ", "NE": "NE"}


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str  # the collective it performs: one of KINDS
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result array, per device
    groups: tuple[tuple[int, ...], ...]  # devices that communicate (none for a collective-permute)
    pairs: tuple[tuple[int, int], ...]  # a collective-permute's (source, target) devices
    executions: int  # times it runs per call of the program (trip count of enclosing loops)
    computation: str
    op_name: str
    via: str = ""  # how, when not as a `kind` op: "windowed einsum", "all-reduce-scatter fusion", DCN
    exact: bool = True  # False when an enclosing loop's trip count could not be read (then counted once)

    @property
    def bytes(self) -> int:
        """Result bytes per device, per execution."""
        return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in self.shapes)

    @property
    def group_size(self) -> int:
        """Devices taking part in each group (2 for a collective-permute: a sender and a receiver)."""
        return len(self.groups[0]) if self.groups else 2 if self.pairs else 0


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # the result type as printed: 'f32[8,16]{1,0}' or a tuple '(f32[8], u32[])'
    opcode: str
    operands: tuple[str, ...]
    line: str

    def called(self) -> list[str]:
        """The computations this instruction calls (loop body and condition, fused or applied computation)."""
        return [name for group in _CALLED.findall(self.line) for name in _NAME.findall(group)]

    @property
    def op_name(self) -> str:
        """The JAX operation it was compiled from (metadata op_name), or ''."""
        found = re.search(r'op_name="([^"]*)"', self.line)
        return found.group(1) if found else ""

    def attribute(self, key: str) -> str | None:
        found = re.search(rf"\b{key}=%?([^\s,]+)", self.line)
        return found.group(1) if found else None


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module's computations, each an ordered {name: instruction} with its root, and the entry."""

    computations: dict[str, dict[str, Instruction]]
    roots: dict[str, str]
    entry: str | None
    replicas: int
    partitions: int

    def root(self, computation: str) -> Instruction | None:
        body = self.computations.get(computation, {})
        return body.get(self.roots.get(computation, ""))


def parse_module(hlo_text: str) -> Module:
    """The computations of an optimized HLO module (`compiled.as_text()`)."""
    lines = hlo_text.splitlines()
    computations: dict[str, dict[str, Instruction]] = {}
    roots, entry, current = {}, None, None
    for line in lines:
        if header := _HEADER.match(line):
            current = header.group(2)
            computations[current] = {}
            entry = current if header.group(1) else entry
        elif current is not None and (instruction := _parse_instruction(line)):
            computations[current][instruction.name] = instruction
            if line.lstrip().startswith("ROOT "):
                roots[current] = instruction.name
    counts = (_module_count(lines, key) for key in ("replica_count", "num_partitions"))
    return Module(computations, roots, entry, *counts)


def _parse_instruction(line: str) -> Instruction | None:
    """`%name = TYPE opcode(%operand, ...), attributes`; None for anything else."""
    head = _INSTRUCTION.match(line)
    if not head:
        return None
    rest = line[head.end() :]
    type_end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    opcode = _OPCODE.match(rest, type_end + 1)
    if type_end < 0 or not opcode:
        return None
    operands_end = _closing(rest, opcode.end() - 1)
    operands = tuple(_NAME.findall(rest[opcode.end() : operands_end]))
    return Instruction(head.group(2), rest[:type_end], opcode.group(1), operands, line)


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i
    return len(text)


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


def arrays(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dtype, dims) of every array in a printed type."""
    return tuple((dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(type_text))


def _tuple_elements(result_type: str) -> list[str]:
    """The top-level elements of a tuple type '(a, (b, c), d)'."""
    elements, depth, start = [], 0, 1
    for i, char in enumerate(result_type):
        depth += char in "([{"
        depth -= char in ")]}"
        if (char == "," and depth == 1) or depth == 0:
            elements.append(re.sub(r"/\*.*?\*/", "", result_type[start:i]).strip())
            start = i + 1
        if depth == 0:
            break
    return elements


class _Uses:
    """Who uses each instruction of a computation, built on first need."""

    def __init__(self, module: Module):
        self.module = module
        self._users: dict[str, dict[str, list[Instruction]]] = {}

    def of(self, computation: str, name: str) -> list[Instruction]:
        if computation not in self._users:
            users: dict[str, list[Instruction]] = {}
            for instruction in self.module.computations[computation].values():
                for operand in instruction.operands:
                    users.setdefault(operand, []).append(instruction)
            self._users[computation] = users
        return self._users[computation].get(name, [])


def _scalar_source(body: dict[str, Instruction], name: str) -> Instruction | None:
    """The instruction a scalar comes from, past copies and conversions."""
    instruction = body.get(name)
    while instruction is not None and instruction.opcode in _SCALAR_FORWARDING and instruction.operands:
        instruction = body.get(instruction.operands[0])
    return instruction


def _constant(body: dict[str, Instruction], name: str) -> int | None:
    source = _scalar_source(body, name)
    found = _CONSTANT.search(source.line) if source is not None and source.opcode == "constant" else None
    return int(found.group(1)) if found else None


def _state_index(body: dict[str, Instruction], name: str) -> int | None:
    """k when `name` is element k of the computation's (tuple) parameter: the loop state's element k."""
    source = _scalar_source(body, name)
    if source is None or source.opcode != "get-tuple-element":
        return None
    parameter = _scalar_source(body, source.operands[0])
    index = source.attribute("index")
    return int(index) if parameter is not None and parameter.opcode == "parameter" and index else None


def trip_count(module: Module, computation: str, loop: Instruction) -> int | None:
    """How many times the `while` instruction `loop` (in `computation`) runs its body; None when neither its
    backend_config nor the loop's own counter (start, step and bound all constants) says."""
    if known := _TRIP_COUNT.search(loop.line):
        return int(known.group(1))
    bound = _loop_bound(module, loop.attribute("condition"))
    if bound is None:
        return None
    index, direction, limit = bound
    start = _loop_start(module.computations[computation], loop, index)
    step = _loop_step(module, loop.attribute("body"), index)
    if start is None or not step:
        return None
    span = limit - start if step > 0 else start - limit
    step = abs(step)
    runs = {"LT": -(-span // step), "GT": -(-span // step), "LE": span // step + 1, "GE": span // step + 1}
    if direction == "NE":
        return span // step if span % step == 0 and span >= 0 else None
    return max(0, runs[direction]) if direction in runs else None


def _loop_bound(module: Module, condition: str | None) -> tuple[int, str, int] | None:
    """(state index, direction, constant) of a loop condition `compare(state[k], constant)`."""
    root = module.root(condition or "")
    direction = root.attribute("direction") if root is not None and root.opcode == "compare" else None
    if direction is None or len(root.operands) != 2:
        return None
    body = module.computations[condition]
    left, right = root.operands
    if (index := _state_index(body, left)) is not None and (limit := _constant(body, right)) is not None:
        return index, direction, limit
    if (index := _state_index(body, right)) is not None and (limit := _constant(body, left)) is not None:
        return index, _FLIPPED[direction], limit
    return None


def _loop_start(caller: dict[str, Instruction], loop: Instruction, index: int) -> int | None:
    state = caller.get(loop.operands[0]) if loop.operands else None
    while state is not None and state.opcode == "copy":
        state = caller.get(state.operands[0])
    if state is None or state.opcode != "tuple" or index >= len(state.operands):
        return None
    return _constant(caller, state.operands[index])


def _loop_step(module: Module, body_name: str | None, index: int) -> int | None:
    """c when the loop body's next state[k] is state[k] + c (or - c)."""
    root = module.root(body_name or "")
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    body = module.computations[body_name]
    update = _scalar_source(body, root.operands[index])
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    a, b = update.operands
    sign = -1 if update.opcode == "subtract" else 1
    if _state_index(body, a) == index and (c := _constant(body, b)) is not None:
        return sign * c
    if update.opcode == "add" and _state_index(body, b) == index and (c := _constant(body, a)) is not None:
        return c
    return None


def loop_multiplicity(module: Module) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per program call, and the computations inside a loop whose trip count
    could not be read (counted as one trip)."""
    counts: dict[str, int] = {}
    uncounted: set[str] = set()

    def visit(name: str, times: int, exact: bool) -> None:
        counts[name] = counts.get(name, 0) + times
        if not exact:
            uncounted.add(name)
        for instruction in module.computations.get(name, {}).values():
            loop = instruction.opcode == "while"
            trips = trip_count(module, name, instruction) if loop else 1
            body = instruction.attribute("body") if loop else None
            for callee in instruction.called():
                if callee == body:
                    visit(callee, times * (1 if trips is None else trips), exact and trips is not None)
                else:
                    visit(callee, times, exact)

    if module.entry:
        visit(module.entry, 1, True)
    return counts, uncounted


def _windowed_loops(module: Module) -> dict[str, str]:
    """Each computation that runs inside a windowed einsum loop, with the collective that loop stands in for."""
    found: dict[str, str] = {}

    def mark(name: str, kind: str) -> None:
        if name not in found:
            found[name] = kind
            for instruction in module.computations.get(name, {}).values():
                for callee in instruction.called():
                    mark(callee, kind)

    for body in module.computations:
        kind = next((kind for prefix, kind in _WINDOWED.items() if prefix in body), None)
        if kind:
            mark(body, kind)
    return found


def _windowed_kind(
    module: Module, uses: _Uses, windowed: dict[str, str], computation: str, permute: Instruction
) -> str | None:
    """The collective a collective-permute stands in for when it belongs to a windowed einsum: it runs in the loop,
    or it comes from the same matmul and feeds the loop its first shard (an all-gather's) or moves the loop's last
    partial sum on (a reduce-scatter's)."""
    if computation in windowed:
        return windowed[computation]
    body = module.computations[computation]
    sources = _reached(body, permute.operands[:1], lambda i: [body[o] for o in i.operands[:1] if o in body])
    consumers = _reached(body, [permute.name], lambda i: uses.of(computation, i.name))
    for instruction in (*sources, *consumers):
        kind = windowed.get(instruction.attribute("body") or "") if instruction.opcode == "while" else None
        if kind and instruction.op_name == permute.op_name:
            return kind
    return None


def _reached(body: dict[str, Instruction], start: Sequence[str], step) -> Iterator[Instruction]:
    """Instructions reached from `start` by `step` (operands or users) through ops that forward a value; each
    reached instruction is yielded, and walked on from only when it forwards."""
    frontier = [body[name] for name in start if name in body]
    seen = set()
    while frontier:
        instruction = frontier.pop()
        if instruction.name in seen:
            continue
        seen.add(instruction.name)
        yield instruction
        if instruction.opcode in _FORWARDING or instruction.opcode.startswith("collective-permute"):
            frontier += step(instruction)


def _fused_reduce_scatter(uses: _Uses, computation: str, reduce: Instruction) -> tuple | None:
    """The shares' (dtype, dims) when `reduce`, an all-reduce in a fused computation, only feeds dynamic-slices:
    the TPU compiler's all-reduce-scatter fusion, which runs as a reduce-scatter."""
    slices, frontier = [], list(uses.of(computation, reduce.name))
    while frontier:
        user = frontier.pop()
        if user.opcode == "get-tuple-element":
            frontier += uses.of(computation, user.name)
        elif user.opcode == "dynamic-slice":
            slices.append(user)
        else:
            return None
    return tuple(array for s in slices for array in arrays(s.type)) if slices else None


def collectives(hlo_text: str, device_ids: Sequence[int] = ()) -> list[Collective]:
    """Every collective in the optimized HLO module `hlo_text` (from `compiled.as_text()`). In a multi-slice TPU
    program, device indices past the slice's own (replicas x partitions) are those of the later slices, in order;
    its transfers between device ids are read with `device_ids`, the ids of the program's devices in order."""
    program = _Program(parse_module(hlo_text))
    found = []
    for computation, body in program.module.computations.items():
        for instruction in body.values():
            if instruction.opcode.removesuffix("-start") in KINDS:
                found.append(program.collective(computation, instruction))
            elif instruction.opcode == "send" and _MEGASCALE.search(instruction.line):
                found.append(program.between_slices(computation, instruction, device_ids))
    return found


def devices_per_program(hlo_text: str) -> int:
    """The devices one copy of the program spans (replicas x partitions): all of them, or one TPU slice's."""
    lines = hlo_text.split("\n", 1)[:1]
    return _module_count(lines, "replica_count") * _module_count(lines, "num_partitions")


class _Program:
    """A module with what reading its collectives needs: loop counts, windowed einsums, fusions, users."""

    def __init__(self, module: Module):
        self.module = module
        self.runs, self.uncounted = loop_multiplicity(module)
        self.windowed = _windowed_loops(module)
        self.fusions = _fusions(module)
        self.uses = _Uses(module)

    def collective(self, computation: str, instruction: Instruction) -> Collective:
        module, opcode = self.module, instruction.opcode.removesuffix("-start")
        kind, via, shapes = opcode, "", _result_shapes(self.uses, computation, instruction)
        fusion = self.fusions.get(computation)
        if opcode == "collective-permute":
            if replaced := _windowed_kind(module, self.uses, self.windowed, computation, instruction):
                kind, via = replaced, "windowed einsum"
        elif opcode == "all-reduce" and fusion is not None:
            if shares := _fused_reduce_scatter(self.uses, computation, instruction):
                kind, via, shapes = "reduce-scatter", "all-reduce-scatter fusion", shares
        numbering = (instruction.line, opcode, module.replicas, module.partitions)  # what the op's ids mean
        pairs = source_target_pairs(instruction.line)
        return Collective(
            name=instruction.name,
            kind=kind,
            shapes=shapes,
            groups=() if pairs else _as_devices(replica_groups(instruction.line) or [], *numbering),
            pairs=_as_devices(pairs, *numbering) if pairs else (),
            executions=self.runs.get(computation, 1),
            computation=computation,
            op_name=instruction.op_name or (fusion.op_name if fusion is not None else ""),
            via=via,
            exact=computation not in self.uncounted,
        )

    def between_slices(self, computation: str, send: Instruction, device_ids: Sequence[int]) -> Collective:
        """A megascale send: its operand crosses slices, to the devices its target names."""
        transfer = _MEGASCALE.search(send.line).group(1)
        if transfer not in _MEGASCALE_KINDS:
            raise ValueError(
                f"{send.name}: unknown megascale transfer type {transfer!r} (known: {list(_MEGASCALE_KINDS)})"
            )
        groups, pairs = _megascale_targets(send, self.module.replicas * self.module.partitions, device_ids)
        return Collective(
            name=send.name,
            kind=_MEGASCALE_KINDS[transfer],
            shapes=arrays(_tuple_elements(send.type)[0]) if send.type.startswith("(") else arrays(send.type),
            groups=groups,
            pairs=pairs,
            executions=self.runs.get(computation, 1),
            computation=computation,
            op_name=send.op_name,
            via=DCN,
            exact=computation not in self.uncounted,
        )


def _megascale_targets(send: Instruction, per_slice: int, device_ids: Sequence[int]) -> tuple[tuple, tuple]:
    """(groups, pairs) of a megascale send in device indices across slices (slice s's partition p is
    s * per_slice + p)."""
    if listed := _MEGASCALE_SLICES.search(send.line):
        slices, first, last = _ints(listed.group(1)), int(listed.group(2)), int(listed.group(3))
        return tuple(tuple((s - 1) * per_slice + p for s in slices) for p in range(first, last + 1)), ()
    if listed := _MEGASCALE_PAIRS.search(send.line):
        index = {device: i for i, device in enumerate(device_ids)}
        ids = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+)->(\d+)\}", listed.group(1))]
        if missing := sorted({d for pair in ids for d in pair} - index.keys()):
            raise ValueError(f"{send.name} sends between device ids {missing[:4]}: pass the program's device ids")
        return (), tuple((index[a], index[b]) for a, b in ids)
    raise ValueError(f"{send.name}: cannot read its megascale target: {send.line[:200]}")


def _result_shapes(uses: _Uses, computation: str, instruction: Instruction) -> tuple:
    """(dtype, dims) of the arrays a collective produces: an async start's are those of its `-done`."""
    if not instruction.opcode.endswith("-start"):
        return arrays(instruction.type)
    done = instruction.opcode.removesuffix("-start") + "-done"
    for user in uses.of(computation, instruction.name):
        if user.opcode == done:
            return arrays(user.type)
    # No -done in sight: a start's tuple is (operands, results, context...), except an all-reduce-start's, which
    # XLA:CPU writes as its results.
    if instruction.opcode == "all-reduce-start" or not instruction.type.startswith("("):
        return arrays(instruction.type)
    return arrays(_tuple_elements(instruction.type)[1])


def _fusions(module: Module) -> dict[str, Instruction]:
    """Each fused computation, with the fusion instruction that calls it."""
    return {
        callee: instruction
        for body in module.computations.values()
        for instruction in body.values()
        if instruction.opcode == "fusion"
        for callee in instruction.called()
    }


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
