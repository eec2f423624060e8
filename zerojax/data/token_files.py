"""Token files: what `zerojax tokenize DATA OUT` writes, and the checks that read it back.

OUT holds raw token shards (`tokens-00000.bin`, ...: uint16 when the vocabulary fits, else
uint32, read with `np.memmap`), the tokenizer (`tokenizer.json`, for a BPE) and `index.json`:

    {"format": 1, "vocab_size": 2048, "eod": 0, "dtype": "uint16", "documents": 120, "tokens": 81234,
     "tokenizer": {"kind": "bpe", "file": "tokenizer.json", "sha256": "...", "source": "..."},
     "shards": [{"file": "tokens-00000.bin", "tokens": 81234, "document_ends": [812, 1490, ...]}]}

Every text file under DATA is one document, followed by the end-of-document token; `document_ends`
are the offsets just past each document's end-of-document token. A document never spans shards.
OUT appears only when complete: everything is written to a sibling folder, then renamed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterator

import numpy as np

from zerojax.data.corpus import corpus_files, text_bytes
from zerojax.data.tokenizer import BPE, TextTokenizer, byte_tokenizer, load_tokenizer
from zerojax.errors import UserError

FORMAT = 1
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
SHARD_TOKENS = 2**28  # a new shard after this many tokens (at a document boundary)
_ENCODE_CHUNK = 64  # documents per encode_batch call


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def documents(data: str) -> Iterator[str]:
    """The text of every readable text file of DATA (a file or a folder), in a fixed order."""
    if not os.path.exists(data):
        raise UserError(f"{data!r} does not exist; give a text file or a folder of text files.")
    for path in corpus_files(data):
        try:
            # UTF-16/32 text grows at most 2x as UTF-8: the whole file fits this budget
            raw = text_bytes(path, 2 * os.path.getsize(path))
        except OSError:
            continue  # as for data.path: unreadable files are not part of the corpus
        if raw:
            yield raw.decode("utf-8", errors="replace")


def check_out(out: str) -> None:
    """OUT must be new or an empty folder: token files never mix with anything else."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"{out!r} already holds something; give a new or empty folder for the token files.")


