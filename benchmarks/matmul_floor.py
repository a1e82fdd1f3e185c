"""What a training step's matmuls cost on their own: a floor under the step time of any program that runs them.

Compiles the step of `--model` on `--mesh` (8 simulated CPU devices by default), reads every matmul of the compiled
per-device program (`jaxtrain.analysis.matmuls`: the partitioner's shapes, remat's recomputation, a scanned stack's
trip counts) and builds a program of those matmuls alone: each device runs its list in the step's order, one after
the other, each in the layout XLA's dot kernels take best ((batch, m, k) @ (batch, k, n)), on random operands, with
no collectives, elementwise math or copies. That program and the step run alternated in one process; the JSON says
how long each takes and what the step spends beyond its matmuls. A matmul in a branch of a `conditional` (a
pipeline's ticks) is counted as if its branch always ran: then the floor is no floor (`floor_exact` false), nor is
it where a loop's trip count cannot be read, or where the step also runs convolutions (a ResNet's).

With `--no-remat` the floor's matmuls come from the same model compiled with `remat=none`: the fewest matmuls a
step of this model needs (no forward matmul recomputed). A program that runs those matmuls through XLA's dot kernels
cannot step faster than that floor. `--other-hlo` times the floor of another program's dumped HLO in the same
alternation (another framework's step: does it run the same matmuls, and how long do they take?).
`benchmarks/benchmark.py --only maxtext` runs this script on each case's step: the share of the step its matmuls
take, and the ratio to MaxText if nothing else took time.

    python benchmarks/matmul_floor.py --model gpt-cpu --mesh fsdp=8 n_layers=4 d_model=256 ...
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxtrain.devices import use_simulated_devices  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-cpu")
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps (and floor calls) per round")
    parser.add_argument("--no-remat", action="store_true", help="the floor of the model compiled with remat=none")
    parser.add_argument(
        "--other-hlo",
        type=Path,
        help="also time the floor of this optimized HLO text (e.g. another framework's step, dumped by "
        "XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text) on the same devices, in the alternation",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    use_simulated_devices(args.devices)
    print(json.dumps(measure(args)))


def measure(args: argparse.Namespace) -> dict:
    from benchmark import interleaved_samples, stepper

    from jaxtrain.analysis.matmuls import matmuls
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import setup

    def built(*extra: str):
        config = apply_overrides(default_config(args.model), [*args.overrides, f"mesh={args.mesh}", *extra])
        return setup(config, log=lambda *_: None)

    run = built()
    source = built("remat=none").train_step if args.no_remat else run.train_step
    text = source.as_text()
    found = matmuls(text)
    convolutions = text.count(" convolution(")  # not matmuls: a floor of the dots alone would leave them out
    timers = {"step": stepper(run), "floor": floor_timer(found, args.devices)}
    if args.other_hlo:
        other = matmuls(args.other_hlo.read_text())
        timers["other_floor"] = floor_timer(other, args.devices)
    times = interleaved_samples(timers, args.rounds, args.steps)
    step_s, floor_s = (statistics.median(times[name]) for name in ("step", "floor"))
    flops = sum(m.flops * m.executions for m in found)
    inexact = sum(m.executions for m in found if not m.exact)
    return {
        "model": args.model,
        "mesh": args.mesh,
        "overrides": args.overrides,
        "floor_of": "the model compiled with remat=none" if args.no_remat else "the step's own program",
        "matmuls_per_device": sum(m.executions for m in found),
        # A pipeline's ticks choose their work by `conditional`: their matmuls count as if every branch ran, so the
        # "floor" then overstates what the step runs.
        "matmuls_not_exact": inexact,
        "convolutions": convolutions,
        "floor_exact": inexact == 0 and convolutions == 0,
        "matmul_gflop_per_device": round(flops / 1e9, 3),
        "step_s": round(step_s, 4),
        "floor_s": round(floor_s, 4),
        "floor_over_step": round(floor_s / step_s, 3),
        "tokens_per_step": run.tokens_per_step,
        "step_tokens_per_sec": round(run.tokens_per_step / step_s, 1),
        "floor_tokens_per_sec": round(run.tokens_per_step / floor_s, 1),
        "floor_gflops_per_device": round(flops / floor_s / 1e9, 1),
        "step_s_rounds": [round(t, 4) for t in times["step"]],
        "floor_s_rounds": [round(t, 4) for t in times["floor"]],
        "shapes": shape_table(found),
        **({"other": _other(args.other_hlo, other, times["other_floor"], floor_s)} if args.other_hlo else {}),
    }


def _other(path: Path, found, times: list[float], our_floor_s: float) -> dict:
    seconds = statistics.median(times)
    return {
        "hlo": str(path),
        "matmuls_per_device": sum(m.executions for m in found),
        "matmuls_not_exact": sum(m.executions for m in found if not m.exact),
        "matmul_gflop_per_device": round(sum(m.flops * m.executions for m in found) / 1e9, 3),
        "floor_s": round(seconds, 4),
        "floor_over_ours": round(seconds / our_floor_s, 3),
        "floor_s_rounds": [round(t, 4) for t in times],
        "shapes": shape_table(found),
    }


def floor_timer(found, devices: int):
    """Seconds per call of `found`'s floor program over `n` calls, as `benchmark.stepper`'s timers (warmed up)."""
    import jax

    program, operands = floor_program(found, jax.devices()[:devices])

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            out = program(operands)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    timed(2)
    return timed


def floor_program(found, devices):
    """A jitted program in which every device runs the matmuls `found` (executions times each, in order), one after
    another, and its operands: per distinct shape one random (batch, m, k) and (batch, k, n) pair per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("devices",))
    sharded = NamedSharding(mesh, PartitionSpec("devices"))
    keys = sorted({_key(m) for m in found})
    rng = np.random.default_rng(0)

    def operand(dtype: str, *dims: int) -> jax.Array:
        values = rng.standard_normal((len(devices), *dims), np.float32) * 0.1
        return jax.device_put(jnp.asarray(values, jnp.dtype(_DTYPES[dtype])), sharded)

    operands = [(operand(k[4], k[0], k[1], k[2]), operand(k[5], k[0], k[2], k[3])) for k in keys]
    order = [keys.index(_key(m)) for m in found for _ in range(m.executions)]

    def per_device(pairs):
        total = jnp.zeros((), jnp.float32)
        for index in order:
            lhs, rhs = pairs[index]
            # The barrier makes each matmul wait for the one before, as in the step, and keeps XLA from running
            # them side by side or dropping any.
            lhs, total = jax.lax.optimization_barrier((lhs, total))
            out = jax.lax.dot_general(
                lhs[0], rhs[0], (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.dtype(_DTYPES[keys[index][6]])
            )
            total = total + out[0, 0, 0].astype(jnp.float32)
        return total[None]

    spec = PartitionSpec("devices")
    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,), out_specs=spec))
    return program, operands


_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "f64": "float64"}


def _key(m) -> tuple:
    return (m.batch, m.m, m.k, m.n, m.lhs_dtype, m.rhs_dtype, m.out_dtype)


def shape_table(found) -> list[dict]:
    """Distinct matmul shapes, with how many times each runs per step and its share of the step's matmul FLOPs."""
    executions: collections.Counter = collections.Counter()
    flops: collections.Counter = collections.Counter()
    for m in found:
        executions[_key(m)] += m.executions
        flops[_key(m)] += m.flops * m.executions
    total = sum(flops.values())
    return [
        {
            "batch_m_k_n": list(k[:4]),
            "dtypes": "x".join(k[4:6]) + "->" + k[6],
            "per_step": executions[k],
            "flop_share": round(share / total, 3),
        }
        for k, share in flops.most_common()
    ]


if __name__ == "__main__":
    main()
