"""Batches are a pure function of (seed, split, step, row): deterministic, resumable, topology-independent."""

import jax
import numpy as np
import pytest
from conftest import shared_file
from helpers import make_run

from jaxtrain.data.datasets import DataError, Digits, SyntheticTokens, builtin_text, global_batch, make_dataset
from jaxtrain.placement.model import PlacementError
from jaxtrain.sharding.rules import ShardingRuleError


def test_builtin_text_is_real_and_deterministic():
    text = builtin_text()
    assert len(text) >= 1_000_000 and b"def " in text and text == builtin_text()


def test_rows_do_not_depend_on_how_the_batch_is_split():
    data = SyntheticTokens(256, 16, seed=3)
    whole = data.rows("train", 5, range(0, 8), 8)["tokens"]
    halves = [data.rows("train", 5, range(a, a + 4), 8)["tokens"] for a in (0, 4)]
    np.testing.assert_array_equal(whole, np.concatenate(halves))
    assert not np.array_equal(whole, data.rows("train", 6, range(0, 8), 8)["tokens"])
    assert not np.array_equal(whole, data.rows("val", 5, range(0, 8), 8)["tokens"])


def test_global_batch_is_the_same_on_any_mesh():
    runs = [make_run(mesh) for mesh in ("data=8", "data=2,fsdp=2,tensor=2")]
    first, second = (jax.device_get(r.batch("train", 2)["tokens"]) for r in runs)
    np.testing.assert_array_equal(first, second)
    assert runs[0].batch("train", 2)["tokens"].sharding.spec[0] == "data"


def test_text_targets_are_inputs_shifted():
    data = make_dataset("builtin", "lm", seq_len=16, seed=0)
    tokens = data.rows("train", 0, range(2), 2)["tokens"]
    assert tokens.shape == (2, 17) and tokens.max() < 256


def test_missing_text_file():
    with pytest.raises(DataError, match=r"data file 'nope.txt' does not exist"):
        make_dataset("nope.txt", "lm", seq_len=16, seed=0)


def test_missing_digits_file(tmp_path):
    with pytest.raises(DataError, match=r"digits data not found at"):
        make_dataset(str(tmp_path / "digits.csv.gz"), "classification", seq_len=1, seed=0)


def test_wrong_data_for_model():
    with pytest.raises(DataError, match="is for clicks models, but this model needs classification data"):
        make_dataset("clicks", "classification", seq_len=1, seed=0)


def test_batch_not_divisible_by_batch_axes():
    with pytest.raises(
        PlacementError,
        match=r"global batch size 6 is not divisible by 1 accumulation step\(s\) x 8 devices "
        r"on the batch axes \(data=8\). Use a batch size that is a multiple of 8",
    ):
        make_run("data=8", ["batch_size=6"])


def test_parameter_not_divisible_by_its_axes_names_it():
    # gpt-tiny has 4 heads: 8-way tensor parallelism cannot split them.
    with pytest.raises(
        ShardingRuleError,
        match=r"'blocks/w_out': dimension 'heads' of size 4 is not divisible by "
        r"mesh axes \('tensor',\)",
    ):
        make_run("tensor=8")


def test_digits_epochs_visit_every_example_once():
    data = Digits(shared_file("digits.csv.gz"), seed=0)
    n = len(data.splits["train"][1])
    seen = np.concatenate([data.rows("train", 0, range(n), n)["x"]])
    assert len(np.unique(seen, axis=0)) == len(np.unique(data.splits["train"][0], axis=0))


def test_global_batch_from_process_local_rows():
    run = make_run("data=2,fsdp=2,tensor=2")
    shardings = run.train_step.input_shardings[0][1]
    batch = global_batch(run.dataset, "train", 0, 8, shardings)
    assert batch["tokens"].shape == (8, 33) and batch["tokens"].sharding == shardings["tokens"]
