"""The training run, top to bottom: mesh -> rules -> plan -> sharded init -> compiled step -> loop.

>>> from jaxtrain.config import apply_overrides, default_config
>>> cfg = apply_overrides(default_config("gpt-tiny"), ["steps=20", "mesh=data=2,tensor=2"])
>>> summary = train(cfg)                                    # doctest: +SKIP
>>> summary["loss"], summary["tokens_per_sec"]              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtrain.checkpoint import Checkpoints, restore
from jaxtrain.config import ConfigError, RunConfig
from jaxtrain.data import Dataset, global_batch, make_dataset
from jaxtrain.flops import peak_flops
from jaxtrain.mesh import build_mesh, describe_mesh, parse_layout
from jaxtrain.metrics import MetricsLog
from jaxtrain.optim import make_optimizer
from jaxtrain.pipeline import Pipeline, make_pipeline, stacked_layer_count
from jaxtrain.plan import ModelParts, Plan, make_plan, memory_report, split_model
from jaxtrain.rules import ShardingRules
from jaxtrain.step import GradFn, accumulate_gradients, eval_step, replica_gradients, train_step, value_and_grad
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

    `devices`: the devices the mesh spans (default: all of them).
    """
    run = build(cfg, log, devices)
    log(memory_report(run.train_step))
    return run


def build(cfg: RunConfig, log: Callable[[str], None] = print, devices: Sequence[jax.Device] | None = None) -> Setup:
    """Like `setup`, but compiles nothing: steps compile when first used."""
    spec, _ = resolve_model(cfg.model_name)
    layout = parse_layout(cfg.mesh)
    mesh = build_mesh(layout, devices)
    rules = ShardingRules.default().with_overrides({**layout.rules, **cfg.rules})
    log(describe_mesh(mesh))

    model = split_model(functools.partial(spec.module, cfg.model))
    if mesh.shape["pipeline"] > 1:  # a model the pipeline cannot split is an error before any data is read
        stacked_layer_count(model.logical_names, model.abstract_params)
    optimizer, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    dataset = make_dataset(
        cfg.data.source,
        spec.task,
        seed=cfg.train.seed,
        seq_len=cfg.data.seq_len,
        vocab_size=getattr(cfg.model, "vocab_size", 256),
        val_fraction=cfg.data.val_fraction,
    )
    pipeline = _pipeline(cfg, mesh, model, dataset.shapes(cfg.data.batch_size))
    if pipeline:
        log(pipeline.describe())
    plan = make_plan(mesh, rules, model, optimizer, pipeline.layout if pipeline else None)
    log(plan.table())
    # Check the batch divides over the devices before anything compiles.
    plan.abstract_batch(dataset.shapes(cfg.data.batch_size), cfg.train.grad_accum)

    grad_fn = _grad_fn(cfg, plan, pipeline)
    seq_len = cfg.data.seq_len if spec.task == "lm" else 1
    return Setup(
        cfg,
        plan,
        dataset,
        optimizer,
        grad_fn,
        functools.partial(train_step, grad_fn=grad_fn, optimizer=optimizer, schedule=schedule),
        cfg.model.train_flops(cfg.data.batch_size, seq_len),
        cfg.data.batch_size * seq_len,
        pipeline,
    )


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


def _grad_fn(cfg: RunConfig, plan: Plan, pipeline: Pipeline | None) -> GradFn:
    """Loss and gradient of a batch: accumulated over `grad_accum` pieces, synchronised as `grad_sync` says."""
    grad_fn = pipeline.value_and_grad(plan.model.loss_fn) if pipeline else value_and_grad(plan.model.loss_fn)
    grad_fn = accumulate_gradients(grad_fn, cfg.train.grad_accum)
    if cfg.train.grad_sync == "xla":
        return grad_fn
    if cfg.train.grad_sync != "fused":
        raise ConfigError(f"train.grad_sync='{cfg.train.grad_sync}': use xla or fused.")
    if not plan.is_pure_data_parallel():
        raise ConfigError(
            "train.grad_sync=fused needs a purely data-parallel mesh (every parameter replicated); "
            f"mesh '{cfg.mesh}' shards parameters. Use grad_sync=xla."
        )
    return replica_gradients(grad_fn, plan.mesh, plan.rules.batch_axes())


def evaluate(run: Setup, params: Any) -> dict[str, float]:
    """Mean metrics over `eval_batches` fixed validation batches."""
    results = [run.compiled_eval(params, run.batch("val", k)) for k in range(run.cfg.train.eval_batches)]
    return {f"val_{k}": float(np.mean([jax.device_get(r[k]) for r in results])) for k in results[0]}


class Preempted(Exception):
    """Training stopped on SIGTERM after saving a checkpoint at `step`."""

    def __init__(self, step: int):
        super().__init__(f"preempted after step {step}")
        self.step = step


