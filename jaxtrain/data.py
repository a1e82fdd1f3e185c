"""Datasets and the global batch.

Every batch is a pure function of (seed, split, step, row): row r of step s is global sample s * B + r. Nothing
depends on the device or process count, so a run can start at any step (resume) on any topology. Each process
builds only the rows its devices hold and `jax.make_array_from_process_local_data` assembles the global array.

Sources: `builtin` (Python standard-library source text, which ships with every Python: no download),
`synthetic` (uniform random tokens, for benchmarks), a UTF-8/byte text file path (byte-level tokens), and
`digits` (8x8 handwritten digits CSV, for classifiers).
"""

from __future__ import annotations

import gzip
import sysconfig
from pathlib import Path
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.errors import UserInputError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"
BUILTIN_TEXT_BYTES = 2_000_000
SPLITS = {"train": 0, "val": 1}


class DataError(UserInputError):
    """A data source that is missing, malformed or wrong for the model."""


class Dataset(Protocol):
    task: str

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]: ...

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]: ...


def _row_rng(seed: int, split: str, step: int, row: int) -> np.random.Generator:
    return np.random.default_rng((seed, SPLITS[split], step, row))


class ByteText:
    """Byte-level language modelling: random windows of `seq_len + 1` bytes; the last `val_fraction` held out."""

    task = "lm"

    def __init__(self, data: bytes, seq_len: int, seed: int, val_fraction: float = 0.1, name: str = "text"):
        tokens = np.frombuffer(data, dtype=np.uint8)
        split_at = int(len(tokens) * (1 - val_fraction))
        self.splits = {"train": tokens[:split_at], "val": tokens[split_at:]}
        for split, part in self.splits.items():
            if len(part) <= seq_len + 1:
                raise DataError(
                    f"{name}: the {split} split has {len(part)} bytes, fewer than seq_len + 1 = {seq_len + 1}."
                )
        self.seq_len, self.seed, self.name = seq_len, seed, name

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), np.int32)}

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        tokens = self.splits[split]
        width = self.seq_len + 1
        starts = [_row_rng(self.seed, split, step, r).integers(0, len(tokens) - width) for r in rows]
        return {"tokens": np.stack([tokens[s : s + width] for s in starts]).astype(np.int32)}


class SyntheticTokens:
    """Uniform random tokens: nothing to learn, for measuring speed."""

    task = "lm"

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), np.int32)}

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        width = self.seq_len + 1
        return {
            "tokens": np.stack(
                [_row_rng(self.seed, split, step, r).integers(0, self.vocab_size, width) for r in rows]
            ).astype(np.int32)
        }


class Digits:
    """8x8 digit images (64 features scaled to [0, 1]) and labels; a fixed seeded 80/20 train/test split.

    Training visits examples in a fresh permutation every epoch: global sample g of the run is example
    perm_epoch[g mod N] with epoch = g div N. Validation walks the test split in order.
    """

    task = "classification"

    def __init__(self, path: Path, seed: int, test_fraction: float = 0.2):
        table = load_digits_csv(path)
        order = np.random.default_rng(1234).permutation(len(table))  # the split is fixed, whatever the run's seed
        n_test = int(len(table) * test_fraction)
        features, labels = table[:, :64].astype(np.float32) / 16.0, table[:, 64].astype(np.int32)
        self.splits = {
            "train": (features[order[n_test:]], labels[order[n_test:]]),
            "val": (features[order[:n_test]], labels[order[:n_test]]),
        }
        self.seed = seed

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, 64), np.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), np.int32),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        features, labels = self.splits[split]
        n = len(labels)
        samples = np.array([step * batch_size + r for r in rows])
        if split == "val":
            index = samples % n
        else:
            index = np.empty(len(samples), dtype=np.int64)
            for epoch in np.unique(samples // n):
                perm = np.random.default_rng((self.seed, int(epoch))).permutation(n)
                hit = samples // n == epoch
                index[hit] = perm[samples[hit] % n]
        return {"x": features[index], "y": labels[index]}


def load_digits_csv(path: Path) -> np.ndarray:
    """The digits table: one row per image, 64 pixel values 0..16 then the label 0..9."""
    if not Path(path).is_file():
        raise DataError(
            f"digits data not found at '{path}'. Pass data.source=/path/to/digits.csv.gz (65 integer columns a row)."
        )
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 65:
        raise DataError(f"'{path}': expected 65 comma-separated integer columns a row, got shape {table.shape}.")
    return table


def builtin_text() -> bytes:
    """About 2 MB of Python standard-library source: real, structured text that ships with Python itself."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= BUILTIN_TEXT_BYTES:
            break
    return b"\n".join(chunks)[:BUILTIN_TEXT_BYTES]


def make_dataset(
    source: str, task: str, *, seq_len: int, seed: int, vocab_size: int = 256, val_fraction: float = 0.1
) -> Dataset:
    """The dataset named by `source` for a model of kind `task` ("lm" or "classification")."""
    if source == "digits" or source.endswith((".csv", ".csv.gz")):
        dataset: Dataset = Digits(SHARED_DATA / "digits.csv.gz" if source == "digits" else Path(source), seed)
    elif source == "synthetic":
        dataset = SyntheticTokens(vocab_size, seq_len, seed)
    elif source == "builtin":
        dataset = ByteText(builtin_text(), seq_len, seed, val_fraction, name="builtin text")
    else:
        path = Path(source)
        if not path.is_file():
            raise DataError(
                f"data file '{source}' does not exist. "
                "Use a path to a text file, or one of: builtin, synthetic, digits."
            )
        dataset = ByteText(path.read_bytes(), seq_len, seed, val_fraction, name=str(path))
    if dataset.task != task:
        raise DataError(f"data source '{source}' is for {dataset.task} models, but this model needs {task} data.")
    if task == "lm" and vocab_size < 256 and not isinstance(dataset, SyntheticTokens):
        raise DataError(f"byte-level text needs vocab_size >= 256, the model has {vocab_size}.")
    return dataset


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous range of global batch rows that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    return range(min(starts), max(stops))


def global_batch(
    dataset: Dataset, split: str, step: int, batch_size: int, shardings: dict[str, NamedSharding]
) -> dict[str, jax.Array]:
    """Batch `step` of `split`, as global arrays sharded by `shardings`, built from this process's rows only."""
    shapes = dataset.shapes(batch_size)
    rows = local_rows(next(iter(shardings.values())), shapes[next(iter(shapes))].shape)
    local = dataset.rows(split, step, rows, batch_size)
    return {k: jax.make_array_from_process_local_data(shardings[k], local[k], shapes[k].shape) for k in shapes}
