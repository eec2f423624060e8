"""Text to token ids and back: bytes (the default, no dependency) or a Hugging Face byte-level BPE.

Both reserve an end-of-document token, which `zerojax tokenize` writes after every document so
packed training windows show the model where one text ends and the next begins. The byte-level
tokenizer uses ids 0-255 for the bytes and 256 for the end of a document. A BPE is trained here
(`train_bpe`) or read from a `tokenizer.json` (`load_tokenizer`); one without an end-of-document
token gets `<|endoftext|>` added at the end of its vocabulary.

`tokenizers` is imported only when a BPE is used: it is the optional extra `zerojax[text]`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from zerojax.errors import UserError

BYTES = "bytes"
BPE = "bpe"
EOD = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, tried in order before adding EOD.
EOD_NAMES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
MIN_BPE_VOCAB = 258  # the 256 byte symbols, the end-of-document token, at least one merge


def require_tokenizers():
    """The `tokenizers` package, or one sentence saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise UserError(
            "BPE tokenizers need the Hugging Face `tokenizers` package; install it with pip install zerojax[text]."
        ) from None
    return tokenizers


@dataclass(frozen=True)
class TextTokenizer:
    """Encodes text to ids below `vocab_size` and back; `eod` ends a document."""

    vocab_size: int
    eod: int
    hf: Any = None  # a tokenizers.Tokenizer; None for the byte-level tokenizer

    @property
    def kind(self) -> str:
        return BYTES if self.hf is None else BPE

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; end-of-document tokens are left out."""
        ids = [int(i) for i in ids if int(i) != self.eod]
        if self.hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    def save(self, path: str) -> None:
        """Write the BPE as a tokenizer.json (the byte-level tokenizer has no file)."""
        if self.hf is not None:
            self.hf.save(path)


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer(vocab_size=257, eod=256)


def _with_eod(hf) -> TextTokenizer:
    """Find the tokenizer's end-of-document token, or add one after its vocabulary."""
    ids = [hf.token_to_id(name) for name in EOD_NAMES]
    eod = next((i for i in ids if i is not None), None)
    if eod is None:
        hf.add_special_tokens([EOD])
        eod = hf.token_to_id(EOD)
    vocab = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return TextTokenizer(vocab_size=vocab, eod=eod, hf=hf)


def load_tokenizer(path: str) -> TextTokenizer:
    """A Hugging Face tokenizer.json (from `tokenizers` or `transformers`' fast tokenizers)."""
    tokenizers = require_tokenizers()
    if not os.path.isfile(path):
        raise UserError(f"tokenizer file {path!r} does not exist.")
    try:
        hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception for any bad file
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise UserError(
            f"tokenizer file {path!r} cannot be read as a Hugging Face tokenizer.json ({reason})."
        ) from None
    return _with_eod(hf)


def train_bpe(texts: Iterable[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE (GPT-2 style) of at most `vocab_size` tokens trained on `texts`, id 0 the
    end-of-document token. Every byte has a token, so any text encodes and decodes exactly."""
    if vocab_size < MIN_BPE_VOCAB or vocab_size > 2**32:
        raise UserError(f"--train-vocab must be between {MIN_BPE_VOCAB} and 2**32, got {vocab_size}.")
    tokenizers = require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return _with_eod(hf)
