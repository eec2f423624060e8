"""From a validated `Config` to the pieces of a run: mesh, model, optimizer, data and `Trainer`.

The model is the shipped GPT (`model.preset` ...) or the user's `model.target`; the data is the byte
corpus (`data.path`), token files (`data.tokens`) or the user's `data.target`; the loss is cross
entropy or `loss.target` (see `zerojax.cli.user_code`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from zerojax.cli.config import Config
from zerojax.core.mesh import check_batch, data_parallel_size, make_mesh
from zerojax.core.optim import build_optimizer, learning_rate
from zerojax.data.corpus import BatchStream, load_corpus, split_corpus
from zerojax.engines import EngineOptions
from zerojax.engines.accum import check_accum_batch
from zerojax.models.gpt import GPT, GPTConfig, gpt_config
from zerojax.train.fit import FitOptions, fit
from zerojax.train.trainer import Trainer


def model_config(c: Config) -> GPTConfig:
    overrides = {
        k: v for k, v in c.model.model_dump().items() if k not in ("preset", "target", "kwargs") and v is not None
    }
    if c.data.tokens:
        from zerojax.data.tokens import model_vocab

        overrides["vocab_size"] = model_vocab(c.data.tokens, c.model.vocab_size)
    return gpt_config(c.model.preset, **overrides)


@dataclass
class Experiment:
    config: Config
    model: GPTConfig | None  # the shipped GPT's config; None for a model.target
    trainer: Trainer
    train_data: Any  # a batch source (zerojax.data.sources)
    eval_data: Any | None
    model_meta: dict | None = None  # what checkpoints record about the model


def build_model(c: Config) -> tuple[Any, GPTConfig | None, dict]:
    """(what Trainer takes, the GPT config or None, the model's description for checkpoints)."""
    if c.model.target:
        from zerojax.cli.user_code import build_model as build_target

        return build_target(c.model.target, c.model.kwargs), None, {"target": c.model.target, **c.model.kwargs}
    gpt = model_config(c)
    return functools.partial(GPT, gpt), gpt, dataclasses.asdict(gpt)


def build_data(c: Config, gpt: GPTConfig | None) -> tuple[Any, Any | None]:
    """(train source, eval source or None)."""
    if c.data.target:
        from zerojax.cli.user_code import build_source

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
        from zerojax.data.tokens import token_sources

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
    from zerojax.core.axis_rules import as_rules
    from zerojax.core.constraints import SEQUENCE_PARALLEL_RULES

    return {**as_rules(c.mesh.rules), **(SEQUENCE_PARALLEL_RULES if c.mesh.sequence_parallel else {})}


def engine_options(c: Config) -> EngineOptions:
    """The engine options a config's `zero` section sets: its keys named like `EngineOptions` fields."""
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    return EngineOptions.of({k: v for k, v in c.zero.model_dump().items() if k in names})


def build_experiment(c: Config, devices=None) -> Experiment:
    model, gpt, meta = build_model(c)
    mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, pipeline=c.mesh.pipeline, devices=devices)
    check_batch(c.train.batch_size, data_parallel_size(mesh))
    check_accum_batch(c.train.batch_size, data_parallel_size(mesh), c.train.grad_accum)
    train_data, eval_data = build_data(c, gpt)
    loss_fn = None
    if c.loss.target:
        from zerojax.cli.user_code import build_loss

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
        engine_options=engine_options(c),
        grad_accum=c.train.grad_accum,
        microbatches=c.train.microbatches,
        pipeline_repeats=c.mesh.pipeline_repeats,
        offload=c.zero.offload,
        axis_rules=axis_rules(c),
        trainable=c.train.trainable,
        **({"rng_streams": tuple(c.model.rng_streams)} if c.model.rng_streams is not None else {}),
    )
    return Experiment(c, gpt, trainer, train_data, eval_data, meta)


def fit_options(c: Config, model: dict | None = None) -> FitOptions:
    """How a config's run goes on, saves and stops: its train.* and checkpoint.* keys."""
    t, k = c.train, c.checkpoint
    return FitOptions(
        steps=t.steps,
        seed=t.seed,
        eval_every=t.eval_every,
        eval_batches=t.eval_batches,
        max_bad_steps=t.max_bad_steps,
        checkpoint_every=k.every,
        checkpoint_keep=k.keep,
        checkpoint_dir=k.dir,
        config=c.to_dict(),
        config_defaults=Config().to_dict(),
        model=model,
        tensorboard=t.tensorboard,
        init_from=t.init_from,
        learning_rate=learning_rate(c.optimizer, t.steps),
    )


def fit_experiment(exp: Experiment, out_dir: str, on_step=None, *, resume: bool = False, start=None) -> dict:
    """`zj.fit` on a config's `Experiment`: its trainer, data and options."""
    return fit(
        exp.trainer,
        exp.train_data,
        out_dir,
        eval_source=exp.eval_data,
        options=fit_options(exp.config, exp.model_meta),
        resume=resume,
        on_step=on_step,
        start=start,
    )
