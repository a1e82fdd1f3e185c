"""The training loop: resume or start, step, log, evaluate, checkpoint, roll back, stop on a signal.

>>> from jaxtrain.run_config import apply_overrides, default_config
>>> cfg = apply_overrides(default_config("gpt-tiny"), ["steps=20", "mesh=data=2,tensor=2"])
>>> summary = train(cfg)                                    # doctest: +SKIP
>>> summary["loss"], summary["tokens_per_sec"]              # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import functools
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxtrain.analysis.flops import peak_flops, peak_too_low
from jaxtrain.data.datasets import Dataset
from jaxtrain.run_config import ConfigError, RunConfig
from jaxtrain.sharding.mesh import parse_layout
from jaxtrain.training import run_lock
from jaxtrain.training.checkpoint import Checkpoints
from jaxtrain.training.distributed import to_host
from jaxtrain.training.metrics import MetricsLog, check_outputs, tensorboard_writer_class
from jaxtrain.training.profiling import StepProfiler, check_profile_settings, memory_profile_on_oom, step_profiler
from jaxtrain.training.recovery import (
    Preempted,
    Progress,
    SkippedSteps,
    StopRequest,
    check_restored_tokenizer,
    check_resume,
    initial_state,
    open_checkpoints,
    preemption_requested,
    roll_back,
    save_checkpoint,
    stop_signals,
)
from jaxtrain.training.reference import reference_at_start
from jaxtrain.training.run_identity import config_json
from jaxtrain.training.setup import Run, setup, with_data_vocab
from jaxtrain.training.stragglers import StepTimes
from jaxtrain.training.tracking import WandbSink, wandb_module

GENERATE_EVAL_KEY = "train.generate_eval_every"
EVAL_TASKS_KEY = "train.eval_tasks"


class Evaluation(Protocol):
    """An evaluation the loop runs beside the validation loss, every `every` steps and after the last (e.g.
    `jaxtrain.posttrain.sft_eval.GenerationEval`); `setting` names the config key that asks for it, if one does."""

    every: int
    setting: str

    def __call__(self, run: Run, params: Any, step: int) -> dict[str, float]:
        """Metrics of `params` (the train state's, as stored) after `step`, named `val_*`."""
        ...


def refuse_pipeline_mesh(cfg: RunConfig, asked: str, error: type[ConfigError] = ConfigError) -> None:
    """An evaluation that runs every layer on each device (generation, lm-eval's tasks) cannot run on a pipeline
    mesh: `error` saying so, naming `asked` (the setting as given, `key=value`), where `cfg.mesh` has one."""
    if parse_layout(cfg.mesh).axes.get("pipeline", 1) > 1:
        key = asked.split("=")[0]
        raise error(
            f"{asked} with a pipeline mesh ({cfg.mesh}): it runs every layer on each device; use a mesh without a "
            f"pipeline axis, or unset {key}."
        )


def evaluate(run: Run, params: Any) -> dict[str, float]:
    """Metrics over `eval_batches` fixed validation batches. `val_loss` is the mean over every target token of them
    that the loss counts (a chat run: the assistants' tokens), not a mean of the batches' means, which would weigh
    a batch with few such tokens as much as one with many; `val_targets` is how many there were. Other metrics are
    the batches' mean."""
    results, counts = [], []
    for k in range(run.cfg.train.eval_batches):
        batch = run.batch("val", k)
        results.append(to_host(run.compiled_eval(params, batch)))
        counts.append(float(to_host(run.counted_targets(batch))))
    metrics = {f"val_{k}": float(np.mean([r[k] for r in results])) for k in results[0]}
    total = sum(counts)
    losses = np.array([r["loss"] for r in results], np.float64)
    metrics["val_loss"] = float(losses @ np.array(counts) / total) if total else float("nan")
    return {**metrics, "val_targets": total}


def train(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
    dataset: Dataset | None = None,
    evaluations: Sequence[Evaluation] = (),
) -> dict[str, Any]:
    """Run `cfg` to completion. Returns a summary: final metrics, throughput, the logged history, the state, and
    the `Run` it ran (its shardings and compiled step, for inspection).

    `on_metrics` receives each logged step's record, `{"step": ..., "loss": ..., ...}`, as it is written to
    `tracking.metrics_file` (e.g. to redraw a plot in a notebook). `dataset`: your own data instead of
    `cfg.data.source`, e.g. `jaxtrain.data.datasets.TokenWindows(token_ids, seq_len, seed)` for token ids in memory
    (any object with the `Dataset` protocol's `task`, `shapes` and `rows`). A checkpoint records the config, not the
    data: resuming with other data is not detected. `evaluations`: more metrics at their own cadence (`Evaluation`:
    `jaxtrain.evaluation.in_loop.train`, which is `jaxtrain.train`, adds the generation score of
    `train.generate_eval_every` and the tasks of `train.eval_tasks`).

    With `checkpoint.dir`, it holds that directory's lock (`run_lock`: one writer at a time), resumes from the
    newest checkpoint there if its config defines the same run (`run_identity`; else `RunIdentityError`, before
    anything is written), and saves every `checkpoint.every` steps and at the end; on SIGTERM or SIGINT it finishes
    the step, saves, and raises `Preempted`. After `rollback_after` skipped (non-finite) updates in a row it restores
    the newest checkpoint and skips the batches since. With several processes, process 0 logs, writes the metrics
    (file, TensorBoard, `on_metrics`); every process trains and checkpoints its shards.
    """
    cfg = with_data_vocab(cfg)  # before the config is compared with a checkpoint's or stored: as the run builds it
    _check_start(cfg, evaluations)
    lead = jax.process_index() == 0
    log = log if lead else lambda *_: None
    if lead and cfg.tracking.tensorboard_dir:
        tensorboard_writer_class()  # a missing tensorboardX is an error now, not after compiling
    if lead and cfg.tracking.wandb_project:  # likewise a missing wandb
        wandb_module()
    with run_lock.holding(cfg.checkpoint.dir, log):  # one writer per checkpoint directory, from start to exit
        # Refused before anything compiles: a resume of another run's checkpoints, metrics into another run's files.
        run_name = check_resume(cfg)
        profiled = check_profile_settings(cfg.tracking.profile_steps, cfg.tracking.profile_dir)
        if lead:
            check_outputs(cfg.tracking.metrics_file, cfg.tracking.tensorboard_dir, run_name)
        run = setup(cfg, log, devices, dataset)
        with open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints:
            state, progress = initial_state(run, checkpoints, log)
            reference_at_start(run, state, progress.step, log)  # DPO without adapters: the pairs' reference
            devices, dtype = list(run.shardings.mesh.devices.flat), getattr(cfg.model, "dtype", "float32")
            peak, peak_source = peak_flops(devices, dtype)
            log(f"model FLOPs/step {run.flops_per_step:.3e}; peak {peak / 1e9:,.0f} GFLOP/s ({peak_source})")
            sink = metrics_sink(cfg, lead, on_metrics, progress, log)
            traced = step_profiler(profiled, cfg.tracking.profile_dir)
            recorder = Recorder(run, Peak(peak, functools.partial(peak_too_low, devices, dtype), log), sink)
            with recorder, stop_signals() as stop, traced as profiler:
                state, preempted = _loop(run, state, progress, checkpoints, recorder, stop, log, profiler, evaluations)
                if checkpoints:
                    checkpoints.wait()  # a second Ctrl-C here still exits at once
    if preempted:
        raise Preempted(progress.step, stop.signum or signal.SIGTERM)

    summary = {**recorder.summary(), "nonfinite_total": progress.nonfinite_total, "rollbacks": progress.rollbacks}
    log("done: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return {**summary, "history": recorder.history, "state": state, "run": run}


def _check_start(cfg: RunConfig, evaluations: Sequence[Evaluation]) -> None:
    """Refuse, before anything is built, what this loop cannot run: another engine; a generation score or tasks no
    evaluation of this call computes (they would be silently missing from the metrics); a restored model's
    fine-tuning on data of another tokenizer."""
    if cfg.engine.kind != "spmd":  # the asynchronous engine is another program, not a variant of this loop
        raise ConfigError(
            f"engine.kind={cfg.engine.kind}: this is the SPMD loop. Run the engine with `jaxtrain train --engine ray` "
            "or jaxtrain.asynchronous.engine.train_async(cfg)."
        )
    check_restored_tokenizer(cfg)
    if cfg.train.generate_eval_every and not any(getattr(e, "setting", "") == GENERATE_EVAL_KEY for e in evaluations):
        raise ConfigError(
            f"{GENERATE_EVAL_KEY}={cfg.train.generate_eval_every}: the generation score needs the generator, which "
            "this loop does not import: train with jaxtrain.train(cfg) (jaxtrain.evaluation.in_loop.train, as "
            f"`jaxtrain train` does), or set {GENERATE_EVAL_KEY}=0."
        )
    if cfg.train.eval_tasks and not any(getattr(e, "setting", "") == EVAL_TASKS_KEY for e in evaluations):
        raise ConfigError(
            f"{EVAL_TASKS_KEY}={cfg.train.eval_tasks}: lm-eval's tasks need its harness, which this loop does not "
            "import: train with jaxtrain.train(cfg) (jaxtrain.evaluation.in_loop.train, as `jaxtrain train` does), "
            "or unset it."
        )


def metrics_sink(
    cfg: RunConfig, lead: bool, on_metrics: Callable | None, progress: Progress, log: Callable[[str], None]
) -> MetricsLog:
    """Where process 0 writes the metrics of the run `progress` names, from its step on (the other processes train
    silently)."""
    if not lead:
        return MetricsLog(None, cfg.train.steps, stream=None)
    t = cfg.tracking
    wandb = None
    if t.wandb_project:
        directory = t.wandb_dir or cfg.checkpoint.dir or "."
        wandb = WandbSink(t.wandb_project, directory, progress.run, config_json(cfg), t.wandb_mode)
        sync = f" (wandb sync {wandb.files} uploads it)" if wandb.mode == "offline" else ""
        log(f"W&B: {wandb.mode} run {progress.run} of project {t.wandb_project} in {wandb.files}{sync}")
    try:
        return MetricsLog(
            t.metrics_file or None,
            cfg.train.steps,
            cfg.train.progress,
            tensorboard_dir=t.tensorboard_dir or None,
            on_record=on_metrics,
            run=progress.run,
            start=progress.step,
            wandb=wandb,
        )
    except BaseException:
        if wandb is not None:  # the W&B run is open already: close it, or its file stays unwritten
            wandb.close()
        raise


def _loop(
    run: Run,
    state: Any,
    progress: Progress,
    checkpoints: Checkpoints | None,
    recorder: Recorder,
    stop: StopRequest,
    log: Callable[[str], None],
    profiler: StepProfiler,
    evaluations: Sequence[Evaluation] = (),
) -> tuple[Any, bool]:
    """Train from `progress.step` to `train.steps` or a preemption; returns the last state and whether it was
    preempted. Updates `progress`. `profiler` runs each step (tracing the chosen ones)."""
    t, steps = run.cfg.train, run.cfg.train.steps
    skipped, rollbacks = SkippedSteps(progress, t.rollback_after), collections.Counter()
    recorder.start(progress.step)
    pending = None  # a logged step's metrics, read only once the next step runs
    batch = run.batch("train", progress.step + progress.data_offset)
    times = StepTimes(run.cfg.engine.slowdowns(), log)  # each process's own time per step: who is the straggler
    preempted = False
    while progress.step < steps and not preempted:
        number = progress.step + 1
        try:
            with times.own():
                state, metrics = profiler.run(number, functools.partial(run.train_step, state, batch))
        except jax.errors.JaxRuntimeError as err:
            memory_profile_on_oom(number, run.cfg.tracking.profile_dir or run.cfg.checkpoint.dir or ".")(err)
            raise
        times.stepped(metrics)
        done = progress.step = number
        skipped.add(done, metrics)
        if pending:
            recorder.record(*pending)
            pending = None
        if done < steps:
            with times.own():
                batch = run.batch("train", done + progress.data_offset)  # built on the host while the device computes
        preempted = preemption_requested(stop, done)
        save = checkpoints is not None and (checkpoints.due(done, steps) or preempted)
        bad_step = skipped.read(keep_newest=not save)  # a save waits for the step anyway: read its flag too
        if bad_step is not None:
            state = roll_back(run, checkpoints, progress, bad_step, rollbacks, log)
            batch, pending = run.batch("train", progress.step + progress.data_offset), None
            recorder.start(progress.step)
            recorder.sink.rewind(progress.step)
            continue  # if preempted too, stop: the checkpoint just restored is on disk, and a rerun resumes there
        extra = {"nonfinite_total": progress.nonfinite_total, **run.data_metrics(done + progress.data_offset)}
        pending = _record(run, recorder, times, done, state, metrics, extra, evaluations)
        # Mid-streak the params are the ones before it; a save then would only hide the older checkpoint.
        if save and (skipped.streak == 0 or done == steps or preempted):
            save_checkpoint(run, checkpoints, state, progress, log)
    if pending:
        recorder.record(*pending)
    skipped.read(keep_newest=False)  # count the last step's flag; too late to roll back
    return state, preempted


def _record(
    run: Run,
    recorder: Recorder,
    times: StepTimes,
    done: int,
    state: Any,
    metrics: Any,
    extra: dict[str, float],
    evaluations: Sequence[Evaluation] = (),
) -> tuple | None:
    """Record step `done` if it is evaluated, now, before the next step donates the params; return it if it is only
    logged, to be recorded once the next step runs (reading its metrics then does not stall the device)."""
    t, steps = run.cfg.train, run.cfg.train.steps
    logged, validated = _due(done, steps, t.log_every), _due(done, steps, t.eval_every)
    due = [e for e in evaluations if _due(done, steps, e.every)]
    if not (logged or validated or due):
        return None
    ready = recorder.ready((state, metrics))  # after the next batch is built: that overlapped this step
    if logged:
        times.check(done)
    if not (validated or due):
        return (done, metrics, ready, extra)
    evaluated = functools.partial(_evaluate, run, state["params"], done, validated, due)
    recorder.record(done, metrics, ready, extra, evaluated)
    return None


def _due(step: int, steps: int, every: int) -> bool:
    """Whether something done `every` steps (0: never) is due after `step` of `steps`: it is after the last one."""
    return every > 0 and (step % every == 0 or step == steps)


def _evaluate(run: Run, params: Any, step: int, validated: bool, due: Sequence[Evaluation]) -> dict[str, float]:
    """The validation metrics (if `validated`) and those of the evaluations `due` after `step`."""
    metrics = evaluate(run, params) if validated else {}
    for evaluation in due:
        metrics.update(evaluation(run, params, step))
    return metrics


class Peak:
    """The peak FLOP/s MFU is reported against. A run whose model FLOP/s exceed it proves it too low (a measurement
    taken while other work held the cores, a figure given too small): it is then raised to the fastest rate seen, so
    no MFU exceeds 1, and the log says so once, with why and what to do (`too_low` names the cause and forgets a
    cached measurement)."""

    def __init__(self, flops: float, too_low: Callable[[float], str], log: Callable[[str], None]):
        self.flops, self.too_low, self.log, self.raised = flops, too_low, log, False

    def fraction(self, step: int, rate: float) -> float:
        """`rate` model FLOP/s as a fraction of the peak, raising the peak first if `rate` exceeds it."""
        if rate > self.flops and not self.raised:
            self.log(
                f"step {step}: the model ran at {rate / 1e9:,.1f} GFLOP/s, above the peak of {self.flops / 1e9:,.1f} "
                f"GFLOP/s: {self.too_low(rate)}. From here on MFU is reported against the fastest rate seen."
            )
            self.raised = True
        self.flops = max(self.flops, rate)
        return rate / self.flops


class Recorder:
    """Turns step metrics into log records with step time, throughput and MFU, and keeps the history.

    A step's time ends when its outputs are ready (`ready`), not when the call that dispatched it returned: JAX
    dispatches asynchronously, and on CPU it may also run a step on the calling thread, so a clock read at dispatch
    hands one step's time to the next."""

    def __init__(self, run: Run, peak: Peak, sink: MetricsLog):
        self.run, self.peak, self.sink = run, peak, sink
        self.history: list[dict[str, Any]] = []
        self.train_time, self.trained_steps = 0.0, 0
        self.start(0)

    def start(self, step: int) -> None:
        """Training (re)starts at `step`: the interval that follows pays one-off costs and is not throughput."""
        self.first_step = self.last_step = step
        self.last_time = time.perf_counter()

    @staticmethod
    def ready(outputs: Any) -> float:
        """Wait for a step's `outputs`; the time they were ready, which ends the step's interval."""
        jax.block_until_ready(outputs)
        return time.perf_counter()

    def record(
        self,
        step: int,
        metrics: dict[str, jax.Array],
        ready: float,
        extra: dict[str, float] | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Log `step`'s metrics with the step time and throughput since the last record (`ready`: when the step's
        outputs were, from `Recorder.ready`), plus `extra` and the metrics `evaluate` returns (run after the clock
        stops: evaluation is not training time)."""
        values = {k: float(v) for k, v in to_host(metrics).items()}
        elapsed, steps = ready - self.last_time, step - self.last_step
        if self.last_step > self.first_step:
            self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + steps
        values["step_time_s"] = elapsed / steps
        values["tokens_per_sec"] = self.run.tokens_per_step * steps / elapsed
        values["mfu"] = self.peak.fraction(step, self.run.flops_per_step * steps / elapsed)
        values.update({**(extra or {}), **(evaluate() if evaluate else {})})
        self.sink.write(step, values)
        self.history.append({"step": step, **values})
        # The next interval starts where this step's outputs were ready, or after the evaluation, which is not training.
        self.last_step, self.last_time = step, time.perf_counter() if evaluate else ready

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *_) -> None:
        self.sink.close()

    def summary(self) -> dict[str, Any]:
        """The last record's loss and validation metrics, and throughput over every interval but the first."""
        last = self.history[-1] if self.history else {"step": self.first_step, "loss": float("nan")}
        rate = self.trained_steps / self.train_time if self.trained_steps else float("nan")
        return {
            "steps": last["step"],
            "loss": last["loss"],
            **{k: v for k, v in last.items() if k.startswith("val_")},
            "tokens_per_sec": rate * self.run.tokens_per_step,
            "mfu": rate * self.run.flops_per_step / self.peak.flops,
            "step_time_s": 1 / rate,
        }
