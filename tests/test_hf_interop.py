"""Hugging Face checkpoints in and out: small randomly initialised transformers models (built here, nothing is
downloaded) imported onto one device and onto meshes compute transformers' logits; exports load in transformers
with the same logits; greedy generation matches token for token; bad input is one clear line.

Agreement is measured as max |ours - theirs| / max |theirs| over all logits (float32): within 1e-4."""

import copy
import functools
import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import shared_file
from flax import nnx
from helpers import extra_module, make_run

from jaxtrain.cli import main
from jaxtrain.interop.exporting import export_hf, write_hf
from jaxtrain.interop.importing import HFCheckpoint, import_hf, params_shardings
from jaxtrain.run_config import apply_overrides
from jaxtrain.training.setup import build

torch, transformers = extra_module("torch"), extra_module("transformers")

RTOL = 1e-4
SIZES = dict(
    vocab_size=256,  # byte-level text fits it (the fine-tuning test)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,  # logits spread over several nats: greedy choices are far from ties
    bos_token_id=None,
    eos_token_id=None,  # generation runs its full length on both sides
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # shorter than the test sequences: the scaling matters
}
# Each architecture, and between them tied and untied embeddings, 1 and 2 key/value heads, llama3 RoPE scaling, a
# head_dim other than hidden / heads, a sliding window shorter than the sequence.
VARIANTS = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-mqa-untied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32, rope_parameters=LLAMA3_ROPE)),
}
TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (4, 24))


@functools.cache
def hf_model(variant: str, directory: str):
    """The transformers model of `variant` (float32, seeded) and the directory it is saved in."""
    config_class, settings = VARIANTS[variant]
    config = getattr(transformers, config_class)(**SIZES, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if config_class == "Qwen2Config":  # transformers initialises biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    path = os.path.join(directory, variant)
    if not os.path.isdir(path):
        model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def assert_logits_close(ours: np.ndarray, theirs: np.ndarray, rtol: float = RTOL) -> float:
    error = float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())
    assert error <= rtol, f"max |ours - transformers'| / max |transformers'| = {error:.3g}"
    return error


def logits_on(mesh: str, source: HFCheckpoint, tokens: np.ndarray, devices: int = 8) -> np.ndarray:
    """The imported model's logits with its params read straight onto `mesh` (each device's shard alone)."""
    cfg = source.run_config("float32")
    shardings = params_shardings(cfg, mesh, jax.devices()[:devices])
    params = source.read_params(cfg.model, shardings.abstract_state["params"])
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(shardings.abstract_state["params"])):
        assert got.sharding == want.sharding
    w_q = params["blocks"]["w_q"]
    assert devices == 1 or w_q.addressable_shards[0].data.size < w_q.size  # read in pieces, not whole and split
    graphdef = shardings.model.graphdef
    batch = jax.ShapeDtypeStruct(tokens.shape, np.int32, sharding=shardings.batch_sharding(tokens.shape))
    forward = shardings.compile(
        lambda p, t: nnx.merge(graphdef, p)(t), shardings.abstract_state["params"], batch, donate_state=False
    )
    return np.asarray(forward(params, jax.device_put(tokens.astype(np.int32), batch.sharding)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_logits_equal_transformers_on_one_device(variant, hf_dir):
    model, path = hf_model(variant, hf_dir)
    assert_logits_close(logits_on("data=1", HFCheckpoint(path), TOKENS, devices=1), hf_logits(model, TOKENS))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "pipeline=2,data=2,tensor=2"])
def test_imported_logits_equal_transformers_on_meshes(mesh, variant, hf_dir):
    model, path = hf_model(variant, hf_dir)
    assert_logits_close(logits_on(mesh, HFCheckpoint(path), TOKENS), hf_logits(model, TOKENS))


