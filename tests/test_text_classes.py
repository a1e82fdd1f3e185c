"""Text classification from JSON lines (jaxtrain.data.text_classes): texts tokenized byte-level ([CLS] bytes [SEP],
padded) or with a tokenizer's own specials, labels as integers or names, every bad line one error naming its file and
line, validation disjoint from training, rows pure in (seed, split, step, row); the generated builtin task needs its
negations; bert_classifier-tiny trains on it on 8 devices."""

import json
import math

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from jaxtrain.data.datasets import make_dataset
from jaxtrain.data.masking import BYTE_SPECIALS
from jaxtrain.data.text_classes import (
    NEGATIVE,
    POSITIVE,
    TextOptions,
    sentiment_records,
    sentiment_review,
    write_sentiment_jsonl,
)
from jaxtrain.errors import UserInputError
from jaxtrain.run_config import TASK_DATA, apply_overrides, default_config
from jaxtrain.training.loop import train

CLS, SEP, PAD = BYTE_SPECIALS.cls, BYTE_SPECIALS.sep, BYTE_SPECIALS.pad


def jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def load(source, seq_len=16, n_classes=2, vocab_size=320, val_fraction=0.25, seed=0, **options):
    return make_dataset(
        source, "text_classification", seq_len=seq_len, seed=seed, vocab_size=vocab_size, classes=n_classes,
        val_fraction=val_fraction, text=TextOptions(**options),
    )  # fmt: skip


def test_texts_are_bytes_between_cls_and_sep_padded_and_cut(tmp_path):
    records = [{"text": "héllo", "label": 1}, {"text": "x" * 40, "label": 0}]
    data = load(jsonl(tmp_path / "a.jsonl", records), val_path=jsonl(tmp_path / "v.jsonl", records))
    val = data.rows("val", 0, range(2), 2)  # validation walks its file in order
    short = [CLS, *"héllo".encode(), SEP]
    np.testing.assert_array_equal(val["tokens"][0], short + [PAD] * (16 - len(short)))
    np.testing.assert_array_equal(val["segment_ids"][0], [1] * len(short) + [0] * (16 - len(short)))
    np.testing.assert_array_equal(val["tokens"][1], [CLS] + [ord("x")] * 14 + [SEP])  # cut, [SEP] kept
    assert (val["segment_ids"][1] == 1).all() and list(val["labels"]) == [1, 0]
    assert {k: (v.shape, v.dtype) for k, v in val.items()} == {
        "tokens": ((2, 16), np.int32), "segment_ids": ((2, 16), np.int32), "labels": ((2,), np.int32),
    }  # fmt: skip


def test_label_names_and_fields(tmp_path):
    records = [{"body": f"t{i}", "y": y} for i, y in enumerate(["pos", "neg", 2, "meh"])]
    data = load(
        jsonl(tmp_path / "a.jsonl", records), n_classes=3, val_path=jsonl(tmp_path / "v.jsonl", records),
        text_field="body", label_field="y", label_names="neg, pos,meh",
    )  # fmt: skip
    assert list(data.rows("val", 0, range(4), 4)["labels"]) == [1, 0, 2, 2]


