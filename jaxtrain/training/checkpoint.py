"""Checkpoints with Orbax: the train state, the data position and the run's config, saved asynchronously.

A checkpoint holds the state in the model's own layer order (`Shardings.state_in_model_order`) and no layout: restoring
reads every array straight into the shardings of the *current* plan, so a run saved on one mesh resumes on another
(8 -> 4 -> 1 devices, data parallel -> FSDP x tensor, with or without a pipeline). Orbax writes each checkpoint to a
temporary directory and renames it when complete, so a crash mid-save leaves the previous checkpoint usable.

The data position is the global step: batches are a pure function of (seed, split, step), whatever the device or
process count, so resuming at step n reads exactly the batches an uninterrupted run would.

Nothing here deletes or replaces a checkpoint it did not write: a step that exists is never saved over, a checkpoint
that does not read back is moved aside (renamed `N.unreadable-<time>`, kept for the user to inspect) once an older one
has been restored in its place, and one that reads back but does not fit the model is an error
(`CheckpointMismatchError`), never a reason to start over. Retention (`keep`, `keep_every`) deletes only the run's own
old steps.

For evaluation or fine-tuning, `export_params` writes the params alone (no optimizer state) and `restore_params` reads
them, from such an export or from a training checkpoint, into any mesh. `describe_checkpoint` reports what a run
directory, step or export holds from metadata alone (`jaxtrain inspect`, `jaxtrain export`).

    >>> checkpoints = Checkpoints("/tmp/run", save_every=100, keep=3)           # doctest: +SKIP
    >>> checkpoints.save(step, plan.state_in_model_order(state), {"step": step})  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.experimental import multihost_utils

from jaxtrain.analysis.memory import total_bytes
from jaxtrain.errors import UserInputError
from jaxtrain.formatting import fmt_bytes, format_table
from jaxtrain.run_config import RunConfig, config_from_table
from jaxtrain.training.save_failure import SaveFailureBroadcast

PyTree = Any
log = logging.getLogger(__name__)


class CheckpointError(UserInputError):
    """A checkpoint that is missing, unreadable, or does not fit the model."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that reads back but was saved by a different model: its arrays' names or shapes differ."""


class CheckpointWriteError(CheckpointError):
    """The save of checkpoint `step` failed (disk full, permission denied, ...); the checkpoints before it are
    intact."""

    def __init__(self, message: str, step: int | None):
        super().__init__(message)
        self.step = step


