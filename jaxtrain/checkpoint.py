"""Checkpoints with Orbax: the train state, the data position and the run's config, saved asynchronously.

A checkpoint holds the state in the model's own layer order (`Plan.state_in_model_order`) and no layout: restoring
reads every array straight into the shardings of the *current* plan, so a run saved on one mesh resumes on another
(8 -> 4 -> 1 devices, data parallel -> FSDP x tensor, with or without a pipeline). Orbax writes each checkpoint to a
temporary directory and renames it when complete, so a crash mid-save leaves the previous checkpoint usable.

The data position is the global step: batches are a pure function of (seed, split, step), whatever the device or
process count, so resuming at step n reads exactly the batches an uninterrupted run would.

    >>> checkpoints = Checkpoints("/tmp/run", save_every=100, keep=3)           # doctest: +SKIP
    >>> checkpoints.save(step, plan.state_in_model_order(state), {"step": step})  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxtrain.errors import UserInputError

PyTree = Any
log = logging.getLogger(__name__)


class CheckpointError(UserInputError):
    """A checkpoint that is missing, unreadable, or does not fit the model."""


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
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return sorted(self.manager.all_steps())

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Start writing `state` (model order) and `meta` (JSON) as checkpoint `step`; returns once the arrays are
        copied off the devices, so the next step may reuse their buffers."""
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    def restore_latest(self, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]] | None:
        """The newest checkpoint that reads back, into `abstract_state`'s shapes and shardings; None if there is
        none. A checkpoint that fails to read is skipped with a warning naming it."""
        for step in reversed(self.steps()):
            try:
                return restore(self.directory / str(step), abstract_state)
            except CheckpointError as err:
                log.warning("skipping checkpoint %s: %s", self.directory / str(step), err)
        return None

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def restore(path: str | Path, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
    """Read checkpoint directory `path` (a step directory) into `abstract_state`'s shapes, dtypes and shardings."""
    path = Path(path).absolute()
    if not (path / "state").is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a step directory containing 'state' (e.g. runs/x/ckpt/1000)."
        )
    _check_shapes(path, abstract_state)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                path,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
            )
    except Exception as err:  # noqa: BLE001 - whatever the storage layer raises, the checkpoint is unusable
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}).") from err
    return restored["state"], dict(restored["meta"])


def _check_shapes(path: Path, abstract_state: PyTree) -> None:
    """Compare the stored arrays' shapes with the model's before reading anything, naming the first mismatch."""
    try:
        stored = ocp.StandardCheckpointHandler().metadata(path / "state")
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path} has unreadable metadata ({type(err).__name__}: {err}).") from err
    stored_tree = getattr(stored, "item_metadata", stored)
    stored_shapes = {_path(k): tuple(v.shape) for k, v in jax.tree_util.tree_flatten_with_path(stored_tree)[0]}
    for key, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        name = _path(key)
        if name not in stored_shapes:
            raise CheckpointError(f"checkpoint {path} has no array {name}: it was saved by a different model.")
        if stored_shapes[name] != tuple(x.shape):
            raise CheckpointError(
                f"checkpoint {path} does not match the model: {name} is {stored_shapes[name]} there, "
                f"{tuple(x.shape)} here. Restore it with the config it was saved with."
            )


def _path(keys: tuple) -> str:
    """'params/blocks/w_in' whether the tree holds dicts, lists or named tuples (metadata has only the first two)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)
