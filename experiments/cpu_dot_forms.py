"""Why `shard_map` steps run slower than `gspmd` on XLA:CPU with jax 0.12: the weight-gradient dot.

    python -m experiments.cpu_dot_forms     # prints, per engine, each dot of the compiled program and its time

A two-layer scanned, rematerialised `tanh(h @ w)` stack in bf16, differentiated on 8 simulated CPU
devices, once partitioned by GSPMD from shardings and once written per device with `jax.shard_map`
(gradients averaged with `pmean`). JAX emits the same weight-gradient `dot_general` followed by a
`transpose` in both. Under GSPMD the partitioner puts an all-reduce between the two; under
`shard_map` nothing separates them, so XLA's algebraic simplifier folds the transpose into the dot
(`lhs_contracting_dims={0}`), and XLA:CPU in jaxlib 0.12 keeps such a dot out of its YNNPACK
fusions, running it on a slower path. jaxlib 0.10 upcasts these dots to f32 and fuses them either way.
The third program is the `shard_map` one compiled without the algebraic simplifier
(`compiler_options={"xla_disable_hlo_passes": "algsimp"}`): its weight-gradient dot keeps JAX's
canonical form, and it runs as fast as `gspmd`.

The last two are stage 3 as the `shard_map` engine writes it: each layer's weight is gathered inside
the layer and its gradient reduce-scattered in the layer's backward (a `custom_vjp`), once as is and
once as its transpose (`zerojax.engines.collectives._transposed`): the transpose cancels JAX's, so
the dot keeps the canonical form with the default compiler passes.
"""

from __future__ import annotations

import collections
import os
import re
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LAYERS, WIDTH, ROWS, SEQ = 2, 512, 16, 128


def loss(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def per_device(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    return jax.lax.pmean(value, "d"), jax.lax.pmean(grads, "d")


def _stage_3_gather(transposed: bool):
    """A layer's weight shard -> the whole weight; backward: its gradient reduce-scattered over "d"
    (as its transpose, then transposed back, when `transposed`)."""

    def scatter(ct):
        if transposed:
            return jax.lax.psum_scatter(ct.T, "d", scatter_dimension=1, tiled=True).T / jax.lax.axis_size("d")
        return jax.lax.psum_scatter(ct, "d", scatter_dimension=0, tiled=True) / jax.lax.axis_size("d")

    gather = jax.custom_vjp(lambda w: jax.lax.all_gather(w, "d", axis=0, tiled=True))
    gather.defvjp(lambda w: (gather(w), None), lambda _, ct: (scatter(ct),))
    return gather


def stage_3(transposed: bool):
    def local(ws, x):
        def layered(ws, x):
            def layer(h, w):
                return jnp.tanh(h @ _stage_3_gather(transposed)(w)), None

            h, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
            return jnp.mean(h.astype(jnp.float32) ** 2)

        value, grads = jax.value_and_grad(layered)(ws, x)
        return jax.lax.pmean(value, "d"), grads

    return local


def dot_forms(text: str) -> collections.Counter:
    """(inside a library fusion?, result shape, lhs contracting, rhs contracting) -> count."""
    fused = set(re.findall(r"calls=%?([\w.\-]+)[^\n]*_(?:ynn|xnn)_fusion", text))
    forms, computation = collections.Counter(), None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(", line)
        if head:
            computation = head.group(1)
        dot = re.search(r"= (\S+) dot\(.*lhs_contracting_dims=\{([\d,]*)\}, rhs_contracting_dims=\{([\d,]*)\}", line)
        if dot:
            forms[(computation in fused, re.sub(r"\{[\d,]*\}", "", dot.group(1)), dot.group(2), dot.group(3))] += 1
    return forms


def main() -> None:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    ws = jnp.full((LAYERS, WIDTH, WIDTH), 0.01, jnp.bfloat16)
    x = jax.device_put(jnp.ones((ROWS, SEQ, WIDTH), jnp.bfloat16), NamedSharding(mesh, P("d")))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    programs = {
        "gspmd": jax.jit(
            jax.value_and_grad(loss), in_shardings=(replicated, rows), out_shardings=(replicated, replicated)
        ),
        "shard_map": jax.jit(
            jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()), check_vma=False)
        ),
    }
    compiled = {name: f.lower(ws, x).compile() for name, f in programs.items()}
    compiled["shard_map, no algsimp"] = (
        programs["shard_map"].lower(ws, x).compile(compiler_options={"xla_disable_hlo_passes": "algsimp"})
    )
    sharded = jax.device_put(ws, NamedSharding(mesh, P(None, "d")))
    for name, transposed in (("shard_map stage 3", False), ("shard_map stage 3, transposed reduction", True)):
        program = jax.shard_map(
            stage_3(transposed),
            mesh=mesh,
            in_specs=(P(None, "d"), P("d")),
            out_specs=(P(), P(None, "d")),
            check_vma=False,
        )
        compiled[name] = jax.jit(program).lower(sharded, x).compile()
    inputs = {name: (sharded if "stage 3" in name else ws, x) for name in compiled}
    times = {name: [] for name in compiled}
    for _ in range(9):  # interleaved, so both see the same machine load
        for name, c in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(*inputs[name]))
            times[name].append(time.perf_counter() - t0)
    print(f"jax {jax.__version__}")
    for name, c in compiled.items():
        print(f"{name}: median {np.median(times[name][1:]) * 1e3:.1f} ms")
        for (fused, shape, lhs, rhs), n in sorted(dot_forms(c.as_text()).items()):
            print(
                f"  {n} x {shape} dot, lhs_contracting={{{lhs}}} rhs_contracting={{{rhs}}}, "
                f"{'in a library fusion' if fused else 'NOT in a library fusion'}"
            )
    for name in list(compiled)[1:]:
        ratio = np.median(np.array(times[name][1:]) / np.array(times["gspmd"][1:]))
        print(f"{name} / gspmd (paired median): {ratio:.2f}")


if __name__ == "__main__":
    main()