class Checkpoints:
    """The checkpoints of one run in `directory`: save every `save_every` steps, keep the newest `keep` (and every
    `keep_every`-th step, if set); saves are asynchronous unless `async_save=False`."""

    def __init__(self, directory: str | Path, save_every: int, keep: int = 3, keep_every: int = 0, async_save=True):
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # what a killed process left half-written
            # Orbax's default creates the step directory in a background thread that the array writers wait for, with
            # a 300 s timeout (orbax's multihost coordination_timeout) and no cancellation: when the directory cannot
            # be created (permission denied, full disk) the error is reported at once, but the writer threads, which
            # the interpreter joins at exit, wait out the 300 s. Created synchronously, in `save`, the same error is
            # raised there and no thread is left waiting. It costs one mkdir in the blocking part of a save.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        except OSError as err:
            raise CheckpointWriteError(f"cannot use checkpoint directory {self.directory}: {err}.", None) from err
        self.writing: int | None = None  # the step of a save that may still be in progress
        self.failure = SaveFailureBroadcast()  # with several processes, a failed save ends them all at once

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return sorted(self.manager.all_steps())

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Start writing `state` (model order) and `meta` (JSON) as checkpoint `step`; returns once the arrays are
        copied off the devices, so the next step may reuse their buffers.

        Raises `CheckpointWriteError` if this save, or the previous one still in flight, fails.
        """
        self.wait()  # Orbax would wait for the previous save too; waiting here names its failure as its own
        if step in self.manager.all_steps():  # never replaced: `restore_latest` moves unreadable newer ones aside
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} already exists and jaxtrain never replaces a checkpoint: "
                "move it away if it is not needed, or train into another checkpoint directory."
            )
        try:
            self.manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )
        except Exception as err:  # noqa: BLE001 - whatever the storage layer raises, the save failed
            raise self._failed(step, err) from err
        self.writing = step

    def restore_latest(
        self, abstract_state: PyTree, accept: Callable[[Path, dict[str, Any]], None] = lambda *_: None
    ) -> tuple[PyTree, dict[str, Any]] | None:
        """The newest checkpoint that reads back, into `abstract_state`'s shapes and shardings; None if there is
        none. `accept(step_dir, meta)` sees each candidate's meta before its arrays are read, and raises to refuse it
        (that stops the search).

        A checkpoint that fails to read is skipped with a one-line warning naming it, and once an older one is
        restored it is moved aside (`N.unreadable-<time>`): this run will save step N again, and a checkpoint is never
        replaced. If none reads back, that is a `CheckpointError`: a run is not started over checkpoints it cannot
        read. One that reads but does not fit the model raises `CheckpointMismatchError`."""
        unreadable = []
        for step in reversed(self.steps()):
            path = self.directory / str(step)
            found = _restore_accepted(path, abstract_state, accept)
            if not isinstance(found, CheckpointError):
                self._move_aside(unreadable)
                return found
            log.warning("skipping checkpoint %s, which does not read back: %s", path, found)
            unreadable.append(path)
        if unreadable:
            raise CheckpointError(
                f"none of the checkpoints in {self.directory} reads back (steps "
                f"{', '.join(p.name for p in reversed(unreadable))}; see the warnings above), and jaxtrain does not "
                "train over checkpoints it cannot read: move them away to start anew, or give another --checkpoint-dir."
            )
        return None

    def _move_aside(self, paths: list[Path]) -> None:
        """Rename unreadable checkpoints out of the step sequence, keeping their bytes (process 0 renames; every
        process then re-reads the step list)."""
        if not paths:
            return
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for path in paths:
                aside = path.with_name(f"{path.name}.unreadable-{stamp}")
                path.rename(aside)
                log.warning("moved unreadable checkpoint %s to %s; delete it when it is no longer needed", path, aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxtrain: unreadable checkpoints moved aside")
        self.manager.reload()

    def wait(self) -> None:
        """Block until every started save is on disk; raises `CheckpointWriteError` if one failed."""
        step, self.writing = self.writing, None
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as err:  # noqa: BLE001 - as in save
            raise self._failed(step, err) from err

    def _failed(self, step: int | None, err: Exception) -> CheckpointWriteError:
        """The error for a failed save of `step`, after removing what it wrote (on a full disk, space matters)."""
        left = self._remove_partial(step)
        steps = self.steps()
        intact = (
            f"the newest complete checkpoint, {self.directory / str(steps[-1])}, is intact"
            if steps
            else "no earlier checkpoint exists"
        )
        error = CheckpointWriteError(
            f"saving checkpoint {self.directory / str(step)} failed ({one_line(err)}){left}; {intact}.", step
        )
        self.failure.publish(str(error))
        return error

    def _remove_partial(self, step: int | None, settle_s: float = 5.0) -> str:
        """Remove the temporary directory of a failed save. The error surfaces from one of Orbax's writer threads
        while another may still be writing into it (seen in tests: a directory reappearing after removal), so remove
        until it stays gone for a moment, or `settle_s` has passed. Storage that refuses the removal (permission
        denied, read-only) is not retried: returns a note naming what is left, else ''."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            partials = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            for partial in partials:
                try:
                    shutil.rmtree(partial)
                except OSError as err:
                    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                        return f"; its partial write {partial} could not be removed ({one_line(err)}): never restored"
            time.sleep(0.2)
            if not partials and not any(self.directory.glob(f"{step}.orbax-checkpoint-tmp*")):
                return ""
        return ""

    def close(self) -> None:
        self.failure.close()
        self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *_) -> None:
        self.close()


_STEP_DIR = "a step directory containing 'state' (e.g. runs/x/ckpt/1000)"
_EXPORT_DIR = "a params export containing 'params' (made by `jaxtrain export`)"


def _restore_accepted(
    path: Path, abstract_state: PyTree, accept: Callable[[Path, dict[str, Any]], None]
) -> tuple[PyTree, dict[str, Any]] | CheckpointError:
    """`restore(path, abstract_state)` once `accept(path, meta)` agrees (its refusal propagates, as does a
    `CheckpointMismatchError`); for a checkpoint that does not read back, the error saying why."""
    try:
        meta = _read_meta(path)
    except CheckpointError as err:
        return err
    accept(path, meta)
    try:
        return restore(path, abstract_state)
    except CheckpointMismatchError:
        raise
    except CheckpointError as err:
        return err


def one_line(err: BaseException, limit: int = 300) -> str:
    """`err` as one line, type and cause, for a message that names its path itself: TensorStore appends its whole
    JSON spec (dozens of lines) to its errors, and a cause longer than `limit` characters is cut."""
    text = " ".join(str(err).split(" [tensorstore_spec=")[0].split())
    return f"{type(err).__name__}: {text if len(text) <= limit else text[: limit - 3] + '...'}"


