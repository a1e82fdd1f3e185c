"""Preference optimisation that learns: the tiny Llama that benchmarks/sft_learning.py pre-trains on plain-text string
transforms, trained with DPO (the whole model, and LoRA) and SimPO on chat-format pairs of the same transforms that
prefer the correct answer; preference accuracy and reward margin on training and held-out pairs against the step.

    python benchmarks/dpo_learning.py --seeds 0 1 2 --out docs/results/dpo_learning.json \\
        --plot docs/results/dpo_learning.png

The pairs are the instruction task's 2,000 conversations (scripts/instruction_task.py) in TRL's conversational format:
the user's message is the prompt, its correct transform the chosen reply, and a plausible wrong one the rejected reply
(another transform of the same word, or the word copied). The last `VAL_FRACTION` of the file is held out
(`data.val_fraction`); every word is in one example only, so no held-out word was seen in pre-training or in a
training pair. The base model has never read the chat template's role tokens (sft_learning's base scores 0 exact
match on these prompts), so it starts with a weak preference for the right answer in this format.

DPO's `preference_accuracy` counts a pair when the policy raised the chosen reply's log-prob against the reference's
more than the rejected one's: at step 0 the policy is the reference, both rewards are 0 and the accuracy is 0 by
definition. The baseline that says what training added is the model's own preference, log π(chosen) > log π(rejected)
(`own_preference`), measured on every training and held-out pair for the base and after each run. SimPO's accuracy
is that preference per reply token; every reply here is 6 tokens, so at step 0 it is the base's own preference.

Per seed the task, the pairs, pre-training and training all follow the seed; 2 simulated CPU devices (`data=2`), as
tests/test_dpo_learning.py runs it. Prints each seed's result as JSON; writes them all (`--out`) and a plot of the
held-out curves (`--plot`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import instruction_task  # noqa: E402
import sft_learning  # noqa: E402

DEVICES = 2
VAL_FRACTION = 0.064  # of 2,000 pairs: the last 128 held out, which the 4 evaluation batches of 32 read once each
COMMON = ["mesh=data=2", "batch_size=32", "seq_len=32", "warmup_steps=10", "train.progress=false"]
COMMON += ["train.eval_batches=4", f"data.val_fraction={VAL_FRACTION}", "checkpoint.dir="]
STEPS = 300
WHOLE = ["checkpoint.restore_params_only=true", "optimizer.learning_rate=1e-3"]  # a new optimizer at step 0
RUNS = {  # name -> its own settings; all start from the same pre-trained checkpoint
    "dpo": ["preference.loss=dpo", "preference.beta=0.1", *WHOLE],
    "dpo_lora": ["preference.loss=dpo", "preference.beta=0.1", "lora.rank=8", "optimizer.learning_rate=1e-2"],
    # SimPO's rewards are per-token log-probs, several times smaller than DPO's summed ones: the paper's beta of 2
    "simpo": ["preference.loss=simpo", "preference.beta=2", *WHOLE],
}
LABELS = {"dpo": "DPO, whole model", "dpo_lora": "DPO, LoRA rank 8", "simpo": "SimPO, whole model"}
TRAIN_KEYS = ("loss", "preference_accuracy", "reward_margin")  # of the step's training batch
# Held out, with each side's: DPO may widen the margin by lowering both replies' log-probs, the rejected one's more.
VAL_KEYS = (*TRAIN_KEYS, "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
CURVE_KEYS = TRAIN_KEYS + tuple(f"val_{k}" for k in VAL_KEYS)


def preference_pairs(task: instruction_task.Task, seed: int) -> list[dict]:
    """One pair a conversation of `task`, in its order: the user's message as the prompt, the assistant's (correct)
    reply chosen, and rejected a wrong one drawn uniformly from the word's two other transforms and the word itself.
    `kind` (which the pairs loader ignores) says which: "transform" or "copy"."""
    rng = np.random.default_rng((seed, 1))  # a stream of its own: the task's draws stay the task's
    pairs = []
    for conversation in task.conversations:
        user, assistant = conversation["messages"]
        name, word = user["content"].split(": ")
        wrong = [transform(word) for other, transform in instruction_task.TRANSFORMS.items() if other != name]
        rejected = [*wrong, word][int(rng.integers(len(wrong) + 1))]
        kind = "copy" if rejected == word else "transform"
        reply = [{"role": "assistant", "content": rejected}]
        pairs.append({"prompt": [user], "chosen": [assistant], "rejected": reply, "kind": kind})
    return pairs


def write_pairs(root: Path, seed: int) -> dict[str, Path]:
    """The task for `seed` under `root` (sft_learning's files, its pre-training shards among them) and `pairs`: its
    preference pairs as JSON lines."""
    paths = sft_learning.tokenize(root, seed)
    pairs = preference_pairs(instruction_task.instruction_task(seed), seed)
    paths["pairs"] = root / "pairs.jsonl"
    paths["pairs"].write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return paths


def config(paths: dict, base: Path, seed: int, run: str, steps: int, every: int):
    from jaxtrain.run_config import load_config

    settings = [f"data.source=pairs:{paths['pairs']}", f"data.tokenizer={paths['tokenizer']}"]
    settings += [f"checkpoint.restore={base}", f"train.steps={steps}", f"train.seed={seed}"]
    settings += [f"train.eval_every={every}", f"train.log_every={every}", *COMMON, *RUNS[run]]
    return load_config(base.parent / "config.toml", overrides=settings)


def own_preference(run, params, pairs_file: Path) -> dict[str, float]:
    """The share of pairs whose chosen reply the model `params` itself gives the higher log-prob (summed over the
    reply's tokens): every training and held-out pair once, and the held-out pairs by kind of rejected reply.
    Computed as a DPO run computes its reference log-probs, on a copy of the run's dataset (its own reference
    stays)."""
    from jaxtrain.training.reference import attach_reference

    probe = dataclasses.replace(run, dataset=copy.copy(run.dataset))
    attach_reference(probe, params, log=lambda *_: None)
    prefers = {split: lp[:, 0] > lp[:, 1] for split, lp in probe.dataset.reference.items()}
    # The held-out pairs are the file's last, in its order (every pair fits seq_len: none is left out)
    kinds = np.array([json.loads(line)["kind"] for line in pairs_file.read_text().splitlines()])[-len(prefers["val"]) :]
    shares = {split: float(np.mean(p)) for split, p in prefers.items()}
    return shares | {f"val_{k}": float(np.mean(prefers["val"][kinds == k])) for k in ("transform", "copy")}


def base_preference(paths: dict, base: Path, seed: int, devices) -> dict[str, float]:
    """The base checkpoint's own preference (`own_preference`), before any preference training."""
    from jaxtrain.training.checkpoint import restore_params
    from jaxtrain.training.setup import build

    run = build(config(paths, base, seed, "dpo", 1, 1), log=lambda *_: None, devices=devices)
    params, _ = restore_params(str(base), run.shardings.abstract_state["params"])
    return own_preference(run, run.shardings.init_state(run.optimizer, 0, params)["params"], paths["pairs"])


def train(paths: dict, base: Path, seed: int, run: str, devices, steps: int = STEPS, every: int = 25) -> dict:
    """One preference run from the base checkpoint (`run`: a key of `RUNS`): its metrics every `every` steps (the
    training batch's and the held-out pairs'), the trained model's own preference, and its time."""
    import jaxtrain

    cfg = config(paths, base, seed, run, steps, every)
    started = time.perf_counter()
    summary = jaxtrain.train(cfg, log=lambda *_: None, devices=devices)
    result = {"seconds": round(time.perf_counter() - started, 1)}
    result["curve"] = [{k: row[k] for k in ("step", *CURVE_KEYS)} for row in summary["history"]]
    result["own_preference"] = own_preference(summary["run"], summary["state"]["params"], paths["pairs"])
    return result


def measure(work: Path, seed: int, devices, runs=tuple(RUNS), steps: int = STEPS) -> dict:
    """The whole recipe for one seed, timed: the task and its pairs, pre-training, the base's preference, the runs."""
    root = work / f"seed{seed}"
    shutil.rmtree(root, ignore_errors=True)  # tokenizing refuses to write over an earlier run's shards
    started = time.perf_counter()
    paths = write_pairs(root, seed)
    base = sft_learning.pretrain(paths, seed, devices)
    result = {"seed": seed, "pretrain_s": round(time.perf_counter() - started, 1)}
    result["base_own_preference"] = base_preference(paths, base, seed, devices)
    for run in runs:
        result[run] = train(paths, base, seed, run, devices, steps)
    return result


def plot(results: list[dict], out: Path) -> None:
    """Held-out preference accuracy and reward margin against the step, each run a colour, each seed a line; step 0
    is the metric's value for the starting model, and a cross the base model's own held-out preference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    colours = {"dpo": "tab:blue", "dpo_lora": "tab:orange", "simpo": "tab:green"}
    for result in results:
        first = result is results[0]
        base = 100 * result["base_own_preference"]["val"]
        axes[0].plot([0], [base], "kx", ms=7, label="base's own preference" if first else None)
        for run, colour in colours.items():
            if run not in result:
                continue
            curve = result[run]["curve"]
            start = base if run == "simpo" else 0.0  # see the module docstring
            steps = [0] + [c["step"] for c in curve]
            accuracy = [start] + [100 * c["val_preference_accuracy"] for c in curve]
            axes[0].plot(steps, accuracy, color=colour, marker="o", ms=2, lw=1, label=LABELS[run] if first else None)
            margin = [np.nan if run == "simpo" else 0.0] + [c["val_reward_margin"] for c in curve]
            axes[1].plot(steps, margin, color=colour, marker="o", ms=2, lw=1)
    axes[0].set(xlabel="training step", ylabel="held-out preference accuracy (%)", ylim=(-2, 102))
    axes[0].axhline(90, color="grey", lw=0.8, ls="--")
    axes[0].legend(loc="lower right", fontsize=8)
    # SimPO's rewards are beta x log-prob per token (no reference): another scale than DPO's
    axes[1].set(xlabel="training step", ylabel="held-out reward margin")
    seeds = ", ".join(str(r["seed"]) for r in results)
    title = f"llama-tiny pre-trained on plain text, preference-trained on chat pairs (seeds {seeds})"
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--work", default="runs/dpo_learning", help="where the data and checkpoints go")
    parser.add_argument("--out", help="the figures as JSON")
    parser.add_argument("--plot", help="the held-out curves as PNG")
    args = parser.parse_args(argv)
    import jaxtrain

    jaxtrain.use_simulated_devices(DEVICES)
    import jax

    started = time.perf_counter()
    results = []
    for seed in args.seeds:
        results.append(measure(Path(args.work), seed, jax.devices()[:DEVICES], args.runs, args.steps))
        print(json.dumps(results[-1]), flush=True)
    print(f"wall time {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
