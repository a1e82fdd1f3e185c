"""GRPO with the trainer's own sampler (jaxtrain.posttrain.rewards, .rollouts, .grpo_train): rewards by name and their
bad input; the batch of rollouts (shapes, masks, advantages, the sampler's log-probs where the trainer's targets are)
on llama-tiny with adapters; at the first step on fresh rollouts the ratio is 1 and the KL 0; one step on one device
equals one on data=2,fsdp=2,tensor=2 (loss and adapter gradients, with the KL to the adapters-off reference); a
learnable reward rises in a few steps, and a resumed run equals the uninterrupted one. The loss itself against NumPy
and TRL: tests/test_grpo_loss.py."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_gradients_close, with_random_adapters

import jaxtrain
from jaxtrain.data.chat_template import ChatTemplate
from jaxtrain.inference.generate import ByteTokenizer, Generation, Generator
from jaxtrain.posttrain.grpo import ROLLOUT_KEYS, group_advantages
from jaxtrain.posttrain.grpo_reference import ReferenceLogProbs
from jaxtrain.posttrain.grpo_train import grpo_train
from jaxtrain.posttrain.rewards import RewardError, register_reward, resolve_rewards, score
from jaxtrain.posttrain.rollouts import Prompts, RolloutError, Rollouts, RolloutShapes
from jaxtrain.run_config import ConfigError, apply_overrides, default_config
from jaxtrain.training.setup import build

HYBRID = "data=2,fsdp=2,tensor=2"
SEQ_LEN, G, NEW = 16, 4, 4
RUN = ["batch_size=8", f"seq_len={SEQ_LEN}", "warmup_steps=0", "progress=false", f"grpo.group_size={G}"]
LORA = ["lora.rank=4", "grpo.beta=0.04", f"grpo.max_new_tokens={NEW}", "learning_rate=0.01"]
WORDS = ["hello", "abc", "what is", "jax", "tiny", "12+3="]
# The sampler's log-probs against the trainer's of the same tokens: a float32 ulp or two apart (measured at most
# 4.8e-7 on one device, tests/test_sampler_log_probs.py); this holds a few times that.
ATOL = 4e-6


def first_byte_low(completion: str, record: dict) -> float:
    """1 where the completion's first byte is below 64 (digits, punctuation, control bytes): a quarter of a fresh
    model's draws, and what a few policy-gradient steps teach it."""
    return float(bool(completion) and ord(completion[0]) < 64)


def prompts() -> Prompts:
    return Prompts.from_records([{"prompt": w, "answer": w[::-1]} for w in WORDS], ByteTokenizer())


def config(mesh: str, overrides: list[str]):
    return apply_overrides(default_config("llama-tiny"), [*RUN, *overrides, f"mesh={mesh}"])


@functools.cache
def lora_run(mesh: str):
    devices = jax.devices()[: 1 if mesh == "data=1" else 8]
    cfg = config(mesh, LORA)
    return build(cfg, log=lambda *_: None, devices=devices, dataset=RolloutShapes.of(cfg))


@functools.cache
def fresh_rollout():
    """Step 0's rollouts of the one-device adapted run from its initial state (adapters' B = 0: the base model)."""
    run = lora_run("data=1")
    state = run.shardings.init_state(run.optimizer, 0)
    sampler = Rollouts(run, state["params"], prompts(), resolve_rewards(first_byte_low), ByteTokenizer().decode)
    return state, sampler, sampler(state["params"], 0)


# -- rewards ----------------------------------------------------------------------------------------------------------


def test_rewards_by_name_format_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def long(completion, record):\n    return len(completion) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_reward("shouts", lambda completion, record: completion.isupper())
    rewards = resolve_rewards(["exact_match", r"format:\d+", "my_rewards:long", "shouts"])
    assert [r.name for r in rewards] == ["exact_match", r"format:\d+", "my_rewards:long", "shouts"]
    records = [{"prompt": "2+2=", "answer": 4}] * 3
    got = score(rewards, [" 4 ", "ABC", "x4"], records, [0, 0, 0])
    np.testing.assert_allclose(got, [1 + 1 + 0.3, 0 + 0 + 0.3 + 1, 0 + 0 + 0.2 + 0])


