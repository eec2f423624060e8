"""The shipped GPT as a Hugging Face Llama folder: `zerojax export --format safetensors`, `zerojax
import`, `train.init_from`; a numpy Llama forward (written from transformers' modeling_llama) on the
exported tensors gives the GPT's logits; every input that does not map is one sentence."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process, dir_digest
from tests.user_code import MLP
from zerojax.cli.config import load_config
from zerojax.cli.experiment import model_config
from zerojax.data.corpus import BatchStream, load_corpus
from zerojax.errors import UserError
from zerojax.models.gpt import GPT, gpt_config
from zerojax.train.checkpoint import CheckpointWriter, run_metadata
from zerojax.train.fit import FitOptions, begin

st = pytest.importorskip("safetensors.numpy", reason="the hf extra is not installed")

CFG = gpt_config("tiny", d_model=32, n_heads=4, n_layers=2, d_ff=48, seq_len=16, remat="none")
KEY = jax.random.key(0)
STD = {"embed": 1.0, "wq": 0.5, "wk": 0.5}  # sharp attention: a wrong rotary pairing shows in the logits


def _random_params(cfg) -> dict:
    """The GPT's params, random (norm weights too, so their mapping shows), by zerojax path."""
    rng = np.random.default_rng(0)
    shapes = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param)))
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    out = {}
    for path, shape in flat:
        name = path[-1].key
        if "norm" in name:
            value = 1 + 0.2 * rng.standard_normal(shape)
        else:
            value = STD.get(name, 0.3) * rng.standard_normal(shape)
        node = out
        for k in path[:-1]:
            node = node.setdefault(k.key, {})
        node[name] = value.astype(np.float32)
    return out


def _trainer(cfg=CFG, trainable=None):
    mesh = zj.make_mesh(devices=jax.devices()[:1])
    return zj.Trainer(lambda rngs: GPT(cfg, rngs), optax.sgd(0.1), mesh=mesh, stage=0, trainable=trainable)


def _stream():
    return BatchStream(load_corpus(None, 20_000), seq_len=CFG.seq_len, global_batch=2, seed=0)


def _save(trainer, state, root: str, model: dict) -> str:
    writer = CheckpointWriter(root, keep=1, run_meta=run_metadata(trainer, seed=0, model=model))
    writer.save(1, state)
    writer.close()
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A GPT checkpoint of random params, exported to a Llama folder and imported back."""
    root = tmp_path_factory.mktemp("hf")
    params = _random_params(CFG)
    trainer = _trainer()
    state = trainer.init(KEY, _stream().host_batch(0), params=params)
    ckpt = _save(trainer, state, str(root / "ckpt"), dataclasses.asdict(CFG))
    result = cli_in_process("export", ckpt, str(root / "llama"), "--format", "safetensors")
    assert result.returncode == 0, result.stderr
    result = cli_in_process("import", str(root / "llama"), str(root / "imported"))
    assert result.returncode == 0, result.stderr
    return {"root": root, "params": params, "ckpt": ckpt, "llama": str(root / "llama"), "imported": root / "imported"}


def _llama_names(n_layers: int) -> dict:
    """The Llama convention's tensors, [out, in] for each Linear, written out here on purpose."""
    d, f, v = CFG.d_model, CFG.d_ff, CFG.vocab_size
    want = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        want |= {p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"}
        want |= {p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d)}
        want |= {p + "mlp.down_proj.weight": (d, f)}
        want |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    return want