def restore(path: str | Path, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """Read checkpoint directory `path` (a step directory) into `abstract_state`'s shapes, dtypes and shardings."""
    path = Path(path).absolute()
    if not (path / "state").is_dir():
        raise _no_checkpoint(path, _STEP_DIR)
    _check_shapes(path, abstract_state)
    restored = _read(path, state=ocp.args.StandardRestore(abstract_state))
    return restored["state"], restored["meta"]


def newest_meta(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest step directory of run directory `directory` whose meta reads back, and that meta (None if none);
    only the small JSON meta is read."""
    directory = Path(directory).absolute()
    for step in reversed(_steps(directory)):
        try:
            return directory / str(step), _read_meta(directory / str(step))
        except CheckpointError:
            continue
    return None


def export_params(step_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the params of training checkpoint `step_dir`, without the optimizer state, as a params export at
    `out_dir` (which must not exist) for evaluation or fine-tuning on any mesh: see `restore_params`. Only the params
    are read, as host arrays; Orbax writes to a temporary directory and renames it when complete, so `out_dir` never
    holds half an export. Returns `out_dir`."""
    step_dir, out_dir = Path(step_dir).absolute(), Path(out_dir).absolute()
    if not (step_dir / "state").is_dir():
        raise _no_checkpoint(step_dir, _STEP_DIR)
    if out_dir.exists():
        raise CheckpointError(
            f"{out_dir} already exists: an export never overwrites. Give a new directory, or remove this one first."
        )
    # Targets without a sharding read as numpy arrays: an export needs no devices, whatever mesh trained the model.
    host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _metadata(step_dir, "state")["params"])
    params, meta = _read_params(step_dir, "state", host)
    # The export's item holds {"params": ...} as the training state does, so both read through `_read_params`.
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            out_dir,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave({"params": params}),
                meta=ocp.args.JsonSave({"kind": "params", "step": meta["step"], "config": meta["config"]}),
            ),
        )
    return out_dir


# Files a model carries besides its weights (an import's Hugging Face config.json and tokenizer): a folder of a params
# export, or of a run directory when the run fine-tunes such an export (`carry_into`), so its checkpoints keep them.
CARRIED = "hf"


def carried_files(step_dir: Path) -> Path | None:
    """The folder of files carried with the model in checkpoint `step_dir` (a params export's own; a training step's
    run directory's), or None."""
    owner = step_dir.parent if (step_dir / "state").is_dir() else step_dir
    return owner / CARRIED if (owner / CARRIED).is_dir() else None


def carry_into(source: Path, run_directory: Path) -> None:
    """Copy the carried files of checkpoint `source`, if any, into `run_directory` (process 0; through a temporary
    name, so a kill leaves none or all), unless it has them already."""
    carried = carried_files(source)
    target = run_directory / CARRIED
    if carried is None or target.exists() or jax.process_index() != 0:
        return
    partial = run_directory / f".{CARRIED}.copying"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(carried, partial)
    partial.rename(target)


def is_params_export(path: str | Path) -> bool:
    """Whether `path` is a params export (`export_params`) rather than a training checkpoint or anything else."""
    return (Path(path) / "params").is_dir()


def restore_params(path: str | Path, abstract_params: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """Read the params of `path`, a params export or a training checkpoint's step directory (whose optimizer state is
    not read), into `abstract_params`' shapes, dtypes and shardings, on any mesh; and the checkpoint's meta."""
    path = Path(path).absolute()
    item = _params_item(path)
    _check_shapes(path, {"params": abstract_params}, item)
    return _read_params(path, item, abstract_params)


def restore_shared_params(path: str | Path, fresh_params: PyTree) -> tuple[PyTree, dict[str, Any], list[str]]:
    """`fresh_params` (arrays, in their shardings) with each one the params of `path` also hold, by name and shape,
    read from there (as `restore_params` reads): a model that shares part of another's (a classifier's encoder, from
    a masked-LM checkpoint). Returns the params, the meta, and the names the checkpoint lacks, which stay fresh. A
    shared name of another shape, or nothing shared, is a `CheckpointMismatchError`."""
    path = Path(path).absolute()
    item = _params_item(path)
    stored = {name.removeprefix("params/"): tuple(x.shape) for name, x in _arrays(path, item).items()}
    wanted = {_path(k): x for k, x in jax.tree_util.tree_flatten_with_path(fresh_params)[0]}
    for name, x in wanted.items():
        if name in stored and stored[name] != tuple(x.shape):
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the model: {name} is {stored[name]} there, {tuple(x.shape)} here. "
                "Use the same sizes as the model it was saved with."
            )
    shared = {name: x for name, x in wanted.items() if name in stored}
    if not shared:
        raise CheckpointMismatchError(
            f"checkpoint {path} has none of this model's params (e.g. {next(iter(wanted))}): it holds another model."
        )
    target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for name, x in shared.items()}
    read, meta = _read_params(path, item, traverse_util.unflatten_dict(target, sep="/"))
    read = {_path(k): x for k, x in jax.tree_util.tree_flatten_with_path(read)[0]}
    params = jax.tree_util.tree_map_with_path(lambda k, x: read.get(_path(k), x), fresh_params)
    return params, meta, [name for name in wanted if name not in stored]


