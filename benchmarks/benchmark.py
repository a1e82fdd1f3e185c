"""Benchmarks that print JSON. Every comparison is a ratio of runs interleaved in one process (the machine is noisy).

    python benchmarks/benchmark.py                          # all sections, 8 simulated CPU devices
    python benchmarks/benchmark.py --only meshes,overhead   # some sections
    python benchmarks/benchmark.py --only maxtext           # jaxtrain vs MaxText, back to back (needs its venv)

Sections:
  meshes     step time, tokens/s and MFU of the benchmark GPT per mesh layout
  variants   compute dtype and remat policy on one mesh, interleaved
  overhead   our train step vs a minimal hand-written jax.jit step of the same model and shardings (target <= 1.05)
  compile    compile time of a 4-layer vs a 32-layer model (target ratio <= 1.5: layers are scanned)
  pipeline   measured bubble of each pipeline schedule vs theory, and activation memory (P = 2 and 4)
  checkpoint how long an async vs a sync save holds up the training loop; save/restore MB/s vs the disk's own speed
  gradsync   seconds per gradient sync (xla, ring, hierarchical, star, bf16 ring) for 1-64 MB, and bytes
             each device sends (from the HLO) vs the algorithm's analytic model (target: within 5%)
  maxtext    our GPT and Llama paths vs MaxText 0.2.5's decoder on the same shape and mesh, alternated, for each
             case of MAXTEXT_CASES (--maxtext-models; benchmarks/maxtext_baseline.sh); and per case our step against
             its matmuls alone (benchmarks/matmul_floor.py): the ratio to MaxText if nothing else took time
  attention  each attention implementation's forward + backward time per sequence length, and what `auto` picks
  context    step time per sequence length (1k-8k; 16k by --context-seqs) on context 1, 2, 4, 8 with ring and
             allgather attention; temporary bytes per device; bytes over `context`, compiled vs the planner's
  data       tokenizer MB/s with 1 and 2 workers; the token-shard loader alone vs the train step; steps on real
             shards vs synthetic tokens (target: within 3%, the loader never the bottleneck)
  hf         Hugging Face import and export of a >= 1 GB Llama built here: MB/s and each process's peak RSS against
             model bytes / processes + the largest tensor + 1 GiB
  small      small GPTs (d_model 128, 256, 512) on one device, float32 and bfloat16: step time and model FLOP/s
             against a plain jitted matmul's rate in the same dtype, alternated
  adapters   full fine-tuning vs LoRA vs QLoRA (int8 base): a 1B-shape Llama's compiled train step on v5p:2x2x2 and
             h100:8 (AOT, fsdp=8): bytes per device of the state, base weights, optimizer state and temporaries; and
             step time on CPU at the benchmark GPT's shape, alternated
  precision  bf16 vs int8 vs fp8 matmuls and FSDP's gather in 8 bits: per-device arguments, temporaries and all-gather
             bytes of a 1B-shape Llama compiled for v5p:2x2x2 and h100:8 (fsdp=8), the dots' operand types; validation
             loss and step time of llama-tiny after --precision-steps on one CPU device (benchmarks/precision.py)
  async      the Ray engine, 4 workers with one slowed 3x by waiting: samples/s of async vs sync updates (target >= 1.5)
             and validation loss vs wall time of both, on tinyshakespeare (else the built-in text); --async-plot PNG
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from jaxtrain.parallel.grad_sync import GradientSync

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The shape MaxText was measured on: 4 layers, d_model 256, 4 heads x 64, GELU MLP 1024, vocab 256, seq 256,
# global batch 8, random tokens.
SHAPE = [
    "n_layers=4",
    "d_model=256",
    "n_heads=4",
    "d_ff=1024",
    "vocab_size=256",
    "seq_len=256",
    "batch_size=8",
    "data.source=synthetic",
]
MESHES = ["fsdp=8", "data=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "data=2,tensor=4"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make(mesh: str, extra=(), devices=None):
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import setup

    cfg = apply_overrides(default_config("gpt"), [*SHAPE, f"mesh={mesh}", *extra])
    return setup(cfg, log=lambda *_: None, devices=devices)


def stepper(run):
    """A function that runs `n` steps of `run` and returns seconds per step (state and batch kept on device)."""
    state = run.shardings.init_state(run.optimizer, 0)
    batch = run.batch("train", 0)
    holder = {"state": state}

    def timed(n: int, step=None) -> float:
        step = step or run.train_step
        start = time.perf_counter()
        for _ in range(n):
            holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / n

    timed(2)  # warm-up: first-touch allocation, thread pools
    return timed


def interleaved(timers: dict, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds/step of each timer, measured in alternation so that machine noise hits all alike."""
    return {name: statistics.median(values) for name, values in interleaved_samples(timers, rounds, steps).items()}


