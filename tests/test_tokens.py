"""Tokenizers, token files and `zerojax sample`: BPE training, exact round trips, per-process rows
and exact resume of the token source, a tiny GPT run on token files then sampled, and bad input as
one line."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cli_helpers import LAUNCH_2X4, REPO, assert_one_line_error, cli_in_process, dir_digest, read_records, run_cli
from zerojax.cli.config import load_config
from zerojax.core.mesh import BATCH_AXES, make_mesh
from zerojax.data import sources
from zerojax.data.token_files import INDEX, documents, read_index, write_token_files
from zerojax.data.tokenizer import byte_tokenizer, load_tokenizer, train_bpe
from zerojax.data.tokens import TokenSource
from zerojax.errors import UserError
from zerojax.interop.sampling import run_tokenizer

TINY = os.path.join(REPO, "configs", "tiny.yaml")
WORDS = "the quick brown fox jumps over a lazy dog while tokens pack into windows of text".split()


def write_corpus(folder, docs: int = 8, words: int = 150, seed: int = 0) -> str:
    """`docs` text files (one in a sub-folder, one not ASCII) of random words."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    for i in range(docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words)) + ("\nnaïve café 日本\n" if i == 3 else "\n")
        with open(os.path.join(folder, "sub" if i % 3 == 0 else "", f"doc{i}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory) -> str:
    """Token files of a 300-token BPE trained on the corpus, in shards of about 400 tokens."""
    out = tmp_path_factory.mktemp("tok") / "bpe"
    done = cli_in_process("tokenize", corpus, str(out), "--train-vocab", "300", "--shard-tokens", "400")
    assert done.returncode == 0, done.stderr
    assert "tokenized 8 documents" in done.stderr
    return str(out)


def shard_documents(folder: str) -> list[np.ndarray]:
    """Every document's tokens (end-of-document token included), read back from the shards."""
    index = read_index(folder)
    out = []
    for shard in index["shards"]:
        tokens = np.fromfile(os.path.join(folder, shard["file"]), dtype=index["dtype"])
        out += np.split(tokens, shard["document_ends"][:-1])
    return out


# ---- tokenizers and token files ----------------------------------------------------------------------


def test_bpe_token_files_round_trip_every_document(bpe, corpus):
    index = read_index(bpe)
    assert index["vocab_size"] == 300 and index["dtype"] == "uint16" and index["eod"] == 0
    assert len(index["shards"]) > 1 and index["documents"] == 8
    assert sum(s["tokens"] for s in index["shards"]) == index["tokens"]
    tok = load_tokenizer(os.path.join(bpe, "tokenizer.json"))
    texts = list(documents(corpus))
    decoded = [tok.decode(ids) for ids in shard_documents(bpe)]
    assert decoded == texts and any("naïve café 日本" in text for text in texts)
    assert all(ids[-1] == tok.eod and tok.eod not in ids[:-1] for ids in shard_documents(bpe))
    assert index["tokens"] < sum(len(t.encode()) for t in texts) * 0.7  # merges learnt: fewer tokens than bytes


def test_byte_level_is_the_default_with_its_own_end_of_document_token(corpus, tmp_path):
    done = cli_in_process("tokenize", corpus, str(tmp_path / "bytes"))
    assert done.returncode == 0, done.stderr
    index = read_index(str(tmp_path / "bytes"))
    assert (index["vocab_size"], index["eod"], index["tokenizer"]) == (257, 256, {"kind": "bytes"})
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()
    texts = list(documents(corpus))
    assert [byte_tokenizer().decode(ids) for ids in shard_documents(str(tmp_path / "bytes"))] == texts
    assert index["tokens"] == sum(len(t.encode()) + 1 for t in texts)


def test_a_tokenizer_json_without_an_end_of_document_token_gets_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"fox": 0, "dog": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "words.json"))
    tok = load_tokenizer(str(tmp_path / "words.json"))
    assert (tok.vocab_size, tok.eod) == (4, 3)
    assert tok.encode("dog fox") == [1, 0]


def test_a_bpe_without_tokenizers_installed_is_one_sentence(monkeypatch, corpus, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    done = cli_in_process("tokenize", corpus, str(tmp_path / "out"), "--train-vocab", "300")
    assert_one_line_error(
        done, "BPE tokenizers need the Hugging Face `tokenizers` package; install it with pip install zerojax[text]."
    )
    assert not os.listdir(tmp_path)


# ---- the token source -----------------------------------------------------------------------------


def test_process_rows_are_disjoint_and_make_the_global_batch(bpe):
    source = TokenSource(bpe, seq_len=16, global_batch=8, seed=3)
    for step in (0, 5):
        whole = source.host_batch(step)
        parts = [source.rows(step, a, b) for a, b in ((0, 3), (3, 4), (4, 8))]
        np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])
        np.testing.assert_array_equal(whole["inputs"][:, 1:], whole["targets"][:, :-1])
        windows = [set(source.order.indices(step, a, b)) for a, b in ((0, 3), (3, 4), (4, 8))]
        assert sum(len(w) for w in windows) == len(set().union(*windows)) == 8  # disjoint
    sharding = NamedSharding(make_mesh(data=2), P(BATCH_AXES))
    batch = sources.global_batch(source, 5, sharding)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), source.host_batch(5)["inputs"])


