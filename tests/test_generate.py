"""Generation: sampling keeps exactly the tokens its settings allow; cached decoding equals the full forward on one
device and on data=2,tensor=2; ragged batches equal their prompts alone; eos stops a row; the command end to end."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shared_file
from flax import nnx
from helpers import cached_run
from jax.sharding import PartitionSpec as P
from test_bad_input import tiny_hf_model
from test_checkpoint import run_train

from jaxtrain.cli import main
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.errors import ConfigError
from jaxtrain.inference.generate import (
    ByteTokenizer,
    GenerationError,
    Generator,
    generate,
    generation_shardings,
    tokenizer_for,
    unknown_pieces,
)
from jaxtrain.inference.sampling import Sampling, filtered_logits, sample
from jaxtrain.interop.importing import import_hf
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.sharding.mesh import build_mesh, parse_layout
from jaxtrain.training.checkpoint import CARRIED, CheckpointError, export_params
from jaxtrain.training.loop import train

MODEL = "llama-tiny"  # float32 compute; grouped-query attention (4 heads, 2 kv heads), tied embeddings
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 8], [200, 1, 64]]  # ragged, all within one prompt bucket (8)
NEW = 6
MESH = "data=2,tensor=2"


# Sampling ---------------------------------------------------------------------------------------------------------


SAMPLE = jax.jit(sample)  # one compile per batch shape; the settings are arguments
DRAWS = 4000


def draws(logits: np.ndarray, **settings) -> np.ndarray:
    """DRAWS tokens sampled from one row of `logits`, each with its own key: rows of one batch."""
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, len(logits)))
    keys = jax.random.split(jax.random.key(0), DRAWS)
    return np.asarray(SAMPLE(batch, keys, *Sampling(**settings).per_row(DRAWS)))


# Probabilities 0.30 0.25 0.20 0.15 0.10, shuffled over the vocabulary so rank and id differ.
PROBS = np.zeros(8)
PROBS[[6, 2, 7, 0, 4]] = [0.30, 0.25, 0.20, 0.15, 0.10]
LOGITS = np.log(np.where(PROBS > 0, PROBS, 1e-12)).astype(np.float32)


@pytest.mark.parametrize(
    "settings,allowed",
    [
        ({"temperature": 1.0}, {6, 2, 7, 0, 4}),
        ({"temperature": 1.0, "top_k": 2}, {6, 2}),
        ({"temperature": 1.0, "top_k": 4}, {6, 2, 7, 0}),
        ({"temperature": 1.0, "top_p": 0.5}, {6, 2}),  # 0.30 < 0.5 <= 0.30 + 0.25
        ({"temperature": 1.0, "top_p": 0.56}, {6, 2, 7}),  # 0.55 < 0.56
        ({"temperature": 1.0, "top_k": 2, "top_p": 0.9}, {6, 2}),
        ({"temperature": 2.0, "top_k": 3}, {6, 2, 7}),
    ],
)
def test_sampling_draws_exactly_the_allowed_tokens(settings, allowed):
    drawn = draws(LOGITS, **settings)
    assert set(drawn.tolist()) == allowed  # each allowed token has >= 10% mass: all of them appear in 4000 draws


def test_filtered_logits_keep_the_nucleus_and_top_k_by_construction():
    kept = filtered_logits(jnp.asarray(LOGITS), jnp.int32(3), jnp.float32(1.0))
    assert set(np.flatnonzero(np.isfinite(kept)).tolist()) == {6, 2, 7}
    np.testing.assert_array_equal(np.asarray(kept)[[6, 2, 7]], LOGITS[[6, 2, 7]])
    tied = filtered_logits(jnp.zeros(5), jnp.int32(2), jnp.float32(1.0))
    assert np.isfinite(np.asarray(tied)).sum() == 2  # ties: exactly k kept


def test_temperature_sharpens_and_greedy_is_the_argmax():
    logits = np.random.default_rng(0).normal(size=(64, 300)).astype(np.float32)
    keys = jax.random.split(jax.random.key(1), 64)
    greedy = SAMPLE(jnp.asarray(logits), keys, *Sampling(temperature=0.0, top_k=5, top_p=0.3).per_row(64))
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))
    cold = draws(LOGITS, temperature=0.05)
    hot = draws(LOGITS, temperature=1.0)
    assert (cold == 6).mean() > 0.95 and 0.25 < (hot == 6).mean() < 0.35


def test_sampling_is_deterministic_per_key_and_settings_are_per_row():
    assert (draws(LOGITS, temperature=1.0) == draws(LOGITS, temperature=1.0)).all()
    batch = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (2, 8))
    temperature, top_k, top_p = jnp.array([0.0, 1.0]), jnp.array([0, 1]), jnp.array([1.0, 1.0])
    for seed in range(20):  # row 0 greedy, row 1 top-1: both always the argmax, whatever the key
        keys = jax.random.split(jax.random.key(seed), 2)
        assert np.asarray(SAMPLE(batch, keys, temperature, top_k, top_p)).tolist() == [6, 6]


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"temperature": -0.5}, "temperature=-0.5: expected a finite number >= 0"),
        ({"top_k": -1}, "top_k=-1: expected an integer >= 0"),
        ({"top_p": 0.0}, "top_p=0.0: expected a finite number > 0 and <= 1"),
        ({"top_p": 1.5}, "top_p=1.5: expected a finite number > 0 and <= 1"),
    ],
)
def test_bad_sampling_settings_are_clear_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        Sampling(**settings)


# Decoding against the full forward --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_params():
    run = cached_run("single", model=MODEL)
    return run, jax.device_get(run.shardings.init_state(run.optimizer, 0)["params"])


def generator(run, params, mesh: str, devices: int) -> Generator:
    mesh = build_mesh(parse_layout(mesh), jax.devices()[:devices])
    return Generator(generation_shardings(run.placed.on_mesh(mesh)), params, run.cfg)


@pytest.fixture(scope="module")
def single(model_and_params):
    return generator(*model_and_params, "data=1", 1)


@pytest.fixture(scope="module")
def greedy(single):
    return single.generate(PROMPTS, max_new_tokens=NEW, return_logits=True)


def assert_matches_full_forward(run, params, prompts, result, atol=1e-5):
    """Each new token's logits equal the full forward's at its position on prompt + continuation: the forward is
    causal, so those are the logits of recomputing the whole prefix at that step (and right-padding the rows to one
    length, to run them in one batch, changes none of them)."""
    sequences = [prompt + continuation for prompt, continuation in zip(prompts, result.tokens)]
    padded = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
    full = np.asarray(jax.jit(lambda p, t: nnx.merge(run.shardings.model.graphdef, p)(t))(params, padded))  # (B, T, V)
    for row, (prompt, continuation, logits) in enumerate(zip(prompts, result.tokens, result.logits)):
        assert len(continuation) == NEW
        steps = full[row, len(prompt) - 1 : len(prompt) - 1 + NEW]
        np.testing.assert_allclose(logits, steps, atol=atol, rtol=0)
        assert continuation == steps.argmax(-1).tolist()  # greedy picked each step's argmax


def test_cached_decoding_equals_the_full_forward(model_and_params, greedy):
    assert_matches_full_forward(*model_and_params, PROMPTS, greedy)


def test_cached_decoding_on_data_and_tensor_axes_equals_one_device(model_and_params, greedy):
    sharded = generator(*model_and_params, MESH, 4)
    result = sharded.generate(PROMPTS, max_new_tokens=NEW, return_logits=True)
    assert result.tokens == greedy.tokens
    assert_matches_full_forward(*model_and_params, PROMPTS, result)
    layout = sharded.cache_shardings(4, 16)  # batch on data, kv heads on tensor
    expected = P(None, "data", None, "tensor", None)
    assert {name: sharding.spec for name, sharding in layout.items()} == {"k": expected, "v": expected}


def test_a_ragged_batch_equals_each_prompt_alone(single, greedy):
    for prompt, together in zip(PROMPTS, greedy.tokens):
        assert single.generate([prompt], max_new_tokens=NEW).tokens == [together]


def test_generation_is_deterministic(single, greedy):
    again = single.generate(PROMPTS, max_new_tokens=NEW, return_logits=True)
    assert again.tokens == greedy.tokens
    sampled = [single.generate(PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=s).tokens for s in (3, 3, 4)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_eos_stops_a_row_and_keeps_the_others(single, greedy):
    eos = greedy.tokens[0][2]
    result = single.generate(PROMPTS, max_new_tokens=NEW, eos_id=eos)
    expected = [row[: row.index(eos) + 1] if eos in row else row for row in greedy.tokens]
    assert result.tokens == expected and len(result.tokens[0]) <= 3


@pytest.mark.parametrize(
    "prompts,settings,message",
    [
        ([[1, 256]], {}, "prompt 1: token id 256 is not an integer in 0..255, the model's vocabulary"),
        ([[1], []], {}, "prompt 2 is empty"),
        ([], {}, "no prompts given"),
        ([[1]], {"eos_id": 300}, "eos_id=300 is outside 0..255"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens=0: expected an integer >= 1"),
        # Refused before the cache is allocated (it would need 1e9 positions: terabytes).
        (
            [[1, 2]],
            {"max_new_tokens": 10**9},
            r"max_new_tokens=1000000000 is more than \d+: the KV cache and the output take 520 B a token on each "
            r"device, which has [\d.]+ [GT]iB \(the host's",
        ),
    ],
)
def test_bad_prompts_are_clear_errors(single, prompts, settings, message):
    with pytest.raises(GenerationError, match=message):
        single.generate(prompts, **{"max_new_tokens": 2, **settings})


def test_no_text_prompts_for_synthetic_tokens_and_no_pipeline_meshes(model_and_params):
    with pytest.raises(GenerationError, match="trained on data.source=synthetic .* give the prompt as token ids"):
        tokenizer_for(apply_overrides(default_config(MODEL), ["data.source=synthetic"]))
    run = model_and_params[0]
    mesh = build_mesh(parse_layout("pipeline=2"), jax.devices()[:2])
    with pytest.raises(GenerationError, match="the mesh has pipeline=2. Give a --mesh without a pipeline axis"):
        generation_shardings(run.placed.on_mesh(mesh))


# From a checkpoint, and the command -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """2 steps of gpt-tiny on the builtin (byte-level) text on data=2,fsdp=2,tensor=2, checkpointed (the run of
    test_checkpoint_tools, whose compiled programs the suite's compilation cache holds); the run directory."""
    directory = tmp_path_factory.mktemp("generate") / "ckpt"
    run_train("data=2,fsdp=2,tensor=2", directory, extra=["steps=2"])
    return directory


def test_generate_command_prints_ids_and_text(checkpoint, tmp_path, capsys):
    """On another mesh than training's; ids and text prompts of one batch shape share one compiled program."""
    export = export_params(checkpoint / "2", tmp_path / "export")
    args = ["generate", "--restore", str(export), "--mesh", MESH, "--max-new-tokens", "5"]
    assert main([*args, "--prompt-ids", "72,101,108;108,111", "--prompt-ids", "33"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line.split()) == 5 for line in lines)
    restored = Generator.restore(checkpoint, MESH)  # the run directory: its newest step, the export's params
    expected = restored.generate([[72, 101, 108], [108, 111], [33]], max_new_tokens=5).tokens
    assert [list(map(int, line.split())) for line in lines] == expected
    assert generate(export, [[72, 101, 108], [108, 111], [33]], max_new_tokens=5, mesh=MESH) == expected
    texts = ["Hel", "lo", "!"]
    sampling = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "7"]
    assert main([*args, *(a for text in texts for a in ("--prompt", text)), *sampling]) == 0
    printed = capsys.readouterr().out
    prompts = [list(text.encode()) for text in texts]
    sampled = restored.generate(prompts, max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=7).tokens
    decoded = (
        f"--- prompt {n}: {text!r}\n{ByteTokenizer().decode(row)}\n"
        for n, (text, row) in enumerate(zip(texts, sampled), 1)
    )
    assert printed == "".join(decoded)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integer token ids"),
        (["--prompt-ids", "1,999"], "prompt 1: token id 999 is not an integer in 0..255"),
        (["--prompt-ids", "1", "--max-new-tokens", "1000000000"], "max_new_tokens=1000000000 is more than"),
    ],
)
def test_generate_command_bad_prompts(checkpoint, capsys, args, message):
    assert main(["generate", "--restore", str(checkpoint), "--mesh", "data=1", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1"], "argument --temperature: expected a finite number >= 0, got '-1'"),
        (["--top-p", "2"], "argument --top-p: expected a finite number > 0 and <= 1, got '2'"),
        (["--top-k", "-3"], "argument --top-k: expected an integer >= 0, got '-3'"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got '0'"),
    ],
)
def test_generate_command_bad_settings(capsys, args, message):
    with pytest.raises(SystemExit) as exit_status:
        main(["generate", "--restore", "anywhere", "--prompt-ids", "1", *args])
    assert exit_status.value.code == 2 and message in capsys.readouterr().err


def test_generate_from_a_missing_or_non_language_checkpoint(tmp_path, capsys):
    assert main(["generate", "--restore", str(tmp_path / "nowhere"), "--prompt-ids", "1"]) == 2
    assert f"error: no checkpoint at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    directory = tmp_path / "mlp"
    overrides = ["steps=1", "batch_size=8", "data.source=synthetic", "progress=false", "mesh=data=1"]
    overrides.append(f"checkpoint.dir={directory}")
    train(apply_overrides(default_config("mlp"), overrides), log=lambda *_: None, devices=jax.devices()[:1])
    with pytest.raises(GenerationError, match="holds model mlp-.*, a classification model: generation needs a"):
        Generator.restore(directory / "1", "data=1", jax.devices()[:1])
    with pytest.raises(CheckpointError, match="expected a run directory"):
        Generator.restore(tmp_path, "data=1")
    moe = tmp_path / "moe"
    moe_overrides = [*overrides[:-1], f"checkpoint.dir={moe}", "seq_len=16", "data.source=builtin"]
    train(apply_overrides(default_config("moe-tiny"), moe_overrides), log=lambda *_: None, devices=jax.devices()[:1])
    with pytest.raises(GenerationError, match="has no init_cache, cache_names, extend"):
        Generator.restore(moe / "1", "data=1", jax.devices()[:1])


# An imported model: its context, its tokenizer's unknown token ---------------------------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A randomly initialised llama-tiny imported from a Hugging Face directory with a word-level tokenizer (words
    outside "to be or not that is the question" are `<unk>`), its context cut to 16 positions."""
    d = tmp_path_factory.mktemp("imported")
    out = import_hf(tiny_hf_model(d / "hf"), d / "export", devices=jax.devices()[:1])
    config = json.loads((out / CARRIED / "config.json").read_text())
    (out / CARRIED / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    return out


def test_new_tokens_fill_an_imported_models_context_and_no_more(imported):
    generator = Generator.restore(imported, "data=1", jax.devices()[:1])
    assert generator.context == 16
    assert len(generator.generate([[1, 2, 3]], max_new_tokens=13).tokens[0]) == 13
    message = "max_new_tokens=14 is more than 13: the model's context is 16 positions .* longest prompt has 3 tokens"
    with pytest.raises(GenerationError, match=message):
        generator.generate([[1, 2, 3], [4]], max_new_tokens=14)
    with pytest.raises(GenerationError, match="max_new_tokens=1: no new token fits: .* Shorten the prompts"):
        generator.generate([[1] * 16], max_new_tokens=1)


def test_unknown_words_in_a_prompt_are_named_in_one_warning(imported, capsys):
    args = ["generate", "--restore", str(imported), "--mesh", "data=1", "--max-new-tokens", "2"]
    assert main([*args, "--prompt", "to be xyzzy or not plugh xyzzy"]) == 0
    out = capsys.readouterr()
    assert out.err == (
        "warning: prompt 1 ('to be xyzzy or not plugh xyzzy'): 3 of its 7 tokens are unknown (<unk> for 'xyzzy', "
        "'plugh'); the model sees nothing of that text.\n"
    )
    assert out.out.count("\n") == 1  # generated all the same (random ids past the 9 words decode to nothing)
    assert main([*args, "--prompt", "to be"]) == 0 and capsys.readouterr().err == ""


def test_a_sentencepiece_models_unknown_pieces_are_found(tmp_path):
    spm = pytest.importorskip("sentencepiece", reason="the sentencepiece extra is not installed")
    (tmp_path / "text.txt").write_text("to be or not to be, that is the question\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=20, minloglevel=2
    )
    tokenizer = load_tokenizer(tmp_path / "sp.model")
    assert unknown_pieces(tokenizer, "to be") == ("<unk>", [])
    assert unknown_pieces(tokenizer, "to bé or ñot") == ("<unk>", ["é", "ñ"])


# Learning ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_model_trained_on_tinyshakespeare_writes_text(tmp_path):
    text = shared_file("tinyshakespeare.txt")
    # 200 steps (measured 2026-12-06: val loss 2.17, the sample 97% letters, words of 4.9 letters on average; 400
    # steps, twice the time: 2.01, 99%, 5.5).
    overrides = [
        f"data.source={text}",
        "mesh=data=2,tensor=2",
        "steps=200",
        "batch_size=32",
        "seq_len=128",
        "learning_rate=3e-3",
        "warmup_steps=50",
        "eval_every=200",
        "eval_batches=8",
        "progress=false",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    summary = train(
        apply_overrides(default_config("gpt-tiny"), overrides), log=lambda *_: None, devices=jax.devices()[:4]
    )
    assert summary["history"][-1]["val_loss"] < 2.5
    generator = Generator.restore(tmp_path / "ckpt", "data=2,tensor=2", jax.devices()[:4])
    prompt = generator.tokenizer.encode("ROMEO:\n")
    tokens = generator.generate([prompt], max_new_tokens=300, temperature=0.8, top_k=40, seed=0).tokens[0]
    sample_text = generator.tokenizer.decode(tokens)
    trained = Generator.from_training(summary).generate([prompt], max_new_tokens=20).tokens  # the run's own params
    assert trained == generator.generate([prompt], max_new_tokens=20).tokens
    print(f"\n--- sample (val loss {summary['history'][-1]['val_loss']:.3f}) ---\nROMEO:\n{sample_text}\n---")
    letters = sum(c.isalpha() or c in " \n" for c in sample_text) / len(sample_text)
    words = sample_text.split()
    assert letters > 0.85 and all(32 <= t < 127 or t == 10 for t in tokens), sample_text
    assert 3 <= np.mean([len(w.strip(".,;:!?'-")) for w in words]) <= 7, sample_text  # English-like word lengths
