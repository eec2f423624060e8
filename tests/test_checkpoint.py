"""Checkpoints at the Trainer level: bit-exact restore at every stage, the reshard matrix (stages x
device counts, with padding that differs between them), the fp32 export round trip, damaged and
mismatched checkpoints."""

import functools
import os
import shutil
from dataclasses import dataclass

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.cli_helpers import dir_digest
from tests.host_copies import logical_params
from tests.models import train_on_stream
from zerojax import Trainer, load_params, make_mesh
from zerojax.core.state import TrainState
from zerojax.data.corpus import BatchStream, load_corpus
from zerojax.errors import UserError
from zerojax.interop.params import export_params
from zerojax.models.gpt import GPT, gpt_config
from zerojax.train.checkpoint import CheckpointWriter, restore, run_metadata

# d_model 36 and d_ff 100 divide 4 but not 8: on 8 devices wq and w_down are stored padded, on 4
# and 1 device not, so restoring across device counts must crop and pad.
CFG = gpt_config("tiny", d_model=36, n_heads=6, d_ff=100, n_layers=1, seq_len=16, remat="none")
KEY = jax.random.key(0)
SAVE_AT, MORE = 2, 2  # save after 2 steps, then compare the next 2


def _tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))


def _trainer(stage: int, devices: int, model_cfg=CFG) -> Trainer:
    mesh = make_mesh(devices=jax.devices()[:devices])
    return Trainer(functools.partial(GPT, model_cfg), _tx(), mesh=mesh, stage=stage)


@dataclass
class Source:
    trainer: Trainer
    step_dir: str
    params: dict  # live master params at SAVE_AT, logical shapes
    losses: list  # the uninterrupted run's next MORE losses


@pytest.fixture(scope="module")
def stream():
    return BatchStream(load_corpus(None, 200_000), seq_len=CFG.seq_len, global_batch=8, seed=0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, stream) -> dict[int, Source]:
    """Per stage, on 8 devices: train SAVE_AT steps, save asynchronously, keep training MORE steps."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for stage in range(4):
        trainer = _trainer(stage, 8)
        state = trainer.init(KEY, stream.host_batch(0))
        state, _ = train_on_stream(trainer, state, stream, range(SAVE_AT))
        params = logical_params(trainer, state)
        writer = CheckpointWriter(str(root / f"stage{stage}"), keep=1, run_meta=run_metadata(trainer, seed=0))
        writer.save(SAVE_AT, state)  # the next step donates `state` while the files are still written
        _, losses = train_on_stream(trainer, state, stream, range(SAVE_AT, SAVE_AT + MORE))
        writer.close()
        out[stage] = Source(trainer, str(root / f"stage{stage}" / str(SAVE_AT)), params, losses)
    return out


def test_restore_is_bit_exact_at_every_stage(sources, stream):
    for stage, src in sources.items():
        state, meta = restore(src.trainer, src.step_dir, KEY, stream.host_batch(SAVE_AT))
        assert int(state.step) == SAVE_AT and meta["data"] == {"position": SAVE_AT, "seed": 0}
        assert "compute" not in meta["leaves"] and meta["stage"] == stage
        for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(src.trainer.state_shardings)):
            assert x.sharding == want, stage
        _, losses = train_on_stream(src.trainer, state, stream, range(SAVE_AT, SAVE_AT + MORE))
        assert losses == src.losses, stage  # the same program on the same bits


def _pick(targets: dict, saved_stage: int):
    return next(t for s, t in targets.items() if s != saved_stage)


def test_reshard_matrix_across_stages_and_device_counts(sources, stream):
    """Each stage's 8-device checkpoint continues at another stage on 8, 4 and 1 devices."""
    four = {1: _trainer(1, 4), 3: _trainer(3, 4)}
    one = {0: _trainer(0, 1), 2: _trainer(2, 1)}
    for saved, src in sources.items():
        eight = {s: sources[s].trainer for s in ((saved + 1) % 4,)}
        for target in (_pick(eight, saved), _pick(four, saved), _pick(one, saved)):
            state, _ = restore(target, src.step_dir, KEY, stream.host_batch(SAVE_AT))
            got = logical_params(target, state)
            jax.tree.map(np.testing.assert_array_equal, got, src.params)  # resharding is lossless
            _, losses = train_on_stream(target, state, stream, range(SAVE_AT, SAVE_AT + MORE))
            rel = np.abs(np.array(losses) / np.array(src.losses) - 1)
            where = f"stage {saved} x8 -> stage {target.stage.index} x{target.mesh.devices.size}"
            assert rel.max() < 1e-4, (where, losses, src.losses)
    # The matrix did cross padded and unpadded storage (w_down: 100 rows padded to 104 on 8 devices).
    assert sources[3].trainer.layout.shapes(True)["blocks"]["w_down"] == (1, 104, 36)
    assert four[3].layout.shapes(True)["blocks"]["w_down"] == (1, 100, 36)


