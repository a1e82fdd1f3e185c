"""What keeps a run alive: where it stands (step, data position, skipped updates, history) as its checkpoints record
it; counting non-finite steps and rolling back after too many in a row; saving with a policy for failed writes;
resuming (only the run the checkpoint directory holds: `run_identity`), restoring or fine-tuning at the start; and
stopping cleanly on preemption or Ctrl-C.

`jaxtrain.training.loop.train` calls these at the points of its loop; each is small enough to read on its own. An
application with a loop of its own (scripts/alphazero.py) calls them too: `check_resume`, `resume` and
`save_checkpoint` take what it keeps beside the train state, `extras` (named pytrees saved in the same checkpoint, e.g.
a replay buffer) and `settings` (JSON values outside the run config that define its run, compared on resume).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.experimental import multihost_utils

from jaxtrain.data.tokenizer import file_digest
from jaxtrain.data.tokens import read_manifest, token_sources
from jaxtrain.errors import UserInputError
from jaxtrain.placement.place import place_model
from jaxtrain.run_config import ConfigWriteError, LoraConfig, RunConfig, write_config
from jaxtrain.training import run_identity
from jaxtrain.training.adapted_checkpoints import restore_merged, stored_lora
from jaxtrain.training.checkpoint import (
    CheckpointMismatchError,
    Checkpoints,
    CheckpointWriteError,
    carried_files,
    carry_into,
    find_checkpoint,
    is_params_export,
    newest_meta,
    restore,
    restore_params,
    restore_shared_params,
    trained_config,
)
from jaxtrain.training.distributed import to_host
from jaxtrain.training.run_identity import RunIdentityError
from jaxtrain.training.setup import Run

PyTree = Any


class Preempted(Exception):
    """Training stopped on a signal (SIGTERM: preemption; SIGINT: Ctrl-C) after saving a checkpoint at `step`.

    `exit_status` is 128 + the signal's number, as if killed by it, so schedulers that requeue on SIGTERM (143) and
    shells that expect 130 after Ctrl-C see what they expect."""

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name} after step {step}")
        self.step, self.exit_status = step, 128 + signum


class Diverged(UserInputError):
    """Updates kept being skipped (non-finite loss or gradient) and rolling back did not help."""


# Rolling back to the same checkpoint this many times means the checkpoint, not the data, is the problem.
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3


@dataclasses.dataclass
class Progress:
    """Where a run stands, as its checkpoints record it (in their JSON `meta`).

    `data_offset`: batches skipped by rollbacks, so step k trains on batch k + data_offset (a global index, whatever
    the topology). `nonfinite_total`: updates skipped for a non-finite loss or gradient, over the run's whole life.
    `history`: the run's deliberate turns, oldest first, each `run_identity.history_entry` (config changes allowed
    on resume; the checkpoint a `checkpoint.restore` started it from), carried forward by every later checkpoint. `run`:
    the run's name, the fingerprint of the config it started with (`run_identity.fingerprint`), kept through changes.
    """

    step: int = 0
    data_offset: int = 0
    nonfinite_total: int = 0
    rollbacks: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    run: str = ""

    def meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Progress:
        counts = {name: int(meta.get(name, 0)) for name in ("step", "data_offset", "nonfinite_total", "rollbacks")}
        run = meta.get("run") or run_identity.fingerprint(meta.get("config", {}))  # older checkpoints have none
        return cls(**counts, history=list(meta.get("history", [])), run=run)


class SkippedSteps:
    """Reads each step's `nonfinite` flag one step late (so the host never waits for the device), counts them, and
    says when `rollback_after` skipped updates in a row call for a rollback."""

    def __init__(self, progress: Progress, rollback_after: int):
        self.progress, self.rollback_after = progress, rollback_after
        self.unread: list[tuple[int, jax.Array]] = []  # (step, flag) of steps dispatched but not yet read
        self.streak = 0

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self.unread.append((step, metrics["nonfinite"]))

    def read(self, keep_newest: bool = True) -> int | None:
        """Read the flags of finished steps (all of them with `keep_newest=False`, which waits for the device).
        Returns the step at which the streak reached `rollback_after`, if it did."""
        pending, self.unread = (self.unread[:-1], self.unread[-1:]) if keep_newest else (self.unread, [])
        for step, flag in pending:
            skipped = int(to_host(flag))
            self.progress.nonfinite_total += skipped
            self.streak = self.streak + 1 if skipped else 0
            if self.rollback_after and self.streak >= self.rollback_after:
                self.unread, self.streak = [], 0
                return step
        return None


def save_checkpoint(
    run: Run,
    checkpoints: Checkpoints,
    state: Any,
    progress: Progress,
    log: Callable[[str], None],
    extras: Mapping[str, PyTree] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Start an asynchronous save. A failed write stops the run (`checkpoint.on_failure=stop`) or is logged and the
    next save tries again (`continue`); the final save must succeed either way. With several processes a failed write
    always stops the job: its other processes are waiting for the failed one in Orbax's barriers.

    An application saves its `extras` (name -> pytree of arrays; names other than the state's) in the same
    checkpoint, so a kill leaves them in step with the state, and its `settings` in the meta (`resume` reads both)."""
    meta = {**progress.meta(), "config": run_identity.config_json(run.cfg), **_settings_meta(settings)}
    tree = {**run.shardings.state_in_model_order(state), **(extras or {})}
    final = progress.step == run.cfg.train.steps
    stop = run.cfg.checkpoint.on_failure == "stop" or jax.process_count() > 1
    for _ in range(2):  # a second try when the failure reported was the previous save's
        try:
            checkpoints.save(progress.step, tree, meta)
            write_run_config(run.cfg, progress.step)
            return
        except CheckpointWriteError as err:
            this_save = err.step == progress.step
            if stop or (final and this_save):
                raise
            log(f"warning: {err} Training continues (checkpoint.on_failure=continue).")
            if this_save:
                return