def train(
    cfg: RunConfig, log: Callable[[str], None] = print, devices: Sequence[jax.Device] | None = None
) -> dict[str, Any]:
    """Run `cfg` to completion. Returns a summary: final metrics, throughput, the logged history and the state.

    With `train.checkpoint_dir`, it resumes from the newest checkpoint there and saves every `checkpoint_every`
    steps and at the end; on SIGTERM it finishes the step, saves, and raises `Preempted`.
    """
    run = setup(cfg, log, devices)
    checkpoints = _checkpoints(cfg)
    state, start = _initial_state(run, checkpoints, log)
    peak, peak_source = peak_flops(list(run.plan.mesh.devices.flat), getattr(cfg.model, "dtype", "float32"))
    log(f"model FLOPs/step {run.flops_per_step:.3e}; peak {peak / 1e9:,.0f} GFLOP/s ({peak_source})")

    sink = MetricsLog(cfg.train.metrics_file or None, cfg.train.steps, progress=cfg.train.progress)
    recorder = Recorder(run, peak, sink, start)
    steps, pending = cfg.train.steps, None
    batch, done = run.batch("train", start), start
    with _sigterm_flag() as stop:
        for step in range(start, steps):
            state, metrics = run.train_step(state, batch)
            done = step + 1
            if pending:  # read the previous step's metrics only now, while the device runs this step
                recorder.record(*pending)
                pending = None
            if done < steps:
                batch = run.batch("train", done)  # built on the host while the device computes
            if done % cfg.train.eval_every == 0 or done == steps:
                recorder.record(done, metrics, evaluate(run, state["params"]))  # before the next step donates state
            elif done % cfg.train.log_every == 0:
                pending = (done, metrics)
            if checkpoints and (checkpoints.due(done, steps) or stop.is_set()):
                checkpoints.save(done, run.plan.state_in_model_order(state), {"step": done, "config": _as_json(cfg)})
            if stop.is_set():
                break
    recorder.close()
    if checkpoints:
        checkpoints.wait()
        checkpoints.close()
    if stop.is_set():
        raise Preempted(done)

    summary = recorder.summary()
    log("done: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return {**summary, "history": recorder.history, "state": state}


def _checkpoints(cfg: RunConfig) -> Checkpoints | None:
    if not cfg.train.checkpoint_dir:
        return None
    t = cfg.train
    return Checkpoints(t.checkpoint_dir, t.checkpoint_every, t.checkpoint_keep, t.checkpoint_keep_every)


def _initial_state(run: Setup, checkpoints: Checkpoints | None, log: Callable[[str], None]) -> tuple[Any, int]:
    """The newest checkpoint in the run's directory, else `train.restore`, else a fresh init; and its step."""
    plan, cfg = run.plan, run.cfg
    found = checkpoints.restore_latest(plan.abstract_model_state()) if checkpoints else None
    if found is None and cfg.train.restore:
        found = restore(cfg.train.restore, plan.abstract_model_state())
    if found is None:
        return plan.init_state(run.optimizer, cfg.train.seed), 0
    state, meta = found
    log(f"resuming at step {meta['step']} from a checkpoint")
    return plan.state_from_model_order(state), int(meta["step"])


def _as_json(cfg: RunConfig) -> dict[str, Any]:
    return {**dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model)}


@contextlib.contextmanager
def _sigterm_flag():
    """A flag set by SIGTERM while inside (the handler is restored after); off the main thread, never set."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


class Recorder:
    """Turns step metrics into log records with throughput and MFU, and keeps the history."""

    def __init__(self, run: Setup, peak: float, sink: MetricsLog, first_step: int = 0):
        self.run, self.peak, self.sink = run, peak, sink
        self.history: list[dict[str, Any]] = []
        self.first_step = first_step
        self.last_step, self.last_time = first_step, time.perf_counter()
        self.train_time, self.trained_steps = 0.0, 0

    def record(self, step: int, metrics: dict[str, jax.Array], extra: dict[str, float] | None = None) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed, steps = time.perf_counter() - self.last_time, step - self.last_step
        if (
            self.last_step > self.first_step
        ):  # the first interval pays one-off costs (allocation, warm-up): not throughput
            self.train_time, self.trained_steps = self.train_time + elapsed, self.trained_steps + steps
        values["tokens_per_sec"] = self.run.tokens_per_step * steps / elapsed
        values["mfu"] = self.run.flops_per_step * steps / elapsed / self.peak
        values.update(extra or {})
        self.sink.write(step, values)
        self.history.append({"step": step, **values})
        self.last_step, self.last_time = step, time.perf_counter()  # evaluation time is not training time

    def close(self) -> None:
        self.sink.close()

    def summary(self) -> dict[str, Any]:
        last = self.history[-1]
        rate = self.trained_steps / self.train_time if self.trained_steps else float("nan")
        return {
            "steps": last["step"],
            "loss": last["loss"],
            **{k: v for k, v in last.items() if k.startswith("val_")},
            "tokens_per_sec": rate * self.run.tokens_per_step,
            "mfu": rate * self.run.flops_per_step / self.peak,
            "step_time_s": 1 / rate,
        }
