"""What makes the checkpoints in a directory one run: the config keys that define its trajectory, compared on resume
with the config its checkpoint stores, and the record of deliberate changes (`checkpoint.allow_change`).

A run's trajectory, the params and losses step after step, is fixed by its model (`model_name`, `model.*`), the
optimizer and its schedule (`optimizer.*`, and `train.steps`, which sets the schedule's length), the data
(`data.*`: source, batch, sequence length, validation split, partition), the seed, the update policy (`updates.*`),
the engine (`engine.*`) and `allreduce.compression`, whose bf16 messages change the gradient). Resuming with one
of them changed would continue a different run under the old one's name, so it is refused unless named in
`checkpoint.allow_change`.

Everything else says how a step is executed or what is written, and may change freely: the mesh and device and
process counts, the sharding rules, `model.remat`, gradient accumulation and the pipeline's schedule, microbatches,
stages and stash, the gradient-synchronisation algorithm and its buckets, logging, evaluation, checkpointing and
rollback settings, output paths. For a loss that is a mean over examples these give the same numbers within float
tolerance (tests/test_checkpoint.py resumes on other meshes); a model that looks across examples, as ResNet's batch
norm does and MoE's expert capacity, sees each accumulation piece or microbatch on its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from jaxtrain.run_config import (
    CheckpointConfig,
    PipelineConfig,
    RunConfig,
    TrackingConfig,
    resolve_key,
    translated,
)
from jaxtrain.training.checkpoint import CheckpointError

# Keys that may differ between a checkpoint and the run resuming from it (any `rules.*` too): see the module's doc.
FREE_KEYS = frozenset(
    {
        "mesh",
        "model.remat",
        "data.prefetch",
        *(f"train.{name}" for name in ("grad_accum", "rollback_after", "log_every", "eval_every", "eval_batches")),
        *(f"train.generate_eval_{name}" for name in ("every", "prompts", "max_new_tokens", "scorer", "stop")),
        *(f"train.eval_tasks{suffix}" for suffix in ("", "_every", "_limit", "_include_path")),
        "train.progress",
        "train.verbose",
        "allreduce.algorithm",
        "allreduce.bucket_mb",
        "allreduce.hubs",
        *(f"pipeline.{f.name}" for f in dataclasses.fields(PipelineConfig)),
        *(f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointConfig)),
        *(f"tracking.{f.name}" for f in dataclasses.fields(TrackingConfig)),
    }
)


class RunIdentityError(CheckpointError):
    """Resuming in a checkpoint directory with a config (or model) other than the run's that wrote it."""


def config_json(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as the JSON a checkpoint's meta stores (tuples become lists, as they read back)."""
    return json.loads(json.dumps({**dataclasses.asdict(cfg), "model": dataclasses.asdict(cfg.model)}))


def fingerprint(config: dict[str, Any]) -> str:
    """A short name of the trajectory `config` (a checkpoint's stored config, or `config_json(cfg)`) defines: a
    hash of its trajectory keys, so a run and every rerun of it share it (metrics rows carry it: `metrics`)."""
    keys = {key: value for key, value in _stored_flat(config).items() if defines_trajectory(key)}
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]


def defines_trajectory(key: str) -> bool:
    """Whether a change of dotted config `key` makes another run."""
    return key not in FREE_KEYS and not key.startswith("rules.")


def allowed_changes(cfg: RunConfig) -> frozenset[str]:
    """The dotted keys `checkpoint.allow_change` names (short names resolved as overrides are: `learning_rate`
    -> `optimizer.learning_rate`); an unknown key is a `ConfigError` listing close matches."""
    given = [name.strip() for name in cfg.checkpoint.allow_change.split(",") if name.strip()]
    names = [translated(name, None, None, cfg)[0] for name in given]
    return frozenset(
        name if name in ("model_name", "mesh") or name.startswith("rules.") else ".".join(resolve_key(cfg, name))
        for name in names
    )


def differences(stored: dict[str, Any], cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The trajectory keys whose value in `stored` (a checkpoint's config) differs from `cfg`'s: key -> (stored,
    now). A key the checkpoint does not store (added to jaxtrain after it was written) is not compared; a key renamed
    since (`run_config.RENAMED`) is compared under its new name."""
    before, now = _stored_flat(stored), _flat(config_json(cfg))
    return {
        key: (before[key], value)
        for key, value in now.items()
        if defines_trajectory(key) and key in before and json.dumps(before[key]) != json.dumps(value)
    }


def check(step_dir: Path, meta: dict[str, Any], cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Whether `cfg` may resume from checkpoint `step_dir` (with `meta`): raises `RunIdentityError` naming each
    trajectory key that differs and is not allowed; returns the allowed differences, for the run's history."""
    changed = differences(meta.get("config", {}), cfg)
    refused = {key: values for key, values in changed.items() if key not in allowed_changes(cfg)}
    if refused:
        raise mismatch(step_dir, refused)
    return changed


def mismatch(step_dir: Path, refused: dict[str, tuple[Any, Any]]) -> RunIdentityError:
    """The error for a resume whose config differs from checkpoint `step_dir`'s in `refused`, with the ways on."""
    lines = "".join(
        f"\n  {key}: {json.dumps(old)} in the checkpoint, {json.dumps(new)} now" for key, (old, new) in refused.items()
    )
    return RunIdentityError(
        f"cannot resume in {step_dir.parent}: its newest checkpoint, {step_dir}, was written by a run with another "
        f"config:{lines}\nNothing was written. To continue that run, use its values. To keep it and train this "
        f"config: give another --checkpoint-dir; or start a new run from that checkpoint's state with "
        f"--checkpoint-dir NEW --restore {step_dir}; or, if the change is deliberate, resume here with "
        f"--allow-config-change {','.join(refused)} (the change is recorded in the run's history)."
    )


def does_not_fit(directory: Path, err: CheckpointError) -> RunIdentityError:
    """The error for a resume in `directory` whose model's arrays differ from its checkpoint's though no refused
    key does (the model's code changed, or a change of shapes was allowed)."""
    return RunIdentityError(
        f"cannot resume in {directory}: {err} Nothing was written: a run cannot change its arrays' shapes. Give "
        "another --checkpoint-dir to train this model."
    )


def history_entry(step: int, changed: dict[str, tuple[Any, Any]], **extra: Any) -> dict[str, Any]:
    """A record for the run's history (carried by every later checkpoint's meta): at `step`, these keys changed."""
    return {"step": step, **extra, "changed": {key: {"from": old, "to": new} for key, (old, new) in changed.items()}}


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changed.items())


def _stored_flat(stored: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's stored config, flat, with the keys (and values) renamed since it was written translated
    silently: a checkpoint of an earlier version resumes with an unchanged command."""
    return dict(translated(key, value, None) for key, value in _flat(stored).items())


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """{'model': {'d_model': 64}, 'mesh': ...} -> {'model.d_model': 64, 'mesh': ...}: one level, as configs nest."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": inner for name, inner in value.items()})
        else:
            flat[key] = value
    return flat
