"""The BERT encoder (models/bert.py): bidirectional, padding-blind, sharded runs equal one device's, a run resumed on
another mesh masks the same tokens and gives the same losses, and a classifier starts from an MLM checkpoint's
encoder."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_curves_close, cached_run, curve, reference_curve

from jaxtrain.errors import ConfigError
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.checkpoint import Checkpoints, restore
from jaxtrain.training.loop import train
from jaxtrain_models import bert

MLM = "bert-tiny"
CLASSIFIER = "bert_classifier-tiny"
# BertForMaskedLM's and BertForSequenceClassification's parameter counts at bert-base-uncased's shape, as
# transformers builds them (tests/test_hf_bert.py compares a small model's tensors with transformers' directly).
HF_BERT_BASE = {"mlm": 109_514_298, "classifier": 109_483_778}


def build(cfg, model_type):
    with nnx.use_eager_sharding(False):
        return model_type(cfg, nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny():
    return build(bert.PRESETS["tiny"](), bert.MaskedLM)


def count(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_parameter_counts_equal_transformers_bert_base():
    for key, (presets, model_type) in {
        "mlm": (bert.PRESETS, bert.MaskedLM),
        "classifier": (bert.CLASSIFIER_PRESETS, bert.Classifier),
    }.items():
        cfg = presets["base"]()
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda cfg=cfg, model_type=model_type: model_type(cfg, nnx.Rngs(0)))
        assert count(abstract) == cfg.num_params() == HF_BERT_BASE[key]


def test_attention_sees_later_tokens(tiny):
    """A decoder's first position ignores the last token; an encoder's does not."""
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 256
    changed = tokens.at[0, -1].set(200)
    first = tiny(tokens)[0, 0], tiny(changed)[0, 0]
    assert float(jnp.max(jnp.abs(first[0] - first[1]))) > 1e-4


def test_padding_does_not_change_the_tokens_outputs(tiny):
    tokens = jnp.arange(12, dtype=jnp.int32)[None] + 40
    alone = tiny(tokens)
    padded = jnp.concatenate([tokens, jnp.full((1, 4), 7, jnp.int32)], 1)
    segments = jnp.concatenate([jnp.ones((1, 12), jnp.int32), jnp.zeros((1, 4), jnp.int32)], 1)
    np.testing.assert_allclose(tiny(padded, segment_ids=segments)[:, :12], alone, rtol=1e-5, atol=1e-5)


def test_a_sequence_longer_than_the_position_table_is_a_clear_error():
    model = build(bert.EncoderConfig(max_positions=8), bert.MaskedLM)
    with pytest.raises(ConfigError, match="sequences of 16 tokens.*max_positions=8.*positions=rotary"):
        model(jnp.zeros((1, 16), jnp.int32))


@pytest.mark.parametrize("overrides", [(), ("positions=rotary", "norm=pre")], ids=["bert", "rotary-prenorm"])
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "context=2,data=4", "context=4,tensor=2"])
def test_sharded_mlm_training_equals_one_device(mesh, overrides):
    if overrides and mesh != "context=2,data=4":
        pytest.skip("the variants run on the context mesh; the plain model on every mesh")
    got = curve(cached_run(mesh, overrides, model=MLM))
    assert_curves_close(got, reference_curve(overrides, model=MLM), rtol=1e-5)


def test_sharded_classifier_training_equals_one_device():
    got = curve(cached_run("context=2,fsdp=2,tensor=2", (), model=CLASSIFIER))
    assert_curves_close(got, reference_curve((), model=CLASSIFIER), rtol=1e-5)


RUN = ["batch_size=8", "seq_len=32", "warmup_steps=1", "learning_rate=0.01", "steps=4", "log_every=1"]
RUN += ["eval_every=1000", "progress=false", "checkpoint.every=2"]


def run_train(model, mesh, directory, extra=()):
    cfg = apply_overrides(default_config(model), [*RUN, f"mesh={mesh}", f"checkpoint.dir={directory}", *extra])
    result = train(cfg, log=lambda *_: None, devices=jax.devices())
    return {r["step"]: r["loss"] for r in result["history"]}


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    """4 MLM steps on context=2,data=4 with checkpoints at 2 and 4."""
    directory = tmp_path_factory.mktemp("mlm") / "ckpt"
    return directory, run_train(MLM, "context=2,data=4", directory)


def test_mlm_resumed_on_another_mesh_masks_the_same_tokens(mlm_run, tmp_path):
    directory, whole = mlm_run
    resumed_dir = tmp_path / "ckpt"
    shutil.copytree(directory, resumed_dir)
    shutil.rmtree(resumed_dir / "4")
    with Checkpoints(resumed_dir, 2) as checkpoints:
        assert checkpoints.steps() == [2]
    resumed = run_train(MLM, "data=2,fsdp=2,tensor=2", resumed_dir)
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], [whole[3], whole[4]], rtol=1e-5)
    batches = [
        jax.device_get(cached_run(mesh, (), model=MLM).batch("train", 3)) for mesh in ("context=2,data=4", "data=8")
    ]
    for key in ("tokens", "targets", "loss_weights"):
        np.testing.assert_array_equal(batches[0][key], batches[1][key])


def test_classifier_fine_tunes_from_an_mlm_checkpoint(mlm_run, tmp_path):
    """The classifier takes the MLM checkpoint's encoder and starts its pooler and classifier fresh (a step at
    learning rate 0 leaves the params as restored)."""
    directory, _ = mlm_run
    lines = []
    overrides = [*RUN, "steps=1", "learning_rate=0", "mesh=data=8", f"checkpoint.dir={tmp_path / 'cls'}"]
    cfg = apply_overrides(default_config(CLASSIFIER), [*overrides, f"checkpoint.restore={directory / '4'}"])
    result = train(cfg, log=lines.append, devices=jax.devices())
    fresh = [line.rsplit("new: ", 1)[1] for line in lines if "its params where this model has the same" in line]
    assert fresh and set(fresh[0].split(", ")) == {"w_pool", "b_pool", "w_classes", "b_classes"}, lines
    mlm = cached_run("data=8", (), model=MLM)
    stored, _ = restore(directory / "4", mlm.shardings.abstract_model_state())
    got = jax.device_get(result["state"]["params"]["encoder"])
    for want, have in zip(jax.tree.leaves(jax.device_get(stored["params"]["encoder"])), jax.tree.leaves(got)):
        np.testing.assert_array_equal(have, want)
