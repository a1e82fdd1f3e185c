"""Supervised fine-tuning on chat data: a randomly initialised transformers Llama with its own tokenizer and chat
template (made here; nothing is downloaded), imported with `jaxtrain import-hf`, fine-tuned on conversations
tokenized with that tokenizer, whole and with LoRA, from the import, a jaxtrain checkpoint and a jaxtrain export.
The task: the assistant repeats the first of the user's three words. Evaluation reports the assistants' tokens' mean
loss over the held-out set (checked against NumPy in float64), and the generation score on held-out prompts rises
from near 0 to near 1 without the train step compiling again; custom scorers are called and logged; bad settings are
one line."""

import contextlib
import io
import json
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxtrain.cli import main
from jaxtrain.errors import ConfigError, UserInputError
from jaxtrain.evaluation import in_loop
from jaxtrain.posttrain.sft_eval import GenerationEval, GenerationEvalError, register_scorer
from jaxtrain.run_config import LoraConfig, load_config
from jaxtrain.training import loop, recovery
from jaxtrain.training.checkpoint import find_checkpoint, restore_params, trained_config
from jaxtrain.training.recovery import TokenizerMismatchError
from jaxtrain.training.setup import build

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

# meta-llama/Meta-Llama-3-8B-Instruct's chat template (as tests/test_chat_data.py has it).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
WORDS = "apple bird cat dog egg fish goat hat ink jam kite lamp moon nest owl pig".split()
DEVICES = 2
# Rows of 33 tokens hold one conversation each (about 24 tokens); a fast learning rate for a task this small.
SFT = ["mesh=data=2", "batch_size=16", "seq_len=32", "data.packing=segments", "train.progress=false"]
SFT += ["optimizer.learning_rate=1e-2", "warmup_steps=5", "train.generate_eval_max_new_tokens=8"]


