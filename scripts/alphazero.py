"""AlphaZero on Connect Four (pgx): actors play the current network against itself with mctx's search, a replay
buffer keeps their positions, and a learner trains the network with jaxtrain's sharded train step on a mesh; at the
end the network plays 200 games against a random player and 200 against its own step-0 self. Prints JSON.

    python scripts/alphazero.py --simulated-devices 8 --mesh data=8 --iterations 40

Each iteration: one batch of self-play games (one jitted program, the games batched), then `--learner-steps` steps of
the compiled step (`jaxtrain.build(...).train_step`: the run's optimizer, schedule and shardings) on batches the
buffer draws.

With `--checkpoint-dir DIR` the run is saved every `--checkpoint-every` iterations and after the last, through
jaxtrain's own checkpoint and resume code (`jaxtrain.save_checkpoint`, `jaxtrain.resume`): the train state, and beside
it the replay buffer and the step-0 network; the self-play flags are the run's settings, which a resume must give
alike. The same command resumes from DIR's newest checkpoint, on any mesh, to the games and losses of an uninterrupted
run. The application uses jaxtrain's public API only; its own pieces are in scripts/alphazero_app/.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import jaxtrain  # noqa: E402  (imports no JAX)

if TYPE_CHECKING:
    from alphazero_app.replay import ReplayBuffer

EVERY = 5  # iterations between checkpoints by default
SETTINGS = ("games", "simulations", "learner_steps", "capacity")  # flags that define a run besides its run config


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `least`, else argparse's usage error saying what was expected."""

    def parse(text: str) -> int:
        value = int(text) if text.lstrip("-").isdigit() else None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got '{text}'")
        return value

    return parse


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulated-devices", type=at_least(1), help="N simulated CPU devices")
    parser.add_argument("--mesh", default="data=-1", help="the learner's mesh (default data=-1)")
    parser.add_argument("--model", default="alphazero-connect4")
    parser.add_argument("--iterations", type=at_least(1), default=40, help="self-play + learning rounds")
    parser.add_argument("--games", type=at_least(1), default=64, help="self-play games per iteration")
    parser.add_argument("--simulations", type=at_least(1), default=16, help="search simulations per move")
    parser.add_argument("--learner-steps", type=at_least(1), default=20, help="train steps per iteration")
    parser.add_argument("--batch-size", type=at_least(1), default=256)
    parser.add_argument("--capacity", type=at_least(1), default=50_000, help="replay buffer positions")
    parser.add_argument("--eval-games", type=at_least(2), default=200)
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--devices", type=at_least(1), help="use the first N devices (default: all)")
    parser.add_argument("--checkpoint-dir", help="save the run here, and resume from its newest checkpoint here")
    parser.add_argument("--checkpoint-every", type=at_least(1), help=f"iterations per checkpoint (default {EVERY})")
    parser.add_argument("--allow-config-change", help="run config keys a resume may change (steps: more iterations)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides")
    args = parser.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir DIR, where to save")
    args.checkpoint_every = args.checkpoint_every or EVERY
    return args


def run_config(args: argparse.Namespace) -> jaxtrain.RunConfig:
    """The learner's run config: the model, mesh, batch, seed, schedule length and checkpointing the flags give (a
    checkpoint every `--checkpoint-every` iterations is one every that many learner steps), then overrides."""
    steps = args.iterations * args.learner_steps
    flags = [f"mesh={args.mesh}", f"steps={steps}", f"batch_size={args.batch_size}", f"seed={args.seed}",
             "learning_rate=1e-3", "warmup_steps=20"]  # fmt: skip
    if args.allow_config_change:
        flags.append(f"checkpoint.allow_change={args.allow_config_change}")
    if args.checkpoint_dir:
        every = args.checkpoint_every * args.learner_steps
        flags += [f"checkpoint.dir={args.checkpoint_dir}", f"checkpoint.every={every}"]
    return jaxtrain.config(args.model, overrides=[*flags, *args.overrides])


def selfplay_settings(args: argparse.Namespace) -> dict[str, int]:
    """The flags that define a run's trajectory besides its run config: a resume must give the checkpoint's."""
    return {name: getattr(args, name) for name in SETTINGS}


def check_flags(args: argparse.Namespace, device_count: int) -> None:
    """Refuse flags that would run, but not as asked: fewer devices than --devices names, or a replay buffer smaller
    than one batch (every batch would draw the same positions several times)."""
    if args.devices is not None and args.devices > device_count:
        raise jaxtrain.UserInputError(
            f"--devices {args.devices}: this process has {device_count} devices; give at most {device_count}, or "
            f"more with --simulated-devices {args.devices}."
        )
    if args.capacity < args.batch_size:
        raise jaxtrain.UserInputError(
            f"--capacity {args.capacity} is below --batch-size {args.batch_size}: every batch would repeat positions; "
            f"give --capacity of at least {args.batch_size}."
        )