def test_restore_and_load_params_accept_relative_paths(sources, stream, tmp_path, monkeypatch):
    src = sources[3]
    monkeypatch.chdir(os.path.dirname(os.path.dirname(src.step_dir)))  # the folder holding stage3/
    relative = os.path.relpath(src.step_dir)
    assert not os.path.isabs(relative)
    state, meta = restore(src.trainer, relative, KEY, stream.host_batch(SAVE_AT))
    assert meta["step"] == SAVE_AT
    jax.tree.map(np.testing.assert_array_equal, logical_params(src.trainer, state), src.params)
    export_params(os.path.dirname(relative), str(tmp_path / "params.npz"))
    monkeypatch.chdir(tmp_path)
    loaded = load_params("params.npz")
    jax.tree.map(np.testing.assert_array_equal, loaded, src.params)


def test_export_round_trip_equals_live_master_params(sources, tmp_path):
    src = sources[3]  # padded on 8 devices: export must crop
    info = export_params(os.path.dirname(src.step_dir), str(tmp_path / "params.npz"))
    assert info["step"] == SAVE_AT and not os.path.exists(tmp_path / "params.npz.partial")
    loaded = load_params(str(tmp_path / "params.npz"))
    assert jax.tree.structure(loaded) == jax.tree.structure(src.params)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(src.params)):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    with np.load(tmp_path / "params.npz") as npz:
        assert "blocks/w_down" in npz.files and npz["blocks/w_down"].shape == (1, 100, 36)

    model = load_params(str(tmp_path / "params.npz"), GPT(CFG, nnx.Rngs(7)))  # for inference
    np.testing.assert_array_equal(model.blocks.w_down[...], src.params["blocks"]["w_down"])
    with pytest.raises(UserError, match="does not fit this model"):
        load_params(str(tmp_path / "params.npz"), GPT(gpt_config("tiny", n_layers=1), nnx.Rngs(0)))

    tuner = _trainer(1, 4)  # fine-tuning starts from the exported weights, sharded
    state = tuner.init(KEY, {"inputs": np.zeros((8, CFG.seq_len), np.int32)}, params=loaded)
    jax.tree.map(np.testing.assert_array_equal, logical_params(tuner, state), src.params)


