"""The resume rules of `zj.fit`: whether a run resumes and from which checkpoint, whether that
checkpoint was trained on the same trajectory (config, or seed without one), and which metrics.jsonl
records a resumed run keeps. A resume may change where and how the run goes on, never what it computes.
"""

from __future__ import annotations

import json
import math
import os

from zerojax.errors import UserError
from zerojax.log import warn
from zerojax.train import checkpoint

# Keys that may change between a run and its resume: where and how the same computation runs, when
# it is saved, and how long it goes on. Every other key changes the trajectory (model, optimizer,
# learning rate and schedule, batch size, data, seed, precision) and stops the resume. A pipeline's
# microbatches sum the same gradient (its blocks hold no dropout or BatchNorm state), as the mesh.
SAFE_ON_RESUME = (
    "zero.",
    "mesh.",
    "checkpoint.",
    "xla.",
    "train.microbatches",
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "train.max_bad_steps",
    "train.tensorboard",
)


def step_to_resume(ckpt_dir: str, *, resume: bool, writes_checkpoints: bool) -> int | None:
    """The step of the latest complete checkpoint in `ckpt_dir` when resuming from it, else None
    (a fresh start). Refuses to start over checkpoints a new run would mix its own with."""
    steps = checkpoint.complete_steps(ckpt_dir)
    if steps and not resume and writes_checkpoints:
        raise UserError(
            f"{ckpt_dir} already holds checkpoints (latest step {steps[-1]}); pass --resume to "
            "continue from it, or choose another --out or checkpoint.dir."
        )
    if resume and not writes_checkpoints:
        warn("checkpoint.every=0: this run writes no checkpoints to resume from later.")
    if not (resume and steps):
        if resume:
            warn(f"no complete checkpoint in {ckpt_dir} yet; starting from scratch.")
        return None
    return steps[-1]


def check_checkpoint_matches(
    meta: dict,
    *,
    step_dir: str,
    ckpt_dir: str,
    seed: int,
    config: dict | None,
    mesh: dict,
    defaults: dict | None = None,
) -> None:
    """Stop a resume from a checkpoint (its metadata `meta`) trained on another trajectory: compare
    the configs when both are known, else the init seeds."""
    if isinstance(meta.get("config"), dict) and config is not None:
        check_resume_config(meta["config"], config, step_dir, meta.get("mesh"), mesh, defaults)
    elif meta.get("seed") != seed:
        raise UserError(
            f"train.seed={seed} differs from the seed {meta.get('seed')} the checkpoint in "
            f"{ckpt_dir} was trained with; resume with --set train.seed={meta.get('seed')}."
        )


def check_resume_config(
    saved: dict,
    current: dict,
    step_dir: str,
    saved_mesh: dict | None = None,
    mesh: dict | None = None,
    defaults: dict | None = None,
) -> None:
    """Stop a resume that changes the trajectory (naming each key and both values); warn about the
    safe changes it makes, a new device count or mesh among them. A longer or shorter `train.steps`
    rebuilds the learning-rate schedule over the new total, so with warm-up and cosine decay the rate
    from the resumed step on follows it."""
    # A key the checkpoint's config predates (e.g. train.grad_accum) held its default (`defaults`) there.
    old, new = {**_flat(defaults or {}), **_flat(saved)}, _flat(current)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    fatal = [k for k in changed if not _safe(k)]
    if fatal:
        what = "; ".join(f"{k} is {new.get(k)!r} here but {old.get(k)!r} in the checkpoint" for k in fatal)
        raise UserError(
            f"cannot resume from {step_dir!r} with a config that changes the training trajectory: "
            f"{what}. Resume with the checkpoint's values, or start a new run in another --out."
        )
    changes = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed]
    if saved_mesh and mesh and {k: int(v) for k, v in saved_mesh.items()} != {k: int(v) for k, v in mesh.items()}:
        changes.insert(0, f"devices {_describe_mesh(saved_mesh)} -> {_describe_mesh(mesh)}")
    if changes:
        note = "; the learning-rate schedule now spans the new train.steps" if "train.steps" in changed else ""
        warn("resuming with changed settings: " + ", ".join(changes) + note + ".")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def _describe_mesh(mesh: dict) -> str:
    sizes = [f"{axis} {int(n)}" for axis, n in mesh.items() if int(n) > 1]
    return f"{math.prod(int(n) for n in mesh.values())} ({' x '.join(sizes) or 'one device'})"


def continue_metrics(path: str, step: int) -> list[dict]:
    """Keep the records of steps 1..`step` (those the checkpoint includes) and rewrite the file with
    exactly them: steps after the checkpoint are trained again, a torn last line is dropped."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                    kept.append(record)
    kept = list({r["step"]: r for r in kept}.values())  # one record per step, the last written wins
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)  # atomic: a crash here leaves the old or the new file, never half
    return kept
