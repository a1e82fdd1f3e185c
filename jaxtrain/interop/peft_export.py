"""Export a run's low-rank adapters in peft's format: a directory that `peft.PeftModel.from_pretrained(model, OUT)`
loads onto the Hugging Face model the run adapted.

    >>> export_peft("runs/lora", "runs/lora-peft")                                                # doctest: +SKIP
    >>> PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "runs/lora-peft")    # doctest: +SKIP

peft's LoRA on a Linear layer of weight W (out, in) adds (lora_alpha / r)·B·A·x, with `lora_A.weight` A (r, in) and
`lora_B.weight` B (out, r); jaxtrain's A holds the adapted weight's contracted dims then the rank, its B the rank then
the weight's output dims (`jaxtrain.posttrain.adapters`). So each factor is a row of the architecture's tensor table
(`architectures`), derived from its weight's row, with `r` the rank's letter:

    q_proj.weight        "(h k) d"  is  w_q         "d h k"
    q_proj.lora_A.weight "r (d)"    is  w_q/lora_a  "d r"      (the weight's in group, after the rank)
    q_proj.lora_B.weight "(h k) r"  is  w_q/lora_b  "r h k"    (the weight's out group, before the rank)

The same transposes and reshapes as the weight's, and no RoPE permutation (the table needs none). Names carry peft's
prefix `base_model.model.`. A weight the table has no row for, or one adapted through an einsum whose contracted and
output dims are not the Linear layer's in and out (an expert's), has no peft counterpart: an error naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.errors import UserInputError
from jaxtrain.interop.architectures import Tensor, architecture_for
from jaxtrain.interop.exporting import HFExportError, check_output, decoder_config, pending_tensor
from jaxtrain.interop.tensor_files import write_tensors
from jaxtrain.placement.place import place_model
from jaxtrain.posttrain.adapters import AdaptedModel, Letters, Target
from jaxtrain.run_config import LoraConfig
from jaxtrain.training.adapted_checkpoints import restore_adapters, stored_lora, with_stored_adapters
from jaxtrain.training.checkpoint import carried_files, find_checkpoint, is_params_export

PyTree = Any
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # one file: peft reads no shards of adapters
PREFIX = "base_model.model."  # where peft's PeftModelForCausalLM holds the transformers model
RANK = "r"  # the rank's letter in the factors' table rows (the tables use d h g k f v)


class PeftExportError(HFExportError):
    """A checkpoint whose adapters cannot be written for peft: none trained, or one peft has no layer for."""


def export_peft(
    path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    mesh: str = "fsdp=-1",
    devices: list[jax.Device] | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the adapters of the LoRA run in checkpoint `path` (a run directory: its newest step; a step) as a peft
    adapter directory `out_dir` (which must not exist), its factors in `dtype`. `base_model`: what
    adapter_config.json names as the model adapted (default: the Hugging Face directory the run's base was imported
    from, where known)."""
    check_output(out_dir, dtype)
    step_dir, meta = find_checkpoint(path)
    cfg = decoder_config(step_dir, meta)
    lora = stored_lora(step_dir, meta)
    if not lora.rank:
        raise PeftExportError(
            f"checkpoint {step_dir} was trained without adapters (lora.rank=0), so it has none to export: export the "
            "whole model without --adapters-only, or train adapters on it (jaxtrain train --restore "
            f"{step_dir} lora.rank=8)."
        )
    placed = with_stored_adapters(place_model(cfg.model_name, cfg.model, mesh, cfg.rules, devices=devices), lora, meta)
    adapters = restore_adapters(step_dir, placed)
    base_model = base_model or base_model_of(meta)
    return write_peft(
        adapters,
        placed.model,
        cfg.model,
        lora,
        out_dir,
        dtype=dtype,
        base_model=base_model,
        carried=carried_files(step_dir),
    )


