"""The shipped GPT as a Hugging Face Llama folder and back.

`export_safetensors(CKPT, OUT)`: OUT/model.safetensors (Llama names and layouts, fp32) and
OUT/config.json (transformers' LlamaConfig). `import_llama(HF_DIR, OUT)`: OUT/params.npz (the
`zerojax export` format) and OUT/config.yaml, a run config that starts from them (train.init_from).
The mapping is `zerojax.interop.llama`; each output folder appears whole or not at all (`zerojax.folders`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import yaml

from zerojax.errors import UserError
from zerojax.folders import check_out_folder, write_folder
from zerojax.interop.llama import (
    IGNORED_SUFFIXES,
    from_llama,
    gpt_shapes,
    gpt_sizes,
    llama_config,
    llama_shapes,
    merged,
    to_llama,
)
from zerojax.interop.params import export_params
from zerojax.interop.peft import adapter_config, adapter_tensors
from zerojax.models.gpt import GPTConfig, gpt_config
from zerojax.train.checkpoint import find_step_dir, read_meta

EXPORT_FILES = ("model.safetensors", "config.json")
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
IMPORT_FILES = ("params.npz", "config.yaml")
INSTALL = "pip install 'zerojax[hf]'"


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise UserError(f"Hugging Face folders need the safetensors package: {INSTALL}.") from None
    return safetensors


def gpt_of_checkpoint(step_dir: str, meta: dict) -> GPTConfig:
    """The shipped GPT's config a checkpoint recorded; a checkpoint of another model is one UserError."""
    model = meta.get("model") or {}
    names = [f.name for f in dataclasses.fields(GPTConfig)]
    required = ("d_model", "n_layers", "n_heads", "d_ff", "seq_len")  # older checkpoints lack the rest
    if "target" in model or not all(n in model for n in required):
        what = f"model.target={model['target']!r}" if "target" in model else "a model that is not the shipped GPT"
        raise UserError(
            f"checkpoint {step_dir!r} holds {what}; --format safetensors writes the shipped GPT's Llama "
            "layout only (export other models with --format npz)."
        )
    return GPTConfig(**{n: model[n] for n in names if n in model})


def _check_params(params: dict[str, np.ndarray], cfg: GPTConfig, step_dir: str) -> None:
    got = {k: tuple(v.shape) for k, v in params.items()}
    if got != gpt_shapes(cfg):
        raise UserError(f"checkpoint {step_dir!r} holds params that do not fit its recorded GPT config.")


def _consolidated(step_dir: str, folder: str) -> dict[str, np.ndarray]:
    """A checkpoint's params, consolidated fp32 (`export_params`, through a file in `folder`)."""
    npz = os.path.join(folder, "params.npz")
    export_params(step_dir, npz)
    with np.load(npz, allow_pickle=False) as f:
        params = {k: f[k] for k in f.files}
    os.remove(npz)
    return params


def export_peft(checkpoint: str, out: str) -> dict:
    """Write OUT/adapter_model.safetensors and OUT/adapter_config.json: a LoRA run's adapters as
    `peft` reads them, beside the base model they were trained on."""
    st = _safetensors()
    step_dir = find_step_dir(checkpoint)
    meta = read_meta(step_dir)
    cfg = gpt_of_checkpoint(step_dir, meta)
    if cfg.lora is None:
        raise UserError(
            f"checkpoint {step_dir!r} has no LoRA adapters (model.lora); export it with --format safetensors."
        )
    check_out_folder(out, PEFT_FILES, "PEFT export")

    def write(folder: str) -> None:
        tensors = adapter_tensors(_consolidated(step_dir, folder), cfg)
        st.numpy.save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(cfg), f, indent=2)

    write_folder(out, write)
    return {"step": meta["step"], "path": out, "tensors": 2 * cfg.n_layers * len(cfg.lora.targets), "from": step_dir}


