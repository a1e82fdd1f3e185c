"""Preference pairs: JSON lines of a prompt with a chosen and a rejected reply, as rows for a preference loss.

A line is one of (other keys are ignored):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                         plain text
    {"prompt": [messages], "chosen": [{"role": "assistant", ...}], "rejected": [...]}   a conversation (TRL's format)

Tokenized as TRL's DPOTrainer does it. Plain text is not rendered: the end-of-text token's text (tokenizer_config's
`eos_token`) is appended to each reply that does not end with it, the prompt and prompt + reply are tokenized with the
tokenizer's own added tokens (a beginning-of-text token), and the reply is what follows their
common prefix (where a tokenizer merges text across the boundary, the merged token is the reply's). A conversation is
rendered with the chat template: the prompt with the generation prompt, and prompt + reply. The loss counts the
reply's tokens only (weight 1), as SFT counts an assistant's turn.

Rows are (seed, split, step, row) -> pair, as every dataset's (`jaxtrain.data.datasets`): a run resumes on any mesh
with the same pairs. Pairs are shuffled once per epoch; the last `val_fraction` of the file is held out.

    >>> pairs = PreferencePairs.from_jsonl("pairs.jsonl", load_tokenizer("tok.json"), seq_len=256)  # doctest: +SKIP
    >>> jaxtrain.train(cfg, dataset=pairs)   # with preference.loss=dpo                            # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxtrain.data.chat import ChatError, checked_conversation
from jaxtrain.data.chat_template import ChatTemplate, ChatTemplateError, special_tokens
from jaxtrain.data.datasets import DataError
from jaxtrain.data.splits import epoch_walk
from jaxtrain.data.tokenizer import Tokenizer

PAIRS = "pairs"  # data.source of preference pairs; "pairs:FILE" names the JSON-lines file inline
PAIR_KEYS = ("pair_tokens", "pair_weights")  # a batch's pairs: (B, 2, T + 1) tokens and the replies' weights
REFERENCE_KEY = "reference_log_probs"  # (B, 2): each reply's log-prob under the reference model, when computed
FIELDS = ("prompt", "chosen", "rejected")
RECORD_FORMAT = (
    "a JSON object a line with 'prompt', 'chosen' and 'rejected': three texts, or a list of messages and two lists "
    "of assistant messages"
)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def encode_pair(
    record: dict,
    encode_batch: Callable[[Sequence[str]], list],
    eos_text: str | None,
    template: ChatTemplate | None,
    encode_plain: Callable[[Sequence[str]], list] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen reply ids, rejected reply ids) of one record, as the module docstring says. Plain text is
    encoded with `encode_plain` (default `encode_batch`): the tokenizer's own special tokens added, as TRL's are."""
    prompt, chosen, rejected = (record[k] for k in FIELDS)
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        texts = [prompt] + [prompt + reply + _unless_ending(reply, eos_text) for reply in (chosen, rejected)]
        encode_batch = encode_plain or encode_batch
    elif isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
        if template is None:
            raise ChatError("a conversation needs a chat template to render it: give the tokenizer's, or a named one.")
        checked_conversation(prompt + chosen)
        checked_conversation(prompt + rejected)
        texts = _rendered(template, prompt, [chosen, rejected])
    else:
        kinds = ", ".join(f"{k} {type(record[k]).__name__}" for k in FIELDS)
        raise ChatError(f"expected {RECORD_FORMAT}; got {kinds}.")
    prompt_ids, *replies = encode_batch(texts)
    start = min(common_prefix_length(prompt_ids, ids) for ids in replies)
    return list(prompt_ids[:start]), list(replies[0][start:]), list(replies[1][start:])


def _unless_ending(reply: str, eos_text: str | None) -> str:
    return "" if not eos_text or reply.endswith(eos_text) else eos_text


def _rendered(template: ChatTemplate, prompt: list[dict], replies: list[list[dict]]) -> list[str]:
    return [template.render(prompt, add_generation_prompt=True)] + [template.render(prompt + r) for r in replies]


