"""From a validated `Config` to the pieces of a run: mesh, model, optimizer, data and `Trainer`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zerojax.config import Config
from zerojax.data import BatchStream, load_corpus, split_corpus
from zerojax.engines import EngineOptions
from zerojax.mesh import check_batch, data_parallel_size, make_mesh
from zerojax.models.gpt import GPT, GPTConfig, gpt_config
from zerojax.optim import build_optimizer
from zerojax.trainer import Trainer


def model_config(c: Config) -> GPTConfig:
    overrides = {k: v for k, v in c.model.model_dump().items() if k != "preset" and v is not None}
    return gpt_config(c.model.preset, **overrides)


@dataclass
class Experiment:
    config: Config
    model: GPTConfig
    trainer: Trainer
    train_data: BatchStream
    eval_data: BatchStream | None


def build_experiment(c: Config, devices=None) -> Experiment:
    gpt = model_config(c)
    mesh = make_mesh(c.mesh.data, c.mesh.fsdp, devices=devices)
    check_batch(c.train.batch_size, data_parallel_size(mesh))
    tokens = load_corpus(c.data.path, c.data.max_bytes)
    train_tokens, eval_tokens = split_corpus(tokens, c.data.eval_fraction)
    stream = functools.partial(BatchStream, seq_len=gpt.seq_len, global_batch=c.train.batch_size, path=c.data.path)
    train_data = stream(train_tokens, seed=c.train.seed)
    eval_data = stream(eval_tokens, seed=c.train.seed + 1) if len(eval_tokens) else None
    trainer = Trainer(
        functools.partial(GPT, gpt),
        build_optimizer(c.optimizer, c.train.steps),
        mesh=mesh,
        stage=c.zero.stage,
        engine=c.zero.engine,
        precision=c.precision,
        reduce_dtype=c.zero.reduce_dtype,
        engine_options=EngineOptions(prefetch=c.zero.prefetch),
    )
    return Experiment(c, gpt, trainer, train_data, eval_data)
