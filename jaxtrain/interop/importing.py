"""Import a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3; BERT) as a jaxtrain params export, onto any mesh.

    >>> import_hf("Llama-3.2-1B", "runs/llama-1b")                                   # doctest: +SKIP
    >>> source = HFCheckpoint("Llama-3.2-1B")                                         # doctest: +SKIP
    >>> params = source.read_params(cfg.model, shardings.abstract_state["params"])   # doctest: +SKIP

Each parameter is built with `jax.make_array_from_callback`: every device's shard is read alone, as a slice of the
file (`tensor_files`), so a process reads only the rows its devices hold, and host memory holds one slice at a time
besides the result. The export carries the run config (model settings from config.json), from which
`jaxtrain train --restore OUT` builds the model to fine-tune, a `config.toml` of it, and under `hf/` the source's
config.json and tokenizer files, which `jaxtrain export-hf` writes back.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tomli_w
from jax.experimental import multihost_utils

from jaxtrain.errors import UserInputError
from jaxtrain.interop.architectures import DECODERS, Architecture, Tensor, architecture
from jaxtrain.interop.encoders import ENCODERS
from jaxtrain.interop.tensor_files import INDEX_FILE, TensorFileError, TensorFiles
from jaxtrain.placement.place import place_model
from jaxtrain.placement.shardings import Shardings
from jaxtrain.run_config import RunConfig, config_from_table, config_table
from jaxtrain.training.checkpoint import CARRIED
from jaxtrain.training.run_identity import config_json

PyTree = Any
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
ARCHITECTURES = {**DECODERS, **ENCODERS}  # every Hugging Face class import-hf reads, by name
# Every model setting is given, from config.json: the preset only names the model the registry builds.
BASE_PRESET = "tiny"
PARAM_DTYPES = ("float32", "bfloat16")
# Checkpoints older than transformers' LayerNorm names (bert-base-uncased's) call its tensors gamma and beta, which
# transformers renames when it loads them: so does the import.
LEGACY_NAMES = ((".LayerNorm.gamma", ".LayerNorm.weight"), (".LayerNorm.beta", ".LayerNorm.bias"))


class HFImportError(UserInputError):
    """A Hugging Face directory that cannot be imported."""


class HFCheckpoint:
    """A Hugging Face model directory: its config.json, architecture and safetensors tensors."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        config_file = self.directory / "config.json"
        if not config_file.is_file():
            raise HFImportError(
                f"{config_file} does not exist: give a Hugging Face model directory (save_pretrained's)."
            )
        self.config: dict[str, Any] = _config(config_file)
        self.arch: Architecture = architecture(self.config, str(config_file), ARCHITECTURES)
        self.files = TensorFiles(self.directory)
        self.files.tensors = {_current_name(name): info for name, info in self.files.tensors.items()}

    def stored_dtype(self) -> str:
        """The dtype of the checkpoint's weights (its token embedding's), as jaxtrain names it."""
        return str(self.files.info(self.arch.tensors[0].name()).dtype)

    def run_config(self, dtype: str | None = None) -> RunConfig:
        """The run config of this model: its settings from config.json; params and compute in `dtype` (float32 or
        bfloat16; default: the checkpoint's)."""
        dtype = dtype or self.stored_dtype()
        if dtype not in PARAM_DTYPES:
            raise HFImportError(f"dtype {dtype!r}: give --dtype float32 or bfloat16.")
        model = {**self.arch.settings(self.config, str(self.directory / "config.json")), "dtype": dtype}
        table = {"model_name": f"{self.arch.model}-{BASE_PRESET}", "model": model, "data": {"source": "synthetic"}}
        return config_from_table(table, str(self.directory / "config.json"))

    def read_params(self, model: Any, abstract_params: PyTree) -> PyTree:
        """Every parameter of `model` (the run config's model settings: a GPTConfig, an EncoderConfig) in
        `abstract_params`' shapes and dtypes (model layer order): jax.Arrays, each device's shard read alone, where
        the ShapeDtypeStructs carry a sharding; numpy arrays where they do not. Shapes are checked against the files
        before anything is read."""
        table = {t.param: t for t in self.arch.tensors_of(model)}
        self._check(table, abstract_params, model)
        return jax.tree_util.tree_map_with_path(lambda path, x: self._param(table[_name(path)], x), abstract_params)

    def _param(self, tensor: Tensor, target: jax.ShapeDtypeStruct) -> jax.Array | np.ndarray:
        read = functools.partial(self._read, tensor, target.shape, target.dtype)
        if getattr(target, "sharding", None) is None:
            return read(tuple(slice(None) for _ in target.shape))
        return jax.make_array_from_callback(target.shape, target.sharding, read)

    def _read(self, tensor: Tensor, shape: tuple[int, ...], dtype: Any, index: tuple[slice, ...]) -> np.ndarray:
        """Slice `index` of the parameter (shape `shape`) that `tensor` maps, from the files."""
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        layers = range(index[0].start, index[0].stop) if tensor.stacked else [None]
        index, shape = (index[1:], shape[1:]) if tensor.stacked else (index, shape)
        sizes = tensor.sizes(shape)
        by_letter = dict(zip(tensor.dims.split(), index))
        hf_index = tensor.hf_index(by_letter, sizes)
        parts = [tensor.from_hf(self.files.read(tensor.name(layer), hf_index), by_letter, sizes) for layer in layers]
        return (np.stack(parts) if tensor.stacked else parts[0]).astype(dtype, copy=False)

    def _check(self, table: dict[str, Tensor], abstract_params: PyTree, model: Any) -> None:
        """Every tensor the model needs, in the shape config.json implies; no tensor it would leave unused."""
        needed = set()
        for path, target in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
            tensor = table[_name(path)]
            layers = range(target.shape[0]) if tensor.stacked else [None]
            expected = tensor.hf_shape(target.shape[1:] if tensor.stacked else target.shape)
            for layer in layers:
                name = tensor.name(layer)
                needed.add(name)
                info = self.files.info(name)
                if info.shape != expected:
                    raise TensorFileError(
                        f"{info.file}: tensor {name} is {info.shape}, but {self.directory / 'config.json'} makes "
                        f"it {expected}. The weights and the config do not belong together: fix config.json or use "
                        "the weights saved with it."
                    )
        unused = sorted(n for n in self.files.tensors if n not in needed and not self.arch.ignorable(n, model))
        if unused:
            raise TensorFileError(
                f"{self.directory} holds {len(unused)} tensor(s) that {self.arch.name} as configured has no place "
                f"for: {', '.join(unused[:3])}{' ...' if len(unused) > 3 else ''}. Check config.json's settings "
                "(tie_word_embeddings, attention_bias) against the weights."
            )


