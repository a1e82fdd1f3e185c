"""GRPO's loop: sample rollouts with the trainer's own generator, then `grpo.num_iterations` optimizer steps on them.

    for each batch of rollouts r = 0, 1, ...:
        rollout = P prompts x G completions from the current params       (jaxtrain.posttrain.rollouts)
        num_iterations x  state, metrics = run.train_step(state, batch)   (the run's compiled step, its loss GRPO's)

The run is an ordinary one (`jaxtrain.training.setup.build`) whose objective is GRPO's loss (`grpo.group_size` > 0),
built for the rollouts' shapes: its step, shardings, gradient sync and checkpoints are every run's. `train.steps`
counts optimizer steps; rollout batch r is sampled at step r x num_iterations from the prompts and sampling seed of
(train.seed, r), so a run resumed from its checkpoint continues as if never stopped. Its records go where a training
run's go (metrics file, TensorBoard, W&B), with the held-out score of `grpo.eval_prompts` where due.

>>> cfg = apply_overrides(default_config("llama-tiny"), ["grpo.group_size=4", "batch_size=16"])  # doctest: +SKIP
>>> out = grpo_train(cfg, "prompts.jsonl", ["exact_match", r"format:[0-9]+"])          # doctest: +SKIP
>>> [h["reward_mean"] for h in out["history"]]                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.data.chat_template import optional_chat_template
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.inference.generate import tokenizer_for
from jaxtrain.posttrain.grpo_eval import HeldOutScore
from jaxtrain.posttrain.grpo_reference import ReferenceLogProbs
from jaxtrain.posttrain.rewards import RewardFn, resolve_rewards
from jaxtrain.posttrain.rollout_source import Sampler, rollout_source
from jaxtrain.posttrain.rollouts import Prompts, RolloutShapes, Tokenizer, batch_shardings
from jaxtrain.run_config import ConfigError, RunConfig
from jaxtrain.training import run_lock
from jaxtrain.training.checkpoint import Checkpoints
from jaxtrain.training.distributed import to_host
from jaxtrain.training.loop import metrics_sink
from jaxtrain.training.metrics import MetricsLog, check_outputs
from jaxtrain.training.recovery import (
    Preempted,
    Progress,
    StopRequest,
    check_resume,
    initial_state,
    open_checkpoints,
    preemption_requested,
    resume,
    save_checkpoint,
    stop_signals,
)
from jaxtrain.training.setup import Run, build


def grpo_train(
    cfg: RunConfig,
    prompts: str | Path | Prompts,
    reward: str | RewardFn | Sequence[str | RewardFn],
    *,
    eval_prompts: str | Path | Prompts | None = None,
    tokenizer: Tokenizer | None = None,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train `cfg`'s model with GRPO (`cfg.grpo`) for `train.steps` optimizer steps on `prompts` (a JSON-lines path or
    `Prompts`) scored by `reward` (names or functions, summed: `jaxtrain.posttrain.rewards`). `tokenizer`: the
    model's (default: `data.tokenizer`, else the one its data were tokenized with, bytes for text); conversations
    are rendered with `data.chat_template` or the tokenizer's own. `eval_prompts` (default `grpo.eval_prompts`):
    held-out prompts scored greedily (`jaxtrain.posttrain.grpo_eval`) at the start, every `train.eval_every` steps and
    at the end. Returns the history (a record per batch of rollouts: rewards, loss, KL, clip fractions, lengths,
    times, and the held-out scores where due), the final state and the run.

    The records go where a training run's go (`tracking.metrics_file`, TensorBoard, W&B, `on_metrics`). With
    `checkpoint.dir` it resumes from the newest checkpoint there (checked to be this run's, prompts and rewards
    included) and saves every `checkpoint.every` steps, a multiple of `grpo.num_iterations`, and at the end; on
    SIGTERM or SIGINT it finishes the batch of rollouts, saves and raises `Preempted`."""
    _check(cfg)
    lead = jax.process_index() == 0
    log = log if lead else lambda *_: None
    rewards = resolve_rewards(reward)
    tokenizer = tokenizer or (load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else tokenizer_for(cfg))
    prompts = _prompts(cfg, prompts, tokenizer)
    eval_prompts = eval_prompts or cfg.grpo.eval_prompts
    held_out = _prompts(cfg, eval_prompts, tokenizer) if eval_prompts else None
    settings = {"grpo_prompts": prompts.digest, "grpo_rewards": [r.name for r in rewards]}
    with run_lock.holding(cfg.checkpoint.dir, log):
        run_name = check_resume(cfg, settings)  # before anything compiles
        if lead:
            check_outputs(cfg.tracking.metrics_file, cfg.tracking.tensorboard_dir, run_name)
        run = build(cfg, log, devices, RolloutShapes.of(cfg))
        with open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints:
            resumed = resume(run, checkpoints, log, settings=settings) if checkpoints else None
            state, progress = (resumed.state, resumed.progress) if resumed else initial_state(run, None, log)
            reference = None
            if cfg.grpo.beta:
                reference = ReferenceLogProbs(run, batch_shardings(run), state, progress.step)
            scorer = HeldOutScore(run, state["params"], held_out, rewards, tokenizer.decode) if held_out else None
            sink = metrics_sink(cfg, lead, on_metrics, progress, log)
            # Ray's workers start first: Ray sets a SIGTERM handler of its own, which stop_signals replaces
            sampling = rollout_source(run, state["params"], prompts, rewards, tokenizer.decode, log)
            with sampling as sampler, contextlib.closing(sink), stop_signals() as stop:
                loop = Loop(run, sampler, reference, scorer, checkpoints, settings, sink, stop, log)
                state, preempted = loop(state, progress)
                if checkpoints:
                    checkpoints.wait()
    if preempted:
        raise Preempted(progress.step, stop.signum or signal.SIGTERM)
    log(_summary(loop.history))
    return {"history": loop.history, "state": state, "run": run}


