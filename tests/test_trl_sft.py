"""Against a peer: jaxtrain's chat SFT loss equals TRL's `SFTTrainer` loss, token for token and to 1e-4 (float32),
on a randomly initialised transformers Llama saved here with its own tokenizer and chat template (nothing is
downloaded), imported with `jaxtrain import-hf`, its conversations tokenized with `jaxtrain tokenize --chat`.

Both losses are the mean next-token cross-entropy over the tokens the loss counts, taken over the whole batch (a
token mean, not a mean of per-sequence means): jaxtrain's is its model's loss with the shards' loss weights
(`compiled_eval`); TRL's is `SFTTrainer.compute_loss(model, batch)` with `num_items_in_batch=None`, TRL 1.16's
default `loss_type="nll"`, which divides the summed loss by the number of labels other than -100 in the batch (so
no option is needed to make it a token mean). TRL runs with `bf16=False` (TRL's default is bf16) and in eval mode.

Which tokens count:

- Conversations (`{"messages": ...}`) against `SFTConfig(assistant_only_loss=True)`. The tokenizer carries the
  model's own chat template, exactly as shipped (TRL's `llama3.jinja` and `qwen2_5.jinja` are the same strings as
  tests/test_chat_data.py's); it has no `{% generation %}` markers, so TRL swaps in its own training variant
  (`get_training_chat_template`: the same text with the assistant's output inside `{% generation %}`), and counts
  the tokens transformers' `return_assistant_tokens_mask` marks from those blocks. jaxtrain renders the original
  and counts what each assistant message adds to the rendering with the generation prompt.
  - Llama 3: both count the assistant's content and its `<|eot_id|>`; the masks are equal token for token.
  - Qwen2.5: TRL's training template opens the generation block right after `<|im_start|>assistant`, before the
    newline that the generation prompt (`<|im_start|>assistant\\n`) already holds; jaxtrain never counts the prompt
    given at inference. So TRL counts exactly one token more per assistant turn, the newline after
    `<|im_start|>assistant`: the test asserts that this is the whole difference, and compares the losses on the
    tokens both count (TRL's labels of those newlines set to -100).
- Instructions (`{"prompt": text, "completion": text}`, which jaxtrain renders as a user and an assistant message)
  against TRL's conversational prompt-completion data (`{"prompt": [user message], "completion": [assistant
  message]}`) with `completion_only_loss=True`: TRL counts what the rendered conversation adds to the prompt rendered
  with the generation prompt, which is what jaxtrain counts, for both templates (Qwen2.5's newline included in the
  prompt on both sides). TRL's plain-text prompt-completion data is not the same thing: it is not rendered with the
  chat template at all.
"""

import contextlib
import functools
import io
import json
import warnings

import jax
import numpy as np
import pytest
from test_chat_data import LLAMA3, QWEN25, SYSTEM, byte_level_bpe, sentence
from test_hf_interop import SIZES
from tokenizers import Tokenizer

from jaxtrain.cli import main
from jaxtrain.run_config import load_config
from jaxtrain.training.checkpoint import restore_params
from jaxtrain.training.setup import build

torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
datasets = pytest.importorskip("datasets", reason="comparing with TRL needs trl and datasets: pip install trl")
trl = pytest.importorskip("trl", reason="comparing with TRL needs trl: pip install trl")

RTOL = 1e-4
ROW = 128  # tokens a row holds (the model sees ROW - 1 inputs): every conversation here fits
CONVERSATIONS = 8  # one batch of all of them, on both sides
FAMILIES = {  # the template as shipped, and the special tokens its tokenizer_config.json names
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}


@functools.cache
def bpe() -> Tokenizer:
    """test_chat_data's BPE, trained on the role names too (so conversations stay short)."""
    rng = np.random.default_rng(0)
    texts = [sentence(rng, 3, 12) + " system user assistant" for _ in range(300)]
    return byte_level_bpe([*texts, SYSTEM["content"]])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("trl")


