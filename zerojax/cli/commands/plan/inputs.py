"""What `zerojax plan` plans: a parameter count and sizes from the flags (`--params N --devices P`, no
JAX import), or a config's model counted on its abstract shapes (`jax.eval_shape`, nothing
allocated) with its mesh, batch, precision and optimizer; flags given explicitly override it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from zerojax.errors import UserError

COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7e9', '7000000000', '7B', '125M', '1.5t' -> a positive parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m or float(m.group(1)) * COUNT_SUFFIX[m.group(2)] <= 0:
        raise UserError(f"--params must be a positive number such as 7e9 or 125M, got {text!r}.")
    return float(m.group(1)) * COUNT_SUFFIX[m.group(2)]


def inputs_from_flags(args: argparse.Namespace) -> dict:
    """Plan inputs from `--params` and `--devices` and the flags' defaults: no model shape, one replica."""
    if args.params is None:
        raise UserError("--params is required, e.g. `zerojax plan --params 7e9 --devices 8`, or give a CONFIG.")
    if args.devices is None:
        raise UserError("--devices is required: how many devices share the model state.")
    inputs = {
        "params": parse_count(args.params),
        "devices": args.devices,
        "seq_len": args.seq or 2048,
        "micro_batch": args.micro_batch or 1,
        "precision": args.precision or "bf16",
        "optimizer": args.optimizer or "adamw",
        "shape": None,
        "remat": "full",
        "replicas": 1,
        "grad_accum": args.grad_accum or 1,
        "reshard_after_forward": True,
        "zeropp": None,
    }
    inputs["rows_per_device"] = inputs["micro_batch"] * inputs["grad_accum"]
    inputs["global_rows"] = inputs["rows_per_device"] * inputs["devices"]
    if args.lora_rank is not None:
        raise UserError(
            "--lora-rank needs a CONFIG of the shipped GPT (the adapters' shapes); give --trainable instead."
        )
    inputs["trainable"] = None if args.trainable is None else args.trainable * inputs["params"]
    return inputs


def counted_model(c, args: argparse.Namespace) -> dict:
    """The config's parameters, sequence length, shape and remat policy, counted without allocating."""
    from zerojax.accounting.activations import GPTShape
    from zerojax.accounting.params import count_params, gpt_param_shapes, selected_params
    from zerojax.cli.experiment import model_config
    from zerojax.models.gpt import LoRAConfig

    if c.model.target:
        return target_inputs(c, args)
    gpt = model_config(c)
    if args.lora_rank is not None:
        gpt = dataclasses.replace(gpt, lora=LoRAConfig(rank=args.lora_rank))
    shapes = gpt_param_shapes(gpt)
    params = float(count_params(shapes))
    # what trains: --trainable's fraction, else train.trainable, else the adapters, else all
    trainable = selected_params(shapes, c.train.trainable) or gpt.num_lora_params() or None
    return {
        "params": params,
        "seq_len": args.seq or gpt.seq_len,
        "shape": GPTShape.of(gpt),
        "remat": gpt.remat,
        "trainable": args.trainable * params if args.trainable else trainable,
    }


def sharding_devices(c, args: argparse.Namespace) -> int:
    """The devices the state is sharded over: `--devices` less the config's replicas, else mesh.fsdp
    (x mesh.tensor x mesh.pipeline: at stage 3 each device keeps 1/(fsdp x tensor x pipeline) of the
    state either way, the blocks' part of it)."""
    replicas = c.mesh.data
    if args.devices is not None:
        if args.devices % replicas:
            raise UserError(f"--devices {args.devices} is not divisible by mesh.data = {replicas}.")
        return args.devices // replicas
    if c.mesh.fsdp is not None:
        return c.mesh.fsdp * c.mesh.tensor * c.mesh.pipeline
    raise UserError(f"--devices is required: {args.config} leaves mesh.fsdp to the device count.")


def inputs_from_config(args: argparse.Namespace) -> dict:
    """Plan inputs from a config: parameters counted on the abstract model, nothing allocated."""
    if not os.path.isfile(args.config):
        raise UserError(
            f"config file {args.config!r} does not exist; give an existing YAML config, "
            "or plan with --params N --devices P."
        )
    from zerojax.cli.config import load_config

    c = load_config(args.config, args.overrides)
    counted = counted_model(c, args)
    fsdp = sharding_devices(c, args)
    dp = c.mesh.data * fsdp
    accum = args.grad_accum or c.train.grad_accum
    micro = args.micro_batch or max(1, c.train.batch_size // dp // accum)
    return {
        "rows_per_device": micro * accum if args.micro_batch else max(1, c.train.batch_size // dp),
        "global_rows": c.train.batch_size,
        "pipeline": c.mesh.pipeline,
        "microbatches": c.train.microbatches,
        "pipeline_repeats": c.mesh.pipeline_repeats,
        "pipeline_gather": c.zero.pipeline_gather,
        "stage": c.zero.stage,
        "params": counted["params"],
        "devices": fsdp,
        "seq_len": counted["seq_len"],
        "micro_batch": micro,
        "grad_accum": accum,
        "reshard_after_forward": c.zero.reshard_after_forward,
        "precision": args.precision or c.precision,
        "optimizer": args.optimizer or c.optimizer.name,
        "shape": counted["shape"],
        "remat": counted["remat"],
        "trainable": counted["trainable"],
        "replicas": c.mesh.data,
        "tensor": c.mesh.tensor,
        "zeropp": {
            "quantize_weights": c.zero.quantize_weights,
            "quantize_grads": c.zero.quantize_grads,
            "block": c.zero.quantize_block,
            "hierarchical": c.zero.hierarchical,
        },
    }


def target_inputs(c, args: argparse.Namespace) -> dict:
    """A model.target's parameters, counted with `jax.eval_shape` on one row of its data's step-0
    batch; the sequence length is that batch's second axis for token-id inputs (else 1)."""
    import jax
    import numpy as np

    from zerojax.accounting.params import selected_params
    from zerojax.adapt.model import functional, param_shapes
    from zerojax.cli.experiment import build_data, build_model
    from zerojax.core.trees import count_params
    from zerojax.data.sources import example_batch

    model, _, _ = build_model(c)
    train, _ = build_data(c, None)
    given = example_batch(train)["inputs"]  # an array, or a pytree of arrays
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), given)
    shapes = param_shapes(functional(model), jax.random.key(0), inputs)
    params = count_params(shapes)
    x = given if hasattr(given, "shape") else None  # token ids name the sequence length; a pytree does not
    tokens = x is not None and x.ndim >= 2 and np.issubdtype(x.dtype, np.integer)
    if args.lora_rank is not None:
        raise UserError("--lora-rank adds adapters to the shipped GPT, not to model.target; give --trainable instead.")
    return {
        "params": float(params),
        "seq_len": args.seq or (int(x.shape[1]) if tokens and x is not None else 1),
        "shape": None,
        "remat": "none",
        "trainable": args.trainable * params if args.trainable else selected_params(shapes, c.train.trainable),
    }
