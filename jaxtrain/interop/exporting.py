"""Export a jaxtrain decoder or BERT encoder (a run directory, a step or a params export) as a Hugging Face model
directory.

    >>> export_hf("runs/x", "runs/x-hf")  # then AutoModelForCausalLM.from_pretrained("runs/x-hf")  # doctest: +SKIP

The params are restored onto a mesh (default: every device on fsdp), then gathered one tensor (one layer's) at a
time, turned into the Hugging Face layout and streamed into safetensors files of at most `max_file_bytes`, so host
memory holds one tensor besides the sharded model. config.json names the architecture that computes the model
(`exported_architecture`: a decoder's by `architectures.architecture_for`, BERT's by `encoders.architecture_for`);
a model imported from Hugging Face keeps its source's other config fields and tokenizer files. Written to a
temporary directory, then renamed: the output never holds half an export. A run trained with adapters exports
merged (`jaxtrain.training.adapted_checkpoints.restore_merged`); `peft_export` writes its adapters for peft.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.errors import UserInputError
from jaxtrain.interop import encoders
from jaxtrain.interop.architectures import DECODER_MODELS, Architecture, Tensor, architecture_for
from jaxtrain.interop.importing import PARAM_DTYPES, carry_files
from jaxtrain.interop.tensor_files import Pending, write_tensors
from jaxtrain.placement.place import place_model
from jaxtrain.run_config import RunConfig
from jaxtrain.training.adapted_checkpoints import restore_merged
from jaxtrain.training.checkpoint import carried_files, find_checkpoint, trained_config

PyTree = Any
MAX_FILE_BYTES = 5 * 10**9  # save_pretrained's default shard size, "5GB"
ENCODER_MODELS = tuple(a.model for a in encoders.ENCODERS.values())
EXPORTED = (*DECODER_MODELS, *ENCODER_MODELS)  # the registered models export-hf writes


class HFExportError(UserInputError):
    """A checkpoint that cannot be exported, or an output directory that cannot be written."""


def export_hf(
    path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_file_bytes: int = MAX_FILE_BYTES,
    mesh: str = "fsdp=-1",
    devices: list[jax.Device] | None = None,
) -> Path:
    """Write the model in checkpoint `path` (a run directory: its newest step; a step; a params export) of a decoder
    (gpt, llama) or an encoder (bert, bert_classifier) as a Hugging Face model directory `out_dir` (which must not
    exist), its weights in `dtype`. A run trained with adapters (`lora.rank` > 0) exports the model it computes: each
    adapter folded into its weight (`export_peft` writes the adapters alone)."""
    check_output(out_dir, dtype)
    step_dir, meta = find_checkpoint(path)
    cfg = exported_config(step_dir, meta)
    placed = place_model(cfg.model_name, cfg.model, mesh, cfg.rules, devices=devices)
    # Restored in the dtype written: a bfloat16 export of a float32 checkpoint holds half the bytes on the devices.
    params = restore_merged(step_dir, meta, placed, dtype)
    return write_hf(
        params,
        cfg.model,
        out_dir,
        dtype=dtype,
        max_file_bytes=max_file_bytes,
        carried=carried_files(step_dir),
        model_name=cfg.model_name,
    )


def exported_config(step_dir: Path, meta: dict[str, Any], models: tuple[str, ...] = EXPORTED) -> RunConfig:
    """The run config of checkpoint `step_dir` (meta `meta`), once its model is known to be one of `models`."""
    cfg = trained_config(step_dir, meta)
    if cfg.model_name.split("-")[0] not in models:
        raise HFExportError(
            f"{step_dir} holds model {cfg.model_name}: only {', '.join(models)} models export to Hugging Face."
        )
    return cfg


def decoder_config(step_dir: Path, meta: dict[str, Any]) -> RunConfig:
    """The run config of checkpoint `step_dir` (meta `meta`), once its model is known to be a decoder."""
    return exported_config(step_dir, meta, DECODER_MODELS)


def exported_architecture(model_name: str, model: Any, imported: dict[str, Any] | None = None) -> Architecture:
    """The Hugging Face architecture that computes `model`, the settings of registered model `model_name` (with or
    without its preset: "llama", "bert-base"), given the config.json it was imported from."""
    name = model_name.split("-")[0]
    if name in ENCODER_MODELS:
        return encoders.architecture_for(name, model)
    return architecture_for(model, imported)


def write_hf(
    params: PyTree,
    model: Any,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_file_bytes: int = MAX_FILE_BYTES,
    carried: Path | None = None,
    model_name: str = "llama",
) -> Path:
    """Write `params` (model layer order; jax.Arrays on any mesh, or numpy) of `model`, the settings of registered
    model `model_name` (a decoder's GPTConfig by default; bert, bert_classifier), as a Hugging Face model directory
    `out_dir`; `carried`: a folder of the source's config.json and tokenizer files."""
    out_dir = check_output(out_dir, dtype)
    carried = carried if carried is not None and carried.is_dir() else None
    imported = json.loads((carried / "config.json").read_text()) if carried else None
    arch = exported_architecture(model_name, model, imported)
    partial = out_dir.with_name(f".{out_dir.name}.exporting-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        pending = [
            pending_tensor(tensor, params, layer, np.dtype(jax.numpy.dtype(dtype)))
            for tensor in arch.tensors_of(model)
            for layer in (range(model.n_layers) if tensor.stacked else [None])
        ]
        write_tensors(partial, pending, max_file_bytes)
        if carried:
            carry_files(carried, partial, skip=("config.json",))
        config = arch.config(model, dtype, imported)
        (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def check_output(out_dir: str | Path, dtype: str) -> Path:
    """`out_dir`, absolute, once it is known not to exist and `dtype` to be one jaxtrain writes."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        raise HFExportError(f"{out_dir} already exists: an export never overwrites. Give a new directory.")
    if dtype not in PARAM_DTYPES:
        raise HFExportError(f"dtype {dtype!r}: give float32 or bfloat16.")
    return out_dir


def pending_tensor(tensor: Tensor, params: PyTree, layer: int | None, dtype: np.dtype) -> Pending:
    """The Hugging Face tensor `tensor` names (of `layer`), gathered from the devices only when it is written."""
    array = params
    for key in tensor.param.split("/"):
        array = array[key]
    shape = array.shape[1:] if tensor.stacked else array.shape

    def produce() -> np.ndarray:
        return tensor.to_hf(_gather(array, layer)).astype(dtype, copy=False)

    return Pending(tensor.name(layer), tensor.hf_shape(shape), dtype, produce)


def _gather(array: jax.Array | np.ndarray, layer: int | None) -> np.ndarray:
    """`array` (its row `layer` if given) on the host, assembled from the devices' shards: at most one host copy and
    no device program (`np.asarray` of a sharded array would gather it on a device first). A shard that holds all of
    it is returned as a view of the device buffer (no copy on the CPU), so a replicated or unsharded tensor costs
    nothing more."""
    if isinstance(array, np.ndarray):
        return array if layer is None else array[layer]
    if not array.is_fully_addressable:
        raise HFExportError("export-hf runs in one process: this array is spread over several (import runs in many).")
    shape = array.shape if layer is None else array.shape[1:]
    out = None
    for shard in array.addressable_shards:
        index, data = shard.index, np.asarray(shard.data)
        if layer is not None:
            rows = range(*index[0].indices(array.shape[0]))
            if layer not in rows:
                continue
            index, data = index[1:], data[layer - rows.start]
        if data.shape == shape:
            return data
        if out is None:
            out = np.empty(shape, array.dtype)
        out[index] = data
    return out
