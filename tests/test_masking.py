"""Masked-language-model data (jaxtrain.data.masking): the chosen share is the mask rate and BERT's 80/10/10 split
holds within binomial bounds; a row's masking is a pure function of (seed, split, step, row), whoever asks for it;
padding and special tokens are never chosen; whole words are chosen whole (byte text, a WordPiece tokenizer and a
byte-level BPE built here, nothing downloaded); bad input is one line; bert-tiny trains on it on 8 devices."""

import math
import re

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from jaxtrain.data.datasets import SyntheticFeatures, TokenOptions, TokenWindows, make_dataset
from jaxtrain.data.masking import (
    BYTE_SPECIALS,
    MaskedTokens,
    MaskOptions,
    byte_vocab,
    synthetic_vocab,
    tokenizer_vocab,
    tokenizer_words,
    word_ids,
)
from jaxtrain.data.shards import tokenize
from jaxtrain.data.text_classes import sentiment_records
from jaxtrain.errors import UserInputError
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.loop import train

TEXTS = [r["text"] for r in sentiment_records(600)]
TEXT = "\n".join(TEXTS).encode()  # ~35 KB of short words between spaces, newlines and punctuation
WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def byte_masking(rate: float = 0.15, whole_words: bool = False, seed: int = 0, seq_len: int = 64) -> MaskedTokens:
    windows = TokenWindows(np.frombuffer(TEXT, np.uint8), seq_len, seed)
    return MaskedTokens(windows, byte_vocab(), seq_len, seed, rate, whole_words)


class FixedRows:
    """A language-model source whose row r is always `ids[r % len(ids)]` (padded with `pad`, segment id 0)."""

    task = "lm"

    def __init__(self, ids: list[list[int]], seq_len: int, pad: int = 0):
        self.tokens = np.full((len(ids), seq_len + 1), pad, np.int32)
        self.segments = np.zeros_like(self.tokens)
        for i, row in enumerate(ids):
            row = row[: seq_len + 1]
            self.tokens[i, : len(row)], self.segments[i, : len(row)] = row, 1

    def shapes(self, batch_size):
        shape = jax.ShapeDtypeStruct((batch_size, self.tokens.shape[1]), np.int32)
        return {"tokens": shape, "segment_ids": shape}

    def rows(self, split, step, rows, batch_size):
        index = np.asarray(rows) % len(self.tokens)
        return {"tokens": self.tokens[index], "segment_ids": self.segments[index]}


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    """A lower-casing WordPiece of 120 tokens (BERT's specials, [CLS] text [SEP]) trained here on the texts."""
    root = tmp_path_factory.mktemp("wordpiece")
    hf = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=120, special_tokens=WORDPIECE_SPECIALS, show_progress=False)
    hf.train_from_iterator(TEXTS, trainer)
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, hf.token_to_id(t)) for t in ("[CLS]", "[SEP]")]
    )
    hf.save(str(root / "tok.json"))
    return root / "tok.json", hf


def byte_level_bpe(path, specials=("<|endoftext|>", "<mask>")) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) of 300 tokens trained here on the texts, saved at `path`."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=alphabet, show_progress=False
    )
    hf.train_from_iterator(TEXTS, trainer)
    hf.save(str(path))
    return hf


def same_partition(ours: np.ndarray, oracle: np.ndarray) -> bool:
    """Whether two labellings of positions (-1: none) group them alike."""

    def canonical(labels):
        first = {}
        return [-1 if x < 0 else first.setdefault(x, len(first)) for x in labels]

    return canonical(list(ours)) == canonical(list(oracle))


def chosen_whole(weights: np.ndarray, words: np.ndarray) -> bool:
    """Whether every word (label >= 0) is chosen in full or not at all, and nothing outside a word is chosen."""
    chosen = weights > 0
    return not chosen[words < 0].any() and all(len(set(chosen[words == w])) == 1 for w in set(words[words >= 0]))


