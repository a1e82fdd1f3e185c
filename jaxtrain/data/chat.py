"""Chat and instruction data: a JSON line into the token ids of its rendered conversation and a loss weight per token.

A line is one of (other keys are ignored):

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}, ...]}
    {"prompt": "...", "completion": "..."}        an instruction: the user's prompt, the assistant's completion

Roles are `system`, `user` and `assistant`; a conversation has at least one assistant message, and one before it.
It is rendered whole with a chat template (`jaxtrain.data.chat_template`) and tokenized without added special tokens:
the ids are transformers' `apply_chat_template(messages, tokenize=True)["input_ids"]`.

What the loss counts (weight 1; every other token 0): the tokens each assistant message adds. For assistant message
i, the conversation before it is rendered with the generation prompt (the assistant's header, which the model is
given at inference) and then through message i; the tokens the second adds are the assistant's content and what the
template closes its turn with: Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>` and newline, Mistral's `</s>`. That is
what TRL's `assistant_only_loss` counts with its `{% generation %}` training templates, except text TRL puts inside
the generation block that a template's generation prompt already holds (Qwen2.5's newline after `assistant`): here
the prompt given at inference is never a target. System and user messages, headers and the beginning-of-text token
weigh 0. A weight belongs to a token as a target: it says whether predicting that token counts.

This needs a template that renders a conversation turn by turn: each rendering of a shorter part is the start of the
longer one's, in text and in tokens. One that is not (Mistral v0.3's moves the system message into the last user
turn) is an error naming the template, the message and where the texts differ.

Too long (`max_tokens`), a conversation is cut after its last assistant message that fits (`turn`, the default;
dropped if none fits), or dropped (`drop`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jaxtrain.data.chat_template import ChatTemplate, ChatTemplateError
from jaxtrain.data.jsonl import line_number, lines
from jaxtrain.errors import UserInputError

ROLES = ("system", "user", "assistant")
TRUNCATIONS = ("turn", "drop")  # what happens to a conversation longer than max_tokens
RECORD_FORMAT = (
    'a JSON object a line with \'messages\' (a list of {"role": system|user|assistant, "content": text}) or '
    "'prompt' and 'completion' (texts)"
)


class ChatError(UserInputError):
    """A conversation that cannot be read, rendered or masked."""


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How `jaxtrain tokenize --chat` turns conversations into tokens: the template, and the length policy."""

    template: ChatTemplate
    max_tokens: int | None = None  # the longest conversation kept whole, in tokens; None: any length
    truncation: str = "turn"  # one of TRUNCATIONS

    def describe(self) -> dict:
        """What a tokenized directory records of these options (its plan and manifest)."""
        return {
            "template": self.template.name,
            "template_sha256": self.template.digest,
            "special_tokens": self.template.special_tokens,
            "max_tokens": self.max_tokens,
            "truncation": self.truncation,
        }


@dataclasses.dataclass(frozen=True)
class EncodedChat:
    """A rendered, tokenized conversation: ids, the loss weight of each as a target (uint8 0/1), and after each
    assistant message the number of ids so far (where the conversation may be cut)."""

    ids: np.ndarray
    weights: np.ndarray
    turn_ends: tuple[int, ...]

    def cut(self, length: int) -> EncodedChat:
        """The conversation's first `length` ids: a turn end, so what is kept renders as the shorter conversation."""
        return EncodedChat(self.ids[:length], self.weights[:length], tuple(e for e in self.turn_ends if e <= length))


def conversation(line: bytes) -> list[dict]:
    """The messages of a JSON line (see the module docstring); a `ChatError` saying what is wrong and how to fix it."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        record = None
    if isinstance(record, dict) and "messages" in record:
        return checked_conversation(record["messages"])
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ChatError(
                f"'prompt' and 'completion' must be texts, got {type(prompt).__name__} and "
                f"{type(completion).__name__}: give a conversation as 'messages' instead."
            )
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    found = f"keys {', '.join(map(repr, record))}" if isinstance(record, dict) else repr(line[:60])
    raise ChatError(f"expected {RECORD_FORMAT}; got {found}.")


def checked_conversation(messages: object, reply: bool = True) -> list[dict]:
    """`messages` if they are a conversation (roles known, contents texts, a user first), else a `ChatError`; with
    `reply`, one the assistant answers in (a prompt for generation need not be)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'messages' must be a non-empty list of messages, got {json.dumps(messages)[:60]}.")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ChatError(
                f"message {k} has role {json.dumps(role)[:40]}: roles are {', '.join(ROLES)}. Rename it (e.g. "
                "human -> user, gpt -> assistant), or drop the message."
            )
        if not isinstance(message.get("content"), str):
            raise ChatError(
                f"message {k} ({message['role']}) has content {json.dumps(message.get('content'))[:40]}: a message's "
                "content is a text."
            )
    roles = [m["role"] for m in messages]
    if reply and "assistant" not in roles:
        raise ChatError(
            f"the conversation has no assistant message (roles: {', '.join(roles)}): there is nothing to train on. "
            "Give each conversation the assistant's reply, or leave the line out."
        )
    if roles[0] == "assistant":
        raise ChatError("the conversation starts with an assistant message: give the user message it answers first.")
    return messages