def find_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `path` names and its meta: a step directory or params export itself, a run directory's newest
    step whose meta reads back. Anything else is a `CheckpointError` saying what was expected."""
    path = Path(path).absolute()
    if (path / "state").is_dir() or is_params_export(path):
        return path, _read_meta(path)
    found = newest_meta(path)
    if found is None:
        raise _no_checkpoint(path, f"a run directory (numbered step directories), {_STEP_DIR}, or {_EXPORT_DIR}")
    return found


# What a model's use after training (generation, evaluation, training on) needs of the run config a checkpoint
# stores: the model, the adapters it trained, its data (the tokenizer) and the sharding rules. The rest (optimizer,
# schedule, loop settings) is not read, so a checkpoint stays usable after jaxtrain renames one of those keys.
_MODEL_KEYS = ("model_name", "model", "lora", "rules")


def trained_config(path: Path, meta: dict[str, Any]) -> RunConfig:
    """The run config of the model in checkpoint `path` (meta `meta`, from `find_checkpoint`): its model and preset,
    model settings, adapters (`lora`), data source and sharding rules as trained; every other key at its preset's
    default."""
    stored = meta.get("config")
    if not isinstance(stored, dict) or "model_name" not in stored:
        raise CheckpointError(
            f"checkpoint {path} stores no run config, so its model cannot be rebuilt: use a checkpoint or export "
            "written by `jaxtrain train` / `jaxtrain export`."
        )
    table = {key: stored[key] for key in _MODEL_KEYS if key in stored}
    if "source" in stored.get("data", {}):
        table["data"] = {"source": stored["data"]["source"]}
    return config_from_table(table, f"{path} (the config it stores)")


def describe_checkpoint(path: str | Path) -> str:
    """What `path` holds, from metadata alone: no array data is read, so it is quick at any model size and works
    when the array data files are damaged. A run directory: its complete steps and any interrupted saves, then the
    newest step. A step directory or params export: every array's path, shape, dtype and bytes; totals for the
    params and the optimizer state; the step, the model and the mesh it was trained on."""
    path = Path(path).absolute()
    if (path / "state").is_dir() or is_params_export(path):
        return _describe_step(path)
    steps = _steps(path)
    interrupted = sorted(ocp.path.step.tmp_checkpoints(path)) if path.is_dir() else []
    if not steps and not interrupted:
        raise _no_checkpoint(path, f"a run directory (numbered step directories), {_STEP_DIR}, or {_EXPORT_DIR}")
    lines = [f"run directory {path}", f"complete steps: {', '.join(map(str, steps)) or 'none'}"]
    if interrupted:
        lines.append(f"interrupted saves (incomplete, never restored): {', '.join(interrupted)}")
    aside = sorted(p.name for p in path.glob("*.unreadable-*"))
    if aside:
        lines.append(f"moved aside, unreadable (never restored; delete when not needed): {', '.join(aside)}")
    if steps:
        lines += ["", f"newest step, {steps[-1]}:", _describe_step(path / str(steps[-1]))]
    return "\n".join(lines)


def _describe_step(path: Path) -> str:
    export = is_params_export(path)
    meta = _read_meta(path)
    config = meta.get("config", {})
    arrays = _arrays(path, "params" if export else "state")
    groups: dict[str, list] = {}
    for name, x in arrays.items():
        groups.setdefault(name.split("/")[0], []).append(x)
    kind = "params export" if export else "training checkpoint"
    lines = [
        f"{kind} {path}: step {meta.get('step')}, model {config.get('model_name')}, trained on mesh "
        f"{config.get('mesh')}",
        *format_table(
            [("array", "shape", "dtype", "bytes")]
            + [(name, str(tuple(x.shape)), str(x.dtype), f"{total_bytes(x):,}") for name, x in arrays.items()]
        ),
    ]
    lines += [_totals(_GROUP_NAMES.get(group, group), xs) for group, xs in groups.items()]
    if len(groups) > 1:
        lines.append(_totals("total", list(arrays.values())))
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    lines.append(f"on disk: {on_disk:,} bytes ({fmt_bytes(on_disk)})")
    return "\n".join(lines)


# How `describe_checkpoint` names the top-level parts of a checkpoint; others (the step) go by their own name.
_GROUP_NAMES = {"params": "params", "opt_state": "optimizer state"}


def _totals(label: str, arrays: list) -> str:
    values = _count(sum(math.prod(x.shape) for x in arrays), "parameter" if label == "params" else "value")
    nbytes = total_bytes(arrays)
    return f"{label}: {_count(len(arrays), 'array')}, {values}, {nbytes:,} bytes ({fmt_bytes(nbytes)})"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _params_item(path: Path) -> str:
    """The Orbax item of `path` that holds {"params": ...}: 'params' in an export, 'state' in a training checkpoint."""
    for item in ("params", "state"):
        if (path / item).is_dir():
            return item
    raise _no_checkpoint(path, f"{_EXPORT_DIR} or {_STEP_DIR}")


def _read_params(path: Path, item: str, target: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """The params in `item` of `path` into `target` (ShapeDtypeStructs: with shardings they read as jax.Arrays,
    without as numpy arrays), and the meta. Nothing else in the item (the optimizer state) is read."""
    target = {"params": target}
    # StandardRestore insists on the whole stored tree; PyTreeRestore(partial_restore=True) reads `target`'s keys only.
    args = ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    restored = _read(path, **{item: args})
    return restored[item]["params"], restored["meta"]


def _read(path: Path, **items: ocp.args.CheckpointArgs) -> dict[str, Any]:
    """Read `items` and the meta of `path`; whatever the storage layer raises is a CheckpointError naming `path`."""
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore()))
    except Exception as err:  # noqa: BLE001 - whatever the storage layer raises, the checkpoint is unusable
        raise CheckpointError(f"checkpoint {path} cannot be read ({one_line(err)}).") from err
    return {**{name: restored[name] for name in items}, "meta": dict(restored["meta"])}


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        return dict(ocp.JsonCheckpointHandler().restore(path / "meta"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} has unreadable meta ({one_line(err)}).") from err


def _steps(path: Path) -> list[int]:
    """The complete checkpoint steps in run directory `path`, oldest first (none if it is not one)."""
    return sorted(ocp.path.step.checkpoint_steps(path)) if path.is_dir() else []


def _no_checkpoint(path: Path, expected: str) -> CheckpointError:
    """The error for a `path` that is not the checkpoint `expected`, pointing into it if it is a run directory."""
    steps = _steps(path)
    hint = f" {path} is a run directory: give one of its steps, e.g. {path / str(steps[-1])}." if steps else ""
    return CheckpointError(f"no checkpoint at {path}: expected {expected}.{hint}")


def _check_shapes(path: Path, abstract_state: PyTree, item: str = "state") -> None:
    """Compare the shapes stored in `item` with the model's before reading anything, naming the first mismatch."""
    stored_shapes = {name: tuple(x.shape) for name, x in _arrays(path, item).items()}
    named = [(_path(key), x) for key, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]
    # Params first: the mismatch named is the model's, not its optimizer state's.
    for name, x in sorted(named, key=lambda nx: not nx[0].startswith("params/")):
        if name not in stored_shapes:
            raise CheckpointMismatchError(f"checkpoint {path} has no array {name}: it was saved by a different model.")
        if stored_shapes[name] != tuple(x.shape):
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the model: {name} is {stored_shapes[name]} there, "
                f"{tuple(x.shape)} here. Restore it with the config it was saved with."
            )


def _arrays(path: Path, item: str) -> dict[str, Any]:
    """Orbax's metadata (shape, dtype, ...) of each array in `item` of `path`, by name ('params/blocks/w_in'), params
    first."""
    flat = {_path(k): x for k, x in jax.tree_util.tree_flatten_with_path(_metadata(path, item))[0]}
    return dict(sorted(flat.items(), key=lambda kv: not kv[0].startswith("params/")))


def _metadata(path: Path, item: str) -> PyTree:
    """The tree of array metadata of `item` in `path`. Orbax reads it from the tree metadata file and each array's
    header in the OCDBT index, never from the array data files."""
    try:
        stored = ocp.StandardCheckpointHandler().metadata(path / item)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path} has unreadable metadata ({one_line(err)}).") from err
    return getattr(stored, "item_metadata", stored)


def _path(keys: tuple) -> str:
    """'params/blocks/w_in' whether the tree holds dicts, lists or named tuples (metadata has only the first two)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)
