"""Safetensors checkpoint files, read a slice at a time and written a tensor at a time.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header mapping each tensor's
name to its dtype, shape and byte range, then the raw row-major bytes. A model too big for one file is split into
`model-0000i-of-0000n.safetensors` beside `model.safetensors.index.json`, whose `weight_map` names each tensor's file.

We read and write the format ourselves rather than through the `safetensors` package. Its writers take every
tensor of a file at once; its reader (safetensors 0.8.0) would do, but it is not a dependency of the library (it comes
with the hf extra), its numpy bfloat16 works only once ml_dtypes is imported, and its refusals name neither the tensor
nor the value ("invalid shape, data type, or offset for tensor"). Here a read is a slice of a memory map (only the
pages of the rows asked for are touched, so a process reads what its devices hold), and a write streams one tensor
after another behind a header computed from the shapes alone: host memory holds one tensor, never a whole file.

A header is checked by the library's own rules (`Metadata::validate`) before any tensor is read: a JSON object of
entries, each a known dtype, a shape of integers >= 0 and [start, end] byte offsets; the ranges, in order, tile the
data exactly (no overlap, no gap, none past the end, each as long as dtype x shape). A file that breaks one is refused
naming the tensor and the value, never read as wrong weights. An index may name only files inside its directory.
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
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
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
    """Every tensor of the safetensors file `path`, from its header alone, once the header is known to describe
    the file's data exactly (see the module's docstring)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                raise _corrupt(
                    path, f"the file is {size} bytes: too short for safetensors (8 bytes of header length first)"
                )
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise _corrupt(path, f"header length {length} runs past the end of the file ({size} bytes)")
            text = f.read(length)
    except OSError as err:
        raise TensorFileError(f"{path} cannot be read ({err.strerror}): check the file and its permissions.") from err
    entries = _entries(path, _header(path, text))
    _check_ranges(path, entries, size - 8 - length)
    return {
        name: TensorInfo(path, DTYPES[e["dtype"]], tuple(e["shape"]), 8 + length + e["data_offsets"][0])
        for name, e in entries
    }


def _corrupt(path: Path, what: str) -> TensorFileError:
    return TensorFileError(f"{path}: {what}. The file is damaged or not safetensors: download or save it again.")


def _header(path: Path, text: bytes) -> dict:
    """The header's JSON object, its `__metadata__` (a string table) checked and removed."""
    try:
        header = json.loads(text.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError both
        raise _corrupt(path, f"the header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"the header is a {type(header).__name__}, not a JSON object of tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, f"__metadata__ {metadata!r}: expected strings by name")
    return header


def _entries(path: Path, header: dict) -> list[tuple[str, dict]]:
    """The header's tensor entries, each with a known dtype, a shape and two offsets, in the order of their data."""
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _corrupt(path, f"tensor {name}: header entry {entry!r} is not an object (dtype, shape, data_offsets)")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise _corrupt(path, f"tensor {name}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not _naturals(shape):
            raise _corrupt(path, f"tensor {name}: shape {shape!r}: expected a list of integers >= 0")
        if not (_naturals(offsets) and len(offsets) == 2):
            raise _corrupt(path, f"tensor {name}: data_offsets {offsets!r}: expected [start, end], integers >= 0")
    return sorted(header.items(), key=lambda item: item[1]["data_offsets"])


def _naturals(value: object) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _check_ranges(path: Path, entries: list[tuple[str, dict]], data_bytes: int) -> None:
    """The entries' byte ranges, in order, tile the `data_bytes` after the header: each starts where the one before
    ends, holds its dtype x shape, and the last ends at the end of the file."""
    end, before = 0, None
    for name, entry in entries:
        start, stop = offsets = entry["data_offsets"]
        what = f"tensor {name}: data_offsets {offsets}"
        if stop > data_bytes:
            raise _corrupt(path, f"{what} end past the {data_bytes} bytes of data the file holds (is it truncated?)")
        if start < end:
            raise _corrupt(path, f"{what} overlap tensor {before[0]} at {before[1]['data_offsets']}")
        if start > end:
            raise _corrupt(path, f"{what} leave bytes {end}..{start} of the data unused")
        nbytes = math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize
        if stop - start != nbytes:
            raise _corrupt(
                path, f"{what} hold {stop - start} bytes, but {entry['dtype']} x shape {entry['shape']} takes {nbytes}"
            )
        end, before = stop, (name, entry)
    if end != data_bytes:
        raise _corrupt(path, f"{data_bytes - end} bytes after the last tensor's data: the header does not cover them")


class TensorFiles:
    """The tensors of a checkpoint directory (one file, or shards with an index), read by name and slice."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise TensorFileError(
                        f"tensor {name} is in both {self.tensors[name].file} and {file}: a checkpoint holds each "
                        "tensor once. Remove the file that does not belong, or download the checkpoint again."
                    )
                self.tensors[name] = info

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            names = sorted(set(_weight_map(index).values()))
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise TensorFileError(
                    f"{index} names {len(missing)} shard file(s) that are not in {self.directory}: "
                    f"{', '.join(missing)}. Copy the complete checkpoint (every shard the index lists)."
                )
            return [_inside(self.directory, name, f"{index}: weight_map names {name!r}") for name in names]
        if (self.directory / SINGLE_FILE).is_file():
            return [_inside(self.directory, SINGLE_FILE, str(self.directory / SINGLE_FILE))]
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
        return np.array(data.view(info.dtype).reshape(info.shape)[index])


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> file table, checked to be one."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as err:  # not UTF-8, not JSON, or JSON but not an object
        raise TensorFileError(f"{index} is not JSON ({err}): {INDEX_FILE} is an object with a weight_map.") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise TensorFileError(
            f"{index} has no weight_map (tensor name -> file name): save the checkpoint again, or remove the index "
            f"if {SINGLE_FILE} holds every tensor."
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise TensorFileError(
                f"{index}: weight_map[{name!r}] is {file!r}, not a file name: fix or replace the index."
            )
    return weight_map


def _inside(directory: Path, name: str, named_by: str) -> Path:
    """`directory / name`, once it is known to lie inside `directory` after links are followed: an index cannot
    send a read to another model's weights, or any other file. In a Hugging Face cache snapshot (`.../snapshots/REV`)
    every file is a link into the repository's `blobs/`, which counts as inside."""
    root = directory.resolve()
    roots = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    path = directory / name
    target = path.resolve()
    if not any(target.is_relative_to(r) for r in roots):
        via = f", a link to {target}" if path.is_symlink() else ""
        raise TensorFileError(
            f"{named_by}{via}, which lies outside {directory}: a checkpoint's weights must be files in its directory. "
            "Copy the file into it (and name it there)."
        )
    return path


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


def write_tensors(
    directory: Path, tensors: Sequence[Pending], max_file_bytes: int, single: str = SINGLE_FILE
) -> list[Path]:
    """Write `tensors` into `directory` as one file `single` (`model.safetensors`), or as shards of at most
    `max_file_bytes` each (a larger tensor gets a file of its own) with `model.safetensors.index.json`. Returns the
    files written."""
    groups = list(_shards(tensors, max_file_bytes))
    if len(groups) == 1:
        names = [single]
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