@pytest.mark.parametrize(
    "reward,match",
    [
        (lambda c, r: 1 / 0, r"^reward '<lambda>' on prompt 7 \('what is the sum of two and three, given \.\.\.'\) "
         r"raised ZeroDivisionError: division by zero$"),
        (lambda c, r: "1.0", r"^reward '<lambda>' on prompt 7 .* returned '1\.0' \(str\): a reward must be a finite"),
        (lambda c, r: None, r"returned None \(NoneType\): a reward must be a finite number$"),
        (lambda c, r: float("nan"), r"returned nan \(float\)"),
        ("exact_match", r"^reward 'exact_match' on prompt 7 .* raised KeyError: .*no 'answer' field"),
    ],
)  # fmt: skip
def test_a_reward_that_raises_or_returns_no_number_is_one_line(reward, match):
    record = {"prompt": "what is the sum of two and three, given that the answer is short?"}
    with pytest.raises(RewardError, match=match) as caught:
        score(resolve_rewards(reward), ["5"], [record], [7])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("exact", r"reward 'exact' is not known: use one of .*exact_match.*format:REGEX, module:function"),
        ("no_such_module_here:f", r"reward 'no_such_module_here:f': module 'no_such_module_here' does not import"),
        ("json:no_such_function", r"module 'json' has no function 'no_such_function'"),
        ("format:(", r"reward 'format:\(': the pattern is no regular expression"),
        ([], "no reward given"),
    ],
)
def test_unknown_rewards_are_one_line(spec, match):
    with pytest.raises(RewardError, match=match):
        resolve_rewards(spec)


# -- prompts and settings ---------------------------------------------------------------------------------------------


def test_each_epoch_takes_every_prompt_once_in_an_order_of_seed_and_epoch():
    p = prompts()
    steps = [p.chosen(seed=3, step=s, count=2) for s in range(6)]  # 6 prompts, 2 a step: epochs of 3 steps
    assert sorted(np.concatenate(steps[:3]).tolist()) == sorted(np.concatenate(steps[3:]).tolist()) == list(range(6))
    assert not np.array_equal(np.concatenate(steps[:3]), np.concatenate(steps[3:]))
    np.testing.assert_array_equal(p.chosen(seed=3, step=4, count=2), steps[4])  # a resumed run's choice
    assert not np.array_equal(p.chosen(seed=4, step=0, count=6), p.chosen(seed=3, step=0, count=6))


def test_bad_prompts_are_one_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"question": "b"}\n')
    with pytest.raises(RolloutError, match=r"prompts.jsonl line 3 has no 'prompt'"):
        Prompts.from_jsonl(path, ByteTokenizer())
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(RolloutError, match=r"prompts.jsonl line 2 is not JSON"):
        Prompts.from_jsonl(path, ByteTokenizer())
    conversation = [{"prompt": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(RolloutError, match=r"prompt 0's prompt is a conversation: give a chat template"):
        Prompts.from_records(conversation, ByteTokenizer())
    template = ChatTemplate("test", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    assert Prompts.from_records(conversation, ByteTokenizer(), template).ids == (tuple(b"<user>hi<assistant>"),)
    with pytest.raises(RolloutError, match=r"prompt 0: message 0 has role \"bot\""):
        Prompts.from_records([{"prompt": [{"role": "bot", "content": "hi"}]}], ByteTokenizer(), template)
    run = lora_run("data=1")
    long = Prompts.from_records([{"prompt": "x" * 14}], ByteTokenizer())
    with pytest.raises(RolloutError, match=r"prompt 0 \('x{14}'\) has 14 tokens, and with grpo.max_new_tokens=4 "):
        Rollouts(run, None, long, [], ByteTokenizer().decode)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["grpo.group_size=1"], r"grpo.group_size=1: each reward would be its own group's mean, every advantage 0"),
        (["grpo.beta=0.1"], r"grpo.beta=0.1 set with grpo.group_size=0"),
    ],
)
def test_bad_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(default_config("llama-tiny"), overrides)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["batch_size=6"], r"data.batch_size=6 holds prompts x G completions, and is no multiple of G"),
        (["grad_accum=2"], r"GRPO runs the plain step: set train.grad_accum=1"),
    ],
)
def test_runs_grpo_cannot_make_are_refused_before_compiling(overrides, match):
    cfg = config("data=1", overrides)
    with pytest.raises(ConfigError, match=match):
        build(cfg, log=lambda *_: None, devices=jax.devices()[:1], dataset=RolloutShapes(SEQ_LEN))