def write_peft(
    params: PyTree,
    adapted: AdaptedModel,
    model: Any,
    lora: LoraConfig,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    base_model: str | None = None,
    carried: Path | None = None,
) -> Path:
    """Write the adapters in `params` (an adapted model's params, or their adapters alone: `adapted.trainable`; model
    layer order; jax.Arrays on any mesh, or numpy) of decoder `model` (a GPTConfig) trained with `lora`, as a peft
    adapter directory `out_dir`: adapter_config.json and adapter_model.safetensors. `carried`: the folder of the
    source's config.json, whose architecture the adapters are named by."""
    out_dir = check_output(out_dir, dtype)
    carried = carried if carried is not None and carried.is_dir() else None
    imported = json.loads((carried / "config.json").read_text()) if carried else None
    arch = architecture_for(model, imported)
    rows = {t.param: t for t in arch.table(model.tie_embeddings)}
    tables = [factor_tensors(_row(rows, path), target) for path, target in adapted.targets.items()]
    adapters, np_dtype = adapted.trainable(params), np.dtype(jax.numpy.dtype(dtype))
    pending = [
        pending_tensor(tensor, adapters, layer, np_dtype)
        for pair in tables
        for tensor in pair
        for layer in (range(model.n_layers) if tensor.stacked else [None])
    ]
    config = adapter_config(lora, sorted({_module(a) for a, _ in tables}), base_model)
    partial = out_dir.with_name(f".{out_dir.name}.exporting-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        write_tensors(partial, pending, sys.maxsize, single=ADAPTER_WEIGHTS)
        (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def factor_tensors(weight: Tensor, target: Target) -> tuple[Tensor, Tensor]:
    """The table rows of the adapter factors A and B on the weight whose row is `weight` (a Linear layer's,
    "out in"), adapted through `target`'s einsum: peft's `lora_A.weight` (r, in) and `lora_B.weight` (out, r)."""
    letters, groups = Letters.of(target.spec), weight.groups()
    ours = dict(zip(letters.w, weight.dims.split()))  # the einsum's letters -> the table's
    contracted = {ours[c] for c in letters.w if c in letters.x and c not in letters.out}
    output = {ours[c] for c in letters.w if c not in letters.x}
    lead = 1 if weight.stacked else 0
    if len(groups) != 2 or (set(groups[1]), set(groups[0])) != (contracted, output) or target.lead != lead:
        raise PeftExportError(
            f"the adapter on {weight.param} ({target.spec}) has no peft counterpart: peft adapts a Linear layer's "
            f"input and output, {weight.hf_name} '{weight.hf_dims}'. Train without it (lora.targets)."
        )
    ours[letters.r] = RANK
    module = PREFIX + weight.hf_name.removesuffix(".weight")
    a_dims, b_dims = (" ".join(ours[c] for c in factor) for factor in (letters.a, letters.b))
    return (
        Tensor(f"{weight.param}/lora_a", f"{module}.lora_A.weight", f"{RANK} ({' '.join(groups[1])})", a_dims),
        Tensor(f"{weight.param}/lora_b", f"{module}.lora_B.weight", f"({' '.join(groups[0])}) {RANK}", b_dims),
    )


def _row(rows: dict[str, Tensor], path: tuple) -> Tensor:
    name = "/".join(map(str, path))
    if name not in rows:
        raise PeftExportError(
            f"the adapter on {name} has no peft counterpart: the exported architecture has no layer for that weight "
            f"(it has {', '.join(rows)}). Train without it (lora.targets)."
        )
    return rows[name]


def _module(factor: Tensor) -> str:
    """peft's target module name of a factor: its layer's last name ("q_proj"), which peft matches in every layer."""
    return factor.hf_name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1]


def adapter_config(lora: LoraConfig, modules: list[str], base_model: str | None) -> dict[str, Any]:
    """adapter_config.json of adapters trained with `lora` on the layers named `modules`: what peft's LoraConfig
    reads. The scale is lora_alpha / r, as jaxtrain's (not rsLoRA's lora_alpha / sqrt(r))."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def base_model_of(meta: dict[str, Any]) -> str | None:
    """The Hugging Face model a run's adapters go on, where the checkpoint says: the directory the params export it
    started from (`checkpoint.restore`) was imported from. None otherwise (a base trained or fine-tuned by jaxtrain
    has no name on the Hub: export it with `jaxtrain export-hf` and load the adapters onto that)."""
    restore = ((meta.get("config") or {}).get("checkpoint") or {}).get("restore")
    if not restore or not is_params_export(restore):
        return None
    try:
        _, base_meta = find_checkpoint(restore)
    except UserInputError:  # moved or deleted since: adapter_config.json then names no base
        return None
    return base_meta.get("imported_from")
