"""Tokenized shards: `jaxtrain tokenize` turns text into token-id shards with document boundaries and a manifest.

A tokenized directory holds:

    manifest.json            format, the tokenizer's SHA-256 and vocabulary, dtype, and per split its shards, their
                             counts and each file's CRC-32 (checked when the shard is opened for training)
    tokenizer.json           a copy of the tokenizer (or tokenizer.model): the directory says how to read it back
    train-00003.tokens.npy   chunk 3's training documents, each followed by the end-of-text token, as uint16/uint32
    train-00003.docs.npy     where each document starts and ends: int64 offsets, documents + 1 of them
    train-00003.weights.npy  chat data only (`chat`): each token's loss weight as a target, uint8 0/1
    val-00003.*              chunk 3's held-out documents
    chat_template.jinja      chat data only: the template its conversations were rendered with

The inputs are cut into chunks (text files, together up to `chunk_bytes`; a JSON-lines file's lines in ranges of
`chunk_bytes`; a Parquet row group), tokenized by worker processes; each chunk's shards are written under temporary
names and renamed, then its `.done` record, so a run that is interrupted resumes where it stopped when rerun. The
plan (`plan.json`, with each input's size and modification time) is written first: a rerun whose settings or inputs
differ is refused. Which documents are held out is decided per chunk by a fixed seed: a rerun makes the same split.

With `chat` (`jaxtrain tokenize --chat`), the inputs are JSON lines of conversations (`jaxtrain.data.chat`): a
document is a conversation rendered with its chat template, without an end-of-text token after it (the template
closes each turn), and its weights say which tokens the loss counts (the assistant's). Such a directory is format 2,
which a jaxtrain that would read its tokens and ignore its weights refuses.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxtrain.data.chat import ChatOptions, read_conversations
from jaxtrain.data.jsonl import line_number, lines
from jaxtrain.data.tokenizer import Tokenizer, file_digest, load_tokenizer, tokenizer_file
from jaxtrain.errors import UserInputError
from jaxtrain.files import read_bytes, utf8_text

FORMAT, CHAT_FORMAT = 1, 2  # text shards; chat shards, which add each token's loss weight
FORMATS = (FORMAT, CHAT_FORMAT)  # what this jaxtrain reads
CHAT_TEMPLATE = "chat_template.jinja"  # the template a chat directory was rendered with, kept beside its shards
MANIFEST, PLAN = "manifest.json", "plan.json"
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DOCUMENTS = ("file", "paragraphs")  # what a document is in a text file: the whole file, or each blank-line paragraph
SPLIT_SEED = 19  # seeds which documents are held out, per chunk: fixed, so a rerun splits the same way
ENCODE_BATCH = 256  # documents per call into the tokenizer
CHECKSUM_BLOCK = 2**22  # bytes read at a time to checksum a shard file
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it dies


class ShardError(UserInputError):
    """Tokenized shards, or their inputs, that are missing, malformed or inconsistent."""


def shard_dtype(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every token id: uint16 up to 65,536 tokens, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def input_files(inputs: Sequence[str | Path], chat: bool = False) -> list[Path]:
    """The files `inputs` name: files as given, folders searched (sorted) for text, JSON-lines and Parquet files
    (JSON-lines files only for chat data, where a file given must be one)."""
    known = JSONL_SUFFIXES if chat else TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file() and p.suffix in known)
            if not found:
                raise ShardError(f"folder '{given}' holds no {', '.join(known)} files to tokenize.")
            files += found
        elif given.is_file():
            if chat and given.suffix not in JSONL_SUFFIXES:
                raise ShardError(
                    f"input '{given}' is not a JSON-lines file ({', '.join(JSONL_SUFFIXES)}): chat data is a "
                    'conversation a line, {"messages": [...]} or {"prompt": ..., "completion": ...}.'
                )
            files.append(given)
        else:
            raise ShardError(f"input '{given}' does not exist: give text, JSON-lines or Parquet files, or folders.")
    _refuse_repeats(files)
    return files


def _refuse_repeats(files: Sequence[Path]) -> None:
    """A file named twice (given twice, or given and inside a folder given, or through a link) would be tokenized
    twice, with its documents held out in one copy and trained on in the other: refused, naming it."""
    seen: dict[tuple[int, int], Path] = {}
    for path in files:
        stat = path.stat()
        if (first := seen.setdefault((stat.st_dev, stat.st_ino), path)) is not path:
            raise ShardError(
                f"input '{path}' is given more than once (also as '{first}'): its documents would be both trained on "
                "and held out. Name each file once."
            )


def describe_inputs(files: Sequence[Path]) -> list[dict]:
    """Each input's path, size and modification time, as the plan records them: a resume checks that none changed
    (reading them all again to hash them would double the work of a big corpus)."""
    return [{"path": str(p), "bytes": (st := p.stat()).st_size, "mtime_ns": st.st_mtime_ns} for p in files]


def plan_chunks(files: Sequence[Path], chunk_bytes: int) -> list[dict]:
    """The units of work: consecutive text files up to `chunk_bytes` together (a bigger one alone), a JSON-lines
    file in byte ranges of `chunk_bytes` (cut at lines), a Parquet row group."""
    chunks, texts, text_bytes = [], [], 0
    for path in files:
        size = path.stat().st_size
        if path.suffix in JSONL_SUFFIXES:
            chunks += [{"path": str(path), "start": s, "stop": s + chunk_bytes} for s in range(0, size, chunk_bytes)]
        elif path.suffix in PARQUET_SUFFIXES:
            chunks += [{"path": str(path), "group": g} for g in range(_parquet(path).num_row_groups)]
        else:
            if texts and text_bytes + size > chunk_bytes:
                chunks.append({"texts": texts})
                texts, text_bytes = [], 0
            texts.append(str(path))
            text_bytes += size
    return chunks + ([{"texts": texts}] if texts else [])


def _parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ShardError(f"reading '{path}' needs pyarrow: pip install 'jaxtrain[parquet]'.") from None

    try:
        return pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a file it cannot read
        raise ShardError(f"'{path}' is not a readable Parquet file ({err}).") from None


def chunk_documents(chunk: dict, documents: str) -> list[str]:
    """The documents of one chunk: texts, in order."""
    if "texts" in chunk:
        return [doc for path in chunk["texts"] for doc in text_documents(Path(path), documents)]
    path = Path(chunk["path"])
    if "start" in chunk:
        return list(_jsonl_texts(path, chunk["start"], chunk["stop"]))
    if "group" in chunk:
        return _parquet_texts(path, chunk["group"])
    raise ValueError(f"not a chunk: {chunk}")


def _parquet_texts(path: Path, group: int) -> list[str]:
    """The `text` of each row of row group `group` of Parquet file `path`: a column of strings, none null."""
    import pyarrow as pa

    table = _parquet(path)
    if "text" not in table.schema_arrow.names:
        raise ShardError(f"'{path}' has no 'text' column (it has: {', '.join(table.schema_arrow.names)}).")
    kind = table.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ShardError(f"'{path}' column 'text' holds {kind}, not strings: tokenize a column of text.")
    texts = table.read_row_group(group, columns=["text"]).column("text").to_pylist()
    if None in texts:
        row = sum(table.metadata.row_group(g).num_rows for g in range(group)) + texts.index(None)
        raise ShardError(
            f"'{path}' row {row}: 'text' is null, not a string (rows count from 0). Drop or fill the rows without text."
        )
    return [t for t in texts if t]


def text_documents(path: Path, documents: str) -> list[str]:
    """A text file's documents: the file, or its blank-line paragraphs."""
    text = utf8_text(read_bytes(path, "text file", ShardError), path, "text file", ShardError)
    parts = [text] if documents == "file" else re.split(r"\n\s*\n", text)
    return [p for p in parts if p.strip()]


