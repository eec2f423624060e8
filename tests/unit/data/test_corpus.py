import os
import sysconfig

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.data.corpus import BatchStream, load_corpus, split_corpus
from zerojax.errors import UserError


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(1, 8, 1), ("data", "fsdp", "tensor"))


def _stream(n: int = 4096, **kw) -> BatchStream:
    tokens = (np.arange(n) * 7 % 251).astype(np.uint8)  # distinct neighbours, so shifts are visible
    return BatchStream(tokens, **{"seq_len": 16, "global_batch": 8, "seed": 3, **kw})


def test_default_corpus_is_stdlib_bytes_in_sorted_order():
    tokens = load_corpus(None, max_bytes=200_000)
    assert tokens.dtype == np.uint8 and tokens.shape == (200_000,)
    first = open(os.path.join(sysconfig.get_paths()["stdlib"], "__future__.py"), "rb").read()
    assert tokens[: len(first)].tobytes() == first  # '__future__.py' sorts first among stdlib .py files
    assert b"def " in tokens.tobytes() and 0 not in tokens
    np.testing.assert_array_equal(tokens, load_corpus(None, max_bytes=200_000))


def test_file_and_folder_corpora(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"zzz")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01binary")
    assert load_corpus(str(tmp_path / "a.txt")).tobytes() == b"hello "
    assert load_corpus(str(tmp_path)).tobytes() == b"hello zzz"  # a.txt, b/z.txt; c.bin skipped
    assert load_corpus(str(tmp_path), max_bytes=8).tobytes() == b"hello zz"


def test_split_holds_out_the_tail():
    tokens = np.arange(200, dtype=np.uint8)
    train, held = split_corpus(tokens, 0.05)
    assert len(train) == 190 and len(held) == 10
    assert train[-1] == 189 and held[0] == 190


def test_offsets_follow_the_documented_rng():
    s = _stream()
    want = np.random.default_rng([3, 5]).integers(0, 4096 - 16 - 1, size=8)
    np.testing.assert_array_equal(s.offsets(5), want)
    b = s.host_batch(5)
    np.testing.assert_array_equal(b["inputs"][2], s.tokens[want[2] : want[2] + 16])


def test_batches_are_deterministic_and_shifted():
    a, b = _stream().host_batch(7), _stream().host_batch(7)
    assert a["inputs"].shape == (8, 16) and a["inputs"].dtype == np.int32
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], _stream().host_batch(8)["inputs"])
    assert not np.array_equal(a["inputs"], _stream(seed=4).host_batch(7)["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert not np.array_equal(a["inputs"], a["targets"])


def test_rows_is_a_slice_of_host_batch():
    s = _stream()
    full, part = s.host_batch(2), s.rows(2, 3, 6)
    for k in ("inputs", "targets"):
        np.testing.assert_array_equal(part[k], full[k][3:6])


def test_global_batch_matches_host_batch_shard_by_shard():
    s = _stream(global_batch=16)
    sharding = NamedSharding(_mesh(), P(("data", "fsdp")))
    host, glob = s.host_batch(11), s.global_batch(11, sharding)
    for k in ("inputs", "targets"):
        assert glob[k].shape == (16, 16) and glob[k].dtype == np.int32
        np.testing.assert_array_equal(np.asarray(glob[k]), host[k])
        shards = glob[k].addressable_shards
        assert len(shards) == 8
        for sh in shards:
            assert sh.data.shape == (2, 16)
            np.testing.assert_array_equal(np.asarray(sh.data), host[k][sh.index[0]])


def test_global_batch_replicated_and_sequence_sharded():
    s = _stream()
    mesh = _mesh()
    host = s.host_batch(1)
    rep = s.global_batch(1, NamedSharding(mesh, P()))["inputs"]
    np.testing.assert_array_equal(np.asarray(rep), host["inputs"])
    seq = s.global_batch(1, NamedSharding(mesh, P(None, "fsdp")))["targets"]
    assert seq.addressable_shards[0].data.shape == (8, 2)
    np.testing.assert_array_equal(np.asarray(seq), host["targets"])


def test_errors_name_data_path(tmp_path):
    with pytest.raises(UserError, match="data.path") as e:
        load_corpus(str(tmp_path / "missing.txt"))
    assert "missing.txt" in str(e.value) and "does not exist" in str(e.value)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UserError, match="data.path.*empty.txt"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="data.path"):
        load_corpus(str(tmp_path / "d"))
    with pytest.raises(UserError, match=r"data.path.*short.*needs at least 18"):
        BatchStream(np.zeros(17, np.uint8), seq_len=16, global_batch=2, seed=0, path="tiny.txt")
    BatchStream(np.zeros(18, np.uint8), seq_len=16, global_batch=2, seed=0)  # exactly enough


def test_utf16_and_utf32_text_with_a_bom_is_read_as_utf8(tmp_path):
    text = "def f():\n    return 'caf\u00e9'\n" * 4
    for encoding in ("utf-16", "utf-16-be", "utf-32"):
        path = tmp_path / f"{encoding}.txt"
        data = text.encode(encoding)
        if encoding == "utf-16-be":
            data = b"\xfe\xff" + data  # the big-endian codec writes no byte-order mark itself
        path.write_bytes(data)
        assert bytes(load_corpus(str(path))) == text.encode("utf-8"), encoding


def test_nul_bytes_without_a_bom_are_explained(tmp_path):
    path = tmp_path / "nobom.txt"
    path.write_bytes("plain text".encode("utf-16-le"))
    with pytest.raises(UserError, match="NUL bytes: binary, or UTF-16/32 text without a byte-order mark"):
        load_corpus(str(path))