def test_a_tokenizer_brings_its_own_specials(tmp_path):
    texts = [r["text"] for r in sentiment_records(200)]
    hf = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    hf.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=100, special_tokens=specials, show_progress=False)
    )
    hf.save(str(tmp_path / "tok.json"))  # no post-processor: its [CLS] and [SEP] are put around each text
    records = [{"text": "the plot was fine", "label": 1}, {"text": " ".join(texts[:5]), "label": 0}]
    path = jsonl(tmp_path / "a.jsonl", records)
    data = load(path, vocab_size=128, val_path=path, tokenizer=str(tmp_path / "tok.json"))
    rows = data.rows("val", 0, range(2), 2)
    cls, sep, pad = (hf.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    inner = hf.encode("the plot was fine", add_special_tokens=False).ids
    np.testing.assert_array_equal(rows["tokens"][0], [cls, *inner, sep] + [pad] * (16 - len(inner) - 2))
    assert rows["tokens"][1][0] == cls and rows["tokens"][1][-1] == sep and (rows["segment_ids"][1] == 1).all()
    with pytest.raises(UserInputError, match="vocab_size >= 100"):
        load(path, vocab_size=64, val_path=path, tokenizer=str(tmp_path / "tok.json"))
    hf.post_processor = processors.TemplateProcessing(single="$A [SEP]", special_tokens=[("[SEP]", sep)])
    hf.save(str(tmp_path / "own.json"))  # a post-processor of its own is what adds the specials
    rows = load(path, vocab_size=128, val_path=path, tokenizer=str(tmp_path / "own.json")).rows("val", 0, range(1), 1)
    np.testing.assert_array_equal(rows["tokens"][0][: len(inner) + 1], [*inner, sep])


LINE_ERRORS = [  # (lines of the file, options, what the error must say)
    (['{"text": "a"}'], {}, r"line 1 has no field 'label' \(its fields: 'text'\): set data.label_field"),
    (['{"label": 0, "body": "a"}'], {}, r"line 1 has no field 'text' \(its fields: 'label', 'body'\)"),
    (['{"text": "a", "label": 1}', '{"text": "b", "label": 5}'], {}, r"line 2: label 5, .*n_classes=2.*n_classes=6"),
    (['{"text": "a", "label": -1}'], {}, r"line 1: label -1: expected 0..1"),
    (['{"text": "a", "label": "pos"}'], {}, r"line 1: label 'pos' is not a class index: set data.label_names"),
    (['{"text": "a", "label": "meh"}'], {"label_names": "neg,pos"}, r"line 1: label 'meh' is not one of .*neg, pos"),
    (['{"text": "a", "label": true}'], {}, r"line 1: label true: expected an integer 0..1"),
    (['{"text": 3, "label": 0}'], {}, r"line 1: field 'text' is 3: expected a string"),
    (['{"text": "a", "label": 0}', "", '{"text": "b", label: 1}'], {}, r"line 3 is not JSON \(.*\): expected one JSON"),
    (['["a", 0]'], {}, r"line 1 is a JSON list: expected an object"),
    ([], {}, r"holds no examples"),
    (["", "  "], {}, r"holds no examples"),
]


@pytest.mark.parametrize(("lines", "options", "message"), LINE_ERRORS)
def test_each_bad_line_is_one_error_naming_file_and_line(tmp_path, lines, options, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n" * bool(lines))
    with pytest.raises(UserInputError, match=message) as err:
        load(str(path), **options)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_bad_settings_are_one_line_errors(tmp_path):
    good = jsonl(tmp_path / "a.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1}])
    for options, message in [
        ({"label_names": "neg,neg"}, "distinct, non-empty names"),
        ({"label_names": "a,b,c"}, "names 3 classes .* n_classes=2: set n_classes=3"),
        ({"val_path": str(tmp_path / "missing.jsonl")}, "missing.jsonl' does not exist"),
    ]:
        with pytest.raises(UserInputError, match=message) as err:
            load(good, **options)
        assert "\n" not in str(err.value)
    for call, message in [
        (lambda: load(good, vocab_size=256), r"ids up to 259.*vocab_size >= 260"),
        (lambda: load(good, seq_len=2), "no room for text"),
        (lambda: load(good, val_fraction=0.9), "2 examples: too few to hold out"),
        (lambda: load("digits"), "holds no labelled texts"),
    ]:
        with pytest.raises(UserInputError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


def test_validation_is_held_out_by_seed_and_rows_are_pure(tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"text": f"example {i}", "label": i % 2} for i in range(40)])

    def texts(data, split, n):
        rows = data.rows(split, 0, range(n), n)
        return {bytes(t[s == 1][1:-1].astype(np.uint8)).decode() for t, s in zip(rows["tokens"], rows["segment_ids"])}

    data = load(path)
    train_texts, val_texts = texts(data, "train", 30), texts(data, "val", 10)
    assert len(train_texts) == 30 and len(val_texts) == 10  # one epoch of training sees each example once
    assert not train_texts & val_texts and len(train_texts | val_texts) == 40
    assert texts(load(path), "val", 10) == val_texts  # the same split every time
    assert texts(load(path, seed=1), "val", 10) != val_texts  # a shuffle by the seed
    whole = data.rows("train", 3, range(8), 8)
    part = data.rows("train", 3, range(2, 5), 8)
    assert all(np.array_equal(whole[k][2:5], part[k]) for k in whole)  # whichever process asks
    assert not np.array_equal(whole["tokens"], data.rows("train", 4, range(8), 8)["tokens"])


def test_the_builtin_task_needs_its_negations(tmp_path):
    records = sentiment_records(2000)
    assert 0.45 < np.mean([r["label"] for r in records]) < 0.55
    longest = max(len(r["text"].encode()) for r in records)
    assert longest + 2 <= TASK_DATA["text_classification"].seq_len  # [CLS] text [SEP] is never cut by default

    def words_vote(text, negations):
        votes, flip = 0, False
        for word in text.replace(",", " ").replace(";", " ").split():
            if word == "not" and negations:
                flip = True
            elif word in POSITIVE or word in NEGATIVE:
                votes += (1 if word in POSITIVE else -1) * (-1 if flip else 1)
                flip = False
        return int(votes > 0)

    # The stated rule gives every label; counting opinion words without their "not" gets over a third wrong (0.635
    # right, measured on 4096).
    assert all(words_vote(r["text"], True) == r["label"] for r in records)
    assert np.mean([words_vote(r["text"], False) == r["label"] for r in records]) < 0.7
    path = write_sentiment_jsonl(tmp_path / "sentiment.jsonl", 100, seed=3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == sentiment_records(100, seed=3)


def test_the_builtin_rows_are_reviews_drawn_by_seed_split_step_and_row():
    data = load("builtin", seq_len=128)
    rows = data.rows("train", 2, range(6), 6)
    review = sentiment_review(np.random.default_rng((0, 0, 2, 4)))  # seed 0, train, step 2, row 4
    assert rows["labels"][4] == review["label"]
    np.testing.assert_array_equal(rows["tokens"][4][rows["segment_ids"][4] == 1], [CLS, *review["text"].encode(), SEP])
    part = data.rows("train", 2, range(3, 5), 6)
    assert all(np.array_equal(rows[k][3:5], part[k]) for k in rows)
    assert not np.array_equal(rows["tokens"], data.rows("val", 2, range(6), 6)["tokens"])
    assert not np.array_equal(
        rows["tokens"], load("builtin", seq_len=128, seed=1).rows("train", 2, range(6), 6)["tokens"]
    )


def test_synthetic_rows_have_the_models_shapes():
    data = load("synthetic", seq_len=8, n_classes=5, vocab_size=50)
    rows = data.rows("train", 0, range(64), 64)
    assert rows["tokens"].shape == (64, 8) and rows["tokens"].max() < 50 and set(rows["labels"]) == set(range(5))


def test_bert_classifier_trains_on_the_builtin_task_on_a_hybrid_mesh():
    overrides = ["batch_size=8", "seq_len=64", "steps=2", "log_every=1", "eval_every=2", "eval_batches=1"]
    cfg = apply_overrides(default_config("bert_classifier-tiny"), [*overrides, "progress=false"])
    summary = train(
        apply_overrides(cfg, ["mesh=data=2,fsdp=2,tensor=2"]), log=lambda *_: None, devices=jax.devices()[:8]
    )
    assert summary["steps"] == 2 and math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    assert 0 <= summary["val_accuracy"] <= 1 and summary["run"].tokens_per_step == 8 * 64
