"""Chat and instruction data: conversations rendered with a model's chat template tokenize to transformers' ids
(Llama 3, Qwen2.5 and Mistral templates, copied below from their tokenizer_config.json files); the loss counts the
assistant's tokens only, through the model's own loss, on any mesh; the weights resume with the tokens; bad input
is one line naming the file and line."""

import contextlib
import io
import json
import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_gradients_close, make_run
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxtrain.cli import main
from jaxtrain.data.chat import ChatError, ChatOptions, chat_ids, conversation, encode
from jaxtrain.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate, ChatTemplateError, find_chat_template
from jaxtrain.data.shards import ShardError, tokenize
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.data.tokens import TokenData

# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json "chat_template".
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - the template as shipped
# mistralai/Mistral-7B-Instruct-v0.3, tokenizer_config.json "chat_template": the system message goes into the last
# user turn, and roles must alternate (raise_exception).
MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501 - the template as shipped
# Each family's template, special tokens, and the text its loss counts of CONVERSATION (the assistant's content and
# what closes its turn).
FAMILIES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "{}<|eot_id|>"),
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "{}<|im_end|>\n"),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, " {}</s>"),
}
SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>"]
SPECIAL += ["<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]"]
WORDS = "the a capital of france is paris what how many legs does spider have eight please answer briefly".split()
SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "How many legs does a spider have?"},
    {"role": "assistant", "content": "Eight."},
]


def sentence(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, rng.integers(low, high))).capitalize() + "."


def byte_level_bpe(texts: list[str]) -> Tokenizer:
    """A byte-level BPE of 400 tokens trained on `texts` that knows the three families' special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    rng = np.random.default_rng(0)
    return byte_level_bpe([sentence(rng, 3, 12) for _ in range(300)])


def model_directory(bpe, family: str, directory: Path):
    """A Hugging Face tokenizer directory of `family` (transformers saves it), and transformers' tokenizer."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    template, special, _ = FAMILIES[family]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template, **special)
    hf.save_pretrained(directory)
    return hf


def theirs(hf, messages, generation_prompt=False) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rendered_conversations_tokenize_to_transformers_ids(bpe, family, tmp_path):
    """With and without a system message, one turn and several, and with the generation prompt: the ids are
    transformers' apply_chat_template ids; the loss counts each assistant's content and the end of its turn."""
    hf = model_directory(bpe, family, tmp_path)
    if family == "qwen2.5":  # the older layout: the template inside tokenizer_config.json
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25}))
        (tmp_path / "chat_template.jinja").unlink()
    template, tokenizer = find_chat_template(tmp_path), load_tokenizer(tmp_path)
    assert template.source == FAMILIES[family][0] and template.special_tokens == FAMILIES[family][1]
    # Mistral's template drops a system message unless the last message is the user's: trained on, it cannot say
    # which tokens an assistant adds (test_a_template_that_does_not_render_turn_by_turn_is_refused).
    systems = [[]] if family == "mistral" else [[], [SYSTEM]]
    for system in systems:
        for messages in (CONVERSATION[:2], CONVERSATION):
            chat = encode(system + messages, template, tokenizer.encode_batch)
            assert chat.ids.tolist() == theirs(hf, system + messages)
            counted = tokenizer.decode(chat.ids[chat.weights == 1].tolist())
            assistant = [m["content"] for m in messages if m["role"] == "assistant"]
            assert counted == "".join(FAMILIES[family][2].format(a) for a in assistant)
    for system in ([], [SYSTEM]):  # a prompt for the model to continue
        prompt = system + CONVERSATION[:3]
        assert chat_ids(prompt, template, tokenizer.encode_batch, True) == theirs(hf, prompt, True)
        assert template.render(prompt, True) == hf.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )


def test_the_builtin_template_and_a_named_file(bpe, tmp_path):
    bpe.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ChatTemplateError, match=r"has no chat template: .* --chat-template chatml \| FILE.jinja"):
        find_chat_template(tmp_path / "tokenizer.json")
    chatml = find_chat_template(tmp_path / "tokenizer.json", "chatml")
    assert chatml.render(CONVERSATION[:2]) == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" + (
        "<|im_start|>assistant\nParis.<|im_end|>\n"
    )
    (tmp_path / "llama.jinja").write_text(LLAMA3)
    assert find_chat_template(tmp_path, str(tmp_path / "llama.jinja")).source == LLAMA3
    assert set(BUILTIN_TEMPLATES) == {"chatml"}


