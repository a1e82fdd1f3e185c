"""GRPO's throughput with rollouts in process against rollouts on Ray's rollout workers (engine.kind=ray, staleness at
most 1), two workers, then two with worker 1 three times slower (engine.slow_workers=1:3).

    python benchmarks/grpo_throughput.py --steps 30 --repeats 3

Each mode runs `--warmup` GRPO steps (compiles, workers' first batches) and then `--steps` timed ones of the tiny
Llama (one optimizer step per batch of rollouts), the learner on one simulated CPU device. Rollout tokens/s counts
the completion tokens of the batches the learner trained on, per second of the timed wall clock; learner steps/s the
optimizer steps. `--repeats` rounds run the modes in turn; the medians' ratios to the first mode's are printed with
every run's figures. In process the learner samples, then trains; on Ray it trains while the workers sample ahead,
and waits only for a batch not yet back (`learner_wait_fraction`). Each worker is a process of its own: on a machine
with fewer cores than learner + workers they share them, and the overlap gains less than it would on separate
nodes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from jaxtrain.devices import use_simulated_devices  # noqa: E402

use_simulated_devices(1)  # the learner's device, before JAX starts

import numpy as np  # noqa: E402

from jaxtrain.inference.generate import ByteTokenizer  # noqa: E402
from jaxtrain.posttrain.grpo_train import grpo_step  # noqa: E402
from jaxtrain.posttrain.rewards import resolve_rewards  # noqa: E402
from jaxtrain.posttrain.rollout_source import rollout_source  # noqa: E402
from jaxtrain.posttrain.rollouts import Prompts, RolloutShapes  # noqa: E402
from jaxtrain.run_config import apply_overrides, default_config  # noqa: E402
from jaxtrain.training.setup import build  # noqa: E402

SEQ_LEN, GROUP, NEW = 48, 4, 32
RUN = [f"batch_size={8 * GROUP}", f"seq_len={SEQ_LEN}", f"grpo.group_size={GROUP}", f"grpo.max_new_tokens={NEW}"]
RUN += ["mesh=data=1", "warmup_steps=0", "learning_rate=1e-3", "progress=false", "engine.max_staleness=1"]
MODES = {
    "in_process": ["engine.kind=spmd"],
    "ray_2_workers": ["engine.kind=ray", "engine.workers=2"],
    "ray_2_workers_1_slowed_3x": ["engine.kind=ray", "engine.workers=2", "engine.slow_workers=1:3"],
}
WORDS = ["hello", "abc", "what is", "jax", "tiny", "12+3=", "rollout", "ray", "grpo", "llama", "seven", "x"]
REWARD = r"format:[\x00-\x7f].*"  # the first byte is ASCII: about half a fresh model's draws


def measure(overrides: list[str], warmup: int, steps: int) -> dict[str, float]:
    """Throughput of `steps` GRPO steps after `warmup` untimed ones, with the rollouts `overrides` say."""
    cfg = apply_overrides(default_config("llama-tiny"), [*RUN, *overrides, f"train.steps={warmup + steps}"])
    run = build(cfg, log=lambda *_: None, dataset=RolloutShapes(SEQ_LEN))
    state = run.shardings.init_state(run.optimizer, cfg.train.seed)
    prompts = Prompts.from_records([{"prompt": w} for w in WORDS], ByteTokenizer())
    rewards, decode = resolve_rewards(REWARD), ByteTokenizer().decode
    with rollout_source(run, state["params"], prompts, rewards, decode, log=_stderr) as sampler:
        for number in range(warmup):
            state, _ = grpo_step(run, state, sampler, number)
        ray = cfg.engine.kind == "ray"
        used, dropped = (list(sampler.used), sampler.dropped) if ray else ([], 0)  # counted from here
        start, records = time.perf_counter(), []
        for number in range(warmup, warmup + steps):
            state, record = grpo_step(run, state, sampler, number)
            records.append(record)
        seconds = time.perf_counter() - start
        batches = [now - then for now, then in zip(sampler.used, used)] if ray else []
        workers = {"batches_per_worker": batches, "copies_dropped": sampler.dropped - dropped} if ray else {}
    tokens = sum(r["completion_length"] for r in records) * cfg.data.batch_size
    return {
        "rollout_tokens_per_s": round(tokens / seconds, 1),
        "learner_steps_per_s": round(steps * cfg.grpo.num_iterations / seconds, 3),
        "learner_wait_fraction": round(sum(r["rollout_wait_s"] for r in records) / seconds, 3),
        "train_s_per_step": round(float(np.mean([r["train_time_s"] for r in records])), 3),
        "staleness_mean": round(float(np.mean([r["staleness"] for r in records])), 3),
        "staleness_max": max(r["staleness"] for r in records),
        "loss_finite": all(np.isfinite(r["loss"]) for r in records),
        **workers,
    }


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)  # stdout is the JSON


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed GRPO steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed GRPO steps first (compiles)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every mode in turn (load drifts alike)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    setup = {"model": "llama-tiny", "rows": 8 * GROUP, "max_new_tokens": NEW, "steps": args.steps}
    rounds = [{mode: measure(MODES[mode], args.warmup, args.steps) for mode in args.modes} for _ in range(args.repeats)]
    results = {mode: [r[mode] for r in rounds] for mode in args.modes}
    summary = {mode: _median(runs, "learner_steps_per_s") for mode, runs in results.items()}
    first = args.modes[0]
    ratios = {f"{mode}_over_{first}": round(v / summary[first], 3) for mode, v in summary.items() if mode != first}
    out = {"setup": {**setup, "max_staleness": 1, "repeats": args.repeats}, "median_learner_steps_per_s": summary}
    print(json.dumps({**out, "ratios": ratios, "runs": results}, indent=2))


def _median(runs: list[dict], key: str) -> float:
    return round(float(np.median([r[key] for r in runs])), 3)


if __name__ == "__main__":
    main()