def bpe(rng: np.random.Generator, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens that knows Llama 3's special tokens: each of WORDS is one token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([" ".join(rng.choice(WORDS, 5)) + " user assistant" for _ in range(300)], trainer)
    return tokenizer


def hf_model(directory, rng: np.random.Generator, vocab_size: int = 300) -> None:
    """A random transformers Llama (init scale 0.3: a frozen random head still spans logits wide enough for LoRA to
    learn through) saved with its tokenizer and chat template."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe(rng, vocab_size),
        chat_template=LLAMA3,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    hf.save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(hf),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def copy_task(path, count: int, rng: np.random.Generator) -> None:
    """`count` conversations: the user says three words, the assistant repeats the first."""
    lines = []
    for _ in range(count):
        words = rng.choice(WORDS, 3)
        messages = [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": words[0]}]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))


def run_cli(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The import and its chat data: 600 conversations, 10% held out, tokenized with the import's own tokenizer."""
    root = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    hf_model(root / "hf", rng)
    copy_task(root / "chats.jsonl", 600, rng)
    run_cli(["import-hf", str(root / "hf"), str(root / "import"), "--dtype", "float32"])
    tokenize = ["tokenize", "--chat", "--tokenizer", str(root / "import" / "hf"), "--max-tokens", "33"]
    run_cli(
        [*tokenize, "--val-fraction", "0.1", "--no-progress", "--out", str(root / "shards"), str(root / "chats.jsonl")]
    )
    return root


def config(sft, *overrides: str, restore: str | None = None):
    base = [f"data.source=tokens:{sft / 'shards'}", f"checkpoint.restore={restore or sft / 'import'}", *SFT]
    return load_config(sft / "import" / "config.toml", overrides=[*base, *overrides])


def sft_train(cfg, **kwargs):
    return in_loop.train(cfg, log=lambda *_: None, devices=jax.devices()[:DEVICES], **kwargs)


class CompileCounter:
    """Counts XLA backend compiles (jax.monitoring), persistent-cache hits included: a program built again counts."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, *_args, **_kwargs) -> None:
        self.count += event == self.EVENT


COMPILES = CompileCounter()


def before_training(cfg) -> float:
    """The generation score of the import itself, before a step of training."""
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:DEVICES])
    params, _ = restore_params(cfg.checkpoint.restore, run.shardings.abstract_state["params"])
    stored = run.shardings.init_state(run.optimizer, 0, params)["params"]
    return GenerationEval(cfg)(run, stored, 0)["val_exact_match"]


def test_sft_from_an_import_learns_and_scores_without_recompiling(sft, capsys):
    """150 steps of the whole model: the held-out assistants' loss falls and exact match on 32 held-out prompts rises
    from near 0 to near 1; after the first evaluation nothing compiles again (train step, evaluation, generation)."""
    cfg = config(sft, "train.steps=150", "train.eval_every=50", "train.log_every=50", "train.generate_eval_every=50")
    before = before_training(cfg)
    compiles = {}
    summary = sft_train(cfg, on_metrics=lambda row: compiles.setdefault(row["step"], COMPILES.count))
    rows = [row for row in summary["history"] if "val_exact_match" in row]
    print(
        f"\nSFT from an import: exact match {before:.3f} before, then "
        + ", ".join(f"step {r['step']}: val_loss {r['val_loss']:.3f} exact {r['val_exact_match']:.3f}" for r in rows)
    )
    assert [r["step"] for r in rows] == [50, 100, 150]
    assert before <= 0.1 and rows[-1]["val_exact_match"] >= 0.8
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] / 4
    assert compiles[50] > 0 and compiles[150] == compiles[50], "a program compiled again after the first evaluation"


def test_sft_with_lora_from_an_import_learns(sft):
    """Adapters alone (rank 8) on the import: exact match rises from near 0."""
    cfg = config(sft, "lora.rank=8", "train.steps=150", "train.eval_every=150", "train.generate_eval_every=150")
    summary = sft_train(cfg)
    print(f"\nSFT with LoRA: val_loss {summary['val_loss']:.3f} exact match {summary['val_exact_match']:.3f}")
    assert summary["val_exact_match"] >= 0.6


def test_sft_from_a_checkpoint_and_an_export_with_and_without_lora(sft, tmp_path):
    """A jaxtrain run's checkpoint restores for SFT as its params with a new optimizer at step 0 (whole model with
    checkpoint.restore_params_only, or with adapters), and so does its `jaxtrain export`; the run directory carries
    the import's tokenizer, so the tokenizer check passes."""
    # Every run here takes 2 steps (the step's learning-rate schedule is part of the compiled program) and both
    # sources get adapters of one rank: the checkpoint's and the export's runs share their compiled programs.
    sft_train(config(sft, "train.steps=2", f"checkpoint.dir={tmp_path / 'run'}", "train.eval_every=2"))
    step = tmp_path / "run" / "2"
    run_cli(["export", str(step), str(tmp_path / "export")])
    for restore, extra in [
        (step, ["checkpoint.restore_params_only=true"]),
        (step, ["lora.rank=8"]),
        (tmp_path / "export", []),
        (tmp_path / "export", ["lora.rank=8"]),
    ]:
        lines = []
        cfg = config(
            sft, "train.steps=2", "train.eval_every=2", "train.generate_eval_every=2", *extra, restore=str(restore)
        )
        summary = in_loop.train(cfg, log=lines.append, devices=jax.devices()[:DEVICES])
        assert any("starting from the params of step 2" in line for line in lines), (restore, extra)
        assert summary["steps"] == 2 and 0 <= summary["val_exact_match"] <= 1


