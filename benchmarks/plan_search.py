"""Is the layout `jaxtrain plan --search` chooses really among the fastest? On simulated CPU devices, search the
layouts of a model (its `Chip` is this machine's CPU shared by the devices: `jaxtrain.planner.search.simulated_chip`),
then train every layout that fits a few steps and time them. Prints one JSON object: the chosen layout, each layout's
estimated and measured step time, and the ratio of the chosen one's measured time to the fastest's.

    python benchmarks/plan_search.py                                  # gpt-small, batch 8 x seq 128, 8 devices
    python benchmarks/plan_search.py --model gpt-tiny --seq-len 64 --steps 3 --rounds 2

Runs alternate: in each of `--rounds` rounds every layout is built, warmed up by one step and timed over `--steps`
steps, the order reversed every other round so that a drift in the machine's load falls on all alike; a layout's time
is its median over the rounds. Each run is a process of its own: its memory is freed when it ends (every layout's
state at once would not fit), and a run that dies (XLA:CPU aborts a collective whose devices do not all arrive within
its timeout, which 8 devices on 2 busy cores can exceed: it is raised to 20 minutes here) is recorded, not fatal.
Compiles come from JAX's compilation cache after the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxtrain.devices import enable_compilation_cache, use_simulated_devices  # noqa: E402  (imports no JAX)

# XLA:CPU's own limits for a collective's devices to arrive (it aborts the process past the second).
COLLECTIVE_TIMEOUTS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300 --xla_cpu_collective_call_terminate_timeout_seconds=1200"
)
RUN_TIMEOUT_S = 3600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def base_overrides(args: argparse.Namespace) -> list[str]:
    return [f"batch_size={args.batch_size}", f"seq_len={args.seq_len}", "data.source=synthetic", *args.overrides]


def time_one(args: argparse.Namespace) -> None:
    """The child: build the run of `--layout` and the overrides, warm it up by one step, print seconds per step
    over `--steps` steps as JSON."""
    use_simulated_devices(args.devices)
    enable_compilation_cache()
    import jax

    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    cfg = apply_overrides(default_config(args.model), [*base_overrides(args), f"mesh={args.layout}"])
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[: args.devices])
    state, batch = run.shardings.init_state(run.optimizer, 0), run.batch("train", 0)
    state, metrics = run.train_step(state, batch)  # compile (or read the cache), first-touch allocation
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    print(json.dumps({"seconds": (time.perf_counter() - start) / args.steps}))


def time_in_child(args: argparse.Namespace, mesh: str, overrides: tuple[str, ...]) -> float | str:
    """Seconds per step of one layout, timed in a process of its own; the reason where it died."""
    command = [sys.executable, __file__, "--time-one", "--layout", mesh, "--model", args.model]
    command += ["--devices", str(args.devices), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    command += ["--steps", str(args.steps), *args.overrides, *overrides]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {COLLECTIVE_TIMEOUTS}".strip()}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"timed out after {RUN_TIMEOUT_S} s"
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return f"exit {done.returncode}: {lines[-1] if lines else ''}"[:300]
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def search_layouts(args: argparse.Namespace):
    """The search on `--devices` simulated CPU devices: every layout that fits, fastest estimate first."""
    use_simulated_devices(args.devices)
    enable_compilation_cache()
    from jaxtrain.planner.search import search, simulated_chip
    from jaxtrain.run_config import apply_overrides, default_config

    cfg = apply_overrides(default_config(args.model), base_overrides(args))
    spec = simulated_chip(args.devices, getattr(cfg.model, "dtype", "float32"))
    return search(cfg, spec, args.devices, compiler="cpu", keep=10**6, log=log), spec  # every layout that fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every layout")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per layout and round, after one warm-up")
    parser.add_argument("--time-one", action="store_true", help="(internal) time the --layout run alone")
    parser.add_argument("--layout", help="(internal) the mesh --time-one times")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    args = parser.parse_args()
    if args.time_one:
        return time_one(args)
    found, spec = search_layouts(args)
    log(f"search: {found.counts} in {found.seconds:.0f} s")
    samples: list[list] = [[] for _ in found.ranked]
    for round_ in range(args.rounds):
        order = range(len(found.ranked)) if round_ % 2 == 0 else reversed(range(len(found.ranked)))
        for rank in order:
            candidate, n = found.ranked[rank][0], len(found.ranked)
            log(f"round {round_ + 1}, layout {rank + 1}/{n}: {candidate.mesh.name} {' '.join(candidate.overrides)}")
            samples[rank].append(time_in_child(args, candidate.mesh.name, candidate.overrides))
            log(f"  {samples[rank][-1]}")
    print(json.dumps(report(args, found, spec, samples), indent=1))


def report(args: argparse.Namespace, found, spec, samples: list[list]) -> dict:
    """The JSON the benchmark prints (see the module docstring)."""
    layouts = []
    for rank, (candidate, est) in enumerate(found.ranked):
        times = [s for s in samples[rank] if isinstance(s, float)]
        layouts.append(
            {
                "mesh": candidate.mesh.name,
                "settings": list(candidate.overrides),
                "estimated_step_s": round(est.step_s[1], 5),
                "estimated_peak_bytes": round(est.memory.peak),
                "measured_step_s": round(statistics.median(times), 4) if times else None,
                "samples_s": [round(s, 4) if isinstance(s, float) else s for s in samples[rank]],
            }
        )
    measured = [x for x in layouts if x["measured_step_s"] is not None]
    chosen = layouts[0]  # the search's choice without a compile check: its fastest estimate
    fastest = min(measured, key=lambda x: x["measured_step_s"])
    by_measure = sorted(measured, key=lambda x: x["measured_step_s"])
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "devices": args.devices,
        "rounds": args.rounds,
        "steps": args.steps,
        "chip": {"peak_flops": spec.peak_bf16, "memory_bytes": spec.hbm_bytes, "bandwidth": spec.hbm_bw},
        "search_s": round(found.seconds, 1),
        "counts": found.counts,
        "chosen": chosen,
        "fastest": fastest,
        "chosen_rank_by_measure": by_measure.index(chosen) + 1 if chosen in by_measure else None,
        "ratio_chosen_to_fastest": round(chosen["measured_step_s"] / fastest["measured_step_s"], 3)
        if chosen["measured_step_s"]
        else None,
        "layouts": layouts,
    }


if __name__ == "__main__":
    sys.exit(main())
