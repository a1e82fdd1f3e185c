"""BERT in and out of Hugging Face: small randomly initialised `BertForMaskedLM` and `BertForSequenceClassification`
models (built here, nothing is downloaded) imported onto one device and onto meshes compute transformers' logits, with
padding and token types; exports load in transformers with jaxtrain's logits; what has no counterpart is one line.

Agreement is measured as max |ours - theirs| / max |theirs| (float32) over the MLM's token logits at real (unpadded)
positions and over the classifier's class logits: within 1e-4."""

import functools
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import extra_module

from jaxtrain.cli import main
from jaxtrain.interop.architectures import ArchitectureError
from jaxtrain.interop.encoders import BERT_CLASSIFIER, BERT_MLM
from jaxtrain.interop.exporting import write_hf
from jaxtrain.interop.importing import HFCheckpoint, params_shardings
from jaxtrain.run_config import apply_overrides, default_config

torch, transformers = extra_module("torch"), extra_module("transformers")

RTOL = 1e-4
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}
# The MLM with GELU's erf form; the classifier with its tanh form and three named labels.
KINDS = {
    "mlm": ("BertForMaskedLM", dict(hidden_act="gelu")),
    "classifier": ("BertForSequenceClassification", dict(hidden_act="gelu_new", id2label=LABELS)),
}
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(1, SIZES["vocab_size"], (4, 16))
MASK = np.ones_like(TOKENS)
MASK[1, 11:] = 0  # row 1 is padded at its end
TYPES = np.zeros_like(TOKENS)
TYPES[:, 6:] = 1  # sentence A, then sentence B
# The context mesh splits the 16 positions into 4 zig-zag chunks over 2 devices.
MESHES = {"data=1": 1, "data=2,fsdp=2,tensor=2": 8, "context=2,data=2": 4}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Each kind's transformers model (float32, seeded) and the directory save_pretrained wrote it to."""
    directory = tmp_path_factory.mktemp("bert")
    models = {}
    for kind, (class_name, settings) in KINDS.items():
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(transformers.BertConfig(**SIZES, **settings)).eval()
        with torch.no_grad():  # transformers starts biases at 0 and LayerNorms at 1: make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias") or "LayerNorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(directory / kind)
        models[kind] = (model, directory / kind)
    return models


def hf_logits(model) -> np.ndarray:
    """transformers' logits of the test batch: its padding by the attention mask."""
    tokens, mask, types = (torch.tensor(x) for x in (TOKENS, MASK, TYPES))
    with torch.no_grad():
        return model(tokens, attention_mask=mask, token_type_ids=types).logits.numpy()


def assert_logits_close(ours: np.ndarray, theirs: np.ndarray, rtol: float = RTOL) -> float:
    """Within `rtol` of the largest logit: every class logit, or the token logits of the real positions."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if theirs.ndim == 3:
        ours, theirs = ours[MASK == 1], theirs[MASK == 1]
    error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    assert error <= rtol, f"max |ours - transformers'| / max |transformers'| = {error:.3g}"
    return error


@functools.cache
def forward(directory: str, mesh: str):
    """The compiled forward pass (params, tokens, segment ids, token types) -> logits of the import of `directory`
    on `mesh`, with the params' shardings: compiled once per (model, mesh) for the tests that share it."""
    shardings = params_shardings(HFCheckpoint(directory).run_config("float32"), mesh, jax.devices()[: MESHES[mesh]])
    graphdef = shardings.model.graphdef
    batch = jax.ShapeDtypeStruct(TOKENS.shape, np.int32, sharding=shardings.batch_sharding(TOKENS.shape))
    compiled = shardings.compile(
        lambda p, tokens, segments, types: nnx.merge(graphdef, p)(tokens, segments, types),
        shardings.abstract_state["params"],
        batch,
        batch,
        batch,
        donate_state=False,
    )
    return compiled, shardings, batch.sharding