def test_a_lora_checkpoint_continues_with_its_adapters_or_starts_from_its_merged_model(sft, tmp_path):
    """A checkpoint trained with adapters: `jaxtrain train --restore STEP` (no --model, no lora keys: the config the
    checkpoint stores) continues it with the adapters and optimizer it stores; checkpoint.restore_params_only starts
    from its model, every adapter folded in (the merged model's val_loss equals the adapted run's), with the whole
    model or new adapters training; other lora settings are a one-line error naming both."""
    run_dir = tmp_path / "lora"
    lora = sft_train(config(sft, "lora.rank=8", "train.steps=10", "train.eval_every=10", f"checkpoint.dir={run_dir}"))
    step = run_dir / "10"
    # What `jaxtrain train --restore STEP` starts from without --model or --config: the lora keys included.
    assert trained_config(*find_checkpoint(step)).lora == LoraConfig(rank=8)

    def started(*overrides: str):
        cfg = config(sft, *overrides, restore=str(step))
        run = build(cfg, log=lambda *_: None, devices=jax.devices()[:DEVICES])
        lines = []
        state, progress = recovery.initial_state(run, None, lines.append)
        return run, state, progress, lines

    run, state, progress, lines = started("lora.rank=8")
    assert progress.step == 10 and "starting a new run from step 10" in lines[0]
    run, state, progress, lines = started("checkpoint.restore_params_only=true")
    assert progress.step == 0 and not run.shardings.model.freezes
    assert loop.evaluate(run, state["params"])["val_loss"] == pytest.approx(lora["val_loss"], rel=1e-5)
    run, state, progress, lines = started("checkpoint.restore_params_only=true", "lora.rank=4")
    assert progress.step == 0 and "new adapters" in lines[0]
    assert loop.evaluate(run, state["params"])["val_loss"] == pytest.approx(lora["val_loss"], rel=1e-5)
    with pytest.raises(recovery.AdapterRestoreError) as err:
        started("lora.rank=4")
    assert "lora.rank=8" in one_line(err) and "lora.rank=4" in one_line(err) and "restore_params_only" in one_line(err)


def numpy_val_loss(run, params, batches: int) -> float:
    """The mean next-token cross-entropy in float64 over every assistant target of `batches` val batches."""
    forward = jax.jit(lambda p, tokens, ids: nnx.merge(run.shardings.model.graphdef, p)(tokens, ids))
    total = count = 0.0
    for k in range(batches):
        batch = {key: np.asarray(v) for key, v in run.batch("val", k).items()}
        tokens, segments = batch["tokens"], batch["segment_ids"]
        logits = np.asarray(forward(params, tokens[:, :-1], segments[:, :-1]), np.float64)  # (B, T, V)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        weights = same * batch["loss_weights"][:, 1:]
        total, count = total + (nll * weights).sum(), count + weights.sum()
    return total / count


def test_the_val_loss_is_the_assistant_token_mean_over_the_held_out_set(sft):
    """val_loss equals NumPy's float64 mean over every assistant token of the evaluated batches (batches of 2
    conversations, so their counts differ and a mean of batch means would not equal it)."""
    cfg = config(sft, "batch_size=2", "train.eval_batches=5")
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:DEVICES])
    params, _ = restore_params(cfg.checkpoint.restore, run.shardings.abstract_state["params"])
    stored = run.shardings.init_state(run.optimizer, 0, params)["params"]
    ours = loop.evaluate(run, stored)
    expected = numpy_val_loss(run, params, 5)
    assert ours["val_loss"] == pytest.approx(expected, rel=1e-5)
    per_batch = [float(run.compiled_eval(stored, run.batch("val", k))["loss"]) for k in range(5)]
    assert abs(np.mean(per_batch) / expected - 1) > 1e-4  # the test tells the two means apart
    weights = [np.asarray(run.batch("val", k)["loss_weights"])[:, 1:].sum() for k in range(5)]
    assert ours["val_targets"] == sum(weights)


CALLS = []


def first_letter(prediction: str, reference: str) -> float:
    """A custom scorer: whether the reply starts with the reference's first letter."""
    CALLS.append((prediction, reference))
    return float(prediction.strip()[:1] == reference.strip()[:1])


