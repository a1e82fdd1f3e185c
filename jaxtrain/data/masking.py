"""Masked-language-model rows (BERT's): any language-model token source, with some positions chosen for prediction.

Each row is the source row's first `seq_len` tokens. `mask_rate` of its positions (at least 1; never padding, never a
special token) are chosen; of those, 80% become the mask id, 10% a random ordinary id and 10% stay as they are. With
whole-word masking, words are chosen rather than tokens, each whole, until the row's budget of `mask_rate` of its
positions is reached (a word that would overshoot is passed over, as BERT's own data code does); a chosen word's tokens
are then masked, replaced or kept each on its own draw, as BERT's.

Every decision is drawn from a generator seeded by (seed, split, step, row) in a stream of its own (`MASK_STREAM`),
apart from the source's choice of windows: a row is masked the same on any mesh, by any number of processes, and in a
resumed run.

What masking knows of a vocabulary (`MaskVocab`): the mask id, which ids are special, and where words start:
- byte-level text (`byte_vocab`): ids 0..255 are bytes, the specials follow them (`BYTE_SPECIALS`), and a word is a
  run of non-whitespace bytes;
- a Hugging Face tokenizer (`tokenizer_vocab`): its [MASK] (or <mask>) token, its special added tokens, and words from
  its pieces: WordPiece's continuation prefix ('##'), or the leading space of byte-level BPE ('Ġ') and sentencepiece
  ('▁') pieces;
- random tokens (`synthetic_vocab`): the last id is the mask, and there are no words.

    >>> from jaxtrain.data.datasets import TokenWindows
    >>> text = TokenWindows(np.frombuffer(b"to be or not to be " * 20, np.uint8), seq_len=16, seed=0)
    >>> rows = MaskedTokens(text, byte_vocab(), seq_len=16, seed=0).rows("train", 0, range(2), 2)
    >>> sorted(rows), rows["tokens"].shape, int(rows["loss_weights"].sum())
    (['loss_weights', 'targets', 'tokens'], (2, 16), 4)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from jaxtrain.data.splits import row_rng
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.errors import UserInputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

MASK_RATE = 0.15
# BERT's split of the chosen positions: below MASKED the mask id, below REPLACED a random ordinary id, else unchanged.
MASKED, REPLACED = 0.8, 0.9
MASK_STREAM = 0x6D61736B  # b"mask": masking's own random stream beside the source's (seed, split, step, row)
# The names tokenizers give their special tokens, in the order looked for.
SPECIAL_NAMES = {
    "mask": ("[MASK]", "<mask>"),
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "pad": ("[PAD]", "<pad>"),
}
WHITESPACE = b" \t\n\r\x0b\x0c"  # the bytes that separate words (bytes.isspace's)
_SPACES = tuple(bytes([b]) for b in WHITESPACE)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's pieces for single bytes


class MaskingError(UserInputError):
    """Masked-language-model data that cannot be made as asked: a bad rate, a vocabulary without a mask or words."""


class Specials(NamedTuple):
    """The special token ids an encoder's data uses (None: the vocabulary has no such token)."""

    mask: int | None
    cls: int | None
    sep: int | None
    pad: int | None


# Byte-level text: the 256 byte values, then these. A byte-level encoder needs vocab_size >= BYTE_VOCAB.
BYTE_SPECIALS = Specials(mask=256, cls=257, sep=258, pad=259)
BYTE_VOCAB = 260
BYTE_VOCAB_FIX = f"set model.vocab_size >= {BYTE_VOCAB} (bytes 0..255, [MASK] 256, [CLS] 257, [SEP] 258, [PAD] 259)"


@dataclasses.dataclass(frozen=True)
class WordMarks:
    """Where words start and end, per token id (each (vocab size,) bool). A token joins the word of the token before
    it unless it `opens` a word (WordPiece: no '##'; byte-level: it starts with whitespace) or that token `closes` one
    (it ends with whitespace); a token `outside` every word (whitespace, a special) is never part of one."""

    opens: np.ndarray
    closes: np.ndarray
    outside: np.ndarray