def write_conversations(path: Path, count: int, seed: int = 0) -> list[list[dict]]:
    """`count` conversations of 1 to 3 turns, some with a system message, a quarter as prompt/completion lines."""
    rng = np.random.default_rng(seed)
    conversations, lines = [], []
    for k in range(count):
        if k % 4 == 3:
            prompt, completion = sentence(rng, 2, 10) + "?", sentence(rng, 1, 30)
            lines.append({"prompt": prompt, "completion": completion, "id": k})
            conversations.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}])
            continue
        messages = [SYSTEM] if rng.random() < 0.5 else []
        for _ in range(rng.integers(1, 4)):
            messages += [{"role": "user", "content": sentence(rng, 2, 10)}]
            messages += [{"role": "assistant", "content": sentence(rng, 1, 30)}]
        lines.append({"messages": messages})
        conversations.append(messages)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return conversations


@pytest.fixture(scope="module")
def chat_shards(bpe, tmp_path_factory):
    """300 conversations in Llama 3's template, tokenized with `jaxtrain tokenize --chat` into shards."""
    root = tmp_path_factory.mktemp("chat")
    model_directory(bpe, "llama3", root / "model")
    conversations = write_conversations(root / "chats.jsonl", 300)
    out = root / "shards"
    argv = ["tokenize", "--chat", "--tokenizer", str(root / "model"), "--out", str(out), "--val-fraction", "0.2"]
    with contextlib.redirect_stdout(io.StringIO()) as report:
        assert main([*argv, "--max-tokens", "120", "--no-progress", str(root / "chats.jsonl")]) == 0
    return {"root": root, "dir": out, "conversations": conversations, "report": report.getvalue()}


