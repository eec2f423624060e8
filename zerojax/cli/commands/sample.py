"""`zerojax sample CKPT --prompt TEXT [--max-tokens N] [--top-k K]`: text from a shipped-GPT checkpoint."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="continue a prompt with a checkpoint of the shipped GPT, greedy or top-k")
    p.add_argument("checkpoint", help="a checkpoint step folder, a checkpoint folder (latest step) or a run's --out")
    p.add_argument("--prompt", default="", help="the text to continue (empty: start a new document)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default 64)")
    p.add_argument("--top-k", type=int, default=1, metavar="K", help="draw from the K most likely tokens; 1: greedy")
    p.add_argument("--seed", type=int, default=0, help="the random seed of top-k draws")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json instead of the run's own")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerojax.interop.sampling import sample
    from zerojax.log import quiet_orbax

    quiet_orbax()
    text = sample(
        args.checkpoint,
        args.prompt,
        max_tokens=args.max_tokens,
        top_k=args.top_k,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    print(text)
    return 0