@dataclasses.dataclass(frozen=True)
class MaskVocab:
    """What masking knows of a vocabulary: its name (for messages), the ids its data may hold (the model needs
    vocab_size >= `size`), the mask id, which ids are special (never chosen, never a random replacement), and where
    its words are (None: it does not say)."""

    name: str
    size: int
    mask_id: int
    special: np.ndarray  # (size,) bool
    words: WordMarks | None = None

    @property
    def ordinary(self) -> np.ndarray:
        """The ids a random replacement draws from."""
        return np.flatnonzero(~self.special)


def byte_vocab() -> MaskVocab:
    """Byte-level text: bytes 0..255, the specials of `BYTE_SPECIALS`, words between whitespace bytes."""
    space = np.isin(np.arange(256), np.frombuffer(WHITESPACE, np.uint8))
    special = np.arange(BYTE_VOCAB) >= 256
    marks = np.concatenate([space, special])
    return MaskVocab("byte-level text", BYTE_VOCAB, BYTE_SPECIALS.mask, special, WordMarks(marks, marks, marks))


def synthetic_vocab(vocab_size: int) -> MaskVocab:
    """Random tokens under the model's vocabulary: ids 0..vocab_size-2, the last id the mask; no words."""
    special = np.arange(vocab_size) == vocab_size - 1
    return MaskVocab("synthetic tokens", vocab_size, vocab_size - 1, special)


def hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The Hugging Face tokenizer at `path` (a tokenizer.json or a directory holding one), checked as
    `load_tokenizer` checks it. A sentencepiece model is refused: encoder data reads a tokenizer.json's special tokens
    and pieces."""
    checked = load_tokenizer(path)
    if checked.path.suffix == ".model":
        raise MaskingError(
            f"tokenizer '{checked.path}' is a sentencepiece model; encoder data reads a Hugging Face tokenizer.json "
            "(its special tokens and word pieces): convert it (transformers' AutoTokenizer(...).save_pretrained)."
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checked.path))


def tokenizer_specials(hf: HFTokenizer) -> Specials:
    """The tokenizer's [MASK], [CLS], [SEP] and [PAD] ids (or <mask>, <s>, </s>, <pad>); None where it has none."""
    found = (next((i for n in names if (i := hf.token_to_id(n)) is not None), None) for names in SPECIAL_NAMES.values())
    return Specials(*found)


def tokenizer_vocab(path: str | Path) -> MaskVocab:
    """The vocabulary of the tokenizer at `path`: its mask token (none is an error), its special added tokens, its
    words where its pieces say (`tokenizer_words`)."""
    hf = hf_tokenizer(path)
    mask = tokenizer_specials(hf).mask
    if mask is None:
        raise MaskingError(
            f"tokenizer '{path}' has no mask token ([MASK] or <mask>), which masked-language-model data puts in place "
            "of chosen tokens: use a tokenizer that has one (or add it: tokenizer.add_special_tokens(['[MASK]']))."
        )
    size = hf.get_vocab_size(with_added_tokens=True)
    special = np.zeros(size, bool)
    special[[i for i, token in hf.get_added_tokens_decoder().items() if token.special and i < size]] = True
    special[mask] = True
    return MaskVocab(f"tokenizer '{path}'", size, mask, special, tokenizer_words(hf, special))


def tokenizer_words(hf: HFTokenizer, special: np.ndarray) -> WordMarks | None:
    """Where the tokenizer's words are, from its pieces: WordPiece's continuation prefix, or the text each piece stands
    for (byte-level BPE's 'Ġ', sentencepiece's '▁' are spaces); None for a tokenizer whose pieces do not say."""
    pieces = [hf.id_to_token(i) or "" for i in range(len(special))]
    prefix = getattr(hf.model, "continuing_subword_prefix", None)
    if prefix:
        continues = np.array([p.startswith(prefix) for p in pieces])
        return WordMarks(~continues, np.zeros_like(special), special.copy())
    surfaces = _piece_bytes(hf, pieces)
    if surfaces is None:
        return None
    opens = np.array([s[:1] in (b"", *_SPACES) for s in surfaces])
    closes = np.array([s[-1:] in (b"", *_SPACES) for s in surfaces])
    blank = np.array([not s.strip(WHITESPACE) for s in surfaces])
    return WordMarks(opens, closes, blank | special)