def test_export_writes_llama_names_shapes_and_config(run):
    assert sorted(os.listdir(run["llama"])) == ["config.json", "model.safetensors"]
    tensors = st.load_file(os.path.join(run["llama"], "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == _llama_names(CFG.n_layers)
    assert all(v.dtype == np.float32 for v in tensors.values())
    p = run["params"]
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.down_proj.weight"], p["blocks"]["w_down"][1].T)
    np.testing.assert_array_equal(tensors["model.layers.0.input_layernorm.weight"], p["blocks"]["attn_norm"][0])
    with open(os.path.join(run["llama"], "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_act"] == "silu"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (32, 48, 2)
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 4
    assert (config["vocab_size"], config["max_position_embeddings"], config["tie_word_embeddings"]) == (256, 16, False)
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-6, 10000.0)


def test_import_round_trips_the_params_bit_for_bit_and_its_config_builds_the_same_gpt(run):
    assert sorted(os.listdir(run["imported"])) == ["config.yaml", "params.npz"]
    jax.tree.map(np.testing.assert_array_equal, zj.load_params(str(run["imported"] / "params.npz")), run["params"])
    config = load_config(str(run["imported"] / "config.yaml"))
    assert model_config(config) == dataclasses.replace(CFG, remat=model_config(config).remat)
    assert config.train.init_from == str(run["imported"] / "params.npz")


def _rotate_half(x: np.ndarray) -> np.ndarray:
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def _rotate_interleaved(x: np.ndarray) -> np.ndarray:  # the other convention, (2i, 2i+1) pairs
    return np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)


def llama_logits(t: dict, c: dict, tokens: np.ndarray, rotate=_rotate_half) -> np.ndarray:
    """LlamaForCausalLM's forward in float64 numpy: embed, RMSNorm, RoPE, causal attention, SwiGLU."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    (B, L), H = tokens.shape, c["num_attention_heads"]
    K = c["hidden_size"] // H
    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, K, 2) / K)
    freqs = np.arange(L)[:, None] * inv_freq[None, :]
    if rotate is _rotate_half:
        freqs = np.concatenate([freqs, freqs], axis=-1)
    else:
        freqs = np.repeat(freqs, 2, axis=-1)
    cos, sin = np.cos(freqs), np.sin(freqs)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c["rms_norm_eps"]) * w

    x = t["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in t.items() if k.startswith(f"model.layers.{i}.")}
        h = norm(x, w["input_layernorm.weight"])
        q, k, v = ((h @ w[f"self_attn.{n}_proj.weight"].T).reshape(B, L, H, K).transpose(0, 2, 1, 3) for n in "qkv")
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        s = np.where(np.tril(np.ones((L, L), bool)), q @ k.transpose(0, 1, 3, 2) / np.sqrt(K), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        o = (a / a.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(B, L, H * K)
        x = x + o @ w["self_attn.o_proj.weight"].T
        h = norm(x, w["post_attention_layernorm.weight"])
        gate = h @ w["mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def _gpt_logits(run, tokens: np.ndarray) -> np.ndarray:
    model = zj.load_params(str(run["imported"] / "params.npz"), GPT(CFG, nnx.Rngs(1)))
    return np.asarray(model(tokens))


def _llama_folder(path: str) -> tuple[dict, dict]:
    with open(os.path.join(path, "config.json")) as f:
        return st.load_file(os.path.join(path, "model.safetensors")), json.load(f)


def test_a_numpy_llama_on_the_exported_tensors_gives_the_gpts_logits(run):
    tokens = np.random.default_rng(1).integers(0, 256, (2, CFG.seq_len)).astype(np.int32)
    tensors, config = _llama_folder(run["llama"])
    want = _gpt_logits(run, tokens)
    np.testing.assert_allclose(llama_logits(tensors, config, tokens), want, atol=1e-4, rtol=0)
    # The check can fail: the interleaved rotary convention gives other logits on these weights.
    assert np.abs(llama_logits(tensors, config, tokens, _rotate_interleaved) - want).max() > 1e-2


@pytest.mark.slow
def test_transformers_llama_reads_the_export_and_gives_the_gpts_logits(run):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = transformers.LlamaForCausalLM.from_pretrained(run["llama"], torch_dtype=torch.float32).eval()
    tokens = np.random.default_rng(2).integers(0, 256, (2, CFG.seq_len)).astype(np.int32)
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, _gpt_logits(run, tokens), atol=1e-4, rtol=0)


def test_a_run_with_init_from_starts_from_the_imported_params(run, tmp_path):
    trainer = _trainer()
    options = FitOptions(steps=1, init_from=str(run["imported"] / "params.npz"))
    start = begin(trainer, _stream(), str(tmp_path), options)
    assert start.step == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.state.params), run["params"])

    other = _trainer(dataclasses.replace(CFG, n_layers=1))
    with pytest.raises(UserError, match=r"train.init_from .* does not fit the configured model: parameter 'blocks/"):
        begin(other, _stream(), str(tmp_path), options)


# ---- input that does not map: one sentence, exit 2, nothing written ------------------------------


def _changed_copy(run, name: str, config: dict | None = None, tensors=None) -> str:
    """A copy of the exported folder with config.json keys replaced and `tensors(dict) -> dict` applied."""
    path = str(run["root"] / "bad" / name)
    shutil.copytree(run["llama"], path)
    t, c = _llama_folder(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**c, **(config or {})}, f)
    st.save_file(tensors(t) if tensors else t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _renamed(t: dict) -> dict:
    return {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(CFG.d_model, np.float32)}


def _without_up(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"}


def _reshaped(t: dict) -> dict:
    return {**t, "model.norm.weight": np.ones(CFG.d_model + 1, np.float32)}


BAD_FOLDERS = {
    "kv-heads": ({"num_key_value_heads": 3}, None, "model.n_kv_heads=3 must divide model.n_heads=4"),
    "rope-type": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, "rope_scaling of type 'yarn' does"),
    "not-llama": (
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        None,
        "is not a Llama, Mistral or Qwen2 config",
    ),
    "vocab": ({"vocab_size": 32000}, None, "tensor 'lm_head.weight' of "),  # the sizes come from config.json
    "act": ({"hidden_act": "gelu"}, None, "hidden_act='gelu' does not map"),
    "bias": ({"attention_bias": True}, None, "attention_bias=True does not map"),
    "size": ({"hidden_size": "big"}, None, "hidden_size must be a positive integer, got 'big'"),
    "extra-tensor": (None, _renamed, "tensor 'model.layers.0.self_attn.q_proj.bias' of "),
    "missing-tensor": (None, _without_up, "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    "shape": (None, _reshaped, "tensor 'model.norm.weight' of "),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_an_hf_folder_that_does_not_map_is_one_line_and_writes_nothing(run, case):
    config, tensors, sentence = BAD_FOLDERS[case]
    path = _changed_copy(run, case, config, tensors)
    out = run["root"] / "bad" / f"{case}-out"
    assert_one_line_error(cli_in_process("import", path, str(out)), sentence)
    assert not os.path.exists(out) and not _partial(run["root"] / "bad")


def _partial(folder) -> list[str]:
    """Staging folders left beside an output."""
    return [n for n in os.listdir(folder) if ".partial-" in n]


def test_a_folder_without_config_or_safetensors_is_one_line(run, tmp_path):
    assert_one_line_error(cli_in_process("import", str(tmp_path), str(tmp_path / "o")), "has no config.json")
    shutil.copy(os.path.join(run["llama"], "config.json"), tmp_path)
    assert_one_line_error(cli_in_process("import", str(tmp_path), str(tmp_path / "o")), "has no .safetensors file")
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_exporting_a_model_target_checkpoint_to_safetensors_is_one_line(tmp_path):
    mesh = zj.make_mesh(devices=jax.devices()[:1])
    trainer = zj.Trainer(lambda rngs: MLP(rngs=rngs), optax.sgd(0.1), mesh=mesh, stage=0)
    state = trainer.init(KEY, {"inputs": np.zeros((2, 12), np.float32), "targets": np.zeros(2, np.int32)})
    ckpt = _save(trainer, state, str(tmp_path / "ckpt"), {"target": "tests.user_code:MLP"})
    result = cli_in_process("export", ckpt, str(tmp_path / "out"), "--format", "safetensors")
    assert_one_line_error(result, "model.target='tests.user_code:MLP'", "--format npz")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_out_folder_with_other_content_is_refused_and_kept(run, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = dir_digest(tmp_path)
    export = ("export", run["ckpt"], str(tmp_path), "--format", "safetensors")
    for args in (export, ("import", run["llama"], str(tmp_path))):
        assert_one_line_error(cli_in_process(*args), f"{str(tmp_path)!r} already holds 'notes.txt'")
    assert dir_digest(tmp_path) == before and not _partial(tmp_path.parent)


def test_an_earlier_export_is_replaced_whole(run):
    again = cli_in_process("export", run["ckpt"], run["llama"], "--format", "safetensors")
    assert again.returncode == 0, again.stderr
    assert sorted(os.listdir(run["llama"])) == ["config.json", "model.safetensors"]
    assert not _partial(run["root"])


@pytest.mark.slow
def test_the_fine_tuning_path_of_the_docs_runs_end_to_end(tmp_path):
    """docs/finetune.md's path: a base trained, exported and imported; LoRA from it with
    configs/finetune-tiny.yaml; the run exported merged (whose logits are the adapted model's) and as
    peft adapters."""
    from tests.cli_helpers import run_cli

    runs = str(tmp_path)
    steps = [
        ("train", "configs/tiny.yaml", "--devices", "8", "--out", f"{runs}/base", "--set", "checkpoint.every=30"),
        ("export", f"{runs}/base", f"{runs}/base-hf", "--format", "safetensors"),
        ("import", f"{runs}/base-hf", f"{runs}/base-imported"),
        ("train", "configs/finetune-tiny.yaml", "--devices", "8", "--out", f"{runs}/finetune")
        + ("--set", f"train.init_from={runs}/base-imported/params.npz"),
        ("export", f"{runs}/finetune", f"{runs}/finetune-hf", "--format", "safetensors"),
        ("export", f"{runs}/finetune", f"{runs}/finetune-peft", "--format", "peft"),
        ("export", f"{runs}/finetune", f"{runs}/finetune.npz"),
        ("import", f"{runs}/finetune-hf", f"{runs}/finetune-imported"),
    ]
    for args in steps:
        r = run_cli(*args)
        assert r.returncode == 0, (args, r.stderr[-2000:])
    assert sorted(os.listdir(f"{runs}/finetune-peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    lora = gpt_config("tiny", remat="none", lora={"rank": 4, "alpha": 8})
    adapted = zj.load_params(f"{runs}/finetune.npz", GPT(lora, nnx.Rngs(0)))
    base = zj.load_params(f"{runs}/finetune-imported/params.npz", GPT(gpt_config("tiny", remat="none"), nnx.Rngs(0)))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(base(tokens)), np.asarray(adapted(tokens)), atol=1e-5, rtol=0)