def test_a_step_reads_the_same_rows_whether_or_not_earlier_steps_were_read(bpe):
    walked = TokenSource(bpe, seq_len=16, global_batch=8, seed=0)
    seen = [walked.host_batch(step)["inputs"] for step in range(6)]
    for step in (5, 2):
        fresh = TokenSource(bpe, seq_len=16, global_batch=8, seed=0)
        np.testing.assert_array_equal(fresh.rows(step, 2, 6)["inputs"], seen[step][2:6])
    assert not np.array_equal(seen[0], seen[1])
    other = TokenSource(bpe, seq_len=16, global_batch=8, seed=1).host_batch(0)["inputs"]
    assert not np.array_equal(other, seen[0])
    n = walked.order.size  # every window once per epoch
    steps = -(-n // 8)
    assert sorted(np.concatenate([walked.order.indices(s) for s in range(steps)])[:n]) == list(range(n))


# ---- bad input: one sentence, nothing written -------------------------------------------------------


def test_tokenize_refuses_bad_input_and_writes_nothing(corpus, tmp_path):
    (tmp_path / "bad.json").write_text('{"model": ')
    done = cli_in_process("tokenize", corpus, str(tmp_path / "a"), "--tokenizer", str(tmp_path / "bad.json"))
    assert_one_line_error(done, f"tokenizer file {str(tmp_path / 'bad.json')!r} cannot be read as a Hugging Face")
    done = cli_in_process("tokenize", corpus, str(tmp_path / "a"), "--train-vocab", "100")
    assert_one_line_error(done, "--train-vocab must be between 258 and 2**32, got 100.")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    done = cli_in_process("tokenize", corpus, str(tmp_path / "busy"))
    assert_one_line_error(done, f"{str(tmp_path / 'busy')!r} already holds something; give a new or empty folder")
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "busy"] and os.listdir(tmp_path / "busy") == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no text files to tokenize"):
        write_token_files(str(tmp_path / "empty"), str(tmp_path / "out"), byte_tokenizer(), source="bytes")
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "busy", "empty"]  # no partial folder left


def test_damaged_token_files_are_one_sentence(bpe, tmp_path):
    def damaged(edit) -> str:
        folder = tmp_path / f"copy{len(os.listdir(tmp_path))}"
        shutil.copytree(bpe, folder)
        edit(folder, read_index(str(folder)))
        with pytest.raises(UserError) as e:
            read_index(str(folder))
        return str(e.value)

    def truncate(folder, index):
        path = folder / index["shards"][1]["file"]
        path.write_bytes(path.read_bytes()[:-2])

    def roll(folder, index):  # same size, other tokens: the document ends no longer hold the end token
        path = folder / index["shards"][0]["file"]
        path.write_bytes(np.roll(np.fromfile(path, dtype=np.uint16), 1).tobytes())

    def retokenize(folder, index):
        train_bpe(["other words entirely " * 50], 290).save(str(folder / "tokenizer.json"))

    shard0, shard1 = (os.path.join(tmp_path, "copy{}", s["file"]) for s in read_index(bpe)["shards"][:2])
    tokens1 = read_index(bpe)["shards"][1]["tokens"]
    assert damaged(truncate) == (
        f"token shard {shard1.format(0)!r} holds {2 * tokens1 - 2} bytes, but {INDEX} records {tokens1} uint16 "
        "tokens (truncated, or from another tokenization); run zerojax tokenize again."
    )
    assert f"token shard {shard0.format(1)!r} does not hold the end-of-document token 0" in damaged(roll)
    assert "is missing or not the tokenizer index.json records (another vocabulary)" in damaged(retokenize)


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_one_sentence(bpe):
    with pytest.raises(UserError) as e:
        load_config(TINY, [f"data.tokens={bpe}", "model.vocab_size=256"])
    assert str(e.value) == (
        f"model.vocab_size=256 is smaller than the 300 tokens of the tokenizer of data.tokens={bpe!r}; "
        "leave it unset or make it at least 300."
    )
    with pytest.raises(UserError, match="data.tokens replaces data.path and data.target"):
        load_config(TINY, [f"data.tokens={bpe}", "data.path=/tmp"])
    with pytest.raises(UserError, match="is not a folder written by zerojax tokenize"):
        load_config(TINY, [f"data.tokens={os.path.dirname(bpe)}"])


# ---- a run on token files, then sampled -------------------------------------------------------------

