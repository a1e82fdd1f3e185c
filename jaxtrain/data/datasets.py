"""Datasets and the global batch.

Every batch is a pure function of (seed, split, step, row): row r of step s is global sample s * B + r (labelled
data can instead be partitioned over replicas, see `Digits`). Nothing depends on the device or process count, so a
run can start at any step (resume) on any topology. Each process builds only the rows its devices hold and
`jax.make_array_from_process_local_data` assembles the global array.

Sources: `builtin` (Python standard-library source text, which ships with every Python: no download),
`synthetic` (random data of the model's shapes, for benchmarks and planning: uniform tokens for language models,
features in [0, 1) and labels for classifiers, the click logs for recommenders), a UTF-8/byte text file path
(byte-level tokens), and
`digits` (8x8 handwritten digits CSV, for classifiers), `clicks` (synthetic click logs with a known rule, for
recommenders: `jaxtrain.data.clicks`). Encoders: masked-language-model rows over any of the token sources
(`jaxtrain.data.masking`), and text classification from JSON lines or a generated task
(`jaxtrain.data.text_classes`).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import math
import os
import sysconfig
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.data.clicks import Clicks
from jaxtrain.data.masking import (
    MaskedTokens,
    MaskOptions,
    byte_vocab,
    check_byte_vocab,
    synthetic_vocab,
    tokenizer_vocab,
)
from jaxtrain.data.splits import row_rng
from jaxtrain.data.text_classes import TextOptions, text_classes
from jaxtrain.data.tokenizer import padded_vocab
from jaxtrain.data.tokens import TokenData, token_sources, tokenizer_of
from jaxtrain.errors import UserInputError
from jaxtrain.files import read_bytes, utf8_text
from jaxtrain.registry import SEQUENCE_TASKS, TASKS

SOURCES = ("builtin", "synthetic", "digits", "clicks")  # data sources by name; any other source is a file path
# Where a named data file (`digits`: digits.csv.gz) is looked for. The library ships no data files and knows no
# checkout layout; the project's scripts and tests point this at ../shared/data when it is there.
DATA_DIR_ENV = "JAXTRAIN_DATA_DIR"
BUILTIN_TEXT_BYTES = 2_000_000
# How labelled training data is split over replicas (see `Digits`). Only uniform suits unlabelled data.
PARTITIONS = ("uniform", "stratified", "by_label")
# The digits CSV: 64 pixels of an 8x8 image, values 0..16, then the label.
DIGIT_PIXELS, DIGIT_MAX_PIXEL, DIGIT_CLASSES = 64, 16, 10
DIGIT_COLUMNS = DIGIT_PIXELS + 1
DIGIT_FORMAT = (
    f"{DIGIT_COLUMNS} comma-separated integers a line: {DIGIT_PIXELS} pixel values 0..{DIGIT_MAX_PIXEL}, "
    f"then the label 0..{DIGIT_CLASSES - 1}"
)
# Tags that give each partition its own random streams, apart from uniform's (seed, epoch).
_STRATIFIED, _BY_LABEL = 1, 2


class DataError(UserInputError):
    """A data source that is missing, malformed or wrong for the model."""


class Dataset(Protocol):
    task: str

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]: ...

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]: ...


def check_partition(partition: str, replicas: int) -> None:
    """Raise a `DataError` for an unknown partition name or a replica count below 1."""
    if partition not in PARTITIONS:
        raise DataError(f"unknown data partition '{partition}'. Use one of: {', '.join(PARTITIONS)}.")
    if replicas < 1:
        raise DataError(f"the data needs at least 1 replica to partition over, got {replicas}.")


def _stratified_order(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random order of all examples with every class spread evenly through it.

    The i-th of class c's n_c examples (in random order) gets the key (i + u) / n_c, u uniform in [0, 1): one key
    in each interval [i / n_c, (i + 1) / n_c), so any L consecutive examples of the order hold L * n_c / N of class
    c, give or take about 2.
    """
    shuffled = rng.permutation(len(labels))
    key = np.empty(len(labels))
    for c in np.unique(labels):
        members = shuffled[labels[shuffled] == c]
        key[members] = (np.arange(len(members)) + rng.random(len(members))) / len(members)
    return np.argsort(key, kind="stable")


