"""The circular schedule's layer order: a pipeline stage holds the stack's consecutive layers as
stored, and runs chunks `(r p + s) c ...`; `circular_chunks` exchanges one for the other inside the
step (its transpose sends the gradient back), `zerojax.engines.pipeline` runs them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.mesh import PIPELINE_AXIS


def circular_chunks(stacked, stages: int, repeats: int):
    """Inside a region manual over `pipeline`: this device's consecutive share of `stacked` (leaves
    [L / p, ...]) exchanged for its circular chunks, layers (r p + s) c ... for r < `repeats` (c =
    L / (p v)), in one all-to-all over `pipeline` (its transpose sends the gradient back). A device
    sends each of its chunks to the stage that runs it, in slots of ceil(v / p) chunks per stage
    (zeros where it has fewer for that stage)."""
    if repeats == 1:
        return stacked
    send, take = _chunk_tables(stages, repeats)
    me = jax.lax.axis_index(PIPELINE_AXIS)

    def exchange(w):
        chunks = w.reshape(repeats, w.shape[0] // repeats, *w.shape[1:])
        padded = jnp.concatenate([chunks, jnp.zeros_like(chunks[:1])])  # chunk `repeats`: the zero slot
        out = jnp.take(padded, jnp.asarray(send)[me], axis=0)  # [p * slots, c, ...], stage d's at d
        got = jax.lax.all_to_all(out, PIPELINE_AXIS, 0, 0, tiled=True)  # stage s's slots at s
        return jnp.take(got, jnp.asarray(take)[me], axis=0).reshape(w.shape)

    return jax.tree.map(exchange, stacked)


def _chunk_tables(stages: int, repeats: int):
    """(send, take): send[s] lists, slot by slot for each destination stage, the local chunk stage s
    sends there (`repeats`: a zero chunk); take[d][r] is where stage d finds its chunk r among what
    it received. Global chunk q = s v + i (stage s's i-th) is run by stage q mod p as its chunk q // p."""
    p, v = stages, repeats
    slots = -(-v // p)
    send, take = np.full((p, p * slots), v), np.zeros((p, v), dtype=np.int32)
    for s in range(p):
        used = [0] * p
        for i in range(v):
            q = s * v + i
            d = q % p
            send[s, d * slots + used[d]] = i
            take[d, q // p] = s * slots + used[d]
            used[d] += 1
    return send.astype(np.int32), take
