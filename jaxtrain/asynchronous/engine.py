"""The asynchronous engine's driver: start the Ray processes, hand out batches, route gradients to the server shards,
log, evaluate, checkpoint, replace dead workers and server shards, and save on SIGTERM or SIGINT. `jaxtrain train
--engine ray --workers W --ps-shards S` runs it.

>>> cfg = apply_overrides(default_config("gpt-tiny"), ["kind=ray", "workers=4", "server_shards=2"])  # doctest: +SKIP
>>> summary = train_async(cfg)                                                              # doctest: +SKIP
>>> summary["samples_per_sec"], summary["staleness_mean"]                                  # doctest: +SKIP

The driver moves no arrays itself: it passes Ray object references, so a gradient travels from its worker to each
server shard, and params from the shards to a worker, through Ray's object store. Each update is sent to every shard
in the same order (Ray runs one caller's calls to an actor in order), so the shards agree on every version.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from jaxtrain.asynchronous import cluster
from jaxtrain.asynchronous.dispatch import Applied, Dispatcher, Job, staleness_report
from jaxtrain.asynchronous.shards import assign_leaves, split
from jaxtrain.run_config import ConfigError, RunConfig
from jaxtrain.sharding.mesh import parse_layout
from jaxtrain.training import run_identity, run_lock
from jaxtrain.training.checkpoint import Checkpoints
from jaxtrain.training.metrics import MetricsLog
from jaxtrain.training.recovery import (
    Preempted,
    Progress,
    StopRequest,
    check_resume,
    open_checkpoints,
    stop_signals,
    write_run_config,
)
from jaxtrain.training.setup import with_data_vocab

BATCH_LOG = "batch_log.jsonl"  # in the checkpoint directory: one row per applied gradient (`dispatch.Applied`)
POLL_S = 1.0  # the longest the driver waits on Ray before it looks again at signals and at the server shards
# A worker builds and compiles its run as it starts: one that has not started in this long (no free CPU for it on the
# cluster, say) is not waited for longer.
START_TIMEOUT_S = 1800.0


class ProcessesLost(RuntimeError):
    """Ray processes died that the run could not replace: more than `engine.worker_restarts` times, or a server shard
    with no checkpoint directory to restore the shards from. Not bad input: the command exits `PROCESSES_LOST_EXIT`,
    and a rerun (or a restarting launcher) resumes from the newest checkpoint."""


def check_engine(cfg: RunConfig) -> None:
    """What the engine cannot do, refused before any process starts."""
    if parse_layout(cfg.mesh).axes.get("pipeline", 1) > 1:
        raise ConfigError(
            f"--engine ray with mesh '{cfg.mesh}': a worker's mesh cannot have a pipeline axis yet (server shards "
            "hold params in the model's layer order). Use data, fsdp and tensor axes inside a worker."
        )
    if cfg.updates.policy != "synchronous":
        raise ConfigError(
            f"updates.policy={cfg.updates.policy} with --engine ray: the engine's own policy (engine.mode, "
            "engine.max_staleness) decides when gradients meet the params; leave updates.policy=synchronous."
        )


def train_async(
    cfg: RunConfig, log: Callable[[str], None] = print, on_metrics: Callable[[dict], None] | None = None
) -> dict[str, Any]:
    """Train `cfg` with `engine.workers` Ray workers and `engine.server_shards` server shards until the servers have
    applied `train.steps` updates. Returns the summary: final loss and validation metrics, samples/s, staleness
    statistics, gradients per worker, the batch log, the evaluations (with wall time) and the logged history.

    With `checkpoint.dir` it holds the directory's lock, resumes from its newest checkpoint when the config
    defines the same run, and saves the server state every `checkpoint.every` updates and at the end (Orbax, as
    `jaxtrain train`); batches handed out but not applied at a save are handed out again on resume. A dead worker is
    replaced; a dead server shard restores every shard from the newest checkpoint (`ProcessesLost` without one, or
    after `engine.worker_restarts` replacements). On SIGTERM or SIGINT it saves what the shards hold and raises
    `Preempted`, as `jaxtrain train` does."""
    cfg = with_data_vocab(cfg)  # as every worker's `build` sets it, before the config is stored or compared
    check_engine(cfg)
    with run_lock.holding(cfg.checkpoint.dir, log), cluster.connected(cfg.engine, log):
        run_name = check_resume(cfg)
        # The signal handlers replace Ray's (which exits the driver at once on SIGTERM): after `connected`.
        with open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints, stop_signals() as stop:
            job = _Job(cfg, log, checkpoints, run_name)
            try:
                return job.run(on_metrics, stop)
            finally:
                job.stop()


class _Job:
    """One run of the engine: its processes, its dispatcher and its outputs."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None], checkpoints: Checkpoints | None, run_name: str):
        self.cfg, self.log, self.checkpoints, self.run_name = cfg, log, checkpoints, run_name
        engine = cfg.engine
        self.slowdowns = engine.slowdowns()
        self.workers = self._start_workers(list(range(engine.workers)))
        leaves, names = ray.get(self.workers[0].initial.remote())
        self.owned = assign_leaves([leaf.nbytes for leaf in leaves], engine.server_shards)
        ray.get([w.set_shards.remote(self.owned) for w in self.workers])
        # Kept in the object store: shards started in place of a dead one begin from them, then load the checkpoint.
        parts = zip(split(names, self.owned), split(leaves, self.owned))
        self.initial = [(part_names, ray.put(part)) for part_names, part in parts]
        self.servers = self._start_servers()
        self.restarts = 0
        self._restore()

    def _start_workers(self, indices: list[int]) -> list[Any]:
        """Worker actors for `indices`, built in parallel (each builds and compiles its run)."""
        workers = [cluster.start_worker(self.cfg, i, self.slowdowns.get(i, 1.0)) for i in indices]
        for index, pid in zip(indices, _started([w.pid.remote() for w in workers], "workers")):
            slowed = f", slowed {self.slowdowns[index]:g}x" if index in self.slowdowns else ""
            self.log(f"worker {index}: pid {pid}{slowed}")
        return workers

    def _start_servers(self) -> list[Any]:
        """Server shard actors holding the initial params."""
        servers = [cluster.start_server(self.cfg, names, params) for names, params in self.initial]
        for index, pid in enumerate(_started([s.pid.remote() for s in servers], "server shards")):
            self.log(f"server shard {index}: pid {pid}")  # started: the run's clock does not count it
        return servers

    def _restore(self) -> None:
        """The newest checkpoint's server state, loaded into the shards, and the position it records; else a start.
        Nothing is in flight after it."""
        e = self.cfg.engine
        found = self.checkpoints.restore_latest(self._abstract_state(), self._accept) if self.checkpoints else None
        self.running: dict[Any, int] = {}  # the metrics reference of each worker's gradient in flight -> the worker
        self.gradients: dict[int, tuple] = {}  # each worker's (metrics, references per shard); sync: the round's
        self.updates: list[Any] = []  # references to updates sent to the shards and not yet seen done
        self.latest: list | None = None  # references to the shards' params at the dispatcher's version
        if found is None:
            self.progress, self.saved = Progress(run=self.run_name), 0
            self.dispatcher = Dispatcher(e.workers, e.mode, e.max_staleness, e.pull_every)
            _keep_log_rows(self.cfg, 0)
            return
        state, meta = found
        ray.get([s.load.remote(jax.device_get(part)) for s, part in zip(self.servers, state["shards"])])
        self.progress, position = Progress.from_meta(meta), meta["engine"]
        self.saved = self.progress.step  # the version the newest checkpoint holds
        redo = len(position["requeued"])
        self.log(f"resuming at update {self.progress.step} from a checkpoint ({redo} batches to redo)")
        _keep_log_rows(self.cfg, self.progress.step)
        where = (self.progress.step, position["next_batch"], position["requeued"])
        self.dispatcher = Dispatcher(e.workers, e.mode, e.max_staleness, e.pull_every, *where)

    def _accept(self, step_dir: Path, meta: dict[str, Any]) -> None:
        run_identity.check(step_dir, meta, self.cfg)

    def _abstract_state(self) -> dict[str, Any]:
        device = jax.devices("cpu")[0]
        states = ray.get([s.state_on_host.remote() for s in self.servers])
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))  # noqa: E731
        return {"shards": jax.tree.map(spec, states)}

    def run(self, on_metrics: Callable[[dict], None] | None, stop: StopRequest) -> dict[str, Any]:
        t, metrics_file = self.cfg.train, self.cfg.tracking.metrics_file
        self.sink = MetricsLog(metrics_file or None, t.steps, t.progress, on_record=on_metrics, run=self.run_name,
                               start=self.progress.step)  # fmt: skip
        self.history: list[dict[str, Any]] = []
        self.evals: list[tuple[int, float, Any]] = []
        self.start = time.perf_counter()
        self.clock = None  # (time, samples) when the first update was applied: compiles are not throughput
        with contextlib.closing(self.sink):
            while self.dispatcher.version < t.steps and not stop.is_set():
                self._step()
            if stop.is_set():
                self._stop_on(stop.signum)
        self.finished = time.perf_counter()  # the evaluations still running are not training time
        return self._summary()

    def _step(self) -> None:
        """Hand out jobs to the idle workers, wait (at most `POLL_S`) for a gradient and apply the update it completes;
        replace a worker or server shard found dead on the way."""
        for worker in range(len(self.workers)):
            if worker not in self.running.values():
                self._dispatch(worker)
        done, _ = ray.wait(list(self.running), num_returns=1, timeout=POLL_S)
        worker = self.running.pop(done[0]) if done else None
        try:
            self._check_servers()
            if worker is not None:
                self._arrived(worker, ray.get(done[0]))
        except RayActorError as err:
            self._recover(*self._lost(err, worker))

    def _dispatch(self, worker: int) -> None:
        job = self.dispatcher.assign(worker)
        if job is None:
            return
        pulled = self._params() if job.pull else []
        refs = self.workers[worker].gradient.options(num_returns=1 + len(self.servers)).remote(job.batch, *pulled)
        self.running[refs[0]] = worker
        self.gradients[worker] = (None, refs[1:])

    def _params(self) -> list:
        """References to every shard's (version, params) after the updates sent so far."""
        if self.latest is None:
            self.latest = [s.params.remote() for s in self.servers]
        return self.latest

    def _check_servers(self) -> None:
        """Raise the error of an update a server shard could not apply (it died): a dead shard is noticed within
        `POLL_S`, whether or not a worker pulls from it."""
        if self.updates:
            done, self.updates = ray.wait(self.updates, num_returns=len(self.updates), timeout=0)
            ray.get(done)

    def _arrived(self, worker: int, info: dict[str, Any]) -> None:
        """`worker`'s gradient arrived (its metrics `info`): apply the update it completes, if it completes one."""
        rows = self.dispatcher.complete(worker)
        self.gradients[worker] = (info, self.gradients.pop(worker)[1])
        if rows:
            self._apply(rows, [self.gradients.pop(r.worker) for r in rows])

    def _apply(self, rows: list[Applied], gathered: list[tuple]) -> None:
        """Send one update, the mean of `gathered` (each (metrics, refs per shard)), to every shard; log it."""
        e, t = self.cfg.engine, self.cfg.train
        infos = [info for info, _ in gathered]
        finite = all(info["finite"] for info in infos)
        staleness = max(row.staleness for row in rows)
        scale = 1.0 / (1 + staleness) if e.staleness_lr == "inverse" else 1.0
        for shard, server in enumerate(self.servers):
            grads = (refs[shard] for _, refs in gathered)
            self.updates.append(server.apply.remote(0.0 if finite else float("nan"), scale, *grads))
        self.latest = None
        version = self.dispatcher.version
        self.progress.step = version
        self.progress.nonfinite_total += not finite
        if self.clock is None:
            self.clock = (time.perf_counter(), self.dispatcher.version)
        record = {
            "loss": float(np.mean([info["loss"] for info in infos])),
            "grad_norm": float(np.mean([info["grad_norm"] for info in infos])),
            "staleness": staleness,
            "worker": rows[0].worker if len(rows) == 1 else -1,
            "wall_s": time.perf_counter() - self.start,
        }
        self.history.append({"step": version, **record})
        _append_log_rows(self.cfg, rows)
        if version % t.log_every == 0 or version == t.steps:
            self.sink.write(version, record)
        if version % t.eval_every == 0 or version == t.steps:
            self.evals.append((version, record["wall_s"], self.workers[0].evaluate.remote(*self._params())))
        if self.checkpoints and self.checkpoints.due(version, t.steps):
            self._save()

    def _save(self) -> None:
        """Checkpoint the shards' state at the current version, with the position to resume from (unless the newest
        checkpoint holds this version already)."""
        if self.progress.step == self.saved:
            return
        states = ray.get([s.state_on_host.remote() for s in self.servers])  # after every update sent: in order
        position = {"next_batch": self.dispatcher.next_batch, "requeued": self.dispatcher.unapplied()}
        meta = {**self.progress.meta(), "config": run_identity.config_json(self.cfg), "engine": position}
        self.checkpoints.save(self.progress.step, {"shards": states}, meta)
        write_run_config(self.cfg, self.progress.step)
        self.saved = self.progress.step
        self.log(f"checkpoint at update {self.progress.step}")

    def _stop_on(self, signum: int) -> None:
        """SIGTERM or SIGINT arrived: save what the shards hold (every update sent; the gradients in flight are
        dropped and their batches go out again on resume) and raise `Preempted`."""
        name = signal.Signals(signum).name
        if self.checkpoints:
            self._save()
            self.checkpoints.wait()
        else:
            self.log(f"{name}: stopping at update {self.progress.step}; without --checkpoint-dir nothing is saved")
        raise Preempted(self.progress.step, signum)

    def _lost(self, err: RayActorError, worker: int | None) -> tuple[str, int]:
        """Which process died, by the actor `err` names: a server shard (a worker's job fails too when the params it
        was to pull died with their shard), else the worker whose job failed."""
        servers = [cluster.actor_id(s) for s in self.servers]
        if err.actor_id in servers:
            return "server shard", servers.index(err.actor_id)
        if worker is None:
            raise err
        return "worker", worker

    def _recover(self, role: str, index: int) -> None:
        """Replace dead `role` `index` (a worker, or a server shard: all shards restart from the newest checkpoint).
        Each replacement counts against `engine.worker_restarts`."""
        if role == "server shard" and self.checkpoints is None:
            raise ProcessesLost(
                f"server shard {index} died, and with no checkpoint directory the params it held are lost: rerun with "
                "--checkpoint-dir DIR, so that the shards are restored from the newest checkpoint when one dies."
            )
        self.restarts += 1
        limit = self.cfg.engine.worker_restarts
        if self.restarts > limit:
            raise ProcessesLost(
                f"{role} {index} died, after {limit} replacements already (engine.worker_restarts={limit}): look at "
                "its logs in Ray's session directory (/tmp/ray/session_latest/logs on its node), or allow more."
            )
        if role == "worker":
            self._replace_worker(index)
        else:
            self._restore_servers(index)

    def _replace_worker(self, worker: int) -> None:
        """Start another worker in the place of `worker`; its batch goes out again."""
        job: Job | None = self.dispatcher.drop(worker)
        self.log(f"worker {worker} died{f' computing batch {job.batch}' if job else ''}; starting a replacement")
        ray.kill(self.workers[worker])  # should it live after all, its CPU is the one the replacement needs
        self.workers[worker] = self._start_workers([worker])[0]
        ray.get(self.workers[worker].set_shards.remote(self.owned))

    def _restore_servers(self, lost: int) -> None:
        """Start every shard anew from the newest checkpoint, and the dispatcher from its position: the live shards
        are ahead of it, and one version for all shards is the only consistent state. The updates since are made
        again; the gradients in flight are dropped (their batches go out again)."""
        reached = self.dispatcher.version
        self.log(f"server shard {lost} died at update {reached}; restarting every shard from the newest checkpoint")
        for server in self.servers:
            ray.kill(server)
        self.checkpoints.wait()
        self.servers = self._start_servers()
        applied = self.dispatcher.log
        self._restore()
        version = self.progress.step
        self.dispatcher.log = [row for row in applied if row.update <= version]
        self.history = [row for row in self.history if row["step"] <= version]
        self.evals = [row for row in self.evals if row[0] <= version]
        self.sink.rewind(version)
        self.log(f"server shards restored at update {version}: updates {version + 1}-{reached} are made again")

    def _summary(self) -> dict[str, Any]:
        e, t = self.cfg.engine, self.cfg.train
        evals = self._evaluations()
        for row in evals:
            self.log(f"update {row['step']}: val_loss {row['val_loss']:.4f} ({row['wall_s']:.1f} s)")
        applied = ray.get([s.applied_count.remote() for s in self.servers])
        per_update = self.cfg.data.batch_size * (e.workers if e.mode == "sync" else 1)
        began, first = self.clock or (self.finished, t.steps)
        elapsed = self.finished - began
        rate = per_update * (self.dispatcher.version - first) / elapsed if elapsed > 0 else float("nan")
        last = self.history[-1] if self.history else {"step": self.progress.step, "loss": float("nan")}
        summary = {
            "steps": self.dispatcher.version,
            "loss": last["loss"],
            **{k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("val_")},
            "samples_per_sec": rate,
            "gradients_applied_per_shard": applied,
            "worker_restarts": self.restarts,
            **staleness_report(self.dispatcher.log, e.workers),
        }
        self.log(
            "done: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
        )
        return {**summary, "batch_log": self.dispatcher.log, "evals": evals, "history": self.history}

    def _evaluations(self) -> list[dict[str, Any]]:
        """The evaluations' results; one whose worker or params died with their process is named and left out."""
        evals = []
        for step, wall, ref in self.evals:
            try:
                evals.append({"step": step, "wall_s": wall, **ray.get(ref)})
            except RayActorError:
                self.log(f"update {step}: its evaluation was lost with a dead process")
        return evals

    def stop(self) -> None:
        for actor in [*self.workers, *self.servers]:
            ray.kill(actor)


