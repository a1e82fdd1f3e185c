"""Tokenized shards: `jaxtrain tokenize` turns text into token-id shards with document boundaries and a manifest.

A tokenized directory holds:

    manifest.json            format, the tokenizer's SHA-256 and vocabulary, dtype, and per split its shards and counts
    tokenizer.json           a copy of the tokenizer (or tokenizer.model): the directory says how to read it back
    train-00003.tokens.npy   chunk 3's training documents, each followed by the end-of-text token, as uint16/uint32
    train-00003.docs.npy     where each document starts and ends: int64 offsets, documents + 1 of them
    val-00003.*              chunk 3's held-out documents

The inputs are cut into chunks (text files, together up to `chunk_bytes`; a JSON-lines file's lines in ranges of
`chunk_bytes`; a Parquet row group), tokenized by worker processes; each chunk's shards are written under temporary
names and renamed, then its `.done` record, so a run that is interrupted resumes where it stopped when rerun. Which
documents are held out is decided per chunk by a fixed seed: a rerun makes the same split.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import multiprocessing
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_file
from jaxtrain.errors import UserInputError

FORMAT = 1
MANIFEST, PLAN = "manifest.json", "plan.json"
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DOCUMENTS = ("file", "paragraphs")  # what a document is in a text file: the whole file, or each blank-line paragraph
SPLIT_SEED = 19  # seeds which documents are held out, per chunk: fixed, so a rerun splits the same way
ENCODE_BATCH = 256  # documents per call into the tokenizer


class ShardError(UserInputError):
    """Tokenized shards, or their inputs, that are missing, malformed or inconsistent."""


def shard_dtype(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every token id: uint16 up to 65,536 tokens, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files `inputs` name: files as given, folders searched (sorted) for text, JSON-lines and Parquet files."""
    known = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file() and p.suffix in known)
            if not found:
                raise ShardError(f"folder '{given}' holds no {', '.join(known)} files to tokenize.")
            files += found
        elif given.is_file():
            files.append(given)
        else:
            raise ShardError(f"input '{given}' does not exist: give text, JSON-lines or Parquet files, or folders.")
    return files


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
        table = _parquet(path)
        if "text" not in table.schema_arrow.names:
            raise ShardError(f"'{path}' has no 'text' column (it has: {', '.join(table.schema_arrow.names)}).")
        return [t for t in table.read_row_group(chunk["group"], columns=["text"]).column("text").to_pylist() if t]
    raise ValueError(f"not a chunk: {chunk}")