def _by_label_classes(classes: np.ndarray, replicas: int) -> list[np.ndarray]:
    """by_label's class sets: replica k gets the m = ceil(C / replicas) classes k * m, ..., k * m + m - 1 (mod C)."""
    m = -(-len(classes) // replicas)
    return [classes[(k * m + np.arange(m)) % len(classes)] for k in range(replicas)]


class TokenWindows:
    """Windows of `seq_len + 1` consecutive tokens of a 1-D array of token ids, the last `val_fraction` of which is
    held out for validation: each row's window starts where (seed, split, step, row) says. Your own token ids in
    memory (a tokenized text, a numpy array) as a language-model dataset: pass it to `jaxtrain.train(cfg,
    dataset=...)`.

    >>> data = TokenWindows(np.arange(1000) % 50, seq_len=16, seed=0, vocab_size=64)
    >>> data.rows("train", 0, range(2), 2)["tokens"].shape
    (2, 17)
    """

    task = "lm"

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.1,
        name: str = "token array",
        vocab_size: int | None = None,
        unit: str = "tokens",
    ):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"{name}: expected a 1-D array of integer token ids, got {tokens.dtype} of shape {tokens.shape}: "
                "concatenate the documents' ids (np.concatenate) into one integer array."
            )
        if not len(tokens):
            raise DataError(f"{name} is empty: a language model needs text to train on.")
        if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise DataError(
                f"{name} holds token ids {int(tokens.min())}..{int(tokens.max())}, but the model's vocab_size is "
                f"{vocab_size}: use a model with vocab_size > {int(tokens.max())}, or map the ids into "
                f"0..{vocab_size - 1}."
            )
        split_at = int(len(tokens) * (1 - val_fraction))
        self.splits = {"train": tokens[:split_at], "val": tokens[split_at:]}
        for split, part in self.splits.items():
            if len(part) <= seq_len + 1:  # a window is seq_len + 1 tokens, and must have somewhere to start
                need = math.ceil((seq_len + 2) / min(val_fraction, 1 - val_fraction)) + 1
                raise DataError(
                    f"{name} is too short for data.seq_len={seq_len}: of its {len(tokens)} {unit}, the {split} split "
                    f"(data.val_fraction={val_fraction:g}) has {len(part)}, and a window needs seq_len + 2 = "
                    f"{seq_len + 2}. Use a shorter seq_len or at least {need} {unit}."
                )
        self.seq_len, self.seed, self.name = seq_len, seed, name
        self.largest_id = int(tokens.max())

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), np.int32)}

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        tokens = self.splits[split]
        width = self.seq_len + 1
        starts = [row_rng(self.seed, split, step, r).integers(0, len(tokens) - width) for r in rows]
        return {"tokens": np.stack([tokens[s : s + width] for s in starts]).astype(np.int32)}


def byte_text(data: bytes, seq_len: int, seed: int, val_fraction: float = 0.1, name: str = "text") -> TokenWindows:
    """Text as byte-level tokens (one token per byte, vocabulary 256)."""
    tokens = np.frombuffer(data, dtype=np.uint8)
    return TokenWindows(tokens, seq_len, seed, val_fraction, name=name, unit="bytes")


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
                [row_rng(self.seed, split, step, r).integers(0, self.vocab_size, width) for r in rows]
            ).astype(np.int32)
        }


class SyntheticFeatures:
    """Uniform random features in [0, 1) (e.g. flattened images) and uniform labels: nothing to learn, for measuring
    speed at a model's real input width (224x224x3 for resnet-50) without its data."""

    task = "classification"

    def __init__(self, features: int, classes: int, seed: int):
        self.features, self.classes, self.seed = features, classes, seed

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.features), np.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), np.int32),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        rngs = [row_rng(self.seed, split, step, r) for r in rows]
        return {
            "x": np.stack([rng.random(self.features, dtype=np.float32) for rng in rngs]),
            "y": np.array([rng.integers(0, self.classes) for rng in rngs], dtype=np.int32),
        }


