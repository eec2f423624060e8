"""`zerojax tokenize DATA OUT [--train-vocab N | --tokenizer PATH]`: token files for `data.tokens`."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("tokenize", help="write a text file or folder as token files (train with data.tokens=OUT)")
    p.add_argument("data", help="a text file, or a folder whose text files are the documents")
    p.add_argument("out", help="a new or empty folder for the token shards, index.json and tokenizer.json")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--train-vocab", type=int, metavar="N", help="train a byte-level BPE of N tokens on DATA (needs zerojax[text])"
    )
    which.add_argument("--tokenizer", metavar="PATH", help="use this Hugging Face tokenizer.json (needs zerojax[text])")
    p.add_argument(
        "--shard-tokens", type=int, default=None, metavar="N", help="start a new shard after N tokens (default 2**28)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from zerojax.data.token_files import SHARD_TOKENS, check_out, documents, write_token_files
    from zerojax.data.tokenizer import byte_tokenizer, load_tokenizer, train_bpe
    from zerojax.errors import UserError

    shard_tokens = SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be a positive integer, got {shard_tokens}.")
    check_out(args.out)  # before a long BPE training
    if args.tokenizer:
        tok, source = load_tokenizer(args.tokenizer), os.path.abspath(args.tokenizer)
    elif args.train_vocab is not None:
        tok, source = train_bpe(documents(args.data), args.train_vocab), f"trained on {os.path.abspath(args.data)}"
    else:
        tok, source = byte_tokenizer(), "bytes"
    index = write_token_files(args.data, args.out, tok, source=source, shard_tokens=shard_tokens)
    print(
        f"tokenized {index['documents']} documents into {index['tokens']} tokens ({tok.kind}, vocabulary "
        f"{index['vocab_size']}, {len(index['shards'])} {index['dtype']} shards) in {args.out}",
        file=sys.stderr,
    )
    return 0