def text_documents(path: Path, documents: str) -> list[str]:
    """A text file's documents: the file, or its blank-line paragraphs."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ShardError(f"'{path}' is not UTF-8 text (byte {err.start}): tokenize text files only.") from None
    parts = [text] if documents == "file" else re.split(r"\n\s*\n", text)
    return [p for p in parts if p.strip()]


def _jsonl_texts(path: Path, start: int, stop: int) -> Iterator[str]:
    """The `text` of each JSON line that starts in bytes [start, stop) of `path`."""
    with path.open("rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the line that began before `start` belongs to the chunk before
        while f.tell() < stop and (line := f.readline()):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise ShardError(
                    f"'{path}' near byte {f.tell() - len(line)}: expected a JSON object with a 'text' field a line, "
                    f"got {line[:80]!r}."
                ) from None
            if text:
                yield text


def _shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def tokenize_chunk(index: int, chunk: dict, tokenizer_path: str, out: str, documents: str, val_fraction: float) -> dict:
    """Tokenize chunk `index` into its train and val shards in `out`; returns (and records in `out` as its `.done`
    file) the counts of each split. Runs in a worker process."""
    tokenizer = _worker_tokenizer(tokenizer_path)
    texts = chunk_documents(chunk, documents)
    held_out = np.random.default_rng((SPLIT_SEED, index)).random(len(texts)) < val_fraction
    record = {}
    for split, mine in (("train", ~held_out), ("val", held_out)):
        shard = _write_shard(
            Path(out), _shard_name(split, index), [t for t, keep in zip(texts, mine) if keep], tokenizer
        )
        if shard:
            record[split] = shard
    _write_json(Path(out) / f"{_shard_name('chunk', index)}.done", record)
    return record


@functools.cache  # loaded once per worker process
def _worker_tokenizer(path: str) -> Tokenizer:
    return load_tokenizer(path)


def _write_shard(out: Path, name: str, texts: list[str], tokenizer: Tokenizer) -> dict | None:
    """Write the token ids of `texts` and their document offsets as shard `name`; its counts, or None (and nothing
    written) if no document has a token."""
    batches = (tokenizer.encode_batch(texts[i : i + ENCODE_BATCH]) for i in range(0, len(texts), ENCODE_BATCH))
    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    ids = [doc for batch in batches for doc in batch if doc or eot]  # a document of no tokens is no document
    if not ids:
        return None
    dtype = shard_dtype(tokenizer.vocab_size)
    tokens = np.concatenate([np.array(doc + eot, dtype=dtype) for doc in ids])
    offsets = np.concatenate([[0], np.cumsum([len(doc) + len(eot) for doc in ids])]).astype(np.int64)
    for suffix, array in (("tokens", tokens), ("docs", offsets)):
        temporary = out / f".{name}.{suffix}.tmp.npy"
        np.save(temporary, array)
        os.replace(temporary, out / f"{name}.{suffix}.npy")
    size = (out / f"{name}.tokens.npy").stat().st_size
    return {
        "name": name,
        "tokens": int(offsets[-1]),
        "documents": len(ids),
        "bytes": size,
        "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
    }


def _write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=1), encoding="utf-8")
    os.replace(temporary, path)


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
) -> dict:
    """Tokenize `inputs` (text files, folders, JSON-lines or Parquet with a `text` field) with the tokenizer at
    `tokenizer` into shards in `out`, holding out about `val_fraction` of the documents for validation; returns the
    manifest. Rerun after an interruption with the same arguments, it finishes what is left."""
    # One core per worker: the tokenizer's own threads would compete with the other workers for the same cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    source = tokenizer_file(tokenizer)
    tok = load_tokenizer(source)
    out = Path(out)
    chunks = plan_chunks(input_files(inputs), chunk_bytes)
    plan = {
        "format": FORMAT,
        "tokenizer_sha256": tok.digest,
        "documents": documents,
        "val_fraction": val_fraction,
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
    }
    _start(out, plan, source)
    done = {
        i: json.loads(p.read_text())
        for i in range(len(chunks))
        if (p := out / f"{_shard_name('chunk', i)}.done").is_file()
    }
    todo = [i for i in range(len(chunks)) if i not in done]
    args = (str(out / f"tokenizer{source.suffix}"), str(out), documents, val_fraction)
    with tqdm(total=len(chunks), initial=len(done), unit="chunk", disable=not progress, desc="tokenize") as bar:
        for index, record in _run(todo, chunks, args, workers):
            done[index] = record
            bar.update()
    manifest = _manifest(plan, tok, [done[i] for i in range(len(chunks))], out)
    _write_json(out / MANIFEST, manifest)
    return manifest


def _start(out: Path, plan: dict, source: Path) -> None:
    """Create `out` with the plan and the tokenizer's copy, or check that the run there is this one (to resume)."""
    if (out / PLAN).is_file():
        before = json.loads((out / PLAN).read_text())
        if before != plan:
            changed = sorted(k for k in plan if before.get(k) != plan[k])
            raise ShardError(
                f"'{out}' holds a tokenization with other settings ({', '.join(changed)} differ): to resume it, give "
                f"the same tokenizer, inputs and options; else choose a new --out directory, or delete '{out}'."
            )
        return
    if out.exists() and any(out.iterdir()):
        raise ShardError(f"--out '{out}' exists and is not a tokenization in progress: choose a new directory.")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, out / f"tokenizer{source.suffix}")
    _write_json(out / PLAN, plan)


def _run(todo: list[int], chunks: list[dict], args: tuple, workers: int) -> Iterator[tuple[int, dict]]:
    """Tokenize the chunks `todo`, in this process or `workers` worker processes; yields each as it finishes."""
    if workers <= 1:
        for i in todo:
            yield i, tokenize_chunk(i, chunks[i], *args)
        return
    # Spawned, not forked: a forked child of a process that runs threads (JAX's, the tokenizer's) may deadlock.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {pool.submit(tokenize_chunk, i, chunks[i], *args): i for i in todo}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()


def _manifest(plan: dict, tok: Tokenizer, records: list[dict], out: Path) -> dict:
    splits = {}
    for split in ("train", "val"):
        shards = [r[split] for r in records if split in r]
        if not shards:
            raise ShardError(
                f"the {split} split of '{out}' is empty: {sum(len(r) for r in records)} shards in all. Tokenize more "
                "documents (for one big text file: --documents paragraphs), or change --val-fraction."
            )
        totals = {k: sum(s[k] for s in shards) for k in ("tokens", "documents", "text_bytes")}
        splits[split] = {**totals, "shards": shards}
    return {
        "format": FORMAT,
        "tokenizer": {
            "file": f"tokenizer{Path(tok.path).suffix}",
            "sha256": tok.digest,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
        },
        "dtype": shard_dtype(tok.vocab_size),
        "splits": splits,
    }
