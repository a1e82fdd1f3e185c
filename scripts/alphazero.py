"""AlphaZero on Connect Four (pgx): actors play the current network against itself with mctx's search, a replay
buffer keeps their positions, and a learner trains the network with jaxtrain's sharded train step on a mesh; at the
end the network plays 200 games against a random player and 200 against its own step-0 self. Prints JSON.

    python scripts/alphazero.py --simulated-devices 8 --mesh data=8 --iterations 40

Each iteration: one batch of self-play games (one jitted program, the games batched), then `--learner-steps` steps of
the compiled step (`Setup.train_step`: the run's optimizer, schedule and shardings) on batches the buffer draws.

With `--checkpoint-dir DIR` the run is saved every `--checkpoint-every` iterations and after the last (the train
state, the replay buffer, the iteration and the step-0 network: `jaxtrain/rl/checkpoint.py`), and the same command
resumes from DIR's newest checkpoint, on any mesh, to the games and losses of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxtrain.cli import command, flag_type  # noqa: E402  (imports no JAX)
from jaxtrain.devices import enable_compilation_cache, use_simulated_devices  # noqa: E402

if TYPE_CHECKING:
    from jaxtrain.run_config import RunConfig

EVERY = 5  # iterations between checkpoints by default


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulated-devices", type=flag_type(at_least=1), help="N simulated CPU devices")
    parser.add_argument("--mesh", default="data=-1", help="the learner's mesh (default data=-1)")
    parser.add_argument("--model", default="alphazero-connect4")
    parser.add_argument("--iterations", type=flag_type(at_least=1), default=40, help="self-play + learning rounds")
    parser.add_argument("--games", type=flag_type(at_least=1), default=64, help="self-play games per iteration")
    parser.add_argument("--simulations", type=flag_type(at_least=1), default=16, help="search simulations per move")
    parser.add_argument("--learner-steps", type=flag_type(at_least=1), default=20, help="train steps per iteration")
    parser.add_argument("--batch-size", type=flag_type(at_least=1), default=256)
    parser.add_argument("--capacity", type=flag_type(at_least=1), default=50_000, help="replay buffer positions")
    parser.add_argument("--eval-games", type=flag_type(at_least=2), default=200)
    parser.add_argument("--seed", type=flag_type(at_least=0), default=0)
    parser.add_argument("--devices", type=flag_type(at_least=1), help="use the first N devices (default: all)")
    parser.add_argument("--checkpoint-dir", help="save the run here, and resume from its newest checkpoint here")
    parser.add_argument(
        "--checkpoint-every", type=flag_type(at_least=1), help=f"iterations between checkpoints (default {EVERY})"
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides")
    args = parser.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir DIR, where to save")
    args.checkpoint_every = args.checkpoint_every or EVERY
    return args


def run_config(args: argparse.Namespace) -> RunConfig:
    """The learner's run config: the model, mesh, batch, seed and schedule length the flags give, then overrides."""
    from jaxtrain.run_config import apply_overrides, default_config

    steps = args.iterations * args.learner_steps
    overrides = [f"mesh={args.mesh}", f"steps={steps}", f"batch_size={args.batch_size}", f"seed={args.seed}"]
    return apply_overrides(default_config(args.model), [*overrides, "learning_rate=1e-3", "warmup_steps=20",
                                                        *args.overrides])  # fmt: skip


def selfplay_settings(args: argparse.Namespace) -> dict[str, int]:
    """The flags that define a run's trajectory besides its run config: a resume must give the checkpoint's."""
    return {name: getattr(args, name) for name in ("games", "simulations", "learner_steps", "capacity")}


def train_alphazero(args: argparse.Namespace, log=print) -> dict:
    """Self-play and learn up to `args.iterations` rounds (resuming from `args.checkpoint_dir`'s newest checkpoint, if
    any), then evaluate. Returns the report: its losses and first self-play moves are those this call played."""
    import jax
    import pgx

    from jaxtrain.rl.checkpoint import SelfPlayCheckpoints, check_resume
    from jaxtrain.rl.replay import ReplayBuffer
    from jaxtrain.training import run_lock
    from jaxtrain.training.setup import build

    env = pgx.make("connect_four")
    cfg, settings = run_config(args), selfplay_settings(args)
    directory = args.checkpoint_dir or ""
    with run_lock.holding(directory, log):  # one writer per checkpoint directory
        if directory:
            check_resume(directory, cfg, settings)  # another run's checkpoints are refused before anything compiles
        buffer = ReplayBuffer(env.observation_shape, env.num_actions, args.capacity, args.seed)
        run = build(cfg, log=lambda *_: None, devices=jax.devices()[: args.devices], dataset=buffer)
        checkpoints = SelfPlayCheckpoints(directory, args.checkpoint_every, run, settings) if directory else None
        with checkpoints or contextlib.nullcontext():
            report = _iterate(args, env, run, buffer, checkpoints, log)
    return {**report, "mesh": cfg.mesh, "devices": len(jax.devices()), "eval_games": args.eval_games}