def test_the_plain_loop_refuses_grpo():
    with pytest.raises(ConfigError, match=r"grpo.group_size=4: GRPO trains on rollouts .*grpo_train\(cfg"):
        jaxtrain.train(config("data=1", []), log=lambda *_: None, devices=jax.devices()[:1])


# -- the batch of rollouts and the step -------------------------------------------------------------------------------


def test_the_batch_of_rollouts():
    _, sampler, rollout = fresh_rollout()
    batch, rows = rollout.batch, 8
    assert {k: v.shape for k, v in batch.items()} == {
        "tokens": (rows, SEQ_LEN + 1),
        "loss_weights": (rows, SEQ_LEN + 1),
        "old_log_probs": (rows, SEQ_LEN),
        "advantages": (rows,),
    }
    assert list(batch) == list(ROLLOUT_KEYS)
    p = sampler.prompts
    assert (rollout.prompts[::G] == rollout.prompts[G - 1 :: G]).all()  # each prompt's G completions together
    for row in range(rows):
        prompt = p.ids[rollout.prompts[row]]
        n = len(prompt)
        completion = batch["tokens"][row, n : n + NEW]
        assert batch["tokens"][row, :n].tolist() == list(prompt) and (batch["tokens"][row, n + NEW :] == 0).all()
        assert rollout.completions[row] == ByteTokenizer().decode(completion.tolist())
        positions = np.arange(SEQ_LEN + 1)
        np.testing.assert_array_equal(batch["loss_weights"][row], (positions >= n) & (positions < n + NEW))
        targets = np.flatnonzero(batch["old_log_probs"][row])
        assert targets.tolist() == list(range(n - 1, n - 1 + NEW))  # target t is token t + 1
    assert (rollout.rewards == [first_byte_low(c, {}) for c in rollout.completions]).all()
    np.testing.assert_array_equal(batch["advantages"], group_advantages(rollout.rewards, G))
    assert 0 < rollout.rewards.mean() < 1  # some groups have something to learn
    assert rollout.metrics(G)["completion_length"] == NEW


def test_a_completion_ends_at_its_stop_token():
    """Completions of different lengths, some ended by the stop token: it is the completion's last token, trained on
    (the model learns to stop), and not in the text the rewards read."""
    state, sampler, _ = fresh_rollout()
    stopping = Rollouts(sampler.run, state["params"], sampler.prompts, sampler.rewards, ByteTokenizer().decode)
    stopping.settings = dataclasses.replace(stopping.settings, eos_id=ord("!"))
    texts = ["ab!", "5", "x!", "yz12", "1!", "22", "!", "3"]
    tokens = [list(t.encode()) for t in texts]
    log_probs = [-np.arange(1, len(t) + 1, dtype=np.float32) for t in tokens]
    rollout = stopping.scored(np.repeat([0, 1], G), Generation(tokens, log_probs=log_probs))
    assert rollout.completions == ["ab", "5", "x", "yz12", "1", "22", "", "3"]
    assert rollout.stopped.tolist() == [True, False] * 4 and rollout.lengths.tolist() == [3, 1, 2, 4, 2, 2, 1, 1]
    assert rollout.batch["loss_weights"].sum(1).tolist() == rollout.lengths.tolist()
    n = len(sampler.prompts.ids[0])
    assert rollout.batch["tokens"][0, n : n + 4].tolist() == [*b"ab!", 0]
    assert rollout.batch["old_log_probs"][0, n - 1 : n + 3].tolist() == [-1, -2, -3, 0]
    assert rollout.rewards.tolist() == [0, 1, 0, 0, 1, 1, 0, 1]  # "5", "1", "22", "3" begin below 64