def stored_documents(directory: Path, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each document of `split` as (token ids, loss weights), read straight from the shard files."""
    manifest = json.loads((directory / "manifest.json").read_text())
    out = []
    for shard in manifest["splits"][split]["shards"]:
        tokens, offsets, weights = (
            np.load(directory / f"{shard['name']}.{k}.npy") for k in ("tokens", "docs", "weights")
        )
        out += [(tokens[a:b], weights[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    return out


def test_tokenize_chat_writes_tokens_weights_and_the_report(chat_shards, bpe, tmp_path):
    """Shards hold transformers' ids of each conversation, whole or cut after the last assistant turn that fits in
    --max-tokens, with the assistant's tokens weighted; the manifest and the printed report count them."""
    manifest = json.loads((chat_shards["dir"] / "manifest.json").read_text())
    chat = manifest["chat"]
    assert manifest["format"] == 2 and chat["truncation"] == "turn" and chat["max_tokens"] == 120
    assert chat["conversations"] == 300 and chat["whole"] + chat["cut"] + chat["dropped"] == 300
    assert chat["cut"] > 0 and chat["whole"] > 150
    assert (chat_shards["dir"] / "chat_template.jinja").read_text() == LLAMA3
    hf = model_directory(bpe, "llama3", tmp_path / "model")
    expected = {}  # every way each conversation may be stored: whole, or cut after each assistant turn
    for messages in chat_shards["conversations"]:
        for end in (k + 1 for k, m in enumerate(messages) if m["role"] == "assistant"):
            expected[tuple(theirs(hf, messages[:end]))] = end == len(messages)
    stored = stored_documents(chat_shards["dir"], "train") + stored_documents(chat_shards["dir"], "val")
    assert len(stored) == chat["whole"] + chat["cut"]
    assert sum(expected[tuple(ids.tolist())] for ids, _ in stored) == chat["whole"]  # KeyError: ids not theirs
    assert all(len(ids) <= 120 for ids, _ in stored)
    weights = np.concatenate([w for _, w in stored])
    assert manifest["splits"]["train"]["assistant_tokens"] + manifest["splits"]["val"]["assistant_tokens"] == (
        weights.sum()
    )
    train = manifest["splits"]["train"]
    counted = f"train: {train['tokens']:,} tokens, {train['assistant_tokens']:,} of them the assistant's"
    assert counted in chat_shards["report"]
    assert (
        f"conversations: 300 read, {chat['whole']} whole, {chat['cut']} cut at a turn, {chat['dropped']} dropped "
        "(over --max-tokens 120, --truncate turn)" in chat_shards["report"]
    )


def assistant_weights(tokens: np.ndarray, segments: np.ndarray, tokenizer) -> np.ndarray:
    """Which tokens of packed rows of Llama 3 conversations are the assistant's, found from the ids alone: those
    after an assistant header, up to its <|eot_id|>. Every segment must be a whole conversation."""
    header = tokenizer.encode("<|start_header_id|>assistant<|end_header_id|>\n\n")
    eot, bos = tokenizer.encode("<|eot_id|>")[0], tokenizer.encode("<|begin_of_text|>")[0]
    weights = np.zeros(tokens.shape, np.float32)
    for row, j in zip(*np.nonzero(segments)):
        if j == 0 or segments[row, j] != segments[row, j - 1]:
            assert tokens[row, j] == bos, "a segment that does not start a conversation"
            inside = False
        weights[row, j] = inside
        inside = (inside and tokens[row, j] != eot) or tokens[row, j - len(header) + 1 : j + 1].tolist() == header
    return weights


def test_the_weights_resume_with_the_tokens(chat_shards):
    """Rows are a function of (seed, split, step, row): read in sequence with read-ahead, or afresh from step 3 (a
    resume) in two halves (two processes), tokens, segments and weights are the same; and the weights sit on the
    tokens they belong to (found again from the ids)."""
    tokenizer = load_tokenizer(chat_shards["dir"] / "tokenizer.json")
    first = TokenData([(chat_shards["dir"], 1.0)], 128, seed=0, packing="segments", prefetch=2)
    assert set(first.shapes(8)) == {"tokens", "segment_ids", "loss_weights"}
    run = [first.rows("train", step, range(8), 8) for step in range(6)]
    resumed = TokenData([(chat_shards["dir"], 1.0)], 128, seed=0, packing="segments", prefetch=2)
    for step in range(3, 6):
        halves = [resumed.rows("train", step, rows, 8) for rows in (range(4), range(4, 8))]
        for key, value in run[step].items():
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), value, err_msg=key)
    for rows in run:
        expected = assistant_weights(rows["tokens"], rows["segment_ids"], tokenizer)
        np.testing.assert_array_equal(rows["loss_weights"], expected)
        assert expected.sum() > 100


def numpy_loss(run, params, batch, tokenizer, weighted: bool = True) -> float:
    """The batch's mean next-token cross-entropy in float64 over the targets that count: in their input's document,
    not padding and (`weighted`) the assistant's, found from the ids. `params` in the model's order."""
    forward = jax.jit(lambda p, tokens, ids: nnx.merge(run.shardings.model.graphdef, p)(tokens, ids))
    tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
    logits = np.asarray(forward(params, tokens[:, :-1], segments[:, :-1]), np.float64)  # (B, T, V)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    counts = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    if weighted:
        counts = counts * assistant_weights(tokens, segments, tokenizer)[:, 1:]
    return float((nll * counts).sum() / counts.sum())


CHAT_RUN = ["data.packing=segments", "seq_len=128", "batch_size=8"]  # rows of 129: every conversation fits


