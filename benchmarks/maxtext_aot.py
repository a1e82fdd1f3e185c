"""jaxtrain's compiled train step against MaxText's, on the same shapes and compile-only targets (issue 40 item 2).

    python benchmarks/maxtext_aot.py --case 1b-v5p          # Llama 3.2 1B, fsdp=64 on v5p:4x4x4 (v5p-128)
    python benchmarks/maxtext_aot.py --case 8b-v5p          # Llama 3 8B, fsdp=32,tensor=4 on v5p:4x4x8 (v5p-256)
    python benchmarks/maxtext_aot.py --case 1b-h100         # Llama 3.2 1B, fsdp=8 on h100:8
    python benchmarks/maxtext_aot.py --case 1b-v5p-pipeline # Llama 3.2 1B, GPipe pipeline=4,fsdp=16 on v5p:4x4x4
    python benchmarks/maxtext_aot.py --all                  # every case, one after another
    python benchmarks/maxtext_aot.py --case 1b-v5p --skip-maxtext            # jaxtrain's side alone
    python benchmarks/maxtext_aot.py --case 1b-v5p --reuse-maxtext           # MaxText's side from its cache
    python benchmarks/maxtext_aot.py --case 1b-v5p --layers 2 --batch-per-device 1   # a quick, smaller compile

Each case prints one JSON object (one line): both frameworks' figures per device and jaxtrain / MaxText ratios.
Nothing runs: both steps are compiled for compile-only devices (libtpu for TPU topologies, the CUDA plugin for GPU
nodes) and read from the compiled programs with the same tools:

- memory: `compiled.memory_analysis()` (arguments, outputs, aliased, temporaries, XLA's peak estimate) and the bound
  jaxtrain judges fits on, arguments + outputs - aliased + temporaries;
- collectives: `jaxtrain.analysis.hlo.collectives` of `compiled.as_text()`, loop trips included: per kind and dtype
  the result bytes per device per step, and the bytes each device sends under the bandwidth-optimal algorithm
  (`jaxtrain.analysis.comm_report.sent_per_device`);
- FLOPs: every `dot` (`jaxtrain.analysis.matmuls`) and every `convolution` (the TPU compiler writes its matmuls as
  convolutions, which `matmuls` does not read; counted here as XLA's cost analysis counts them: valid window
  positions only), times the trip counts of the loops around them. Custom-call kernels (splash attention, cuDNN
  attention) are not in it; they are listed by target with their executions;
- HBM bytes: an estimate, the bytes each top-level instruction (outside fused computations) reads and writes in HBM
  (arrays in other memory spaces, e.g. TPU VMEM `S(1)`, left out; dynamic slices and in-place dynamic updates count
  the slice), times the loop trips; collectives are left to the ICI term;
- roofline time: FLOPs / the chip's bf16 peak, HBM bytes / HBM bandwidth and sent bytes / ICI (NVLink) bandwidth
  (`jaxtrain.analysis.chips`), and the largest of the three.

MaxText runs in its own venv (benchmarks/maxtext_baseline.sh makes it at $MAXTEXT_VENV, default /tmp/maxtext_venv)
through benchmarks/maxtext_aot_compile.py, which saves MaxText's compiled HLO text and memory figures to
$MAXTEXT_AOT_CACHE/<case key> (default /tmp/maxtext_aot); --reuse-maxtext reads that cache instead of compiling (the
JSON then says when it was written, with which overrides). Both sides must use the same libtpu (the JSON's
`versions`): maxtext[tpu]==0.2.5 pulls a newer libtpu than jax[tpu]==0.12.0.1's 0.0.50.1, so pin it in MaxText's
venv (`pip install libtpu==0.0.50.1`) or the TPU programs come from different compilers. The GPU case needs the CUDA
plugin in MaxText's venv too (`pip install 'jax[cuda12-local]==0.12.0.1' 'nvidia-cudnn-cu12>=9.8,<10'`). The JSON
also records the topology each side compiled for: MaxText's TPU targets are tori (`wrap` on every side), and libtpu
compiles collectives over an open mesh differently (a gather over the whole slice as an all-reduce), so compare
`target` before reading the collectives. Results and what they show: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxtrain.analysis.chips import CHIPS, Chip  # noqa: E402
from jaxtrain.analysis.comm_report import sent_per_device  # noqa: E402
from jaxtrain.analysis.hlo import (  # noqa: E402
    DTYPE_BYTES,
    Instruction,
    Module,
    collectives,
    devices_per_program,
    loop_multiplicity,
    parse_module,
)
from jaxtrain.analysis.matmuls import matmuls, under_branches  # noqa: E402

GIB = 2**30
VENV = Path(os.environ.get("MAXTEXT_VENV", "/tmp/maxtext_venv"))
CACHE = Path(os.environ.get("MAXTEXT_AOT_CACHE", "/tmp/maxtext_aot"))
COMPANION = Path(__file__).resolve().parent / "maxtext_aot_compile.py"


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape on one target, in both frameworks' words."""

    target: str  # jaxtrain's compile target
    model: str  # jaxtrain's model preset; MaxText's shape keys are made from it (`maxtext_model_keys`)
    mesh: dict[str, int]  # jaxtrain's axes; MaxText's ici_<axis>_parallelism
    batch: int  # global batch (sequences)
    seq: int
    attention: tuple[str, str]  # (jaxtrain model.attention, MaxText attention)
    maxtext_target: tuple[str, ...]  # MaxText's keys that choose the target
    gpu: bool = False
    jaxtrain_extra: tuple[str, ...] = ()  # further settings of each side (a pipeline's schedule, microbatches)
    maxtext_extra: tuple[str, ...] = ()

    @property
    def devices(self) -> int:
        return math.prod(int(d) for d in self.target.split(":")[1].split("x"))


