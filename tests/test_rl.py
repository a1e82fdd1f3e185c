"""AlphaZero-style reinforcement learning, an application beside the library (`scripts/alphazero.py` and
`scripts/alphazero_app/`, on jaxtrain's public API): a library that knows nothing of it, the replay buffer and the value
targets without the game, the checks that keep a resume to its own run, then (slow) self-play and learning on 1 and 4
devices, a run resumed from its checkpoint on either, and a network that learns to win."""

import ast
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxtrain
from jaxtrain.registry import TASKS
from jaxtrain.training import run_identity
from jaxtrain.training.checkpoint import Checkpoints
from jaxtrain.training.run_identity import RunIdentityError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from alphazero import parse, run_config, selfplay_settings  # noqa: E402
from alphazero_app.replay import ReplayBuffer  # noqa: E402

SMALL = ["--games", "8", "--simulations", "4", "--learner-steps", "3", "--batch-size", "16", "--eval-games", "4"]


APPLICATION_NAMES = ("selfplay", "alphazero")


def code_strings(path: Path) -> list[str]:
    """The string constants of `path`'s code, its docstrings aside (they may name an application as an example)."""
    tree = ast.parse(path.read_text())
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]
    docstrings = {id(scope.body[0].value) for scope in scopes if ast.get_docstring(scope) is not None}
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        and id(n) not in docstrings
    ]  # fmt: skip


def test_the_library_knows_no_application():
    """No library module imports the games or the search (pgx, mctx) or names an application in its code, and every
    task the registry knows is a kind of data the library makes, or `custom`: data the run brings."""
    from jaxtrain.data.datasets import make_dataset

    for path in sorted((ROOT / "jaxtrain").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {name.split(".")[0] for name in imported} & {"pgx", "mctx"}, f"{path} imports {imported}"
        named = [text for text in code_strings(path) if any(app in text.lower() for app in APPLICATION_NAMES)]
        assert not named, f"{path} names an application: {named}"
    for task in set(TASKS) - {"custom"}:
        assert make_dataset("synthetic", task, seq_len=8, seed=0).task == task
    with pytest.raises(jaxtrain.UserInputError, match="task is 'custom'.*dataset=..."):
        make_dataset("synthetic", "custom", seq_len=8, seed=0)


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


def test_the_replay_buffer_saves_padded_to_its_capacity_and_restores():
    buffer = ReplayBuffer((6, 7, 2), 7, capacity=5, seed=3)
    buffer.add(positions(3))
    saved = buffer.saved()
    assert saved["value"].shape == (5,) and int(saved["size"]) == 3
    assert {k: (x.shape, x.dtype) for k, x in saved.items()} == {
        k: (x.shape, x.dtype) for k, x in buffer.saved_shapes().items()
    }
    restored = ReplayBuffer((6, 7, 2), 7, capacity=5, seed=3)
    restored.restore(saved)
    for name, array in buffer.data.items():
        np.testing.assert_array_equal(restored.data[name], array)
    draw = buffer.rows("train", 4, range(8), 8)
    np.testing.assert_array_equal(restored.rows("train", 4, range(8), 8)["value"], draw["value"])


def test_checkpoint_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        parse(["--checkpoint-dir", "runs/az", "--checkpoint-every", "0"])
    assert "argument --checkpoint-every: expected an integer >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--checkpoint-every", "2"])
    assert "--checkpoint-every 2 needs --checkpoint-dir DIR" in capsys.readouterr().err
    assert parse(["--checkpoint-dir", "runs/az"]).checkpoint_every == 5


def saved_run(directory: Path, flags: list[str], settings: bool = True) -> Path:
    """A checkpoint in `directory` as the run of `flags` writes one after 4 iterations of 3 learner steps: its meta
    (`jaxtrain.save_checkpoint`'s: the run config, the self-play settings) and a stand-in array. Returns its step."""
    args = parse(flags)
    meta = {"step": 12, "config": run_identity.config_json(run_config(args))}
    meta |= {"settings": selfplay_settings(args)} if settings else {}
    with Checkpoints(directory, 1, async_save=False) as checkpoints:
        checkpoints.save(12, {"params": np.zeros(3, np.float32)}, meta)
    return directory / "12"


def refusal(flags: list[str]) -> str:
    """The message `jaxtrain.check_resume` refuses the run of `flags` with."""
    args = parse(flags)
    with pytest.raises(RunIdentityError) as refused:
        jaxtrain.check_resume(run_config(args), selfplay_settings(args))
    return str(refused.value)


