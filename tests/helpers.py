"""Small shared test helpers: build a run on some devices, take steps or gradients, compare with a reference."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.aot.targets import TPU_CHIPS, Target, compile_target, installed, parse_target
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.setup import Run, build

# Gradients computed in bfloat16 on two meshes (or a mesh and one device), leaf by leaf: measured within 9.2e-3 of each
# other on gpt-tiny; a gradient off by a constant factor of 2 is off by 1.
BF16_GRAD_RTOL = 3e-2
TINY = ["batch_size=8", "seq_len=32", "train.steps=10", "warmup_steps=1", "learning_rate=0.01"]


def make_run(mesh: str, overrides: list[str] = (), model: str = "gpt-tiny", devices: int = 8) -> Run:
    """A run whose steps compile when first used."""
    cfg = apply_overrides(default_config(model), [*TINY, *overrides, f"mesh={mesh}"])
    return build(cfg, log=lambda *_: None, devices=jax.devices()[:devices])


@functools.cache
def cached_run(mesh: str, overrides: tuple[str, ...] = (), model: str = "gpt-tiny") -> Run:
    """`make_run` once per test session for each (mesh, overrides, model), on 1 device for "single", else 8: tests
    that share a run share its compiled steps (each compile costs seconds)."""
    return make_run(mesh, overrides, model=model, devices=1 if mesh == "single" else 8)


def extra_module(name: str, extra: str = "hf"):
    """Module `name`, from a project extra. Where it is not installed the calling test module skips saying which extra
    installs it, except under CI (CI=true), which installs every extra: there the import fails, since a skip would
    hide a broken install."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"needs the {extra} extra: pip install -e '.[{extra}]'")


@functools.cache
def aot_target(name: str, slices: int = 1) -> Target:
    """The compile-only devices called `name` ('v5p:2x2x2', 'h100:8'), once per session. Where the extra that
    compiles for them is not installed the test skips saying which, except under CI (CI=true), which installs both
    extras: there a skip would hide a broken install."""
    package, extra = (
        ("libtpu", "tpu-aot") if parse_target(name)[0] in TPU_CHIPS else ("jax_plugins.xla_cuda12", "gpu-aot")
    )
    if not installed(package):
        why = f"compiling for {name} needs the {extra} extra: pip install -e '.[{extra}]'"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{why}; CI installs it", pytrace=False)
        pytest.skip(why)
    return compile_target(name, slices)


def aot_run(target: Target, mesh: str, overrides: tuple[str, ...] = (), model: str = "gpt-tiny") -> Run:
    """A run built on `target`'s compile-only devices: its steps compile for that hardware and cannot run."""
    cfg = apply_overrides(default_config(model), [*TINY, *overrides, f"mesh={mesh}"])
    return build(cfg, log=lambda *_: None, devices=target.devices)


@functools.cache
def reference_curve(overrides: tuple[str, ...] = (), model: str = "gpt-tiny") -> dict[str, np.ndarray]:
    """The first 5 training steps' losses and gradient norms on one device: what every mesh must reproduce."""
    return curve(cached_run("single", overrides, model))


def curve(run: Run, steps: int = 5, params=None) -> dict[str, np.ndarray]:
    """Loss and gradient norm (before clipping) of the first `steps` training steps of `run`, from its own
    initialisation or from `params` (model order). The norm sees a gradient off by a constant factor (a sum where a
    mean belongs), which the losses of clipped AdamW steps hardly show."""
    state = run.shardings.init_state(run.optimizer, run.cfg.train.seed, params)
    out = {"loss": [], "grad_norm": []}
    for step in range(steps):
        state, metrics = run.train_step(state, run.batch("train", step))
        for key, values in out.items():
            values.append(float(metrics[key]))
    return {key: np.array(values) for key, values in out.items()}


def assert_curves_close(got: dict[str, np.ndarray], reference: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    """Losses and gradient norms step by step within `rtol`."""
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], reference[key], rtol=rtol, err_msg=key)


def gradients(run: Run) -> tuple[float, list[np.ndarray]]:
    """Loss and gradient leaves (in the model's own layer order) of the initial params on the first batch."""
    params = run.shardings.init_state(run.optimizer, run.cfg.train.seed)["params"]
    (loss, _), grads = run.compiled_grad(params, run.batch("train", 0))
    return float(loss), [
        np.asarray(g) for g in jax.tree.leaves(jax.device_get(run.shardings.params_in_model_order(grads)))
    ]


def assert_gradients_close(got: list[np.ndarray], reference: list[np.ndarray], rtol: float = 1e-5) -> None:
    """Each gradient leaf within `rtol` of the reference, relative to the leaf's norm (elementwise relative error
    is meaningless for entries that are zero up to rounding)."""
    assert len(got) == len(reference)
    for leaf, (g, r) in enumerate(zip(got, reference)):
        assert g.shape == r.shape
        error, norm = np.linalg.norm(g - r), np.linalg.norm(r)
        assert error <= rtol * norm, f"leaf {leaf} {r.shape}: |got - reference| = {error:.3g}, |reference| = {norm:.3g}"


def with_random_adapters(run: Run) -> dict:
    """`run`'s initial train state on its devices, as host arrays in model order, with every adapter factor drawn at
    random: B is no longer zero, so A has a gradient too."""
    model, state = run.shardings.model, run.shardings.init_state(run.optimizer, 0)
    trained, frozen = model.split(state["params"])
    leaves, treedef = jax.tree.flatten(trained)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    drawn = [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.device_get({**state, "params": model.join(jax.tree.unflatten(treedef, drawn), frozen)})


def adapter_gradients(run: Run, start: dict) -> tuple[float, list[np.ndarray]]:
    """The loss and each adapter factor's gradient (model order) at train state `start` (model order), on `run`'s
    mesh."""
    shardings, model = run.shardings, run.shardings.model
    params = shardings.state_from_model_order(start)["params"]
    (loss, _), grads = run.compiled_grad(params, run.batch("train", 0))
    in_model_order = shardings.params_in_model_order(model.join(grads, model.split(params)[1]))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(jax.device_get(model.trainable(in_model_order)))]


def assert_adapters_match_one_device(one: Run, sharded: Run, start: dict) -> None:
    """The loss and every adapter gradient of `sharded` at `start` equal one device's (`one`), float32 within 1e-5;
    gpt-tiny's 6 adapted weights (q k v out in down) each give A and B a nonzero gradient."""
    ref_loss, reference = adapter_gradients(one, start)
    assert len(reference) == 2 * 6 and all(np.abs(g).max() > 0 for g in reference)
    loss, got = adapter_gradients(sharded, start)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_gradients_close(got, reference, rtol=1e-5)


# -- processes killed with SIGKILL (tests/test_fault_tolerance.py, tests/test_grpo_restart.py) ------------------------


def logged_rows(metrics: Path) -> list[dict]:
    """The records of a metrics file's complete lines; a SIGKILL can cut the last one short."""
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def kill_when(process: subprocess.Popen, ready, timeout: float = 120.0) -> bool:
    """SIGKILL `process` as soon as `ready()` holds; False if it finished first."""
    deadline = time.time() + timeout
    while process.poll() is None and time.time() < deadline:
        if ready():
            process.kill()
            process.wait()
            return True
        time.sleep(0.002)
    return False


def newest(directory: Path) -> int:
    """The newest complete checkpoint (Orbax renames a finished write to its step number), read without Orbax,
    whose manager would clean up the interrupted writes a test may look for."""
    return max([int(p.name) for p in directory.glob("*") if p.name.isdigit()], default=0)