def test_at_the_first_step_on_fresh_rollouts_the_ratio_is_1_and_the_kl_0():
    """The sampler's log-probs are the trainer's within ATOL, so the first update's ratio is 1 to float32 precision
    (num_iterations=1: TRL detaches the policy's own log-probs here, ratio 1 exactly); with the adapters' B at 0 the
    policy is the reference, and the KL is 0."""
    state, sampler, rollout = fresh_rollout()
    run = sampler.run
    batch = ReferenceLogProbs(run, sampler.shardings, state, 0).attach(state["params"], sampler.place(rollout.batch))
    model = run.shardings.model
    trainer = np.asarray(
        jax.jit(lambda p, t: model.module(p).target_log_probs({"tokens": t}))(state["params"], batch["tokens"])
    )
    mask = rollout.batch["loss_weights"][:, 1:] > 0
    difference = np.abs(trainer - rollout.batch["old_log_probs"])[mask]
    assert difference.max() <= ATOL, difference.max()
    _, metrics = run.train_step(jax.tree.map(jnp.copy, state), batch)
    assert abs(float(metrics["ratio"]) - 1) < 1e-6
    assert float(metrics["clip_fraction"]) == 0 and float(metrics["kl"]) == 0
    assert float(metrics["grad_norm"]) > 0 and float(metrics["completion_tokens"]) == 8 * NEW


def test_one_device_equals_the_mesh_with_adapters():
    """Loss and adapter gradients of one GRPO step on the same rollouts, on one device and on data=2,fsdp=2,tensor=2,
    from adapters drawn at random (so the ratio moves off 1, the KL to the adapters-off reference is not 0, and A
    has a gradient). And the rollouts each mesh's sampler draws from those params are the same tokens, with
    log-probs a float32 ulp or two apart."""
    one, hybrid = lora_run("data=1"), lora_run(HYBRID)
    start = with_random_adapters(one)
    host = fresh_rollout()[2].batch  # sampled before the adapters moved
    results, sampled = [], []
    for run in (one, hybrid):
        params = run.shardings.state_from_model_order(start)["params"]
        sampler = Rollouts(run, params, prompts(), resolve_rewards(first_byte_low), ByteTokenizer().decode)
        sampled.append(sampler(params, 0).batch)
        reference = ReferenceLogProbs(run, sampler.shardings, {"params": params}, 0)  # adapters: params' own base
        batch = reference.attach(params, sampler.place(host))
        (loss, metrics), grads = run.compiled_grad(params, batch)
        model = run.shardings.model
        grads = model.trainable(run.shardings.params_in_model_order(model.join(grads, model.split(params)[1])))
        metrics = {k: float(metrics[k]) for k in ("kl", "ratio", "clip_fraction")}
        results.append((float(loss), metrics, [np.asarray(g) for g in jax.tree.leaves(grads)]))
    (loss, metrics, reference), (sharded_loss, sharded_metrics, got) = results
    assert metrics["kl"] > 1e-3 and abs(metrics["ratio"] - 1) > 1e-3
    assert len(reference) == 2 * 7 and all(np.abs(g).max() > 0 for g in reference)  # q k v o gate up down: A and B
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(list(sharded_metrics.values()), list(metrics.values()), rtol=1e-5)
    assert_gradients_close(got, reference, rtol=1e-5)
    np.testing.assert_array_equal(sampled[1]["tokens"], sampled[0]["tokens"])
    np.testing.assert_allclose(sampled[1]["old_log_probs"], sampled[0]["old_log_probs"], rtol=0, atol=ATOL)