def test_the_loss_counts_the_assistants_tokens_only_on_every_mesh(chat_shards):
    """The model's loss of a training batch equals NumPy's over the assistant's tokens (and not over all tokens), on
    one device and on data x fsdp x context; the weights are sharded as the tokens (on a pipeline mesh too)."""
    overrides = [f"data.source=tokens:{chat_shards['dir']}", *CHAT_RUN]
    tokenizer = load_tokenizer(chat_shards["dir"] / "tokenizer.json")
    one = make_run("data=1", overrides, "llama-tiny", devices=1)
    params = one.shardings.model.init_params(0)
    stored = one.shardings.init_state(one.optimizer, 0, params)["params"]
    batch = one.batch("train", 2)
    assert set(batch) == {"tokens", "segment_ids", "loss_weights"}
    ours = float(one.compiled_eval(stored, batch)["loss"])
    assert ours == pytest.approx(numpy_loss(one, params, batch, tokenizer), rel=1e-5)
    everything = numpy_loss(one, params, batch, tokenizer, weighted=False)
    assert abs(ours / everything - 1) > 1e-3  # so a loss that dropped the weights would fail the line above
    val = one.batch("val", 0)  # held-out conversations: evaluation reports the assistant's loss too
    assert float(one.compiled_eval(stored, val)["loss"]) == pytest.approx(
        numpy_loss(one, params, val, tokenizer), rel=1e-5
    )
    mesh = make_run("data=2,fsdp=2,context=2", overrides, "llama-tiny")
    sharded = mesh.batch("train", 2)
    assert sharded["loss_weights"].sharding == sharded["tokens"].sharding
    np.testing.assert_array_equal(np.asarray(sharded["loss_weights"]), np.asarray(batch["loss_weights"]))
    placed = mesh.shardings.init_state(mesh.optimizer, 0, params)["params"]
    assert float(mesh.compiled_eval(placed, sharded)["loss"]) == pytest.approx(ours, rel=1e-5)
    # Pipelines take concat packing only: the weights ride along, split into microbatches as the tokens are.
    piped = make_run("pipeline=2,data=4", [*overrides, "data.packing=concat"], "llama-tiny").batch("train", 2)
    assert set(piped) == {"tokens", "loss_weights"} and piped["loss_weights"].sharding == piped["tokens"].sharding


def test_accumulated_replica_and_pipelined_gradients_weigh_each_piece_by_its_assistant_tokens(chat_shards):
    """Pieces of a batch hold different numbers of assistant tokens: gradient accumulation, an explicit gradient sync
    (ring; fused, after accumulation) and a pipeline's microbatches weigh each piece's loss and gradient by its share
    of them, so each equals one device's whole batch (a plain mean of the pieces' means, which the batch tells apart,
    would not). Pipelines take concat packing, so theirs is compared with one device's on concat packing."""
    overrides = [f"data.source=tokens:{chat_shards['dir']}", *CHAT_RUN]
    concat = [*overrides, "data.packing=concat"]
    params = make_run("data=1", overrides, "llama-tiny", devices=1).shardings.model.init_params(0)

    def loss_and_gradients(mesh: str, settings: list[str]) -> tuple:  # loss, gradients, the batch, the run
        run = make_run(mesh, settings, "llama-tiny", devices=math.prod(int(a.split("=")[1]) for a in mesh.split(",")))
        placed = run.shardings.init_state(run.optimizer, 0, params)["params"]
        (loss, _), grads = run.compiled_grad(placed, run.batch("train", 2))
        grads = jax.tree.leaves(run.shardings.params_in_model_order(grads))
        return float(loss), [np.asarray(g) for g in grads], jax.device_get(run.batch("train", 2)), run

    whole_loss, whole, batch, one = loss_and_gradients("data=1", overrides)
    loss_fn = jax.jit(one.shardings.model.loss_fn)
    quarters = [{k: v[2 * i : 2 * i + 2] for k, v in batch.items()} for i in range(4)]
    means = [float(loss_fn(params, q)[0]) for q in quarters]
    assert abs(np.mean(means) / whole_loss - 1) > 2e-4, means  # 20x the tolerance below
    cases = [
        ("data=1", ["grad_accum=4"], whole_loss, whole),
        ("data=4", ["allreduce.algorithm=ring"], whole_loss, whole),
        ("data=2", ["allreduce.algorithm=fused", "grad_accum=2"], whole_loss, whole),
        ("pipeline=2,data=2", ["pipeline.microbatches=4"], *loss_and_gradients("data=1", concat)[:2]),
    ]
    for mesh, extra, expected_loss, expected in cases:
        loss, grads, _, _ = loss_and_gradients(mesh, [*(concat if "pipeline" in mesh else overrides), *extra])
        assert loss == pytest.approx(expected_loss, rel=1e-5), (mesh, extra)
        assert_gradients_close(grads, expected)


