"""Checkpoints of an AlphaZero run (`scripts/alphazero.py --checkpoint-dir`): everything the iterations after the k-th
depend on, saved as one checkpoint of `jaxtrain.training.checkpoint.Checkpoints`, so that a resumed run plays the same
games and takes the same learner steps as an uninterrupted one.

Those are the train state (params, optimizer state, step), the replay buffer's positions (the learner's batches are
drawn from them by (seed, step, row)), the iteration count (self-play's key is `fold_in(key, iteration)`), and the
step-0 network the final evaluation plays against. The checkpoint's `state` item holds the train state in model
order, as `jaxtrain train` saves it (so `jaxtrain inspect` and `jaxtrain export` read it), with `initial_params` and
`replay` (`ReplayBuffer.saved`) beside it; its JSON meta holds the learner step, the iteration, the run config, the
self-play settings and the history of allowed config changes. Orbax writes all of it into a temporary directory that it
renames when complete, so a kill at any moment leaves only whole checkpoints, the buffer in step with the params; a
checkpoint that does not read back is skipped for the one before it. Restore reads the arrays into the current plan's
shardings and the buffer as host arrays, so a run saved on one mesh resumes on another. Directories are numbered by
learner step, as `jaxtrain train`'s are.

A run resumes only its own checkpoints: the trajectory keys of its run config (`run_identity`; the override
`allow_config_change` lets named ones change, recorded in the history) and the self-play settings must equal those
the checkpoint stores.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxtrain.rl.replay import ReplayBuffer
from jaxtrain.run_config import RunConfig
from jaxtrain.training import run_identity
from jaxtrain.training.checkpoint import CheckpointMismatchError, Checkpoints, newest_meta
from jaxtrain.training.run_identity import RunIdentityError
from jaxtrain.training.setup import Setup

PyTree = Any

# The script's flags behind the run config keys a resume compares, for messages in the flags the user typed.
_FLAGS = {
    "model_name": "--model",
    "train.steps": "--iterations x --learner-steps",
    "data.batch_size": "--batch-size",
    "train.seed": "--seed",
}


@dataclasses.dataclass
class Resumed:
    """A run as its newest checkpoint left it, `iteration` iterations done (its buffer is restored in place): the
    train state in the plan's shardings and the step-0 network's params."""

    state: PyTree
    initial_params: PyTree
    iteration: int


class SelfPlayCheckpoints:
    """The checkpoints of one AlphaZero run `run` in `directory`: one every `every` iterations and one after the last.
    `settings` are the self-play flags that define the run besides `run.cfg` (name -> value: games, simulations,
    learner_steps, capacity); a resume compares them with the checkpoint's."""

    def __init__(self, directory: str | Path, every: int, run: Setup, settings: dict[str, int]):
        self.run, self.settings = run, settings
        self.learner_steps = settings["learner_steps"]
        self.checkpoints = Checkpoints(directory, save_every=every * self.learner_steps)
        self.history: list[dict[str, Any]] = []  # the allowed config changes, carried by every checkpoint

    def due(self, iteration: int, last: int) -> bool:
        """Whether to save after iteration `iteration` (counting from 1) of `last`."""
        return self.checkpoints.due(iteration * self.learner_steps, last * self.learner_steps)

    def save(self, iteration: int, state: PyTree, initial_params: PyTree, buffer: ReplayBuffer) -> None:
        """Start saving the run after `iteration` iterations; returns once the arrays are off the devices, so the next
        step may reuse the state's buffers. Raises `CheckpointWriteError` if this save or the one before failed."""
        step = iteration * self.learner_steps
        # The step-0 params as the actors take them, the model's own layout: the script has no pipeline layouts.
        tree = {**self.run.plan.state_in_model_order(state), "initial_params": initial_params, "replay": buffer.saved()}
        meta = {
            "step": step,
            "iteration": iteration,
            "config": run_identity.config_json(self.run.cfg),
            "selfplay": self.settings,
            "history": self.history,
        }
        self.checkpoints.save(step, tree, meta)

    def restore_latest(self, buffer: ReplayBuffer, log: Callable[[str], None]) -> Resumed | None:
        """The run as the newest checkpoint that reads back left it, its positions restored into `buffer`; None if there
        is no checkpoint. Raises `RunIdentityError` if the newest one is another run's or does not fit the model, and
        `CheckpointError` if none reads back."""
        abstract = self.run.plan.abstract_model_state()
        target = {**abstract, "initial_params": abstract["params"], "replay": buffer.saved_shapes()}
        changed: dict[str, tuple[Any, Any]] = {}

        def accept(step_dir: Path, meta: dict[str, Any]) -> None:
            changed.clear()
            changed.update(check_same_run(step_dir, meta, self.run.cfg, self.settings))

        try:
            found = self.checkpoints.restore_latest(target, accept)
        except CheckpointMismatchError as err:
            raise run_identity.does_not_fit(self.checkpoints.directory, err) from err
        if found is None:
            return None
        tree, meta = found
        buffer.restore(tree.pop("replay"))
        initial_params = tree.pop("initial_params")
        self.history = list(meta.get("history", []))
        if changed:
            self.history.append(run_identity.history_entry(meta["step"], changed))
        also = f", with {run_identity.describe_changes(changed)} (allowed; recorded in its history)" if changed else ""
        log(f"resuming after iteration {meta['iteration']} (learner step {meta['step']}) from a checkpoint{also}")
        return Resumed(self.run.plan.state_from_model_order(tree), initial_params, meta["iteration"])

    def wait(self) -> None:
        """Block until every started save is on disk; raises `CheckpointWriteError` if one failed."""
        self.checkpoints.wait()

    def __enter__(self) -> SelfPlayCheckpoints:
        return self

    def __exit__(self, *_) -> None:
        self.checkpoints.close()