def test_export_streams_leaf_by_leaf(tmp_path):
    """Host memory during export peaks near the largest leaf, not near the whole model."""
    import tracemalloc

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh()
    shapes = {f"w{i}": (4, 128, 512) for i in range(4)} | {"embed": (256, 128)}  # 4 x 1 MiB + 128 KiB
    params = {
        k: jax.device_put(jnp.full(v, i + 1.0), NamedSharding(mesh, P(None, "fsdp")))
        for i, (k, v) in enumerate(shapes.items())
    }
    meta = {"format": 1, "seed": 0, "params": {k: {"shape": list(v)} for k, v in shapes.items()}}
    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep=1, run_meta=meta)
    writer.save(1, TrainState(step=jnp.int32(1), params=params, opt_state=()))
    writer.close()
    export_params(str(tmp_path / "ckpt"), str(tmp_path / "warm.npz"))  # imports and caches first
    tracemalloc.start()
    try:
        export_params(str(tmp_path / "ckpt"), str(tmp_path / "p.npz"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    largest, total = 4 * 128 * 512 * 4, sum(4 * np.prod(v) for v in shapes.values())
    assert peak < 1.6 * largest < total / 2, (peak, largest, total)
    assert float(load_params(str(tmp_path / "p.npz"))["w3"][3, 127, 511]) == 4.0


def test_bad_checkpoints_raise_one_sentence_and_change_nothing(sources, stream, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.dirname(sources[0].step_dir), root)
    step_dir = str(root / str(SAVE_AT))
    before = dir_digest(root)

    other = _trainer(0, 8, gpt_config("tiny", d_model=32, n_heads=4, d_ff=64, n_layers=1, seq_len=16))
    with pytest.raises(
        UserError,
        match=r"from another model: parameter 'blocks/attn_norm' has shape \(1, 36\) "
        r"there but \(1, 32\) here",
    ):
        restore(other, step_dir, KEY, stream.host_batch(SAVE_AT))
    with pytest.raises(UserError, match="does not exist"):
        export_params(str(root / "missing"), str(tmp_path / "x.npz"))
    assert dir_digest(root) == before and not os.path.exists(tmp_path / "x.npz")

    # Truncated array data: tensorstore cannot read it. Every data file is cut, since which file holds
    # the params (all that export reads) depends on how the asynchronous writes were batched.
    data = root / str(SAVE_AT) / "state" / "ocdbt.process_0" / "d"
    for chunk in data.iterdir():
        chunk.write_bytes(chunk.read_bytes()[:100])
    before = dir_digest(root)
    with pytest.raises(UserError, match="corrupted or truncated"):
        restore(sources[0].trainer, step_dir, KEY, stream.host_batch(SAVE_AT))
    with pytest.raises(UserError, match="corrupted or truncated"):
        export_params(str(root), str(tmp_path / "x.npz"))
    assert dir_digest(root) == before
    assert not os.path.exists(tmp_path / "x.npz") and not os.path.exists(tmp_path / "x.npz.partial")


def _stored_chunks(step_dir: str) -> list[tuple[str, str, int, int]]:
    """(key, data file, offset, length) of every array chunk the checkpoint's own OCDBT index (the
    one restore reads) stores outside its tree nodes, newest version."""
    import tensorstore as ts

    state = os.path.join(step_dir, "state")
    base = ts.KvStore.open(f"file://{state}/").result()
    version = ts.ocdbt.dump(base).result()["versions"][-1]
    nodes, chunks = [version["root"]["location"]], []
    while nodes:
        node = ts.ocdbt.dump(base, nodes.pop()).result()
        for entry in node["entries"]:
            if "node" in entry:  # an interior node of a taller tree
                nodes.append(entry["node"]["location"])
            elif "indirect_value" in entry:
                # value:<dir>/:<file>:<offset>:<length>, relative to the state folder
                _, where, file, offset, length = entry["indirect_value"].split(":")
                chunks.append((entry["key"].decode(), os.path.join(state, where, file), int(offset), int(length)))
    return chunks


def _damaged_copy(step_dir: str, root) -> str:
    shutil.copytree(os.path.dirname(step_dir), root)
    return str(root / str(SAVE_AT))


def test_every_stored_chunk_flipped_is_refused(sources, stream, tmp_path):
    """A bit flipped in the middle of any stored chunk: the chunk either fails to decode or restores
    to other values, which its leaf's checksum refuses. Never a silent restore."""
    chunks = _stored_chunks(sources[3].step_dir)
    per_leaf = {}
    for key, file, offset, length in chunks:  # the largest chunk of each leaf keeps the test short
        leaf = key.rsplit("/", 1)[0]
        if length > per_leaf.get(leaf, (None, None, 0, 0))[3]:
            per_leaf[leaf] = (key, file, offset, length)
    assert len(per_leaf) >= 10, per_leaf
    for i, (_key, file, offset, length) in enumerate(sorted(per_leaf.values())):
        step_dir = _damaged_copy(sources[3].step_dir, tmp_path / f"c{i}")
        file = file.replace(os.path.dirname(sources[3].step_dir), os.path.dirname(step_dir))
        raw = bytearray(open(file, "rb").read())
        raw[offset + length // 2] ^= 0x10
        open(file, "wb").write(bytes(raw))
        with pytest.raises(UserError, match="does not match its checksum|cannot be read"):
            restore(sources[3].trainer, step_dir, KEY, stream.host_batch(SAVE_AT))


def test_any_changed_value_of_any_leaf_is_caught_by_its_checksum(sources, stream, tmp_path):
    """One element of one leaf rewritten through the checkpoint's own arrays (so it decodes fine):
    the checksum, and nothing else, must catch it, for every saved leaf."""
    import tensorstore as ts

    leaves = sorted({key.rsplit("/", 1)[0] for key, *_ in _stored_chunks(sources[3].step_dir)})
    assert len(leaves) >= 10, leaves
    for i, leaf in enumerate(leaves):
        step_dir = _damaged_copy(sources[3].step_dir, tmp_path / f"v{i}")
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir}/state/", "path": f"{leaf}/"},
        }
        arr = ts.open(spec).result()
        first = (0,) * arr.ndim
        value = np.asarray(arr[first].read().result())
        flipped = (value.view(np.uint32) ^ np.uint32(1 << 20)).view(value.dtype)  # one bit of the 32
        arr[first].write(flipped).result()
        named = leaf.replace(".", "/")  # the index's key 'opt_state.1.0.mu' is the leaf 'opt_state/1/0/mu'
        with pytest.raises(UserError, match=f"'{named}' does not match its checksum"):
            restore(sources[3].trainer, step_dir, KEY, stream.host_batch(SAVE_AT))
