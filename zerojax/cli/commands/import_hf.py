"""`zerojax import HF_DIR OUT`: a Hugging Face Llama folder the shipped GPT can hold, as OUT/params.npz
and OUT/config.yaml, a run config that trains from those weights."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("import", help="a Hugging Face Llama folder as the shipped GPT's params and run config")
    p.add_argument(
        "hf_dir", help="a folder with config.json and *.safetensors (e.g. from zerojax export --format safetensors)"
    )
    p.add_argument("out", help="the folder for params.npz and config.yaml (train it: zerojax train OUT/config.yaml)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerojax.interop.hf import import_llama

    info = import_llama(args.hf_dir, args.out)
    sizes = ", ".join(f"{k}={v}" for k, v in info["model"].items())
    print(f"imported a GPT ({sizes}) from {args.hf_dir} to {info['params']} and {info['config']}", file=sys.stderr)
    return 0
