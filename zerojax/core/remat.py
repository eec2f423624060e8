"""Activation-checkpoint (remat) policies of the shipped GPT, `zj.Stacked` and FSDP units, by name.
The names and their check import no JAX: config validation and the planner (`zerojax.accounting`,
which must not start JAX) read them here too; JAX is imported by the functions that apply a policy.

  none     no remat: every intermediate of the forward is kept for the backward.
  dots     save the weight matmuls' outputs (`dots_with_no_batch_dims_saveable`), recompute the rest.
  full     save nothing inside a layer: only its input; the backward re-runs the layer's forward.
  offload  what `dots` saves, kept in host memory (`pinned_host`) between the forward and the
           backward instead of on the device (`offload_dot_with_no_batch_dims`): device memory as
           `full`, recompute as `dots`, plus a host<->device copy of those bytes each way.

`offload` needs a backend that places arrays in host memory from inside a compiled program (GPU,
TPU). XLA:CPU does not: JAX lowers the policy's `device_put` to the host as the identity on CPU
(`jax/_src/dispatch.py` registers the memory-kind lowering for "tpu" and "gpu" only, jax 0.10.2
and 0.12), so the residuals would silently stay in device memory. `remat` therefore raises a
`UserError` for `offload` when the default backend is the CPU rather than pretend.
"""

from __future__ import annotations

from collections.abc import Callable

from zerojax.errors import UserError

REMAT_POLICIES = ("full", "dots", "none", "offload")


def check(policy: str, key: str = "model.remat") -> str:
    """`policy` itself, or a `UserError` naming the valid policies."""
    if policy not in REMAT_POLICIES:
        raise UserError(f"{key} must be one of {REMAT_POLICIES}, got {policy!r}.")
    return policy


OFFLOAD_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def platform() -> str:
    """The backend a traced layer will run on (tests stand in another to lower for a GPU)."""
    import jax

    return jax.default_backend()


def checkpoint_policy(policy: str):
    """The `jax.checkpoint` policy for a name (None: save nothing); `none` has no policy at all."""
    import jax

    check(policy)
    if policy == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if policy == "offload":
        backend = platform()
        if backend not in OFFLOAD_PLATFORMS:
            raise UserError(
                f"remat=offload keeps saved activations in host memory, which the {backend} backend "
                "cannot place from a compiled program (JAX lowers the move to the host as a no-op there); "
                "use remat=full for the same device memory on CPU, or run on a GPU or TPU."
            )
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host")
    return None


def unit_policy(remat, reshard: bool):
    """What an FSDP unit saves for its backward pass (`WrapRule.remat`): "full", "none" or a
    `jax.checkpoint` policy. None: "full" when the unit reshards after its forward (its backward
    re-runs it to gather the weights again anyway), else "none"."""
    if remat is None:
        return "full" if reshard else "none"
    if callable(remat):
        return remat
    check(remat, key="WrapRule.remat")
    return remat if remat in ("full", "none") else checkpoint_policy(remat)


def remat(body: Callable, policy: str) -> Callable:
    """`body` (a scanned layer) rematerialised under `policy`."""
    import jax

    if check(policy) == "none":
        return body
    # prevent_cse=False: the callers scan the body, and the scan already blocks CSE.
    return jax.checkpoint(body, policy=checkpoint_policy(policy), prevent_cse=False)