# -- the loop ---------------------------------------------------------------------------------------------------------


def test_a_learnable_reward_rises_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """8 steps of full fine-tuning on 'the first byte is below 64' with a KL to a frozen copy of the starting weights,
    checkpointed at 4 and 8; its last checkpoint deleted (a run killed after step 7), rerun: it resumes at 4 (its
    reference made again) and logs the same rewards, losses and KL for 5 to 8, and the same held-out score at 8. The
    held-out score (at 0 and at the end) is that of the greedy completions the saved model gives, and the metrics
    file holds every record once."""
    overrides = ["learning_rate=0.05", "batch_size=16", "grpo.group_size=8", "grpo.max_new_tokens=2", "steps=8"]
    overrides += ["grpo.beta=0.04"]  # the KL to a frozen copy of the starting weights: no adapters here
    metrics = tmp_path.parent / f"{tmp_path.name}-metrics.jsonl"
    overrides += [f"checkpoint.dir={tmp_path}", "checkpoint.every=4", f"tracking.metrics_file={metrics}"]
    cfg = config("data=1", overrides)
    path, held_out = (tmp_path.parent / f"{tmp_path.name}-{name}.jsonl" for name in ("train", "eval"))
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    held_out.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ("xy", "A", "bye", "z", "7")))
    keys = ("reward_mean", "loss", "grad_norm", "val_reward_mean", "kl")

    def history() -> list[tuple]:
        out = grpo_train(
            cfg, path, first_byte_low, eval_prompts=held_out, log=lambda *_: None, devices=jax.devices()[:1]
        )
        return [(h["step"], *(h.get(k, np.nan) for k in keys)) for h in out["history"]]

    whole = history()
    assert [h[0] for h in whole] == list(range(9))
    rewards = [h[1] for h in whole[1:]]
    assert np.mean(rewards[-2:]) >= rewards[0] + 0.3, rewards
    kl = [h[5] for h in whole[1:]]
    assert kl[0] < 1e-6 and min(kl[1:]) > 1e-4, kl  # the first step's policy is the reference; then it moves off
    greedy = Generator.restore(tmp_path / "8").generate(
        [list(w.encode()) for w in ("xy", "A", "bye", "z", "7")], max_new_tokens=2
    )
    assert whole[-1][4] == np.mean([first_byte_low(bytes(t).decode("utf-8", "replace"), {}) for t in greedy.tokens])
    assert np.isfinite(whole[0][4]) and all(np.isnan(h[4]) for h in whole[1:-1])
    shutil.rmtree(tmp_path / "8")
    resumed = history()
    assert [h[0] for h in resumed] == [5, 6, 7, 8]
    np.testing.assert_allclose(np.array(resumed), np.array(whole[5:]), rtol=1e-5, atol=1e-7)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(9)) and rows[-1]["val_first_byte_low"] == resumed[-1][4]


def test_jaxtrain_train_runs_grpo_from_its_config(tmp_path, capsys):
    """`jaxtrain train grpo.group_size=G grpo.prompts=FILE grpo.rewards=...`: the command line's GRPO, and its
    one-line error without prompts or rewards."""
    from jaxtrain.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w, "answer": "x"}) + "\n" for w in WORDS))
    argv = ["train", "--model", "llama-tiny", "--mesh", "data=-1", "--steps", "2", "--batch-size", "8"]
    argv += [f"seq_len={SEQ_LEN}", f"grpo.group_size={G}", f"grpo.max_new_tokens={NEW}", "progress=false"]
    assert main([*argv, f"grpo.prompts={prompts}", "grpo.rewards=exact_match,format:^[a-z]"]) == 0
    printed = capsys.readouterr()
    assert "step      2  loss" in printed.err and "done: steps 2  reward_mean" in printed.out
    assert main(argv) == 2
    assert "grpo.prompts and grpo.rewards are not set" in capsys.readouterr().err
