"""Rematerialisation policies by name: which activations a block keeps for the backward pass.

The transformer layers name their projections' outputs with `jax.ad_checkpoint.checkpoint_name`
(`QKV_PROJ`, `CONTEXT`, `OUT_PROJ`, `MLP_IN`, `MLP_OUT`); a policy chooses among them
as MaxText's `remat_policy` does, and may move what it keeps to host memory.
"""

from __future__ import annotations

from typing import Any, Literal

import jax

from .._errors import LayerConfigError

QKV_PROJ = "qkv_proj"
"""The fused query/key/value projection's output, `[..., T, 3 D/tp]`."""
CONTEXT = "context"
"""The attention context (before the output projection), `[..., T, D/tp]`."""
OUT_PROJ = "out_proj"
"""The attention output projection's output (reduced over tp), `[..., T(/tp), D]`."""
MLP_IN = "mlpwi"
"""The MLP up-projection's output, `[..., T, F/tp]` (`2 F/tp` with SwiGLU)."""
MLP_OUT = "mlpwo"
"""The MLP down-projection's output (reduced over tp), `[..., T(/tp), D]`."""

RematName = Literal["none", "full", "dots", "minimal", "minimal_with_context"]
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots", "minimal", "minimal_with_context")
"""The names `remat_policy` knows."""

_SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "minimal": (QKV_PROJ, OUT_PROJ, MLP_IN, MLP_OUT),
    "minimal_with_context": (QKV_PROJ, CONTEXT, OUT_PROJ, MLP_IN, MLP_OUT),
}

# Collectives whose outputs a policy can keep instead of sending them again.
COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "reduce_scatter",
        "ppermute",
        "all_to_all",
        "ragged_all_to_all",
    }
)


def _collective_axes(params: dict[str, Any]) -> frozenset[str]:
    axes = params.get("axes", params.get("axis_name", ()))
    return frozenset((axes,) if isinstance(axes, str) else axes)


def save_collectives_except(axis_name: str | None) -> Any:
    """A `jax.checkpoint` policy: keep every collective's output not over `axis_name`.

    Recomputing a block in the backward pass would send its tensor-parallel all-reduces,
    sequence-parallel gathers and expert all-to-alls a second time; keeping their outputs
    (one activation each) means only local computation is redone. Collectives over
    `axis_name` (an FSDP axis, whose gathers are re-done on purpose) are not kept;
    `None` keeps all.
    """

    def policy(prim: Any, *_: Any, **params: Any) -> bool:
        return prim.name in COLLECTIVES and (
            axis_name is None or axis_name not in _collective_axes(params)
        )

    return policy


def _offload_supported() -> bool:
    """Whether the default backend has pinned host memory to offload activations to."""
    if jax.default_backend() == "cpu":
        return False
    device = jax.devices()[0]
    return any(m.kind == "pinned_host" for m in device.addressable_memories())


def remat_policy(name: str, *, offload: bool = False) -> Any:
    """The `jax.checkpoint` policy of a rematerialisation policy named as MaxText names them.

    - `"none"`: no rematerialisation (returns `None`: do not wrap in `jax.checkpoint`).
    - `"full"`: keep nothing; the block's forward runs again in the backward pass.
    - `"dots"`: keep every matrix product without batch dimensions.
    - `"minimal"`: keep the projections' outputs (fused QKV, attention output
      projection, MLP up and down projections); recompute the rest (norms, rotary,
      the attention itself, activations).
    - `"minimal_with_context"`: `"minimal"` plus the attention context.

    The two `minimal` policies also keep the outputs of the block's collectives
    (tensor-parallel reductions, sequence-parallel gathers), so that recomputation sends
    nothing again. With `offload=True` the activations they keep go to the host's
    pinned memory (GPU and TPU backends); see the training guide.

    **Arguments:**

    - `name`: one of `REMAT_POLICIES`.
    - `offload`: move the kept named activations to host memory.

    **Returns:**

    A policy for `jax.checkpoint` / `eqx.filter_checkpoint`, or `None` for `"none"`.

    **Raises:**

    `LayerConfigError` for an unknown name, for `offload` with a policy that keeps no
    named activation, or for `offload` on a backend without pinned host memory (the CPU).
    """
    if name not in REMAT_POLICIES:
        raise LayerConfigError(
            f"remat={name!r} is not a rematerialisation policy; choose one of "
            f"{', '.join(REMAT_POLICIES)}."
        )
    if offload and name not in _SAVED_NAMES:
        raise LayerConfigError(
            f"remat={name!r} with offload: only the named policies "
            f"({', '.join(_SAVED_NAMES)}) keep activations that can be offloaded to host memory."
        )
    if offload and not _offload_supported():
        raise LayerConfigError(
            f"remat={name!r} with offload: the {jax.default_backend()!r} backend has no pinned "
            f"host memory to offload saved activations to (offloading is supported on GPU and "
            f"TPU backends, not on the CPU); drop the offload option."
        )
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    names = list(_SAVED_NAMES[name])
    if offload:
        named = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=names,
            offload_src="device",
            offload_dst="pinned_host",
        )
    else:
        named = jax.checkpoint_policies.save_only_these_names(*names)
    collectives = save_collectives_except(None)

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        # A collective's output is kept (on the device); a named one as `named` says.
        return True if collectives(prim, *args, **params) else named(prim, *args, **params)

    return policy
