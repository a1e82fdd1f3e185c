"""Supervised fine-tuning that learns: a tiny Llama pre-trained here on plain-text string transforms, then fine-tuned
on the same transforms as chat conversations (scripts/instruction_task.py), the whole model and with LoRA from the
same checkpoint; exact match of greedy replies to every held-out prompt, against the step.

    python benchmarks/sft_learning.py --seeds 0 1 2 --out docs/results/sft_learning.json \\
        --plot docs/results/sft_learning.png

Per seed: the task's words and draws, the pre-training and fine-tuning order and init all follow the seed. 2 simulated
CPU devices (`data=2`), as tests/test_sft_learning.py runs it. Writes the figures (JSON, with each run's metrics) and
a plot of val_loss and val_exact_match against the step, full fine-tuning against LoRA.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "scripts"))

import instruction_task  # noqa: E402

DEVICES = 2
# Pre-training: plain text, 64-token rows of concatenated paragraphs.
PRETRAIN = ["mesh=data=2", "batch_size=32", "seq_len=64", "optimizer.learning_rate=1e-2", "warmup_steps=30"]
PRETRAIN += ["train.progress=false", "train.eval_every=100000", "train.log_every=100"]
PRETRAIN_STEPS = 1000
# Fine-tuning: one conversation a row (at most 22 tokens), the held-out split's every prompt (about 120).
SFT = ["mesh=data=2", "batch_size=32", "seq_len=32", "data.packing=segments", "warmup_steps=10"]
SFT += ["train.progress=false", "train.eval_batches=4", "train.generate_eval_prompts=256"]
SFT += ["train.generate_eval_max_new_tokens=8", "checkpoint.dir="]
SFT_STEPS = 800
RUNS = {  # name -> its own settings
    "full": ["checkpoint.restore_params_only=true", "optimizer.learning_rate=3e-3"],
    "lora": ["lora.rank=8", "optimizer.learning_rate=1e-2"],
}
VAL_FRACTION = 0.06  # of 2,000 conversations: about 120 held out


def cli(argv: list[str]) -> None:
    from jaxtrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv


def tokenize(root: Path, seed: int, task: instruction_task.Task | None = None, **kept) -> dict[str, Path]:
    """The task for `seed` (or `task`) written under `root` (`kept`: `instruction_task.write_task`'s held_out and
    noise) and tokenized with its tokenizer: `pre` (plain-text shards of the pre-training paragraphs) and `sft` (chat
    shards, `VAL_FRACTION` of the conversations held out)."""
    task = task or instruction_task.instruction_task(seed)
    paths = instruction_task.write_task(root / "task", task, seed=seed, **kept)
    common = ["--tokenizer", str(paths["tokenizer"]), "--no-progress"]
    pre, sft = root / "pre", root / "sft"
    cli(
        [
            "tokenize",
            *common,
            "--documents",
            "paragraphs",
            "--val-fraction",
            "0.01",
            "--out",
            str(pre),
            str(paths["pretrain"]),
        ]
    )
    cli(
        [
            "tokenize",
            *common,
            "--chat",
            "--max-tokens",
            "33",
            "--val-fraction",
            str(VAL_FRACTION),
            "--out",
            str(sft),
            str(paths["chats"]),
        ]
    )
    return {**paths, "pre": pre, "sft": sft}


def pretrain(paths: dict, seed: int, devices, steps: int = PRETRAIN_STEPS, metrics: Path | None = None) -> Path:
    """Pre-trains llama-tiny on the plain text; returns the checkpoint's step directory."""
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train

    run = paths["pre"].parent / "base"
    settings = [f"data.source=tokens:{paths['pre']}", f"checkpoint.dir={run}", f"train.steps={steps}"]
    settings += [f"train.seed={seed}", "checkpoint.every=0", *PRETRAIN]
    if metrics:
        settings.append(f"tracking.metrics_file={metrics}")
    train(apply_overrides(default_config("llama-tiny"), settings), log=lambda *_: None, devices=devices)
    return run / str(steps)


def sft_config(paths: dict, base: Path, seed: int, run: str, steps: int, every: int, metrics: Path | None = None):
    from jaxtrain.run_config import load_config

    settings = [f"data.source=tokens:{paths['sft']}", f"checkpoint.restore={base}", f"train.steps={steps}"]
    settings += [f"train.seed={seed}", f"train.eval_every={every}", f"train.generate_eval_every={every}"]
    settings += [f"train.log_every={every}", f"tracking.metrics_file={metrics or ''}", *SFT, *RUNS[run]]
    return load_config(base.parent / "config.toml", overrides=settings)