def write_run_config(cfg: RunConfig, step: int) -> None:
    """`<checkpoint.dir>/config.toml`, the resolved config that `--config` reruns, beside the checkpoint just saved
    (after it: a run refused or stopped before its first save writes nothing). Process 0 writes it; a failure is
    storage trouble, like a failed save."""
    if jax.process_index() != 0:
        return
    try:
        write_config(cfg)
    except ConfigWriteError as err:
        raise CheckpointWriteError(str(err), step) from None


def roll_back(
    run: Run,
    checkpoints: Checkpoints | None,
    progress: Progress,
    bad_step: int,
    earlier: collections.Counter,
    log: Callable[[str], None],
) -> Any:
    """Restore the newest checkpoint after `rollback_after` skipped updates ending at `bad_step`, and move the data
    position past every batch since that checkpoint: the same batches would lead back to the same place."""
    limit = run.cfg.train.rollback_after
    where = f"{limit} non-finite steps in a row (steps {bad_step - limit + 1}-{bad_step})"
    if checkpoints is None:
        raise Diverged(
            f"{where} and no checkpoint to roll back to. Lower optimizer.learning_rate, set checkpoint.dir, "
            "or set rollback_after=0 to keep skipping."
        )
    checkpoints.wait()
    found, _ = _restore_latest(run, checkpoints)
    if found is None:
        raise Diverged(f"{where} and no checkpoint in {checkpoints.directory} restores.")
    restored, meta = found
    back_to = Progress.from_meta(meta).step
    earlier[back_to] += 1
    if earlier[back_to] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
        raise Diverged(
            f"{where}, after rolling back to step {back_to} {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} times already: the run "
            "diverges from that checkpoint whatever the data. Lower optimizer.learning_rate and restore an earlier one."
        )
    progress.data_offset += bad_step - back_to
    progress.step, progress.rollbacks = back_to, progress.rollbacks + 1
    log(
        f"warning: {where}: rolled back to the checkpoint of step {back_to}; "
        f"continuing at batch {back_to + progress.data_offset} (the {bad_step - back_to} batches since are skipped)."
    )
    return run.shardings.state_from_model_order(restored)


