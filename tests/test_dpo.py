"""Preference optimisation (jaxtrain.posttrain.preference, jaxtrain.data.pairs): the DPO and SimPO losses against
a NumPy float64 reference, the reference model (adapters switched off; without adapters, log-probs computed once with
the starting weights), one device equal to a mesh, a resumed run equal to an uninterrupted one, and the bad inputs.
TRL's DPOTrainer on the same model and batch: tests/test_trl_dpo.py."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import adapter_gradients, assert_gradients_close, with_random_adapters

import jaxtrain
from jaxtrain.data.datasets import DataError
from jaxtrain.data.pairs import PreferencePairs
from jaxtrain.posttrain.preference import PreferenceError, PreferenceLoss, sequence_log_probs
from jaxtrain.run_config import ConfigError, apply_overrides, default_config
from jaxtrain.training.reference import attach_reference
from jaxtrain.training.setup import build

HYBRID = "data=2,fsdp=2,tensor=2"
SEQ_LEN = 24
RUN = ["batch_size=8", f"seq_len={SEQ_LEN}", "learning_rate=0.01", "warmup_steps=1", "progress=false"]


@functools.cache
def pairs_of_ids(count: int = 48, seed: int = 0) -> tuple:
    """`count` (prompt, chosen, rejected) id lists of random lengths, every pair within SEQ_LEN + 1 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        prompt, chosen, rejected = (list(rng.integers(3, 250, rng.integers(a, b))) for a, b in ((2, 9), (1, 8), (1, 8)))
        out.append((prompt, chosen, rejected))
    return tuple(out)


def make_run(mesh: str, overrides: list[str], devices: int):
    cfg = apply_overrides(default_config("llama-tiny"), [*RUN, *overrides, f"mesh={mesh}"])
    data = PreferencePairs(pairs_of_ids(), SEQ_LEN, seed=0)
    return build(cfg, log=lambda *_: None, devices=jax.devices()[:devices], dataset=data)


@functools.cache
def lora_run(mesh: str):
    return make_run(mesh, ["preference.loss=dpo", "lora.rank=4"], 1 if mesh == "single" else 8)


def numpy_loss(kind: str, policy, reference, lengths, beta: float, gamma: float) -> tuple[float, float]:
    """(mean loss, preference accuracy) in float64, from the papers' formulas."""
    policy, reference, lengths = (np.asarray(x, np.float64) for x in (policy, reference, lengths))
    if kind == "dpo":
        chosen, rejected = beta * (policy - reference).T
        margin = chosen - rejected
    else:
        chosen, rejected = beta * (policy / lengths).T
        margin = chosen - rejected - gamma
    losses = np.log1p(np.exp(-margin))  # -log sigmoid(margin)
    return float(losses.mean()), float(np.mean(chosen > rejected))


@pytest.mark.parametrize("kind", ["dpo", "simpo"])
def test_losses_equal_a_float64_reference(kind):
    rng = np.random.default_rng(1)
    policy = rng.normal(-20, 5, (16, 2)).astype(np.float32)
    reference = (policy + rng.normal(0, 3, (16, 2))).astype(np.float32)
    lengths = rng.integers(1, 30, (16, 2)).astype(np.float32)
    loss, metrics = PreferenceLoss(kind, beta=0.3, gamma=0.7)(policy, reference, lengths)
    want_loss, want_accuracy = numpy_loss(kind, policy, reference, lengths, 0.3, 0.7)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    assert float(metrics["preference_accuracy"]) == want_accuracy
    assert 0 < want_accuracy < 1  # both outcomes occur, so the accuracy is checked for real