def encode(messages: list[dict], template: ChatTemplate, encode_batch: Callable[[Sequence[str]], list]) -> EncodedChat:
    """`messages` rendered with `template`, tokenized with `encode_batch` (no special tokens added), with the loss
    weights of the module docstring."""
    whole = template.render(messages)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    # Each assistant turn's text: the conversation before it with the generation prompt, and through it.
    spans = [
        (template.render(messages[:k], add_generation_prompt=True), template.render(messages[: k + 1])) for k in turns
    ]
    for k, (before, through) in zip(turns, spans):
        _check_extends(before, through, template, f"message {k - 1} with the generation prompt", f"message {k}")
        _check_extends(through, whole, template, f"message {k}", f"the last message ({len(messages) - 1})")
    texts = list(dict.fromkeys([whole, *(text for span in spans for text in span)]))
    tokens = dict(zip(texts, encode_batch(texts)))
    ids = np.asarray(tokens[whole], dtype=np.int64)
    weights = np.zeros(len(ids), np.uint8)
    ends = []
    for k, (before, through) in zip(turns, spans):
        start, stop = len(tokens[before]), len(tokens[through])
        if not (
            np.array_equal(tokens[through][:start], tokens[before]) and np.array_equal(ids[:stop], tokens[through])
        ):
            raise ChatError(
                f"rendered with the chat template ({template.name}), the text before assistant message {k} (ending "
                f"{before[-30:]!r}) or through it tokenizes to ids that do not start the longer conversation's: the "
                "tokenizer merges text across the turn's start or end, so the assistant's tokens cannot be told "
                "apart. Use a template that closes the prompt and the turn with a special token or a newline "
                "(--chat-template FILE)."
            )
        weights[start:stop] = 1
        ends.append(stop)
    return EncodedChat(ids, weights, tuple(ends))


def chat_ids(
    messages: list[dict],
    template: ChatTemplate,
    encode_batch: Callable[[Sequence[str]], list],
    add_generation_prompt: bool = False,
) -> list[int]:
    """The token ids of `messages` rendered with `template` (with the generation prompt: a conversation for the model
    to continue), as transformers' `apply_chat_template(messages, tokenize=True, ...)["input_ids"]`."""
    return list(encode_batch([template.render(messages, add_generation_prompt)])[0])


def _check_extends(shorter: str, longer: str, template: ChatTemplate, short_name: str, long_name: str) -> None:
    """Refuse a template whose rendering of a shorter part of a conversation does not start its longer one's."""
    if longer.startswith(shorter):
        return
    at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), min(len(shorter), len(longer)))
    raise ChatError(
        f"the chat template ({template.name}) does not render this conversation turn by turn: rendered through "
        f"{short_name} it reads {shorter[max(0, at - 25) : at + 25]!r} at character {at}, but through {long_name} "
        f"{longer[max(0, at - 25) : at + 25]!r}. The loss mask marks the tokens each assistant message adds, so the "
        "template must extend a conversation's text as messages are added (Mistral v0.3's, for one, moves the system "
        "message into the last user turn). Drop what it moves, or give a template that does (--chat-template FILE)."
    )


def fit(chat: EncodedChat, max_tokens: int | None, truncation: str) -> tuple[EncodedChat | None, str]:
    """`chat` within `max_tokens` ids (None: any length) by `truncation` (one of TRUNCATIONS), and what was done:
    "whole", "cut" (after its last assistant turn that fits) or "dropped"."""
    if max_tokens is None or len(chat.ids) <= max_tokens:
        return chat, "whole"
    fitting = [end for end in chat.turn_ends if end <= max_tokens]
    if truncation == "drop" or not fitting:
        return None, "dropped"
    return chat.cut(fitting[-1]), "cut"


def read_conversations(
    path: Path, start: int, stop: int, encode_batch: Callable[[Sequence[str]], list], options: ChatOptions
) -> tuple[list[EncodedChat | None], list[int], dict[str, int]]:
    """The conversations of the JSON lines starting in bytes [start, stop) of `path`, encoded and fitted to
    `options`: each line's conversation (None where dropped), each line's size in bytes, and how many were kept
    whole, cut and dropped. A bad line is a `ChatError` naming the file and line."""
    chats, sizes, counts = [], [], {"whole": 0, "cut": 0, "dropped": 0}
    for offset, line in lines(path, start, stop):
        try:
            chat = encode(conversation(line), options.template, encode_batch)
        except (ChatError, ChatTemplateError) as err:
            raise ChatError(f"'{path}' line {line_number(path, offset)}: {err}") from None
        chat, outcome = fit(chat, options.max_tokens, options.truncation)
        counts[outcome] += 1
        chats.append(chat)
        sizes.append(len(line))
    return chats, sizes, counts
