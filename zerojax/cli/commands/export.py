"""`zerojax export CKPT OUT [--format npz|safetensors|peft]`: a checkpoint's master params,
consolidated fp32: one .npz keyed by parameter path, or (the shipped GPT) a Hugging Face Llama-family
folder (a LoRA run's adapters merged in), or a LoRA run's adapters as `peft` reads them."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's params, consolidated fp32, to an .npz or a Llama folder")
    p.add_argument("checkpoint", help="a checkpoint step folder, a checkpoint folder (latest step) or a run's --out")
    p.add_argument(
        "out",
        help="npz: the .npz file to write (load it with zerojax.load_params); "
        "safetensors: the folder for model.safetensors and config.json; "
        "peft: the folder for adapter_model.safetensors and adapter_config.json",
    )
    p.add_argument(
        "--format",
        choices=("npz", "safetensors", "peft"),
        default="npz",
        help="safetensors: the shipped GPT as a Hugging Face Llama (transformers' LlamaForCausalLM reads it; "
        "LoRA adapters merged); peft: a LoRA run's adapters as the peft library reads them",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    # One host device is enough: leaves are read one at a time into host memory.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zerojax.interop.hf import export_peft, export_safetensors
    from zerojax.interop.params import export_params
    from zerojax.log import quiet_orbax

    quiet_orbax()
    if args.format == "safetensors":
        info = export_safetensors(args.checkpoint, args.out)
        what = f"{info['tensors']} Llama tensors"
    elif args.format == "peft":
        info = export_peft(args.checkpoint, args.out)
        what = f"{info['tensors']} LoRA tensors"
    else:
        info = export_params(args.checkpoint, args.out)
        what = f"{info['params']} parameters"
    print(f"exported {what} of step {info['step']} from {info['from']} to {info['path']}", file=sys.stderr)
    return 0