def test_a_prompt_tokens_target_does_not_change_the_gradient(chat_shards):
    """Changing a target the weights leave out (the last token of a row, read only as a target) leaves the gradient
    as it was; changing one they count does not."""
    run = make_run("data=1", [f"data.source=tokens:{chat_shards['dir']}", *CHAT_RUN], "llama-tiny", devices=1)
    params = run.shardings.init_state(run.optimizer, 0)["params"]
    batch = {k: np.asarray(v).copy() for k, v in run.batch("train", 0).items()}
    batch["segment_ids"][0] = 1  # row 0: one document to its end, so its last target is in its input's document

    def gradient(last_token: int, last_weight: float):
        changed = {k: v.copy() for k, v in batch.items()}
        changed["tokens"][0, -1], changed["loss_weights"][0, -1] = last_token, last_weight
        return jax.tree.leaves(run.compiled_grad(params, changed)[1])

    for leaf, other in zip(gradient(5, 0.0), gradient(9, 0.0)):
        np.testing.assert_array_equal(leaf, other)
    assert not all(np.array_equal(a, b) for a, b in zip(gradient(5, 1.0), gradient(9, 1.0)))


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, r"line 2: the conversation has no assistant message"),
        (
            {"messages": [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            r"line 2: message 0 has role \"human\": roles are system, user, assistant. Rename it",
        ),
        ({"text": "plain text"}, r"line 2: expected a JSON object a line with 'messages' .* got keys 'text'"),
        (
            {
                "messages": [
                    {"role": "user", "content": "A"},
                    {"role": "user", "content": "B"},
                    {"role": "assistant", "content": "C"},
                ]
            },
            r"line 2: the chat template \(.*chat_template.jinja\) failed: After the optional system message, "
            "conversation roles must alternate",
        ),
        (
            {"messages": [SYSTEM, *CONVERSATION]},
            r"line 2: the chat template \(.*\) does not render this conversation turn by turn: .* moves the system",
        ),
    ],
    ids=["no-assistant", "unknown-role", "neither-format", "raise-exception", "not-turn-by-turn"],
)
def test_bad_conversations_are_one_line_naming_the_file_and_line(bpe, tmp_path, capsys, line, match):
    model_directory(bpe, "mistral", tmp_path / "model")
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION[:2]}) + "\n" + json.dumps(line) + "\n")
    argv = ["tokenize", "--chat", "--tokenizer", str(tmp_path / "model"), "--out", str(tmp_path / "out"), str(path)]
    assert re.search(rf"'{re.escape(str(path))}' {match}", one_line_error(capsys, [*argv, "--no-progress"]))


def test_bad_templates_and_inputs_are_one_line(bpe, tmp_path, capsys):
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chats.jsonl").write_text(json.dumps({"prompt": "Hi", "completion": "Hello"}) + "\n")
    argv = ["tokenize", "--chat", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out")]
    err = one_line_error(capsys, [*argv, str(tmp_path / "chats.jsonl")])
    assert "has no chat template" in err and "--chat-template chatml | FILE.jinja | tokenizer_config.json" in err
    (tmp_path / "broken.jinja").write_text("{% for message in messages %}{{ message.content }")
    err = one_line_error(
        capsys, [*argv, "--chat-template", str(tmp_path / "broken.jinja"), str(tmp_path / "chats.jsonl")]
    )
    assert re.search(r"the chat template \(.*broken.jinja\) does not parse: line 1: ", err)
    err = one_line_error(capsys, [*argv, "--chat-template", "vicuna", str(tmp_path / "chats.jsonl")])
    assert "--chat-template vicuna is neither a built-in template (chatml) nor a file" in err
    (tmp_path / "notes.txt").write_text("text")
    err = one_line_error(capsys, [*argv, "--chat-template", "chatml", str(tmp_path / "notes.txt")])
    assert "is not a JSON-lines file" in err
    with pytest.raises(ChatError, match="'prompt' and 'completion' must be texts"):
        conversation(b'{"prompt": ["Hi"], "completion": "Hello"}')
    with pytest.raises(ChatError, match="starts with an assistant message"):
        conversation(b'{"messages": [{"role": "assistant", "content": "Hello"}]}')
    options = ChatOptions(ChatTemplate("chatml", BUILTIN_TEMPLATES["chatml"]), max_tokens=4, truncation="drop")
    with pytest.raises(ShardError, match="the train split of .* is empty: .* or --max-tokens"):
        tokenize(tmp_path / "tokenizer.json", [tmp_path / "chats.jsonl"], tmp_path / "o", progress=False, chat=options)