def _iterate(args: argparse.Namespace, env, run, buffer, checkpoints, log) -> dict:
    """The iterations from the newest checkpoint (or the start) to `args.iterations`, saving when due; then the
    evaluation. Returns the report's figures."""
    import jax

    from jaxtrain.rl.selfplay import match, training_rows
    from jaxtrain.training.recovery import Preempted, StopRequest, stop_signals

    forward, play = _actors(args, env, run)
    state, initial, start = _start(run, checkpoints, buffer, args.seed, log)
    key = jax.random.key(args.seed)
    acting = learning = 0.0
    losses, first_actions = [], None
    # With checkpoints, SIGTERM (preemption) or Ctrl-C finishes the iteration, saves it and stops (`Preempted`).
    with stop_signals() if checkpoints else contextlib.nullcontext(StopRequest()) as stop:
        for iteration in range(start, args.iterations):
            begin = time.perf_counter()
            games = jax.device_get(play(state["params"], jax.random.fold_in(key, iteration)))
            first_actions = games["action"] if first_actions is None else first_actions
            buffer.add(training_rows(games))
            middle = time.perf_counter()
            for step in range(iteration * args.learner_steps, (iteration + 1) * args.learner_steps):
                state, metrics = run.train_step(state, run.batch("train", step))
                losses.append(metrics["loss"])
            loss = float(metrics["loss"])
            done = time.perf_counter()
            # This call's first iteration compiles both programs: throughput counts the others.
            acting, learning = (acting + middle - begin, learning + done - middle) if iteration > start else (0.0, 0.0)
            seconds = f"{middle - begin:.1f} s self-play, {done - middle:.1f} s learning"
            log(f"iteration {iteration + 1}: {len(buffer)} positions, loss {loss:.4f} ({seconds})")
            if checkpoints and (stop.is_set() or checkpoints.due(iteration + 1, args.iterations)):
                checkpoints.save(iteration + 1, state, initial, buffer)
            if stop.is_set() and iteration + 1 < args.iterations:
                checkpoints.wait()
                raise Preempted((iteration + 1) * args.learner_steps, stop.signum)
    if checkpoints:
        checkpoints.wait()  # the last save is on disk before the run reports success
    timed = max(args.iterations - start - 1, 1)
    evaluate = jax.jit(functools.partial(match, forward, env, games=args.eval_games, simulations=args.simulations))
    eval_key = jax.random.fold_in(key, 10**6)
    return {
        "iterations": args.iterations,
        "resumed_from_iteration": start,
        "learner_steps": args.iterations * args.learner_steps,
        "positions": len(buffer),
        "final_loss": float(losses[-1]) if losses else None,
        "selfplay_games_per_sec": args.games * timed / acting if acting else float("nan"),
        "learner_steps_per_sec": args.learner_steps * timed / learning if learning else float("nan"),
        "score_vs_random": float(evaluate(state["params"], None, eval_key).mean()),
        "score_vs_step0": float(evaluate(state["params"], initial, eval_key).mean()),
        "losses": [float(x) for x in losses],
        "first_selfplay_actions": None if first_actions is None else first_actions.tolist(),
    }


def _actors(args: argparse.Namespace, env, run) -> tuple:
    """The network as a function of its params, and the jitted self-play of one iteration's games: one program plays
    every game, the games split over the learner mesh's batch axes."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtrain.rl.selfplay import self_play

    graphdef = run.plan.model.graphdef

    def forward(params, observation):
        return nnx.merge(graphdef, params)(observation)

    games_axes = tuple(a for a in run.plan.rules.batch_axes() if run.plan.mesh.shape[a] > 1)
    per_move = NamedSharding(run.plan.mesh, PartitionSpec(None, games_axes))
    shardings = {k: per_move for k in ("observation", "policy", "action", "player", "valid")}
    shardings["outcome"] = NamedSharding(run.plan.mesh, PartitionSpec(games_axes))
    play = jax.jit(
        functools.partial(self_play, forward, env, games=args.games, simulations=args.simulations),
        out_shardings=shardings,
    )
    return forward, play


def _start(run, checkpoints, buffer, seed: int, log) -> tuple:
    """The train state, the step-0 network's params and the iterations done: from the newest checkpoint (its positions
    restored into `buffer`), or a new run's."""
    import jax
    import jax.numpy as jnp

    resumed = checkpoints.restore_latest(buffer, log) if checkpoints else None
    if resumed:
        return resumed.state, resumed.initial_params, resumed.iteration
    state = run.plan.init_state(run.optimizer, seed)
    return state, jax.tree.map(jnp.copy, state["params"]), 0  # a copy: the train step donates the state's buffers


@command
def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.simulated_devices:
        use_simulated_devices(args.simulated_devices)
    enable_compilation_cache()
    from jaxtrain.training.recovery import Preempted

    try:
        report = train_alphazero(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    except Preempted as stop:
        print(f"{stop} (learner step), checkpoint saved: rerun the same command to resume", file=sys.stderr)
        return stop.exit_status
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
