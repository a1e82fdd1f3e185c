"""Text classification: JSON lines of a text and its label, as an encoder classifier's rows.

A line is one JSON object; `data.text_field` (default "text") holds the text and `data.label_field` (default "label")
the label: an integer 0..n_classes-1 (the model's `n_classes`), or a name that `data.label_names` lists in class
order ("neg,pos": neg is 0, pos 1). Other fields are ignored. Each way a line can be wrong is an error naming the file,
the line, the value, what was expected and how to fix it.

Texts are tokenized byte-level by default: [CLS], the text's UTF-8 bytes, [SEP] (`BYTE_SPECIALS`), cut to `seq_len`;
or with `data.tokenizer` (a tokenizer.json or a directory holding one), with its own special tokens (its post-processor
where it adds some, else its [CLS] and [SEP]). Rows are padded with the pad id, where their segment ids are 0.

Validation is `data.val_path`, a file of its own, or else the last `data.val_fraction` of the file's examples after a
shuffle by the run's seed. Rows are pure functions of (seed, split, step, row), as every dataset's
(`jaxtrain.data.datasets`): training row r of step s is example s * B + r of an order drawn afresh each epoch from
(seed, epoch); validation walks its examples in order.

`data.source=builtin` is a generated task (`sentiment_review`): short reviews whose label is the opinion of their one
opinion clause, "not" flipping it, among neutral asides, each row's review drawn from (seed, split, step, row), so no
review is seen twice but by chance; `write_sentiment_jsonl` writes such reviews as JSON lines.

    >>> data = text_classes("builtin", TextOptions(), seq_len=128, seed=0, vocab_size=320, n_classes=2)
    >>> rows = data.rows("train", 0, range(4), 4)
    >>> rows["tokens"].shape, rows["segment_ids"].shape, rows["labels"].shape
    ((4, 128), (4, 128), (4,))
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxtrain.data.masking import (
    BYTE_SPECIALS,
    BYTE_VOCAB,
    BYTE_VOCAB_FIX,
    hf_tokenizer,
    tokenizer_specials,
)
from jaxtrain.data.splits import epoch_walk, row_rng
from jaxtrain.errors import UserInputError
from jaxtrain.files import read_bytes

TASK = "text_classification"
_HOLD_OUT = 0x686F6C64  # b"hold": the shuffle that chooses the validation examples, apart from the epochs' orders

# The generated task's words: opinions, the clauses around them, and asides that say nothing.
POSITIVE = ("good", "great", "superb", "lovely", "fine", "moving", "clever", "fun")
NEGATIVE = ("bad", "awful", "dull", "weak", "boring", "poor", "silly", "bland")
SUBJECTS = ("the film", "the plot", "the cast", "the music", "the end", "the story")
VERBS = ("was", "is", "felt")
DEGREES = ("", "very ", "so ")
ASIDES = ("we saw it at home", "it ran long", "i went twice", "it was a sunday")
JOINS = (", ", " and ", "; ")
NEGATION = 0.35  # the chance a clause says "not"
RECORD_FORMAT = 'one JSON object a line, e.g. {"text": "...", "label": 0}'


class TextClassesError(UserInputError):
    """Text-classification data that is missing or malformed, or whose labels the model cannot take."""


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """Where a JSON line's text and label are, what label names mean, the validation file and the tokenizer (the
    `data.*` keys of the same names)."""

    text_field: str = "text"
    label_field: str = "label"
    label_names: str = ""
    val_path: str = ""
    tokenizer: str = ""


class TextEncoder(NamedTuple):
    """Texts -> token ids with the special tokens around them, at most `seq_len` each; `size`: the ids they may hold
    (the model needs vocab_size >= size); `pad_id`: what fills a row after its tokens."""

    name: str
    size: int
    pad_id: int
    encode: Callable[[Sequence[str]], list[list[int]]]


def byte_encoder(seq_len: int) -> TextEncoder:
    """[CLS], the text's UTF-8 bytes cut to fit, [SEP]."""
    if seq_len < 3:
        raise TextClassesError(
            f"data.seq_len={seq_len} leaves no room for text between [CLS] and [SEP]: use data.seq_len >= 3."
        )
    cls, sep = BYTE_SPECIALS.cls, BYTE_SPECIALS.sep

    def encode(texts: Sequence[str]) -> list[list[int]]:
        return [[cls, *text.encode()[: seq_len - 2], sep] for text in texts]

    return TextEncoder("byte-level text", BYTE_VOCAB, BYTE_SPECIALS.pad, encode)