def _config(config_file: Path) -> dict[str, Any]:
    """config.json's settings, once they are known to be a JSON object."""
    try:
        config = json.loads(config_file.read_text())
    except ValueError as err:  # not UTF-8, or not JSON
        raise HFImportError(f"{config_file} is not JSON ({err}): save the model again with save_pretrained.") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{config_file} holds a JSON {type(config).__name__}, not an object of model settings.")
    return config


def _name(path: tuple) -> str:
    """A parameter's name in the tensor tables, "blocks/w_q", from its tree path."""
    return "/".join(k.key for k in path)


def _current_name(name: str) -> str:
    """A tensor's name as transformers names it today: "...LayerNorm.gamma" -> "...LayerNorm.weight"."""
    for old, new in LEGACY_NAMES:
        if name.endswith(old):
            return name.removesuffix(old) + new
    return name


def params_shardings(cfg: RunConfig, mesh: str, devices: list[jax.Device] | None = None) -> Shardings:
    """The params' shardings for model `cfg.model` on layout `mesh` (no optimizer state), by its rules."""
    return place_model(cfg.model_name, cfg.model, mesh, cfg.rules, devices=devices).shardings()


def import_hf(
    directory: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    mesh: str = "fsdp=-1",
    devices: list[jax.Device] | None = None,
) -> Path:
    """Import the Hugging Face model in `directory` as a params export at `out_dir` (which must not exist),
    read onto layout `mesh` (default: every device on fsdp, so each holds 1/n of the weights) in `dtype` (default:
    the checkpoint's). Written to a temporary directory, then renamed: `out_dir` never holds half an import."""
    source = HFCheckpoint(directory)
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        raise HFImportError(f"{out_dir} already exists: an import never overwrites. Give a new directory.")
    cfg = source.run_config(dtype)
    shardings = params_shardings(cfg, mesh, devices)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(cfg.model.dtype), sharding=x.sharding),
        shardings.abstract_state["params"],
    )
    _save(source.read_params(cfg.model, abstract), cfg, source, out_dir)
    return out_dir


def _save(params: PyTree, cfg: RunConfig, source: HFCheckpoint, out_dir: Path) -> None:
    """Write the params export: Orbax's items as `jaxtrain export` writes them, config.toml, the carried files."""
    # One name for every process of a job: each writes its shards into the same directory.
    partial = out_dir.with_name(f".{out_dir.name}.importing")
    if partial.exists():
        raise HFImportError(f"{partial} exists: an interrupted import left it. Remove it and import again.")
    if jax.process_count() > 1:  # every process has looked before any writes
        multihost_utils.sync_global_devices("jaxtrain import-hf: output checked")
    meta = {"kind": "params", "step": 0, "config": config_json(cfg), "imported_from": str(source.directory)}
    # Orbax copies arrays to the host to write them, by default all at once: in batches of at most the largest
    # array (one larger than the limit goes alone), host memory holds one tensor's copy besides the model.
    largest_gb = max(x.nbytes for x in jax.tree.leaves(params)) / 1e9
    handler = ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=largest_gb)
    with ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(params=handler, meta=ocp.JsonCheckpointHandler())
    ) as checkpointer:
        checkpointer.save(
            partial,
            args=ocp.args.Composite(params=ocp.args.PyTreeSave({"params": params}), meta=ocp.args.JsonSave(meta)),
        )
    if jax.process_index() == 0:
        carry_files(source.directory, partial / CARRIED)
        (partial / "config.toml").write_text(tomli_w.dumps(config_table(cfg)))
        partial.rename(out_dir)


def carry_files(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy the files of `source` that are not weights (config.json, generation_config.json, the tokenizer's) into
    `target`, except those named in `skip`."""
    target.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name not in (INDEX_FILE, *skip):
            shutil.copy2(file, target / file.name)