class _ShardWriter:
    """Appends documents to shards of at most `limit` tokens (more only for one long document)."""

    def __init__(self, folder: str, dtype: np.dtype, limit: int):
        self.folder, self.dtype, self.limit = folder, dtype, limit
        self.shards: list[dict] = []
        self.file = None

    def add(self, ids: list[int]) -> None:
        current = self.shards[-1] if self.shards else None
        if current is None or (current["tokens"] and current["tokens"] + len(ids) > self.limit):
            self.close()
            current = {"file": f"tokens-{len(self.shards):05d}.bin", "tokens": 0, "document_ends": []}
            self.shards.append(current)
            self.file = open(os.path.join(self.folder, current["file"]), "wb")  # type: ignore[assignment]
        self.file.write(np.asarray(ids, dtype=self.dtype).tobytes())  # type: ignore[attr-defined]
        current["tokens"] += len(ids)
        current["document_ends"].append(current["tokens"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _write_shards(data: str, folder: str, tok: TextTokenizer, shard_tokens: int) -> list[dict]:
    writer = _ShardWriter(folder, token_dtype(tok.vocab_size), shard_tokens)
    texts = documents(data)
    try:
        while chunk := list(itertools.islice(texts, _ENCODE_CHUNK)):
            for ids in tok.encode_batch(chunk):
                writer.add([*ids, tok.eod])
    finally:
        writer.close()
    if not writer.shards:
        raise UserError(f"{data!r} holds no text files to tokenize (only empty, unreadable or binary ones).")
    return writer.shards


def _tokenizer_entry(folder: str, tok: TextTokenizer, source: str) -> dict:
    if tok.kind != BPE:
        return {"kind": tok.kind}
    path = os.path.join(folder, TOKENIZER)
    tok.save(path)
    return {"kind": BPE, "file": TOKENIZER, "sha256": sha256(path), "source": source}


def write_token_files(data: str, out: str, tok: TextTokenizer, *, source: str, shard_tokens: int = SHARD_TOKENS):
    """Tokenize DATA into OUT (see the module docstring); returns the index. `source` says where
    the tokenizer came from, for the index."""
    check_out(out)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = f"{out}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        shards = _write_shards(data, partial, tok, shard_tokens)
        index = {
            "format": FORMAT,
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
            "dtype": token_dtype(tok.vocab_size).name,
            "documents": sum(len(s["document_ends"]) for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "tokenizer": _tokenizer_entry(partial, tok, source),
            "shards": shards,
        }
        with open(os.path.join(partial, INDEX), "w") as f:
            json.dump(index, f)
        check_out(out)  # nothing appeared there meanwhile
        if os.path.isdir(out):
            os.rmdir(out)  # empty: replaced by the finished folder
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return index


# ---- reading back ---------------------------------------------------------------------------------


def _damaged(folder: str, what: str) -> UserError:
    return UserError(f"{os.path.join(folder, INDEX)!r} is damaged ({what}); run zerojax tokenize again.")


def load_index(folder: str) -> dict:
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise UserError(f"data.tokens={folder!r} is not a folder written by zerojax tokenize (it has no {INDEX}).")
    try:
        with open(path) as f:
            index = json.load(f)
        keys = ("vocab_size", "eod", "dtype", "tokenizer", "shards")
        if index.get("format") != FORMAT or not all(k in index for k in keys):
            raise _damaged(folder, f"not format {FORMAT} with {', '.join(keys)}")
    except (OSError, ValueError, AttributeError) as e:
        raise _damaged(folder, type(e).__name__) from None
    if index["dtype"] != token_dtype(index["vocab_size"]).name:
        raise _damaged(folder, f"dtype {index['dtype']} does not fit vocab_size {index['vocab_size']}")
    return index


def _check_shard(folder: str, index: dict, shard: dict) -> None:
    """The shard's size and its end-of-document tokens agree with the index."""
    path = os.path.join(folder, shard["file"])
    dtype = np.dtype(index["dtype"])
    size = os.path.getsize(path) if os.path.isfile(path) else None
    if size != shard["tokens"] * dtype.itemsize:
        found = "is missing" if size is None else f"holds {size} bytes"
        raise UserError(
            f"token shard {path!r} {found}, but {INDEX} records {shard['tokens']} {dtype.name} tokens "
            "(truncated, or from another tokenization); run zerojax tokenize again."
        )
    ends = np.asarray(shard["document_ends"], dtype=np.int64)
    if shard["tokens"] and not np.all(np.memmap(path, dtype=dtype, mode="r")[ends - 1] == index["eod"]):
        raise UserError(
            f"token shard {path!r} does not hold the end-of-document token {index['eod']} where {INDEX} "
            "records document ends: it was written with another vocabulary; run zerojax tokenize again."
        )


def index_tokenizer(folder: str, index: dict) -> TextTokenizer:
    """The tokenizer the token files were written with, checked against the index."""
    entry = index["tokenizer"]
    if entry.get("kind") != BPE:
        return byte_tokenizer()
    path = os.path.join(folder, entry.get("file", TOKENIZER))
    if not os.path.isfile(path) or sha256(path) != entry.get("sha256"):
        raise UserError(
            f"{path!r} is missing or not the tokenizer {INDEX} records (another vocabulary); "
            "run zerojax tokenize again."
        )
    tok = load_tokenizer(path)
    if (tok.vocab_size, tok.eod) != (index["vocab_size"], index["eod"]):
        raise _damaged(folder, "its vocab_size or eod differs from tokenizer.json")
    return tok


def read_index(folder: str) -> dict:
    """`index.json` of a token folder, after checking every shard against it (one UserError if not)."""
    folder = os.path.abspath(folder)
    index = load_index(folder)
    if not index["shards"]:
        raise _damaged(folder, "no shards")
    for shard in index["shards"]:
        _check_shard(folder, index, shard)
    if index["tokenizer"].get("kind") == BPE:
        index_tokenizer(folder, index)
    return index
