"""Hugging Face's own models against the shipped GPT: tiny random Llama 3 (grouped-query attention),
Llama 3.1 (llama3 rope scaling), Llama 3.2 (tied embeddings, explicit head_dim), Mistral and Qwen2
(q/k/v biases), written by `transformers`; `zerojax import` of each gives transformers' logits, and
exporting the import writes the same tensors bit for bit. A LoRA run's merged export gives the adapted
model's logits in transformers, and its `--format peft` folder does in `peft`.

These need torch, transformers and peft, which the default suite never installs: every test is `slow`
(`python3 -m pytest -m slow tests/test_transformers.py` in an environment that has them)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from flax import nnx

import zerojax as zj
from tests.cli_helpers import assert_one_line_error, cli_in_process
from tests.test_hf import KEY, _random_params, _save, _stream, _trainer
from zerojax.cli.config import load_config
from zerojax.cli.experiment import model_config
from zerojax.models.gpt import GPT, gpt_config

st = pytest.importorskip("safetensors.numpy", reason="the hf extra is not installed")
pytestmark = pytest.mark.slow

SEQ = 16
COMMON = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
}
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,  # wavelengths past 8 positions are scaled: most of them here
}
# family -> (config class, model class, its own settings)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0, "rms_norm_eps": 1e-5}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}),
    "llama3.2": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rms_norm_eps": 1e-6}),
}
TOKENS = np.random.default_rng(3).integers(0, 256, (2, SEQ)).astype(np.int64)


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers), imported only when a test here runs."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.set_grad_enabled(False)
    return torch, transformers


def _sharp(model, torch, seed: int = 0):
    """Random weights far from transformers' 0.02 init (norm weights and biases too), so a wrong
    mapping, rotary pairing or scaling shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.2 * noise if "norm" in name else (1.0 if "embed" in name else 0.3) * noise)
    return model


def _hf_model(hf, family: str, dtype=None):
    torch, transformers = hf
    config_cls, model_cls, own = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **own)
    model = _sharp(getattr(transformers, model_cls)(config).eval(), torch)
    return model if dtype is None else model.to(dtype)


def _logits(model, torch) -> np.ndarray:
    return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def _imported(folder: str, out: str):
    """`zerojax import folder out`, then (its GPTConfig, its params)."""
    result = cli_in_process("import", folder, out)
    assert result.returncode == 0, result.stderr
    cfg = model_config(load_config(os.path.join(out, "config.yaml")))
    return cfg, zj.load_params(os.path.join(out, "params.npz"))


def _gpt_logits(cfg, params) -> np.ndarray:
    graph, state, rest = nnx.split(GPT(dataclasses.replace(cfg, remat="none"), nnx.Rngs(0)), nnx.Param, ...)
    state.replace_by_pure_dict(params)
    return np.asarray(nnx.merge(graph, state, rest)(TOKENS.astype(np.int32)))


def _exported(cfg, params, root: str, fmt: str = "safetensors", trainable=None) -> str:
    """`params` saved as a run's checkpoint under root/ckpt, exported to root/<fmt>."""
    trainer = _trainer(cfg, trainable)
    state = trainer.init(KEY, _stream().host_batch(0), params=params)
    ckpt = _save(trainer, state, os.path.join(root, "ckpt"), dataclasses.asdict(cfg))
    out = os.path.join(root, fmt)
    result = cli_in_process("export", ckpt, out, "--format", fmt)
    assert result.returncode == 0, result.stderr
    return out


