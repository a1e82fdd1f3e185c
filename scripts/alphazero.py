"""AlphaZero on Connect Four (pgx): actors play the current network against itself with mctx's search, a replay
buffer keeps their positions, and a learner trains the network with jaxtrain's sharded train step on a mesh; at the
end the network plays 200 games against a random player and 200 against its own step-0 self. Prints JSON.

    python scripts/alphazero.py --simulated-devices 8 --mesh data=8 --iterations 40

Each iteration: one batch of self-play games (one jitted program, the games batched), then `--learner-steps` steps of
the compiled step (`Setup.train_step`: the run's optimizer, schedule and shardings) on batches the buffer draws.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jaxtrain.cli import flag_type  # noqa: E402  (imports no JAX)
from jaxtrain.devices import enable_compilation_cache, use_simulated_devices  # noqa: E402


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
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides")
    return parser.parse_args(argv)


def train_alphazero(args: argparse.Namespace, log=print) -> dict:
    """Self-play and learn for `args.iterations` rounds, then evaluate. Returns the report."""
    import jax
    import jax.numpy as jnp
    import pgx
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtrain.rl.replay import ReplayBuffer
    from jaxtrain.rl.selfplay import match, self_play, training_rows
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    env = pgx.make("connect_four")
    steps = args.iterations * args.learner_steps
    overrides = [f"mesh={args.mesh}", f"steps={steps}", f"batch_size={args.batch_size}", f"seed={args.seed}"]
    cfg = apply_overrides(default_config(args.model), [*overrides, "learning_rate=1e-3", "warmup_steps=20",
                                                       *args.overrides])  # fmt: skip
    buffer = ReplayBuffer(env.observation_shape, env.num_actions, args.capacity, args.seed)
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[: args.devices], dataset=buffer)
    graphdef = run.plan.model.graphdef

    def forward(params, observation):
        return nnx.merge(graphdef, params)(observation)

    # The actors: one program plays every game, the games split over the learner mesh's batch axes.
    games_axes = tuple(a for a in run.plan.rules.batch_axes() if run.plan.mesh.shape[a] > 1)
    per_move = NamedSharding(run.plan.mesh, PartitionSpec(None, games_axes))
    shardings = {k: per_move for k in ("observation", "policy", "action", "player", "valid")}
    shardings["outcome"] = NamedSharding(run.plan.mesh, PartitionSpec(games_axes))
    play = jax.jit(
        functools.partial(self_play, forward, env, games=args.games, simulations=args.simulations),
        out_shardings=shardings,
    )
    state = run.plan.init_state(run.optimizer, args.seed)
    initial = jax.tree.map(jnp.copy, state["params"])  # the step-0 network; the step donates the state's buffers
    key = jax.random.key(args.seed)
    acting = learning = 0.0
    losses, first_actions = [], None
    for iteration in range(args.iterations):
        start = time.perf_counter()
        games = jax.device_get(play(state["params"], jax.random.fold_in(key, iteration)))
        first_actions = games["action"] if first_actions is None else first_actions
        buffer.add(training_rows(games))
        middle = time.perf_counter()
        for step in range(iteration * args.learner_steps, (iteration + 1) * args.learner_steps):
            state, metrics = run.train_step(state, run.batch("train", step))
            losses.append(metrics["loss"])
        loss = float(metrics["loss"])
        done = time.perf_counter()
        # The first iteration compiles both programs: throughput counts the others.
        acting, learning = (acting + middle - start, learning + done - middle) if iteration else (0.0, 0.0)
        log(f"iteration {iteration + 1}: {len(buffer)} positions, loss {loss:.4f} ({middle - start:.1f} s self-play, "
            f"{done - middle:.1f} s learning)")  # fmt: skip
    timed = max(args.iterations - 1, 1)
    evaluate = jax.jit(functools.partial(match, forward, env, games=args.eval_games, simulations=args.simulations))
    eval_key = jax.random.fold_in(key, 10**6)
    against_random = float(evaluate(state["params"], None, eval_key).mean())
    against_initial = float(evaluate(state["params"], initial, eval_key).mean())
    return {
        "iterations": args.iterations,
        "learner_steps": steps,
        "mesh": cfg.mesh,
        "devices": len(jax.devices()),
        "positions": len(buffer),
        "final_loss": loss,
        "selfplay_games_per_sec": args.games * timed / acting if acting else float("nan"),
        "learner_steps_per_sec": args.learner_steps * timed / learning if learning else float("nan"),
        "score_vs_random": against_random,
        "score_vs_step0": against_initial,
        "eval_games": args.eval_games,
        "losses": [float(x) for x in losses],
        "first_selfplay_actions": first_actions.tolist(),
    }


def main() -> int:
    args = parse()
    if args.simulated_devices:
        use_simulated_devices(args.simulated_devices)
    enable_compilation_cache()
    print(json.dumps(train_alphazero(args, log=lambda m: print(m, file=sys.stderr, flush=True)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
