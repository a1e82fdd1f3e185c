"""One GPU's check of the Llama path: train llama-1b in bfloat16 with cuDNN attention and report JSON.

    python scripts/gpu_check.py                      # every variant below; results to $OUT/gpu_check.json
    python scripts/gpu_check.py --variants b8-s2048 --steps 20
    JAX_PLATFORMS=cpu python scripts/gpu_check.py --model llama-tiny --attention reference --variants b8-s2048 --steps 1

For each variant (batch x sequence length x remat policy) it compiles the train step, runs warm-up steps, then times
`--steps` steps and reports step time, tokens/s, MFU against the chip's dense bf16 peak (jaxtrain.analysis.chips;
the issue's target is >= 55% on an H200) and the device's peak memory (`memory_stats()`). It also checks that
cuDNN's fused attention is in the compiled program. Results are written after every variant, so a run cut short by
its time limit still leaves what it measured.

It runs from a checkout without installing jaxtrain (the GPU machine has JAX but may not reach a package index):
the checkout is put on sys.path and its models/ folder is imported, as `jaxtrain_models`, to register the built-in
models.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> overrides of the llama-1b preset (bfloat16 compute, float32 params, AdamW).
VARIANTS = {
    "b8-s2048": ["batch_size=8", "seq_len=2048", "remat=save_dots"],
    "b16-s2048-full": ["batch_size=16", "seq_len=2048", "remat=full"],
    "b4-s8192": ["batch_size=4", "seq_len=8192", "remat=save_dots"],
    # Issue 43's checks on a real chip (compile-only GPUs list no host memory, so the state's offload could only be
    # compiled for TPU there): 8-bit matmuls' speed against b8-s2048, and the two host offloads' device memory.
    "b8-s2048-int8": ["batch_size=8", "seq_len=2048", "remat=save_dots", "precision.matmuls=int8"],
    "b8-s2048-fp8": ["batch_size=8", "seq_len=2048", "remat=save_dots", "precision.matmuls=fp8"],
    "b8-s2048-offload-state": ["batch_size=8", "seq_len=2048", "remat=save_dots", "optimizer.offload=state"],
    "b8-s2048-remat-offload": ["batch_size=8", "seq_len=2048", "remat=offload"],
}


def register_builtin_models() -> None:
    """Imports the built-in models, which registers them: installed, `jaxtrain_models`; else this checkout's models/
    under that name (the entry point that would find them is declared by an installed jaxtrain only)."""
    if importlib.util.find_spec("jaxtrain_models") is None:
        folder = ROOT / "models"
        spec = importlib.util.spec_from_file_location(
            "jaxtrain_models", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        sys.modules["jaxtrain_models"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["jaxtrain_models"])
    import jaxtrain_models  # noqa: F401


def measure(name: str, overrides: list[str], steps: int, model: str, attention: str) -> dict:
    import jax

    from jaxtrain.analysis.flops import peak_flops
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    cfg = apply_overrides(
        default_config(model), [f"attention={attention}", "data.source=synthetic", "mesh=data=-1", *overrides]
    )
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    state = run.shardings.init_state(run.optimizer, 0)
    batch = run.batch("train", 0)
    start = time.perf_counter()
    compiled = run.train_step  # compiled on first use
    compile_s = time.perf_counter() - start
    for _ in range(3):
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps
    stats = jax.devices()[0].memory_stats() or {}
    peak, _ = peak_flops(jax.devices()[:1])
    return {
        "variant": name,
        "overrides": overrides,
        "step_time_s": round(seconds, 4),
        "tokens_per_sec": round(run.tokens_per_step / seconds, 1),
        "mfu": round(run.flops_per_step / seconds / peak, 4),
        "peak_memory_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
        "memory_limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2),
        "loss": float(metrics["loss"]),
        "compile_s": round(compile_s, 1),
        "cudnn_attention_in_hlo": "__cudnn$fmha" in compiled.as_text(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="llama-1b", help="e.g. llama-tiny for a smoke test on CPU")
    parser.add_argument("--attention", default="cudnn", help="e.g. reference for a smoke test on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    args = parser.parse_args()

    import jax

    register_builtin_models()

    out = Path(args.out) / "gpu_check.json"
    report = {"jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()], "results": []}
    for name in args.variants.split(","):
        try:
            result = measure(name, VARIANTS[name], args.steps, args.model, args.attention)
        except Exception as err:  # one variant out of memory must not lose the others' figures
            result = {"variant": name, "error": f"{type(err).__name__}: {err}"[:2000], "trace": traceback.format_exc()}
        report["results"].append(result)
        print(json.dumps(result), flush=True)
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
