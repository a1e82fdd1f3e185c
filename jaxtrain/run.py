"""The training run, top to bottom: mesh -> rules -> plan -> sharded init -> compiled step -> loop.

>>> from jaxtrain.config import apply_overrides, default_config
>>> cfg = apply_overrides(default_config("gpt-tiny"), ["steps=20", "mesh=data=2,tensor=2"])
>>> summary = train(cfg)                                    # doctest: +SKIP
>>> summary["loss"], summary["tokens_per_sec"]              # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtrain import run_lock
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.comm import GradientSync
from jaxtrain.comm_report import communication_report
from jaxtrain.config import ConfigError, RunConfig
from jaxtrain.data import Dataset, global_batch, make_dataset, model_data_args
from jaxtrain.distributed import describe_processes, to_host
from jaxtrain.flops import peak_flops
from jaxtrain.mesh import build_mesh, describe_mesh, parse_layout
from jaxtrain.metrics import MetricsLog, check_outputs, tensorboard_writer_class
from jaxtrain.optim import make_optimizer
from jaxtrain.pipeline import Pipeline, make_pipeline, stacked_layer_count
from jaxtrain.plan import (
    ModelParts,
    Plan,
    fmt_bytes,
    make_plan,
    memory_report,
    split_model,
)
from jaxtrain.recovery import (
    Preempted,
    Progress,
    SkippedSteps,
    StopRequest,
    check_resume,
    initial_state,
    open_checkpoints,
    preemption_requested,
    roll_back,
    save_checkpoint,
    stop_signals,
)
from jaxtrain.rules import ShardingRules
from jaxtrain.step import GradFn, accumulate_gradients, eval_step, replica_gradients, value_and_grad
from jaxtrain.updates import UpdatePolicy
from models import resolve_model


@dataclasses.dataclass
class Setup:
    """Everything a loop needs, built once: the plan, the step functions (compiled on first use), data, and the
    step's model FLOPs."""

    cfg: RunConfig
    plan: Plan
    dataset: Dataset
    optimizer: Any
    grad_fn: GradFn  # ((loss, metrics), grads) of params on a global batch, as the train step computes them
    step_fn: Callable  # (state, batch) -> (state, metrics), uncompiled
    flops_per_step: float
    tokens_per_step: int
    pipeline: Pipeline | None = None
    grad_sync: GradientSync | None = None  # an explicit gradient synchronisation algorithm, if one is chosen

    def batch(self, split: str, step: int) -> dict[str, jax.Array]:
        return global_batch(self.dataset, split, step, self.cfg.data.batch_size, self._batch_shardings)

    @functools.cached_property
    def _batch_shardings(self) -> dict[str, Any]:  # computed once, not at every step of the loop
        return {k: v.sharding for k, v in self._abstract_batch(self.cfg.train.grad_accum).items()}

    def _abstract_batch(self, grad_accum: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
        return self.plan.abstract_batch(self.dataset.shapes(self.cfg.data.batch_size), grad_accum)

    @functools.cached_property
    def train_step(self) -> jax.stages.Compiled:
        """The compiled optimizer step; the state argument is donated."""
        plan = self.plan
        return plan.compile(
            self.step_fn,
            plan.abstract_state,
            self._abstract_batch(self.cfg.train.grad_accum),
            out_shardings=(plan.state_shardings, plan.replicated),
        )

    @functools.cached_property
    def compiled_grad(self) -> jax.stages.Compiled:
        """`grad_fn` compiled: (params, batch) -> ((loss, metrics), grads), for inspection and tests."""
        plan = self.plan
        return plan.compile(
            self.grad_fn,
            plan.abstract_state["params"],
            self._abstract_batch(self.cfg.train.grad_accum),
            donate_state=False,
        )

    @functools.cached_property
    def compiled_eval(self) -> jax.stages.Compiled:
        """Loss and metrics on a batch, without updating."""
        plan = self.plan
        loss_fn = self.pipeline.loss(plan.model.loss_fn) if self.pipeline else plan.model.loss_fn
        return plan.compile(
            functools.partial(eval_step, loss_fn=loss_fn),
            plan.abstract_state["params"],
            self._abstract_batch(),
            donate_state=False,
            out_shardings=plan.replicated,
        )


def setup(cfg: RunConfig, log: Callable[[str], None] = print, devices: Sequence[jax.Device] | None = None) -> Setup:
    """Build mesh, rules, plan and data, and compile the train step (nothing runs yet).

    `devices`: the devices the mesh spans (default: all of them). The preflight it logs is a few lines; with
    `train.verbose`, the full tables.
    """
    run = build(cfg, log, devices)
    log(memory_report(run.train_step))
    log(communication(run) if cfg.train.verbose else communication_summary(run))
    return run


def communication(run: Setup) -> str:
    """The bytes each device sends per step, from the compiled train step, beside the analytic model of an explicit
    gradient synchronisation when one is chosen."""
    expected = run.grad_sync.expected(run.plan.param_bytes()) if run.grad_sync else ()
    return communication_report(run.train_step, run.plan.mesh).format(expected)


def communication_summary(run: Setup) -> str:
    """One line: the mean bytes a device sends per step, in all and over each set of mesh axes."""
    report = communication_report(run.train_step, run.plan.mesh)
    by_axes = collections.Counter()
    for row in report.rows:
        by_axes["+".join(row.axes) or "-"] += row.mean
    where = ", ".join(f"{axes} {fmt_bytes(sent)}" for axes, sent in by_axes.items())
    return f"communication per step: {fmt_bytes(report.per_device.mean())} sent per device" + (
        f" ({where})" if where else ""
    )


def build(cfg: RunConfig, log: Callable[[str], None] = print, devices: Sequence[jax.Device] | None = None) -> Setup:
    """Like `setup`, but compiles nothing: steps compile when first used."""
    spec, _ = resolve_model(cfg.model_name)
    layout = parse_layout(cfg.mesh)
    mesh = build_mesh(layout, devices)
    if jax.process_count() > 1:
        log(describe_processes(mesh))
    rules = ShardingRules.default().with_overrides({**layout.rules, **cfg.rules})
    if cfg.data.partition != "uniform" and rules.batch_axes()[:1] != ("replica",):
        raise ConfigError(  # a replica's rows are then no longer one contiguous block of the batch
            f"data.partition={cfg.data.partition} needs 'replica' first in the batch rule; it is {rules.batch_axes()}."
        )
    verbose = cfg.train.verbose
    log(describe_mesh(mesh) if verbose else describe_mesh(mesh).splitlines()[0])  # the first line names the axes

    model = split_model(functools.partial(spec.module, cfg.model))
    if mesh.shape["pipeline"] > 1:  # a model the pipeline cannot split is an error before any data is read
        stacked_layer_count(model.logical_names, model.abstract_params)
    optimizer, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    dataset = make_dataset(
        cfg.data.source,
        spec.task,
        seed=cfg.train.seed,
        seq_len=cfg.data.seq_len,
        **model_data_args(cfg.model),
        val_fraction=cfg.data.val_fraction,
        partition=cfg.data.partition,
        replicas=mesh.shape["replica"],
    )
    pipeline = _pipeline(cfg, mesh, model, dataset.shapes(cfg.data.batch_size))
    if pipeline and verbose:
        log(pipeline.describe())
    policy = _update_policy(cfg, mesh)
    plan = make_plan(mesh, rules, model, optimizer, pipeline.layout if pipeline else None, policy)
    log(plan.table() if verbose else f"{plan.totals()} (--verbose or train.verbose=true: the full tables)")
    # Check the batch divides over the devices before anything compiles.
    plan.abstract_batch(dataset.shapes(cfg.data.batch_size), cfg.train.grad_accum)

    sync = _gradient_sync(cfg, plan)
    grad_fn = _grad_fn(cfg, plan, pipeline, sync)
    seq_len = cfg.data.seq_len if spec.task == "lm" else 1
    return Setup(
        cfg,
        plan,
        dataset,
        optimizer,
        grad_fn,
        policy.step_fn(grad_fn, optimizer, schedule, mesh, cfg.train.steps),
        cfg.model.train_flops(cfg.data.batch_size, seq_len),
        cfg.data.batch_size * seq_len,
        pipeline,
        sync,
    )


def _update_policy(cfg: RunConfig, mesh: Mesh) -> UpdatePolicy:
    t = cfg.train
    policy = UpdatePolicy(t.sync, t.sync_every, t.staleness, t.outer_lr, t.outer_momentum)
    policy.check_mesh(mesh)
    if policy.name != "synchronous" and mesh.shape["pipeline"] > 1:
        raise ConfigError(f"train.sync={t.sync} with a pipeline axis is not supported yet: use sync=synchronous.")
    if policy.is_local and t.grad_sync != "xla":
        raise ConfigError(
            f"train.grad_sync={t.grad_sync} averages every step's gradient over all replicas, which train.sync="
            f"{t.sync} exists to avoid: inside each replica XLA reduces the gradient; use grad_sync=xla."
        )
    return policy


def _pipeline(cfg: RunConfig, mesh: Mesh, model: ModelParts, shapes: dict) -> Pipeline | None:
    """The pipeline schedule and stage layout when the mesh has a pipeline axis; None otherwise."""
    if mesh.shape["pipeline"] == 1:
        return None
    accum = cfg.train.grad_accum
    per_step = {k: jax.ShapeDtypeStruct((s.shape[0] // accum, *s.shape[1:]), s.dtype) for k, s in shapes.items()}
    return make_pipeline(
        mesh,
        model.loss_fn,
        model.logical_names,
        model.abstract_params,
        per_step,
        schedule=cfg.train.schedule,
        microbatches=cfg.train.microbatches,
        virtual=cfg.train.virtual_stages,
        balance=cfg.train.stage_balance,
        stash=cfg.train.pipeline_stash,
    )


def _grad_fn(cfg: RunConfig, plan: Plan, pipeline: Pipeline | None, sync: GradientSync | None) -> GradFn:
    """Loss and gradient of a batch: accumulated over `grad_accum` pieces, synchronised as `grad_sync` says."""
    grad_fn = pipeline.value_and_grad(plan.model.loss_fn) if pipeline else value_and_grad(plan.model.loss_fn)
    grad_fn = accumulate_gradients(grad_fn, cfg.train.grad_accum)
    if cfg.train.grad_sync == "xla":
        return grad_fn
    _check_pure_data_parallel(cfg, plan)
    if cfg.train.grad_sync == "fused":
        return replica_gradients(grad_fn, plan.mesh, plan.rules.batch_axes())
    return sync.wrap(grad_fn, plan.mesh)


def _gradient_sync(cfg: RunConfig, plan: Plan) -> GradientSync | None:
    """The explicit synchronisation algorithm `train.grad_sync` names, over the mesh's data-parallel axes."""
    t = cfg.train
    if t.grad_sync in ("xla", "fused"):
        return None
    _check_pure_data_parallel(cfg, plan)
    # In mesh order, whatever the order of the batch rule: ppermute over several axes requires it.
    axes = tuple(a for a in plan.mesh.axis_names if a in plan.rules.batch_axes() and plan.mesh.shape[a] > 1)
    bucket = int(t.grad_bucket_mb * 2**20)
    return GradientSync(t.grad_sync, axes, dict(plan.mesh.shape), bucket, t.ps_servers, t.grad_compression)


def _check_pure_data_parallel(cfg: RunConfig, plan: Plan) -> None:
    if plan.is_pure_data_parallel():
        return
    used = plan.param_axes()
    other = [a for a in plan.mesh.axis_names if plan.mesh.shape[a] > 1 and a not in plan.rules.batch_axes()]
    why = f"parameters are sharded over {', '.join(used)}" if used else f"axes {', '.join(other)} are not data axes"
    raise ConfigError(
        f"train.grad_sync={cfg.train.grad_sync} averages gradients over data-parallel replicas, each holding every "
        f"parameter; on mesh '{cfg.mesh}' {why}. Use grad_sync=xla, or a mesh of replica/data axes only (for "
        "fsdp, replicate the weights with rules.params.embed=)."
    )


def evaluate(run: Setup, params: Any) -> dict[str, float]:
    """Mean metrics over `eval_batches` fixed validation batches."""
    results = [run.compiled_eval(params, run.batch("val", k)) for k in range(run.cfg.train.eval_batches)]
    return {f"val_{k}": float(np.mean([to_host(r[k]) for r in results])) for k in results[0]}


def train(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Run `cfg` to completion. Returns a summary: final metrics, throughput, the logged history, the state, and
    the `Setup` it ran (its plan and compiled step, for inspection).

    `on_metrics` receives each logged step's record, `{"step": ..., "loss": ..., ...}`, as it is written to
    `train.metrics_file` (e.g. to redraw a plot in a notebook).

    With `train.checkpoint_dir`, it holds that directory's lock (`run_lock`: one writer at a time), resumes from the
    newest checkpoint there if its config defines the same run (`run_identity`; else `RunIdentityError`, before
    anything is written), and saves every `checkpoint_every` steps and at the end; on SIGTERM or SIGINT it finishes
    the step, saves, and raises `Preempted`. After `rollback_after` skipped (non-finite) updates in a row it restores
    the newest checkpoint and skips the batches since. With several processes, process 0 logs, writes the metrics
    (file, TensorBoard, `on_metrics`); every process trains and checkpoints its shards.
    """
    lead = jax.process_index() == 0
    log = log if lead else lambda *_: None
    if lead and cfg.train.tensorboard_dir:
        tensorboard_writer_class()  # a missing tensorboardX is an error now, not after compiling
    with run_lock.holding(cfg.train.checkpoint_dir, log):  # one writer per checkpoint directory, from start to exit
        # Refused before anything compiles: a resume of another run's checkpoints, metrics into another run's files.
        run_name = check_resume(cfg)
        if lead:
            check_outputs(cfg.train.metrics_file, cfg.train.tensorboard_dir, run_name)
        run = setup(cfg, log, devices)
        with open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints:
            state, progress = initial_state(run, checkpoints, log)
            peak, peak_source = peak_flops(list(run.plan.mesh.devices.flat), getattr(cfg.model, "dtype", "float32"))
            log(f"model FLOPs/step {run.flops_per_step:.3e}; peak {peak / 1e9:,.0f} GFLOP/s ({peak_source})")
            sink = _metrics_sink(cfg, lead, on_metrics, progress)
            with Recorder(run, peak, sink) as recorder, stop_signals() as stop:
                state, preempted = _loop(run, state, progress, checkpoints, recorder, stop, log)
                if checkpoints:
                    checkpoints.wait()  # a second Ctrl-C here still exits at once
    if preempted:
        raise Preempted(progress.step, stop.signum or signal.SIGTERM)

    summary = {**recorder.summary(), "nonfinite_total": progress.nonfinite_total, "rollbacks": progress.rollbacks}
    log("done: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return {**summary, "history": recorder.history, "state": state, "run": run}


def _metrics_sink(cfg: RunConfig, lead: bool, on_metrics: Callable | None, progress: Progress) -> MetricsLog:
    """Where process 0 writes the metrics of the run `progress` names, from its step on (the other processes train
    silently)."""
    if not lead:
        return MetricsLog(None, cfg.train.steps, stream=None)
    t = cfg.train
    return MetricsLog(
        t.metrics_file or None,
        t.steps,
        t.progress,
        tensorboard_dir=t.tensorboard_dir or None,
        on_record=on_metrics,
        run=progress.run,
        start=progress.step,
    )


def _loop(
    run: Setup,
    state: Any,
    progress: Progress,
    checkpoints: Checkpoints | None,
    recorder: Recorder,
    stop: StopRequest,
    log: Callable[[str], None],
) -> tuple[Any, bool]:
    """Train from `progress.step` to `train.steps` or a preemption; returns the last state and whether it was
    preempted. Updates `progress`."""
    t, steps = run.cfg.train, run.cfg.train.steps
    skipped, rollbacks = SkippedSteps(progress, t.rollback_after), collections.Counter()
    recorder.start(progress.step)
    pending = None  # a logged step's metrics, read only once the next step runs
    batch = run.batch("train", progress.step + progress.data_offset)
    preempted = False
    while progress.step < steps and not preempted:
        state, metrics = run.train_step(state, batch)
        done = progress.step = progress.step + 1
        skipped.add(done, metrics)
        if pending:
            recorder.record(*pending)
            pending = None
        if done < steps:
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
        extra = {"nonfinite_total": progress.nonfinite_total}
        if done % t.eval_every == 0 or done == steps:
            # Now, before the next step donates the params.
            recorder.record(done, metrics, extra, functools.partial(evaluate, run, state["params"]))
        elif done % t.log_every == 0:
            pending = (done, metrics, extra)
        # Mid-streak the params are the ones before it; a save then would only hide the older checkpoint.
        if save and (skipped.streak == 0 or done == steps or preempted):
            save_checkpoint(run, checkpoints, state, progress, log)
    if pending:
        recorder.record(*pending)
    skipped.read(keep_newest=False)  # count the last step's flag; too late to roll back
    return state, preempted


class Recorder:
    """Turns step metrics into log records with throughput and MFU, and keeps the history."""

    def __init__(self, run: Setup, peak: float, sink: MetricsLog):
        self.run, self.peak, self.sink = run, peak, sink
        self.history: list[dict[str, Any]] = []
        self.train_time, self.trained_steps = 0.0, 0
        self.start(0)

    def start(self, step: int) -> None:
        """Training (re)starts at `step`: the interval that follows pays one-off costs and is not throughput."""
        self.first_step = self.last_step = step
        self.last_time = time.perf_counter()

    def record(
        self,
        step: int,
        metrics: dict[str, jax.Array],
        extra: dict[str, float] | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Log `step`'s metrics with the throughput since the last record, plus `extra` and the metrics `evaluate`
        returns (run after the clock stops: evaluation is not training time)."""
        values = {k: float(v) for k, v in to_host(metrics).items()}
        elapsed, steps = time.perf_counter() - self.last_time, step - self.last_step
        if self.last_step > self.first_step:
            self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + steps
        values["tokens_per_sec"] = self.run.tokens_per_step * steps / elapsed
        values["mfu"] = self.run.flops_per_step * steps / elapsed / self.peak
        values.update({**(extra or {}), **(evaluate() if evaluate else {})})
        self.sink.write(step, values)
        self.history.append({"step": step, **values})
        self.last_step, self.last_time = step, time.perf_counter()  # evaluation time is not training time

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
            "mfu": rate * self.run.flops_per_step / self.peak,
            "step_time_s": 1 / rate,
        }
