"""What the `xla_cpu_*.py` reproductions share: their command line (a stack of GELU MLP layers: how many, their
widths, the tokens, how many alternated rounds), their inputs, and the alternated timing of their programs. Attach
this file with a reproduction."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def mlp_arguments(
    doc: str, batch: int, seq: int, d_model: int, d_ff: int, rounds: int, dtype: str | None = None
) -> argparse.Namespace:
    """The command line of a reproduction whose docstring is `doc`, with these defaults (`--dtype` only if given)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if dtype is not None:
        parser.add_argument("--dtype", default=dtype, choices=("bfloat16", "float32"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--d-ff", type=int, default=d_ff)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def mlp_inputs(args: argparse.Namespace, dtype=jnp.float32) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """float32 weights (layers, d_model, d_ff) and (layers, d_ff, d_model), and tokens (batch, seq, d_model) in
    `dtype`, drawn from a fixed seed."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.batch, args.seq, args.d_model)), dtype)
    weights = (
        jnp.asarray(rng.standard_normal((args.layers, args.d_model, args.d_ff)) * 0.05, jnp.float32),
        jnp.asarray(rng.standard_normal((args.layers, args.d_ff, args.d_model)) * 0.05, jnp.float32),
    )
    return weights, x


def alternated_seconds(programs: dict[str, Callable], args: tuple, rounds: int) -> dict[str, list[float]]:
    """Seconds of each program's call on `args`, the programs taking turns for `rounds` rounds, so that the machine's
    drift hits them alike."""
    times = {name: [] for name in programs}
    for _ in range(rounds):
        for name, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            times[name].append(time.perf_counter() - start)
    return times