def _summary(history: list[dict[str, float]]) -> str:
    """The `done:` line: the last record's rewards, loss and KL, and the newest held-out scores."""
    if not history:
        return "done: nothing to do (the run had reached train.steps)"
    last, scored = history[-1], [r for r in history if "val_reward_mean" in r]
    shown = {k: last[k] for k in ("reward_mean", "loss", "kl", "completion_length") if k in last}
    shown |= {k: v for k, v in (scored[-1] if scored else {}).items() if k.startswith("val_")}
    return f"done: steps {last['step']}  " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items())


def _prompts(cfg: RunConfig, prompts: str | Path | Prompts, tokenizer: Tokenizer) -> Prompts:
    """`prompts` as `Prompts`: a JSON-lines file's records encoded, conversations rendered with the run's template
    (`data.chat_template`, or `data.tokenizer`'s own, if any)."""
    if isinstance(prompts, Prompts):
        return prompts
    template = None
    if cfg.data.tokenizer:
        template = optional_chat_template(cfg.data.tokenizer, cfg.data.chat_template or None)
    return Prompts.from_jsonl(prompts, tokenizer, template)


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
    if cfg.engine.kind == "ray" and jax.process_count() > 1:
        raise ConfigError(
            f"engine.kind=ray with {jax.process_count()} processes: GRPO's rollouts on Ray are driven by one learner "
            "process (each would start workers of its own); use one process, or engine.kind=spmd."
        )
    every = cfg.checkpoint.every
    if cfg.checkpoint.dir and every and every % g.num_iterations:
        raise ConfigError(
            f"checkpoint.every={every} is no multiple of grpo.num_iterations={g.num_iterations}: a checkpoint between "
            "two optimizer steps on one batch of rollouts could not resume them; use a multiple."
        )


@dataclasses.dataclass
class Loop:
    """From `progress.step` to `train.steps`: a batch of rollouts, its optimizer steps, a record (with the held-out
    score where due), a checkpoint where due or asked for by a signal."""

    run: Run
    sampler: Sampler
    reference: ReferenceLogProbs | None
    scorer: HeldOutScore | None
    checkpoints: Checkpoints | None
    settings: dict[str, Any]
    sink: MetricsLog
    stop: StopRequest
    log: Callable[[str], None]
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def __call__(self, state: Any, progress: Progress) -> tuple[Any, bool]:
        """The last state, and whether a signal stopped the run before `train.steps`."""
        cfg = self.run.cfg
        iterations, steps, every = cfg.grpo.num_iterations, cfg.train.steps, cfg.train.eval_every
        if self.scorer is not None and progress.step == 0:
            self._record(0, self.scorer(state["params"]))
        while progress.step < steps:
            state, record = grpo_step(self.run, state, self.sampler, progress.step // iterations, self.reference)
            progress.step += iterations
            progress.nonfinite_total += int(record["nonfinite"])
            crossed = progress.step // every > (progress.step - iterations) // every
            if self.scorer is not None and (crossed or progress.step == steps):
                record |= self.scorer(state["params"])
            self._record(progress.step, record)
            preempted = preemption_requested(self.stop, progress.step) and progress.step < steps
            if self.checkpoints is not None and (self.checkpoints.due(progress.step, steps) or preempted):
                save_checkpoint(self.run, self.checkpoints, state, progress, self.log, settings=self.settings)
            if preempted:
                return state, True
        return state, False

    def _record(self, step: int, record: dict[str, float]) -> None:
        self.history.append({"step": step, **record})
        self.sink.write(step, record)


def grpo_step(
    run: Run, state: Any, sampler: Sampler, number: int, reference: ReferenceLogProbs | None = None
) -> tuple[Any, dict[str, float]]:
    """Batch of rollouts `number` from `state`'s params (with its `reference` log-probs where `grpo.beta` > 0), then
    `grpo.num_iterations` optimizer steps on it. Returns the new state and a record: the rollouts' metrics, the
    steps' (their mean; `nonfinite`: their sum) and times."""
    start = time.perf_counter()
    rollout = sampler(state["params"], number)
    sampled = time.perf_counter()
    batch = sampler.place(rollout.batch)
    if reference is not None:
        batch = reference.attach(state["params"], batch)
    steps = []
    for _ in range(run.cfg.grpo.num_iterations):
        state, metrics = run.train_step(state, batch)
        steps.append(metrics)
    steps = to_host(steps)  # waits for the steps
    trained = time.perf_counter()
    record = {k: float(np.mean([m[k] for m in steps])) for k in steps[0]}
    record["nonfinite"] = float(sum(m["nonfinite"] for m in steps))
    completion_tokens = float(np.sum(rollout.lengths))
    # The learner's wait for its rollouts: all of their sampling in process, what was not done ahead on Ray
    times = {"rollout_wait_s": sampled - start, "train_time_s": trained - sampled}
    rates = {"completion_tokens_per_sec": completion_tokens / (trained - start)}
    return state, {**rollout.metrics(run.cfg.grpo.group_size), **record, **times, **rates}