def test_a_resume_must_be_the_same_run_unless_a_change_is_allowed(tmp_path):
    directory = tmp_path / "ckpt"
    step_dir = saved_run(directory, [*SMALL, "--iterations", "4", "--model", "alphazero-tiny"])
    here = ["--checkpoint-dir", str(directory)]
    message = refusal(["--games", "16", "--iterations", "4", *here])
    assert f"cannot resume in {directory}: its newest checkpoint, {step_dir}, was written by a run with" in message
    assert 'model_name: "alphazero-tiny" in the checkpoint, "alphazero-connect4" now' in message
    assert "model.hidden: 32 in the checkpoint, 128 now" in message
    assert "give another --checkpoint-dir" in message
    message = refusal([*SMALL, "--games", "16", "--iterations", "4", "--model", "alphazero-tiny", *here])
    assert "was written by a run with other settings:\n  games: 8 in the checkpoint, 16 now" in message
    assert "give another checkpoint directory" in message

    # Extending a run changes its learning-rate schedule (train.steps): refused unless allowed.
    longer = [*SMALL, "--iterations", "6", "--model", "alphazero-tiny", *here]
    assert "train.steps: 12 in the checkpoint, 18 now" in refusal(longer)
    assert "--allow-config-change train.steps" in refusal(longer)
    allowed = parse([*longer, "--allow-config-change", "steps"])
    assert jaxtrain.check_resume(run_config(allowed), selfplay_settings(allowed))  # the stored run's name

    other = tmp_path / "other"  # e.g. a checkpoint of the same config without the self-play settings
    saved_run(other, [*SMALL, "--iterations", "4"], settings=False)
    message = refusal([*SMALL, "--iterations", "4", "--checkpoint-dir", str(other)])
    assert "other settings:\n  games: null in the checkpoint, 8 now" in message


def test_value_targets_are_the_outcome_for_the_player_who_moved():
    from alphazero_app.selfplay import training_rows

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


def test_another_runs_checkpoints_are_refused_before_anything_compiles(tmp_path, monkeypatch):
    from alphazero import train_alphazero

    directory = tmp_path / "ckpt"
    saved_run(directory, [*SMALL, "--iterations", "4", "--model", "alphazero-tiny"])
    before = sorted(p.name for p in directory.iterdir())
    monkeypatch.setattr(jaxtrain, "build", lambda *_, **__: pytest.fail("built the run"))
    args = parse([*SMALL, "--iterations", "4", "--checkpoint-dir", str(directory)])
    with pytest.raises(RunIdentityError, match='model_name: "alphazero-tiny" in the checkpoint'):
        train_alphazero(args, log=lambda *_: None)
    assert sorted(p.name for p in directory.iterdir()) == before


def alphazero(devices: int, *flags: str) -> dict:
    """The report of the small run of `flags` on mesh data=`devices`."""
    from alphazero import train_alphazero

    args = parse([*SMALL, *flags, "--mesh", f"data={devices}", "--devices", str(devices)])
    return train_alphazero(args, log=lambda *_: None)