@pytest.mark.parametrize("rate", [0.15, 0.4])
def test_the_chosen_share_is_the_rate_and_bert_split_holds(rate):
    rows = byte_masking(rate).rows("train", 0, range(400), 400)
    chosen = rows["loss_weights"] > 0
    # Exactly round(rate x 64) positions of each row of 64 bytes (no padding, no specials in byte text).
    assert (chosen.sum(axis=1) == round(rate * 64)).all()
    inputs, targets, n = rows["tokens"][chosen], rows["targets"][chosen], int(chosen.sum())
    masked = inputs == BYTE_SPECIALS.mask
    replaced = ~masked & (inputs != targets)
    # A random replacement is the original byte again 1 time in 256: then it counts as unchanged.
    for share, p in [(masked, 0.8), (replaced, 0.1 * 255 / 256), (~masked & ~replaced, 0.1 + 0.1 / 256)]:
        assert abs(share.mean() - p) < 4 * math.sqrt(p * (1 - p) / n), (share.mean(), p, n)
    assert (inputs[replaced] < 256).all()  # replacements are bytes, never a special id
    np.testing.assert_array_equal(rows["tokens"][~chosen], rows["targets"][~chosen])


def test_a_rows_masking_depends_on_seed_split_step_and_row_alone():
    data = byte_masking()
    whole = data.rows("train", 5, range(8), 8)
    for part in (range(2, 4), range(7, 8)):  # what one process of several asks for
        sliced = data.rows("train", 5, part, 8)
        for key in whole:
            np.testing.assert_array_equal(sliced[key], whole[key][part.start : part.stop])
    again = byte_masking().rows("train", 5, range(8), 8)  # a fresh dataset: a resumed run
    assert all(np.array_equal(whole[k], again[k]) for k in whole)
    for other in (byte_masking(seed=1).rows("train", 5, range(8), 8), data.rows("train", 6, range(8), 8)):
        assert not np.array_equal(whole["loss_weights"], other["loss_weights"])
    assert not np.array_equal(whole["loss_weights"], data.rows("val", 5, range(8), 8)["loss_weights"])
    # Masking draws from its own stream, not the source's: the same tokens in two rows are masked differently.
    same = MaskedTokens(FixedRows([list(TEXT[:65])], 64), byte_vocab(), 64, seed=0).rows("train", 0, range(4), 4)
    assert (same["targets"] == same["targets"][0]).all()
    assert len({same["loss_weights"][i].tobytes() for i in range(4)}) == 4


def test_padding_is_never_chosen_whatever_its_id():
    source = FixedRows([list(TEXT[i : i + n]) for i, n in [(0, 10), (50, 30), (90, 3)]], 32, pad=ord("x"))
    for whole_words in (False, True):
        rows = MaskedTokens(source, byte_vocab(), 32, 0, 0.5, whole_words).rows("train", 0, range(300), 300)
        padding = rows["segment_ids"] == 0
        assert padding.any() and not rows["loss_weights"][padding].any()
        assert (rows["tokens"][padding] == ord("x")).all()
        budget = np.maximum(1, np.round(0.5 * (~padding).sum(axis=1)))
        for weights, allowed in zip(rows["loss_weights"], budget):
            # Over the budget only where one word is more than the budget, the one word taken.
            chosen = np.flatnonzero(weights)
            assert len(chosen) <= allowed or (whole_words and np.all(np.diff(chosen) == 1)), (chosen, allowed)