def jaxtrain_logits(source: HFCheckpoint, mesh: str, params=None) -> np.ndarray:
    """The logits of the import of `source` (its params read straight onto `mesh`, or `params` in model order) for
    the test batch; the padding's segment id is 0."""
    compiled, shardings, batch_sharding = forward(str(source.directory), mesh)
    abstract = shardings.abstract_state["params"]
    if params is None:
        params = source.read_params(source.run_config("float32").model, abstract)
    else:
        params = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), params, abstract)
    inputs = (jax.device_put(x.astype(np.int32), batch_sharding) for x in (TOKENS, MASK, TYPES))
    return np.asarray(compiled(params, *inputs))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("kind", KINDS)
def test_imported_logits_equal_transformers(kind, mesh, hf_models):
    model, path = hf_models[kind]
    assert_logits_close(jaxtrain_logits(HFCheckpoint(path), mesh), hf_logits(model))


def test_the_import_reads_config_json_as_encoder_settings(hf_models):
    mlm = HFCheckpoint(hf_models["mlm"][1]).run_config()
    assert mlm.model_name == "bert-tiny" and not mlm.model.gelu_approximate
    assert (mlm.model.max_positions, mlm.model.type_vocab_size, mlm.model.d_ff) == (64, 2, 128)
    classifier = HFCheckpoint(hf_models["classifier"][1]).run_config()
    assert classifier.model_name == "bert_classifier-tiny" and classifier.model.gelu_approximate
    assert classifier.model.n_classes == 3 and classifier.model.pooling == "first"


@pytest.mark.parametrize("kind", KINDS)
def test_import_then_export_loads_in_transformers_with_the_same_tensors(kind, hf_models, tmp_path, capsys):
    """`jaxtrain import-hf` onto fsdp=8, then `jaxtrain export-hf` from data=2,fsdp=2,tensor=2 in files of 20 kB: the
    same class, the same tensors bit for bit, the label names carried."""
    model, path = hf_models[kind]
    imported, out = tmp_path / "export", tmp_path / "hf"
    assert main(["import-hf", str(path), str(imported)]) == 0
    assert (
        main(["export-hf", str(imported), str(out), "--mesh", "data=2,fsdp=2,tensor=2", "--max-shard-mb", "0.02"]) == 0
    )
    assert f"{KINDS[kind][0]}.from_pretrained reads it" in capsys.readouterr().out
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    back = type(model).from_pretrained(out).eval()
    state, original = back.state_dict(), model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in original)
    assert back.config.id2label == model.config.id2label and back.config.hidden_act == model.config.hidden_act


def host_params(cfg) -> dict:
    """The params of `cfg`'s model as ShapeDtypeStructs without shardings: `read_params` reads them into numpy."""
    abstract = params_shardings(cfg, "data=1", jax.devices()[:1]).abstract_state["params"]
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)


def perturbed(params, scale: float = 0.05):
    """`params` (numpy, model order) each moved by noise of `scale` times its own spread: a state jaxtrain trained."""
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda x: x + scale * (x.std() + 0.1) * rng.standard_normal(x.shape).astype(x.dtype), params)


@pytest.mark.parametrize("kind", KINDS)
def test_a_changed_model_exports_with_the_logits_jaxtrain_computes(kind, hf_models, tmp_path):
    """The import's params moved off the checkpoint's values, written without the source's config.json (a model
    jaxtrain made): transformers computes jaxtrain's logits."""
    _, path = hf_models[kind]
    source = HFCheckpoint(path)
    cfg = source.run_config("float32")
    params = perturbed(source.read_params(cfg.model, host_params(cfg)))
    out = write_hf(params, cfg.model, tmp_path / "hf", model_name=cfg.model_name)
    back = getattr(transformers, KINDS[kind][0]).from_pretrained(out).eval()
    ours = jaxtrain_logits(source, "data=1", params)
    assert_logits_close(ours, hf_logits(back))
    assert np.abs(ours - jaxtrain_logits(source, "data=1")).max() > 1e-2  # not the import's logits
    assert back.config.hidden_act == KINDS[kind][1]["hidden_act"]  # GELU's form, from gelu_approximate alone
    if kind == "classifier":
        assert back.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}