def test_sequence_log_probs_sum_the_replies_tokens_only():
    run = make_run("data=1", ["preference.loss=simpo"], 1)
    params = run.shardings.init_state(run.optimizer, 0)["params"]
    batch = jax.device_get(run.batch("train", 0))
    module = run.shardings.model.module(params)
    got = np.asarray(sequence_log_probs(module.target_log_probs, batch))
    tokens, weights = batch["pair_tokens"], batch["pair_weights"]
    per_token = np.asarray(module.target_log_probs({"tokens": tokens.reshape(-1, SEQ_LEN + 1)})).reshape(8, 2, -1)
    want = np.sum(per_token * weights[..., 1:], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    lengths = weights[..., 1:].sum(-1)
    assert (lengths >= 1).all() and (lengths < SEQ_LEN).all()  # the prompts' tokens and the padding do not count


def test_lora_reference_is_the_base_model_and_one_device_equals_a_mesh():
    one = lora_run("single")
    start = with_random_adapters(one)  # the adapters move the policy away from the base: the loss is not log 2
    model = one.shardings.model
    params = one.shardings.state_from_model_order(start)["params"]
    batch = one.batch("train", 0)
    base = nnx.merge(model.graphdef, model.base_params(params))  # the model without adapters, its float weights
    reference = sequence_log_probs(model.reference_module(params).target_log_probs, batch)
    np.testing.assert_array_equal(reference, sequence_log_probs(base.target_log_probs, batch))
    metrics = one.compiled_eval(params, batch)
    assert abs(float(metrics["loss"]) - np.log(2)) > 1e-3
    loss, reference = adapter_gradients(one, start)
    assert len(reference) == 2 * 7 and all(np.abs(g).max() > 0 for g in reference)  # q k v o gate up down: A and B
    sharded_loss, got = adapter_gradients(lora_run(HYBRID), start)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-6)
    assert_gradients_close(got, reference, rtol=1e-5)


def test_reference_log_probs_are_the_starting_models_and_the_first_loss_is_log_2():
    run = make_run(HYBRID, ["preference.loss=dpo"], 8)
    state = run.shardings.init_state(run.optimizer, 0)
    attach_reference(run, state["params"], log=lambda *_: None)
    batch = run.batch("train", 0)
    module = run.shardings.model.module(state["params"])
    np.testing.assert_allclose(
        batch["reference_log_probs"], sequence_log_probs(module.target_log_probs, batch), rtol=1e-6
    )
    np.testing.assert_allclose(float(run.compiled_eval(state["params"], batch)["loss"]), np.log(2), rtol=1e-6)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """A run of 6 steps, checkpointed at 3 and 6; its last checkpoint deleted (a run killed after step 5), rerun: it
    resumes at 3, computes the reference log-probs again from the starting weights, and logs the same losses and
    rewards for steps 4 to 6."""

    def history() -> list[tuple]:
        overrides = [*RUN, "preference.loss=dpo", "mesh=data=2,fsdp=2", "steps=6", "log_every=1"]
        overrides += [f"checkpoint.dir={tmp_path}", "checkpoint.every=3"]
        cfg = apply_overrides(default_config("llama-tiny"), overrides)
        data = PreferencePairs(pairs_of_ids(), SEQ_LEN, seed=0)
        out = jaxtrain.train(cfg, dataset=data, log=lambda *_: None, devices=jax.devices()[:4])
        return [(h["step"], h["loss"], h["reward_margin"]) for h in out["history"]]

    whole = history()
    shutil.rmtree(tmp_path / "6")
    resumed = history()
    assert [h[0] for h in resumed] == [4, 5, 6]
    np.testing.assert_allclose(np.array(resumed), np.array(whole[3:]), rtol=1e-6)
    assert whole[-1][1] < whole[0][1]  # it trains