def export_safetensors(checkpoint: str, out: str) -> dict:
    """Write OUT/model.safetensors and OUT/config.json for the shipped GPT of a checkpoint."""
    st = _safetensors()
    step_dir = find_step_dir(checkpoint)
    meta = read_meta(step_dir)
    cfg = gpt_of_checkpoint(step_dir, meta)
    check_out_folder(out, EXPORT_FILES, "Hugging Face export")

    def write(folder: str) -> None:
        params = merged(_consolidated(step_dir, folder), cfg)  # a LoRA run: its adapters folded in
        _check_params(params, cfg, step_dir)
        st.numpy.save_file(to_llama(params), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(llama_config(cfg), f, indent=2)

    write_folder(out, write)
    return {"step": meta["step"], "path": out, "tensors": len(llama_shapes(cfg)), "from": step_dir}


def _read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{hf_dir!r} has no config.json; give a Hugging Face model folder.") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path!r} is not readable JSON ({type(e).__name__}).") from None
    if not isinstance(hf, dict):
        raise UserError(f"{path!r} must hold a JSON object, got {type(hf).__name__}.")
    return hf


def _read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
    st = _safetensors()
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise UserError(f"{hf_dir!r} has no .safetensors file.")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with st.safe_open(path, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                    if name in tensors:
                        raise UserError(f"tensor {name!r} appears in more than one file of {hf_dir!r}.")
                    tensors[name] = f.get_tensor(name)
        except (st.SafetensorError, OSError, ValueError, TypeError) as e:
            raise UserError(f"{path!r} is not a readable safetensors file ({type(e).__name__}).") from None
    return {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}


def _check_tensors(tensors: dict[str, np.ndarray], want: dict[str, tuple], hf_dir: str) -> None:
    """Every tensor maps to a GPT parameter of the shape config.json implies, and every one is there."""
    for name in sorted(set(tensors) | set(want)):
        if name not in want:
            raise UserError(f"tensor {name!r} of {hf_dir!r} does not map to the shipped GPT its config.json describes.")
        if name not in tensors:
            raise UserError(f"{hf_dir!r} lacks tensor {name!r}, which its config.json implies.")
        if tuple(tensors[name].shape) != want[name]:
            raise UserError(
                f"tensor {name!r} of {hf_dir!r} has shape {tuple(tensors[name].shape)}; "
                f"its config.json implies {want[name]}."
            )


def run_config(sizes: dict[str, int], params_path: str, hf_dir: str) -> str:
    """The YAML of a run of the imported GPT that starts from its params."""
    head = f"# The shipped GPT imported from {os.path.abspath(hf_dir)}: train it from these weights.\n"
    return head + yaml.safe_dump(
        {"model": {"preset": "tiny", **sizes}, "train": {"init_from": params_path}}, sort_keys=False
    )


def import_llama(hf_dir: str, out: str) -> dict:
    """Write OUT/params.npz and OUT/config.yaml from a Hugging Face Llama folder the GPT can hold."""
    if not os.path.isdir(hf_dir):
        raise UserError(f"Hugging Face folder {hf_dir!r} does not exist.")
    hf = _read_config(hf_dir)
    sizes = gpt_sizes(hf, os.path.join(hf_dir, "config.json"))
    cfg = gpt_config("tiny", **sizes)
    tensors = _read_tensors(hf_dir)
    if cfg.tie_embeddings:  # some tied checkpoints also carry the head: the embedding's copy
        tensors.pop("lm_head.weight", None)
    _check_tensors(tensors, llama_shapes(cfg), hf_dir)
    check_out_folder(out, IMPORT_FILES, "zerojax import")
    params_path = os.path.join(os.path.abspath(out), "params.npz")

    def write(folder: str) -> None:
        np.savez(os.path.join(folder, "params.npz"), **from_llama(tensors, cfg))  # type: ignore[arg-type]
        with open(os.path.join(folder, "config.yaml"), "w") as f:
            f.write(run_config(sizes, params_path, hf_dir))

    write_folder(out, write)
    return {"path": out, "params": params_path, "config": os.path.join(out, "config.yaml"), "model": sizes}