def test_whole_byte_words_are_chosen_whole():
    data = byte_masking(0.15, whole_words=True)
    rows = data.rows("train", 0, range(200), 200)
    for targets, weights in zip(rows["targets"], rows["loss_weights"]):
        words = np.full(len(targets), -1)
        for k, match in enumerate(re.finditer(rb"\S+", targets.astype(np.uint8).tobytes())):
            words[match.start() : match.end()] = k
        assert chosen_whole(weights, words)
        assert 1 <= weights.sum() <= round(0.15 * 64)  # words fill the budget without passing it (or one word)
    assert abs(rows["loss_weights"].mean() - 0.15) < 0.03  # short words: the budget is nearly filled
    # A packed row's documents end its words: "the end" and "the plot" side by side are four words, not three.
    packed = np.frombuffer(b"the endthe plot", np.uint8)
    segments = np.repeat([1, 2], [7, 8])
    words = word_ids(packed, np.ones(len(packed), bool), segments, byte_vocab().words)
    np.testing.assert_array_equal(words, [0, 0, 0, -1, 1, 1, 1, 2, 2, 2, -1, 3, 3, 3, 3])


def test_wordpiece_words_padding_and_specials(wordpiece):
    path, hf = wordpiece
    vocab = tokenizer_vocab(path)
    assert vocab.mask_id == hf.token_to_id("[MASK]")
    assert vocab.special[[hf.token_to_id(t) for t in WORDPIECE_SPECIALS]].all()
    encodings = hf.encode_batch(TEXTS[:64])  # [CLS] text [SEP], many shorter than a row: padded
    pad = hf.token_to_id("[PAD]")
    source = FixedRows([e.ids for e in encodings], 40, pad)
    rows = MaskedTokens(source, vocab, 40, seed=0, mask_rate=0.3, whole_words=True).rows("train", 0, range(64), 64)
    for encoding, weights, segments in zip(encodings, rows["loss_weights"], rows["segment_ids"]):
        oracle = np.array([-1 if w is None else w for w in encoding.word_ids][:40] + [-1] * (40 - len(encoding.ids)))
        assert chosen_whole(weights, oracle)  # the tokenizer's own words, [CLS] and [SEP] in none
        assert weights.sum() >= 1 and not weights[segments == 0].any()
    padding = rows["segment_ids"] == 0
    assert padding.any() and (rows["tokens"][padding] == pad).all()
    assert not vocab.special[rows["tokens"][(rows["loss_weights"] > 0) & (rows["tokens"] != vocab.mask_id)]].any()


def test_tokenized_shards_mask_with_their_tokenizer_inside_documents(wordpiece, tmp_path):
    path, hf = wordpiece
    (tmp_path / "text.txt").write_text("\n\n".join(TEXTS))
    tokenize(
        path, [tmp_path / "text.txt"], tmp_path / "shards", val_fraction=0.2, documents="paragraphs", progress=False
    )
    options = TokenOptions(packing="segments")
    masking = MaskOptions(0.2, whole_words=True)
    data = make_dataset(
        f"tokens:{tmp_path / 'shards'}", "mlm", seq_len=48, seed=0, vocab_size=128, tokens=options, masking=masking
    )
    rows = data.rows("train", 0, range(16), 16)
    assert set(rows) == {"tokens", "targets", "loss_weights", "segment_ids"}
    assert {k: v.shape for k, v in data.shapes(16).items()} == {k: v.shape for k, v in rows.items()}
    assert (rows["tokens"] == hf.token_to_id("[MASK]")).any()
    assert not rows["loss_weights"][rows["segment_ids"] == 0].any()
    for tokens, segments, weights in zip(rows["targets"], rows["segment_ids"], rows["loss_weights"]):
        words = word_ids(tokens, segments != 0, segments, tokenizer_vocab(path).words)
        for w in set(words[words >= 0]):
            assert len(set(segments[words == w])) == 1  # no word spans two documents
        assert chosen_whole(weights, words)


def test_byte_level_bpe_words_are_runs_of_non_space_bytes(tmp_path):
    hf = byte_level_bpe(tmp_path / "bpe.json")
    vocab = tokenizer_vocab(tmp_path / "bpe.json")
    assert vocab.mask_id == hf.token_to_id("<mask>")
    text = "the plot  was not fine;\nthe end,\tso superb!\n\n it ran long"
    ids = np.array(hf.encode(text).ids)
    pieces = [hf.decode([i]) for i in ids]  # each token's own text (ASCII: no byte of a character split off)
    assert "".join(pieces) == text
    starts = np.cumsum([0] + [len(p) for p in pieces])
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    oracle = []
    for piece, start in zip(pieces, starts):
        at = start + len(piece) - len(piece.lstrip())  # the token's first non-space character
        oracle.append(next((k for k, (a, b) in enumerate(spans) if a <= at < b), -1) if piece.strip() else -1)
    assert same_partition(word_ids(ids, np.ones(len(ids), bool), None, vocab.words), np.array(oracle))


