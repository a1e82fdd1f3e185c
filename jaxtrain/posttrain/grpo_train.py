"""GRPO's loop: sample rollouts with the trainer's own generator, then `grpo.num_iterations` optimizer steps on them.

    for each batch of rollouts r = 0, 1, ...:
        rollout = P prompts x G completions from the current params       (jaxtrain.posttrain.rollouts)
        num_iterations x  state, metrics = run.train_step(state, batch)   (the run's compiled step, its loss GRPO's)

The run is an ordinary one (`jaxtrain.training.setup.build`) whose objective is GRPO's loss (`grpo.group_size` > 0),
built for the rollouts' shapes: its step, shardings, gradient sync and checkpoints are every run's. `train.steps`
counts optimizer steps; rollout batch r is sampled at step r x num_iterations from the prompts and sampling seed of
(train.seed, r), so a run resumed from its checkpoint continues as if never stopped.

>>> cfg = apply_overrides(default_config("llama-tiny"), ["grpo.group_size=4", "batch_size=16"])  # doctest: +SKIP
>>> out = grpo_train(cfg, "prompts.jsonl", ["exact_match", r"format:[0-9]+"])          # doctest: +SKIP
>>> [h["reward_mean"] for h in out["history"]]                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.data.chat_template import ChatTemplate, optional_chat_template
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.inference.generate import tokenizer_for
from jaxtrain.posttrain.rewards import RewardFn, resolve_rewards
from jaxtrain.posttrain.rollouts import Prompts, Rollouts, RolloutShapes, Tokenizer
from jaxtrain.run_config import ConfigError, RunConfig
from jaxtrain.training import run_lock
from jaxtrain.training.checkpoint import Checkpoints
from jaxtrain.training.distributed import to_host
from jaxtrain.training.recovery import (
    Progress,
    check_resume,
    initial_state,
    open_checkpoints,
    resume,
    save_checkpoint,
)
from jaxtrain.training.setup import Run, build

LOGGED = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction", "completion_length")


def grpo_train(
    cfg: RunConfig,
    prompts: str | Path | Prompts,
    reward: str | RewardFn | Sequence[str | RewardFn],
    *,
    tokenizer: Tokenizer | None = None,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train `cfg`'s model with GRPO (`cfg.grpo`) for `train.steps` optimizer steps on `prompts` (a JSON-lines path or
    `Prompts`) scored by `reward` (names or functions, summed: `jaxtrain.posttrain.rewards`). `tokenizer`: the
    model's (default: `data.tokenizer`, else the one its data were tokenized with, bytes for text); conversations
    are rendered with `data.chat_template` or the tokenizer's own. Returns the history (a record per
    batch of rollouts: rewards, loss, KL, clip fractions, lengths, times), the final state and the run.

    With `checkpoint.dir` it resumes from the newest checkpoint there (checked to be this run's, prompts and rewards
    included) and saves every `checkpoint.every` steps, a multiple of `grpo.num_iterations`, and at the end."""
    _check(cfg)
    log = log if jax.process_index() == 0 else lambda *_: None
    rewards = resolve_rewards(reward)
    tokenizer = tokenizer or (load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else tokenizer_for(cfg))
    if not isinstance(prompts, Prompts):
        prompts = Prompts.from_jsonl(prompts, tokenizer, _chat_template(cfg))
    settings = {"grpo_prompts": prompts.digest, "grpo_rewards": [r.name for r in rewards]}
    with run_lock.holding(cfg.checkpoint.dir, log):
        check_resume(cfg, settings)  # before anything compiles
        run = build(cfg, log, devices, RolloutShapes(cfg.data.seq_len))
        with open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints:
            resumed = resume(run, checkpoints, log, settings=settings) if checkpoints else None
            state, progress = (resumed.state, resumed.progress) if resumed else initial_state(run, None, log)
            sampler = Rollouts(run, state["params"], prompts, rewards, tokenizer.decode)
            state, history = _loop(run, state, progress, sampler, checkpoints, settings, log, on_metrics)
            if checkpoints:
                checkpoints.wait()
    return {"history": history, "state": state, "run": run}