def _jsonl_texts(path: Path, start: int, stop: int) -> Iterator[str]:
    """The `text` of each JSON line that starts in bytes [start, stop) of `path`."""
    for offset, line in lines(path, start, stop):
        if text := _jsonl_text(path, offset, line):
            yield text


def _jsonl_text(path: Path, offset: int, line: bytes) -> str:
    """The `text` of JSON line `line`, which starts at byte `offset` of `path`: a string (an empty one is no
    document); anything else is an error naming the line."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        record = None
    if not isinstance(record, dict) or "text" not in record:
        raise ShardError(
            f"'{path}' line {line_number(path, offset)}: expected a JSON object with a 'text' field a line, got "
            f"{line[:80]!r}."
        )
    if not isinstance(text := record["text"], str):
        raise ShardError(
            f"'{path}' line {line_number(path, offset)}: 'text' is {json.dumps(text)[:40]}, not a string. Give each "
            "line its text, or drop the line."
        )
    return text


def _shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def tokenize_chunk(
    index: int,
    chunk: dict,
    tokenizer_path: str,
    out: str,
    documents: str,
    val_fraction: float,
    chat: ChatOptions | None = None,
) -> dict:
    """Tokenize chunk `index` into its train and val shards in `out`; returns (and records in `out` as its `.done`
    file) the counts of each split, and for chat data how many conversations were kept whole, cut and dropped. Runs
    in a worker process."""
    tokenizer = _worker_tokenizer(tokenizer_path)
    if chat is None:
        texts = chunk_documents(chunk, documents)
        ids, weights, sizes, record = _text_ids(texts, tokenizer), None, [len(t.encode("utf-8")) for t in texts], {}
    else:
        path, start, stop = Path(chunk["path"]), chunk["start"], chunk["stop"]
        chats, sizes, counts = read_conversations(path, start, stop, tokenizer.encode_batch, chat)
        ids = [np.zeros(0, np.int64) if c is None else c.ids for c in chats]  # a dropped one is no document
        weights = [np.zeros(0, np.uint8) if c is None else c.weights for c in chats]
        sizes = [0 if c is None else size for c, size in zip(chats, sizes)]
        record = {"chat": counts}
    # Drawn for every document read, dropped ones too: which are held out does not depend on --max-tokens.
    held_out = np.random.default_rng((SPLIT_SEED, index)).random(len(ids)) < val_fraction
    dtype = shard_dtype(tokenizer.vocab_size)
    for split, mine in (("train", ~held_out), ("val", held_out)):
        keep = np.flatnonzero(mine)
        shard = _write_shard(
            Path(out),
            _shard_name(split, index),
            [ids[k] for k in keep],
            None if weights is None else [weights[k] for k in keep],
            dtype,
            sum(sizes[k] for k in keep),
        )
        if shard:
            record[split] = shard
    _write_json(Path(out) / f"{_shard_name('chunk', index)}.done", record)
    return record


@functools.cache  # loaded once per worker process
def _worker_tokenizer(path: str) -> Tokenizer:
    return load_tokenizer(path)


def _text_ids(texts: list[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Each text's token ids followed by the end-of-text token, if the tokenizer has one."""
    batches = (tokenizer.encode_batch(texts[i : i + ENCODE_BATCH]) for i in range(0, len(texts), ENCODE_BATCH))
    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    return [np.array(doc + eot, dtype=np.int64) for batch in batches for doc in batch]


