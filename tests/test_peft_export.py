"""A LoRA run's adapters exported for peft, and its merged model for transformers: a small random transformers model
(built here, nothing is downloaded) imported, its adapters trained by jaxtrain, then loaded by
`peft.PeftModel.from_pretrained` onto the transformers model, which computes jaxtrain's logits; the merged export
computes them in transformers alone; generation from the LoRA checkpoint merges; bad input is one line.

Agreement is measured as max |ours - theirs| / max |theirs| over all logits (float32)."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import extra_module

from jaxtrain.cli import main
from jaxtrain.interop.importing import HFCheckpoint, import_hf
from jaxtrain.interop.peft_export import write_peft
from jaxtrain.placement.place import place_model
from jaxtrain.posttrain.adapters import adapt
from jaxtrain.run_config import LoraConfig, load_config

torch, transformers = extra_module("torch"), extra_module("transformers")
peft = extra_module("peft")

from test_hf_interop import SIZES  # noqa: E402  (the same small Llama; imported after the skips above)

RTOL = 1e-5
MODULES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # attention and mlp
TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 24))


def save_hf(directory, config_class: str, **settings) -> str:
    """A random float32 transformers model of `config_class` saved in `directory`; biases drawn, not zero."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SIZES, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return str(directory)


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def relative_error(ours, theirs: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


def with_adapters(base_dir: str, adapters) -> torch.nn.Module:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    return peft.PeftModel.from_pretrained(base, str(adapters)).eval()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A Llama (2 kv heads, untied) imported, then 3 steps of rank-4 adapters on attention and MLP at a high learning
    rate, so every B is far from its zero start: (the transformers directory, the run directory, jaxtrain's logits of
    the adapted model)."""
    from flax import nnx

    from jaxtrain.training.loop import train

    tmp = tmp_path_factory.mktemp("peft")
    hf_dir = save_hf(tmp / "llama", "LlamaConfig", num_key_value_heads=2, tie_word_embeddings=False)
    imported = import_hf(hf_dir, tmp / "import", dtype="float32", devices=jax.devices()[:1])
    overrides = [
        "mesh=data=1",
        "lora.rank=4",
        "lora.alpha=8",
        "batch_size=2",
        "seq_len=16",
        "train.steps=3",
        "warmup_steps=0",
        "learning_rate=0.05",
        f"checkpoint.restore={imported}",
        f"checkpoint.dir={tmp / 'run'}",
        "train.progress=false",
    ]
    cfg = load_config(imported / "config.toml", overrides=overrides)
    summary = train(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    shardings = summary["run"].shardings
    params = shardings.params_in_model_order(summary["state"]["params"])
    model = shardings.model
    adapted, base = jax.jit(
        lambda p: (model.module(p)(TOKENS), nnx.merge(model.graphdef, model.base_params(p))(TOKENS))
    )(params)
    assert relative_error(base, np.asarray(adapted)) > 1e-2, "the adapters change the logits"
    return hf_dir, tmp / "run", np.asarray(adapted)


def test_peft_loads_the_exported_adapters_and_computes_jaxtrains_logits(lora_run, tmp_path):
    hf_dir, run, ours = lora_run
    out = tmp_path / "adapters"
    assert main(["export-hf", str(run), str(out), "--adapters-only"]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, MODULES)
    assert config["base_model_name_or_path"] == hf_dir  # the directory the base was imported from
    # The names and shapes peft itself gives adapters of these settings on this model.
    theirs = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(r=4, target_modules=MODULES)
    )
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(theirs).items()}
    from safetensors.numpy import load_file

    assert {k: v.shape for k, v in load_file(out / "adapter_model.safetensors").items()} == expected
    error = relative_error(ours, hf_logits(with_adapters(hf_dir, out)))
    print(f"\npeft's logits against jaxtrain's adapted model: {error:.2g} of the largest")
    assert error <= RTOL


def test_the_merged_export_computes_jaxtrains_logits_in_transformers_and_generation_merges(lora_run, tmp_path):
    from jaxtrain.inference.generate import Generator

    _, run, ours = lora_run
    out = tmp_path / "merged"
    assert main(["export-hf", str(run), str(out)]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    error = relative_error(ours, hf_logits(merged))
    print(f"\ntransformers' logits of the merged export against jaxtrain's adapted model: {error:.2g} of the largest")
    assert error <= RTOL
    prompts = [TOKENS[0, :5].tolist()]
    got = Generator.restore(run, mesh="data=1").generate(prompts, max_new_tokens=8).tokens[0]
    theirs = merged.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert got == theirs[0, 5:].tolist()


@pytest.mark.parametrize(
    "config_class, settings",
    [
        ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),  # q/k/v biases
        ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32)),  # heads x head_dim (128) wider than the model (64)
    ],
)
def test_adapters_of_other_architectures_name_and_lay_out_their_factors_as_peft(config_class, settings, tmp_path):
    """`write_peft` from params in memory, each factor drawn at random: no training, one compiled forward."""
    hf_dir = save_hf(tmp_path / "hf", config_class, **settings)
    source = HFCheckpoint(hf_dir)
    cfg = source.run_config("float32")
    placed = place_model(cfg.model_name, cfg.model, "data=1", devices=jax.devices()[:1])
    lora = LoraConfig(rank=4, alpha=8.0)
    model = adapt(placed.model, lora, {"tokens": jax.ShapeDtypeStruct((1, 9), np.int32)})
    params = model.init_params(0, source.read_params(cfg.model, placed.model.abstract_params))
    trained, frozen = model.split(params)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(trained))))
    params = model.join(jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), trained), frozen)
    ours = jax.jit(lambda p: model.module(p)(TOKENS))(params)
    out = write_peft(params, model, cfg.model, lora, tmp_path / "adapters", base_model=hf_dir)
    error = relative_error(ours, hf_logits(with_adapters(hf_dir, out)))
    print(f"\n{config_class}: peft's logits against jaxtrain's adapted model: {error:.2g} of the largest")
    assert error <= RTOL


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], r"checkpoint .*/import was trained without adapters \(lora.rank=0\), so it has none to export"),
        (["--max-shard-mb", "10"], r"--max-shard-mb 10 with --adapters-only: peft reads its adapters from one file"),
    ],
)
def test_bad_adapter_exports_are_one_line(lora_run, extra, message, tmp_path, capsys):
    import re

    imported = lora_run[1].parent / "import"  # a params export: the import, without adapters
    assert main(["export-hf", str(imported), str(tmp_path / "out"), "--adapters-only", *extra]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