def check_resume(directory: str | Path, cfg: RunConfig, settings: dict[str, int]) -> None:
    """Refuse to resume in `directory` if its newest checkpoint is another run's (`check_same_run`): only JSON is read,
    so it is cheap enough to call before anything compiles."""
    newest = newest_meta(directory)
    if newest is not None:
        check_same_run(*newest, cfg, settings)


def check_same_run(
    step_dir: Path, meta: dict[str, Any], cfg: RunConfig, settings: dict[str, int]
) -> dict[str, tuple[Any, Any]]:
    """Whether the run of `cfg` and `settings` may resume from checkpoint `step_dir` (with `meta`): raises
    `RunIdentityError` naming each difference that is not allowed; returns the allowed ones (config key -> (stored,
    now)), for the run's history."""
    if "selfplay" not in meta:
        raise RunIdentityError(
            f"cannot resume in {step_dir.parent}: its newest checkpoint, {step_dir}, was not written by "
            "scripts/alphazero.py (it holds no replay buffer). Nothing was written: give another --checkpoint-dir."
        )
    changed = run_identity.differences(meta.get("config", {}), cfg)
    allowed = run_identity.allowed_changes(cfg)
    refused = {key: values for key, values in changed.items() if key not in allowed}
    flags = {
        f"--{name.replace('_', '-')}": (stored, settings.get(name))
        for name, stored in meta["selfplay"].items()
        if settings.get(name) != stored
    }
    if refused or flags:
        raise _mismatch(step_dir, refused, flags)
    return changed


def _mismatch(
    step_dir: Path, refused: dict[str, tuple[Any, Any]], flags: dict[str, tuple[Any, Any]]
) -> RunIdentityError:
    """The error for a resume whose config keys `refused` and self-play flags `flags` differ from `step_dir`'s."""
    named = {_flag(key): values for key, values in refused.items()} | flags
    lines = "".join(
        f"\n  {name}: {json.dumps(old)} in the checkpoint, {json.dumps(new)} now" for name, (old, new) in named.items()
    )
    deliberate = (
        f" If the change is deliberate, resume with the override allow_config_change={','.join(refused)} (recorded in "
        "the run's history)."
        if refused
        else ""
    )
    return RunIdentityError(
        f"cannot resume in {step_dir.parent}: its newest checkpoint, {step_dir}, was written by another run:{lines}\n"
        f"Nothing was written. To continue that run, rerun with its values; to start this one, give another "
        f"--checkpoint-dir.{deliberate}"
    )


def _flag(key: str) -> str:
    """A run config key as the user gives it to scripts/alphazero.py: a flag where one sets it, else the key itself."""
    if key.startswith("model."):
        return f"--model ({key})"
    return f"{_FLAGS[key]} ({key})" if key in _FLAGS else key
