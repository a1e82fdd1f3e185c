"""Training on tokenized shards (`data.source=tokens data.path=DIR`, or `--data tokens:DIR`), read with Grain.

Row r of step s is global sample g = s * B + r, as for every jaxtrain dataset. Each split of a directory is a Grain
random-access source of rows (`ConcatWindows` or `PackedRows`, see `jaxtrain.data.packing`), shuffled by Grain with
a seed from (train.seed, split), a new order each epoch (`repeat`); a mixture of directories is Grain's
deterministic `mix` of them by weight. So sample g is a pure function of (seed, split, g): any process reads just
its own rows, a run resumes exactly on any number of devices or processes, and nothing about the data needs to be
in a checkpoint. With `data.prefetch` > 0 a Grain thread reads the next steps' rows while the device computes.

Each shard is checked when it is opened: against its CRC-32 in the manifest (a shard changed since it was written, or
a manifest copied from another tokenization, is refused), and its largest id against the tokenizer's vocabulary (an
id past it would train to NaN). A manifest written before shards had checksums is read with the ids check alone.

Chat data (`jaxtrain tokenize --chat`) stores each token's loss weight beside it: the rows then carry
`loss_weights` (B, T + 1) float32, laid out as `tokens` (the same windows, the same packing, the same shuffle), so
the weights resume with the tokens on any mesh; `jaxtrain.ops.sequence.next_tokens` makes them target weights. In a
mixture of chat and text directories, the text's tokens weigh 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxtrain.data.packing import PACKINGS, ConcatWindows, PackedRows
from jaxtrain.data.shards import FORMATS, MANIFEST, file_crc32
from jaxtrain.data.splits import SPLITS
from jaxtrain.data.tokenizer import Tokenizer, file_digest, load_tokenizer, padded_vocab
from jaxtrain.errors import UserInputError

if TYPE_CHECKING:
    import grain

TOKENS = "tokens"  # data.source of tokenized shards; "tokens:DIR" names the directory inline


class TokenDataError(UserInputError):
    """Tokenized data that is missing, malformed, or does not fit the run."""


def token_sources(source: str, path: str, mixture: str) -> list[tuple[Path, float]] | None:
    """The tokenized directories a data config names, with their mixture weights (one: weight 1); None if the
    source is not tokenized data."""
    if source != TOKENS and not source.startswith(f"{TOKENS}:"):
        return None
    inline = source.removeprefix(f"{TOKENS}:") if source != TOKENS else ""
    given = [g for g in (inline, path, mixture) if g]
    if len(given) != 1:
        raise TokenDataError(
            f"data.source={source} needs the tokenized data named once: data.path=DIR, --data tokens:DIR, or "
            f"data.mixture=DIR_A:0.7,DIR_B:0.3 (got {len(given)} of them)."
        )
    if not mixture:
        return [(Path(given[0]), 1.0)]
    return [_mixture_part(part) for part in mixture.split(",")]


def _mixture_part(part: str) -> tuple[Path, float]:
    directory, _, text = part.strip().rpartition(":")
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not directory or not weight > 0 or not np.isfinite(weight):
        raise TokenDataError(
            f"data.mixture entry '{part}': expected DIR:WEIGHT with a positive weight, e.g. "
            "data.mixture=web:0.7,code:0.3 (the weights are normalised to sum to 1)."
        )
    return Path(directory), weight


def read_manifest(directory: Path) -> dict:
    """The manifest of tokenized directory `directory`, checked for its format."""
    path = directory / MANIFEST
    if not path.is_file():
        raise TokenDataError(
            f"'{directory}' is not tokenized data: it has no {MANIFEST}. Make it with jaxtrain tokenize --tokenizer "
            f"TOK --out {directory} INPUTS (an interrupted run finishes when rerun)."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise TokenDataError(
            f"'{path}' is not valid JSON ({err}): rerun jaxtrain tokenize into a new directory."
        ) from None
    if manifest.get("format") not in FORMATS:
        raise TokenDataError(
            f"'{path}' has format {manifest.get('format')!r}, this jaxtrain reads formats "
            f"{', '.join(map(str, FORMATS))}: tokenize it again with this jaxtrain, or train with the one that wrote "
            "it."
        )
    return manifest


def has_loss_weights(manifest: dict) -> bool:
    """Whether a tokenized directory stores a loss weight per token: chat data does."""
    return "chat" in manifest


def token_vocab(source: str, path: str, mixture: str) -> int | None:
    """The model vocabulary the tokenized data a data config names needs: its tokenizer's size, padded to a
    multiple of 128; None if the source is not tokenized data."""
    sources = token_sources(source, path, mixture)
    if sources is None:
        return None
    return padded_vocab(max(read_manifest(d)["tokenizer"]["vocab_size"] for d, _ in sources))


class SplitTokens:
    """One split of a tokenized directory: its shards' tokens as one stream (memory-mapped), its documents, and for
    chat data each token's loss weight."""

    def __init__(self, directory: Path, manifest: dict, split: str):
        self.directory, self.split = directory, split
        shards = manifest["splits"][split]["shards"]
        self.tokens = [self._open(s, "tokens", (s["tokens"],), manifest["dtype"]) for s in shards]
        weighted = has_loss_weights(manifest)
        self.weights = [self._open(s, "weights", (s["tokens"],), "uint8") for s in shards] if weighted else None
        docs = [self._open(s, "docs", (s["documents"] + 1,), "int64") for s in shards]
        for shard, tokens in zip(shards, self.tokens):
            self._check_ids(shard, tokens, manifest["tokenizer"]["vocab_size"])
        self.starts = np.concatenate([[0], np.cumsum([len(t) for t in self.tokens])])  # each shard's first token
        for shard, offsets, tokens in zip(shards, docs, self.tokens):
            if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
                raise TokenDataError(
                    f"'{self._file(shard, 'docs')}': its document offsets do not cover the {len(tokens)} tokens of "
                    "its shard in increasing order. Rerun jaxtrain tokenize into a new directory."
                )
        # Every document's [start, stop) in the stream.
        self.documents = np.concatenate([offsets[:-1] + base for offsets, base in zip(docs, self.starts)])
        self.document_ends = np.concatenate([offsets[1:] + base for offsets, base in zip(docs, self.starts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream, across shards, as int32."""
        return self._across_shards(self.tokens, start, stop).astype(np.int32)

    def read_weights(self, start: int, stop: int) -> np.ndarray:
        """The loss weights of tokens [start, stop), as float32: stored ones for chat data, else 1 (all count)."""
        if self.weights is None:
            return np.ones(stop - start, np.float32)
        return self._across_shards(self.weights, start, stop).astype(np.float32)

    def longest_document(self) -> int:
        """The most tokens of any document of the split."""
        return int((self.document_ends - self.documents).max())

    def _across_shards(self, arrays: list[np.ndarray], start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of the split's stream of `arrays`, one per shard."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, at = [], start
        for shard in range(first, len(arrays)):
            if at >= stop:
                break
            base = self.starts[shard]
            parts.append(arrays[shard][at - base : min(stop, self.starts[shard + 1]) - base])
            at = int(self.starts[shard + 1])
        return np.concatenate(parts)

    def _file(self, shard: dict, kind: str) -> Path:
        return self.directory / f"{shard['name']}.{kind}.npy"

    def _open(self, shard: dict, kind: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A shard's array, memory-mapped, checked against the manifest: a missing, empty or truncated file is an
        error naming it."""
        path = self._file(shard, kind)
        fix = "Rerun jaxtrain tokenize into a new directory (or restore the file)."
        if not path.is_file():
            raise TokenDataError(f"shard '{path}' of the manifest is missing. {fix}")
        if shape[0] == 0 or path.stat().st_size == 0:
            raise TokenDataError(f"shard '{path}' is empty: a shard holds at least one document. {fix}")
        try:
            array = np.load(path, mmap_mode="r")
        except (
            ValueError,
            OSError,
            EOFError,
        ) as err:  # a truncated file fails to map: fewer bytes than its header says
            raise TokenDataError(f"shard '{path}' is truncated or not a .npy array ({err}). {fix}") from None
        if array.shape != shape or array.dtype != np.dtype(dtype):
            raise TokenDataError(
                f"shard '{path}' holds {array.dtype}{list(array.shape)}, the manifest says {dtype}{list(shape)}. {fix}"
            )
        expected = shard.get("crc32", {}).get(kind)  # none in a manifest written before shards had checksums
        if expected is not None and (found := file_crc32(path)) != expected:
            raise TokenDataError(
                f"shard '{path}' has CRC-32 {found}, but the manifest says {expected}: the file changed after it was "
                f"written, or the manifest was copied from another tokenization and the shard does not belong to it. "
                f"{fix}"
            )
        return array

    def _check_ids(self, shard: dict, tokens: np.ndarray, vocab_size: int) -> None:
        """Every id of a shard is one of its tokenizer's: an id past the vocabulary would index past the embedding."""
        if (largest := int(tokens.max())) >= vocab_size:
            position = int(np.argmax(tokens >= vocab_size))
            raise TokenDataError(
                f"shard '{self._file(shard, 'tokens')}' holds token id {largest} at position {position}, but its "
                f"tokenizer has {vocab_size} tokens (ids 0..{vocab_size - 1}): the shard is corrupt or was written "
                "with another tokenizer. Rerun jaxtrain tokenize into a new directory."
            )


def open_split(directory: Path, split: str) -> tuple[dict, SplitTokens]:
    """The manifest of `directory`, its tokenizer checked, and its split `split`."""
    manifest = read_manifest(directory)
    checked_tokenizer(directory, manifest)
    if any("crc32" not in shard for s in manifest["splits"].values() for shard in s["shards"]):
        _unchecked_notice(directory / MANIFEST)
    return manifest, SplitTokens(directory, manifest, split)


@functools.cache  # once per manifest, though each split is opened
def _unchecked_notice(manifest: Path) -> None:
    # Still read, not refused: re-tokenizing a big corpus for a check costs hours, and the ids check still runs.
    print(
        f"notice: '{manifest}' has no shard checksums (written by an older jaxtrain tokenize): its shards are read "
        "unchecked, their ids checked against the vocabulary. Rerun jaxtrain tokenize into a new directory to add "
        "them.",
        file=sys.stderr,
    )


def tokenizer_of(directory: Path) -> Tokenizer:
    """The tokenizer tokenized directory `directory` was made with (its checked copy), e.g. to encode prompts."""
    return load_tokenizer(checked_tokenizer(directory, read_manifest(directory)))


def checked_tokenizer(directory: Path, manifest: dict) -> Path:
    """The path of the tokenizer copy in `directory`, once checked against the manifest's SHA-256."""
    tokenizer = directory / manifest["tokenizer"]["file"]
    fix = "rerun jaxtrain tokenize with the tokenizer you mean to train with, into a new directory"
    if not tokenizer.is_file():
        raise TokenDataError(f"tokenizer '{tokenizer}' is missing: the manifest of '{directory}' names it; {fix}.")
    if (digest := file_digest(tokenizer)) != manifest["tokenizer"]["sha256"]:
        raise TokenDataError(
            f"tokenizer '{tokenizer}' has SHA-256 {digest[:12]}..., but '{directory / MANIFEST}' was tokenized with "
            f"{manifest['tokenizer']['sha256'][:12]}...: the tokens would be read with another vocabulary. Put the "
            f"original tokenizer back, or {fix}."
        )
    return tokenizer


def _chat_notices(directory: Path, tokens: SplitTokens, seq_len: int, packing: str) -> None:
    """One line each (to stderr) where chat data will train other than it reads: conversations longer than a row,
    or packed so that they attend to each other."""
    width = seq_len + 1
    if tokens.longest_document() > width:
        longer = int(np.sum(tokens.document_ends - tokens.documents > width))
        _notice(
            f"notice: {longer} of the {len(tokens.documents)} conversations of the {tokens.split} split of "
            f"'{directory}' are longer than a row (data.seq_len + 1 = {width} tokens): their later tokens train "
            f"without their start in view. Tokenize with --max-tokens {width} to cut them at a turn, or raise seq_len."
        )
    if packing == "concat":
        _notice(
            f"notice: '{directory}' holds conversations, read with data.packing=concat: they share rows and attend to "
            "each other. data.packing=segments keeps each to itself (pipeline parallelism takes only concat)."
        )


@functools.cache  # each line once per process
def _notice(line: str) -> None:
    print(line, file=sys.stderr)


@dataclasses.dataclass
class _Prefetched:
    """The rows of successive steps of one split and row range, read ahead on a Grain thread."""

    key: tuple
    next_step: int
    iterator: object


class TokenData:
    """Tokenized shards (one directory, or a weighted mixture) as a jaxtrain `Dataset`; see the module docstring."""

    task = "lm"

    def __init__(
        self,
        sources: Sequence[tuple[Path, float]],
        seq_len: int,
        seed: int,
        packing: str = "concat",
        prefetch: int = 0,
    ):
        import grain  # here, not at the top: only runs on tokenized data pay for importing it

        if packing not in PACKINGS:
            raise TokenDataError(f"data.packing={packing} is not one of {', '.join(PACKINGS)}.")
        self.seq_len, self.seed, self.packing, self.prefetch = seq_len, seed, packing, prefetch
        self.names = [str(d) for d, _ in sources]
        self.weights = [w / sum(w for _, w in sources) for _, w in sources]
        # Rows carry loss weights if any source stores them (chat data); a text source's then weigh 1.
        self.loss_weights = any(has_loss_weights(read_manifest(d)) for d, _ in sources)
        self.splits = {split: self._split(sources, split) for split in SPLITS}
        self._prefetched: _Prefetched | None = None
        # Which source each training sample comes from: Grain's mix of one constant per source draws the same
        # pattern as the data's mix (it depends on the weights alone, every part being endless), without reading.
        constants = [grain.MapDataset.range(k, k + 1).repeat() for k in range(len(sources))]
        self._source_of = grain.MapDataset.mix(constants, self.weights) if len(sources) > 1 else None
        self._counted = (0, np.zeros(len(sources), np.int64))  # a memo of `metrics`: samples seen, rows per source

    def _split(self, sources: Sequence[tuple[Path, float]], split: str) -> grain.MapDataset:
        import grain

        parts, digest = [], None
        for k, (directory, _) in enumerate(sources):
            manifest, tokens = open_split(directory, split)
            if digest is not None and manifest["tokenizer"]["sha256"] != digest[1]:
                raise TokenDataError(
                    f"data.mixture: '{directory}' was tokenized with another tokenizer than '{digest[0]}' (SHA-256 "
                    f"{manifest['tokenizer']['sha256'][:12]}... against {digest[1][:12]}...): a model has one "
                    "vocabulary. Tokenize every source with the same tokenizer."
                )
            digest = digest or (directory, manifest["tokenizer"]["sha256"])
            self.vocab_size = manifest["tokenizer"]["vocab_size"]
            rows = (ConcatWindows if self.packing == "concat" else PackedRows)(tokens, self.seq_len, self.loss_weights)
            if has_loss_weights(manifest):
                _chat_notices(directory, tokens, self.seq_len, self.packing)
            if not len(rows):
                raise TokenDataError(
                    f"the {split} split of '{directory}' has {len(tokens)} tokens, too few for one row of "
                    f"data.seq_len={self.seq_len} + 1: use a shorter seq_len or more data."
                )
            seed = int(np.random.SeedSequence((self.seed, SPLITS[split], k)).generate_state(1)[0])
            parts.append(grain.MapDataset.source(rows).shuffle(seed=seed).repeat())
        return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, self.weights)

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), np.int32)
        weights = jax.ShapeDtypeStruct(shape.shape, np.float32)
        return {
            "tokens": shape,
            **({"segment_ids": shape} if self.packing == "segments" else {}),
            **({"loss_weights": weights} if self.loss_weights else {}),
        }

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        if self.prefetch <= 0 or split != "train":
            return self._read(split, step, rows, batch_size)
        key = (split, rows, batch_size)
        ahead = self._prefetched
        if ahead is None or ahead.key != key or ahead.next_step != step:  # a first call, a resume or a rollback
            import grain

            steps = grain.MapDataset.range(step, 2**62).map(lambda s: self._read(split, s, rows, batch_size))
            options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch)
            ahead = self._prefetched = _Prefetched(key, step, iter(steps.to_iter_dataset(options)))
        ahead.next_step += 1
        return next(ahead.iterator)

    def metrics(self, step: int, batch_size: int) -> dict[str, float]:
        """For a mixture, the tokens (row positions) drawn from each source in training steps [0, step), by the
        source directory's name: `tokens_NAME`. Nothing for one source."""
        if self._source_of is None:
            return {}
        seen, counts = self._counted
        if seen > step * batch_size:  # asked about an earlier step (a rollback): count again from the start
            seen, counts = 0, np.zeros_like(counts)
        drawn = [self._source_of[g] for g in range(seen, step * batch_size)]
        counts = counts + np.bincount(drawn, minlength=len(counts))
        self._counted = (step * batch_size, counts)
        names = [Path(n).name for n in self.names]
        keys = names if len(set(names)) == len(names) else self.names
        return {f"tokens_{key}": float(c * self.seq_len) for key, c in zip(keys, counts)}

    def source_of(self, sample: int) -> int:
        """The index of the source training sample `sample` is drawn from."""
        return 0 if self._source_of is None else self._source_of[sample]

    def _read(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        data = self.splits[split]
        items = [data[step * batch_size + r] for r in rows]
        return {k: np.stack([item[k] for item in items]) for k in items[0]}
