"""Real learning on real data (slow: minutes). Run with: python -m pytest -m slow"""

import jax
import numpy as np
import pytest
from conftest import shared_file
from flax import nnx

from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.loop import train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "pipeline=2,data=2,tensor=2"])
def test_tiny_gpt_learns_tinyshakespeare(mesh):
    text = shared_file("tinyshakespeare.txt")
    cfg = apply_overrides(
        default_config("gpt-tiny"),
        [
            f"data.source={text}",
            f"mesh={mesh}",
            "steps=300",  # docs/results/convergence.json: gpt-tiny at 2.18 by step 200 (synchronous, replica=8)
            "batch_size=32",
            "seq_len=128",
            "learning_rate=3e-3",
            "warmup_steps=50",
            "eval_every=150",
            "eval_batches=8",
            "progress=false",
        ],
    )
    summary = train(cfg, log=lambda *_: None)
    val = [r["val_loss"] for r in summary["history"] if "val_loss" in r]
    assert val[-1] < 2.5, val


def test_mlp_reaches_95_percent_on_digits_data_parallel():
    digits = shared_file("digits.csv.gz")
    cfg = apply_overrides(
        default_config("mlp"),
        [
            f"data.source={digits}",
            "mesh=data=8",
            "steps=400",
            "batch_size=64",
            "learning_rate=3e-3",
            "weight_decay=1e-4",
            "eval_every=400",
            "progress=false",
        ],
    )
    summary = train(cfg, log=lambda *_: None)
    from jaxtrain.data.datasets import Digits
    from jaxtrain_models.mlp import MLP

    features, labels = Digits(digits, seed=0).splits["val"]  # the whole held-out split, 359 images
    with nnx.use_eager_sharding(False):
        model = nnx.merge(nnx.graphdef(MLP(cfg.model, nnx.Rngs(0))), jax.device_get(summary["state"]["params"]))
    accuracy = float(np.mean(np.argmax(model(features), -1) == labels))
    assert accuracy >= 0.95, accuracy