def test_sentencepiece_style_pieces_open_words_at_their_space_mark():
    vocab = {"<unk>": 0, "<mask>": 1, "▁the": 2, "▁cat": 3, "s": 4, "▁sat": 5, "<0x0A>": 6, "on": 7, "▁": 8, "at▁": 9}
    hf = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    hf.add_special_tokens(["<unk>", "<mask>"])
    special = np.zeros(len(vocab), bool)
    special[[0, 1]] = True
    marks = tokenizer_words(hf, special)
    ids = np.array([2, 3, 4, 5, 6, 7, 8, 7, 1, 9, 7])  # "the cats sat\non on", a special, "at on"
    np.testing.assert_array_equal(word_ids(ids, ~special[ids], None, marks), [0, 1, 1, 2, -1, 3, -1, 4, -1, 5, 6])


def one_line_error(call, match: str) -> str:
    with pytest.raises(UserInputError, match=match) as err:
        call()
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def test_bad_masking_input_is_one_line(tmp_path):
    windows = TokenWindows(np.frombuffer(TEXT, np.uint8), 32, 0)
    for rate in (0, 1, 1.5):
        one_line_error(lambda r=rate: MaskedTokens(windows, byte_vocab(), 32, 0, mask_rate=r), f"mask rate {rate}")
        one_line_error(
            lambda r=rate: apply_overrides(default_config("bert-tiny"), [f"mask_rate={r}"]), "data.mask_rate"
        )
    one_line_error(lambda: MaskedTokens(windows, byte_vocab(), 64, 0), "at least 64 tokens")
    one_line_error(lambda: MaskedTokens(SyntheticFeatures(8, 2, 0), byte_vocab(), 8, 0), "language-model dataset")
    whole_words = MaskOptions(whole_words=True)
    one_line_error(
        lambda: make_dataset("synthetic", "mlm", seq_len=8, seed=0, masking=whole_words), "whole_words=false"
    )
    small = one_line_error(
        lambda: make_dataset("builtin", "mlm", seq_len=8, seed=0, vocab_size=256), "vocab_size >= 260"
    )
    assert "[MASK] 256" in small
    byte_level_bpe(tmp_path / "no-mask.json", specials=("<|endoftext|>",))
    one_line_error(lambda: tokenizer_vocab(tmp_path / "no-mask.json"), "no mask token")
    plain = Tokenizer(models.WordLevel({"[MASK]": 0, "[UNK]": 1, "cat": 2}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.add_special_tokens(["[MASK]", "[UNK]"])
    plain.save(str(tmp_path / "words.json"))
    vocab = tokenizer_vocab(tmp_path / "words.json")  # fine for single tokens, but it says nothing of words
    one_line_error(lambda: MaskedTokens(windows, vocab, 32, 0, whole_words=True), "does not say")
    assert synthetic_vocab(16).words is None


def test_bert_trains_on_masked_builtin_text_on_a_hybrid_mesh():
    overrides = ["batch_size=8", "seq_len=32", "steps=2", "log_every=1", "eval_every=100", "progress=false"]
    cfg = apply_overrides(default_config("bert-tiny"), [*overrides, "mesh=data=2,fsdp=2,tensor=2"])
    summary = train(cfg, log=lambda *_: None, devices=jax.devices()[:8])
    assert summary["steps"] == 2 and math.isfinite(summary["loss"]) and summary["loss"] > 0
    assert summary["run"].tokens_per_step == 8 * 32
