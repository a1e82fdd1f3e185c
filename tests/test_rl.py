"""AlphaZero-style reinforcement learning (`jaxtrain.rl`, `scripts/alphazero.py`): the replay buffer and the value
targets without the game, then (slow) self-play and learning on 1 and 4 devices, and a network that learns to win."""

import sys
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.rl.replay import ReplayBuffer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def positions(n: int, start: int = 0) -> dict[str, np.ndarray]:
    values = np.arange(start, start + n, dtype=np.float32)
    return {
        "observation": np.broadcast_to(values[:, None, None, None], (n, 6, 7, 2)).copy(),
        "policy": np.full((n, 7), 1 / 7, np.float32),
        "value": values,
    }


def test_the_replay_buffer_keeps_the_newest_and_draws_by_step_and_row():
    buffer = ReplayBuffer((6, 7, 2), 7, capacity=5, seed=3)
    buffer.add(positions(4))
    buffer.add(positions(3, start=4))
    assert len(buffer) == 5 and list(buffer.data["value"]) == [2, 3, 4, 5, 6]
    first, again = buffer.rows("train", 7, range(0, 8), 8), buffer.rows("train", 7, range(4, 8), 8)
    np.testing.assert_array_equal(first["value"][4:], again["value"])  # a row is the same whoever builds it
    assert not np.array_equal(first["value"], buffer.rows("train", 8, range(0, 8), 8)["value"])
    assert set(first["value"]) <= set(buffer.data["value"])


def test_value_targets_are_the_outcome_for_the_player_who_moved():
    from jaxtrain.rl.selfplay import training_rows

    games = {  # 3 moves of 2 games; game 0 won by player 1 after its 2 moves, game 1 drawn after 3
        "observation": np.zeros((3, 2, 6, 7, 2)),
        "policy": np.full((3, 2, 7), 1 / 7),
        "player": np.array([[0, 1], [1, 0], [0, 1]]),
        "valid": np.array([[True, True], [True, True], [False, True]]),
        "outcome": np.array([[-1.0, 1.0], [0.0, 0.0]]),
    }
    rows = training_rows(games)
    assert list(rows["value"]) == [-1.0, 0.0, 1.0, 0.0, 0.0]


pgx = pytest.importorskip("pgx", reason="self-play needs the rl extra: pip install -e '.[rl]'")


@pytest.mark.slow  # two compiles of the search: ~1 min
def test_actors_and_learner_equal_on_one_and_four_devices():
    """The same self-play moves from a rollout on one device and one whose games are
    split over 4 devices; then the same learner losses on mesh data=1 and data=4 from the same buffer."""
    from alphazero import parse, train_alphazero

    small = ["--iterations", "2", "--games", "8", "--simulations", "4", "--learner-steps", "3", "--batch-size", "16"]
    reports = {
        devices: train_alphazero(
            parse([*small, "--eval-games", "4", "--mesh", f"data={devices}", "--devices", str(devices)]),
            log=lambda *_: None,
        )  # fmt: skip
        for devices in (1, 4)
    }
    one, four = reports[1], reports[4]
    assert one["positions"] == four["positions"]
    np.testing.assert_array_equal(one["first_selfplay_actions"], four["first_selfplay_actions"])
    np.testing.assert_allclose(one["losses"], four["losses"], rtol=1e-5)


@pytest.mark.slow  # a few minutes of self-play and learning
def test_alphazero_learns_to_beat_random_and_its_first_self():
    from alphazero import parse, train_alphazero

    args = parse(["--iterations", "30", "--games", "128", "--simulations", "16", "--learner-steps", "30"])
    report = train_alphazero(args, log=lambda *_: None)
    assert report["score_vs_random"] >= 0.9, report
    assert report["score_vs_step0"] >= 0.75, report
    assert report["selfplay_games_per_sec"] > 0 and report["learner_steps_per_sec"] > 0