def train_alphazero(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Self-play and learn up to `args.iterations` rounds (resuming from `args.checkpoint_dir`'s newest checkpoint, if
    any), then evaluate. Returns the report: its losses and first self-play moves are those this call played."""
    import jax
    import pgx
    from alphazero_app.replay import ReplayBuffer

    check_flags(args, jax.device_count())
    env = pgx.make("connect_four")
    cfg = run_config(args)
    with jaxtrain.run_lock(cfg.checkpoint.dir, log):  # one writer per checkpoint directory
        # Another run's checkpoints are refused before anything compiles.
        run_name = jaxtrain.check_resume(cfg, selfplay_settings(args))
        buffer = ReplayBuffer(env.observation_shape, env.num_actions, args.capacity, args.seed)
        run = jaxtrain.build(cfg, log=lambda *_: None, devices=jax.devices()[: args.devices], dataset=buffer)
        check_games(args, run)
        with jaxtrain.open_checkpoints(cfg) or contextlib.nullcontext() as checkpoints:
            learner = Learner(args, run, buffer, checkpoints, run_name, log)
            report = _iterate(args, env, learner, log)
    return {**report, "mesh": cfg.mesh, "devices": len(jax.devices()), "eval_games": args.eval_games}


class Learner:
    """The learner's side of a run: its train state, the step-0 network's params and where it stands, saved with
    the replay buffer through jaxtrain's checkpoints (`checkpoints`: None without --checkpoint-dir). It starts from
    the newest checkpoint (its positions restored into `buffer`), or as the new run `run_name`."""

    def __init__(self, args: argparse.Namespace, run: Any, buffer: ReplayBuffer, checkpoints: Any, run_name: str, log):
        self.args, self.run, self.buffer, self.checkpoints, self.log = args, run, buffer, checkpoints, log
        self.settings = selfplay_settings(args)
        self._start(run_name)

    def _start(self, run_name: str) -> None:
        import jax
        import jax.numpy as jnp

        abstract = self.run.shardings.abstract_model_state()
        # The step-0 params as the actors take them, the model's own layout: the script has no pipeline layouts.
        extras = {"initial_params": abstract["params"], "replay": self.buffer.saved_shapes()}
        resumed = self.checkpoints and jaxtrain.resume(self.run, self.checkpoints, self.log, extras, self.settings)
        if resumed:
            self.buffer.restore(resumed.extras["replay"])
            self.state, self.initial, self.progress = resumed.state, resumed.extras["initial_params"], resumed.progress
            return
        self.state = self.run.shardings.init_state(self.run.optimizer, self.args.seed)
        self.initial = jax.tree.map(jnp.copy, self.state["params"])  # a copy: the train step donates the state's
        self.progress = jaxtrain.Progress(run=run_name)

    @property
    def iteration(self) -> int:
        """Iterations done."""
        return self.progress.step // self.args.learner_steps

    def learn(self) -> list:
        """One iteration's `--learner-steps` steps on batches the buffer draws; returns their losses (on device)."""
        losses = []
        for _ in range(self.args.learner_steps):
            self.state, metrics = self.run.train_step(self.state, self.run.batch("train", self.progress.step))
            self.progress.step += 1
            losses.append(metrics["loss"])
        return losses

    def save(self, stopping: bool) -> None:
        """Save the iteration just done if one is due (or the run is `stopping`); returns once the arrays are off the
        devices, so the next step may reuse the state's buffers."""
        checkpoints, step = self.checkpoints, self.progress.step
        if checkpoints and (stopping or checkpoints.due(step, self.run.cfg.train.steps)):
            extras = {"initial_params": self.initial, "replay": self.buffer.saved()}
            jaxtrain.save_checkpoint(self.run, checkpoints, self.state, self.progress, self.log, extras, self.settings)

    def wait(self) -> None:
        """Block until every started save is on disk."""
        if self.checkpoints:
            self.checkpoints.wait()


def _iterate(args: argparse.Namespace, env, learner: Learner, log) -> dict:
    """The iterations from the newest checkpoint (or the start) to `args.iterations`, saving when due; then the
    evaluation. Returns the report's figures."""
    import jax
    from alphazero_app.selfplay import training_rows

    forward, play = _actors(args, env, learner.run)
    start, key = learner.iteration, jax.random.key(args.seed)
    acting = learning = 0.0
    losses, first_actions = [], None
    # SIGTERM (preemption) or Ctrl-C finishes the iteration, saves it (with --checkpoint-dir) and stops (`Preempted`).
    with jaxtrain.stop_signals() as stop:
        for iteration in range(start, args.iterations):
            begin = time.perf_counter()
            games = jax.device_get(play(learner.state["params"], jax.random.fold_in(key, iteration)))
            first_actions = games["action"] if first_actions is None else first_actions
            learner.buffer.add(training_rows(games))
            middle = time.perf_counter()
            losses += learner.learn()
            loss = float(losses[-1])
            done = time.perf_counter()
            # This call's first iteration compiles both programs: throughput counts the others.
            acting, learning = (acting + middle - begin, learning + done - middle) if iteration > start else (0.0, 0.0)
            seconds = f"{middle - begin:.1f} s self-play, {done - middle:.1f} s learning"
            log(f"iteration {iteration + 1}: {len(learner.buffer)} positions, loss {loss:.4f} ({seconds})")
            learner.save(stopping=stop.is_set())
            if stop.is_set() and iteration + 1 < args.iterations:
                learner.wait()
                raise jaxtrain.Preempted(learner.progress.step, stop.signum)
    learner.wait()  # the last save is on disk before the run reports success
    timed = max(args.iterations - start - 1, 1)
    return {
        "iterations": args.iterations,
        "resumed_from_iteration": start,
        "learner_steps": args.iterations * args.learner_steps,
        "positions": len(learner.buffer),
        "final_loss": float(losses[-1]) if losses else None,
        "selfplay_games_per_sec": args.games * timed / acting if acting else float("nan"),
        "learner_steps_per_sec": args.learner_steps * timed / learning if learning else float("nan"),
        **_evaluate(args, env, forward, learner, jax.random.fold_in(key, 10**6)),
        "losses": [float(x) for x in losses],
        "first_selfplay_actions": None if first_actions is None else first_actions.tolist(),
    }


def _evaluate(args: argparse.Namespace, env, forward, learner: Learner, key) -> dict[str, float]:
    """The final network's mean score against uniformly random moves and against its step-0 self."""
    import jax
    from alphazero_app.selfplay import match

    evaluate = jax.jit(functools.partial(match, forward, env, games=args.eval_games, simulations=args.simulations))
    return {
        "score_vs_random": float(evaluate(learner.state["params"], None, key).mean()),
        "score_vs_step0": float(evaluate(learner.state["params"], learner.initial, key).mean()),
    }


def games_axes(run) -> tuple[str, ...]:
    """The learner mesh's batch axes of more than one device: self-play splits its games over them."""
    return tuple(a for a in run.shardings.rules.batch_axes() if run.shardings.mesh.shape[a] > 1)


def check_games(args: argparse.Namespace, run) -> None:
    """Refuse a number of games that does not split evenly over the devices self-play runs on."""
    splits = math.prod(run.shardings.mesh.shape[a] for a in games_axes(run))
    if args.games % splits:
        raise jaxtrain.UserInputError(
            f"--games {args.games} does not split over the {splits} devices of the mesh's batch axes "
            f"({', '.join(games_axes(run))}): give a multiple of {splits}."
        )


def _actors(args: argparse.Namespace, env, run) -> tuple:
    """The network as a function of its params, and the jitted self-play of one iteration's games: one program plays
    every game, the games split over the learner mesh's batch axes."""
    import jax
    from alphazero_app.selfplay import self_play
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    graphdef = run.shardings.model.graphdef

    def forward(params, observation):
        return nnx.merge(graphdef, params)(observation)

    per_move = NamedSharding(run.shardings.mesh, PartitionSpec(None, games_axes(run)))
    shardings = {k: per_move for k in ("observation", "policy", "action", "player", "valid")}
    shardings["outcome"] = NamedSharding(run.shardings.mesh, PartitionSpec(games_axes(run)))
    play = jax.jit(
        functools.partial(self_play, forward, env, games=args.games, simulations=args.simulations),
        out_shardings=shardings,
    )
    return forward, play


def main(argv: list[str]) -> int:
    """The command: exit 0 with the report printed; 2 for bad input (one line, unless --debug); 128 + the signal's
    number when stopped by SIGTERM or Ctrl-C."""
    args = parse(argv)
    try:
        if args.simulated_devices:
            jaxtrain.use_simulated_devices(args.simulated_devices)
        jaxtrain.enable_compilation_cache()
        report = train_alphazero(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    except jaxtrain.Preempted as stop:
        saved = "checkpoint saved: rerun the same command to resume" if args.checkpoint_dir else "nothing saved"
        print(f"{stop} (learner step), {saved}", file=sys.stderr)
        return stop.exit_status
    except jaxtrain.UserInputError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