class Digits:
    """8x8 digit images (64 features scaled to [0, 1]) and labels; a fixed seeded 80/20 train/test split.

    Validation walks the test split in order. Training data is split over `replicas` replicas by `partition`: row r
    of a batch of B rows belongs to replica r div (B / replicas), the block of rows the `replica` mesh axis holds.
    Each stream below visits its examples in a fresh order every epoch: its sample g is the (g mod n)-th example of
    epoch g div n's order, n being the stream's size.

    - uniform: one stream, all N examples in random order; row r of step s is its sample s * B + r.
    - stratified: a stream per replica, replica k's j-th row of step s being its sample s * B / replicas + j. Each
      epoch's order of all examples is stratified (every class spread evenly, see `_stratified_order`), and replica
      k takes the k-th of `replicas` equal contiguous pieces of it: replicas see disjoint data, each with the global
      class mix over any run of steps.
    - by_label (non-IID, the federated setting): a stream per replica, as for stratified, but replica k sees only
      the m = ceil(C / replicas) classes k * m, ..., k * m + m - 1 (mod C), in random order: the fewest classes per
      replica that still cover every class between them. With 10 classes and 8 replicas each sees 2 classes and
      replicas 5-7 repeat classes 0-5 (each in its own order); with one replica there is nothing to skew.
    """

    task = "classification"

    def __init__(
        self, path: Path, seed: int, test_fraction: float = 0.2, partition: str = "uniform", replicas: int = 1
    ):
        check_partition(partition, replicas)
        table = load_digits_csv(path)
        order = np.random.default_rng(1234).permutation(len(table))  # the split is fixed, whatever the run's seed
        n_test = int(len(table) * test_fraction)
        features, labels = table[:, :64].astype(np.float32) / 16.0, table[:, 64].astype(np.int32)
        self.splits = {
            "train": (features[order[n_test:]], labels[order[n_test:]]),
            "val": (features[order[:n_test]], labels[order[:n_test]]),
        }
        self.seed, self.partition, self.replicas = seed, partition, replicas
        train_labels = self.splits["train"][1]
        n = len(train_labels)
        if partition == "stratified":
            if n < replicas:
                raise DataError(f"'{path}': {n} training examples cannot be split over {replicas} replicas.")
            # No fixed examples per stream: every epoch's stratified order is cut into `replicas` equal pieces.
            self._stream_sizes = [n // replicas] * replicas
            # A memo, not state: every stream of a batch cuts the same order, and a batch seldom spans over 2 epochs.
            self._stratified_epoch_cached = functools.lru_cache(maxsize=2)(self._stratified_epoch)
        else:
            # Each stream's examples: all of them (uniform), or those of the replica's classes (by_label).
            if partition == "uniform":
                self._pools = [np.arange(n)]
            else:
                classes = _by_label_classes(np.unique(train_labels), replicas)
                self._pools = [np.flatnonzero(np.isin(train_labels, c)) for c in classes]
            self._stream_sizes = [len(pool) for pool in self._pools]

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        self._check_batch_size(batch_size)
        return {
            "x": jax.ShapeDtypeStruct((batch_size, 64), np.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), np.int32),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        self._check_batch_size(batch_size)
        features, labels = self.splits[split]
        row_ids = np.array(rows, dtype=np.int64)
        if split == "val":
            index = (step * batch_size + row_ids) % len(labels)
        else:
            index = self._train_index(step, row_ids, batch_size)
        return {"x": features[index], "y": labels[index]}

    def _check_batch_size(self, batch_size: int) -> None:
        if batch_size % self.replicas:
            raise DataError(
                f"batch size {batch_size} does not split evenly over {self.replicas} replicas "
                f"(data.partition={self.partition}). Use a batch size that is a multiple of {self.replicas}."
            )

    def _train_index(self, step: int, rows: np.ndarray, batch_size: int) -> np.ndarray:
        """The training examples of `rows` of batch `step`. With b rows a stream per batch, row r is sample
        step * b + (r mod b) of stream r div b."""
        per_stream = batch_size // len(self._stream_sizes)
        streams, samples = rows // per_stream, step * per_stream + rows % per_stream
        index = np.empty(len(rows), dtype=np.int64)
        for stream in np.unique(streams):
            mine = streams == stream
            index[mine] = self._walk(int(stream), samples[mine])
        return index

    def _walk(self, stream: int, samples: np.ndarray) -> np.ndarray:
        """Sample g of `stream` is the (g mod n)-th example of epoch g div n's order, n the stream's size."""
        size = self._stream_sizes[stream]
        index = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(samples // size):
            hit = samples // size == epoch
            index[hit] = self._epoch_order(stream, int(epoch))[samples[hit] % size]
        return index

    def _epoch_order(self, stream: int, epoch: int) -> np.ndarray:
        """The training examples `stream` visits in `epoch`, in order."""
        if self.partition == "stratified":
            size = self._stream_sizes[stream]
            return self._stratified_epoch_cached(epoch)[stream * size : (stream + 1) * size]
        pool = self._pools[stream]
        # Uniform keeps the (seed, epoch) stream it has always had, so earlier runs resume unchanged.
        key = (self.seed, epoch) if self.partition == "uniform" else (self.seed, _BY_LABEL, stream, epoch)
        return pool[np.random.default_rng(key).permutation(len(pool))]

    def _stratified_epoch(self, epoch: int) -> np.ndarray:
        """All training examples in `epoch`'s stratified order."""
        return _stratified_order(self.splits["train"][1], np.random.default_rng((self.seed, _STRATIFIED, epoch)))


def load_digits_csv(path: Path) -> np.ndarray:
    """The digits table: one row per image, 64 pixel values 0..16 then the label 0..9. A file that is not such a
    table is a DataError naming the file, and the line and column of the first bad value."""
    lines = _digit_lines(Path(path))
    try:  # numpy parses; only a file it refuses, or a value out of range, is read again line by line to say where
        table = np.loadtxt([text for _, text in lines], delimiter=",", dtype=np.int64, comments=None, ndmin=2)
    except ValueError:
        table = None
    if table is None or table.shape[1] != DIGIT_COLUMNS or not _in_digit_ranges(table).all():
        for number, text in lines:
            _check_digit_line(path, number, text)
        raise DataError(f"'{path}': not a digits table ({DIGIT_FORMAT}).")  # each line alone was fine
    return table


def _digit_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered non-blank lines of a digits CSV (gzip if it ends .gz)."""
    missing = f"digits data not found at '{path}'. Pass data.source=/path/to/digits.csv.gz ({DIGIT_FORMAT})."
    raw = read_bytes(path, "digits data", DataError, missing)
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError; a truncated file, an EOFError
            raise DataError(
                f"'{path}' is not a readable gzip file ({err}); decompress it, or rename it without .gz."
            ) from None
    text = utf8_text(raw, path, "digits data", DataError)
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise DataError(f"'{path}' is empty: expected {DIGIT_FORMAT}.")
    return lines


def _in_digit_ranges(table: np.ndarray) -> np.ndarray:
    pixels, labels = table[:, :DIGIT_PIXELS], table[:, DIGIT_PIXELS]
    pixels_ok = ((pixels >= 0) & (pixels <= DIGIT_MAX_PIXEL)).all(axis=1)
    return pixels_ok & (labels >= 0) & (labels < DIGIT_CLASSES)


def _check_digit_line(path: Path, number: int, text: str) -> None:
    """Raise a DataError naming the first value of line `number` that a digits table cannot hold."""
    where = f"'{path}' line {number}"
    cells = text.split(",")
    if len(cells) != DIGIT_COLUMNS:
        raise DataError(f"{where} has {len(cells)} values; expected {DIGIT_FORMAT}.")
    for column, cell in enumerate(cells, 1):
        try:
            value = int(cell)
        except ValueError:
            raise DataError(
                f"{where}, column {column}: {cell.strip()!r} is not an integer; expected {DIGIT_FORMAT}."
            ) from None
        if column <= DIGIT_PIXELS and not 0 <= value <= DIGIT_MAX_PIXEL:
            raise DataError(f"{where}, column {column}: pixel value {value} is outside 0..{DIGIT_MAX_PIXEL}.")
        if column == DIGIT_COLUMNS and not 0 <= value < DIGIT_CLASSES:
            raise DataError(f"{where}, column {column}: label {value} is not a digit 0..{DIGIT_CLASSES - 1}.")


def read_text_file(path: Path) -> bytes:
    """The UTF-8 bytes of a text file to train on. A file that is not UTF-8 (a binary, a compressed file) would
    train a byte-level model on noise without a word: it is refused, naming the first byte that is not."""
    missing = f"data file '{path}' does not exist. Use a path to a text file, or one of: {', '.join(SOURCES)}."
    raw = read_bytes(path, "data file", DataError, missing)
    utf8_text(raw, path, "data file", DataError)
    return raw


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


@dataclasses.dataclass(frozen=True)
class TokenOptions:
    """Where tokenized data is and how it is read (the `data.*` keys of the same names)."""

    path: str = ""
    mixture: str = ""
    packing: str = "concat"
    prefetch: int = 0


def model_data_args(model_cfg: object) -> dict[str, int]:
    """What `make_dataset` needs to know of a model's inputs (the config fields a model has, else defaults)."""
    return {
        "vocab_size": getattr(model_cfg, "vocab_size", 256),
        "features": getattr(model_cfg, "in_features", 64),
        "classes": getattr(model_cfg, "n_classes", 10),
    }


def make_dataset(
    source: str,
    task: str,
    *,
    seq_len: int,
    seed: int,
    vocab_size: int = 256,
    features: int = 64,
    classes: int = 10,
    val_fraction: float = 0.1,
    partition: str = "uniform",
    replicas: int = 1,
    tokens: TokenOptions | None = None,
    masking: MaskOptions | None = None,
    text: TextOptions | None = None,
) -> Dataset:
    """The dataset named by `source` for a model of kind `task` (a registry task: "lm", "classification", "clicks",
    "mlm", "text_classification").

    `synthetic` is random data of the model's shapes: `vocab_size` tokens of `seq_len`, or `features` inputs and
    `classes` labels. `partition` (one of PARTITIONS) splits labelled training data over `replicas` replicas, see
    `Digits`. `tokens` says where tokenized data is and how to read it (`source` tokens, or tokens:DIR); `masking`
    how an MLM's positions are chosen; `text` where text classification's texts and labels are.
    """
    check_partition(partition, replicas)
    if task == "custom":
        raise DataError(
            f"data source '{source}': this model's task is 'custom', data that no source makes: pass the run its "
            "dataset, jaxtrain.build(cfg, dataset=...) or jaxtrain.train(cfg, dataset=...), or use the application "
            "that brings it."
        )
    tokens = tokens or TokenOptions()
    token_dirs = token_sources(source, tokens.path, tokens.mixture)
    if task == "mlm":
        lm_args = {"seq_len": seq_len, "seed": seed, "vocab_size": vocab_size, "val_fraction": val_fraction}
        dataset: Dataset = _masked(source, token_dirs is not None, masking or MaskOptions(), tokens, **lm_args)
    elif task == "text_classification":
        sizes = {"seq_len": seq_len, "seed": seed, "vocab_size": vocab_size, "n_classes": classes}
        dataset = _text_classes(
            source, token_dirs is not None, text or TextOptions(), **sizes, val_fraction=val_fraction
        )
    elif token_dirs is not None:
        dataset = _token_data(token_dirs, seq_len, seed, tokens, vocab_size)
    elif source == "digits" or source.endswith((".csv", ".csv.gz")):
        path = named_data_file("digits.csv.gz") if source == "digits" else Path(source)
        dataset = Digits(path, seed, partition=partition, replicas=replicas)
    elif source == "synthetic" and task == "classification":
        dataset = SyntheticFeatures(features, classes, seed)
    elif source == "synthetic" and task == "lm":
        dataset = SyntheticTokens(vocab_size, seq_len, seed)
    elif source in ("clicks", "synthetic"):
        dataset = Clicks(vocab_size, seed)  # a recommender's vocab_size: the ids per field
    elif source == "builtin":
        dataset = byte_text(builtin_text(), seq_len, seed, val_fraction, name="builtin text")
    else:
        dataset = byte_text(read_text_file(Path(source)), seq_len, seed, val_fraction, name=f"'{source}'")
    _check_made(dataset, source, task, vocab_size, features, classes, partition)
    return dataset


def _check_made(
    dataset: Dataset, source: str, task: str, vocab_size: int, features: int, classes: int, partition: str
) -> None:
    """The dataset `source` named fits a model of kind `task` with these inputs and the data partition."""
    if dataset.task != task:
        raise DataError(f"data source '{source}' is for {dataset.task} models, but this model needs {task} data.")
    if isinstance(dataset, Digits) and (features != DIGIT_PIXELS or classes < DIGIT_CLASSES):
        raise DataError(
            f"data source '{source}' holds images of {DIGIT_PIXELS} pixels with labels 0..{DIGIT_CLASSES - 1}, but "
            f"the model takes {features} features and {classes} classes: use a model with in_features="
            f"{DIGIT_PIXELS} and n_classes >= {DIGIT_CLASSES} (e.g. --model mlp)."
        )
    if partition != "uniform" and not isinstance(dataset, Digits):
        raise DataError(
            f"data.partition={partition} splits data by class label, so it needs labelled data (digits); "
            f"'{source}' has no class labels to split by. Use data.partition=uniform."
        )
    if task == "lm" and vocab_size < 256 and isinstance(dataset, TokenWindows):
        raise DataError(f"byte-level text needs vocab_size >= 256, the model has {vocab_size}.")


def _masked(
    source: str,
    tokenized: bool,
    masking: MaskOptions,
    tokens: TokenOptions,
    *,
    seq_len: int,
    seed: int,
    vocab_size: int,
    val_fraction: float,
) -> MaskedTokens:
    """MLM rows over the language-model source `source` names: synthetic ids under a mask id of their own, tokenized
    shards in their tokenizer's vocabulary, or byte-level text."""
    lm_args = {"seq_len": seq_len, "seed": seed, "vocab_size": vocab_size}
    if source == "synthetic":  # the last id is the mask, so no random token is one
        text, vocab = SyntheticTokens(vocab_size - 1, seq_len, seed), synthetic_vocab(vocab_size)
    elif tokenized:
        text = make_dataset(source, "lm", tokens=tokens, **lm_args)
        vocab = tokenizer_vocab(tokenizer_of(Path(text.names[0])).path)
    else:
        check_byte_vocab(vocab_size, "a masked language model")
        text, vocab = make_dataset(source, "lm", val_fraction=val_fraction, **lm_args), byte_vocab()
    return MaskedTokens(text, vocab, seq_len, seed, masking.rate, masking.whole_words)


def _text_classes(source: str, tokenized: bool, text: TextOptions, **args: Any) -> Dataset:
    """Text classification from the JSON-lines file `source` names, the generated task (builtin) or random ids
    (`args`: `text_classes`'s)."""
    if source in ("digits", "clicks") or tokenized:
        raise DataError(
            f"data source '{source}' holds no labelled texts: text classification reads JSON lines "
            "(data.source=FILE.jsonl, with data.text_field and data.label_field), or data.source=builtin (a "
            "generated task) or synthetic."
        )
    return text_classes(source, text, **args)


def _token_data(
    directories: list[tuple[Path, float]], seq_len: int, seed: int, tokens: TokenOptions, vocab_size: int
) -> TokenData:
    """Tokenized data, for a model of `vocab_size` tokens: enough for every id of its tokenizer."""
    dataset = TokenData(directories, seq_len, seed, tokens.packing, tokens.prefetch)
    if dataset.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer of {', '.join(dataset.names)} has {dataset.vocab_size} tokens, but the model's "
            f"vocab_size is {vocab_size}: drop the vocab_size override (it then comes from the tokenizer, "
            f"padded to {padded_vocab(dataset.vocab_size)}) or set vocab_size >= {dataset.vocab_size}."
        )
    return dataset


def check_dataset(dataset: object, task: str, seq_len: int, batch_size: int, vocab_size: int) -> Dataset:
    """`dataset`, one a caller brought (`jaxtrain.train(cfg, dataset=...)`), if it fits a model of kind `task`: it
    has the `Dataset` protocol's `task`, `shapes` and `rows`, the model's task, and for a model of sequences rows of
    `seq_len + 1` tokens (a decoder's) or `seq_len` (an encoder's), and where it says, ids under `vocab_size`. Else a
    `DataError` saying what to change."""
    missing = [name for name in ("task", "shapes", "rows") if not hasattr(dataset, name)]
    if missing:
        raise DataError(
            f"dataset {type(dataset).__name__} has no {', '.join(missing)}: a dataset has a `task` (one of "
            f"{', '.join(TASKS)}), `shapes(batch_size)` and `rows(split, step, rows, batch_size)` "
            "(jaxtrain.data.datasets.Dataset; e.g. TokenWindows for token ids in memory)."
        )
    if dataset.task != task:
        raise DataError(
            f"dataset {type(dataset).__name__} is for {dataset.task} models, but this model needs {task} data."
        )
    shapes = dataset.shapes(batch_size)
    if task in SEQUENCE_TASKS:
        pairs = "pair_tokens" in shapes  # preference pairs (jaxtrain.data.pairs): two rows of tokens an example
        width = getattr(shapes.get("pair_tokens" if pairs else "tokens"), "shape", None)
        next_token = task == "lm"  # a decoder's rows hold one token more than it reads: the last one's target
        expected = (batch_size, *(2,) * pairs, seq_len + next_token)
        if width != expected:
            raise DataError(
                f"dataset {type(dataset).__name__} gives tokens of shape {width}, but this run's batch is "
                f"{expected} (batch_size, {'2, ' if pairs else ''}seq_len{' + 1' * next_token}): build the dataset "
                f"with seq_len={seq_len}, or set the run's seq_len to the dataset's."
            )
        largest = getattr(dataset, "largest_id", None)
        if largest is not None and largest >= vocab_size:
            raise DataError(
                f"dataset {type(dataset).__name__} holds token id {largest}, but the model's vocab_size is "
                f"{vocab_size}: use a model with vocab_size > {largest}."
            )
    return dataset


def named_data_file(name: str) -> Path:
    """The file `name` in the directory `$JAXTRAIN_DATA_DIR` names."""
    folder = os.environ.get(DATA_DIR_ENV)
    if not folder:
        raise DataError(
            f"data source '{name.split('.')[0]}' is the file {name} in the folder ${DATA_DIR_ENV} names, and "
            f"{DATA_DIR_ENV} is not set: set it to the folder that holds {name}, or give the file's path as "
            "data.source=PATH."
        )
    return Path(folder) / name


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous range of global batch rows that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    return range(min(starts), max(stops))


def placed_batch(batch: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """A whole batch every process holds (host arrays) as global arrays laid out by `shardings`: each device takes
    its own slice, nothing is sent."""
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda index, v=v: v[index]) for k, v in batch.items()
    }


def global_batch(
    dataset: Dataset, split: str, step: int, batch_size: int, shardings: dict[str, NamedSharding]
) -> dict[str, jax.Array]:
    """Batch `step` of `split`, as global arrays sharded by `shardings`, built from this process's rows only."""
    shapes = dataset.shapes(batch_size)
    rows = local_rows(next(iter(shardings.values())), shapes[next(iter(shapes))].shape)
    local = dataset.rows(split, step, rows, batch_size)
    return {k: jax.make_array_from_process_local_data(shardings[k], local[k], shapes[k].shape) for k in shapes}
