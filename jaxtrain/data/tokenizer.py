"""Tokenizers: a Hugging Face `tokenizers` file (tokenizer.json, or a model directory holding one), or a
sentencepiece `.model` (needs the optional `sentencepiece` package); and a byte-level BPE trained on local files.

>>> tok = train_bpe(["corpus.txt"], vocab_size=4096, out="tok.json")   # doctest: +SKIP
>>> tok.encode_batch(["To be, or not"]), tok.vocab_size, padded_vocab(tok.vocab_size)   # doctest: +SKIP
([[1147, 316, 12, 419, 461]], 4096, 4096)

A tokenizer is known by the SHA-256 of its file (`digest`): tokenized shards record it, and loading them checks it.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxtrain.errors import UserInputError

# A model's vocabulary is padded up to a multiple of this, so the vocab dim splits over a tensor axis of any
# power-of-two size up to 128 (and the matmuls stay on aligned tiles).
VOCAB_MULTIPLE = 128
# The end-of-text token our BPE gets, and the names other tokenizers give theirs, in the order looked for.
EOT_TOKEN = "<|endoftext|>"
EOT_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# The largest vocabulary `train_bpe` asks for. The trainer reserves room for every token it is asked for before it
# reads a byte (tens of bytes each, at least: at 2**28 it needs over 6 GB, and 10**10 aborts the process), and its ids
# are 32-bit. 2**24 reserves about a gigabyte, and is 64 times the largest vocabularies in use (262,144).
MAX_BPE_VOCAB = 2**24
READ_BLOCK = 2**20  # bytes read at a time to check a training file


class TokenizerError(UserInputError):
    """A tokenizer that is missing, unreadable or unusable."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: `encode_batch` texts to token ids (no special tokens added), `decode` ids to text."""

    path: Path  # the file it was loaded from
    digest: str  # SHA-256 of that file's bytes
    vocab_size: int
    eot_id: int | None  # the end-of-text token that closes each document, if the tokenizer has one
    encode_batch: Callable[[Sequence[str]], list[list[int]]]
    decode: Callable[[Sequence[int]], str]
    # Texts to ids with the tokens the tokenizer itself adds around a text (its post-processor's: a beginning-of-text
    # token), as transformers' `tokenizer(text)` gives them; None: it adds none.
    encode_batch_with_special: Callable[[Sequence[str]], list[list[int]]] | None = None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def padded_vocab(vocab_size: int) -> int:
    """`vocab_size` rounded up to a multiple of `VOCAB_MULTIPLE`: the model's vocabulary for this tokenizer."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizer_file(path: str | Path) -> Path:
    """The file a tokenizer path names: the path itself, or an HF model directory's tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer '{path}' does not exist. Give a tokenizer.json, a Hugging Face model directory holding one, "
            "or a sentencepiece .model; or train one: jaxtrain tokenizer train --vocab-size N --out tok.json FILES."
        )
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path` (see `tokenizer_file`); a `.model` file is read with sentencepiece."""
    path = tokenizer_file(path)
    if path.suffix == ".model":
        return _sentencepiece(path)
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exceptions for any malformed file
        raise TokenizerError(f"tokenizer '{path}' is not a Hugging Face tokenizer.json ({err}).") from None
    eot = next((i for name in EOT_NAMES if (i := hf.token_to_id(name)) is not None), None)
    return Tokenizer(
        path,
        file_digest(path),
        hf.get_vocab_size(with_added_tokens=True),
        eot,
        lambda texts: [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=False)],
        lambda ids: hf.decode(list(ids), skip_special_tokens=False),
        lambda texts: [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=True)],
    )


def _sentencepiece(path: Path) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(
            f"tokenizer '{path}' is a sentencepiece model, and sentencepiece is not installed: "
            "pip install sentencepiece."
        ) from None
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as err:
        raise TokenizerError(f"tokenizer '{path}' is not a sentencepiece model ({err}).") from None
    eot = sp.eos_id() if sp.eos_id() >= 0 else None
    return Tokenizer(path, file_digest(path), sp.get_piece_size(), eot, lambda texts: sp.encode(list(texts)), sp.decode)


def train_bpe(files: Sequence[str | Path], vocab_size: int, out: str | Path) -> Tokenizer:
    """Train a byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes) of `vocab_size` tokens,
    `<|endoftext|>` among them, on the text `files`; save it as a tokenizer.json at `out` and load it back."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE holds the {len(alphabet)} bytes and "
            f"{EOT_TOKEN}, so it needs at least {len(alphabet) + 1}."
        )
    if vocab_size > MAX_BPE_VOCAB:
        raise TokenizerError(
            f"--vocab-size {vocab_size} is too large: the trainer reserves memory for every token up front, so "
            f"jaxtrain asks it for at most {MAX_BPE_VOCAB:,} (2**24; vocabularies in use hold up to 262,144)."
        )
    out = Path(out)
    if out.exists():
        raise TokenizerError(f"tokenizer '{out}' already exists: training never overwrites. Give a new --out path.")
    _check_corpus([Path(f) for f in files])
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT_TOKEN], initial_alphabet=alphabet, show_progress=False
    )
    hf.train([str(f) for f in files], trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp")  # renamed into place once whole: never a half-written tokenizer
    try:
        hf.save(str(temporary))
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return load_tokenizer(out)


def _check_corpus(files: Sequence[Path]) -> None:
    """The training files exist, are UTF-8 text (the trainer would stop at the first other byte, naming no file),
    and hold some text between them."""
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise TokenizerError(f"no text file at {', '.join(missing)}: give the text files to train the tokenizer on.")
    if not any([_holds_text(f) for f in files]):  # a list: every file is checked, not only up to one with text
        named = ", ".join(f"'{f}'" for f in files)
        raise TokenizerError(f"the files {named} hold no text to learn from: give text files with something in them.")


def _holds_text(path: Path) -> bool:
    """Whether the file at `path` holds anything but blanks; a file that is not UTF-8 is an error naming the first
    byte that is not. Read in blocks: a corpus file need not fit in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    found, offset, line = False, 0, 1
    with path.open("rb") as f:
        while True:
            block = f.read(READ_BLOCK)
            pending = decoder.getstate()[0]  # the start of a character cut by the last block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                data = pending + block
                raise TokenizerError(
                    f"'{path}' is not UTF-8 text: byte 0x{data[err.start]:02x} on line "
                    f"{line + data.count(b'\n', 0, err.start)} (offset {offset - len(pending) + err.start}). Convert "
                    "it to UTF-8 (e.g. iconv -f latin1 -t utf-8), or leave it out."
                ) from None
            if not block:
                return found
            found = found or bool(text.strip())
            offset, line = offset + len(block), line + block.count(b"\n")