def reply_length(prediction: str, reference: str) -> float:
    return float(len(prediction))


def test_custom_scorers_are_called_and_logged(sft, tmp_path):
    """A registered scorer and a module:function one: each is called once per held-out prompt with the decoded
    reply and reference (the reference without the end-of-turn token), and logged as val_<name> in the JSONL."""
    register_scorer("first_letter", first_letter)
    for spec, key in [("first_letter", "val_first_letter"), (f"{__name__}:reply_length", "val_reply_length")]:
        CALLS.clear()
        metrics = tmp_path / f"{key}.jsonl"
        cfg = config(
            sft,
            "train.steps=2",
            "train.eval_every=2",
            "train.generate_eval_every=2",
            "train.generate_eval_prompts=6",
            f"train.generate_eval_scorer={spec}",
            f"tracking.metrics_file={metrics}",
        )
        sft_train(cfg)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert key in rows[-1] and "val_loss" in rows[-1], rows[-1]
        if spec == "first_letter":
            assert len(CALLS) == 6 and all(ref in WORDS for _, ref in CALLS), CALLS


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, UserInputError), message
    return message


def test_bad_settings_are_one_line(sft, tmp_path):
    """An unknown scorer, data without chat (no template, no prompts), a pipeline mesh, the loop asked for a score
    it cannot compute, and data of another tokenizer than the model's. (Chat data without held-out conversations
    cannot be made: `jaxtrain tokenize` refuses an empty val split.)"""
    with pytest.raises(GenerationEvalError) as err:
        GenerationEval(config(sft, "train.generate_eval_every=5", "train.generate_eval_scorer=bleu"))
    assert "bleu" in one_line(err) and "exact_match" in one_line(err)
    with pytest.raises(GenerationEvalError) as err:
        GenerationEval(config(sft, "train.generate_eval_every=5", "train.generate_eval_scorer=no_such_module:f"))
    assert "cannot import" in one_line(err)
    # Text data tokenized with the same tokenizer: no chat template, so no prompts to generate from.
    (tmp_path / "text.txt").write_text("apple bird cat dog fish goat.\n\n" * 100)
    tokenize = ["tokenize", "--tokenizer", str(sft / "import" / "hf"), "--no-progress", "--val-fraction", "0.5"]
    run_cli([*tokenize, "--documents", "paragraphs", "--out", str(tmp_path / "text"), str(tmp_path / "text.txt")])
    text = config(sft, "train.generate_eval_every=5", f"data.source=tokens:{tmp_path / 'text'}")
    with pytest.raises(GenerationEvalError) as err:
        GenerationEval(text)
    assert "needs chat data" in one_line(err)
    chats = tmp_path / "chats.jsonl"
    copy_task(chats, 100, np.random.default_rng(1))
    with pytest.raises(GenerationEvalError) as err:
        GenerationEval(config(sft, "train.generate_eval_every=5", "mesh=pipeline=2"))
    assert "pipeline" in one_line(err)
    with pytest.raises(ConfigError) as err:
        loop.train(config(sft, "train.generate_eval_every=5"), log=lambda *_: None)
    assert "jaxtrain.train(cfg)" in one_line(err)
    # Chat data tokenized with another tokenizer than the import's.
    other = tmp_path / "other"
    hf_model(other, np.random.default_rng(7), vocab_size=290)
    run_cli(
        [
            "tokenize",
            "--chat",
            "--tokenizer",
            str(other),
            "--no-progress",
            "--val-fraction",
            "0.2",
            "--out",
            str(tmp_path / "o"),
            str(chats),
        ]
    )
    with pytest.raises(TokenizerMismatchError) as err:
        sft_train(config(sft, f"data.source=tokens:{tmp_path / 'o'}"))
    assert "another tokenizer" in one_line(err) and "jaxtrain tokenize --tokenizer" in one_line(err)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
