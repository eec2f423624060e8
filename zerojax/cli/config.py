"""Typed experiment config: YAML plus dotted `--set key=value` overrides, validated once.

The sections are pydantic models: pydantic checks each key's type and bounds (unknown keys are
errors), and `validate` asks the owner of every other rule (`stages`, `precision`, `optim`, `mesh`,
the engines) instead of repeating it. Every error is a `UserError` whose one sentence names the
dotted key, the value and what is valid.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError
from pydantic_core import PydanticCustomError

from zerojax.errors import UserError


def _no_bool(kind: str):
    """YAML's `true` is not a number, though pydantic's lax mode would read it as 1."""

    def check(value):
        if isinstance(value, bool):
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}")
        return value

    return BeforeValidator(check)


Int = Annotated[int, _no_bool("integer")]
Float = Annotated[float, _no_bool("number")]  # also accepts ints and numeric text ('3e-4')
PositiveInt = Annotated[Int, Field(ge=1)]
NonNegativeInt = Annotated[Int, Field(ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRASection(_Section):
    rank: PositiveInt
    alpha: Annotated[Float, Field(gt=0)] | None = None  # the update is scaled by alpha / rank; null: the rank
    targets: list[str] = Field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])


class RopeScalingSection(_Section):
    rope_type: Literal["llama3"] = "llama3"
    factor: Annotated[Float, Field(gt=0)]
    low_freq_factor: Annotated[Float, Field(gt=0)]
    high_freq_factor: Annotated[Float, Field(gt=0)]
    original_max_position_embeddings: PositiveInt


class ModelConfig(_Section):
    target: str | None = None  # "package.module:name": the user's model instead of the shipped GPT
    kwargs: dict = Field(default_factory=dict)  # passed to model.target
    rng_streams: list[str] | None = None  # a Linen model.target's make_rng streams, keyed each step; null: [dropout]
    preset: str = "tiny"  # this and the keys below: the shipped GPT only
    d_model: Int | None = None
    n_layers: Int | None = None
    n_heads: Int | None = None
    d_ff: Int | None = None
    seq_len: Int | None = None
    vocab_size: Int | None = None  # default: 256 bytes, or the vocabulary of data.tokens
    remat: str | None = None  # the GPT config owns the valid policies and checks them
    n_kv_heads: PositiveInt | None = None  # key/value heads (grouped-query attention); null: model.n_heads
    head_dim: PositiveInt | None = None  # the size of a head; null: d_model / n_heads
    norm_eps: Annotated[Float, Field(gt=0)] | None = None  # RMSNorm's epsilon; null: 1e-6
    rope_base: Annotated[Float, Field(gt=0)] | None = None  # the rotary base (rope_theta); null: 10000
    rope_scaling: RopeScalingSection | None = None  # Llama 3.1's: factor, low/high_freq_factor, original length
    qkv_bias: StrictBool | None = None  # biases on q, k and v (Qwen2); null: none
    tie_embeddings: StrictBool | None = None  # the head is the embedding transposed (Llama 3.2); null: untied
    lora: LoRASection | None = None  # rank, alpha (null: the rank), targets (default: all seven); they alone train


class ZeroConfig(_Section):
    stage: Int = 3
    engine: str = "gspmd"
    reduce_dtype: str | None = None
    prefetch: StrictBool = False  # stage 3: gather the next layer (shard_map) or FSDP unit (both engines) one ahead
    reshard_after_forward: StrictBool = True  # stage 3, False: gather once per step, keep across micro-batches
    offload: str = "none"  # "optimizer": fp32 master + optimizer state in host memory; "optimizer+params"
    quantize_weights: Literal["int8", "fp8"] | None = None  # ZeRO++ qwZ, shard_map stage 3
    quantize_grads: Literal["int8"] | None = None  # ZeRO++ qgZ, shard_map stages 1-3
    quantize_block: PositiveInt = 256  # elements per quantization scale
    hierarchical: StrictBool = False  # ZeRO++ hpZ, shard_map stage 3 on a data x fsdp mesh
    checked_update: StrictBool = False  # also refuse a non-finite new state: two optimizer passes
    # stage 3, mesh.pipeline > 1: gather the stage weights once per step, or each layer per microbatch
    pipeline_gather: Literal["per_step", "per_microbatch"] = "per_step"
    whole_micro_batches: StrictBool = False  # gspmd, grad_accum > 1: each micro-batch whole, reduced as made


class MeshConfig(_Section):
    data: Int = 1
    fsdp: Int | None = None  # default: every device not on `pipeline`, `data` or `tensor`
    tensor: Int = 1  # tensor parallelism: the parameter dimensions `rules` map to it (docs/parallelism.md)
    pipeline: Int = 1  # pipeline stages: the model's stack of blocks split into consecutive layers
    pipeline_repeats: PositiveInt = 1  # layer chunks per pipeline device: more than 1 runs the circular schedule
    # default: vocab, heads, kv_heads and mlp on tensor
    rules: dict[str, str | list[str] | None] | None = None  # a name -> a mesh axis, a list of them, or null
    # the residual stream between blocks split over `tensor` along the sequence (the rule seq -> tensor)
    sequence_parallel: StrictBool = False


class OptimizerConfig(_Section):
    name: str = "adamw"
    lr: Annotated[Float, Field(gt=0)] = 3e-3
    weight_decay: Annotated[Float, Field(ge=0)] = 0.0
    b1: Annotated[Float, Field(ge=0, lt=1)] = 0.9  # 1 would never forget: updates become NaN
    b2: Annotated[Float, Field(ge=0, lt=1)] = 0.95
    warmup_steps: NonNegativeInt = 0
    grad_clip: Annotated[Float, Field(gt=0)] | None = 1.0


class TrainConfig(_Section):
    steps: PositiveInt = 30
    batch_size: PositiveInt = 16  # global, split over mesh data x fsdp
    grad_accum: PositiveInt = 1  # micro-batches per step, batch_size / grad_accum rows each
    microbatches: PositiveInt | None = None  # mesh.pipeline > 1: GPipe microbatches per step (default: one a stage)
    seed: NonNegativeInt = 0  # an unsigned PRNG seed
    eval_every: NonNegativeInt = 0  # 0: evaluate only at the end
    eval_batches: PositiveInt = 2
    max_bad_steps: PositiveInt = 3
    tensorboard: StrictBool | None = None  # event files beside metrics.jsonl; None: when tensorboard is installed
    init_from: str | None = None  # params (.npz of zerojax export or import) a fresh run starts from, not random
    trainable: str | None = None  # a regex over param paths: only those train; None: all (or the nnx.LoRAParams)


class DataConfig(_Section):
    target: str | None = None  # "package.module:name", called as name(seed=, batch_size=, **kwargs)
    kwargs: dict = Field(default_factory=dict)
    eval_kwargs: dict | None = None  # with data.target: an eval source from seed + 1 and kwargs | eval_kwargs
    path: str | None = None  # None: the Python standard library's own sources
    tokens: str | None = None  # a `zerojax tokenize` OUT folder: train on its token files instead of data.path
    max_bytes: Annotated[Int, Field(gt=0)] = 16 * 2**20
    eval_fraction: Annotated[Float, Field(ge=0, lt=1)] = 0.05


class LossConfig(_Section):
    target: str | None = None  # "package.module:name": (outputs, batch) -> loss; default cross entropy


class CheckpointConfig(_Section):
    dir: str | None = None  # default: OUT/checkpoints
    every: NonNegativeInt = 0  # steps; 0 = off
    keep: PositiveInt = 2


XlaFlag = Annotated[str, Field(pattern=r"^--[A-Za-z0-9_]+(=\S*)?$")]


class XlaConfig(_Section):
    # Compiler flags a pod config needs; applied before JAX starts, and overridden by the
    # environment's own XLA_FLAGS / LIBTPU_INIT_ARGS (which come after them).
    flags: list[XlaFlag] = Field(default_factory=list)  # XLA_FLAGS: the CPU and GPU compilers
    libtpu_flags: list[XlaFlag] = Field(default_factory=list)  # LIBTPU_INIT_ARGS: the TPU compiler


class Config(_Section):
    precision: str = "fp32"
    model: ModelConfig = Field(default_factory=ModelConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    xla: XlaConfig = Field(default_factory=XlaConfig)

    def to_dict(self) -> dict:
        return self.model_dump()


# ---- parsing --------------------------------------------------------------------------------------


def _section(loc: tuple) -> type[BaseModel] | None:
    """The model class at a location of the config tree (None below a leaf)."""
    cls = Config
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        cls = field.annotation if field is not None else None  # type: ignore[assignment]
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
    return cls


def _one_sentence(error: ValidationError) -> str:
    """pydantic's first error as one sentence naming the dotted key, what is valid and the value."""
    e = error.errors(include_url=False)[0]
    loc = tuple(e["loc"])
    key = ".".join(str(p) for p in loc)
    if e["type"] == "extra_forbidden":
        section = _section(loc[:-1])
        valid = ", ".join(section.model_fields) if section else "none"
        return f"unknown config key {key!r}; valid keys here are: {valid}."
    if e["type"] == "model_type":
        return f"{key or 'the config'} must be a mapping, got {e['input']!r}."
    if e["type"] == "string_pattern_mismatch":
        return f"{'.'.join(str(p) for p in loc[:-1])} entries must look like --name=value, got {e['input']!r}."
    what = e["msg"].removeprefix("Input should be ").split(", ")[0]  # "a valid integer, unable to parse ..."
    return f"{key} must be {what}, got {e['input']!r}."


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {dotted!r}: {part!r} is not a section.")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    """'optimizer.lr=1e-3' -> ('optimizer.lr', 0.001), values parsed as YAML scalars."""
    if "=" not in text:
        raise UserError(f"--set expects KEY=VALUE, got {text!r}.")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"config file {path!r} does not exist.")
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except UnicodeDecodeError as e:
            raise UserError(
                f"config file {path!r} is not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8."
            ) from None
        except OSError as e:
            raise UserError(f"config file {path!r} cannot be read: {e.strerror or e}.") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise UserError(f"config file {path!r} is not valid YAML{line}.") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path!r} must hold a mapping of sections, got {type(raw).__name__}.")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    try:
        config = Config.model_validate(raw)
    except ValidationError as e:
        raise UserError(_one_sentence(e)) from None
    validate(config)
    return config


# ---- validation -----------------------------------------------------------------------------------


def validate(c: Config) -> None:
    """The rules beyond each key's own type and bounds, each asked of the module that owns it."""
    from zerojax.core.axis_rules import as_rules
    from zerojax.core.mesh import check_batch, check_sizes
    from zerojax.core.offload import check_mode
    from zerojax.core.optim import get_optimizer
    from zerojax.core.precision import get_precision
    from zerojax.core.stages import get_stage
    from zerojax.engines import ENGINES, check_name
    from zerojax.engines.accum import check_accum_batch

    get_precision(c.precision, c.zero.reduce_dtype)
    get_stage(c.zero.stage)
    check_mode(c.zero.offload)
    check_name(c.zero.engine, ENGINES)  # a config names a built-in engine
    get_optimizer(c.optimizer.name)
    from zerojax.train.tensorboard import check_setting

    check_setting(c.train.tensorboard)
    check_sizes(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    as_rules(c.mesh.rules)
    if c.mesh.sequence_parallel and c.mesh.tensor == 1:
        raise UserError("mesh.sequence_parallel splits the sequence over the tensor axis; it needs mesh.tensor > 1.")
    if c.model.kwargs and not c.model.target:
        raise UserError(
            "model.kwargs needs a model.target to pass them to; the shipped GPT takes model.preset, "
            "model.d_model, ... instead."
        )
    if c.model.rng_streams is not None and not c.model.target:
        raise UserError("model.rng_streams names a model.target's RNG streams; the shipped GPT keys its own.")
    gpt_only = [
        k
        for k in ModelConfig.model_fields
        if k not in ("target", "kwargs", "rng_streams", "preset")
        if c.model.target and getattr(c.model, k) is not None
    ]
    if gpt_only:
        raise UserError(
            f"model.{gpt_only[0]} configures the shipped GPT, not model.target={c.model.target!r}: pass "
            "your model's sizes through model.kwargs, and rematerialise inside it (nnx.remat, nn.remat)."
        )
    if (c.data.kwargs or c.data.eval_kwargs is not None) and not c.data.target:
        raise UserError("data.kwargs and data.eval_kwargs need a data.target to pass them to.")
    if c.data.tokens is not None and (c.data.target or c.data.path is not None):
        raise UserError("data.tokens replaces data.path and data.target; set only one of them.")
    if not c.model.target and not c.data.target:
        from zerojax.data.tokens import model_vocab

        model_vocab(c.data.tokens, c.model.vocab_size)  # the token files are sound and fit the model
    from zerojax.cli.user_code import import_target

    for key, text in (("model.target", c.model.target), ("data.target", c.data.target), ("loss.target", c.loss.target)):
        if text is not None:
            import_target(text, key)  # importable and callable: fails here, before JAX starts
    if c.mesh.fsdp is not None:
        check_batch(c.train.batch_size, c.mesh.data * c.mesh.fsdp)
        check_accum_batch(c.train.batch_size, c.mesh.data * c.mesh.fsdp, c.train.grad_accum)
    elif c.train.batch_size % c.train.grad_accum:
        check_accum_batch(c.train.batch_size, 1, c.train.grad_accum)
