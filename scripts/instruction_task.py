"""A synthetic instruction task with checkable answers, for supervised fine-tuning that can be scored exactly:
string transforms of random 4-letter words, as chat conversations (JSON lines of `messages`), plus plain-text
renderings of the same transforms to pre-train a base model on, and a character-level tokenizer with a compact chat
template to tokenize both. Deterministic from a seed (benchmarks/sft_learning.py and tests/test_sft_learning.py use
it).

    python scripts/instruction_task.py --out task --seed 0                 # task/chats.jsonl, pretrain.txt, tokenizer/
    python scripts/instruction_task.py --out task --held-out 128 --noise 0.5   # + prompts.jsonl, held_out.jsonl
    jaxtrain tokenize --tokenizer task/tokenizer --documents paragraphs --val-fraction 0.01 --out pre task/pretrain.txt
    jaxtrain tokenize --chat --tokenizer task/tokenizer --max-tokens 33 --val-fraction 0.06 --out sft task/chats.jsonl

The transforms (`TRANSFORMS`), each a map of every letter the instruction names: `Upper: abcd` -> `ABCD`,
`Shift: abcd` -> `bcde` (each letter to the next, z to a), `Rot13: abcd` -> `nopq`. Every word is drawn once across
all of it: no two conversations, and no conversation and pre-training example, share a word. The held-out split is
the one `jaxtrain tokenize --val-fraction` draws (about that part of the conversations, each in or out by a fixed
seed): whichever it holds out, a held-out prompt (and its answer) was never seen in pre-training or fine-tuning.
`instruction_task(...)` returns the texts to a test without a subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

LETTERS = string.ascii_lowercase
TRANSFORMS: dict[str, Callable[[str], str]] = {
    "Upper": str.upper,
    "Shift": lambda word: "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in word),
    "Rot13": lambda word: "".join(LETTERS[(LETTERS.index(c) + 13) % 26] for c in word),
}
# The plain-text rendering of an example for pre-training (other words than the chat's, no template): the chat
# template's layout token for token, with one-character markers where it puts its role tokens ('#' for <|user|>,
# '>' for <|assistant|>), so the base model has the skill and ends a turn with <|end|>; the roles are new to it.
PLAIN = "#{}: {}<|end|>\n>{}<|end|>"
# A noisy teacher's wrong reply: the word under another transform than the one asked for.
CONFUSED = {"Upper": "Shift", "Shift": "Rot13", "Rot13": "Upper"}
# Special tokens, one id each: the end of a text document, and the chat template's role markers and end of turn.
SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A compact template, ChatML's shape with one token per role marker:
# `<|user|>Upper: abcd<|end|>\n<|assistant|>ABCD<|end|>\n`.
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Task:
    """The task's texts: pre-training paragraphs and chat conversations (each a `messages` dict), no word in two of
    them."""

    pretrain: list[str]
    conversations: list[dict]


def words(rng: np.random.Generator, count: int, min_len: int, max_len: int) -> list[str]:
    """`count` distinct random lowercase words of `min_len` to `max_len` letters, in the order drawn."""
    seen: dict[str, None] = {}
    while len(seen) < count:
        length = int(rng.integers(min_len, max_len + 1))
        seen.setdefault("".join(rng.choice(list(LETTERS), length)), None)
    return list(seen)


def conversation(name: str, word: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"{name}: {word}"},
            {"role": "assistant", "content": TRANSFORMS[name](word)},
        ]
    }


def instruction_task(
    seed: int = 0,
    pretrain_examples: int = 20_000,
    conversations: int = 2_000,
    min_len: int = 4,
    max_len: int = 4,
    per_paragraph: int = 8,
) -> Task:
    """The task for `seed`: each example a distinct word and a transform drawn uniformly; the pre-training text as
    paragraphs of `per_paragraph` plain-text examples (`PLAIN`)."""
    rng = np.random.default_rng(seed)
    pool = words(rng, pretrain_examples + conversations, min_len, max_len)
    names = list(TRANSFORMS)
    picks = [names[i] for i in rng.integers(0, len(names), len(pool))]
    examples = list(zip(picks, pool))
    pre, chat = examples[:pretrain_examples], examples[pretrain_examples:]
    plain = [PLAIN.format(name, word, TRANSFORMS[name](word)) for name, word in pre]
    paragraphs = ["\n".join(plain[i : i + per_paragraph]) for i in range(0, len(plain), per_paragraph)]
    return Task(paragraphs, [conversation(name, word) for name, word in chat])


def noisy_teacher(conversations: list[dict], noise: float, seed: int) -> list[dict]:
    """`conversations` as a teacher right `1 - noise` of the time gives them: each reply replaced, with probability
    `noise`, by the word under the transform `CONFUSED` with the one asked for (benchmarks/grpo_learning.py)."""
    rng = np.random.default_rng((seed, 2))  # a stream of its own: the task's draws stay the task's
    taught = []
    for item in conversations:
        user, assistant = item["messages"]
        name, word = user["content"].split(": ")
        if rng.random() < noise:
            assistant = {"role": "assistant", "content": TRANSFORMS[CONFUSED[name]](word)}
        taught.append({"messages": [user, assistant]})
    return taught


def prompt_records(conversations: list[dict]) -> list[dict]:
    """GRPO's prompt records of `conversations`: the user's message as a conversation, the correct reply its answer
    (`exact_match` compares with it)."""
    records = []
    for item in conversations:
        user = item["messages"][0]
        name, word = user["content"].split(": ")
        records.append({"prompt": [user], "answer": TRANSFORMS[name](word)})
    return records


def tokenizer_directory(directory: str | Path) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template): one token
    per byte (no merges, so a word's letters are its tokens) and the `SPECIAL` tokens, the chat template's end of
    turn `<|end|>` as `eos_token`. Written the same every time (its SHA-256 is the tokenizer's identity)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "eos_token": "<|end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_task(out: str | Path, task: Task, held_out: int = 0, noise: float = 0.0, seed: int = 0) -> dict[str, Path]:
    """`out`/pretrain.txt (blank-line paragraphs), chats.jsonl (one conversation a line: tokenize it with
    --val-fraction) and tokenizer/. With `held_out` > 0 the last that many conversations are left out of chats.jsonl
    and written as GRPO's prompt records, held_out.jsonl, beside prompts.jsonl, those of the conversations kept; with
    `noise` > 0 chats.jsonl holds a noisy teacher's replies (`noisy_teacher`), the prompts the correct answers."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kept = task.conversations[: len(task.conversations) - held_out]
    paths = {"pretrain": out / "pretrain.txt", "chats": out / "chats.jsonl"}
    paths["pretrain"].write_text("\n\n".join(task.pretrain) + "\n")
    taught = noisy_teacher(kept, noise, seed) if noise else kept
    paths["chats"].write_text("".join(json.dumps(c) + "\n" for c in taught))
    if held_out:
        for name, part in (("prompts", kept), ("held_out", task.conversations[len(kept) :])):
            paths[name] = out / f"{name}.jsonl"
            paths[name].write_text("".join(json.dumps(r) + "\n" for r in prompt_records(part)))
    paths["tokenizer"] = tokenizer_directory(out / "tokenizer")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain-examples", type=int, default=20_000)
    parser.add_argument("--conversations", type=int, default=2_000)
    parser.add_argument("--held-out", type=int, default=0, help="the last N conversations as GRPO's held-out prompts")
    parser.add_argument("--noise", type=float, default=0.0, help="the share of a noisy teacher's wrong replies")
    args = parser.parse_args(argv)
    task = instruction_task(args.seed, args.pretrain_examples, args.conversations)
    for name, path in write_task(args.out, task, args.held_out, args.noise, args.seed).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