def _tensors(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out |= st.load_file(os.path.join(folder, name))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_transformers_logits_and_export_writes_the_same_tensors(hf, family, tmp_path):
    torch, transformers = hf
    model = _hf_model(hf, family)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = _imported(str(tmp_path / "hf"), str(tmp_path / "imported"))
    want = _logits(model, torch)
    np.testing.assert_allclose(_gpt_logits(cfg, params), want, atol=1e-4, rtol=0)
    if family == "llama3.1":  # the check can fail: without the rope scaling the logits differ
        assert np.abs(_gpt_logits(dataclasses.replace(cfg, rope_scaling=None), params) - want).max() > 1e-3

    exported = _exported(cfg, params, str(tmp_path))
    original, again = _tensors(str(tmp_path / "hf")), _tensors(exported)
    assert sorted(again) == sorted(original)
    for name, value in original.items():
        assert again[name].dtype == value.dtype and np.array_equal(again[name], value), name
    reread = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    np.testing.assert_array_equal(_logits(reread, torch), want)


def test_sharded_and_bf16_folders_import_as_written(hf, tmp_path):
    torch, _ = hf
    model = _hf_model(hf, "llama3")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = [n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path / "sharded")
    _, one = _imported(str(tmp_path / "one"), str(tmp_path / "one-imported"))
    cfg, sharded = _imported(str(tmp_path / "sharded"), str(tmp_path / "sharded-imported"))
    _assert_same_tree(sharded, one)

    bf16 = model.to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    _, from_bf16 = _imported(str(tmp_path / "bf16"), str(tmp_path / "bf16-imported"))
    # the bf16 values, exactly, in an fp32 model (a cast model would keep its rotary table rounded)
    widened = _hf_model(hf, "llama3")
    widened.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    embed = widened.model.embed_tokens.weight.numpy()
    np.testing.assert_array_equal(from_bf16["embed"], embed)
    assert not np.array_equal(embed, one["embed"])  # rounded: the check above can fail
    np.testing.assert_allclose(_gpt_logits(cfg, from_bf16), _logits(widened, torch), atol=1e-4, rtol=0)


def _leaves(tree) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_same_tree(a, b) -> None:
    import jax

    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_a_lora_runs_merged_and_peft_exports_give_the_adapted_logits(hf, tmp_path):
    torch, transformers = hf
    peft = pytest.importorskip("peft", reason="peft is not installed")
    base_cfg = gpt_config("tiny", d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48, seq_len=SEQ)
    lora_cfg = dataclasses.replace(base_cfg, lora=gpt_config("tiny", lora={"rank": 4, "alpha": 8}).lora)
    params = _random_params(lora_cfg)
    for name in params["blocks"]:  # B non-zero, so the adapters change the logits, at a trained size
        if name.endswith("_lora_b"):
            params["blocks"][name] *= 0.1
    base_params = {**params, "blocks": {k: v for k, v in params["blocks"].items() if "lora" not in k}}
    adapted = _gpt_logits(lora_cfg, params)
    assert np.abs(adapted - _gpt_logits(base_cfg, base_params)).max() > 1e-2

    # within 1e-5 of the logits' scale: W x + s (x A) B and (W + s A B) x round differently in fp32
    tolerance = 1e-5 * np.abs(adapted).max()
    merged = _exported(lora_cfg, params, str(tmp_path / "lora"), trainable=".*")
    got = _logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval(), torch)
    np.testing.assert_allclose(got, adapted, atol=tolerance, rtol=0)

    adapters = _exported(lora_cfg, params, str(tmp_path / "peft"), fmt="peft", trainable=".*")
    base = _exported(base_cfg, base_params, str(tmp_path / "base"))
    with_adapters = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapters
    ).eval()
    np.testing.assert_allclose(_logits(with_adapters, torch), adapted, atol=tolerance, rtol=0)


REFUSED = {  # settings transformers writes that the shipped GPT has no equal for -> the sentence's words
    "sliding-window": ("mistral", {"sliding_window": 8}, "sliding_window=8"),
    "yarn": ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn'"),
    "mlp-bias": ("llama3", {"mlp_bias": True}, "mlp_bias=True"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_setting_the_gpt_cannot_honour_is_one_line_and_writes_nothing(hf, case, tmp_path):
    _, transformers = hf
    family, setting, words = REFUSED[case]
    config_cls, model_cls, own = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **{**own, **setting})
    getattr(transformers, model_cls)(config).save_pretrained(tmp_path / "hf")
    assert_one_line_error(cli_in_process("import", str(tmp_path / "hf"), str(tmp_path / "out")), words)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