def tokenizer_encoder(path: str, seq_len: int) -> TextEncoder:
    """The tokenizer at `path`, with the special tokens its post-processor adds (where it adds none: its [CLS] before
    the text and [SEP] after, those it has), truncated to `seq_len` as the tokenizer truncates (specials kept)."""
    from tokenizers import processors

    hf = hf_tokenizer(path)
    specials = tokenizer_specials(hf)
    cls, sep = (None if i is None else hf.id_to_token(i) for i in (specials.cls, specials.sep))
    if not hf.num_special_tokens_to_add(is_pair=False) and (cls or sep):
        hf.post_processor = processors.TemplateProcessing(
            single=" ".join(t for t in (cls, "$A", sep) if t),
            special_tokens=[(t, hf.token_to_id(t)) for t in (cls, sep) if t],
        )
    if seq_len <= hf.num_special_tokens_to_add(is_pair=False):
        raise TextClassesError(
            f"data.seq_len={seq_len} leaves no room for text beside tokenizer '{path}''s special tokens: use a "
            "longer data.seq_len."
        )
    hf.enable_truncation(max_length=seq_len)

    def encode(texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in hf.encode_batch(list(texts))]

    pad = specials.pad if specials.pad is not None else 0  # padding is masked by segment id 0: any id would do
    return TextEncoder(f"tokenizer '{path}'", hf.get_vocab_size(with_added_tokens=True), pad, encode)


class Labels:
    """A label as a class index: an integer 0..n_classes-1, or one of `names` ("neg,pos", in class order)."""

    def __init__(self, n_classes: int, names: str = ""):
        self.n_classes = n_classes
        self.names = tuple(name.strip() for name in names.split(",")) if names.strip() else ()
        if any(not name for name in self.names) or len(set(self.names)) < len(self.names):
            raise TextClassesError(
                f"data.label_names={names!r}: expected distinct, non-empty names separated by commas, in class order "
                "(e.g. data.label_names=neg,pos)."
            )
        if len(self.names) > n_classes:
            raise TextClassesError(
                f"data.label_names names {len(self.names)} classes ({', '.join(self.names)}), but the model has "
                f"n_classes={n_classes}: set n_classes={len(self.names)}."
            )

    def index(self, value: object, where: str) -> int:
        """The class of label `value` of the line at `where`; a label the model has no class for is an error."""
        if isinstance(value, str) and value in self.names:
            return self.names.index(value)
        if isinstance(value, str):
            listed = f"one of data.label_names ({', '.join(self.names)})" if self.names else "a class index"
            fix = "add it to data.label_names" if self.names else "set data.label_names=NAME0,NAME1,... in class order"
            raise TextClassesError(f"{where}: label {value!r} is not {listed}: {fix}, or fix the line.")
        if isinstance(value, bool) or not isinstance(value, int):
            raise TextClassesError(
                f"{where}: label {json.dumps(value)}: expected an integer 0..{self.n_classes - 1} or a name of "
                "data.label_names; fix the line."
            )
        if value < 0:
            raise TextClassesError(f"{where}: label {value}: expected 0..{self.n_classes - 1}; fix the line.")
        if value >= self.n_classes:
            raise TextClassesError(
                f"{where}: label {value}, but the model has n_classes={self.n_classes} (labels 0.."
                f"{self.n_classes - 1}): fix the label, or set n_classes={value + 1} if the data has that many classes."
            )
        return value