CASES = {
    "1b-v5p": Case(
        "v5p:4x4x4",
        "llama-1b",
        {"fsdp": 64},
        256,
        2048,
        ("splash", "flash"),
        ("compile_topology=v5p-128", "compile_topology_num_slices=1"),
    ),
    "8b-v5p": Case(
        "v5p:4x4x8",
        "llama-8b",
        {"fsdp": 32, "tensor": 4},
        256,
        2048,
        ("splash", "flash"),
        ("compile_topology=v5p-256", "compile_topology_num_slices=1"),
    ),
    "1b-h100": Case(
        "h100:8",
        "llama-1b",
        {"fsdp": 8},
        32,
        2048,
        ("cudnn", "cudnn_flash_jax"),
        ("compile_topology=a3", "compile_topology_num_slices=1", "hardware=gpu"),
        gpu=True,
    ),
    # GPipe over 4 stages of 4 layers each, 8 microbatches of 32 sequences; MaxText's pipeline with one repeat
    # (num_layers_per_pipeline_stage = layers / stages) is the same schedule. balance=uniform: 4 layers a stage as
    # MaxText places them (and the cost balance traces its layers off the mesh, where splash is refused).
    "1b-v5p-pipeline": Case(
        "v5p:4x4x4",
        "llama-1b",
        {"pipeline": 4, "fsdp": 16},
        256,
        2048,
        ("splash", "flash"),
        ("compile_topology=v5p-128", "compile_topology_num_slices=1"),
        jaxtrain_extra=("pipeline.schedule=gpipe", "pipeline.microbatches=8", "pipeline.balance=uniform"),
        maxtext_extra=("num_pipeline_microbatches=8", "num_layers_per_pipeline_stage=4"),
    ),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The two steps


def jaxtrain_overrides(case: Case, layers: int | None, batch: int) -> list[str]:
    mesh = ",".join(f"{axis}={size}" for axis, size in case.mesh.items())
    return [
        f"mesh={mesh}",
        f"data.batch_size={batch}",
        f"data.seq_len={case.seq}",
        "data.source=synthetic",
        "model.dtype=bfloat16",
        "model.remat=full",
        f"model.attention={case.attention[0]}",
        *([f"model.n_layers={layers}"] if layers else []),
        *case.jaxtrain_extra,
    ]


def compile_jaxtrain(case: Case, layers: int | None, batch: int):
    """jaxtrain's train step compiled for the case's target as `jaxtrain comm/plan --aot-topology` compile it: the
    run `build` makes on the target's compile-only devices, `compile_train_step`. (seconds, compiled, run)."""
    from jaxtrain.aot.targets import compile_target

    target = compile_target(case.target)  # before anything else starts JAX
    from jaxtrain.planner.measure import compile_train_step
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    cfg = apply_overrides(default_config(case.model), jaxtrain_overrides(case, layers, batch))
    run = build(cfg, log=lambda *_: None, devices=target.devices)
    seconds, cached = compile_train_step(run)
    if cached:
        log("jaxtrain's step came from JAX's persistent compilation cache: its compile_s is not a compile time")
    return seconds, run.train_step, run


def maxtext_model_keys(model: str, layers: int | None) -> list[str]:
    """MaxText's keys for jaxtrain's preset `model`, so that both frameworks read one shape."""
    from jaxtrain.run_config import default_config

    m = default_config(model).model
    return [
        f"base_emb_dim={m.d_model}",
        f"base_num_query_heads={m.n_heads}",
        f"base_num_kv_heads={m.n_kv_heads or m.n_heads}",
        f"head_dim={m.head_dim or m.d_model // m.n_heads}",
        f"base_mlp_dim={m.d_ff}",
        f"base_num_decoder_layers={layers or m.n_layers}",
        f"vocab_size={m.vocab_size}",
        f"logits_via_embedding={m.tie_embeddings}",
        "decoder_block=llama2",
        "mlp_activations=[silu,linear]",
        f"normalization_layer_epsilon={m.norm_eps}",
        f"rope_max_timescale={int(m.rope_base)}",
        "enable_dropout=False",
    ]


def maxtext_overrides(case: Case, layers: int | None, batch: int, key: str) -> list[str]:
    mesh = [f"ici_{axis}_parallelism={size}" for axis, size in case.mesh.items()]
    if "fsdp" not in case.mesh:
        mesh.append("ici_fsdp_parallelism=1")
    per_device = batch / case.devices  # MaxText's batch is per device, over every device
    return [
        *case.maxtext_target,
        f"run_name=aot_{key}",
        "base_output_directory=/tmp/maxtext_out",
        "dataset_type=synthetic",
        "enable_checkpointing=False",
        "skip_jax_distributed_system=True",
        "steps=10",
        *maxtext_model_keys(case.model, layers),
        f"max_target_length={case.seq}",
        f"per_device_batch_size={per_device:g}",
        *mesh,
        "remat_policy=full",
        f"attention={case.attention[1]}",
        "dtype=bfloat16",
        "weight_dtype=float32",
        *case.maxtext_extra,
    ]


def compile_maxtext(case: Case, overrides: list[str], out: Path) -> dict:
    """MaxText's step compiled in its own venv by the companion script; its record, with the HLO text added."""
    python = VENV / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no MaxText venv at {VENV}: run benchmarks/maxtext_baseline.sh 1 once, or --skip-maxtext")
    command = [str(python), str(COMPANION), str(out)]
    if case.gpu:
        spec = ROOT / "jaxtrain" / "aot" / "gpu_targets" / f"{case.target.split(':')[0]}.txtpb"
        command += ["--gpu-spec", str(spec), "--gpu-devices", str(case.devices)]
    command += overrides
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    log(f"[maxtext] {' '.join(command)}")
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (out / "maxtext.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "maxtext.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"MaxText's compile failed (rc {done.returncode}); tail of {out}/maxtext.log:\n" + _tail(done))
    record = read_maxtext(out)
    record["process_s"] = round(time.perf_counter() - start, 1)
    (out / "maxtext.json").write_text(json.dumps({k: v for k, v in record.items() if k != "hlo"}, indent=1))
    return record


def read_maxtext(out: Path) -> dict:
    record = json.loads((out / "maxtext.json").read_text())
    record["hlo"] = (out / "train_step.hlo.txt").read_text()
    return record


def _tail(done: subprocess.CompletedProcess) -> str:
    return "\n".join((done.stdout + done.stderr).splitlines()[-25:])


# ---------------------------------------------------------------------------------------------------------------
# Reading a compiled program


def figures(hlo: str, memory: dict[str, int], chip: Chip) -> dict:
    """Per-device figures of one compiled step: memory, collectives by kind and dtype, loop-corrected FLOPs, HBM
    bytes and the roofline times."""
    module = parse_module(hlo)
    runs, uncounted = loop_multiplicity(module)
    found = collectives(hlo)
    devices = devices_per_program(hlo)
    branches = under_branches(module)
    by_kind: dict[str, dict] = {}
    sent_in_branches = 0.0
    for c in found:
        sent = float(sent_per_device(c, devices).mean()) * c.executions
        sent_in_branches += sent if c.computation in branches else 0.0
        entry = by_kind.setdefault(c.kind, {"ops": 0, "executions": 0, "bytes": 0, "sent": 0.0, "dtypes": {}})
        entry["ops"] += 1
        entry["executions"] += c.executions
        entry["bytes"] += c.bytes * c.executions
        entry["sent"] += sent
        for dtype, dims in c.shapes:
            share = DTYPE_BYTES.get(dtype, 4) * math.prod(dims) * c.executions
            entry["dtypes"][dtype] = entry["dtypes"].get(dtype, 0) + share
        if c.via:
            entry.setdefault("via", {})[c.via] = entry.get("via", {}).get(c.via, 0) + c.bytes * c.executions
    collective_bytes = sum(e["bytes"] for e in by_kind.values())
    sent = sum(e["sent"] for e in by_kind.values())
    dots = matmuls(hlo)
    dot_flops = sum(m.flops * m.executions for m in dots)
    conv_flops = convolution_flops(module, runs)
    flops = dot_flops + conv_flops
    in_branches = sum(m.flops * m.executions for m in dots if not m.exact)
    in_branches += convolution_flops(module, {c: n for c, n in runs.items() if c in branches})
    hbm = hbm_bytes(module, runs)
    live = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    compute_s, hbm_s, ici_s = flops / chip.peak_bf16, hbm / chip.hbm_bw, sent / chip.ici_bw
    return {
        "memory": {
            "arguments": memory["argument"],
            "outputs": memory["output"],
            "aliased": memory["alias"],
            "temporaries": memory["temp"],
            "live_bound": live,
            "xla_peak": memory.get("peak", 0),
        },
        "collectives": {
            "result_bytes": collective_bytes,
            "sent_bytes": round(sent),
            "by_kind": {k: _rounded(v) for k, v in sorted(by_kind.items())},
            "uncounted_loops": sum(not c.exact for c in found),
            "sent_in_branches": round(sent_in_branches),
        },
        "flops": {
            "total": flops,
            "dot": dot_flops,
            "convolution": conv_flops,
            "inexact_dots": sum(not m.exact for m in dots),
            "in_branches": in_branches,
            "custom_calls": custom_calls(module, runs),
        },
        "hbm_bytes_estimate": hbm,
        "roofline_s": {
            "compute": round(compute_s, 5),
            "hbm": round(hbm_s, 5),
            "ici": round(ici_s, 5),
            "bound": round(max(compute_s, hbm_s, ici_s), 5),
        },
        "loops_uncounted": len(uncounted),
    }


def _rounded(entry: dict) -> dict:
    return {k: round(v) if isinstance(v, float) else v for k, v in entry.items()}


_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")


def convolution_flops(module: Module, runs: dict[str, int]) -> int:
    """FLOPs of every `convolution` of the program, times how often its computation runs, as XLA's
    HloCostAnalysis counts a convolution: 2 x (input features / feature groups) x output features x (batch / batch
    groups) x the (output, kernel) position pairs that land inside the unpadded input, per spatial dimension."""
    total = 0
    for computation, body in module.computations.items():
        times = runs.get(computation, 0)
        for instruction in body.values():
            if instruction.opcode == "convolution" and times:
                total += _convolution_flops(instruction, body) * times
    return total


def _convolution_flops(conv: Instruction, body: dict[str, Instruction]) -> int:
    lhs_type, rhs_type = (body[name].type for name in conv.operands[:2])
    lhs, out = _first_array(lhs_type), _first_array(conv.type)
    labels = _DIM_LABELS.search(conv.line)
    if labels is None:
        raise ValueError(f"convolution without dim_labels: {conv.line.strip()[:200]}")
    lhs_labels, _, out_labels = labels.groups()
    groups = _int_attribute(conv.line, "feature_group_count", 1)
    batch_groups = _int_attribute(conv.line, "batch_group_count", 1)
    input_features = lhs[lhs_labels.index("f")]
    output_features = out[out_labels.index("f")]
    batch = lhs[lhs_labels.index("b")]
    window = _window(conv.line)
    positions = 1
    for spatial, size in enumerate(window["size"]):
        positions *= _valid_pairs(
            input_size=lhs[lhs_labels.index(str(spatial))],
            kernel=size,
            output=out[out_labels.index(str(spatial))],
            pad_low=window["pad"][spatial][0],
            stride=window["stride"][spatial],
            lhs_dilation=window["lhs_dilate"][spatial],
            rhs_dilation=window["rhs_dilate"][spatial],
        )
    return 2 * (input_features // groups) * output_features * (batch // batch_groups) * positions


def _window(line: str) -> dict[str, list]:
    found = _WINDOW.search(line)
    fields = dict(part.split("=", 1) for part in found.group(1).split()) if found else {}
    size = [int(x) for x in fields["size"].split("x")] if "size" in fields else []
    n = len(size)

    def ints(key: str) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [1] * n

    pad = [tuple(int(x) for x in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    return {"size": size, "pad": pad, **{key: ints(key) for key in ("stride", "lhs_dilate", "rhs_dilate")}}


def _valid_pairs(
    input_size: int, kernel: int, output: int, pad_low: int, stride: int, lhs_dilation: int, rhs_dilation: int
) -> int:
    """(output position, kernel position) pairs whose input position is a real (not padded, not dilation-hole)
    element of the input."""
    o = np.arange(output, dtype=np.int64)[:, None]
    total = 0
    for start in range(0, kernel, 1024):  # a block of kernel positions at a time, to bound the memory
        k = np.arange(start, min(kernel, start + 1024), dtype=np.int64)[None, :]
        position = o * stride + k * rhs_dilation - pad_low
        valid = (position >= 0) & (position % lhs_dilation == 0) & (position // lhs_dilation < input_size)
        total += int(valid.sum())
    return total


def _int_attribute(line: str, key: str, default: int) -> int:
    found = re.search(rf"\b{key}=(\d+)", line)
    return int(found.group(1)) if found else default


def _first_array(type_text: str) -> tuple[int, ...]:
    found = _ARRAY_LAYOUT.search(type_text)
    if not found:
        raise ValueError(f"not an array type: {type_text!r}")
    return tuple(int(d) for d in found.group(2).split(",") if d)


def custom_calls(module: Module, runs: dict[str, int]) -> dict[str, int]:
    """Executions per step of each custom-call kernel (target name, with the kernel's name where the TPU compiler
    gives one), leaving out the compiler's own bookkeeping calls."""
    counted: dict[str, int] = collections.Counter()
    for computation, body in module.computations.items():
        for instruction in body.values():
            if instruction.opcode != "custom-call" or not runs.get(computation):
                continue
            target = re.search(r'custom_call_target="([^"]*)"', instruction.line)
            name = target.group(1) if target else "?"
            if name in ("AllocateBuffer", "AssumeGatherIndicesInBound", "Sharding", "SPMDFullToShardShape"):
                continue
            kernel = re.search(r'kernel_name[\\"]*[:=][\\"]*([\w.-]+)', instruction.line)
            counted[f"{name}:{kernel.group(1)}" if kernel else name] += runs[computation]
    return dict(sorted(counted.items()))


# Ops that move no bytes of their own (bookkeeping, control flow whose callees are counted) or whose bytes are
# counted elsewhere (collectives: the ICI term; an async op's -done: its -start).
_NO_HBM = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "custom-call-done",
}
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "send", "recv")


def hbm_bytes(module: Module, runs: dict[str, int]) -> int:
    """An estimate of the HBM bytes one step reads and writes: each instruction of the entry and of the loop bodies,
    conditions and branches it runs (not of fused computations, which run inside their fusion), its operands plus
    its result, times how often it runs."""
    fused = _fused_computations(module)
    total = 0
    for computation, body in module.computations.items():
        times = runs.get(computation, 0)
        if not times or computation in fused:
            continue
        for instruction in body.values():
            total += _instruction_hbm(module, body, instruction) * times
    return total


def _fused_computations(module: Module) -> set[str]:
    """Computations that run inside another instruction (fusions, reductions' and sorts' appliers, async wrappers):
    everything but the entry and the bodies, conditions and branches of control flow."""
    control = {module.entry}
    pending = [module.entry]
    while pending:
        for instruction in module.computations.get(pending.pop(), {}).values():
            if instruction.opcode in ("while", "conditional", "call"):
                for callee in instruction.called():
                    if callee not in control:
                        control.add(callee)
                        pending.append(callee)
    return set(module.computations) - control


def _hbm_array_bytes(type_text: str) -> int:
    """Bytes of the arrays of a printed type that live in HBM (memory space 0: no `S(n)` in their layout)."""
    total = 0
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(type_text):
        if re.search(r"S\([1-9]\d*\)", layout or ""):
            continue
        total += DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _instruction_hbm(module: Module, body: dict[str, Instruction], instruction: Instruction) -> int:
    opcode = instruction.opcode
    if opcode in _NO_HBM or opcode.endswith("-done") or opcode.removesuffix("-start") in _COLLECTIVE_OPS:
        return 0
    if opcode == "custom-call" and "AllocateBuffer" in instruction.line:
        return 0

    def operand(name: str) -> int:
        return _hbm_array_bytes(body[name].type) if name in body else 0

    if opcode == "copy-start":  # (destination, source, context): reads the source, writes the destination
        return operand(instruction.operands[0]) + _hbm_array_bytes(_first_element(instruction.type))
    if opcode == "dynamic-slice":
        return 2 * _hbm_array_bytes(instruction.type)
    if opcode == "dynamic-update-slice":
        return 2 * operand(instruction.operands[1])
    if opcode not in ("fusion", "fusion-start"):
        return sum(operand(name) for name in instruction.operands) + _hbm_array_bytes(instruction.type)
    called = instruction.attribute("calls") or ""
    fused, root = module.computations.get(called, {}), module.root(called)
    if opcode == "fusion-start":  # an async fusion: ((operands), results, context); its -done adds nothing
        result_type = _tuple_element(instruction.type, 1)
    else:
        result_type = instruction.type
    total = 0
    for index, name in enumerate(instruction.operands):
        full = operand(name)
        total += min(full, _parameter_reads(module, called, index, full)) if full else 0
    return total + _fused_result_bytes(fused, root, result_type)


def _parameter_reads(module: Module, computation: str, index: int, full: int) -> int:
    """Bytes a fused computation reads of its parameter `index` (`full` bytes in all): only the slices where every
    use is a dynamic-slice (through bitcasts and nested fusions), nothing where it is the buffer a
    dynamic-update-slice writes into in place, else all of it."""
    body = module.computations.get(computation, {})
    parameter = next(
        (i for i in body.values() if i.opcode == "parameter" and i.line.split("parameter(")[1].startswith(f"{index})")),
        None,
    )
    if parameter is None:
        return full
    users: dict[str, list[Instruction]] = collections.defaultdict(list)
    for i in body.values():
        for name in i.operands:
            users[name].append(i)
    total, frontier, seen = 0, [parameter.name], set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        for user in users.get(name, []):
            if user.opcode in ("bitcast", "reshape"):
                frontier.append(user.name)
            elif user.opcode == "dynamic-slice" and user.operands[0] == name:
                total += _hbm_array_bytes(user.type) or _array_bytes(user.type)
            elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
                continue  # written in place: what it writes is counted as the fusion's result
            elif user.opcode == "fusion":
                nested = user.attribute("calls") or ""
                for position, operand_name in enumerate(user.operands):
                    if operand_name == name:
                        total += _parameter_reads(module, nested, position, full)
            else:
                return full
    return total


def _array_bytes(type_text: str) -> int:
    found = _ARRAY_LAYOUT.findall(type_text)
    return sum(DTYPE_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x) for d, dims, _ in found)


def _root_updates(fused: dict[str, Instruction], root: Instruction | None) -> list[Instruction]:
    if root is None:
        return []
    elements = [fused[name] for name in root.operands if name in fused] if root.opcode == "tuple" else [root]
    return [e for e in elements if e.opcode == "dynamic-update-slice"]


def _fused_result_bytes(fused: dict[str, Instruction], root: Instruction | None, type_text: str) -> int:
    """What a fusion writes: its result, except that an in-place dynamic-update-slice writes only its update."""
    if root is None:
        return _hbm_array_bytes(type_text)
    elements = [fused[name] for name in root.operands if name in fused] if root.opcode == "tuple" else [root]
    total = 0
    for element in elements:
        if element.opcode == "dynamic-update-slice" and element.operands[1] in fused:
            total += _hbm_array_bytes(fused[element.operands[1]].type)
        else:
            total += _hbm_array_bytes(element.type)
    return total


def _first_element(tuple_type: str) -> str:
    return _tuple_element(tuple_type, 0)


def _tuple_element(tuple_type: str, index: int) -> str:
    """Element `index` of a printed tuple type '(a, (b, c), d)' (the type itself when it is not a tuple)."""
    if not tuple_type.startswith("("):
        return tuple_type
    depth, start, found = 0, 1, 0
    for i, char in enumerate(tuple_type):
        depth += char in "([{"
        depth -= char in ")]}"
        if (char == "," and depth == 1) or depth == 0:
            if found == index:
                return tuple_type[start:i]
            found, start = found + 1, i + 1
        if depth == 0:
            break
    return ""


def memory_of(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "peak": int(getattr(m, "peak_memory_in_bytes", 0) or 0),
    }


# ---------------------------------------------------------------------------------------------------------------
# The comparison


def ratios(ours: dict, theirs: dict) -> dict:
    """jaxtrain / MaxText of the headline figures."""
    pick = {
        "arguments": ("memory", "arguments"),
        "temporaries": ("memory", "temporaries"),
        "live_bound": ("memory", "live_bound"),
        "xla_peak": ("memory", "xla_peak"),
        "collective_result_bytes": ("collectives", "result_bytes"),
        "collective_sent_bytes": ("collectives", "sent_bytes"),
        "flops": ("flops", "total"),
        "hbm_bytes_estimate": ("hbm_bytes_estimate",),
        "roofline_compute_s": ("roofline_s", "compute"),
        "roofline_hbm_s": ("roofline_s", "hbm"),
        "roofline_ici_s": ("roofline_s", "ici"),
        "roofline_bound_s": ("roofline_s", "bound"),
    }
    out = {}
    for name, path in pick.items():
        a, b = ours, theirs
        for key in path:
            a, b = a[key], b[key]
        out[name] = round(a / b, 3) if b else None
    return out


def source_tree() -> dict:
    """The commit jaxtrain's side was compiled from, and the files under jaxtrain/ changed since (the figures are
    the working tree's)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "jaxtrain", "models").splitlines()]
    tree = {"commit": git("rev-parse", "--short", "HEAD") or None, "subject": git("log", "-1", "--format=%s")[:80]}
    tree["uncommitted"] = changed
    if changed:  # which working tree: the sha1 of `git diff HEAD -- jaxtrain models` (untracked files not in it)
        tree["diff_sha1"] = hashlib.sha1(git("diff", "HEAD", "--", "jaxtrain", "models").encode()).hexdigest()[:12]
    return tree


def jaxtrain_target(case: Case) -> dict:
    """The topology jaxtrain compiled for: its name and, for a TPU slice, which sides close into rings (a torus)
    where jaxtrain.aot.targets says (libtpu's own default is an open mesh)."""
    from jaxtrain.aot import targets

    chip_name, dims = targets.parse_target(case.target)
    if chip_name not in targets.TPU_CHIPS:
        return {"topology": case.target}
    wrap = getattr(targets, "wraparound", None)
    return {"topology": case.target, "wrap": list(wrap(chip_name, dims)) if wrap else "libtpu default (open mesh)"}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_case(name: str, args: argparse.Namespace) -> dict:
    case = CASES[name]
    chip = CHIPS[case.target.split(":")[0]]
    batch = args.batch_per_device * case.devices if args.batch_per_device else case.batch
    key = name + (f"-L{args.layers}" if args.layers else "") + (f"-B{batch}" if batch != case.batch else "")
    theirs_overrides = maxtext_overrides(case, args.layers, batch, key)
    out = CACHE / f"{key}-{hashlib.sha1(' '.join(theirs_overrides).encode()).hexdigest()[:8]}"
    result: dict = {
        "case": name,
        "target": case.target,
        "model": case.model,
        "layers": args.layers or None,
        "mesh": case.mesh,
        "batch": batch,
        "seq_len": case.seq,
        "chip": dataclasses.asdict(chip) | {"device_kinds": None},
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    result["chip"].pop("device_kinds")

    theirs = None
    if not args.skip_maxtext:  # MaxText first: its venv's process runs alone, then this process compiles ours
        if args.reuse_maxtext and (out / "maxtext.json").is_file():
            theirs = read_maxtext(out)
            theirs["source"] = f"cache {out}, written {theirs['written']} (--reuse-maxtext)"
        else:
            theirs = compile_maxtext(case, theirs_overrides, out)
            theirs["source"] = f"compiled now in {VENV} ({out})"
        log(f"[maxtext] compiled in {theirs['compile_s']} s")

    seconds, compiled, run = compile_jaxtrain(case, args.layers, batch)
    log(f"[jaxtrain] compiled in {seconds:.1f} s")
    hlo = compiled.as_text()
    if args.save_hlo:
        args.save_hlo.mkdir(parents=True, exist_ok=True)
        (args.save_hlo / f"jaxtrain-{key}.hlo.txt").write_text(hlo)
    ours = figures(hlo, memory_of(compiled), chip)
    result["jaxtrain"] = {
        "overrides": jaxtrain_overrides(case, args.layers, batch),
        "tree": source_tree(),
        "target": jaxtrain_target(case),
        "compile_s": round(seconds, 1),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax")},
        **ours,
    }
    if theirs is not None:
        figures_theirs = figures(theirs["hlo"], theirs["memory"], chip)
        result["maxtext"] = {
            "overrides": theirs["overrides"],
            "target": theirs.get("target"),
            "compile_s": theirs["compile_s"],
            "source": theirs["source"],
            "versions": theirs["versions"],
            **figures_theirs,
        }
        result["ratio_jaxtrain_over_maxtext"] = ratios(ours, figures_theirs)
        mismatch = [
            p
            for p in ("jax", "jaxlib", "libtpu" if not case.gpu else "jax-cuda12-plugin")
            if result["jaxtrain"]["versions"].get(p) != theirs["versions"].get(p)
        ]
        if mismatch:
            result["warning"] = f"the two sides compiled with different {', '.join(mismatch)}: see `versions`"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--case", choices=sorted(CASES), action="append", help="a case (repeatable)")
    which.add_argument("--all", action="store_true", help="every case")
    parser.add_argument("--skip-maxtext", action="store_true", help="jaxtrain's side alone")
    parser.add_argument("--reuse-maxtext", action="store_true", help="MaxText's figures from its cache if there")
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the preset (a quicker compile)")
    parser.add_argument("--batch-per-device", type=int, help="sequences per device instead of the case's batch")
    parser.add_argument("--save-hlo", type=Path, help="also write jaxtrain's compiled HLO text into this folder")
    args = parser.parse_args(argv)
    names = sorted(CASES) if args.all else args.case
    if len(names) > 1:  # one process per case: each compiles alone, for its own target
        for name in names:
            subprocess.run([sys.executable, __file__, "--case", name, *_passed_on(args)], check=False)
        return 0
    for name in names:
        print(json.dumps(run_case(name, args)), flush=True)
    return 0


def _passed_on(args: argparse.Namespace) -> list[str]:
    flags = ["--skip-maxtext"] * args.skip_maxtext + ["--reuse-maxtext"] * args.reuse_maxtext
    flags += ["--layers", str(args.layers)] * bool(args.layers)
    flags += ["--batch-per-device", str(args.batch_per_device)] * bool(args.batch_per_device)
    flags += ["--save-hlo", str(args.save_hlo)] * bool(args.save_hlo)
    return flags


if __name__ == "__main__":
    sys.exit(main())
