"""Typed experiment config: YAML plus dotted `--set key=value` overrides, validated once.

Every error is a `UserError` whose one sentence names the key, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field

import yaml

from zerojax.errors import UserError


@dataclass
class ModelConfig:
    preset: str = "tiny"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    seq_len: int | None = None
    remat: str | None = None


@dataclass
class ZeroConfig:
    stage: int = 3
    engine: str = "gspmd"
    reduce_dtype: str | None = None
    prefetch: bool = False  # shard_map stage 3: gather layer i+1 while layer i computes


@dataclass
class MeshConfig:
    data: int = 1
    fsdp: int | None = None  # default: every device not on `data` or `tensor`
    tensor: int = 1


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    warmup_steps: int = 0
    grad_clip: float | None = 1.0


@dataclass
class TrainConfig:
    steps: int = 30
    batch_size: int = 16  # global, split over mesh data x fsdp
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 2
    max_bad_steps: int = 3


@dataclass
class DataConfig:
    path: str | None = None  # None: the Python standard library's own sources
    max_bytes: int = 16 * 2**20
    eval_fraction: float = 0.05


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: OUT/checkpoints
    every: int = 0  # steps; 0 = off
    keep: int = 2


@dataclass
class XlaConfig:
    # Compiler flags a pod config needs; applied before JAX starts, and overridden by the
    # environment's own XLA_FLAGS / LIBTPU_INIT_ARGS (which come after them).
    flags: list[str] = field(default_factory=list)  # XLA_FLAGS: the CPU and GPU compilers
    libtpu_flags: list[str] = field(default_factory=list)  # LIBTPU_INIT_ARGS: the TPU compiler


@dataclass
class Config:
    precision: str = "fp32"
    model: ModelConfig = field(default_factory=ModelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- parsing --------------------------------------------------------------------------------------


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value, annotation):
    """Check `value` against a field's annotation; ints pass for floats, '1e-3' strings for numbers."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (annotation,)
    if value is None and type(None) in options:
        return None
    if typing.get_origin(annotation) is list:  # only list[str] so far (compiler flags)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise UserError(f"{key} must be a list of strings, got {value!r}.")
    for opt in options:
        if opt is bool and isinstance(value, bool):
            return value
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if opt is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if opt is str and isinstance(value, str):
            return value
    if isinstance(value, str):  # YAML reads 3e-4 as a string; accept numeric text for number fields
        for opt in options:
            try:
                if opt is int:
                    return int(value)
                if opt is float:
                    return float(value)
            except ValueError:
                pass
    names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise UserError(f"{key} must be {names}, got {value!r}.")


def _build(cls, data, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"{prefix.rstrip('.') or 'the config'} must be a mapping, got {data!r}.")
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types:
            raise UserError(f"unknown config key {full!r}; valid keys here are: {', '.join(types)}.")
        annotation = types[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, annotation)
    return cls(**kwargs)


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


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise UserError(f"config file {path!r} does not exist.")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise UserError(f"config file {path!r} is not valid YAML{line}.") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path!r} must hold a mapping of sections, got {type(raw).__name__}.")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    config = _build(Config, raw, "")
    validate(config)
    return config


# ---- validation -----------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def validate(c: Config) -> None:
    from zerojax.engines import ENGINES

    _require(c.precision in ("fp32", "bf16"), f"precision must be 'fp32' or 'bf16', got {c.precision!r}.")
    _require(c.zero.stage in (0, 1, 2, 3), f"zero.stage must be 0, 1, 2 or 3, got {c.zero.stage!r}.")
    _require(c.zero.engine in ENGINES, f"zero.engine must be one of {', '.join(ENGINES)}, got {c.zero.engine!r}.")
    _require(c.zero.reduce_dtype in (None, "fp32", "bf16"),
             f"zero.reduce_dtype must be fp32, bf16 or null, got {c.zero.reduce_dtype!r}.")
    _require(c.optimizer.name in OPTIMIZERS,
             f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {c.optimizer.name!r}.")
    _require(c.optimizer.lr > 0, f"optimizer.lr must be positive, got {c.optimizer.lr!r}.")
    _require(c.optimizer.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {c.optimizer.weight_decay!r}.")
    _require(c.optimizer.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {c.optimizer.warmup_steps!r}.")
    _require(c.optimizer.grad_clip is None or c.optimizer.grad_clip > 0,
             f"optimizer.grad_clip must be positive or null, got {c.optimizer.grad_clip!r}.")
    for key in ("steps", "batch_size", "log_every", "eval_batches", "max_bad_steps"):
        value = getattr(c.train, key)
        _require(value >= 1, f"train.{key} must be a positive integer, got {value!r}.")
    _require(c.train.eval_every >= 0, f"train.eval_every must be >= 0, got {c.train.eval_every!r}.")
    for key in ("data", "tensor"):
        value = getattr(c.mesh, key)
        _require(value >= 1, f"mesh.{key} must be a positive integer, got {value!r}.")
    _require(c.mesh.fsdp is None or c.mesh.fsdp >= 1, f"mesh.fsdp must be a positive integer, got {c.mesh.fsdp!r}.")
    _require(c.mesh.tensor == 1, f"mesh.tensor must be 1 (tensor parallelism is reserved), got {c.mesh.tensor!r}.")
    if c.mesh.fsdp is not None:
        dp = c.mesh.data * c.mesh.fsdp
        _require(c.train.batch_size % dp == 0,
                 f"train.batch_size={c.train.batch_size} is not divisible by the data-parallel size {dp} "
                 f"(mesh.data x mesh.fsdp).")
    _require(0 <= c.data.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {c.data.eval_fraction!r}.")
    _require(c.data.max_bytes > 0, f"data.max_bytes must be positive, got {c.data.max_bytes!r}.")
    _require(c.checkpoint.every >= 0, f"checkpoint.every must be >= 0, got {c.checkpoint.every!r}.")
    _require(c.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {c.checkpoint.keep!r}.")
    _require(c.model.remat in (None, "full", "dots", "none"),
             f"model.remat must be full, dots or none, got {c.model.remat!r}.")
    for key in ("flags", "libtpu_flags"):
        for flag in getattr(c.xla, key):
            _require(re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", flag) is not None,
                     f"xla.{key} entries must look like --name=value, got {flag!r}.")


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "adafactor")


def build_optimizer(c: OptimizerConfig, total_steps: int):
    """The optax transformation a config names, with warm-up then cosine decay."""
    import optax

    if c.warmup_steps:
        lr = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup_steps, max(total_steps, c.warmup_steps + 1))
    else:
        lr = c.lr
    base = {
        "adamw": lambda: optax.adamw(lr, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay),
        "adam": lambda: optax.adam(lr, b1=c.b1, b2=c.b2),
        "sgd": lambda: optax.sgd(lr),
        "sgd_momentum": lambda: optax.sgd(lr, momentum=c.b1),
        "adafactor": lambda: optax.adafactor(lr),
    }[c.name]()
    return optax.chain(optax.clip_by_global_norm(c.grad_clip), base) if c.grad_clip else base
