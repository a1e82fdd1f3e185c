"""Reinforcement learning that learns: the tiny Llama that benchmarks/sft_learning.py pre-trains on plain-text string
transforms, fine-tuned briefly on the same transforms as chat (SFT), then trained with GRPO on the chat prompts with
exact match of the answer as the reward; greedy exact match on held-out prompts against the step.

    python benchmarks/grpo_learning.py --seeds 0 1 2 --out docs/results/grpo_learning.json \\
        --plot docs/results/grpo_learning.png

The task is scripts/instruction_task.py's (`Upper: abcd`, `Shift: abcd`, `Rot13: abcd`, random 4-letter words). Its
last `HELD_OUT` conversations are held out of everything: neither SFT nor GRPO sees them, and their words are in no
other example. SFT runs `SFT_STEPS` steps, short of what it takes to solve the task (benchmarks/sft_learning.py:
0.90-1.00 exact match after 200), so the model GRPO starts from answers some prompts right and samples right answers
to others: the reward has something to tell it. GRPO then samples G = 8 completions of 8 training prompts per step
at temperature 1 (stopping at the chat template's end of turn), rewards 1 for an exact answer, and takes one
optimizer step per batch of rollouts (the whole model, no KL: the reference needs adapters or a copy).

The held-out score (`grpo.eval_prompts`) completes each held-out prompt greedily with the trainer's own generator.
The baseline it is compared with is the same SFT checkpoint's score at GRPO's step 0. 2 simulated CPU devices
(`data=2`), as tests/test_grpo_learning.py runs it. Prints each seed's result as JSON; writes them all (`--out`) and a
plot of the curves (`--plot`).
"""

from __future__ import annotations

import argparse
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
HELD_OUT = 128  # the task's last conversations: GRPO's held-out prompts
NOISE = 0.5  # the teacher's share of wrong replies (another transform: instruction_task.noisy_teacher)
SFT_STEPS = 200
GROUP = 8
GRPO = ["mesh=data=2", f"batch_size={8 * GROUP}", "seq_len=32", f"grpo.group_size={GROUP}", "grpo.max_new_tokens=8"]
GRPO += ["checkpoint.restore_params_only=true", "optimizer.learning_rate=1e-3", "warmup_steps=5"]
GRPO += ["train.progress=false", "checkpoint.dir=", "tracking.metrics_file="]
GRPO_STEPS = 1000
END_OF_TURN = instruction_task.SPECIAL.index("<|end|>")  # the tokenizer's id of the stop token
CURVE_KEYS = ("reward_mean", "val_exact_match", "loss", "completion_length")


def write_task(root: Path, seed: int) -> dict[str, Path]:
    """sft_learning's files for `seed` without the held-out conversations, their replies the noisy teacher's, and
    `prompts` and `held_out`: GRPO's prompt records of the training conversations and of the held-out ones, with the
    correct answers (`instruction_task.write_task`)."""
    task = instruction_task.instruction_task(seed)
    return sft_learning.tokenize(root, seed, task, held_out=HELD_OUT, noise=NOISE)


def finetune(paths: dict, base: Path, seed: int, devices, steps: int) -> Path:
    """`steps` of SFT of the whole model from the base checkpoint; returns its checkpoint's step directory."""
    from jaxtrain.evaluation import in_loop
    from jaxtrain.run_config import apply_overrides

    run = paths["sft"].parent / f"sft{steps}"
    cfg = sft_learning.sft_config(paths, base, seed, "full", steps, steps)
    cfg = apply_overrides(cfg, [f"checkpoint.dir={run}", "checkpoint.every=0", "train.generate_eval_every=0"])
    in_loop.train(cfg, log=lambda *_: None, devices=devices)
    return run / str(steps)


def held_out_exact_match(paths: dict, checkpoint: Path, devices) -> float:
    """Greedy exact match of the model in `checkpoint` on the held-out prompts, computed apart from GRPO's own
    held-out score: the checkpoint restored into a generator, the prompts rendered with the tokenizer's template."""
    from jaxtrain.data.chat_template import optional_chat_template
    from jaxtrain.data.tokenizer import load_tokenizer
    from jaxtrain.inference.generate import Generator

    tokenizer, template = load_tokenizer(paths["tokenizer"]), optional_chat_template(paths["tokenizer"], None)
    records = [json.loads(line) for line in paths["held_out"].read_text().splitlines()]
    ids = [tokenizer.encode(template.render(r["prompt"], add_generation_prompt=True)) for r in records]
    generator = Generator.restore(checkpoint, mesh=f"data={len(devices)}", devices=devices)
    out = generator.generate(ids, max_new_tokens=8, eos_id=END_OF_TURN)
    replies = [tokenizer.decode(t[:-1] if t and t[-1] == END_OF_TURN else t) for t in out.tokens]
    return float(np.mean([reply.strip() == r["answer"] for reply, r in zip(replies, records)]))


