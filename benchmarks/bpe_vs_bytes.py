"""A BPE against bytes: the same tiny Llama, steps and batch, trained on tinyshakespeare as 2,048 BPE tokens and as
bytes; validation loss in nats per byte, so the two are comparable. Prints JSON, draws a PNG (the `plot` extra).

    python benchmarks/bpe_vs_bytes.py --out docs/results           # ~3 min on 2 cores, 8 simulated CPU devices

The text is split once: the first 90% trains (the BPE is trained on it too), the last 10% is held out. Both runs
go through `jaxtrain tokenize` (bytes as a BPE of no merges: 256 bytes and <|endoftext|>), so both curves are on
the same validation paragraphs (5% of the 90%); the final figure of each is on the held-out 10%, in nats per byte
of its paragraphs' text (each paragraph closed by <|endoftext|>, as in training).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
BYTE_VOCAB = 257  # a byte-level BPE of no merges
RUN = ["batch_size=16", "seq_len=128", "warmup_steps=20", "learning_rate=3e-3", "eval_batches=4", "progress=false"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def nats_per_byte(summary: dict, stream: np.ndarray, n_bytes: int) -> float:
    """The trained model's mean loss on `stream` (token ids of a text of `n_bytes` bytes), in nats per byte: its
    loss per token (windows of seq_len + 1, every token a target once) times tokens per byte."""
    run = summary["run"]
    seq_len, batch_size = run.cfg.data.seq_len, run.cfg.data.batch_size
    windows = np.stack([stream[i : i + seq_len + 1] for i in range(0, len(stream) - seq_len - 1, seq_len)])
    shape = jax.ShapeDtypeStruct((batch_size, seq_len + 1), np.int32)
    sharding = run.shardings.abstract_batch({"tokens": shape})["tokens"].sharding
    losses = []
    for start in range(0, len(windows) - batch_size + 1, batch_size):
        batch = {"tokens": jax.device_put(windows[start : start + batch_size].astype(np.int32), sharding)}
        losses.append(float(run.compiled_eval(summary["state"]["params"], batch)["loss"]))
    return float(np.mean(losses)) * len(stream) / n_bytes


def compare(text: Path, work: Path, steps: int = 300, vocab: int = 2048, model: str = "llama-tiny") -> dict:
    """Train `model` on `text` as bytes and as a BPE of `vocab` tokens for `steps` steps; their validation curves
    and final nats/byte on the held-out last 10%."""
    raw = text.read_bytes()
    cut = int(len(raw) * 0.9)
    (work / "train.txt").write_bytes(raw[:cut])
    (work / "held_out.txt").write_bytes(raw[cut:])
    out = {"steps": steps, "model": model, "run": RUN}
    # Bytes are a byte-level BPE of no merges: the 256 bytes and <|endoftext|>. Both read the same documents.
    for name, size in (("bytes", BYTE_VOCAB), ("bpe", vocab)):
        log(f"training on {name}")
        out[name] = train_on(work, name, size, model, steps)
    return out


def train_on(work: Path, name: str, vocab: int, model: str, steps: int) -> dict:
    """Tokenize the training text with a BPE of `vocab` tokens, train `model` on it; the curve and the held-out
    figure in nats per byte. The held-out text is read as the training text is: paragraphs, each closed by
    <|endoftext|>."""
    from jaxtrain.data.shards import text_documents, tokenize
    from jaxtrain.data.tokenizer import train_bpe
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train

    tokenizer = train_bpe([work / "train.txt"], vocab, work / f"{name}.json")
    manifest = tokenize(
        work / f"{name}.json",
        [work / "train.txt"],
        work / name,
        documents="paragraphs",
        val_fraction=0.05,
        progress=False,
    )
    val = manifest["splits"]["val"]
    data = [f"data.source=tokens:{work / name}", f"steps={steps}", f"eval_every={steps // 10}"]
    cfg = apply_overrides(default_config(model), [*RUN, *data])
    summary = train(cfg, log=lambda *_: None)
    paragraphs = text_documents(work / "held_out.txt", "paragraphs")
    stream = np.concatenate([[*ids, tokenizer.eot_id] for ids in tokenizer.encode_batch(paragraphs)])
    n_bytes = sum(len(p.encode("utf-8")) for p in paragraphs)
    return {
        "vocab_size": cfg.model.vocab_size,
        "params": cfg.model.num_params(),
        "curve_nats_per_byte": [
            (r["step"], r["val_loss"] * val["tokens"] / val["text_bytes"])
            for r in summary["history"]
            if "val_loss" in r
        ],
        "held_out_nats_per_byte": nats_per_byte(summary, stream, n_bytes),
        "held_out_tokens_per_byte": len(stream) / n_bytes,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name in ("bytes", "bpe"):
        steps, values = zip(*report[name]["curve_nats_per_byte"])
        axes.plot(steps, values, label=f"{name} (vocab {report[name]['vocab_size']})")
    axes.set(xlabel="step", ylabel="validation nats / byte", title=f"{report['model']}, same steps: BPE vs bytes")
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="write bpe_vs_bytes.json and .png here")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    with tempfile.TemporaryDirectory() as work:
        report = compare(TEXT, Path(work), args.steps, args.vocab)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bpe_vs_bytes.json").write_text(json.dumps(report, indent=1) + "\n")
        plot(report, args.out / "bpe_vs_bytes.png")


if __name__ == "__main__":
    main()
