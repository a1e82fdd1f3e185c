"""An encoder that learns: bert-tiny (2 layers, d_model 64) pre-trained as a masked language model on
tinyshakespeare's bytes, then fine-tuned as a classifier, from that checkpoint, on the built-in generated
classification task (jaxtrain/data/text_classes.py), with held-out accuracy.

    python benchmarks/bert_learning.py --out docs/results/bert_learning.json --plot docs/results/bert_learning.png

The MLM masks 15% of the bytes of each 128-byte window (80% [MASK], 10% a random byte, 10% kept) and scores the
masked positions. Its yardstick is the unigram entropy of the training bytes: the loss of a model that ignores every
context. The validation loss (`val_loss`, over `eval_batches` fixed held-out batches) is compared with it after
`MLM_STEPS`. The classifier reads the mean of the encoder's outputs through BERT's pooler; its held-out accuracy is
the loop's `val_accuracy` on rows the training never draws (the task's validation split). 2 simulated CPU devices
(data=2), as tests/test_bert_learning.py runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
DEVICES = 2
MLM_STEPS = 300
CLASSIFY_STEPS = 500
# Rotary positions: with BERT's learned table, bert-tiny's masked-byte loss stalls at 3.04-3.17 nats
# (docs/encoders.md); rotary positions give every layer the offsets between bytes from the start.
COMMON = [
    "mesh=data=2",
    "positions=rotary",
    "train.progress=false",
    "tracking.metrics_file=",
    "log_every=10",
    "eval_batches=4",
]
MLM = [*COMMON, "batch_size=32", "seq_len=128", "learning_rate=3e-3", "warmup_steps=20", "eval_every=50"]
# Mean pooling: the MLM never trains the first token ([CLS], which byte windows do not hold), and read through it the
# fine-tune reaches 0.76-0.90 in 300-600 steps where the mean reaches 1.0 in 150 (docs/encoders.md).
CLASSIFY = [*COMMON, "pooling=mean", "batch_size=32", "learning_rate=1e-3", "warmup_steps=20", "eval_every=50"]


def unigram_entropy(data: bytes) -> float:
    """Nats per byte of the bytes' own frequencies: the loss of the best prediction that reads no context."""
    counts = np.bincount(np.frombuffer(data, np.uint8), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def curve(history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in history if key in r]


def pretrain(text: Path, work: Path, seed: int, devices: list) -> dict:
    """MLM on `text` for MLM_STEPS steps, checkpointed at the end in `work`/mlm: the loss curves and the entropy."""
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train

    overrides = [*MLM, f"data.source={text}", f"steps={MLM_STEPS}", f"seed={seed}", f"checkpoint.dir={work / 'mlm'}"]
    result = train(apply_overrides(default_config("bert-tiny"), overrides), log=lambda *_: None, devices=devices)
    train_part = text.read_bytes()[: int(text.stat().st_size * 0.9)]
    return {
        "unigram_entropy": unigram_entropy(train_part),
        "loss": curve(result["history"], "loss"),
        "val_loss": curve(result["history"], "val_loss"),
        "checkpoint": str(work / "mlm" / str(MLM_STEPS)),
    }


def fine_tune(checkpoint: str, work: Path, seed: int, devices: list) -> dict:
    """The classifier from the MLM checkpoint's encoder on the built-in task: loss and held-out accuracy curves."""
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train

    overrides = [*CLASSIFY, f"steps={CLASSIFY_STEPS}", f"seed={seed}", f"checkpoint.restore={checkpoint}"]
    overrides += [f"checkpoint.dir={work / 'classifier'}", "data.source=builtin"]
    cfg = apply_overrides(default_config("bert_classifier-tiny"), overrides)
    result = train(cfg, log=lambda *_: None, devices=devices)
    return {"loss": curve(result["history"], "loss"), "val_accuracy": curve(result["history"], "val_accuracy")}


def run(text: Path, work: Path, seed: int, devices: list) -> dict:
    start = time.perf_counter()
    mlm = pretrain(text, work, seed, devices)
    classifier = fine_tune(mlm["checkpoint"], work, seed, devices)
    return {"seed": seed, "mlm": mlm, "classifier": classifier, "seconds": round(time.perf_counter() - start, 1)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for result in results:
        steps, losses = zip(*result["mlm"]["val_loss"])
        left.plot(steps, losses, marker="o", label=f"val masked-token loss, seed {result['seed']}")
        steps, accuracy = zip(*result["classifier"]["val_accuracy"])
        right.plot(steps, accuracy, marker="o", label=f"seed {result['seed']}")
    left.axhline(results[0]["mlm"]["unigram_entropy"], color="gray", linestyle="--", label="unigram entropy")
    left.set(xlabel="MLM step", ylabel="nats per masked byte", title="bert-tiny MLM on tinyshakespeare")
    right.set(xlabel="fine-tuning step", ylabel="held-out accuracy", title="classifier from the MLM checkpoint")
    right.set_ylim(0.4, 1.01)
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bert_learning"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    import jax

    from jaxtrain import use_simulated_devices

    use_simulated_devices(DEVICES)
    devices = jax.devices()[:DEVICES]
    results = []
    for seed in args.seeds:
        results.append(run(args.text, args.work / f"seed{seed}", seed, devices))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