def _write_shard(
    out: Path, name: str, ids: list[np.ndarray], weights: list[np.ndarray] | None, dtype: str, text_bytes: int
) -> dict | None:
    """Write the documents `ids` (their loss `weights`, for chat data) and their offsets as shard `name`; its counts,
    or None (and nothing written) if no document has a token. `text_bytes`: the input they were read from."""
    kept = [k for k, doc in enumerate(ids) if len(doc)]  # a document of no tokens is no document
    if not kept:
        return None
    arrays = {
        "tokens": np.concatenate([ids[k] for k in kept]).astype(dtype),
        "docs": np.concatenate([[0], np.cumsum([len(ids[k]) for k in kept])]).astype(np.int64),
    }
    if weights is not None:
        arrays["weights"] = np.concatenate([weights[k] for k in kept]).astype(np.uint8)
    checksums = {}
    for suffix, array in arrays.items():
        temporary = out / f".{name}.{suffix}.tmp.npy"
        np.save(temporary, array)
        checksums[suffix] = file_crc32(temporary)
        os.replace(temporary, out / f"{name}.{suffix}.npy")
    counts = {"assistant_tokens": int(arrays["weights"].sum())} if weights is not None else {}
    return {
        "name": name,
        "tokens": int(arrays["docs"][-1]),
        "documents": len(kept),
        "bytes": (out / f"{name}.tokens.npy").stat().st_size,
        "text_bytes": text_bytes,
        **counts,
        "crc32": checksums,
    }