def test_the_pipelined_loss_of_an_import_equals_transformers(hf_dir):
    """Through the pipeline schedule (2 stages, 2 microbatches): the mean next-token loss of transformers' logits."""
    model, path = hf_model("llama", hf_dir)
    source = HFCheckpoint(path)
    cfg = apply_overrides(
        source.run_config("float32"),
        ["mesh=pipeline=2,data=2,tensor=2", "batch_size=4", "seq_len=23", "microbatches=2", "log_every=1"],
    )
    run = build(cfg, log=lambda *_: None)
    params = source.read_params(cfg.model, run.shardings.abstract_model_state()["params"])
    state = run.shardings.init_state(run.optimizer, 0, params)
    batch = {"tokens": jax.device_put(TOKENS.astype(np.int32), run.shardings.batch_sharding(TOKENS.shape))}
    ours = float(run.compiled_eval(state["params"], batch)["loss"])
    logits = torch.tensor(hf_logits(model, TOKENS))[:, :-1]
    theirs = float(
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, SIZES["vocab_size"]), torch.tensor(TOKENS[:, 1:]).reshape(-1)
        )
    )
    assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("variant", ["qwen2-bias", "qwen3-qknorm"])
def test_import_then_export_loads_in_transformers_with_the_same_logits(variant, hf_dir, tmp_path):
    """`jaxtrain import-hf` onto fsdp=4,tensor=2, then `jaxtrain export-hf` from data=2,fsdp=2,tensor=2 in files
    of 100 kB: the same architecture, the same tensors bit for bit, the tokenizer-side files carried."""
    model, path = hf_model(variant, hf_dir)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    imported, out = tmp_path / "export", tmp_path / "hf"
    assert main(["import-hf", path, str(imported), "--dtype", "float32", "--mesh", "fsdp=4,tensor=2"]) == 0
    assert (
        main(["export-hf", str(imported), str(out), "--mesh", "data=2,fsdp=2,tensor=2", "--max-shard-mb", "0.1"]) == 0
    )
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "tokenizer_config.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(model)
    state, original = back.state_dict(), model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in original)
    assert_logits_close(hf_logits(back, TOKENS), hf_logits(model, TOKENS), rtol=0)


@pytest.mark.parametrize(
    "overrides,architecture",
    [
        ((), "LlamaForCausalLM"),
        # Each compiles a train step (5-10 s): the other architectures in the slow set.
        pytest.param(("qkv_bias=true",), "Qwen2ForCausalLM", marks=pytest.mark.slow),
        pytest.param(("qk_norm=true", "tie_embeddings=false"), "Qwen3ForCausalLM", marks=pytest.mark.slow),
        pytest.param(("sliding_window=8",), "MistralForCausalLM", marks=pytest.mark.slow),
    ],
)
def test_a_jaxtrain_trained_model_exports_with_the_logits_jaxtrain_computes(overrides, architecture, tmp_path):
    run = make_run("single", list(overrides), model="llama-tiny", devices=1)
    state = run.shardings.init_state(run.optimizer, 0)
    for step in range(3):  # trained a little: biases and norms move off their initial zeros and ones
        state, _ = run.train_step(state, run.batch("train", step))
    params = run.shardings.params_in_model_order(state["params"])
    out = write_hf(params, run.cfg.model, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == architecture
    tokens = np.random.default_rng(1).integers(0, 256, (2, 24))
    ours = nnx.merge(run.shardings.model.graphdef, params)(tokens)
    assert_logits_close(ours, hf_logits(back, tokens))


@pytest.mark.parametrize("variant", ["llama", "qwen3-qknorm"])
def test_greedy_generation_equals_transformers_token_for_token(variant, hf_dir, tmp_path):
    from jaxtrain.inference.generate import Generator

    model, path = hf_model(variant, hf_dir)
    out = import_hf(path, tmp_path / "export", dtype="float32", devices=jax.devices()[:2])
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :9].tolist()]
    ours = Generator.restore(out, mesh="data=2").generate(prompts, max_new_tokens=32).tokens
    for prompt, got in zip(prompts, ours):
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert got == theirs[0, len(prompt) :].tolist()


WORDS = ["<unk>", "to", "be", "or", "not", "that", "is", "the", "question"]


