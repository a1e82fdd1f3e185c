"""How labelled training data is split over replicas: uniform, stratified (the global class mix on every replica)
and by_label (a few classes a replica), each still a pure function of (seed, split, step, row)."""

import numpy as np
import pytest

from jaxtrain.data.datasets import DataError, Digits, make_dataset

# 500 images, unevenly spread over 10 classes so that "the global mix" is not just "balanced".
CLASS_COUNTS = [40, 45, 50, 55, 60, 40, 45, 50, 55, 60]
BATCH, REPLICAS, STEPS = 32, 4, 20


@pytest.fixture(scope="module")
def digits_csv(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.repeat(np.arange(10), CLASS_COUNTS))
    table = np.column_stack([rng.integers(0, 17, (len(labels), 64)), labels])
    path = tmp_path_factory.mktemp("data") / "digits.csv"
    np.savetxt(path, table, fmt="%d", delimiter=",")
    return str(path)


def replica_labels(data: Digits) -> list[np.ndarray]:
    """Each replica's training labels over STEPS batches of BATCH rows."""
    batches = np.stack([data.rows("train", step, range(BATCH), BATCH)["y"] for step in range(STEPS)])
    return np.split(batches, data.replicas, axis=1)


def class_mix(labels: np.ndarray) -> np.ndarray:
    return np.bincount(labels.ravel(), minlength=10) / labels.size


def test_uniform_is_the_unpartitioned_stream(digits_csv):
    data = Digits(digits_csv, seed=3, partition="uniform", replicas=REPLICAS)
    default = Digits(digits_csv, seed=3)
    for step in range(STEPS):
        for key, value in data.rows("train", step, range(BATCH), BATCH).items():
            np.testing.assert_array_equal(value, default.rows("train", step, range(BATCH), BATCH)[key])
    # The documented stream, across the end of the first epoch: sample g is example perm_epoch[g mod N].
    features, _ = data.splits["train"]
    n, samples = len(features), 12 * BATCH + np.arange(BATCH)
    expected = [features[np.random.default_rng((3, e)).permutation(n)[i]] for e, i in zip(samples // n, samples % n)]
    np.testing.assert_array_equal(data.rows("train", 12, range(BATCH), BATCH)["x"], np.stack(expected))


def test_stratified_replicas_each_have_the_global_class_mix(digits_csv):
    data = Digits(digits_csv, seed=0, partition="stratified", replicas=REPLICAS)
    overall = class_mix(data.splits["train"][1])
    worst = max(np.abs(class_mix(labels) - overall).max() for labels in replica_labels(data))
    uniform = Digits(digits_csv, seed=0, replicas=REPLICAS)
    worst_uniform = max(np.abs(class_mix(labels) - overall).max() for labels in replica_labels(uniform))
    # 160 labels a replica: a shuffle is off by 7 or more in some class; stratified by 3 (0.02) at most.
    assert worst <= 0.02 < worst_uniform


def test_stratified_replicas_see_disjoint_data_within_an_epoch(digits_csv):
    data = Digits(digits_csv, seed=0, partition="stratified", replicas=REPLICAS)
    # 400 training images, 100 a replica: 12 steps of 8 rows a replica stay inside the first epoch.
    x = np.concatenate([data.rows("train", step, range(BATCH), BATCH)["x"] for step in range(12)])
    assert len(np.unique(x, axis=0)) == len(x)


@pytest.mark.parametrize(
    "replicas, classes",
    [
        (4, [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9, 0, 1}]),
        (8, [{2 * k % 10, (2 * k + 1) % 10} for k in range(8)]),  # 10 classes, 8 replicas: 2 each, wrapping
    ],
)
def test_by_label_replicas_see_only_their_classes(digits_csv, replicas, classes):
    data = Digits(digits_csv, seed=0, partition="by_label", replicas=replicas)
    seen = [set(labels.ravel().tolist()) for labels in replica_labels(data)]
    assert seen == classes and set().union(*seen) == set(range(10))


@pytest.mark.parametrize("partition", ["uniform", "stratified", "by_label"])
def test_partitioned_rows_are_deterministic_and_built_per_process(digits_csv, partition):
    data, again = (Digits(digits_csv, seed=1, partition=partition, replicas=REPLICAS) for _ in range(2))
    whole = data.rows("train", 7, range(BATCH), BATCH)
    np.testing.assert_array_equal(whole["x"], again.rows("train", 7, range(BATCH), BATCH)["x"])
    # A process holding rows 5..20 (parts of three replicas) builds exactly those rows of the batch.
    part = again.rows("train", 7, range(5, 21), BATCH)
    np.testing.assert_array_equal(part["x"], whole["x"][5:21])
    assert not np.array_equal(whole["x"], data.rows("train", 8, range(BATCH), BATCH)["x"])
    # Validation is never partitioned.
    val = Digits(digits_csv, seed=1).rows("val", 2, range(BATCH), BATCH)
    np.testing.assert_array_equal(data.rows("val", 2, range(BATCH), BATCH)["x"], val["x"])


def test_make_dataset_passes_the_partition_on(digits_csv):
    data = make_dataset(digits_csv, "classification", seq_len=1, seed=0, partition="by_label", replicas=REPLICAS)
    expected = Digits(digits_csv, seed=0, partition="by_label", replicas=REPLICAS)
    np.testing.assert_array_equal(
        data.rows("train", 3, range(BATCH), BATCH)["x"], expected.rows("train", 3, range(BATCH), BATCH)["x"]
    )


def test_unknown_partition(digits_csv):
    with pytest.raises(DataError, match=r"unknown data partition 'iid'\. Use one of: uniform, stratified, by_label"):
        make_dataset(digits_csv, "classification", seq_len=1, seed=0, partition="iid")


@pytest.mark.parametrize("source", ["synthetic", "builtin"])
def test_label_partitions_need_labelled_data(source):
    with pytest.raises(DataError, match=rf"data.partition=stratified .* needs labelled data .*'{source}'"):
        make_dataset(source, "lm", seq_len=16, seed=0, partition="stratified", replicas=2)


def test_batch_must_split_over_the_replicas(digits_csv):
    data = Digits(digits_csv, seed=0, partition="by_label", replicas=3)
    match = r"batch size 32 does not split evenly over 3 replicas .* a multiple of 3"
    with pytest.raises(DataError, match=match):
        data.shapes(32)
    with pytest.raises(DataError, match=match):
        data.rows("train", 0, range(8), 32)


def test_replicas_must_be_positive(digits_csv):
    with pytest.raises(DataError, match="at least 1 replica"):
        Digits(digits_csv, seed=0, partition="stratified", replicas=0)