class Examples(NamedTuple):
    """Encoded examples: tokens and segment ids (N, seq_len) int32 (segment 1 on tokens, 0 on padding), labels (N,)."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    labels: np.ndarray

    def take(self, index: np.ndarray) -> Examples:
        return Examples(*(x[index] for x in self))


def read_records(path: Path) -> list[tuple[str, dict]]:
    """The JSON objects of the non-blank lines of `path`, each with where it is ("'path' line N")."""
    raw = read_bytes(path, "text-classification data", TextClassesError)
    records = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"'{path}' line {number}"
        try:
            record = json.loads(line)
        except ValueError as err:  # a UnicodeDecodeError is one
            raise TextClassesError(f"{where} is not JSON ({err}): expected {RECORD_FORMAT}.") from None
        if not isinstance(record, dict):
            raise TextClassesError(f"{where} is a JSON {type(record).__name__}: expected an object a line.")
        records.append((where, record))
    if not records:
        raise TextClassesError(f"'{path}' holds no examples: expected {RECORD_FORMAT}.")
    return records


def encoded(
    records: Sequence[tuple[str, dict]], options: TextOptions, labels: Labels, encoder: TextEncoder, seq_len: int
) -> Examples:
    """The records' texts tokenized and padded to `seq_len`, and their labels as class indices."""
    texts, classes = [], []
    for where, record in records:
        texts.append(_field(record, options.text_field, "text", where))
        if not isinstance(texts[-1], str):
            shown = json.dumps(texts[-1])
            raise TextClassesError(f"{where}: field {options.text_field!r} is {shown}: expected a string of text.")
        classes.append(labels.index(_field(record, options.label_field, "label", where), where))
    return padded(encoder, texts, classes, seq_len)


def padded(encoder: TextEncoder, texts: Sequence[str], classes: Sequence[int], seq_len: int) -> Examples:
    """`texts` encoded and padded to `seq_len`, with their classes."""
    tokens = np.full((len(texts), seq_len), encoder.pad_id, np.int32)
    segments = np.zeros((len(texts), seq_len), np.int32)
    for i, ids in enumerate(encoder.encode(texts)):
        tokens[i, : len(ids)], segments[i, : len(ids)] = ids, 1
    return Examples(tokens, segments, np.array(classes, np.int32))


def _field(record: dict, name: str, what: str, where: str) -> object:
    if name not in record:
        present = ", ".join(map(repr, record)) or "none"
        raise TextClassesError(
            f"{where} has no field {name!r} (its fields: {present}): set data.{what}_field to the field that holds "
            f"the {what}, or add it to the line."
        )
    return record[name]


def held_out(examples: Examples, val_fraction: float, seed: int, name: str) -> tuple[Examples, Examples]:
    """(train, validation): the last `val_fraction` of the examples after a shuffle by `seed` are validation's."""
    n = len(examples.labels)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise TextClassesError(
            f"{name} holds {n} example{'s' * (n != 1)}: too few to hold out data.val_fraction={val_fraction:g} for "
            "validation and train on the rest; give more examples, or a validation file (data.val_path)."
        )
    order = np.random.default_rng((seed, _HOLD_OUT)).permutation(n)
    return examples.take(order[: n - n_val]), examples.take(order[n - n_val :])