@functools.cache
def model_directory(root, family: str):
    """A random float32 transformers Llama saved with `family`'s tokenizer and chat template, and its jaxtrain import
    (`jaxtrain import-hf --dtype float32`). The weights are the same for every family (one seed, one vocabulary)."""
    template, special = FAMILIES[family]
    directory = root / family
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe(), chat_template=template, **special)
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(**{**SIZES, "vocab_size": len(tokenizer)}, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    run_cli(["import-hf", str(directory), str(directory / "import"), "--dtype", "float32"])
    return directory


def run_cli(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv


def conversations(seed: int = 0) -> list[list[dict]]:
    """CONVERSATIONS conversations of 1 to 3 turns, half with a system message."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(CONVERSATIONS):
        messages = [SYSTEM] if k % 2 else []
        for _ in range(rng.integers(1, 4)):
            messages += [{"role": "user", "content": sentence(rng, 2, 7)[:-1] + "?"}]
            messages += [{"role": "assistant", "content": sentence(rng, 1, 10)}]
        out.append(messages)
    return out


def instructions(seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"prompt": sentence(rng, 2, 10)[:-1] + "?", "completion": sentence(rng, 1, 20)} for _ in range(CONVERSATIONS)
    ]


def jaxtrain_documents(directory, lines: list[dict], name: str) -> list[tuple[list[int], list[int]]]:
    """`lines` written as JSON lines and tokenized with `jaxtrain tokenize --chat` with the import's tokenizer (and
    chat template); each stored document (train and val split) as (token ids, loss weights)."""
    data, out = directory / f"{name}.jsonl", directory / f"{name}-shards"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = directory / "import" / "hf"
    argv = ["tokenize", "--chat", "--tokenizer", str(tokenizer), "--out", str(out), "--val-fraction", "0.25"]
    run_cli([*argv, "--max-tokens", str(ROW), "--no-progress", str(data)])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat"]["whole"] == len(lines)  # none cut or dropped: each fits in a row, on both sides
    documents = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            tokens, offsets, weights = (
                np.load(out / f"{shard['name']}.{k}.npy") for k in ("tokens", "docs", "weights")
            )
            documents += [(tokens[a:b].tolist(), weights[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    return documents


def trl_batch(directory, records: list[dict], **options):
    """TRL's trainer on the saved model (float32) and tokenizer, its one training batch of all `records` (from
    `get_train_dataloader`, whose sampler orders them at random: rows are matched to jaxtrain's by their ids), and each
    row's ids and counted-token mask (labels other than -100) without the padding."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with warnings.catch_warnings():  # TRL's own defaults warn (gradient_checkpointing's new name); nothing trains
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(
            output_dir=str(directory / "trl"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=len(records),
            max_length=ROW,
            packing=False,
            dataloader_num_workers=0,
            seed=0,
            **options,
        )
        trainer = trl.SFTTrainer(
            model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer
        )
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1
    batch = batches[0]
    rows = []
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()  # padded on the right
        rows.append((ids[:length].tolist(), (labels[:length] != -100).long().tolist()))
    return trainer, batch, rows


def trl_loss(trainer, batch) -> float:
    trainer.model.eval()
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, {k: v.clone() for k, v in batch.items()}))


@functools.cache
def jaxtrain_run(directory, shards):
    """A one-device run of the import on `shards` (chat data: tokens and loss weights) in batches of CONVERSATIONS
    rows of ROW tokens, and the import's params."""
    cfg = load_config(
        directory / "import" / "config.toml",
        overrides=[
            f"checkpoint.restore={directory / 'import'}",
            f"data.source=tokens:{shards}",
            "mesh=data=1",
            f"batch_size={CONVERSATIONS}",
            f"seq_len={ROW - 1}",
            "data.packing=segments",
            "train.progress=false",
        ],
    )
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    params, _ = restore_params(cfg.checkpoint.restore, run.shardings.abstract_state["params"])
    return run, run.shardings.init_state(run.optimizer, 0, params)["params"]


def jaxtrain_loss(directory, name: str, documents: list[tuple[list[int], list[int]]], weighted: bool = True) -> float:
    """The import's loss on one batch of `documents` (of the shards `name`), a row each (padding: segment 0), through
    jaxtrain's eval step."""
    run, params = jaxtrain_run(directory, directory / f"{name}-shards")
    shape = (CONVERSATIONS, ROW)
    batch = {
        "tokens": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "loss_weights": np.zeros(shape, np.float32),
    }
    for row, (ids, weights) in enumerate(documents):
        batch["tokens"][row, : len(ids)] = ids
        batch["segment_ids"][row, : len(ids)] = 1
        batch["loss_weights"][row, : len(ids)] = weights if weighted else 1
    return float(run.compiled_eval(params, batch)["loss"])


def matched(ours: list[tuple[list[int], list[int]]], theirs: list[tuple[list[int], list[int]]]):
    """jaxtrain's documents in the order of TRL's rows, matched by their token ids: the same ids, row for row."""
    by_ids = {tuple(ids): (ids, weights) for ids, weights in ours}
    assert len(by_ids) == len(ours) == len(theirs)
    assert sorted(by_ids) == sorted(tuple(ids) for ids, _ in theirs), "TRL feeds other token ids than jaxtrain"
    return [by_ids[tuple(ids)] for ids, _ in theirs]


def assert_close(ours: float, theirs: float) -> float:
    error = abs(ours - theirs) / abs(theirs)
    assert error <= RTOL, f"jaxtrain {ours:.7f}, TRL {theirs:.7f}: relative difference {error:.3g}"
    return error


def test_assistant_only_loss_equals_trl_on_llama3(root):
    """Multi-turn conversations, some with a system message: the same ids, the same assistant mask token for token
    (content and <|eot_id|>), and the same loss; a loss over every token would differ."""
    directory = model_directory(root, "llama3")
    records = [{"messages": messages} for messages in conversations()]
    ours = jaxtrain_documents(directory, records, "chats")
    trainer, batch, theirs = trl_batch(directory, records, assistant_only_loss=True)
    assert trainer.chat_template == trl.chat_template_utils.llama3_training_chat_template  # TRL's training variant
    ours = matched(ours, theirs)
    for (ids, weights), (_, mask) in zip(ours, theirs):
        assert weights == mask, f"assistant masks differ on {ids}"
    eot = trainer.processing_class.convert_tokens_to_ids("<|eot_id|>")
    assistant_turns = sum(m["role"] == "assistant" for r in records for m in r["messages"])
    assert sum(ids[j] == eot for ids, w in ours for j in range(len(ids)) if w[j]) == assistant_turns
    loss = jaxtrain_loss(directory, "chats", ours)
    error = assert_close(loss, trl_loss(trainer, batch))
    print(f"\nllama3 assistant-only loss: jaxtrain {loss:.6f}, relative difference to TRL {error:.2g}")
    # Over every token (TRL's labels all kept but padding) the two agree too, and differ from the loss above: the
    # masks are what makes it the assistant's loss.
    every = jaxtrain_loss(directory, "chats", ours, weighted=False)
    labels = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
    assert_close(every, trl_loss(trainer, {**batch, "labels": labels}))
    assert abs(every / loss - 1) > 1e-2


def test_assistant_only_loss_equals_trl_on_qwen25_less_the_newline_trl_counts(root):
    """Qwen2.5: TRL's mask is jaxtrain's plus the newline after each `<|im_start|>assistant` (see the module
    docstring), and nothing else; on the tokens both count the losses are equal."""
    directory = model_directory(root, "qwen2.5")
    records = [{"messages": messages} for messages in conversations()]
    ours = jaxtrain_documents(directory, records, "chats")
    trainer, batch, theirs = trl_batch(directory, records, assistant_only_loss=True)
    assert trainer.chat_template == trl.chat_template_utils.qwen2_5_training_chat_template
    tokenizer = trainer.processing_class
    header = tokenizer.encode("<|im_start|>assistant", add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    ours = matched(ours, theirs)
    labels = batch["labels"].clone()
    for row, ((ids, weights), (_, mask)) in enumerate(zip(ours, theirs)):
        after_header = {j + len(header) for j in range(len(ids)) if ids[j : j + len(header)] == header}
        only_trl = {j for j in range(len(ids)) if mask[j] and not weights[j]}
        assert not any(w and not m for w, m in zip(weights, mask)), "jaxtrain counts a token TRL does not"
        assert only_trl == after_header and all(ids[j] == newline[0] for j in only_trl)
        labels[row, sorted(only_trl)] = -100
    assert (batch["labels"] != labels).sum() == sum(m["role"] == "assistant" for r in records for m in r["messages"])
    loss = jaxtrain_loss(directory, "chats", ours)
    error = assert_close(loss, trl_loss(trainer, {**batch, "labels": labels}))
    print(f"\nqwen2.5 assistant-only loss: jaxtrain {loss:.6f}, relative difference to TRL {error:.2g}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_completion_loss_equals_trl_completion_only_loss(root, family):
    """jaxtrain's prompt/completion lines against TRL's conversational prompt-completion data with
    completion_only_loss=True: the same ids, the same counted tokens, the same loss."""
    directory = model_directory(root, family)
    lines = instructions()
    ours = jaxtrain_documents(directory, lines, "instructions")
    records = [
        {
            "prompt": [{"role": "user", "content": line["prompt"]}],
            "completion": [{"role": "assistant", "content": line["completion"]}],
        }
        for line in lines
    ]
    trainer, batch, theirs = trl_batch(directory, records, completion_only_loss=True)
    ours = matched(ours, theirs)
    for (ids, weights), (_, mask) in zip(ours, theirs):
        assert weights == mask, f"completion masks differ on {ids}"
    loss = jaxtrain_loss(directory, "instructions", ours)
    error = assert_close(loss, trl_loss(trainer, batch))
    print(f"\n{family} completion-only loss: jaxtrain {loss:.6f}, relative difference to TRL {error:.2g}")
