"""Small shared test helpers: build a run on some devices, take steps, compare with a reference."""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.config import apply_overrides, default_config
from jaxtrain.run import Setup, setup

TINY = ["batch_size=8", "seq_len=32", "train.steps=10", "warmup_steps=1", "learning_rate=0.01"]


def make_run(mesh: str, overrides: list[str] = (), model: str = "gpt-tiny", devices: int = 8) -> Setup:
    cfg = apply_overrides(default_config(model), [*TINY, *overrides, f"mesh={mesh}"])
    return setup(cfg, log=lambda *_: None, devices=jax.devices()[:devices])


def losses(run: Setup, steps: int = 5) -> np.ndarray:
    state = run.plan.init_state(run.optimizer, run.cfg.train.seed)
    out = []
    for step in range(steps):
        state, metrics = run.train_step(state, run.batch("train", step))
        out.append(float(metrics["loss"]))
    return np.array(out)