# 4 iterations saved after each (the newest 3 kept: learner steps 6, 9, 12); a buffer of 400 positions is full by the
# third iteration's end, so a resume restores a full one.
CHECKPOINTED = ["--iterations", "4", "--capacity", "400", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("whole") / "ckpt"
    return directory, alphazero(4, *CHECKPOINTED, "--checkpoint-dir", str(directory))


@pytest.mark.slow  # one run on one device; the 4-device run is the resume tests' (their programs shared)
def test_actors_and_learner_equal_on_one_and_four_devices(uninterrupted):
    """The same self-play moves from a rollout on one device and one whose games are
    split over 4 devices; then the same learner losses on mesh data=1 and data=4 from the same buffer."""
    _, four = uninterrupted
    one = alphazero(1, *CHECKPOINTED[:4])  # the same run on one device, unsaved (saving does not change a number)
    assert one["positions"] == four["positions"]
    np.testing.assert_array_equal(one["first_selfplay_actions"], four["first_selfplay_actions"])
    assert len(one["losses"]) == 12  # 4 iterations: every learner step of the run on both meshes
    np.testing.assert_allclose(one["losses"], four["losses"], rtol=1e-5)


def replay(step_dir: Path) -> dict[str, np.ndarray]:
    """The replay buffer checkpoint `step_dir` holds, as numpy arrays (the rest is not read)."""
    import orbax.checkpoint as ocp

    target = {"replay": ReplayBuffer((6, 7, 2), 7, capacity=400, seed=0).saved_shapes()}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.PyTreeCheckpointer() as checkpointer:
        args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        return checkpointer.restore(step_dir / "state", args=args)["replay"]


@pytest.mark.slow  # five runs of the small AlphaZero, most programs from the compilation cache: ~40 s
@pytest.mark.parametrize("devices", [4, 1])
def test_a_resumed_run_equals_an_uninterrupted_one(uninterrupted, devices, tmp_path):
    """The run on data=4 as if killed after its second iteration (its later checkpoints removed), resumed by the same
    command on data=4 or data=1: its third iteration plays the uninterrupted run's games (the buffers the two save
    after it hold the same positions), its learner takes the same losses and its network scores the same. Rerun once
    more, it has nothing left to do and evaluates the final checkpoint alike."""
    whole, straight = uninterrupted
    directory = tmp_path / "ckpt"
    shutil.copytree(whole, directory)
    for later in ("9", "12"):
        shutil.rmtree(directory / later)
    resumed = alphazero(devices, *CHECKPOINTED, "--checkpoint-dir", str(directory))
    assert resumed["resumed_from_iteration"] == 2 and len(resumed["losses"]) == 6  # this call's steps: 7-12
    np.testing.assert_allclose(resumed["losses"], straight["losses"][6:], rtol=1e-5)
    # The third iteration's games: the same positions and outcomes; the search's visit distributions agree to float32
    # rounding when the device count differs (3e-6 from 4 to 1 devices), as the learner's losses do.
    saved, reference = replay(directory / "9"), replay(whole / "9")
    for name in ("observation", "value", "size"):
        np.testing.assert_array_equal(saved[name], reference[name], err_msg=name)
    np.testing.assert_allclose(saved["policy"], reference["policy"], rtol=1e-5, atol=1e-7)
    scores = ("positions", "score_vs_random", "score_vs_step0")
    assert {k: resumed[k] for k in scores} == {k: straight[k] for k in scores}
    again = alphazero(devices, *CHECKPOINTED, "--checkpoint-dir", str(directory))
    assert again["resumed_from_iteration"] == 4 and again["losses"] == [] and again["first_selfplay_actions"] is None
    assert {k: again[k] for k in scores} == {k: straight[k] for k in scores}


@pytest.mark.slow  # two runs of the small AlphaZero, their programs from the compilation cache
def test_a_signal_saves_the_iteration_and_a_rerun_resumes_it(uninterrupted, tmp_path):
    """SIGTERM (a preemption) during the first iteration of a run that would save only at its end: the iteration
    finishes, is saved, and the run stops with `Preempted` (exit status 143 from the script); the rerun resumes
    after it and takes the uninterrupted run's losses."""
    from alphazero import train_alphazero

    _, straight = uninterrupted
    directory = tmp_path / "ckpt"
    flags = [*SMALL, *CHECKPOINTED, "--checkpoint-every", "4", "--checkpoint-dir", str(directory), "--mesh", "data=4"]

    def preempt_during_the_first_iteration(message: str) -> None:
        if message.startswith("iteration 1:"):
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(jaxtrain.Preempted) as stopped:
        train_alphazero(parse([*flags, "--devices", "4"]), log=preempt_during_the_first_iteration)
    assert (stopped.value.step, stopped.value.exit_status) == (3, 143)
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["3"]
    resumed = train_alphazero(parse([*flags, "--devices", "4"]), log=lambda *_: None)
    assert resumed["resumed_from_iteration"] == 1
    np.testing.assert_allclose(resumed["losses"], straight["losses"][3:], rtol=1e-5)


@pytest.mark.slow  # a few minutes of self-play and learning
def test_alphazero_learns_to_beat_random_and_its_first_self():
    from alphazero import parse, train_alphazero

    # 20 iterations, not docs/rl.md's 30: self-play is most of the time. Measured on 8 devices (2026-12-06), scores
    # against random / step 0 (200 games each): 30 iterations 0.955 / 0.850, 20 iterations 0.945 / 0.835; fewer fell
    # to the thresholds (12 iterations 0.925 / 0.780; 16 of 40 learner steps 0.925 / 0.780; 20 at 8 simulations 0.900
    # / 0.820).
    args = parse(["--iterations", "20", "--games", "128", "--simulations", "16", "--learner-steps", "30"])
    report = train_alphazero(args, log=lambda *_: None)
    assert report["score_vs_random"] >= 0.9, report
    assert report["score_vs_step0"] >= 0.75, report
    assert report["selfplay_games_per_sec"] > 0 and report["learner_steps_per_sec"] > 0