def grpo_config(paths: dict, sft: Path, seed: int, steps: int, every: int):
    from jaxtrain.run_config import load_config

    settings = [f"checkpoint.restore={sft}", f"data.tokenizer={paths['tokenizer']}", f"train.steps={steps}"]
    settings += [f"train.seed={seed}", f"train.eval_every={every}", f"grpo.eval_prompts={paths['held_out']}"]
    settings += [f"grpo.eos_id={END_OF_TURN}", *GRPO]
    return load_config(sft.parent / "config.toml", overrides=settings)


def reinforce(paths: dict, sft: Path, seed: int, devices, steps: int = GRPO_STEPS, every: int = 50) -> dict:
    """GRPO from the SFT checkpoint: its records (every step's rollout reward, the held-out score every `every`
    steps and at 0) and its time."""
    from jaxtrain.posttrain.grpo_train import grpo_train

    cfg = grpo_config(paths, sft, seed, steps, every)
    started = time.perf_counter()
    out = grpo_train(cfg, paths["prompts"], "exact_match", log=lambda *_: None, devices=devices)
    curve = [{"step": h["step"], **{k: round(h[k], 5) for k in CURVE_KEYS if k in h}} for h in out["history"]]
    return {"seconds": round(time.perf_counter() - started, 1), "curve": curve}


def measure(work: Path, seed: int, devices, sft_steps: int = SFT_STEPS, steps: int = GRPO_STEPS) -> dict:
    """The whole recipe for one seed, timed: the task, pre-training, SFT, GRPO."""
    root = work / f"seed{seed}"
    shutil.rmtree(root, ignore_errors=True)  # tokenizing refuses to write over an earlier run's shards
    started = time.perf_counter()
    paths = write_task(root, seed)
    base = sft_learning.pretrain(paths, seed, devices)
    sft = finetune(paths, base, seed, devices, sft_steps)
    result = {"seed": seed, "sft_steps": sft_steps, "pretrain_and_sft_s": round(time.perf_counter() - started, 1)}
    result["sft_held_out"] = held_out_exact_match(paths, sft, devices)
    result["grpo"] = reinforce(paths, sft, seed, devices, steps)
    scores = [c["val_exact_match"] for c in result["grpo"]["curve"] if "val_exact_match" in c]
    result |= {"held_out_before": scores[0], "held_out_after": scores[-1], "held_out_best": max(scores)}
    # The control: as many more SFT steps on the noisy teacher's replies as GRPO took
    longer = finetune(paths, base, seed, devices, sft_steps + steps)
    result["more_sft_steps"], result["more_sft_held_out"] = (
        sft_steps + steps,
        held_out_exact_match(paths, longer, devices),
    )
    return result


def plot(results: list[dict], out: Path) -> None:
    """The rollouts' mean reward (a moving mean over 10 steps) and the held-out exact match against the step; a cross
    the control's held-out exact match (as many more SFT steps instead of GRPO's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for result in results:
        curve = result["grpo"]["curve"]
        rows = [c for c in curve if "reward_mean" in c]
        rewards = np.convolve([c["reward_mean"] for c in rows], np.ones(10) / 10, mode="valid")
        axes[0].plot([c["step"] for c in rows][9:], 100 * rewards, lw=1, label=f"seed {result['seed']}")
        held = [c for c in curve if "val_exact_match" in c]
        line = axes[1].plot([c["step"] for c in held], [100 * c["val_exact_match"] for c in held], marker="o", ms=3)
        more = f"{result['more_sft_steps']} SFT steps instead" if result is results[0] else None
        axes[1].plot(held[-1]["step"], 100 * result["more_sft_held_out"], "x", color=line[0].get_color(), label=more)
    axes[0].set(xlabel="GRPO step", ylabel="rollouts' exact match (%, mean of 10 steps)", ylim=(-2, 102))
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].set(xlabel="GRPO step", ylabel="held-out greedy exact match (%)", ylim=(-2, 102))
    axes[1].axhline(90, color="grey", lw=0.8, ls="--")
    axes[1].legend(loc="lower right", fontsize=8)
    sft = results[0]["sft_steps"]
    figure.suptitle(
        f"llama-tiny after {sft} SFT steps, trained with GRPO (G = {GROUP}, exact-match reward)", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--steps", type=int, default=GRPO_STEPS)
    parser.add_argument("--work", default="runs/grpo_learning", help="where the data and checkpoints go")
    parser.add_argument("--out", help="the figures as JSON")
    parser.add_argument("--plot", help="the curves as PNG")
    args = parser.parse_args(argv)
    import jaxtrain

    jaxtrain.use_simulated_devices(DEVICES)
    import jax

    started = time.perf_counter()
    results = []
    for seed in args.seeds:
        results.append(measure(Path(args.work), seed, jax.devices()[:DEVICES], args.sft_steps, args.steps))
        r = results[-1]
        print(json.dumps({k: v for k, v in r.items() if k != "grpo"} | {"grpo_s": r["grpo"]["seconds"]}), flush=True)
    print(f"wall time {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text("[\n" + ",\n".join(json.dumps(r) for r in results) + "\n]\n")  # a line a seed
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