def test_bert_base_uncased_names_import(hf_models, tmp_path):
    """A checkpoint as bert-base-uncased's: LayerNorm tensors named gamma and beta, and the pre-training tensors
    BertForMaskedLM drops (pooler, next-sentence head, the decoder's tied copies, position ids) imports the same
    params."""
    from safetensors.numpy import load_file, save_file

    model, path = hf_models["mlm"]
    tensors = {
        name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): x
        for name, x in load_file(path / "model.safetensors").items()
    }
    d = SIZES["hidden_size"]
    tensors.update(
        {
            "bert.pooler.dense.weight": np.zeros((d, d), np.float32),
            "bert.pooler.dense.bias": np.zeros(d, np.float32),
            "cls.seq_relationship.weight": np.zeros((2, d), np.float32),
            "cls.seq_relationship.bias": np.zeros(2, np.float32),
            "cls.predictions.decoder.weight": tensors["bert.embeddings.word_embeddings.weight"],
            "cls.predictions.decoder.bias": tensors["cls.predictions.bias"],
            "bert.embeddings.position_ids": np.arange(SIZES["max_position_embeddings"])[None],
        }
    )
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file(tensors, legacy / "model.safetensors")
    (legacy / "config.json").write_bytes((path / "config.json").read_bytes())
    cfg = HFCheckpoint(path).run_config()
    read = [HFCheckpoint(p).read_params(cfg.model, host_params(cfg)) for p in (path, legacy)]
    jax.tree.map(np.testing.assert_array_equal, *read)


def edited_copy(path, tmp_path, **config) -> str:
    """A copy of the model directory `path` whose config.json has `config`'s keys changed."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for name in os.listdir(path):
        os.link(path / name, copy / name)
    settings = json.loads((copy / "config.json").read_text())
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**settings, **config}))
    return str(copy)


@pytest.mark.parametrize(
    "kind,change,message",
    [
        ("mlm", {"hidden_act": "relu"}, "hidden_act='relu' (jaxtrain's encoder computes GELU: gelu, gelu_new"),
        ("mlm", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ("mlm", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
        ("mlm", {"is_decoder": True}, "is_decoder or add_cross_attention"),
        ("classifier", {"problem_type": "multi_label_classification"}, "problem_type='multi_label_classification'"),
    ],
)
def test_settings_bert_has_and_jaxtrain_lacks_are_one_line(kind, change, message, hf_models, tmp_path, capsys):
    edited = edited_copy(hf_models[kind][1], tmp_path, **change)
    assert main(["import-hf", edited, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "has settings jaxtrain cannot express" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model,overrides,message",
    [
        ("bert-tiny", ["norm=pre"], "norm='pre' (BERT normalises after each block: norm=post)"),
        ("bert-tiny", ["positions=rotary"], "positions='rotary' (BERT learns a table of positions"),
        ("bert_classifier-tiny", ["pooling=mean"], "pooling='mean' (BERT's classifier reads the first token"),
    ],
)
def test_an_encoder_no_bert_computes_is_refused_before_anything_is_written(model, overrides, message, tmp_path):
    cfg = apply_overrides(default_config(model), overrides)
    with pytest.raises(ArchitectureError) as caught:
        write_hf({}, cfg.model, tmp_path / "hf", model_name=cfg.model_name)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("arch", [BERT_MLM, BERT_CLASSIFIER])
def test_every_param_of_the_encoder_has_one_row_with_its_dims(arch):
    """The table and the model's params name the same arrays, each row with a letter per dim of its param (of a
    layer's, for the stacked blocks), and no two rows the same tensor."""
    cfg = default_config(arch.model)
    flat = jax.tree_util.tree_flatten_with_path(host_params(cfg))[0]
    shapes = {"/".join(k.key for k in path): x.shape for path, x in flat}
    rows = {t.param: t for t in arch.tensors_of(cfg.model)}
    assert rows.keys() == shapes.keys()
    assert all(len(t.dims.split()) == len(shapes[p]) - t.stacked for p, t in rows.items())
    assert len({t.hf_name for t in rows.values()}) == len(rows)