def test_pairs_from_json_lines_and_their_bad_input(tmp_path):
    tokenizer = byte_tokenizer()
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    path = write_lines(tmp_path / "good.jsonl", [good, {**good, "chosen": "four"}])
    pairs = PreferencePairs.from_jsonl(path, tokenizer, seq_len=16, val_fraction=0.5, eos_text="$")
    rows = pairs.rows("train", 0, range(1), 1)
    ids = rows["pair_tokens"][0, 0]
    counted = rows["pair_weights"][0, 0] > 0
    assert bytes(ids[counted].tolist()).decode() in ("4$", "four$")  # the reply and the end of text
    assert bytes(ids[: np.argmax(counted)].tolist()).decode() == "2+2="
    cases = {
        "same": ([{**good, "rejected": "4"}], "the same tokens"),
        "missing": ([{"prompt": "a", "chosen": "b"}], "missing rejected"),
        "kinds": ([{"prompt": "a", "chosen": ["b"], "rejected": "c"}], "got prompt str, chosen list"),
        "conversation": ([{"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": []}], "template"),
        "long": ([{**good, "prompt": "x" * 40}], "holds no pair that fits 17 tokens"),
    }
    for name, (lines, message) in cases.items():
        with pytest.raises(DataError, match=message):
            PreferencePairs.from_jsonl(write_lines(tmp_path / f"{name}.jsonl", lines), tokenizer, seq_len=16)


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="preference.beta=0.2 set with preference.loss=none"):
        apply_overrides(default_config("llama-tiny"), ["preference.beta=0.2"])
    with pytest.raises(ConfigError, match="simpo's margin"):
        apply_overrides(default_config("llama-tiny"), ["preference.loss=dpo", "preference.gamma=1"])
    with pytest.raises(ConfigError, match="trains on pairs"):
        build(apply_overrides(default_config("llama-tiny"), ["preference.loss=dpo"]), log=lambda *_: None)
    with pytest.raises(ConfigError, match="preference pairs, which the model's own loss cannot read"):
        make_run("data=1", [], 1)
    with pytest.raises(PreferenceError, match="gives no per-token log-probs"):
        cfg = apply_overrides(default_config("moe-tiny"), [*RUN, "preference.loss=simpo", "mesh=data=1"])
        build(cfg, log=lambda *_: None, devices=jax.devices()[:1], dataset=PreferencePairs(pairs_of_ids(), SEQ_LEN))
    with pytest.raises(ConfigError, match="pipeline axis is not supported"):
        make_run("pipeline=2", ["preference.loss=dpo"], 2)
    with pytest.raises(ConfigError, match="data.tokenizer not set"):
        overrides = ["preference.loss=dpo", "data.source=pairs:x.jsonl"]
        build(apply_overrides(default_config("llama-tiny"), overrides), log=lambda *_: None)


def byte_tokenizer():
    """A tokenizer whose ids are a text's UTF-8 bytes (every text fits the tiny model's 256 ids)."""
    from jaxtrain.data.tokenizer import Tokenizer

    def encode_batch(texts):
        return [list(t.encode()) for t in texts]

    return Tokenizer(None, "", 256, None, encode_batch, lambda ids: bytes(ids).decode())


def write_lines(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_dpo_from_a_language_model_checkpoint_starts_at_step_0_with_it_as_the_reference(tmp_path):
    """A checkpoint of another objective (here next-token training; SFT's in practice) is a new run's start, not a run
    to continue: step 0, a new optimizer, and its model the reference (so the first loss is log 2). The DPO run is the
    resume test's, so its compiled step is shared through the compilation cache."""
    lm = [*RUN, "mesh=data=2,fsdp=2", "steps=1", f"checkpoint.dir={tmp_path / 'lm'}"]
    jaxtrain.train(apply_overrides(default_config("llama-tiny"), lm), log=lambda *_: None, devices=jax.devices()[:4])
    dpo = [*RUN, "preference.loss=dpo", "mesh=data=2,fsdp=2", "steps=6", "log_every=1"]
    data = PreferencePairs(pairs_of_ids(), SEQ_LEN, seed=0)
    cfg = apply_overrides(default_config("llama-tiny"), [*dpo, f"checkpoint.restore={tmp_path}/lm/1"])
    out = jaxtrain.train(cfg, dataset=data, log=lambda *_: None, devices=jax.devices()[:4])
    assert [h["step"] for h in out["history"]] == list(range(1, 7))
    np.testing.assert_allclose(out["history"][0]["loss"], np.log(2), rtol=1e-6)
