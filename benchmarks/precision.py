"""Low-precision training, measured two ways: how it learns here (CPU), and what it saves on the chips (programs
compiled for TPU v5p and H100, which do not depend on this machine's load). Prints one JSON report; draws the
curves as a PNG (with the `plot` extra installed).

    python benchmarks/precision.py                                  # both parts (~10 min on 2 cores)
    python benchmarks/precision.py --only curves --steps 500 --out docs/results/precision.json \
        --plot docs/results/precision.png

- curves: llama-tiny on tinyshakespeare (../shared/data; the built-in text when absent), one CPU device, the same
  seed and batches, for each mode: bf16 (the compute dtype), int8 and fp8 (precision.matmuls), and bf16 with the
  optimizer state offloaded (optimizer.offload=state: on CPU the same numbers). Validation loss every
  `--eval-every` steps; the final one against bf16's; the median step time, for the record only (XLA:CPU has no
  8-bit matrix units: it widens the operands).
- compiled: Llama 3.2 1B's shapes (`--layers` of its 16 blocks, to keep compiles short) under mesh=fsdp=8 on
  v5p:2x2x2 and h100:8, per mode (also the host offloads, docs/memory.md): per-device arguments and temporaries
  in device and host memory (`memory_analysis`), all-gather bytes per device by element type, and the element types
  the dots multiply.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"
os.environ.setdefault("JAXTRAIN_DATA_DIR", str(SHARED_DATA))
# Every run here is on CPU or compile-only; with CPU JAX's only backend, the TPU and GPU targets can be made after the
# curves have run (jaxtrain.aot.targets).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = {
    "bf16": [],
    "int8": ["precision.matmuls=int8"],
    "fp8": ["precision.matmuls=fp8"],
    "bf16, optimizer state offloaded": ["optimizer.offload=state"],  # on CPU, host and device memory are one
}
COMPILED_MODES = {
    "bf16": [],
    "bf16, 8-bit gather": ["precision.gather=8bit"],
    "int8": ["precision.matmuls=int8"],
    "int8, 8-bit gather": ["precision.matmuls=int8", "precision.gather=8bit"],
    "fp8": ["precision.matmuls=fp8"],
    "fp8, 8-bit gather": ["precision.matmuls=fp8", "precision.gather=8bit"],
    "bf16, optimizer state offloaded": ["optimizer.offload=state"],
    "bf16, remat=offload": ["remat=offload"],
}
# Compile-only GPU devices list no host memory in JAX 0.12, so the state's offload is refused there (docs/memory.md).
NOT_ON = {"v5p": ("fp8",), "h100": ("bf16, optimizer state offloaded",)}
TARGETS = ("v5p:2x2x2", "h100:8")
# A dot's operand: the element type of an HLO array, e.g. "s8[256,64]{1,0}" or "f8e4m3fn[...]".
EIGHT_BIT = ("s8", "u8", "f8e4m3fn", "f8e5m2")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def curves(args) -> dict:
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train

    text = SHARED_DATA / "tinyshakespeare.txt"
    source = str(text) if text.is_file() else "builtin"
    base = [
        "mesh=data=1", f"data.source={source}", f"steps={args.steps}", "batch_size=16", "seq_len=128",
        f"eval_every={args.eval_every}", "eval_batches=8", "log_every=10", "dtype=bfloat16", "progress=false",
        "learning_rate=3e-3", f"warmup_steps={args.steps // 10}",
    ]  # fmt: skip
    out = {}
    for name, overrides in MODES.items():
        log(f"curves: {name}")
        cfg = apply_overrides(default_config("llama-tiny"), [*base, *overrides])
        summary = train(cfg, log=lambda *_: None, devices=__import__("jax").devices()[:1])
        points = [r for r in summary["history"] if "val_loss" in r]
        times = [r["step_time_s"] for r in summary["history"] if "step_time_s" in r][1:]  # the first compiles
        out[name] = {
            "step": [r["step"] for r in points],
            "val_loss": [round(r["val_loss"], 4) for r in points],
            "final_val_loss": round(points[-1]["val_loss"], 4),
            "median_step_time_s": round(statistics.median(times), 4) if times else None,
        }
    reference = out["bf16"]["final_val_loss"]
    for name in out:
        out[name]["vs_bf16"] = round(out[name]["final_val_loss"] / reference, 4)
    return {"model": "llama-tiny", "data": source, "steps": args.steps, "modes": out}


def compiled_modes(args) -> dict:
    from jaxtrain.analysis.hlo import DTYPE_BYTES, collectives
    from jaxtrain.aot.targets import compile_target
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    base = ["seq_len=2048", "dtype=bfloat16", "remat=full", f"batch_size={args.batch}", f"n_layers={args.layers}"]
    report: dict = {"model": f"llama-1b with {args.layers} of its 16 layers", "mesh": "fsdp=8", "targets": {}}
    for target_name in TARGETS:
        target = compile_target(target_name)
        rows = {}
        for name, overrides in COMPILED_MODES.items():
            if any(name.startswith(mode) for mode in NOT_ON[target_name.split(":")[0]]):
                continue  # refused there: v5p has no FP8 matrix units; see NOT_ON
            log(f"compiled: {target_name} {name}")
            start = time.perf_counter()
            cfg = apply_overrides(default_config("llama-1b"), [*base, *overrides, "mesh=fsdp=8"])
            step = build(cfg, log=lambda *_: None, devices=target.devices).train_step
            text, memory = step.as_text(), step.memory_analysis()
            gathers: dict[str, int] = collections.Counter()
            for found in collectives(text):
                if found.kind == "all-gather":  # the compilers combine gathers of several types into one
                    for dtype, dims in found.shapes:
                        gathers[dtype] += DTYPE_BYTES[dtype] * math.prod(dims) * found.executions
            rows[name] = {
                "arguments_bytes": memory.argument_size_in_bytes,
                "temporaries_bytes": memory.temp_size_in_bytes,
                "host_arguments_bytes": memory.host_argument_size_in_bytes,
                "host_temporaries_bytes": memory.host_temp_size_in_bytes,
                "all_gather_bytes": dict(gathers),
                "dot_operand_types": dot_operand_types(text),
                "compile_s": round(time.perf_counter() - start, 1),
            }
        report["targets"][target_name] = rows
    return report


def dot_operand_types(hlo: str) -> dict[str, int]:
    """How many dots (GPU) or convolutions (TPU writes its matmuls as convolutions) multiply operands of each
    element type, read from the operands' definitions in the optimized HLO."""
    defined = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", hlo, re.M))
    counts: collections.Counter = collections.Counter()
    for operands in re.findall(r" (?:dot|convolution)\((%[\w.\-]+), (%[\w.\-]+)\)", hlo):
        counts["x".join(defined.get(o, "?") for o in operands)] += 1
    return dict(counts)


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: pip install -e .[plot] (matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in report["curves"]["modes"].items():
        ax.plot(c["step"], c["val_loss"], marker=".", label=f"{name} ({c['final_val_loss']})")
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="llama-tiny on tinyshakespeare")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("curves", "compiled"))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2, help="of llama-1b's 16, for the compiled part")
    parser.add_argument("--batch", type=int, default=16, help="global batch of the compiled part")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    report = {}
    if args.only in (None, "curves"):
        report["curves"] = curves(args)
    if args.only in (None, "compiled"):
        report["compiled"] = compiled_modes(args)
    if args.plot and "curves" in report:
        report["plot"] = plot(report, args.plot)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