def with_tokenizer(variant: str, hf_dir: str, tmp_path) -> str:
    """A copy of `variant`'s directory with a word-level tokenizer.json (ids 0-8), as save_pretrained of a model and
    its tokenizer leaves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    copy = edited_copy(variant, hf_dir, tmp_path)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(copy, "tokenizer.json"))
    return copy


def test_an_import_generates_from_text_with_the_tokenizer_it_carries(hf_dir, tmp_path, capsys):
    from jaxtrain.inference.generate import Generator

    model, _ = hf_model("llama", hf_dir)
    out = import_hf(with_tokenizer("llama", hf_dir, tmp_path), tmp_path / "export", devices=jax.devices()[:1])
    assert (out / "hf" / "tokenizer.json").is_file()
    tokenizer = Generator.restore(out, mesh="data=1").tokenizer
    assert tokenizer.encode("to be or not") == [1, 2, 3, 4]
    assert (
        main(
            ["generate", "--restore", str(out), "--mesh", "data=1", "--prompt", "to be or not", "--max-new-tokens", "6"]
        )
        == 0
    )
    theirs = model.generate(torch.tensor([[1, 2, 3, 4]]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert capsys.readouterr().out.strip() == tokenizer.decode(theirs[0, 4:].tolist())


def edited_copy(variant: str, hf_dir: str, tmp_path, **config) -> str:
    """A copy of `variant`'s directory whose config.json has `config`'s keys changed."""
    _, path = hf_model(variant, hf_dir)
    copy = tmp_path / "edited"
    copy.mkdir()
    for name in os.listdir(path):
        os.link(os.path.join(path, name), copy / name)
    settings = json.loads((copy / "config.json").read_text())
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**settings, **config}))
    return str(copy)


def import_error(capsys, directory, tmp_path) -> str:
    assert main(["import-hf", str(directory), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_an_unknown_architecture_is_one_line_naming_the_supported_ones(hf_dir, tmp_path, capsys):
    edited = edited_copy("llama", hf_dir, tmp_path, architectures=["GPT2LMHeadModel"])
    err = import_error(capsys, edited, tmp_path)
    assert "architecture GPT2LMHeadModel is not supported" in err and "Qwen3ForCausalLM" in err
    assert "Traceback" not in err


def test_weights_that_do_not_match_the_config_name_the_file_and_tensor(hf_dir, tmp_path, capsys):
    edited = edited_copy("llama", hf_dir, tmp_path, intermediate_size=96)
    err = import_error(capsys, edited, tmp_path)
    assert "edited/model.safetensors: tensor model.layers.0.mlp.down_proj.weight is (64, 128)" in err
    assert "config.json makes it (64, 96)" in err


def test_a_missing_shard_is_named(hf_dir, tmp_path, capsys):
    model, _ = hf_model("llama", hf_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[1].unlink()
    err = import_error(capsys, tmp_path / "sharded", tmp_path)
    assert f"names 1 shard file(s) that are not in {tmp_path / 'sharded'}: {shards[1].name}" in err


def test_a_sharded_checkpoint_imports_from_its_index(hf_dir, tmp_path):
    model, _ = hf_model("mistral-window", hf_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    got = logits_on("data=1", HFCheckpoint(tmp_path / "sharded"), TOKENS, devices=1)
    assert_logits_close(got, hf_logits(model, TOKENS))


def test_the_checkpoint_dtype_is_kept_or_cast(hf_dir, tmp_path):
    model, _ = hf_model("llama", hf_dir)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    source = HFCheckpoint(tmp_path / "bf16")
    assert source.run_config().model.dtype == "bfloat16"
    assert source.run_config("float32").model.dtype == "float32"
    shardings = params_shardings(source.run_config(), "data=1", jax.devices()[:1])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype("bfloat16")), shardings.abstract_state["params"]
    )
    params = source.read_params(source.run_config().model, abstract)
    embedding = params["embedding"]
    assert embedding.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(embedding, model.model.embed_tokens.weight.detach().to(torch.bfloat16).float())


@pytest.mark.slow
def test_fine_tuning_an_import_lowers_the_loss_and_exports(hf_dir, tmp_path):
    """The import's config.toml and --restore: 50 steps on tinyshakespeare (bytes)
    on fsdp=4,tensor=2; the export of the result computes in transformers what jaxtrain computes."""
    from jaxtrain.run_config import load_config
    from jaxtrain.training.loop import train

    model, _ = hf_model("qwen3-qknorm", hf_dir)
    out = import_hf(with_tokenizer("qwen3-qknorm", hf_dir, tmp_path), tmp_path / "export", dtype="float32")
    overrides = [
        f"data.source={shared_file('tinyshakespeare.txt')}",
        "mesh=fsdp=4,tensor=2",
        "batch_size=8",
        "seq_len=64",
        "train.steps=50",
        "train.log_every=10",
        "warmup_steps=5",
        "optimizer.learning_rate=0.003",
        f"checkpoint.restore={out}",
        f"checkpoint.dir={tmp_path / 'run'}",
        "train.progress=false",
    ]
    summary = train(load_config(out / "config.toml", overrides=overrides), log=lambda *_: None)
    losses = [row["loss"] for row in summary["history"] if "loss" in row]
    print(f"\nfine-tuning an import, loss every 10 steps: {[round(x, 3) for x in losses]}")
    assert losses[-1] < losses[0] - 0.5, losses
    exported = export_hf(tmp_path / "run", tmp_path / "hf")
    # The run keeps the tokenizer its export carried, and its own export carries it on to transformers.
    assert (tmp_path / "run" / "hf" / "tokenizer.json").is_file()
    assert (exported / "tokenizer.json").read_bytes() == (out / "hf" / "tokenizer.json").read_bytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(back) is type(model)
    params = jax.device_get(summary["run"].shardings.params_in_model_order(summary["state"]["params"]))
    ours = nnx.merge(summary["run"].shardings.model.graphdef, params)(TOKENS)
    assert_logits_close(ours, hf_logits(back, TOKENS))


BASE_CONFIG = {
    "vocab_size": 256,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
}


def test_config_translation_reads_both_rope_formats_and_a_null_window():
    from jaxtrain.interop.architectures import MISTRAL, model_settings

    factors = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    old_style = {**BASE_CONFIG, "rope_theta": 1e6, "rope_scaling": {"type": "llama3", **factors}}  # transformers 4
    settings = model_settings(MISTRAL, {**old_style, "sliding_window": None}, "config.json")
    assert settings["rope_base"] == 1e6 and settings["rope_scaling"] == "llama3" and settings["rope_factor"] == 8.0
    assert settings["sliding_window"] == 0 and settings["n_kv_heads"] == 4 and settings["head_dim"] == 16


@pytest.mark.parametrize(
    "arch,change,message",
    [
        ("LLAMA", {"attention_bias": True}, "attention_bias=true"),
        ("LLAMA", {"mlp_bias": True}, "mlp_bias=true"),
        ("LLAMA", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("QWEN2", {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}, "some layers only"),
        ("LLAMA", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
        ("LLAMA", {"hidden_size": None}, "lacks hidden_size"),
    ],
)
def test_settings_jaxtrain_cannot_express_are_refused_by_name(arch, change, message):
    from jaxtrain.interop import architectures

    config = {k: v for k, v in {**BASE_CONFIG, **change}.items() if v is not None}
    with pytest.raises(architectures.ArchitectureError, match=message):
        architectures.model_settings(getattr(architectures, arch), config, "config.json")


def test_tensors_the_model_has_no_place_for_are_named(hf_dir, tmp_path, capsys):
    """Qwen2's q/k/v biases under a config that says Llama: refused, not dropped."""
    edited = edited_copy("qwen2-bias", hf_dir, tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    err = import_error(capsys, edited, tmp_path)
    assert "holds 6 tensor(s) that LlamaForCausalLM as configured has no place for" in err
    assert "model.layers.0.self_attn.k_proj.bias" in err


@pytest.mark.parametrize("module", ["self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"])
def test_any_slice_of_a_parameter_reads_from_the_rows_it_needs(module):
    """What each device's read does, on every kind of layout: a slice on every dim (heads, channels, width) of our
    parameter equals the same slice of the whole tensor converted, and `to_hf` inverts the conversion."""
    from jaxtrain.interop.architectures import LLAMA

    tensor = next(t for t in LLAMA.tensors if module in t.hf_name)
    shape = {"q_proj": (8, 4, 6), "o_proj": (4, 6, 8), "down_proj": (10, 8)}[module.split(".")[1]]
    sizes = tensor.sizes(shape)
    hf = np.arange(math.prod(shape), dtype=np.float32).reshape(tensor.hf_shape(shape))
    whole = tensor.from_hf(hf, {c: slice(0, n) for c, n in sizes.items()}, sizes)
    np.testing.assert_array_equal(tensor.to_hf(whole), hf)
    index = {c: slice(1, n - 1) for c, n in sizes.items()}
    part = tensor.from_hf(hf[tensor.hf_index(index, sizes)], index, sizes)
    np.testing.assert_array_equal(part, whole[tuple(index[c] for c in tensor.dims.split())])