# No eval split: one program less to compile.
RUN_SETS = ["model.n_layers=1", "model.seq_len=32", "train.steps=2", "train.batch_size=8", "checkpoint.every=2"]
RUN_SETS += ["data.eval_fraction=0"]


def test_train_on_token_files_then_sample(bpe, tmp_path):
    from tokenizers import Tokenizer, models

    out = tmp_path / "run"
    sets = [a for s in (f"data.tokens={bpe}", *RUN_SETS) for a in ("--set", s)]
    done = cli_in_process("train", TINY, *sets, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_records(out)] == [1, 2]
    with open(out / "checkpoints" / "2" / "meta" / "metadata") as f:
        assert json.load(f)["model"]["vocab_size"] == 300  # from the index
    first = cli_in_process("sample", str(out), "--prompt", "the quick", "--max-tokens", "6")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("the quick") and len(first.stdout.rstrip("\n")) > len("the quick")
    assert cli_in_process("sample", str(out), "--prompt", "the quick", "--max-tokens", "6").stdout == first.stdout
    drawn = cli_in_process("sample", str(out), "--prompt", "the", "--top-k", "50", "--max-tokens", "6")
    assert drawn.returncode == 0 and drawn.stdout.startswith("the")
    big = tmp_path / "big.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0")).save(str(big))
    before = dir_digest(out)
    done = cli_in_process("sample", str(out), "--prompt", "the", "--tokenizer", str(big))
    assert_one_line_error(
        done, "the tokenizer has 401 tokens, more than the model's embedding of 300; give the tokenizer the run"
    )
    assert dir_digest(out) == before


def test_sample_uses_the_runs_tokenizer_and_bytes_without_one(bpe, tmp_path):
    assert run_tokenizer({"config": {"data": {"tokens": None}}}).kind == "bytes"
    assert run_tokenizer({"config": {"data": {"tokens": bpe}}}).vocab_size == 300
    gone = str(tmp_path / "gone")
    with pytest.raises(UserError) as e:
        run_tokenizer({"config": {"data": {"tokens": gone}}})
    assert str(e.value) == f"the run's data.tokens folder {gone!r} is gone; pass its tokenizer.json with --tokenizer."


# ---- slow: a 2,048-token BPE, resumed bit-exactly; two processes ------------------------------------


@pytest.mark.slow
def test_a_run_on_a_2048_token_bpe_resumes_bit_exactly(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=40, words=1500)
    rng = random.Random(1)  # made-up words of 1-4 syllables: enough distinct ones for 2,048 merges
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    with open(os.path.join(corpus, "words.txt"), "w") as f:
        f.write(" ".join(rng.choice(words) for _ in range(60000)))
    tokens = tmp_path / "tokens"
    assert cli_in_process("tokenize", corpus, str(tokens), "--train-vocab", "2048").returncode == 0
    assert read_index(str(tokens))["vocab_size"] == 2048
    sets = [a for s in (f"data.tokens={tokens}", *RUN_SETS, "train.steps=4") for a in ("--set", s)]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli_in_process("train", TINY, *sets, "--out", str(whole)).returncode == 0
    shutil.copytree(whole / "checkpoints" / "2", resumed / "checkpoints" / "2")
    done = cli_in_process("train", TINY, *sets, "--out", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = read_records(resumed), read_records(whole)
    assert [r["step"] for r in got] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want[2:]]


PROBE = """
import json, sys
from zerojax.cli import distributed
distributed.initialize(distributed.resolve())
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from zerojax.data import sources
from zerojax.core.mesh import BATCH_AXES, make_mesh
from zerojax.data.tokens import TokenSource

source = TokenSource(sys.argv[1], seq_len=16, global_batch=8, seed=0)
read = []
rows = source.rows
source.rows = lambda step, start, stop: read.append((start, stop)) or rows(step, start, stop)
batch = sources.global_batch(source, 3, NamedSharding(make_mesh(data=2), P(BATCH_AXES)))
full = multihost_utils.process_allgather(batch["inputs"], tiled=True)
expected = TokenSource(sys.argv[1], seq_len=16, global_batch=8, seed=0).host_batch(3)["inputs"]
print("PROBE " + json.dumps({"process": jax.process_index(), "read": read,
                             "global": bool(np.array_equal(full, expected))}), flush=True)
"""


@pytest.mark.slow
def test_two_processes_read_disjoint_rows_of_token_files(bpe, tmp_path):
    import re

    (tmp_path / "probe.py").write_text(PROBE)
    done = run_cli(*LAUNCH_2X4, str(tmp_path / "probe.py"), bpe, env={"PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    probes = {p["process"]: p for p in (json.loads(m) for m in re.findall(r"^\[\d\] PROBE (.*)$", done.stdout, re.M))}
    assert probes[0]["read"] == [[0, 4]] and probes[1]["read"] == [[4, 8]]
    assert probes[0]["global"] and probes[1]["global"]
