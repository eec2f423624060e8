"""From a validated `Config` to the pieces of a run: mesh, model, optimizer, data and `Trainer`.

The model is the shipped GPT (`model.preset` ...) or the user's `model.target`; the data is the byte
corpus (`data.path`), token files (`data.tokens`) or the user's `data.target`; the loss is cross
entropy or `loss.target` (see `zerojax.targets`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from zerojax.config import Config
from zerojax.data import BatchStream, load_corpus, split_corpus
from zerojax.engines import EngineOptions
from zerojax.engines.accum import check_accum_batch
from zerojax.mesh import check_batch, data_parallel_size, make_mesh
from zerojax.models.gpt import GPT, GPTConfig, gpt_config
from zerojax.optim import build_optimizer
from zerojax.trainer import Trainer


def model_config(c: Config) -> GPTConfig:
    overrides = {
        k: v for k, v in c.model.model_dump().items() if k not in ("preset", "target", "kwargs") and v is not None
    }
    if c.data.tokens:
        from zerojax.tokens import model_vocab

        overrides["vocab_size"] = model_vocab(c.data.tokens, c.model.vocab_size)
    return gpt_config(c.model.preset, **overrides)


@dataclass
class Experiment:
    config: Config
    model: GPTConfig | None  # the shipped GPT's config; None for a model.target
    trainer: Trainer
    train_data: Any  # a batch source (zerojax.sources)
    eval_data: Any | None
    model_meta: dict | None = None  # what checkpoints record about the model


def build_model(c: Config) -> tuple[Any, GPTConfig | None, dict]:
    """(what Trainer takes, the GPT config or None, the model's description for checkpoints)."""
    if c.model.target:
        from zerojax.targets import build_model as build_target

        return build_target(c.model.target, c.model.kwargs), None, {"target": c.model.target, **c.model.kwargs}
    gpt = model_config(c)
    return functools.partial(GPT, gpt), gpt, dataclasses.asdict(gpt)


def build_data(c: Config, gpt: GPTConfig | None) -> tuple[Any, Any | None]:
    """(train source, eval source or None)."""
    if c.data.target:
        from zerojax.targets import build_source

        train = build_source(c.data.target, c.data.kwargs, seed=c.train.seed, batch_size=c.train.batch_size)
        evals = None
        if c.data.eval_kwargs is not None:
            evals = build_source(
                c.data.target,
                {**c.data.kwargs, **c.data.eval_kwargs},
                seed=c.train.seed + 1,
                batch_size=c.train.batch_size,
            )
        return train, evals
    seq_len = (gpt or model_config(c)).seq_len
    if c.data.tokens:
        from zerojax.tokens import token_sources

        return token_sources(
            c.data.tokens,
            seq_len=seq_len,
            global_batch=c.train.batch_size,
            seed=c.train.seed,
            eval_fraction=c.data.eval_fraction,
        )
    tokens = load_corpus(c.data.path, c.data.max_bytes)
    train_tokens, eval_tokens = split_corpus(tokens, c.data.eval_fraction)
    stream = functools.partial(BatchStream, seq_len=seq_len, global_batch=c.train.batch_size, path=c.data.path)
    return stream(train_tokens, seed=c.train.seed), (
        stream(eval_tokens, seed=c.train.seed + 1) if len(eval_tokens) else None
    )


def axis_rules(c: Config) -> dict:
    """The config's axis rules (`mesh.rules`, else the defaults), with seq -> tensor under
    `mesh.sequence_parallel`."""
    from zerojax.activations import SEQUENCE_PARALLEL_RULES
    from zerojax.axis_rules import as_rules

    return {**as_rules(c.mesh.rules), **(SEQUENCE_PARALLEL_RULES if c.mesh.sequence_parallel else {})}


def build_experiment(c: Config, devices=None) -> Experiment:
    model, gpt, meta = build_model(c)
    mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, devices=devices)
    check_batch(c.train.batch_size, data_parallel_size(mesh))
    check_accum_batch(c.train.batch_size, data_parallel_size(mesh), c.train.grad_accum)
    train_data, eval_data = build_data(c, gpt)
    loss_fn = None
    if c.loss.target:
        from zerojax.targets import build_loss

        loss_fn = build_loss(c.loss.target)
    trainer = Trainer(
        model,
        build_optimizer(c.optimizer, c.train.steps),
        mesh=mesh,
        stage=c.zero.stage,
        engine=c.zero.engine,
        precision=c.precision,
        loss_fn=loss_fn,
        reduce_dtype=c.zero.reduce_dtype,
        engine_options=EngineOptions(
            prefetch=c.zero.prefetch,
            reshard_after_forward=c.zero.reshard_after_forward,
            quantize_weights=c.zero.quantize_weights,
            quantize_grads=c.zero.quantize_grads,
            quantize_block=c.zero.quantize_block,
            hierarchical=c.zero.hierarchical,
            checked_update=c.zero.checked_update,
        ),
        grad_accum=c.train.grad_accum,
        offload=c.zero.offload,
        axis_rules=axis_rules(c),
    )
    return Experiment(c, gpt, trainer, train_data, eval_data, meta)