def open_checkpoints(cfg: RunConfig) -> Checkpoints | None:
    """The run's checkpoint directory, if `checkpoint.dir` names one."""
    c = cfg.checkpoint
    if not c.dir:
        return None
    return Checkpoints(c.dir, c.every, c.keep, c.keep_every)


def check_resume(cfg: RunConfig, settings: Mapping[str, Any] | None = None) -> str:
    """The name of the run `cfg` continues in `checkpoint.dir`, or starts. Raises `RunIdentityError` if the
    newest checkpoint's config (or an application's `settings`, see `save_checkpoint`) makes it another run, and
    `ConfigError` for an unknown key in `checkpoint.allow_change`: cheap (only JSON is read), so before anything
    compiles. `initial_state` and `resume` check each checkpoint they try again."""
    run_identity.allowed_changes(cfg)
    newest = newest_meta(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if newest is None:
        return run_identity.fingerprint(run_identity.config_json(cfg))
    _check_run(*newest, cfg, settings)
    return Progress.from_meta(newest[1]).run


def _check_run(
    step_dir: Path, meta: dict[str, Any], cfg: RunConfig, settings: Mapping[str, Any] | None
) -> dict[str, tuple[Any, Any]]:
    """`run_identity.check`, then the application's `settings` against those the checkpoint stores: none may differ
    (they are not run config keys, so `checkpoint.allow_change` cannot name them). Returns the allowed changes."""
    changed = run_identity.check(step_dir, meta, cfg)
    stored, now = meta.get("settings", {}), _settings_meta(settings).get("settings", {})
    differ = [name for name in {**stored, **now} if stored.get(name) != now.get(name)]
    if differ:
        lines = "".join(
            f"\n  {name}: {json.dumps(stored.get(name))} in the checkpoint, {json.dumps(now.get(name))} now"
            for name in differ
        )
        raise RunIdentityError(
            f"cannot resume in {step_dir.parent}: its newest checkpoint, {step_dir}, was written by a run with other "
            f"settings:{lines}\nNothing was written. To continue that run, use its values; to start this one, give "
            "another checkpoint directory."
        )
    return changed


def _settings_meta(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """`settings` as a checkpoint's meta holds them (as JSON reads back: tuples become lists); none: nothing."""
    return {"settings": json.loads(json.dumps(dict(settings)))} if settings else {}


def initial_state(run: Run, checkpoints: Checkpoints | None, log: Callable[[str], None]) -> tuple[Any, Progress]:
    """The newest checkpoint in the run's directory, else `checkpoint.restore`, else a fresh init; and where it stands
    (a new run, also one restored from another's checkpoint, has the fingerprint of its own config for a name)."""
    shardings, cfg = run.shardings, run.cfg
    resumed = resume(run, checkpoints, log) if checkpoints else None
    if resumed is not None:
        return resumed.state, resumed.progress
    new_run = run_identity.fingerprint(run_identity.config_json(cfg))
    if cfg.checkpoint.restore and _continues(cfg):
        state, progress = _restore_step(run, log)
        return state, dataclasses.replace(progress, run=new_run)
    if cfg.checkpoint.restore:
        return _fine_tune(run, checkpoints, log), Progress(run=new_run)
    return shardings.init_state(run.optimizer, cfg.train.seed), Progress(run=new_run)


class AdapterRestoreError(UserInputError):
    """A checkpoint trained with adapters restored into a run with other adapter settings, which would neither
    continue it nor start from its model."""


def _continues(cfg: RunConfig) -> bool:
    """Whether the run continues the training checkpoint at `checkpoint.restore` (its optimizer state and step),
    rather than starting at step 0 from its params (`_fine_tune`). A params export (an import from Hugging Face)
    always starts so, as do `restore_params_only`, another model's checkpoint (an MLM encoder under a classifier),
    another objective (`preference.loss`, `grpo`: after SFT), and new adapters on a checkpoint trained without them.
    A checkpoint trained with adapters continues with the same `lora` settings; other ones are an error, since which
    of its weights to keep frozen would be a guess."""
    source = cfg.checkpoint.restore
    if is_params_export(source) or cfg.checkpoint.restore_params_only:
        return False
    step_dir, meta = find_checkpoint(source)
    if _family((meta.get("config") or {}).get("model_name", "")) != _family(cfg.model_name):
        return False  # another model's checkpoint (an MLM encoder under a classifier): its shared params, at step 0
    if _objective(meta.get("config") or {}) != _objective(dataclasses.asdict(cfg)):
        return False  # another objective (SFT's checkpoint, then DPO or GRPO): a new run from its model, at step 0
    trained = stored_lora(step_dir, meta)
    if trained == cfg.lora:
        return True
    if not trained.rank:
        return False  # new adapters on the checkpoint's params
    differ = [f.name for f in dataclasses.fields(trained) if getattr(trained, f.name) != getattr(cfg.lora, f.name)]
    raise AdapterRestoreError(
        f"checkpoint.restore={source} trained adapters with {_lora_keys(trained, differ)}, this run asks for "
        f"{_lora_keys(cfg.lora, differ)}: set the same to continue that run, or checkpoint.restore_params_only=true "
        "to start from its model (adapters folded into the weights) with new adapters or, at lora.rank=0, none."
    )


def _objective(config: dict) -> tuple[str, bool]:
    """What a run (its config as a table) trains for: its preference loss, and whether it is GRPO."""
    return (config.get("preference") or {}).get("loss", "none"), bool((config.get("grpo") or {}).get("group_size"))


def _lora_keys(lora: LoraConfig, names: list[str]) -> str:
    return " ".join(f"{lora.key(name)}={getattr(lora, name)}" for name in names)


class Resumed(NamedTuple):
    """A run as its newest checkpoint left it: the train state in the run's shardings, where it stands, and the
    application's extras (`save_checkpoint`)."""

    state: Any
    progress: Progress
    extras: dict[str, PyTree]


def resume(
    run: Run,
    checkpoints: Checkpoints,
    log: Callable[[str], None],
    extras: Mapping[str, PyTree] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Resumed | None:
    """The newest checkpoint in `checkpoints` that reads back (None if none), checked to be this run's: its config
    (`run_identity.check`, allowed changes recorded in the progress's history) and an application's `settings`.
    `extras`: the application's trees saved beside the state (`save_checkpoint`), name -> abstract target
    (`jax.ShapeDtypeStruct`s: with a sharding they read as jax.Arrays, without as numpy arrays)."""
    found, changed = _restore_latest(run, checkpoints, extras or {}, settings)
    if found is None:
        return None
    tree, meta = found
    saved = {name: tree.pop(name) for name in extras or {}}
    progress = _resumed(run.cfg, Progress.from_meta(meta), changed, log)
    return Resumed(run.shardings.state_from_model_order(tree), progress, saved)


def _restore_latest(
    run: Run,
    checkpoints: Checkpoints,
    extras: Mapping[str, PyTree] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> tuple[tuple[Any, dict] | None, dict[str, tuple]]:
    """`Checkpoints.restore_latest` for this run (the state and `extras`): each candidate's config and `settings` are
    checked (`_check_run`), and a checkpoint whose arrays do not fit the model stops the run too. Also returns the
    changes allowed in the one restored."""
    changed: dict[str, tuple] = {}

    def accept(step_dir: Path, meta: dict[str, Any]) -> None:
        changed.clear()
        changed.update(_check_run(step_dir, meta, run.cfg, settings))

    try:
        return checkpoints.restore_latest({**run.shardings.abstract_model_state(), **(extras or {})}, accept), changed
    except CheckpointMismatchError as err:
        raise run_identity.does_not_fit(checkpoints.directory, err) from err


def _resumed(cfg: RunConfig, progress: Progress, changed: dict[str, tuple], log: Callable[[str], None]) -> Progress:
    """`progress` with the allowed config changes recorded in its history; says what it resumes."""
    if changed:
        progress.history.append(run_identity.history_entry(progress.step, changed))
        log(
            f"resuming at step {progress.step} with changes checkpoint.allow_change allows: "
            f"{run_identity.describe_changes(changed)} (recorded in the run's history)"
        )
    else:
        log(f"resuming at step {progress.step} from a checkpoint")
    unchanged = sorted(
        k for k in run_identity.allowed_changes(cfg) - changed.keys() if run_identity.defines_trajectory(k)
    )
    if unchanged:
        log(f"note: checkpoint.allow_change names {', '.join(unchanged)}, equal to the checkpoint's")
    return progress


def _restore_step(run: Run, log: Callable[[str], None]) -> tuple[Any, Progress]:
    """The state and progress of the training checkpoint at `checkpoint.restore` (another run's step directory), as a
    new run's start: its history records where it came from and the config keys it changes."""
    source = Path(run.cfg.checkpoint.restore).absolute()
    state, meta = restore(source, run.shardings.abstract_model_state())
    progress = Progress.from_meta(meta)
    changed = run_identity.differences(meta.get("config", {}), run.cfg)
    progress.history.append(run_identity.history_entry(progress.step, changed, restored_from=str(source)))
    also = f", changing {run_identity.describe_changes(changed)}" if changed else ""
    log(f"starting a new run from step {progress.step} of {source}{also}")
    return run.shardings.state_from_model_order(state), progress


def _fine_tune(run: Run, checkpoints: Checkpoints | None, log: Callable[[str], None]) -> Any:
    """A fresh optimizer state at step 0 around the params of the export or checkpoint at `checkpoint.restore` (with
    adapters: around those params, frozen, and new adapters); a checkpoint trained with adapters gives its model, each
    adapter folded into its weight. The files the export carries (an import's tokenizer) are copied into the run
    directory, so its checkpoints keep them."""
    shardings, cfg, source = run.shardings, run.cfg, run.cfg.checkpoint.restore
    step_dir, meta = find_checkpoint(source)
    if stored_lora(step_dir, meta).rank:  # its model: the adapters it trained folded into their weights
        placed = place_model(cfg.model_name, cfg.model, cfg.mesh, cfg.rules, mesh=shardings.mesh)
        params = restore_merged(step_dir, meta, placed)
    elif _family(meta.get("config", {}).get("model_name", "")) != _family(cfg.model_name):
        params, meta = _shared_params(run, step_dir, log)
    else:
        params, meta = restore_params(step_dir, shardings.model.base_params(shardings.abstract_model_state()["params"]))
    adapters = " and new adapters" if shardings.model.freezes else ""
    log(f"starting from the params of step {meta['step']} at {source}, with a new optimizer{adapters}")
    if checkpoints is not None:
        carry_into(Path(run.cfg.checkpoint.restore).absolute(), checkpoints.directory)
    return shardings.init_state(run.optimizer, run.cfg.train.seed, params)


def _family(model_name: str) -> str:
    """The registered model of a `name-preset` choice: what decides whether two runs' params are the same model's."""
    return model_name.partition("-")[0]


def _shared_params(run: Run, step_dir: Path, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """The params of another model's checkpoint (a masked-LM encoder under a classifier) where this model has the
    same ones, the others initialised with the run's seed; the params left fresh are logged by name."""
    model, abstract = (
        run.shardings.model,
        run.shardings.model.base_params(run.shardings.abstract_model_state()["params"]),
    )
    fresh = jax.jit(
        lambda: model.init_params(run.cfg.train.seed), out_shardings=jax.tree.map(lambda x: x.sharding, abstract)
    )()
    params, meta, new = restore_shared_params(step_dir, fresh)
    stored_model = meta.get("config", {}).get("model_name", "another model")
    log(f"{step_dir} holds {stored_model}: its params where this model has the same; new: {', '.join(new) or 'none'}")
    return params, meta


class TokenizerMismatchError(UserInputError):
    """Tokenized data whose tokenizer is not the one the restored model was trained or imported with."""


def check_restored_tokenizer(cfg: RunConfig) -> None:
    """Refuse training the model at `checkpoint.restore` on tokenized data of another tokenizer than its own: the one
    its checkpoint carries (an import's `hf/tokenizer.json`), else the one of the tokenized data it trained on. Token
    ids of another vocabulary would train without an error, on text the model reads as another. Known by SHA-256."""
    ours = token_sources(cfg.data.source, cfg.data.path, cfg.data.mixture)
    if not cfg.checkpoint.restore or not ours:
        return
    model = _model_tokenizer(cfg.checkpoint.restore)
    data = read_manifest(ours[0][0])["tokenizer"]["sha256"]
    if model is not None and model[0] != data:
        raise TokenizerMismatchError(
            f"data '{ours[0][0]}' was tokenized with another tokenizer (SHA-256 {data[:12]}...) than the model at "
            f"checkpoint.restore={cfg.checkpoint.restore} reads ({model[1]}, SHA-256 {model[0][:12]}...): tokenize "
            f"the data with the model's own, jaxtrain tokenize --tokenizer {model[2]} ..."
        )


def _model_tokenizer(restore_path: str) -> tuple[str, str, str] | None:
    """The SHA-256 of the tokenizer the model at `restore_path` reads, where it is known; what holds it; and the
    path to tokenize with."""
    step_dir, meta = find_checkpoint(restore_path)
    carried = carried_files(step_dir)
    if carried is not None and (carried / "tokenizer.json").is_file():
        return file_digest(carried / "tokenizer.json"), f"{carried / 'tokenizer.json'}", str(carried)
    data = trained_config(step_dir, meta).data
    trained = token_sources(data.source, data.path, data.mixture)
    if not trained or not (Path(trained[0][0]) / "manifest.json").is_file():
        return None  # bytes, synthetic data, or tokenized data no longer there: nothing to compare
    directory = Path(trained[0][0])
    digest = read_manifest(directory)["tokenizer"]["sha256"]
    return digest, f"the tokenizer of its data {directory}", str(directory / "tokenizer.json")


class StopRequest:
    """The signal (SIGTERM or SIGINT) that asked the run to stop, once one has."""

    def __init__(self):
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self.signum is not None


def preemption_requested(request: StopRequest, step: int) -> bool:
    """Whether to save and stop after `step`. One process: SIGTERM or SIGINT was received. Several: JAX's preemption
    sync point, which every process answers alike at the same step (a signal reaches hosts at different moments,
    and a save is a collective)."""
    if jax.process_count() == 1:
        return request.is_set()
    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # jax.distributed was started without its preemption service
        return False


def tell(line: str) -> None:
    """Write `line` to file descriptor 2 from a signal handler: one unbuffered write, because a handler that prints
    can interrupt a print of the main thread, and Python refuses the nested call into the same buffered stream."""
    os.write(2, (line + "\n").encode())


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """Inside, SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to finish its step, save and stop
    (`preemption_requested`), which the handler says on stderr; a second Ctrl-C exits at once, status 130, without
    saving. The handlers are restored after. Only on the main thread. With several processes JAX's preemption
    notifier owns SIGTERM, and a SIGINT is passed on to it as a SIGTERM, so that every process stops after the same
    step."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    several = jax.process_count() > 1

    def on_signal(signum: int, _frame: Any) -> None:
        if request.is_set() and signum == signal.SIGINT:
            tell("error: interrupted again: exiting now, without saving")
            os._exit(128 + signal.SIGINT)
        if not request.is_set():
            name = signal.Signals(signum).name
            tell(f"{name}: stopping after this step; Ctrl-C again exits at once without saving")
        request.signum = request.signum or signum
        if several:
            os.kill(os.getpid(), signal.SIGTERM)

    handled = (signal.SIGINT,) if several else (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, on_signal) for signum in handled}
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