def row_shapes(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A text-classification batch: tokens and segment ids (B, T), labels (B,)."""
    ids = jax.ShapeDtypeStruct((batch_size, seq_len), np.int32)
    return {"tokens": ids, "segment_ids": ids, "labels": jax.ShapeDtypeStruct((batch_size,), np.int32)}


class TextClasses:
    """Encoded text-classification examples of two splits as rows {"tokens": int32 (B, T), "segment_ids": int32
    (B, T), "labels": int32 (B,)} (see the module docstring for which example each row is)."""

    task = TASK

    def __init__(self, train: Examples, val: Examples, seq_len: int, seed: int, largest_id: int):
        self.splits = {"train": train, "val": val}
        self.seq_len, self.seed = seq_len, seed
        self.largest_id = largest_id  # the largest id rows may hold: what `check_dataset` compares with the model's

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return row_shapes(batch_size, self.seq_len)

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        examples = self.splits[split]
        samples = step * batch_size + np.asarray(rows, np.int64)
        n = len(examples.labels)
        index = samples % n if split == "val" else epoch_walk(self.seed, "train", samples, n)
        return examples.take(index)._asdict()


class SyntheticTextClasses:
    """Random token ids and labels of the model's shapes: nothing to learn, for measuring speed and planning."""

    task = TASK

    def __init__(self, vocab_size: int, n_classes: int, seq_len: int, seed: int):
        self.vocab_size, self.n_classes, self.seq_len, self.seed = vocab_size, n_classes, seq_len, seed

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return row_shapes(batch_size, self.seq_len)

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        rngs = [row_rng(self.seed, split, step, row) for row in rows]
        return {
            "tokens": np.stack([rng.integers(0, self.vocab_size, self.seq_len) for rng in rngs]).astype(np.int32),
            "segment_ids": np.ones((len(rngs), self.seq_len), np.int32),
            "labels": np.array([rng.integers(0, self.n_classes) for rng in rngs], np.int32),
        }


class SentimentTask:
    """The generated task (`sentiment_review`) as rows of text-classification data: row r of step s of a split is the
    review drawn from (seed, split, s, r), encoded by `encoder`."""

    task = TASK

    def __init__(self, encoder: TextEncoder, seq_len: int, seed: int):
        self.encoder, self.seq_len, self.seed = encoder, seq_len, seed
        self.largest_id = encoder.size - 1

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return row_shapes(batch_size, self.seq_len)

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        reviews = [sentiment_review(row_rng(self.seed, split, step, r)) for r in rows]
        texts, labels = [r["text"] for r in reviews], [r["label"] for r in reviews]
        return padded(self.encoder, texts, labels, self.seq_len)._asdict()


def sentiment_review(rng: np.random.Generator) -> dict:
    """A generated review {"text": ..., "label": 0 or 1}: one opinion clause ("the plot was not very dull"), its
    opinion flipped by "not", among up to two neutral asides in random order; the label is 1 where the opinion is
    positive. Learnable, not by a word list alone: a word list scores 1 - NEGATION, negation decides the rest."""
    opinion, sign = _opinion(rng)
    clauses = [str(aside) for aside in rng.choice(ASIDES, size=int(rng.integers(0, 3)), replace=False)]
    clauses.insert(int(rng.integers(len(clauses) + 1)), opinion)
    text = clauses[0] + "".join(str(rng.choice(JOINS)) + clause for clause in clauses[1:])
    return {"text": text, "label": int(sign > 0)}


def _opinion(rng: np.random.Generator) -> tuple[str, int]:
    """A clause and its opinion, +1 or -1."""
    positive, negated = rng.random() < 0.5, rng.random() < NEGATION
    word = rng.choice(POSITIVE if positive else NEGATIVE)
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {'not ' * negated}{rng.choice(DEGREES)}{word}"
    return text, 1 if positive != negated else -1


def sentiment_records(n: int, seed: int = 0) -> list[dict]:
    """`n` generated reviews (`sentiment_review`) from one generator seeded by `seed`."""
    rng = np.random.default_rng(seed)
    return [sentiment_review(rng) for _ in range(n)]


def write_sentiment_jsonl(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `sentiment_records(n, seed)` to `path` as JSON lines; returns the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(record) + "\n" for record in sentiment_records(n, seed)))
    return path


def text_classes(
    source: str,
    options: TextOptions,
    *,
    seq_len: int,
    seed: int,
    vocab_size: int,
    n_classes: int,
    val_fraction: float = 0.1,
) -> TextClasses | SentimentTask | SyntheticTextClasses:
    """The text-classification data `source` names: `builtin` (the generated task), `synthetic` (random ids), or a
    JSON-lines file; for a model of `vocab_size` token ids and `n_classes` classes."""
    if source == "synthetic":
        return SyntheticTextClasses(vocab_size, n_classes, seq_len, seed)
    encoder = tokenizer_encoder(options.tokenizer, seq_len) if options.tokenizer else byte_encoder(seq_len)
    if encoder.size > vocab_size:
        fix = BYTE_VOCAB_FIX if not options.tokenizer else f"set model.vocab_size >= {encoder.size}"
        raise TextClassesError(
            f"{encoder.name} uses ids up to {encoder.size - 1}, but the model's vocab_size is {vocab_size}: {fix}."
        )
    if source == "builtin":
        return SentimentTask(encoder, seq_len, seed)
    labels = Labels(n_classes, options.label_names)
    examples = encoded(read_records(Path(source)), options, labels, encoder, seq_len)
    if options.val_path:
        val = encoded(read_records(Path(options.val_path)), options, labels, encoder, seq_len)
        train = examples
    else:
        train, val = held_out(examples, val_fraction, seed, f"'{source}'")
    return TextClasses(train, val, seq_len, seed, encoder.size - 1)