def _piece_bytes(hf: HFTokenizer, pieces: list[str]) -> list[bytes] | None:
    """The bytes each piece stands for, where the tokenizer writes them in a way we read: byte-level (GPT-2's
    alphabet) or with '▁' for a space (sentencepiece, with <0xNN> byte pieces); else None."""
    config = json.loads(hf.to_str())
    kinds = {part.get("type") for key in ("pre_tokenizer", "decoder") for part in _parts(config.get(key))}
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        return [bytes(alphabet.get(c, 0x3F) for c in p) for p in pieces]  # 0x3F "?": an added token's other chars
    if "Metaspace" in kinds or any(p.startswith("▁") for p in pieces):
        fallback = (_BYTE_FALLBACK.fullmatch(p) for p in pieces)
        return [bytes([int(m[1], 16)]) if m else p.replace("▁", " ").encode() for p, m in zip(pieces, fallback)]
    return None


def _parts(component: dict | None) -> list[dict]:
    """A tokenizer.json component and, for a Sequence, its members."""
    if not component:
        return []
    members = component.get("pretokenizers") or component.get("decoders") or []
    return [component, *members]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE's pieces -> the byte.
    Printable bytes stand for themselves; the others, in order, for characters from U+0100 on ('Ġ' is the space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def check_byte_vocab(vocab_size: int, what: str) -> None:
    """A byte-level encoder's vocabulary holds the bytes and `BYTE_SPECIALS`: a smaller one is an error."""
    if vocab_size < BYTE_VOCAB:
        raise MaskingError(
            f"{what} on byte-level text needs vocab_size >= {BYTE_VOCAB}, the model has {vocab_size}: {BYTE_VOCAB_FIX}."
        )


def check_mask_rate(rate: float) -> None:
    if not 0 < rate < 1:
        raise MaskingError(
            f"mask rate {rate}: expected a share of positions strictly between 0 and 1 (BERT's is {MASK_RATE}); a "
            "rate of 0 predicts nothing and 1 leaves nothing to read: set data.mask_rate, e.g. data.mask_rate=0.15."
        )


def mask_rng(seed: int, split: str, step: int, row: int) -> np.random.Generator:
    """Masking's generator for row `row` of batch `step`: apart from the source's stream of the same row."""
    return row_rng(seed, split, step, row, MASK_STREAM)


@dataclasses.dataclass(frozen=True)
class MaskOptions:
    """How positions are chosen (the `data.mask_rate` and `data.whole_words` keys)."""

    rate: float = MASK_RATE
    whole_words: bool = False


class MaskedTokens:
    """Masked-language-model rows (see the module docstring) over `source`, a language-model dataset whose rows hold
    at least `seq_len` tokens (and, packed, their segment ids: 0 is padding), in the vocabulary `vocab`.

    Rows: {"tokens": int32 (B, T) with the chosen positions replaced, "targets": int32 (B, T) the source's tokens,
    "loss_weights": float32 (B, T) 1 where chosen, and where the source packs documents "segment_ids": int32 (B, T)}.
    """

    task = "mlm"

    def __init__(
        self,
        source: object,
        vocab: MaskVocab,
        seq_len: int,
        seed: int,
        mask_rate: float = MASK_RATE,
        whole_words: bool = False,
    ):
        check_mask_rate(mask_rate)
        shapes = source.shapes(1) if getattr(source, "task", None) == "lm" else {}
        width = shapes["tokens"].shape[1] if "tokens" in shapes else 0
        if width < seq_len:
            raise MaskingError(
                f"{type(source).__name__} is no source of token rows of at least {seq_len} tokens (it gives "
                f"{', '.join(f'{k} {v.shape[1:]}' for k, v in shapes.items()) or 'no language-model rows'}): mask a "
                "language-model dataset of rows of data.seq_len tokens or more (TokenWindows, TokenData)."
            )
        if whole_words and vocab.words is None:
            raise MaskingError(
                f"data.whole_words=true needs to know where words are, and {vocab.name} does not say (no '##' "
                "continuation pieces, no byte-level or '▁' word starts): set data.whole_words=false."
            )
        self.source, self.vocab, self.seq_len, self.seed = source, vocab, seq_len, seed
        self.mask_rate, self.whole_words = mask_rate, whole_words
        self.packed = "segment_ids" in shapes
        self.largest_id = vocab.size - 1  # the ids rows may hold: what `check_dataset` compares with the model's
        self._ordinary = vocab.ordinary

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        ids = jax.ShapeDtypeStruct((batch_size, self.seq_len), np.int32)
        shapes = {"tokens": ids, "targets": ids, "loss_weights": jax.ShapeDtypeStruct(ids.shape, np.float32)}
        return shapes | ({"segment_ids": ids} if self.packed else {})

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        source = self.source.rows(split, step, rows, batch_size)
        targets = np.asarray(source["tokens"][:, : self.seq_len], np.int32)
        segments = np.asarray(source["segment_ids"][:, : self.seq_len], np.int32) if self.packed else None
        tokens, weights = np.empty_like(targets), np.zeros(targets.shape, np.float32)
        for i, row in enumerate(rows):
            row_segments = None if segments is None else segments[i]
            tokens[i], weights[i] = self.masked(targets[i], row_segments, mask_rng(self.seed, split, step, row))
        batch = {"tokens": tokens, "targets": targets, "loss_weights": weights}
        return batch | ({"segment_ids": segments} if self.packed else {})

    def metrics(self, step: int, batch_size: int) -> dict[str, float]:
        """What the source reports of training steps [0, step) (a mixture: tokens per source)."""
        metrics = getattr(self.source, "metrics", None)
        return metrics(step, batch_size) if metrics else {}

    def masked(
        self, tokens: np.ndarray, segments: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """One row (T,): its inputs with the chosen positions masked, replaced or kept, and its loss weights."""
        candidates = ~self.vocab.special[tokens] if segments is None else ~self.vocab.special[tokens] & (segments != 0)
        inputs, weights = tokens.copy(), np.zeros(tokens.shape, np.float32)
        if not candidates.any():  # a row of padding: nothing to predict
            return inputs, weights
        budget = max(1, round(self.mask_rate * int(candidates.sum())))
        words = word_ids(tokens, candidates, segments, self.vocab.words) if self.whole_words else None
        if words is not None and words.max() >= 0:
            chosen = _whole_words(words, budget, rng)
        else:  # token masking, or a row with no word (all whitespace)
            chosen = np.sort(rng.choice(np.flatnonzero(candidates), budget, replace=False))
        action = rng.random(len(chosen))
        replaced = chosen[(action >= MASKED) & (action < REPLACED)]
        inputs[chosen[action < MASKED]] = self.vocab.mask_id
        inputs[replaced] = self._ordinary[rng.integers(len(self._ordinary), size=len(replaced))]
        weights[chosen] = 1.0
        return inputs, weights


def word_ids(tokens: np.ndarray, candidates: np.ndarray, segments: np.ndarray | None, marks: WordMarks) -> np.ndarray:
    """(T,) int: each position's word, numbered from 0 along the row; -1 outside every word. A word never spans
    two documents of a packed row, nor a position that is not a candidate (padding, a special)."""
    inside = candidates & ~marks.outside[tokens]
    joins = inside[:-1] & inside[1:] & ~marks.opens[tokens[1:]] & ~marks.closes[tokens[:-1]]
    if segments is not None:
        joins &= segments[1:] == segments[:-1]
    starts = inside & ~np.concatenate([[False], joins])
    return np.where(inside, np.cumsum(starts) - 1, -1)


def _whole_words(words: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    """The positions of whole words taken in random order while they fit in `budget` positions (one that would
    overshoot is passed over, as BERT's data code does); at least one word."""
    sizes = np.bincount(words[words >= 0])
    taken, total = [], 0
    for word in rng.permutation(len(sizes)):
        if total + sizes[word] <= budget:
            taken.append(word)
            total += sizes[word]
            if total == budget:
                break
    if not taken:  # every word is longer than the budget: the first in the random order
        taken = [int(rng.integers(len(sizes)))]
    return np.flatnonzero(np.isin(words, taken))