def file_crc32(path: Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits. A shard's checksum guards against corruption and mix-ups, not
    forgery, and CRC-32 is the fastest such check in the standard library (docs/data.md has the figures), so a
    loader can check every shard it opens."""
    crc = 0
    with Path(path).open("rb") as f:
        while block := f.read(CHECKSUM_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _temporary(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: beside it, hidden."""
    return path.with_name(f".{path.name}.tmp")


def _write_json(path: Path, value: dict) -> None:
    _write_text(path, json.dumps(value, indent=1))


def _write_text(path: Path, text: str) -> None:
    _temporary(path).write_text(text, encoding="utf-8")
    os.replace(_temporary(path), path)


def _holds(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text(encoding="utf-8") == text


def _checked_chat(chat: ChatOptions, tokenizer: Path) -> dict:
    """What the plan records of the chat options, once the template compiles and the tokenizer can read it."""
    if tokenizer.suffix == ".model":
        raise ShardError(
            f"chat data needs a Hugging Face tokenizer.json: sentencepiece ('{tokenizer}') reads the special tokens a "
            "chat template writes (<s>, [INST], ...) as plain text. Give the model directory's tokenizer.json."
        )
    chat.template.check()
    return chat.describe()


def _copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, _temporary(target))
    os.replace(_temporary(target), target)


def tokenize(
    tokenizer: str | Path,
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    val_fraction: float = 0.01,
    workers: int = 1,
    documents: str = "file",
    chunk_bytes: int = 4 * 2**20,
    progress: bool = True,
    chat: ChatOptions | None = None,
) -> dict:
    """Tokenize `inputs` (text files, folders, JSON-lines or Parquet with a `text` field) with the tokenizer at
    `tokenizer` into shards in `out`, holding out about `val_fraction` of the documents for validation; returns the
    manifest. Rerun after an interruption with the same arguments, it finishes what is left. With `chat`, the
    inputs are JSON lines of conversations, rendered and weighted as `jaxtrain.data.chat` says."""
    # One core per worker: the tokenizer's own threads would compete with the other workers for the same cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    source = tokenizer_file(tokenizer)
    tok = load_tokenizer(source)
    out = Path(out)
    files = input_files(inputs, chat=chat is not None)
    if not any(p.stat().st_size for p in files):
        named = ", ".join(f"'{p}'" for p in inputs)
        raise ShardError(f"the inputs {named} hold no text ({len(files)} empty files): give files with documents.")
    chunks = plan_chunks(files, chunk_bytes)
    plan = {
        "format": FORMAT if chat is None else CHAT_FORMAT,
        "tokenizer_sha256": tok.digest,
        "documents": documents,
        "val_fraction": val_fraction,
        "chunk_bytes": chunk_bytes,
        "inputs": describe_inputs(files),
        "chunks": chunks,
        **({} if chat is None else {"chat": _checked_chat(chat, source)}),
    }
    _start(out, plan, source)
    if chat is not None and not _holds(out / CHAT_TEMPLATE, chat.template.source):
        _write_text(out / CHAT_TEMPLATE, chat.template.source)
    done = {
        i: json.loads(p.read_text())
        for i in range(len(chunks))
        if (p := out / f"{_shard_name('chunk', i)}.done").is_file()
    }
    todo = [i for i in range(len(chunks)) if i not in done]
    args = (str(out / f"tokenizer{source.suffix}"), str(out), documents, val_fraction, chat)
    with tqdm(total=len(chunks), initial=len(done), unit="chunk", disable=not progress, desc="tokenize") as bar:
        for index, record in _run(todo, chunks, args, workers):
            done[index] = record
            bar.update()
    manifest = _manifest(plan, tok, [done[i] for i in range(len(chunks))], out)
    _write_json(out / MANIFEST, manifest)
    return manifest


def _start(out: Path, plan: dict, source: Path) -> None:
    """Create `out` with the plan, then the tokenizer's copy, or check that the run there is this one (to resume).
    Each is written under a temporary name and renamed, so a kill at any moment leaves a directory a rerun takes up:
    no plan yet (nothing else but the start's own files), or a plan and perhaps the copy."""
    if out.exists() and not out.is_dir():
        raise ShardError(
            f"--out '{out}' is a file: give the directory to write the shards into (a new one, or an interrupted "
            "tokenization's to finish it)."
        )
    if (out / PLAN).is_file():
        _check_resume(out, json.loads((out / PLAN).read_text()), plan)
    elif out.exists() and not {p.name for p in out.iterdir()} <= _start_files():
        raise ShardError(f"--out '{out}' exists and is not a tokenization in progress: choose a new directory.")
    else:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / PLAN, plan)
    copy = out / f"tokenizer{source.suffix}"
    if not copy.is_file() or file_digest(copy) != plan["tokenizer_sha256"]:
        _copy(source, copy)