def _started(refs: list, what: str) -> list:
    """The results of the first calls to newly started actors, waited for at most `START_TIMEOUT_S`."""
    try:
        return ray.get(refs, timeout=START_TIMEOUT_S)
    except GetTimeoutError:
        raise ProcessesLost(
            f"{what} did not start within {START_TIMEOUT_S:g} s: the Ray cluster may have no free CPU for them "
            "(`ray status` shows its resources); free some, or ask for fewer --workers."
        ) from None


def _log_path(cfg: RunConfig) -> Path | None:
    return Path(cfg.checkpoint.dir) / BATCH_LOG if cfg.checkpoint.dir else None


def _append_log_rows(cfg: RunConfig, rows: list[Applied]) -> None:
    path = _log_path(cfg)
    if path is None:
        return
    with path.open("a") as out:
        for row in rows:
            out.write(f'{{"update": {row.update}, "batch": {row.batch}, "worker": {row.worker}, '
                      f'"read_version": {row.read_version}}}\n')  # fmt: skip


def _keep_log_rows(cfg: RunConfig, version: int) -> None:
    """On resume at `version`: drop the batch log's rows of updates after it (they will be made again)."""
    path = _log_path(cfg)
    if path is None or not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if json.loads(line)["update"] <= version]
    path.write_text("".join(f"{line}\n" for line in rows))
