"""Safetensors checkpoint files, read a slice at a time and written a tensor at a time.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header mapping each tensor's
name to its dtype, shape and byte range, then the raw row-major bytes. A model too big for one file is split into
`model-0000i-of-0000n.safetensors` beside `model.safetensors.index.json`, whose `weight_map` names each tensor's file.

We read and write the format ourselves rather than through the `safetensors` package: its numpy reader refuses
bfloat16 (`TypeError: data type 'bfloat16' not understood`, safetensors 0.8.0), the dtype most checkpoints are in,
and its writers take every tensor of a file at once. Here a read is a slice of a memory map (only the pages of the
rows asked for are touched, so a process reads what its devices hold), and a write streams one tensor after another
behind a header computed from the shapes alone: host memory holds one tensor, never a whole file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxtrain.errors import UserInputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as the reference writer does


class TensorFileError(UserInputError):
    """A checkpoint file that is missing, truncated, or lacks a tensor the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, dtype, shape and the byte offset of its data in that file."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the safetensors file `path`, from its header alone."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as err:
        raise TensorFileError(f"{path} is not a readable safetensors file ({err}).") from err
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise TensorFileError(f"{path}: tensor {name} has dtype {entry['dtype']}; supported: {', '.join(DTYPES)}.")
        start = 8 + length + entry["data_offsets"][0]
        tensors[name] = TensorInfo(path, DTYPES[entry["dtype"]], tuple(entry["shape"]), start)
    return tensors


class TensorFiles:
    """The tensors of a checkpoint directory (one file, or shards with an index), read by name and slice."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            self.tensors.update(read_header(file))

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise TensorFileError(
                    f"{index} names {len(missing)} shard file(s) that are not in {self.directory}: "
                    f"{', '.join(missing)}. Copy the complete checkpoint (every shard the index lists)."
                )
            return [self.directory / n for n in names]
        if (self.directory / SINGLE_FILE).is_file():
            return [self.directory / SINGLE_FILE]
        raise TensorFileError(
            f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}: give a Hugging Face model directory "
            "with safetensors weights (a PyTorch .bin checkpoint must be converted with save_pretrained first)."
        )

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise TensorFileError(
                f"tensor {name} is in no file of {self.directory}: the checkpoint is incomplete or does not match "
                "its config.json."
            )
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Tensor `name`, rows and columns `index`, copied out of its file (only those pages are read)."""
        info = self.info(name)
        size = math.prod(info.shape) * info.dtype.itemsize
        # A map per read, dropped with it: the file's pages count in the process's RSS while they are mapped.
        data = np.memmap(info.file, np.uint8, mode="r")[info.offset : info.offset + size]
        if data.size != size:
            raise TensorFileError(f"{info.file} is truncated: tensor {name} ends past the end of the file.")
        return np.array(data.view(info.dtype).reshape(info.shape)[index])


@dataclass(frozen=True)
class Pending:
    """A tensor to write: its name, shape and dtype up front, its values when `produce()` is called."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_tensors(directory: Path, tensors: Sequence[Pending], max_file_bytes: int) -> list[Path]:
    """Write `tensors` into `directory` as one `model.safetensors`, or as shards of at most `max_file_bytes` each
    (a larger tensor gets a file of its own) with `model.safetensors.index.json`. Returns the files written."""
    groups = list(_shards(tensors, max_file_bytes))
    if len(groups) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        weight_map = {t.name: name for name, group in zip(names, groups) for t in group}
        total = sum(t.nbytes for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for name, group in zip(names, groups):
        _write_file(directory / name, group)
    return [directory / name for name in names]


def _shards(tensors: Sequence[Pending], max_file_bytes: int) -> Iterator[list[Pending]]:
    group, size = [], 0
    for tensor in tensors:
        if group and size + tensor.nbytes > max_file_bytes:
            yield group
            group, size = [], 0
        group.append(tensor)
        size += tensor.nbytes
    if group:
        yield group


def _write_file(path: Path, tensors: Sequence[Pending]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers reads "pt" files as PyTorch's own
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors:
            values = np.ascontiguousarray(t.produce(), dtype=t.dtype)
            if values.shape != t.shape:
                raise ValueError(f"tensor {t.name}: produced {values.shape}, announced {t.shape}")
            f.write(values.reshape(-1).view(np.uint8))  # no copy of the tensor's bytes
        f.flush()
        os.fsync(f.fileno())
