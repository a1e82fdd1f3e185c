"""QLoRA's loss against LoRA's: the same pre-trained base, adapters, data and steps, with the base stored as float32
(LoRA), int8, int4 and nf4 (`lora.quantize`). Prints one JSON report and draws the curves into a PNG (with the
`plot` extra installed).

    python benchmarks/qlora_curve.py                               # ~4 min on 2 CPU cores
    python benchmarks/qlora_curve.py --pretrain 300 --steps 200 --out docs/results/qlora_curve.png
    python benchmarks/qlora_curve.py --tpu-bytes        # the base's bytes per device on v5p:2x2x2 (libtpu, ~1 min)

gpt-tiny is first trained whole on the built-in text for `--pretrain` steps, so the base is a trained model, whose
weights quantization must keep; then each variant fine-tunes rank-8 adapters on attention and MLP from it on other
text, tinyshakespeare (../shared/data; the built-in text when absent), for `--steps` steps, on one CPU device, the
same batches in the same order. The right panel shows each curve minus LoRA's.

`--tpu-bytes` instead compiles the LoRA train step for v5p:2x2x2 (fsdp=8, compile-only devices) with each base and
reports its argument bytes per device: everything but the base is the same in each, so the difference from the
float32 base's step is the base's (tests/test_qlora.py asserts the int8 ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"  # beside the checkout, where the project's data lives
os.environ.setdefault("JAXTRAIN_DATA_DIR", str(SHARED_DATA))

DIFF = "loss minus LoRA's"
VARIANTS = {"LoRA (float32 base)": "none", "QLoRA int8": "int8", "QLoRA int4": "int4", "QLoRA nf4": "nf4"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


COMMON = ["mesh=data=1", "batch_size=16", "seq_len=64", "progress=false"]


def fine_tuning_text() -> str:
    text = SHARED_DATA / "tinyshakespeare.txt"
    return str(text) if text.is_file() else "builtin"


def build_run(overrides: list[str]):
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    return build(apply_overrides(default_config("gpt-tiny"), overrides), log=lambda *_: None, devices=jax.devices()[:1])


def losses(run, steps: int, params=None) -> tuple[list[float], dict]:
    """The training loss of each of `steps` steps from `run`'s initialisation (or from base `params`), and the
    final state."""
    state = run.shardings.init_state(run.optimizer, run.cfg.train.seed, params)
    out = []
    for step in range(steps):
        state, metrics = run.train_step(state, run.batch("train", step))
        out.append(float(metrics["loss"]))
    return out, state


def pretrained(args) -> dict:
    """gpt-tiny's params (model order) after `args.pretrain` steps of whole-model training."""
    run = build_run([*COMMON, "data.source=builtin", f"steps={args.pretrain}", "learning_rate=0.003"])
    curve, state = losses(run, args.pretrain)
    log(f"pretrained {args.pretrain} steps: loss {curve[0]:.3f} -> {np.mean(curve[-10:]):.3f}")
    return jax.device_get(run.shardings.params_in_model_order(state["params"]))


# Shapes whose per-device arrays fill TPU tiles, so bytes are the arrays' own (as tests/test_qlora.py's TPU_MODEL).
TPU_MODEL = ["n_layers=2", "d_model=512", "n_heads=4", "d_ff=2048", "seq_len=128", "batch_size=8", "lora.rank=8"]


def tpu_bytes() -> dict:
    """Per lora.quantize: the compiled step's argument bytes per device and the base's share of them."""
    from jaxtrain.aot.targets import compile_target
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    devices = compile_target("v5p:2x2x2").devices
    args = {}
    for kind in ("none", "int8", "int4", "nf4"):
        cfg = apply_overrides(default_config("gpt-tiny"), [*TPU_MODEL, f"lora.quantize={kind}", "mesh=fsdp=8"])
        run = build(cfg, log=lambda *_: None, devices=devices)
        args[kind] = run.train_step.memory_analysis().argument_size_in_bytes
        if kind == "none":  # the float32 base's bytes per device, from its shapes and shardings
            model = run.shardings.model
            bases = model.base_params(run.shardings.abstract_state["params"])
            weights = [bases[path[0]][path[1]] for path in model.targets]
            float_base = sum(int(np.prod(w.sharding.shard_shape(w.shape))) * 4 for w in weights)
        log(f"{kind}: {args[kind]:,} argument bytes per device")
    base = {kind: float_base - (args["none"] - n) for kind, n in args.items()}
    return {
        "target": "v5p:2x2x2, mesh fsdp=8",
        "model": "gpt-tiny " + " ".join(TPU_MODEL),
        "argument_bytes_per_device": args,
        "base_bytes_per_device": base,
        "base_ratio_to_float32": {kind: round(b / float_base, 4) for kind, b in base.items()},
        "base_ratio_to_bfloat16": {kind: round(2 * b / float_base, 4) for kind, b in base.items()},
    }


def shrink(png: Path) -> Path:
    """`png` rewritten with a 64-colour palette: a third of the bytes, the same picture (it is kept in docs/)."""
    from PIL import Image  # matplotlib's own dependency

    Image.open(png).convert("RGB").quantize(colors=64).save(png, optimize=True)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrain", type=int, default=300, help="whole-model steps that make the base")
    parser.add_argument("--steps", type=int, default=200, help="adapter steps per variant")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "qlora_curve.png"))
    parser.add_argument("--tpu-bytes", action="store_true", help="measure the base's TPU bytes instead")
    args = parser.parse_args(argv)
    if args.tpu_bytes:
        print(json.dumps(tpu_bytes(), indent=2))
        return 0
    base = pretrained(args)
    adapters = ["lora.rank=8", "lora.alpha=16", f"steps={args.steps}", "learning_rate=0.003", "warmup_steps=10"]
    curves = {}
    for label, kind in VARIANTS.items():
        log(f"{label}: {args.steps} steps")
        run = build_run([*COMMON, f"data.source={fine_tuning_text()}", *adapters, f"lora.quantize={kind}"])
        curves[label], _ = losses(run, args.steps, base)
    reference = np.array(curves["LoRA (float32 base)"])
    report = {
        "model": "gpt-tiny",
        "pretrain_steps": args.pretrain,
        "adapter_steps": args.steps,
        "fine_tuning_data": Path(fine_tuning_text()).name,
        "variants": {
            label: {
                "lora.quantize": VARIANTS[label],
                "first_loss": round(curve[0], 4),
                "last10_mean_loss": round(float(np.mean(curve[-10:])), 4),
                "max_abs_diff_vs_lora": round(float(np.max(np.abs(np.array(curve) - reference))), 4),
            }
            for label, curve in curves.items()
        },
    }
    try:
        from scripts.plot_metrics import plot

        records = {
            label: [{"step": i + 1, "loss": v, DIFF: v - r} for i, (v, r) in enumerate(zip(c, reference))]
            for label, c in curves.items()
        }
        report["png"] = str(shrink(plot(records, Path(args.out), keys=["loss", DIFF], smooth=0.9)))
    except ImportError as err:
        log(f"no plot: {err}")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