def interleaved_samples(timers: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds/step of each timer (a function of a step count) in each of `rounds` rounds, the timers alternating."""
    samples = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(timer(steps))
    return samples


def throughput(run, seconds: float, peak: float) -> dict:
    return {
        "step_time_s": round(seconds, 4),
        "tokens_per_sec": round(run.tokens_per_step / seconds, 1),
        "mfu": round(run.flops_per_step / seconds / peak, 4),
    }


def bench_meshes(args, peak) -> dict:
    runs = {mesh: make(mesh) for mesh in MESHES}
    timers = {mesh: stepper(run) for mesh, run in runs.items()}
    times = interleaved(timers, args.rounds, args.steps)
    return {mesh: throughput(runs[mesh], t, peak) for mesh, t in times.items()}


def bench_variants(args, peak) -> dict:
    variants = {
        f"{dtype},remat={remat}": [f"dtype={dtype}", f"remat={remat}"]
        for dtype in ("bfloat16", "float32")
        for remat in ("none", "save_dots", "full")
    }
    runs = {name: make(args.mesh, extra) for name, extra in variants.items()}
    times = interleaved({name: stepper(run) for name, run in runs.items()}, args.rounds, args.steps)
    return {"mesh": args.mesh, **{name: throughput(runs[name], t, peak) for name, t in times.items()}}


def minimal_step(run):
    """The same model, optimizer and shardings, written as the shortest plain jax.jit training step."""
    from flax import nnx

    from jaxtrain.sharding.constraints import activation_sharding

    graphdef, optimizer, shardings = run.shardings.model.graphdef, run.optimizer, run.shardings

    def step(state, batch):
        def loss(params):
            with activation_sharding(shardings.mesh, shardings.rules):  # the model's own activation hints, as in ours
                return nnx.merge(graphdef, params).loss(batch)[0]

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": value}

    batch_sharding = run.train_step.input_shardings[0][1]
    return jax.jit(
        step,
        in_shardings=(shardings.state_shardings, batch_sharding),
        out_shardings=(shardings.state_shardings, shardings.replicated),
        donate_argnums=0,
    )


def bench_overhead(args, peak) -> dict:
    results = {}
    for mesh in ("fsdp=8", "data=2,fsdp=2,tensor=2"):
        run = make(mesh)
        ours, hand = stepper(run), stepper(run)
        plain = minimal_step(run)
        times = interleaved(
            {"jaxtrain": ours, "minimal_jit": functools.partial(hand, step=plain)}, args.rounds, args.steps
        )
        results[mesh] = {
            **{k: round(v, 4) for k, v in times.items()},
            "ratio": round(times["jaxtrain"] / times["minimal_jit"], 3),
            "target": "<= 1.05",
        }
    return results


def bench_compile(args, peak) -> dict:
    jax.config.update("jax_enable_compilation_cache", False)  # time real compiles
    seconds = {}
    for _ in range(2):  # alternate, keep the faster of two
        for layers in (4, 32):
            start = time.perf_counter()
            make("fsdp=8", [f"n_layers={layers}"])
            seconds[layers] = min(seconds.get(layers, float("inf")), time.perf_counter() - start)
    return {
        "layers_4_s": round(seconds[4], 2),
        "layers_32_s": round(seconds[32], 2),
        "ratio": round(seconds[32] / seconds[4], 3),
        "target": "<= 1.5",
    }


# small: GPTs on one CPU device, their model FLOP/s against a plain jitted matmul's rate in the same dtype.
SMALL_SHAPES = {
    "d128": ["n_layers=4", "d_model=128", "n_heads=4", "d_ff=512", "seq_len=64", "batch_size=12"],
    "d256": ["n_layers=4", "d_model=256", "n_heads=4", "d_ff=1024", "seq_len=256", "batch_size=8"],
    "d512": ["n_layers=4", "d_model=512", "n_heads=8", "d_ff=2048", "seq_len=256", "batch_size=8"],
}
MATMUL_SIZE = 2048


def matmul_timer(dtype: str) -> Callable[[int], float]:
    """Seconds per plain jitted MATMUL_SIZE² matmul in `dtype` (the rate a model's dots could reach)."""
    import jax.numpy as jnp

    a = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            out = matmul(a)
        out.block_until_ready()
        return (time.perf_counter() - start) / n

    return timed


def bench_small(args, peak) -> dict:
    """Step time and model FLOP/s of small GPTs on one device, float32 and bfloat16, alternated with a plain matmul
    of each dtype: `of_matmul` is the model's FLOP/s over the matmul's (issue 21's target: >= 0.5 from d_model 256)."""
    cases = {f"{name},{dtype}": [*shape, f"dtype={dtype}"] for name, shape in SMALL_SHAPES.items()
             for dtype in ("float32", "bfloat16")}  # fmt: skip
    runs = {name: make("data=1", extra, devices=jax.devices()[:1]) for name, extra in cases.items()}
    timers = {name: stepper(run) for name, run in runs.items()}
    timers |= {f"matmul,{dtype}": matmul_timer(dtype) for dtype in ("float32", "bfloat16")}
    times = interleaved(timers, args.rounds, args.steps)
    rates = {dtype: 2 * MATMUL_SIZE**3 / times[f"matmul,{dtype}"] for dtype in ("float32", "bfloat16")}
    out = {f"matmul_gflops,{dtype}": round(rate / 1e9, 1) for dtype, rate in rates.items()}
    for name, run in runs.items():
        flops = run.flops_per_step / times[name]
        out[name] = {
            "step_ms": round(times[name] * 1e3, 2),
            "model_gflops": round(flops / 1e9, 1),
            "of_matmul": round(flops / rates[name.split(",")[1]], 3),
        }
    return out


# Full fine-tuning, LoRA (rank 16 on attention and MLP) and QLoRA (the same adapters over an int8 base).
ADAPTER_VARIANTS = {
    "full": [],
    "lora": ["lora.rank=16", "lora.alpha=32"],
    "qlora_int8": ["lora.rank=16", "lora.alpha=32", "lora.quantize=int8"],
}
# Llama 3.2 1B (vocab 128,256, 16 layers, d 2048, SwiGLU 8192) as issue 40 compiles it, one 2048-token row a device.
ADAPTER_1B = ["mesh=fsdp=8", "batch_size=8", "seq_len=2048", "data.source=synthetic", "dtype=bfloat16", "remat=full"]
ADAPTER_TARGETS = ("v5p:2x2x2", "h100:8")


def adapter_memory(run) -> dict:
    """Bytes per device of `run`'s compiled train step (XLA's figures) and of its state by part."""
    from jaxtrain.analysis.memory import tree_device_bytes

    memory, state, model = run.train_step.memory_analysis(), run.shardings.abstract_state, run.shardings.model
    frozen = model.split(state["params"])[1] if model.freezes else {}
    return {
        "arguments": memory.argument_size_in_bytes,
        "temporaries": memory.temp_size_in_bytes,
        "params": tree_device_bytes(state["params"]),
        "frozen_params": tree_device_bytes(frozen),
        "optimizer_state": tree_device_bytes(state["opt_state"]),
    }


def bench_adapters(args, peak) -> dict:
    """The compiled step's memory per device for each variant on each AOT target, with each figure's ratio to full
    fine-tuning's; then CPU step times of the variants at the benchmark shape, alternated, as ratios to full's."""
    from jaxtrain.aot.targets import compile_target
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    out: dict = {}
    for target in ADAPTER_TARGETS:
        devices = compile_target(target).devices
        figures = {}
        for name, extra in ADAPTER_VARIANTS.items():
            cfg = apply_overrides(default_config("llama-1b"), [*ADAPTER_1B, *extra])
            figures[name] = adapter_memory(build(cfg, log=lambda *_: None, devices=devices))
            log(f"{target} {name}: {figures[name]}")
        out[target] = {
            name: {
                **f,
                **{f"{k}_vs_full": round(v / figures["full"][k], 3) for k, v in f.items() if figures["full"][k]},
            }
            for name, f in figures.items()
        }
    runs = {name: make(args.mesh, extra) for name, extra in ADAPTER_VARIANTS.items()}
    times = interleaved({name: stepper(run) for name, run in runs.items()}, args.rounds, args.steps)
    out["cpu"] = {
        "mesh": args.mesh,
        **{
            name: {**throughput(runs[name], t, peak), "vs_full": round(t / times["full"], 3)}
            for name, t in times.items()
        },
    }
    return out


# float32: XLA:CPU runs the bfloat16 backward inside the pipeline loop ~4x slower than outside it (an XLA:CPU
# quirk, not pipeline cost), which would swamp the bubble; forwards and float32 are unaffected.
PIPELINE_SHAPE = [
    "n_layers=8",
    "d_model=256",
    "n_heads=4",
    "d_ff=1024",
    "vocab_size=256",
    "seq_len=64",
    "dtype=float32",
]


def bench_pipeline(args, peak) -> dict:
    """Measured bubble = 1 - T_ideal / T_pipeline, alternated in one process. T_ideal is the same model on the same
    P devices without a bubble: data parallel over them, accumulating M/P pieces so every matmul has the
    pipeline's microbatch size, with one fused gradient all-reduce per step (the pipeline has none over those
    devices). On simulated CPU devices the stages share the cores, so the bubble is measured as
    the placeholder work that idle stages compute in its place (see jaxtrain.parallel.pipeline), which takes on real
    chips exactly the time they would wait."""
    batch = 64
    results = {}
    for stages in (int(p) for p in args.pipeline_stages.split(",")):
        devices = jax.devices()[:stages]
        cases = {}
        for name, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            for microbatches in (stages, 4 * stages):
                extra = [f"schedule={name}", f"microbatches={microbatches}", f"virtual_stages={virtual}"]
                cases[f"{name},M={microbatches}"] = (f"pipeline={stages}", extra, microbatches)
        for microbatches in (stages, 4 * stages):
            accumulate = [f"grad_accum={microbatches // stages}", "allreduce.algorithm=fused"]
            cases[f"ideal,M={microbatches}"] = (f"data={stages}", accumulate, None)
        runs = {
            key: make(mesh, [*PIPELINE_SHAPE, f"batch_size={batch}", *extra], devices=devices)
            for key, (mesh, extra, _) in cases.items()
        }
        times = interleaved({key: stepper(run) for key, run in runs.items()}, args.rounds, args.steps)
        report = {}
        for key, run in runs.items():
            if key.startswith("ideal"):
                continue
            ideal = times[f"ideal,M={cases[key][2]}"]
            schedule = run.pipeline.schedule
            report[key] = {
                "step_time_s": round(times[key], 4),
                "ideal_step_time_s": round(ideal, 4),
                "bubble_measured": round(1 - ideal / times[key], 4),
                "bubble_theory": round(schedule.theoretical_bubble(), 4),
                "ratio_to_theory": round((1 - ideal / times[key]) / schedule.theoretical_bubble(), 3),
                "stash_microbatches": schedule.stash_slots,
                "temp_bytes": run.train_step.memory_analysis().temp_size_in_bytes,
            }
        results[f"P={stages}"] = report
    return results


# A model whose train state (params + Adam moments, float32) is about 300 MB, big enough for disk speed to matter.
CHECKPOINT_SHAPE = ["n_layers=8", "d_model=512", "n_heads=8", "d_ff=2048", "vocab_size=256", "seq_len=128"]


def disk_write_speed(path: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """MB/s of writing `nbytes` of incompressible bytes to `path` and fsync-ing it, as Orbax's writes do."""
    data = os.urandom(min(chunk, nbytes))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, len(data)):
            f.write(data[: nbytes - offset])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds / 1e6


def bench_checkpoint(args, peak) -> dict:
    """Saves of a trained state (Adam moments non-zero, so compression does not flatter the numbers), interleaved:
    the time `save` blocks, async and sync; the extra time a save adds to `--steps` training steps; write and
    restore throughput; and the disk's own fsync-ed write speed measured in the same run."""
    from jaxtrain.training.checkpoint import Checkpoints, restore

    run = make(args.checkpoint_mesh, CHECKPOINT_SHAPE)
    state, batch = run.shardings.init_state(run.optimizer, 0), run.batch("train", 0)
    for _ in range(2):
        state, metrics = run.train_step(state, batch)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(run.shardings.state_in_model_order(state)))
    abstract = run.shardings.abstract_model_state()
    holder = {"state": state}

    def loop(checkpoints, step: int) -> float:
        """Seconds for `args.steps` train steps with one save (if `checkpoints`) after the first."""
        start = time.perf_counter()
        for i in range(args.steps):
            holder["state"], metrics = run.train_step(holder["state"], batch)
            if checkpoints and i == 0:
                checkpoints.save(step, run.shardings.state_in_model_order(holder["state"]), {"step": step})
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
        if checkpoints:
            checkpoints.wait()  # outside the timing: in training the write would overlap later steps
        return seconds

    samples: dict[str, list[float]] = {}

    def sample(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as root:
        root = Path(root)
        disk = [disk_write_speed(root / "probe", nbytes) for _ in range(2)]
        managers = {
            mode: Checkpoints(root / mode, save_every=1, keep=2, async_save=mode == "async")
            for mode in ("async", "sync")
        }
        first = {}
        for mode, checkpoints in managers.items():  # the first save of a process compiles Orbax's slicing ops
            start = time.perf_counter()
            checkpoints.save(1, run.shardings.state_in_model_order(state), {"step": 1})
            checkpoints.wait()
            first[mode] = round(time.perf_counter() - start, 3)
        loop(None, 0)  # warm-up
        for step in range(2, 2 * args.rounds + 2, 2):  # odd steps are the saves inside the timed loop
            sample("loop", loop(None, 0))
            for mode, checkpoints in managers.items():
                saved = run.shardings.state_in_model_order(holder["state"])
                jax.block_until_ready(saved)
                start = time.perf_counter()
                checkpoints.save(step, saved, {"step": step})
                blocked = time.perf_counter() - start
                checkpoints.wait()
                sample(f"{mode}_blocked", blocked)
                sample(f"{mode}_written", time.perf_counter() - start)
                if mode == "sync":
                    start = time.perf_counter()
                    jax.block_until_ready(restore(root / "sync" / str(step), abstract))
                    sample("restore", time.perf_counter() - start)
                sample(f"loop_{mode}", loop(checkpoints, step + 1))
        for checkpoints in managers.values():
            checkpoints.close()
    median = {name: statistics.median(values) for name, values in samples.items()}
    mb = nbytes / 1e6
    disk_mb_s = statistics.median(disk)
    return {
        "mesh": args.checkpoint_mesh,
        "state_mb": round(mb, 1),
        "train_steps_per_round": args.steps,
        "step_time_s": round(median["loop"] / args.steps, 4),
        "first_save_s": first,
        "save_blocks_s": {mode: round(median[f"{mode}_blocked"], 4) for mode in managers},
        "async_blocks_vs_sync": round(median["async_blocked"] / median["sync_blocked"], 3),
        "loop_extra_s_per_save": {mode: round(median[f"loop_{mode}"] - median["loop"], 4) for mode in managers},
        "save_mb_s": {mode: round(mb / median[f"{mode}_written"], 1) for mode in managers},
        "restore_mb_s": round(mb / median["restore"], 1),
        "disk_write_mb_s": round(disk_mb_s, 1),
        "save_vs_disk": round(mb / median["sync_written"] / disk_mb_s, 3),
        "restore_note": "reads just-written files, so largely from the page cache",
    }


# MaxText's decoder (Llama 2's) made GPT's: a GELU MLP and one key/value head per query head.
MAXTEXT_GPT = ["base_num_kv_heads=4", "mlp_activations=[gelu]"]


@dataclasses.dataclass(frozen=True)
class MaxTextCase:
    """One shape on one mesh in both frameworks: our model and its overrides of SHAPE, MaxText's overrides of
    benchmarks/maxtext_baseline.sh's defaults (the same shape on fsdp=8)."""

    model: str
    mesh: str
    ours: tuple[str, ...] = ()
    theirs: tuple[str, ...] = ()


MAXTEXT_CASES = {
    "gpt": MaxTextCase("gpt-cpu", "fsdp=8", theirs=(*MAXTEXT_GPT,)),
    "llama": MaxTextCase("llama-cpu", "fsdp=8", theirs=("base_num_kv_heads=2", "mlp_activations=[silu,linear]")),
    "gpt-data": MaxTextCase(
        "gpt-cpu", "data=8", theirs=(*MAXTEXT_GPT, "ici_fsdp_parallelism=1", "ici_data_parallelism=8")
    ),
    "gpt-3d": MaxTextCase(
        "gpt-cpu",
        "data=2,fsdp=2,tensor=2",
        theirs=(*MAXTEXT_GPT, "ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ),
    # 8 layers of d_model 512 (8 heads of 64, MLP 2048) at seq 128: the larger shapes, at a size whose
    # 20 steps take minutes, not tens of minutes, here.
    "gpt-wide": MaxTextCase(
        "gpt-cpu",
        "fsdp=8",
        ours=("n_layers=8", "d_model=512", "n_heads=8", "d_ff=2048", "seq_len=128"),
        theirs=(
            "mlp_activations=[gelu]",
            "base_num_decoder_layers=8",
            "base_emb_dim=512",
            "base_num_query_heads=8",
            "base_num_kv_heads=8",
            "base_mlp_dim=2048",
            "max_target_length=128",
        ),
    ),
    # Two stages of two layers, 4 microbatches of 4 sequences: GPipe's order in both (MaxText's pipeline is GPipe
    # with circular repeats; one repeat here). MaxText needs each microbatch divisible by fsdp: a global batch of 16.
    "gpt-pipeline": MaxTextCase(
        "gpt-cpu",
        "pipeline=2,fsdp=4",
        ours=("batch_size=16", "pipeline.schedule=gpipe", "pipeline.microbatches=4"),
        theirs=(
            *MAXTEXT_GPT,
            "ici_pipeline_parallelism=2",
            "ici_fsdp_parallelism=4",
            "num_pipeline_microbatches=4",
            "num_layers_per_pipeline_stage=2",
            "scan_layers=False",
            "per_device_batch_size=2",
        ),
    ),
}


def run_maxtext(steps: int, overrides: Sequence[str]) -> dict:
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "maxtext_baseline.sh"), str(steps), *overrides],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_maxtext(args, peak) -> dict:
    """Alternate ours and MaxText as separate processes, like a user would run them, for each case of
    `--maxtext-models`. Both figures are the median per-step throughput from step 10 on (MaxText's log and our
    --log-every 1 metrics file), so that compilation and warm-up count for neither."""
    results = {}
    for name in args.maxtext_models.split(","):
        case = MAXTEXT_CASES[name]
        ours, theirs = [], []
        for round_index in range(args.maxtext_rounds):
            log(f"maxtext {name} round {round_index + 1}/{args.maxtext_rounds}")
            ours.append(run_ours(args.maxtext_steps, case))
            theirs.append(run_maxtext(args.maxtext_steps, case.theirs)["tokens_per_sec"])
        log(f"maxtext {name}: the matmul floor")
        floor = run_floor(case)  # not exact for a pipeline, whose ticks' matmuls are in conditional branches
        ratio = statistics.median(ours) / statistics.median(theirs)
        results[name] = {
            "jaxtrain_model": case.model,
            "mesh": case.mesh,
            "jaxtrain_overrides": list(case.ours),
            "maxtext_overrides": list(case.theirs),
            "jaxtrain_tokens_per_sec": ours,
            "maxtext_tokens_per_sec": theirs,
            "ratio_of_medians": round(ratio, 3),
            "target": ">= 1.3",
            # Our step against its matmuls alone (benchmarks/matmul_floor.py, alternated in one process), and what
            # that makes the ratio to MaxText if everything but the matmuls took no time.
            "matmul_floor_over_step": floor["floor_over_step"] if floor["floor_exact"] else None,
            "ratio_with_matmuls_only": round(ratio / floor["floor_over_step"], 3) if floor["floor_exact"] else None,
            "matmul_floor": {key: floor[key] for key in ("step_s", "floor_s", "matmul_gflop_per_device", "shapes")},
        }
    return results


def run_floor(case: MaxTextCase) -> dict:
    """benchmarks/matmul_floor.py on the case: our step and a program of its matmuls alone, alternated."""
    command = [sys.executable, str(ROOT / "benchmarks" / "matmul_floor.py"), "--model", case.model, "--mesh", case.mesh]
    result = subprocess.run([*command, *SHAPE, *case.ours], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_ours(steps: int, case: MaxTextCase) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "train.py"),
                "--simulated-devices",
                "8",
                "--mesh",
                case.mesh,
                "--steps",
                str(steps),
                "--log-every",
                "1",
                "--eval-every",
                "100000",
                "--no-progress",
                "--metrics-file",
                str(metrics),
                "--model",
                case.model,
                *SHAPE,
                *case.ours,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return round(statistics.median(r["tokens_per_sec"] for r in records if r["step"] > 10), 1)


# gradsync: each algorithm on the mesh it is meant for (hierarchical needs groups along `replica`), as GradientSync
# options; None is XLA's own all-reduce, a pmean.
SYNC_CASES: dict[str, tuple[str, dict | None]] = {
    "xla": ("data=-1", None),
    "ring": ("data=-1", {"algorithm": "ring"}),
    "hierarchical": ("replica=2,data=-1", {"algorithm": "hierarchical"}),
    "star": ("data=-1", {"algorithm": "star"}),
    "star_2": ("data=-1", {"algorithm": "star", "hubs": 2}),
    "ring_bf16": ("data=-1", {"algorithm": "ring", "compression": "bf16"}),
}
WITHIN = 0.05  # measured bytes per device must match the analytic model this closely


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The gradsync meshes have replica/data axes only, so every axis larger than 1 is data-parallel."""
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def sync_program(mesh: Mesh, sync: GradientSync | None, values: int) -> jax.stages.Compiled:
    """The mean over the replicas of a float32 gradient of `values`, each replica holding its own (one row of a
    (replicas, values) array), by `sync` or, when None, by XLA's all-reduce."""
    axes = data_axes(mesh)
    mean = sync.mean if sync else functools.partial(jax.lax.pmean, axis_name=axes)
    # check_vma=False: the explicit algorithms' results are equal on every replica by construction, which the type
    # system cannot see through their dynamic indexing (as in step.replica_gradients).
    body = jax.shard_map(
        lambda g: mean(g[0]), mesh=mesh, in_specs=PartitionSpec(axes), out_specs=PartitionSpec(), check_vma=False
    )
    rows = math.prod(mesh.shape[a] for a in axes)
    spec = jax.ShapeDtypeStruct((rows, values), np.float32, sharding=NamedSharding(mesh, PartitionSpec(axes)))
    return jax.jit(body).lower(spec).compile()


def sync_bytes(compiled: jax.stages.Compiled, mesh: Mesh, sync: GradientSync | None, nbytes: int) -> dict:
    """Bytes each device sends per sync, read from the compiled HLO, against the analytic model: the mean over
    devices, and for star also the busiest device (a hub), where its cost lies."""
    from jaxtrain.analysis.comm_report import Expected, communication_report

    report, n = communication_report(compiled, mesh), mesh.size
    # XLA's all-reduce is modelled as bandwidth-optimal, as the report models every all-reduce.
    levels = sync.expected(nbytes) if sync else [Expected("all-reduce", 2 * (n - 1) / n * nbytes)]
    expected, measured = {"mean": sum(e.bytes for e in levels)}, {"mean": report.per_device.mean()}
    if sync and sync.algorithm == "star":
        expected["max"] = sync.hub_bytes(nbytes)
        measured["max"] = report.per_device.max()
    if len(levels) > 1:  # hierarchical: its point is how little crosses the groups, so check each level apart
        expected |= {e.label: e.bytes for e in levels}
        measured |= {e.label: report.measured(e.axes, e.kinds) for e in levels}
    ratios = {k: measured[k] / v for k, v in expected.items()}
    return {
        **{
            k: {"measured": int(measured[k]), "expected": int(v), "ratio": round(ratios[k], 4)}
            for k, v in expected.items()
        },
        "within_5pct": all(abs(r - 1) <= WITHIN for r in ratios.values()),
    }


def sync_timer(compiled: jax.stages.Compiled, gradients: jax.Array) -> Callable[[int], float]:
    """Seconds per sync over `n` calls, each waited for: a sync is on a step's critical path, not a stream."""

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(compiled(gradients))
        return (time.perf_counter() - start) / n

    timed(1)  # warm-up: first-touch allocation, thread pools
    return timed


def bench_gradsync_size(args: argparse.Namespace, meshes: dict[str, Mesh], mb: int) -> dict:
    """Every case of SYNC_CASES on a float32 gradient of `mb` MB: bytes vs the model, and seconds per sync, all
    cases interleaved."""
    from jaxtrain.parallel.grad_sync import GradientSync

    nbytes = mb << 20
    gradients = np.random.default_rng(0).standard_normal((args.devices, nbytes // 4), dtype=np.float32)
    placed, timers, sent = {}, {}, {}
    for name, (layout, options) in SYNC_CASES.items():
        mesh = meshes[layout]
        sync = GradientSync(axes=data_axes(mesh), sizes=dict(mesh.shape), **options) if options else None
        compiled = sync_program(mesh, sync, nbytes // 4)
        if layout not in placed:  # one copy per mesh: 64 MB x 8 devices is already 512 MB
            placed[layout] = jax.device_put(gradients, compiled.input_shardings[0][0])
        timers[name] = sync_timer(compiled, placed[layout])
        sent[name] = sync_bytes(compiled, mesh, sync, nbytes)
    times = interleaved(timers, args.rounds, args.steps)
    return {
        name: {
            "seconds_per_sync": round(times[name], 5),
            "vs_xla": round(times[name] / times["xla"], 3),
            "bytes_per_device": sent[name],
        }
        for name in SYNC_CASES
    }


def bench_gradsync(args: argparse.Namespace, peak: float) -> dict:
    """Gradient syncs of 1-64 MB: seconds per sync of each algorithm, and the bytes each device sends (from the
    compiled HLO) against the algorithm's analytic model."""
    from jaxtrain.parallel.grad_sync import GradientSync
    from jaxtrain.sharding.mesh import build_mesh, parse_layout

    meshes = {layout: build_mesh(parse_layout(layout)) for layout, _ in SYNC_CASES.values()}
    sizes = {}
    for mb in (int(s) for s in args.sync_sizes.split(",")):
        start = time.perf_counter()
        sizes[f"{mb}MB"] = bench_gradsync_size(args, meshes, mb)
        log(f"gradsync {mb} MB: {time.perf_counter() - start:.1f}s")
    return {
        "meshes": {name: layout for name, (layout, _) in SYNC_CASES.items()},
        "bucket_bytes": GradientSync.bucket_bytes,
        "bucket_note": "GradientSync's default bucket (4 MB) for every explicit algorithm; xla is one all-reduce",
        "units": "MB = 2**20 bytes; seconds_per_sync: median over --rounds of the mean of --steps calls",
        "note": f"simulated CPU devices share {os.cpu_count()} cores and one memory: times reflect memory bandwidth "
        "and per-message overhead, not a network; bytes are what each device would send, from the compiled HLO",
        "sizes": sizes,
        "all_within_5pct": all(c["bytes_per_device"]["within_5pct"] for size in sizes.values() for c in size.values()),
    }


# attention: one layer's attention of the llama-cpu shape (4 query heads, 2 kv heads of 64 channels, float32), batch
# 1, forward and backward, on one CPU device.
ATTENTION_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 64}
ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "chunked")


def attention_timer(impl: str, seq_len: int) -> Callable[[int], float]:
    from jaxtrain.ops.attention import attention

    shape = ATTENTION_SHAPE
    q = jax.random.normal(jax.random.key(0), (1, seq_len, shape["heads"], shape["head_dim"]))
    k, v = (jax.random.normal(jax.random.key(i), (1, seq_len, shape["kv_heads"], shape["head_dim"])) for i in (1, 2))
    step = jax.jit(jax.grad(lambda *x: attention(*x, implementation=impl).sum(), argnums=(0, 1, 2)))

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            out = step(q, k, v)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    timed(1)  # compile
    return timed


def bench_attention(args, peak) -> dict:
    """Seconds per forward + backward of each implementation per sequence length, alternated, and what `auto` picks
    on CPU there (jaxtrain.ops.attention.CPU_CHUNKED_FROM_SEQ)."""
    from jaxtrain.ops.attention import resolve_implementation

    out = {"shape": ATTENTION_SHAPE}
    for seq_len in map(int, args.attention_seqs.split(",")):
        timers = {impl: attention_timer(impl, seq_len) for impl in ATTENTION_IMPLEMENTATIONS}
        times = interleaved(timers, args.rounds, max(1, 2048 // seq_len))
        out[seq_len] = {
            "seconds": {impl: round(t, 5) for impl, t in times.items()},
            "fastest": min(times, key=times.get),
            "auto_picks": resolve_implementation("auto", "cpu", seq_len),
        }
    return out


# context: a small GPT at long sequences, one row per step (the global batch is the same on every mesh).
CONTEXT_SHAPE = ["n_layers=2", "d_model=64", "n_heads=4", "d_ff=256", "vocab_size=256", "dtype=float32"]
CONTEXT_SHAPE += ["batch_size=1", "data.source=synthetic"]


def context_run(seq_len: int, ways: int, algorithm: str):
    """The context section's model on context=`ways` (`ways` devices), compiled."""
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.setup import build

    overrides = [*CONTEXT_SHAPE, f"seq_len={seq_len}", f"context_parallel={algorithm}", f"mesh=context={ways}"]
    cfg = apply_overrides(default_config("gpt"), overrides)
    return build(cfg, log=lambda *_: None, devices=jax.devices()[:ways])


def context_bytes(run) -> dict:
    """Bytes each device sends over `context` per step: the compiled step's (HLO) beside the planner's estimate,
    in all and for attention alone (the analytic model of jaxtrain.planner.context)."""
    from jaxtrain.analysis.chips import chip
    from jaxtrain.analysis.comm_report import communication_report
    from jaxtrain.planner.context import context_attention_bytes
    from jaxtrain.planner.estimate import estimate

    report = communication_report(run.train_step, run.shardings.mesh)
    attention = context_attention_bytes(run.cfg, run.shardings)
    planned = estimate(run.cfg, chip("v5p"), run.shardings.mesh.size, compiler="cpu")
    return {
        "compiled": report.measured(("context",)),
        "planner": sum(t.bytes for t in planned.transfers if t.axes == ("context",)),
        "attention_compiled": report.measured(("context",), tuple({t.kind for t in attention})),
        "attention_model": sum(t.bytes for t in attention),
    }


def bench_context(args, peak) -> dict:
    """Seconds per training step per sequence length on context=1, 2, 4, 8 with ring and allgather attention,
    alternated, with each step's temporary bytes per device and its bytes over `context` (compiled and planned).
    Simulated CPU devices share this machine's cores: the times show each algorithm's overhead, not the speedup of
    real devices. Default lengths stop at 8k (16k: --context-seqs ...,16384; one device then takes ~10 s a step)."""
    out = {"shape": CONTEXT_SHAPE}
    for seq_len in map(int, args.context_seqs.split(",")):
        sizes = map(int, args.context_sizes.split(","))
        cases = sorted(
            {(ways, algorithm if ways > 1 else "ring") for ways in sizes for algorithm in ("ring", "allgather")}
        )
        runs = {f"context={w}" + (f",{a}" if w > 1 else ""): context_run(seq_len, w, a) for w, a in cases}
        times = interleaved({name: stepper(run) for name, run in runs.items()}, args.context_rounds, 1)
        out[seq_len] = {
            name: {
                "step_time_s": round(times[name], 4),
                "temp_mb": round(run.train_step.memory_analysis().temp_size_in_bytes / 1e6, 1),
                **({"context_bytes": context_bytes(run)} if run.shardings.mesh.shape["context"] > 1 else {}),
            }
            for name, run in runs.items()
        }
        log(f"context {seq_len}: {json.dumps(out[seq_len])}")
    return out


# data: the benchmark GPT's shape with a 4,096-token BPE (vocab_size 4096 for synthetic data too: the same program).
DATA_VOCAB = 4096


def data_corpus(root: Path, megabytes: float) -> list[Path]:
    """About `megabytes` of Python's standard library (every module, subpackages too) as text files to tokenize."""
    import sysconfig

    files, size = [], 0
    for i, path in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))):
        if size >= megabytes * 2**20:
            break
        text = path.read_bytes()
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:  # a few test modules are in other encodings on purpose
            continue
        (root / f"{i:05d}.txt").write_bytes(text)
        files.append(root / f"{i:05d}.txt")
        size += len(text)
    return files


def tokenize_rate(tokenizer: Path, inputs: list[Path], out: Path, workers: int) -> dict:
    """MB/s of `jaxtrain tokenize` (text in, shards and manifest out) with `workers` worker processes."""
    from jaxtrain.data.shards import tokenize

    start = time.perf_counter()
    manifest = tokenize(tokenizer, inputs, out, val_fraction=0.05, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    text = sum(split["text_bytes"] for split in manifest["splits"].values())
    return {
        "seconds": round(seconds, 2),
        "text_mb": round(text / 2**20, 2),
        "mb_per_sec": round(text / 2**20 / seconds, 2),
    }


def fresh_batch_stepper(run):
    """Seconds per step of `run`, each step on its own batch built by the loader, as the training loop does."""
    state, at = {"state": run.shardings.init_state(run.optimizer, 0)}, {"step": 0}

    def timed(n: int) -> float:
        start = time.perf_counter()
        batch = run.batch("train", at["step"])
        for _ in range(n):
            state["state"], metrics = run.train_step(state["state"], batch)
            at["step"] += 1
            batch = run.batch("train", at["step"])  # built on the host while the device computes
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / n

    timed(2)
    return timed


def loader_timer(run):
    """Seconds per global batch of the loader alone: this process's rows read and put on the devices."""
    at = {"step": 10_000}

    def timed(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            at["step"] += 1
            jax.block_until_ready(run.batch("train", at["step"]))
        return (time.perf_counter() - start) / n

    return timed


def bench_data(args, peak) -> dict:
    """Tokenizer MB/s with 1 and 2 workers; the loader alone vs the train step; steps on real shards (concat and
    segments packing) vs synthetic tokens, each step on a fresh batch, alternated."""
    from jaxtrain.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory(prefix="jaxtrain-data-bench-") as work:
        root = Path(work)
        (root / "text").mkdir()
        inputs = data_corpus(root / "text", args.data_mb)
        train_bpe(inputs[:50], DATA_VOCAB, root / "tok.json")
        rates = {f"workers_{w}": tokenize_rate(root / "tok.json", inputs, root / f"shards{w}", w) for w in (1, 2)}
        shape = [*SHAPE, f"vocab_size={DATA_VOCAB}", f"mesh={args.mesh}"]
        tokens = [f"data.source=tokens:{root / 'shards1'}"]
        runs = {
            "synthetic": make(args.mesh, [*shape]),
            "tokens_concat": make(args.mesh, [*shape, *tokens]),
            "tokens_segments": make(args.mesh, [*shape, *tokens, "data.packing=segments"]),
        }
        steps = interleaved({name: fresh_batch_stepper(run) for name, run in runs.items()}, args.rounds, args.steps)
        loaders = interleaved({name: loader_timer(run) for name, run in runs.items()}, args.rounds, args.steps)
    return {
        "tokenizer": {
            **rates,
            "speedup_2_workers": round(rates["workers_2"]["mb_per_sec"] / rates["workers_1"]["mb_per_sec"], 2),
        },
        "mesh": args.mesh,
        "step_time_s": {name: round(t, 4) for name, t in steps.items()},
        "loader_s_per_batch": {name: round(t, 5) for name, t in loaders.items()},
        "concat_vs_synthetic": round(steps["tokens_concat"] / steps["synthetic"], 3),
        "loader_over_step": {name: round(loaders[name] / steps[name], 4) for name in runs},
        "note": f"{os.cpu_count()} cores shared by the simulated devices, the tokenizer workers and the loader",
    }


# Llama 3.2 1B's shapes with 6 of its 16 layers: 627M params, 1.25 GB in bfloat16; the tied embedding (128,256 x
# 2,048, 525 MB) is the largest tensor.
HF_SHAPE = ["n_layers=6", "dtype=bfloat16"]
HF_CHILD = """
import json, sys, time
from importlib.metadata import entry_points

# A CPU job, measured as a host without accelerators runs it: a PJRT plugin installed here for compiling (the gpu-aot
# extra's CUDA plugin) loads its CUDA libraries into every JAX process, 650 MB of RSS on this machine.
for plugin in entry_points(group="jax_plugins"):
    sys.modules[plugin.value] = None
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", {devices})
if {processes} > 1:
    jax.distributed.initialize("127.0.0.1:{port}", num_processes={processes}, process_id=int(sys.argv[1]))
from jaxtrain.interop.exporting import export_hf
from jaxtrain.interop.importing import import_hf


def rss(field):  # this process's own figures: getrusage's maxrss would include the parent's, from before exec
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


jax.devices()
baseline = rss("VmRSS")
start = time.perf_counter()
{call}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "peak_rss": rss("VmHWM"), "baseline_rss": baseline}}))
"""


def hf_child(call: str, processes: int, devices: int) -> dict:
    """Run `call` (import_hf or export_hf) in `processes` fresh processes of `devices` CPU devices each (a job, when
    several): wall seconds, and each process's peak RSS, and its RSS before the call (JAX and jaxtrain imported)."""
    code = HF_CHILD.format(devices=devices, processes=processes, port=12000 + os.getpid() % 1000, call=call)
    children = [
        subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, cwd=ROOT)
        for i in range(processes)
    ]
    results = [json.loads(child.communicate()[0].decode().strip().splitlines()[-1]) for child in children]
    return {
        "seconds": max(r["seconds"] for r in results),
        "peak_rss": max(r["peak_rss"] for r in results),
        "baseline_rss": max(r["baseline_rss"] for r in results),
    }


def write_random_hf(directory: Path, cfg) -> tuple[int, int]:
    """A Hugging Face directory of `cfg.model` with random bfloat16 weights; (its weight bytes, its largest)."""
    from jaxtrain.interop.exporting import write_hf
    from jaxtrain.interop.importing import params_shardings

    rng = np.random.default_rng(0)
    abstract = params_shardings(cfg, "data=1", jax.devices()[:1]).abstract_state["params"]
    params = jax.tree.map(
        lambda x: (rng.standard_normal(x.shape, np.float32) * 0.02).astype(jax.numpy.bfloat16), abstract
    )
    write_hf(params, cfg.model, directory, dtype="bfloat16")
    sizes = [x.nbytes for x in jax.tree.leaves(params)]
    return sum(sizes), max(sizes)


def bench_hf(args, peak) -> dict:
    """Import and export of a >= 1 GB model, each in fresh processes: in one process (1 device, and 8 simulated
    devices on fsdp=8, which one process holds all of), and as a job of 2 processes x 1 device on fsdp=2."""
    from jaxtrain.run_config import apply_overrides, default_config

    cfg = apply_overrides(default_config("llama-1b"), HF_SHAPE)
    report = {"model": "llama-1b " + " ".join(HF_SHAPE)}
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as root:
        root = Path(root)
        model_bytes, largest = write_random_hf(root / "hf", cfg)
        report.update(model_mb=round(model_bytes / 1e6, 1), largest_tensor_mb=round(largest / 1e6, 1))
        for processes, devices in ((1, 1), (1, 8), (2, 1)):
            name, mesh = f"{processes}x{devices}", f"fsdp={processes * devices}"
            calls = {"import": f"import_hf('{root / 'hf'}', '{root / name}', mesh='{mesh}')"}
            if processes == 1:  # export runs in one process (docs/huggingface.md)
                calls["export"] = (
                    f"export_hf('{root / name}', '{root / (name + '-hf')}', dtype='bfloat16', mesh='{mesh}')"
                )
            for what, call in calls.items():
                got = hf_child(call, processes, devices)
                target = model_bytes / processes + largest + 2**30  # a process holds its devices' shards
                report[f"{what}_{name}"] = {
                    "mesh": mesh,
                    "mb_s": round(model_bytes / got["seconds"] / 1e6, 1),
                    "peak_rss_mb": round(got["peak_rss"] / 1e6, 1),
                    "rss_before_mb": round(got["baseline_rss"] / 1e6, 1),
                    "target_rss_mb": round(target / 1e6, 1),
                    "within_target": got["peak_rss"] <= target,
                }
                log(f"hf {what} {name}: {report[f'{what}_{name}']}")
    return report


def async_run(args, mode: str) -> dict:
    """One run of the Ray engine (`mode` async or sync) over the same samples, with its evaluations' wall times."""
    from jaxtrain.asynchronous.engine import train_async
    from jaxtrain.run_config import apply_overrides, default_config

    shakespeare = Path(os.environ.get("JAXTRAIN_DATA_DIR", ROOT.parent / "shared" / "data")) / "tinyshakespeare.txt"
    workers, updates = args.async_workers, args.async_samples // args.async_batch
    per_update = workers if mode == "sync" else 1
    overrides = [f"data.source={shakespeare if shakespeare.exists() else 'builtin'}", "seq_len=64"]
    overrides += [f"batch_size={args.async_batch}", f"steps={updates // per_update}", "progress=false"]
    overrides += [f"eval_every={max(1, updates // per_update // 6)}", "eval_batches=2", "log_every=1000"]
    overrides += ["engine.kind=ray", f"engine.mode={mode}", f"workers={workers}", f"slow_workers={workers - 1}:3"]
    cfg = apply_overrides(default_config("gpt-tiny"), overrides)
    summary = train_async(cfg, log=lambda *_: None)
    evals = [{"samples": row["step"] * per_update * args.async_batch, "wall_s": round(row["wall_s"], 2),
              "val_loss": round(row["val_loss"], 4)} for row in summary["evals"]]  # fmt: skip
    keys = ("samples_per_sec", "staleness_mean", "staleness_max", "gradients_per_worker", "loss")
    return {**{k: summary[k] for k in keys}, "evals": evals, "data": overrides[0].split("=", 1)[1]}


def bench_async(args, peak) -> dict:
    """Async vs sync updates of the Ray engine with one worker slowed 3x, runs alternated, `--async-rounds` each."""
    import ray

    from jaxtrain.asynchronous.cluster import runtime_env

    ray.init(num_cpus=args.async_workers, include_dashboard=False, runtime_env=runtime_env(), logging_level="warning")
    runs = {"async": [], "sync": []}
    try:
        for _ in range(args.async_rounds):
            for mode in runs:
                runs[mode].append(async_run(args, mode))
                log(f"async {mode}: {runs[mode][-1]}")
    finally:
        ray.shutdown()
    rates = {mode: statistics.median(r["samples_per_sec"] for r in got) for mode, got in runs.items()}
    report = {
        "workers": args.async_workers,
        "slowed": f"worker {args.async_workers - 1}: 3x",
        "samples_per_sec": rates,
        "async_over_sync": round(rates["async"] / rates["sync"], 3),
        "target": 1.5,
        "runs": runs,
    }
    if args.async_plot:
        plot_async(runs, Path(args.async_plot))
    return report


def plot_async(runs: dict, out: Path) -> None:
    """Validation loss against wall time, every run of each mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for (mode, got), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        for number, run in enumerate(got):
            wall, loss = [e["wall_s"] for e in run["evals"]], [e["val_loss"] for e in run["evals"]]
            label = f"{mode} ({run['samples_per_sec']:.0f} samples/s)"
            axes.plot(wall, loss, marker="o", color=color, alpha=1 - 0.4 * number, label=label)
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("validation loss (nats/byte)")
    axes.set_title("4 Ray workers, one 3x slower: async vs sync updates")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=100)


def bench_precision(args, peak: float) -> dict:
    """bf16 against int8 and fp8 matmuls (and FSDP's gather in 8 bits): per-device bytes of Llama 3.2 1B's shapes
    compiled for v5p:2x2x2 and h100:8, and validation loss and step time after N steps here (benchmarks/precision.py,
    which also runs alone and draws the curves)."""
    import types

    import precision

    options = types.SimpleNamespace(
        steps=args.precision_steps, eval_every=max(args.precision_steps // 10, 1), layers=2, batch=16
    )
    return {"curves": precision.curves(options), "compiled": precision.compiled_modes(options)}


SECTIONS = {
    "meshes": bench_meshes,
    "variants": bench_variants,
    "overhead": bench_overhead,
    "compile": bench_compile,
    "pipeline": bench_pipeline,
    "checkpoint": bench_checkpoint,
    "maxtext": bench_maxtext,
    "attention": bench_attention,
    "context": bench_context,
    "gradsync": bench_gradsync,
    "data": bench_data,
    "hf": bench_hf,
    "async": bench_async,
    "adapters": bench_adapters,
    "small": bench_small,
    "precision": bench_precision,
}


def markdown(report: dict) -> str:
    """The report's throughput sections as Markdown tables, headed by the machine's peak and where it came from:
    `meshes` (tokens/s and MFU per mesh), `small` (model FLOP/s against a plain matmul), `maxtext` (ratios)."""
    lines = [
        f"jax {report['jax']}, {report['devices']} simulated CPU devices; MFU against a peak of "
        f"{report['peak_flops'] / 1e9:,.0f} GFLOP/s ({report['peak_source']}).",
        "",
    ]
    if "meshes" in report:
        lines += [f"The benchmark GPT ({', '.join(SHAPE)}), medians of alternated rounds:", ""]
        lines += ["| mesh | step s | tokens/s | MFU |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{mesh}` | {r['step_time_s']:.4f} | {r['tokens_per_sec']:,.0f} | {r['mfu']:.1%} |"
            for mesh, r in report["meshes"].items()
        ]
        lines.append("")
    if "small" in report:
        small = report["small"]
        rates = ", ".join(f"{k.split(',')[1]} {v:,.0f}" for k, v in small.items() if k.startswith("matmul"))
        lines += [f"Small GPTs (4 layers) on one device against a plain 2048² matmul (GFLOP/s: {rates}):", ""]
        lines += ["| model, dtype | step ms | model GFLOP/s | of the matmul rate |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {name} | {r['step_ms']} | {r['model_gflops']} | {r['of_matmul']:.2f} |"
            for name, r in small.items()
            if not name.startswith("matmul")
        ]
        lines.append("")
    if "maxtext" in report:
        lines += ["Against MaxText 0.2.5, tokens/s per round:", ""]
        lines += [
            "| case | model, mesh | jaxtrain | MaxText | ratio of medians | matmuls' share of our step | "
            "ratio if only matmuls took time |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {name} | {' '.join([r['jaxtrain_model'], *r['jaxtrain_overrides']])}, {r['mesh']} | "
            f"{', '.join(f'{t:,.0f}' for t in r['jaxtrain_tokens_per_sec'])} | "
            f"{', '.join(f'{t:,.0f}' for t in r['maxtext_tokens_per_sec'])} | {r['ratio_of_medians']} | "
            f"{_share(r['matmul_floor_over_step'])} | {r['ratio_with_matmuls_only'] or 'n/a'} |"
            for name, r in report["maxtext"].items()
        ]
        lines.append("")
    return "\n".join(lines)


def _share(fraction: float | None) -> str:
    return "n/a (matmuls in branches)" if fraction is None else f"{fraction:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="meshes,variants,overhead,compile", help="comma-separated sections")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mesh", default="fsdp=8", help="mesh for the variants section")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--pipeline-stages", default="2,4", help="pipeline section: stage counts P to measure")
    parser.add_argument("--checkpoint-mesh", default="fsdp=8", help="checkpoint section: the mesh saved from")
    parser.add_argument(
        "--checkpoint-dir", default=None, help="checkpoint section: where to write (default: a tmp dir)"
    )
    parser.add_argument("--sync-sizes", default="1,4,16,64", help="gradsync section: gradient sizes in MB")
    parser.add_argument("--attention-seqs", default="128,256,512,1024,2048,4096", help="attention section")
    parser.add_argument("--context-seqs", default="1024,2048,4096,8192", help="context section: sequence lengths")
    parser.add_argument("--context-sizes", default="1,2,4,8", help="context section: context axis sizes")
    parser.add_argument("--context-rounds", type=int, default=2, help="context section: timed rounds of one step")
    parser.add_argument("--data-mb", type=float, default=8, help="data section: MB of text to tokenize")
    parser.add_argument("--maxtext-rounds", type=int, default=3)
    parser.add_argument("--maxtext-steps", type=int, default=40)
    parser.add_argument("--maxtext-models", default=",".join(MAXTEXT_CASES), help=f"of {', '.join(MAXTEXT_CASES)}")
    parser.add_argument("--async-workers", type=int, default=4, help="async section: Ray workers (the last slowed 3x)")
    parser.add_argument("--async-batch", type=int, default=8, help="async section: rows per worker gradient")
    parser.add_argument("--async-samples", type=int, default=1536, help="async section: samples trained per run")
    parser.add_argument("--async-rounds", type=int, default=2, help="async section: runs of each mode, alternated")
    parser.add_argument("--async-plot", default=None, help="async section: draw val loss vs wall time in this PNG")
    parser.add_argument("--precision-steps", type=int, default=500, help="precision section: steps per curve")
    parser.add_argument("--markdown", default=None, help="also write the meshes, small and maxtext tables to this file")
    args = parser.parse_args()

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxtrain.analysis.flops import peak_flops

    peak, source = peak_flops(jax.devices(), "bfloat16")
    report = {
        "jax": jax.__version__,
        "devices": args.devices,
        "peak_flops": peak,
        "peak_source": source,
        "shape": SHAPE,
    }
    for name in args.only.split(","):
        log(f"benchmark: {name}")
        report[name] = SECTIONS[name](args, peak)
        log(json.dumps(report[name]))
    print(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))


if __name__ == "__main__":
    main()