def finetune(paths: dict, base: Path, seed: int, run: str, devices, steps: int = SFT_STEPS, every: int = 200, **kw):
    """Fine-tunes the base checkpoint on the chat shards (`run`: "full" or "lora"); returns the run's summary, its
    `history` holding val_loss and val_exact_match every `every` steps."""
    from jaxtrain.evaluation import in_loop

    cfg = sft_config(paths, base, seed, run, steps, every, **kw)
    return in_loop.train(cfg, log=lambda *_: None, devices=devices)


def base_score(paths: dict, base: Path, seed: int, devices) -> float:
    """Exact match of the base checkpoint itself on the held-out chat prompts, before any fine-tuning."""
    from jaxtrain.posttrain.sft_eval import GenerationEval
    from jaxtrain.training.checkpoint import restore_params
    from jaxtrain.training.setup import build

    cfg = sft_config(paths, base, seed, "full", 1, 1)
    run = build(cfg, log=lambda *_: None, devices=devices)
    params, _ = restore_params(cfg.checkpoint.restore, run.shardings.abstract_state["params"])
    stored = run.shardings.init_state(run.optimizer, 0, params)["params"]
    return GenerationEval(cfg)(run, stored, 0)["val_exact_match"]


def curve(summary: dict) -> list[dict]:
    keys = ("step", "val_loss", "val_exact_match")
    return [{k: row[k] for k in keys} for row in summary["history"] if "val_exact_match" in row]


def measure(work: Path, seed: int, devices) -> dict:
    """The whole recipe for one seed, timed."""
    root = work / f"seed{seed}"
    started = time.perf_counter()
    paths = tokenize(root, seed)
    base = pretrain(paths, seed, devices, metrics=root / "pretrain.jsonl")
    result = {"seed": seed, "pretrain_s": round(time.perf_counter() - started, 1)}
    result["base_exact_match"] = base_score(paths, base, seed, devices)
    for run in RUNS:
        started = time.perf_counter()
        summary = finetune(paths, base, seed, run, devices, metrics=root / f"{run}.jsonl")
        result[run] = {"curve": curve(summary), "seconds": round(time.perf_counter() - started, 1)}
        result[run] |= {k: summary[k] for k in ("val_loss", "val_exact_match")}
    pretrain_rows = [json.loads(line) for line in (root / "pretrain.jsonl").read_text().splitlines()]
    result["pretrain_loss"] = pretrain_rows[-1]["loss"]
    return result


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colours = {"full": "tab:blue", "lora": "tab:orange"}
    labels = {"full": "whole model", "lora": "LoRA rank 8"}
    for result in results:
        for run, colour in colours.items():
            steps = [0] + [r["step"] for r in result[run]["curve"]]
            label = labels[run] if result is results[0] else None
            exact = [result["base_exact_match"]] + [r["val_exact_match"] * 1.0 for r in result[run]["curve"]]
            axes[1].plot(steps, [100 * e for e in exact], color=colour, marker="o", ms=3, label=label)
            axes[0].plot(steps[1:], [r["val_loss"] for r in result[run]["curve"]], color=colour, marker="o", ms=3)
    axes[0].set(xlabel="fine-tuning step", ylabel="held-out loss (nats / assistant token)", yscale="log")
    axes[1].set(xlabel="fine-tuning step", ylabel="held-out exact match (%)", ylim=(-2, 102))
    axes[1].axhline(90, color="grey", lw=0.8, ls="--")
    axes[1].legend(loc="lower right")
    seeds = ", ".join(str(r["seed"]) for r in results)
    figure.suptitle(f"llama-tiny, pre-trained on plain text, fine-tuned on chat (seeds {seeds})", fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--work", default="runs/sft_learning", help="where the data and checkpoints go")
    parser.add_argument("--out", help="the figures as JSON")
    parser.add_argument("--plot", help="the curves as PNG")
    args = parser.parse_args(argv)
    import jaxtrain

    jaxtrain.use_simulated_devices(DEVICES)
    import jax

    results = []
    for seed in args.seeds:
        results.append(measure(Path(args.work), seed, jax.devices()[:DEVICES]))
        r = results[-1]
        runs = ", ".join(
            f"{name} {r[name]['val_exact_match']:.3f} (val_loss {r[name]['val_loss']:.4f}, {r[name]['seconds']} s)"
            for name in RUNS
        )
        print(f"seed {seed}: base {r['base_exact_match']:.3f}, {runs}; pre-training {r['pretrain_s']} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
