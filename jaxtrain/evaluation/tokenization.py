"""The model's tokenizer as lm-eval's `hf` backend uses transformers': a text is encoded with the tokens the tokenizer
adds around it (a beginning-of-text token) unless it starts with that token's text; the end-of-text and
beginning-of-text tokens are those its `tokenizer_config.json` names (an import from Hugging Face carries it); decoded
text leaves special tokens out. Log-likelihoods agree with the `hf` backend's only if the token ids do.

A tokenizer without that file (one trained here: `jaxtrain tokenizer train`) has its end-of-text token and no
beginning-of-text token; bytes (`ByteTokenizer`) have neither.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from jaxtrain.data.tokenizer import Tokenizer
from jaxtrain.inference.generate import ByteTokenizer, Generator


@dataclasses.dataclass(frozen=True)
class Special:
    """A special token: its text and id."""

    text: str
    id: int


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """Encode and decode as the `hf` backend does. `add_bos_token`: as its model argument, None for the tokenizer's
    own choice."""

    tokenizer: ByteTokenizer | Tokenizer
    bos: Special | None
    eos: Special | None
    special_ids: frozenset[int]  # left out of decoded text
    add_bos_token: bool | None = None

    @classmethod
    def of(cls, generator: Generator, add_bos_token: bool | None = None) -> TextCodec:
        """The codec of the tokenizer `generator`'s model trained with (see `Generator.tokenizer`)."""
        tokenizer = generator.tokenizer
        if isinstance(tokenizer, ByteTokenizer):
            return cls(tokenizer, None, None, frozenset(), add_bos_token)
        named = _named_specials(generator.carried)
        bos, eos = (_special(tokenizer, named.get(key)) for key in ("bos_token", "eos_token"))
        if eos is None and tokenizer.eot_id is not None:
            eos = Special(tokenizer.decode([tokenizer.eot_id]), tokenizer.eot_id)
        return cls(tokenizer, bos, eos, _special_ids(tokenizer.path), add_bos_token)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """`text`'s ids; with the tokenizer's own tokens around it when `add_special_tokens` (default: the codec's
        `add_bos_token`, else yes unless the text starts with the beginning-of-text token's text)."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None:
            add_special_tokens = not (self.bos is not None and text.startswith(self.bos.text))
        with_special = getattr(self.tokenizer, "encode_batch_with_special", None)
        if add_special_tokens and with_special is not None:
            return with_special([text])[0]
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.tokenizer.decode(ids)


def _named_specials(carried: Path | None) -> dict[str, str]:
    """The beginning- and end-of-text tokens' texts that transformers' files name: tokenizer_config.json's, else
    special_tokens_map.json's (older saves)."""
    named: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = carried / name if carried is not None else None
        if path is not None and path.is_file():
            settings = json.loads(path.read_text(encoding="utf-8"))
            for key in ("bos_token", "eos_token"):
                value = settings.get(key)
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str):
                    named.setdefault(key, text)
    return named


def _special(tokenizer: Tokenizer, text: str | None) -> Special | None:
    """The token whose text is `text`, if the tokenizer has it as one token."""
    if text is None:
        return None
    ids = tokenizer.encode(text)
    return Special(text, ids[0]) if len(ids) == 1 else None


def _special_ids(path: Path) -> frozenset[int]:
    """The ids of a tokenizer.json's special added tokens (transformers' `skip_special_tokens` leaves them out);
    none for sentencepiece, whose decoder drops its control tokens itself."""
    if path.suffix == ".model":
        return frozenset()
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
    return frozenset(t["id"] for t in added if t.get("special"))