class PreferencePairs:
    """Tokenized preference pairs in memory, as rows of `pair_tokens` and `pair_weights` (B, 2, seq_len + 1)
    (`jaxtrain.posttrain.preference`), padded with `pad_id` (weight 0), and each pair's reference log-probs once
    `attach_reference` has computed them."""

    task = "lm"

    def __init__(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
        seq_len: int,
        seed: int = 0,
        val_fraction: float = 0.1,
        pad_id: int = 0,
        name: str = "preference pairs",
    ):
        if not pairs:
            raise DataError(f"{name} holds no pair that fits {seq_len + 1} tokens: nothing to train on.")
        self.seq_len, self.seed, self.name = seq_len, seed, name
        tokens = np.full((len(pairs), 2, seq_len + 1), pad_id, np.int32)
        weights = np.zeros((len(pairs), 2, seq_len + 1), np.float32)
        for i, (prompt, *replies) in enumerate(pairs):
            for side, reply in enumerate(replies):
                ids = [*prompt, *reply]
                tokens[i, side, : len(ids)] = ids
                weights[i, side, len(prompt) : len(ids)] = 1.0
        held_out = min(len(pairs) - 1, int(round(len(pairs) * val_fraction)))
        cut = len(pairs) - held_out
        self.splits = {"train": (tokens[:cut], weights[:cut]), "val": (tokens[cut:], weights[cut:])}
        if held_out == 0:  # one pair: validation reads the training pair rather than nothing
            self.splits["val"] = self.splits["train"]
        self.largest_id = int(tokens.max())
        self.expects_reference = False  # set by a run whose loss reads reference log-probs from the batch
        self.reference: dict[str, np.ndarray] | None = None
        self.dropped = 0  # pairs left out as too long (`from_jsonl`)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: Tokenizer,
        seq_len: int,
        seed: int = 0,
        val_fraction: float = 0.1,
        template: ChatTemplate | None = None,
        eos_text: str | None = None,
    ) -> PreferencePairs:
        """The pairs of a JSON-lines file, tokenized with `tokenizer` (and `template` for conversations). Pairs
        longer than `seq_len + 1` tokens are left out and counted (`dropped`). `eos_text`: what plain replies end
        with (the tokenizer_config's eos_token), default the tokenizer's end-of-text token."""
        if eos_text is None and tokenizer.path is not None:
            eos_text = special_tokens(tokenizer.path).get("eos_token")
        if eos_text is None and tokenizer.eot_id is not None:
            eos_text = tokenizer.decode([tokenizer.eot_id])
        encode_plain = tokenizer.encode_batch_with_special or tokenizer.encode_batch
        pairs, dropped = [], 0
        for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"'{path}' line {number}"
            try:
                pair = encode_pair(_record(line), tokenizer.encode_batch, eos_text, template, encode_plain)
            except (ChatError, ChatTemplateError) as err:
                raise DataError(f"{where}: {err}") from None
            if pair[1] == pair[2]:
                raise DataError(
                    f"{where}: the chosen and the rejected reply are the same tokens, so the pair prefers nothing: "
                    "drop the line or fix one of the replies."
                )
            if not pair[1] or not pair[2]:
                raise DataError(f"{where}: a reply with no tokens of its own; give both replies text.")
            if len(pair[0]) + max(len(pair[1]), len(pair[2])) > seq_len + 1:
                dropped += 1
                continue
            pairs.append(pair)
        data = cls(pairs, seq_len, seed, val_fraction, name=f"'{path}'")
        data.dropped = dropped
        return data

    def shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (batch_size, 2, self.seq_len + 1)
        shapes = {
            PAIR_KEYS[0]: jax.ShapeDtypeStruct(shape, np.int32),
            PAIR_KEYS[1]: jax.ShapeDtypeStruct(shape, np.float32),
        }
        if self.expects_reference:
            shapes[REFERENCE_KEY] = jax.ShapeDtypeStruct((batch_size, 2), np.float32)
        return shapes

    def size(self, split: str) -> int:
        return len(self.splits[split][0])

    def indices(self, split: str, step: int, rows: range, batch_size: int) -> np.ndarray:
        """Which pair each row of a step reads: global sample step x batch_size + row, through a shuffle of the
        split drawn per epoch from (seed, split, epoch)."""
        return epoch_walk(self.seed, split, step * batch_size + np.asarray(rows, np.int64), self.size(split))

    def rows(self, split: str, step: int, rows: range, batch_size: int) -> dict[str, np.ndarray]:
        picked = self.indices(split, step, rows, batch_size)
        tokens, weights = self.splits[split]
        out = {PAIR_KEYS[0]: tokens[picked], PAIR_KEYS[1]: weights[picked]}
        if self.expects_reference:
            if self.reference is None:
                raise DataError(
                    f"{self.name}: the run's loss reads each pair's reference log-probs, which are not computed yet: "
                    "jaxtrain.training.reference.attach_reference(run, params) computes them (the training loop "
                    "does, before its first step)."
                )
            out[REFERENCE_KEY] = self.reference[split][picked]
        return out

    def attach_reference(self, log_probs: Callable[[dict[str, np.ndarray]], np.ndarray], batch_size: int) -> None:
        """Compute each pair's reference log-probs once, `batch_size` pairs at a time, with `log_probs` (a batch of
        pairs -> (B, 2)); rows carry them from then on. The last batch of a split is padded with its first pairs."""
        reference = {}
        for split, (tokens, weights) in self.splits.items():
            out = np.empty((len(tokens), 2), np.float32)
            for start in range(0, len(tokens), batch_size):
                picked = np.arange(start, start + batch_size) % len(tokens)
                values = np.asarray(log_probs({PAIR_KEYS[0]: tokens[picked], PAIR_KEYS[1]: weights[picked]}))
                kept = min(batch_size, len(tokens) - start)
                out[start : start + kept] = values[:kept]
            reference[split] = out
        self.reference = reference


def _record(line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        found = f"keys {', '.join(map(repr, record))}" if isinstance(record, dict) else repr(line[:60])
        missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
        raise ChatError(f"expected {RECORD_FORMAT}; got {found} (missing {', '.join(missing)}).")
    return record