def _chat_template(cfg: RunConfig) -> ChatTemplate | None:
    """The template conversations are rendered with: `data.chat_template`, or `data.tokenizer`'s own, if any."""
    return optional_chat_template(cfg.data.tokenizer, cfg.data.chat_template or None) if cfg.data.tokenizer else None


def _check(cfg: RunConfig) -> None:
    """What this loop needs of the config beyond what building the run checks."""
    g, steps = cfg.grpo, cfg.train.steps
    if not g.group_size:
        raise ConfigError("grpo.group_size=0: GRPO samples G >= 2 completions of each prompt; set grpo.group_size.")
    if steps % g.num_iterations:
        raise ConfigError(
            f"train.steps={steps} is no multiple of grpo.num_iterations={g.num_iterations} (optimizer steps per batch "
            f"of rollouts): use e.g. train.steps={g.num_iterations * max(1, steps // g.num_iterations)}."
        )
    every = cfg.checkpoint.every
    if cfg.checkpoint.dir and every and every % g.num_iterations:
        raise ConfigError(
            f"checkpoint.every={every} is no multiple of grpo.num_iterations={g.num_iterations}: a checkpoint between "
            "two optimizer steps on one batch of rollouts could not resume them; use a multiple."
        )


def _loop(
    run: Run,
    state: Any,
    progress: Progress,
    sampler: Rollouts,
    checkpoints: Checkpoints | None,
    settings: dict[str, Any],
    log: Callable[[str], None],
    on_metrics: Callable[[dict[str, float]], None] | None,
) -> tuple[Any, list[dict[str, float]]]:
    """From `progress.step` to `train.steps`: a batch of rollouts, its optimizer steps, a record, a checkpoint when
    due. Returns the last state and the records."""
    iterations, steps, history = run.cfg.grpo.num_iterations, run.cfg.train.steps, []
    while progress.step < steps:
        state, record = grpo_step(run, state, sampler, progress.step // iterations)
        progress.step += iterations
        progress.nonfinite_total += int(record["nonfinite"])
        record = {"step": progress.step, **record}
        history.append(record)
        log(_line(record))
        if on_metrics is not None and jax.process_index() == 0:
            on_metrics(record)
        if checkpoints is not None and checkpoints.due(progress.step, steps):
            save_checkpoint(run, checkpoints, state, progress, log, settings=settings)
    return state, history


def grpo_step(run: Run, state: Any, sampler: Rollouts, number: int) -> tuple[Any, dict[str, float]]:
    """Batch of rollouts `number` from `state`'s params, then `grpo.num_iterations` optimizer steps on it. Returns
    the new state and a record: the rollouts' metrics, the steps' (their mean; `nonfinite`: their sum) and times."""
    start = time.perf_counter()
    rollout = sampler(state["params"], number)
    sampled = time.perf_counter()
    batch = sampler.place(rollout.batch)
    steps = []
    for _ in range(run.cfg.grpo.num_iterations):
        state, metrics = run.train_step(state, batch)
        steps.append(metrics)
    steps = to_host(steps)  # waits for the steps
    trained = time.perf_counter()
    record = {k: float(np.mean([m[k] for m in steps])) for k in steps[0]}
    record["nonfinite"] = float(sum(m["nonfinite"] for m in steps))
    completion_tokens = float(np.sum(rollout.lengths))
    times = {"rollout_time_s": sampled - start, "train_time_s": trained - sampled}
    rates = {"rollout_tokens_per_sec": completion_tokens / times["rollout_time_s"]}
    return state, {**rollout.metrics(run.cfg.grpo.group_size), **record, **times, **rates}


def _line(record: dict[str, float]) -> str:
    shown = "  ".join(f"{k} {record[k]:.4g}" for k in LOGGED if k in record)
    return f"step {record['step']}: {shown}"
