"""Text from a checkpoint of the shipped GPT: `zerojax sample CKPT --prompt TEXT`.

The checkpoint's consolidated fp32 params (as `zerojax export` writes them) go into a GPT built from
the model the run recorded, and the run's tokenizer (its data.tokens folder's; byte-level when it
had none) encodes the prompt. Decoding recomputes the whole window for every new token (no KV
cache): one compiled program of the model's seq_len, plenty for the small models this is for.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from zerojax.data.corpus import VOCAB_SIZE
from zerojax.data.tokenizer import BYTES, TextTokenizer, byte_tokenizer, load_tokenizer
from zerojax.errors import UserError
from zerojax.train.checkpoint import find_step_dir, read_meta


def run_tokenizer(meta: dict, path: str | None = None) -> TextTokenizer:
    """The tokenizer `path` names, else the run's: its data.tokens folder's, or byte-level."""
    if path is not None:
        return load_tokenizer(path)
    folder = (((meta.get("config") or {}).get("data")) or {}).get("tokens")
    if not folder:
        return byte_tokenizer()
    from zerojax.data.token_files import index_tokenizer, load_index

    if not os.path.isdir(folder):
        raise UserError(f"the run's data.tokens folder {folder!r} is gone; pass its tokenizer.json with --tokenizer.")
    return index_tokenizer(folder, load_index(folder))


def load_gpt(checkpoint: str):
    """(the shipped GPT with the checkpoint's params, the step's metadata)."""
    from flax import nnx

    from zerojax.interop.params import export_params
    from zerojax.models.gpt import GPT, GPTConfig
    from zerojax.train.params_file import load_params

    step_dir = find_step_dir(checkpoint)
    meta = read_meta(step_dir)
    model = meta.get("model") or {}
    if "d_model" not in model:
        raise UserError(
            f"checkpoint {step_dir!r} is not of the shipped GPT (model {model.get('target', 'unknown')!r}); "
            "sample reads only runs of model.preset."
        )
    gpt = GPT(GPTConfig(**model), rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = export_params(step_dir, os.path.join(tmp, "params.npz"))["path"]
        return load_params(path, gpt), meta


def generate(model, prompt: list[int], *, max_tokens: int, top_k: int, vocab: int, stop: int, seed: int = 0):
    """Up to `max_tokens` ids after `prompt`, ending early at `stop`: the most likely token
    (top_k <= 1) or one drawn from the `top_k` most likely, never an id of `vocab` or above."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    length = model.cfg.seq_len
    k = max(1, min(top_k, vocab))

    @jax.jit
    def pick(state, tokens_1xL, last, key):
        logits_V = nnx.merge(graphdef, state)(tokens_1xL)[0, last]  # causal: the padding after is unseen
        logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < vocab, logits_V, -jnp.inf)
        if k == 1:
            return jnp.argmax(logits_V)
        values_K, ids_K = jax.lax.top_k(logits_V, k)
        return ids_K[jax.random.categorical(key, values_K)]

    ids, out, key = list(prompt), [], jax.random.key(seed)
    for _ in range(max_tokens):
        window = ids[-length:]
        tokens_1xL = np.zeros((1, length), np.int32)
        tokens_1xL[0, : len(window)] = window
        key, sub = jax.random.split(key)
        token = int(pick(state, tokens_1xL, len(window) - 1, sub))
        if token == stop:
            break
        ids.append(token)
        out.append(token)
    return out


def sample(
    checkpoint: str, prompt: str, *, max_tokens: int = 64, top_k: int = 1, seed: int = 0, tokenizer: str | None = None
) -> str:
    """The prompt and its continuation as text."""
    if max_tokens < 0 or top_k < 1:
        raise UserError(f"--max-tokens must be >= 0 and --top-k >= 1, got {max_tokens} and {top_k}.")
    model, meta = load_gpt(checkpoint)
    tok = run_tokenizer(meta, tokenizer)
    embedding = model.cfg.vocab_size
    needed = VOCAB_SIZE if tok.kind == BYTES else tok.vocab_size  # text never encodes to the bytes' end id
    if needed > embedding:
        raise UserError(
            f"the tokenizer has {needed} tokens, more than the model's embedding of {embedding}; "
            "give the tokenizer the run was trained with."
        )
    ids = tok.encode(prompt) or [tok.eod]
    if max(ids) >= embedding:
        raise UserError("--prompt is empty and the model has no end-of-document token to start from; give a prompt.")
    new = generate(model, ids, max_tokens=max_tokens, top_k=top_k, vocab=min(tok.vocab_size, embedding), stop=tok.eod)
    return prompt + tok.decode(new)