def _start_files() -> set[str]:
    """What a start killed before its plan was written may have left (an older jaxtrain copied the tokenizer first)."""
    copies = {f"tokenizer{suffix}" for suffix in (".json", ".model")}
    return copies | {_temporary(Path(name)).name for name in (*copies, PLAN)}


def _check_resume(out: Path, before: dict, plan: dict) -> None:
    """Refuse to resume the tokenization in `out` (planned as `before`) with other settings or changed inputs."""
    recorded = {i["path"]: i for i in before.get("inputs", [])}
    for now in plan["inputs"]:
        if (then := recorded.get(now["path"], now)) != now:
            raise ShardError(
                f"input '{now['path']}' changed since the tokenization in '{out}' began ({then['bytes']:,} bytes then, "
                f"{now['bytes']:,} now, or modified since): its finished chunks hold the old text. Put the file back "
                "as it was, or tokenize into a new --out directory."
            )
    if before != plan:
        changed = sorted(k for k in plan if before.get(k) != plan[k])
        raise ShardError(
            f"'{out}' holds a tokenization with other settings ({', '.join(changed)} differ): to resume it, give "
            f"the same tokenizer, inputs and options; else choose a new --out directory, or delete '{out}'."
        )


def _run(todo: list[int], chunks: list[dict], args: tuple, workers: int) -> Iterator[tuple[int, dict]]:
    """Tokenize the chunks `todo`, in this process or `workers` worker processes; yields each as it finishes."""
    if workers <= 1:
        for i in todo:
            yield i, tokenize_chunk(i, chunks[i], *args)
        return
    # Spawned, not forked: a forked child of a process that runs threads (JAX's, the tokenizer's) may deadlock.
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_die_with_parent, initargs=(os.getpid(),)
    )
    try:
        futures = {pool.submit(tokenize_chunk, i, chunks[i], *args): i for i in todo}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    finally:  # after an error (bad input in one chunk, Ctrl-C), the chunks not begun are not begun
        pool.shutdown(cancel_futures=True)


def _die_with_parent(parent: int) -> None:
    """Make this worker die with the process that started it, even by kill -9: else it would go on writing the same
    temporary shard names as a rerun's workers. On Linux the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _manifest(plan: dict, tok: Tokenizer, records: list[dict], out: Path) -> dict:
    splits = {}
    counted = ("tokens", "documents", "text_bytes", *(("assistant_tokens",) if "chat" in plan else ()))
    for split in ("train", "val"):
        shards = [r[split] for r in records if split in r]
        if not shards:
            found = sum(part in r for r in records for part in ("train", "val"))
            raise ShardError(
                f"the {split} split of '{out}' is empty: {found} shards in all. Tokenize more documents (for one big "
                "text file: --documents paragraphs), or change --val-fraction"
                + (", or --max-tokens (long conversations were dropped)." if "chat" in plan else ".")
            )
        totals = {k: sum(s[k] for s in shards) for k in counted}
        splits[split] = {**totals, "shards": shards}
    chat = {}
    if "chat" in plan:  # how many conversations were read, kept whole, cut at a turn, dropped
        outcomes = {k: sum(r["chat"][k] for r in records) for k in ("whole", "cut", "dropped")}
        chat = {"chat": {**plan["chat"], "conversations": sum(outcomes.values()), **outcomes}}
    return {
        "format": plan["format"],
        "tokenizer": {
            "file": f"tokenizer{Path(tok.path).suffix}",
            "sha256": tok.digest,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
        },
        "dtype": shard_dtype(tok.vocab_size),
        **chat,
        "splits": splits,
    }
