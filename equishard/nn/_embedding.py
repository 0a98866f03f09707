"""The parallel embedding: split over the embedding dimension or over the vocabulary."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import is_bound
from .._errors import LayerConfigError
from ..core import mp_gather, mp_reduce, mp_scatter, scatter_tokens
from ..sharding import Sharded
from ._initializers import (
    axis_size,
    check_choice,
    check_divisible,
    check_init_type,
    check_positive,
    check_token_dim,
    init_weight,
    value_of,
)
from ._linear import lora_scale, master_of, matmul_t


class ParallelEmbedding(eqx.Module):
    """A model-parallel embedding table `[num_embeddings, embedding_dim]`.

    - `partition="embedding"` (the PyTorch library's default): each device holds all
      tokens' `embedding_dim / n` features; the looked-up features are all-gathered.
    - `partition="vocab"` (Megatron's vocab-parallel embedding): each device holds
      `num_embeddings / n` rows; ids outside this device's range contribute zero and
      the result is summed over the axis.

    Either way the output is the full embedding, replicated over the axis; with
    `sequence_parallel=True` it is split over the token dimension instead (the last
    dimension of `ids`), ready for a sequence-parallel transformer block: for
    `partition="vocab"` the sum over the axis becomes a reduce-scatter over the tokens.
    Outside any `shard_map` the layer is the plain lookup.

    With `padding_idx`, that row starts at zero and receives no gradient (as in
    `torch.nn.Embedding`). The PyTorch options `max_norm`, `norm_type`,
    `scale_grad_by_freq` and `sparse` have no equivalent here.

    With `lora_rank`, a low-rank update is added as the PyTorch library's LoRA
    embedding (`maybe_lora` on a `ParallelEmbedding`) does:
    `out += (lora_alpha / lora_rank) * lora_a.T[ids] @ lora_b.T`, with `lora_a`
    `[lora_rank, num_embeddings]` starting at zero and `lora_b`
    `[embedding_dim, lora_rank]` drawn from N(0, 1); `lora_b` is split like the
    output features (`partition="embedding"`) or replicated (`partition="vocab"`).

    Fields: `weight` (`Sharded`; spec `P(None, axis)` or `P(axis, None)`), `lora_a`,
    `lora_b` (`Sharded`, or `None` without LoRA).
    """

    weight: Sharded
    lora_a: Sharded | None
    lora_b: Sharded | None
    lora_scale: float = eqx.field(static=True)
    num_embeddings: int = eqx.field(static=True)
    embedding_dim: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    partition: str = eqx.field(static=True)
    padding_idx: int | None = eqx.field(static=True)
    init_type: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        axis_name: str = "tp",
        partition: str = "embedding",
        padding_idx: int | None = None,
        init_type: str = "xavier_normal",
        sequence_parallel: bool = False,
        lora_rank: int | None = None,
        lora_alpha: float = 1.0,
        normal_std: float = 0.01,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `num_embeddings`: the vocabulary size.
        - `embedding_dim`: the embedding size.
        - `axis_name`: the mesh axis the table is split over.
        - `partition`: `"embedding"` (split the features) or `"vocab"` (split the rows).
        - `padding_idx`: a row (negative counts from the end) that starts at zero and
          gets no gradient.
        - `init_type`: see `equishard.nn.init_weight`.
        - `sequence_parallel`: return this device's tokens only (the last dimension of
          `ids` split over the axis) instead of all of them.
        - `lora_rank`, `lora_alpha`: add a LoRA update of this rank, scaled by
          `lora_alpha / lora_rank` (see above); `None`: no LoRA.
        - `normal_std`: the standard deviation of the `"normal"`-family init types
          (the PyTorch library's 0.01; the reference GPT passes 0.02).
        - `dtype`: the table's dtype (default: JAX's default float).
        - `key`: a PRNG key; the global table is built from it (mesh-invariant).
        """
        name = "ParallelEmbedding"
        check_positive(name, "num_embeddings", num_embeddings)
        check_positive(name, "embedding_dim", embedding_dim)
        check_choice(name, "partition", partition, ("embedding", "vocab"))
        check_init_type(name, init_type)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise LayerConfigError(
                    f"{name}: padding_idx={padding_idx} is out of range for "
                    f"num_embeddings={num_embeddings} (expected {-num_embeddings} <= "
                    f"padding_idx < {num_embeddings})."
                )
            padding_idx = padding_idx % num_embeddings
        self.lora_scale = lora_scale(name, lora_rank, lora_alpha)
        # f32[V, D], global
        w = init_weight(key, (num_embeddings, embedding_dim), init_type, dtype=dtype, normal_std=normal_std)
        if lora_rank is not None:
            lora_b = jax.random.normal(jax.random.fold_in(key, 1), (embedding_dim, lora_rank), w.dtype)
            self.lora_a = Sharded(jnp.zeros((lora_rank, num_embeddings), w.dtype), P())
            self.lora_b = Sharded(lora_b, P(axis_name, None) if partition == "embedding" else P())
        else:
            self.lora_a = None
            self.lora_b = None
        if padding_idx is not None:
            w = w.at[padding_idx].set(0)
        spec = P(None, axis_name) if partition == "embedding" else P(axis_name, None)
        self.weight = Sharded(w, spec)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.axis_name = axis_name
        self.partition = partition
        self.padding_idx = padding_idx
        self.init_type = init_type
        self.sequence_parallel = sequence_parallel

    @property
    def master_weight(self) -> Array:
        """The full global table `[num_embeddings, embedding_dim]`; inside `shard_map` gathered."""
        return master_of(self.weight, (self.num_embeddings, self.embedding_dim), self.axis_name)

    def __call__(
        self, ids: Int[Array, "..."], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "... embedding_dim"]:
        """**Arguments:**

        - `ids`: integer token ids of any shape, replicated over the axis.
        - `key`: ignored (the layer is deterministic); keyword-only, so the layer
          composes with `eqx.nn.Sequential` like Equinox's own layers.

        **Returns:**

        The embeddings `[*ids.shape, embedding_dim]`, replicated over the axis; with
        `sequence_parallel`, this device's `[..., tokens/n, embedding_dim]`.
        """
        bound = is_bound(self.axis_name)
        n = axis_size(self.axis_name)
        if bound and self.sequence_parallel:
            check_token_dim("ParallelEmbedding", ids.shape, self.axis_name, feature_dim=False)
        table = value_of(self.weight)
        if self.partition == "embedding":
            check_divisible("ParallelEmbedding", "embedding_dim", self.embedding_dim, self.axis_name, n)
            # f32[V, D/n][ids] -> f32[..., D/n]
            out = jnp.take(table, ids, axis=0)
            # + f32[..., r] @ f32[r, D/n]
            out = self._mask_padding(ids, out + self._lora(ids))
            if bound:
                # f32[..., D/n] -> f32[..., D], replicated
                out = mp_gather(out, -1, axis_name=self.axis_name)
                if self.sequence_parallel:
                    check_divisible("ParallelEmbedding", "the token dimension", out.shape[-2], self.axis_name, n)
                    # f32[..., T, D] -> f32[..., T/n, D]: this device's tokens
                    out = mp_scatter(out, -2, axis_name=self.axis_name)
            return out
        check_divisible("ParallelEmbedding", "num_embeddings", self.num_embeddings, self.axis_name, n)
        rows = self.num_embeddings // n
        start = jax.lax.axis_index(self.axis_name) * rows if bound else 0
        local = ids - start
        mine = (local >= 0) & (local < rows)
        # f32[V/n, D][clip(ids - start)] -> f32[..., D], zero where the id is elsewhere
        # ("clip": the gather clamps the index, without the default mode's mask)
        out = jnp.take(table, local, axis=0, mode="clip")
        out = jnp.where(mine[..., None], out, jnp.zeros((), out.dtype))
        out = self._mask_padding(ids, out)
        # f32[..., D], replicated (zero without LoRA)
        lora = self._mask_padding(ids, self._lora(ids)) if self.lora_a is not None else self._lora(ids)
        if bound and self.sequence_parallel:
            check_divisible("ParallelEmbedding", "the token dimension", out.shape[-2], self.axis_name, n)
            # partial f32[..., T, D] -> f32[..., T/n, D]
            out = scatter_tokens(out, self.axis_name)
            if self.lora_a is not None:
                out = out + mp_scatter(lora, -2, axis_name=self.axis_name)
        elif bound:
            # partial f32[..., D] -> f32[..., D], replicated
            out = mp_reduce(out, axis_name=self.axis_name) + lora
        else:
            out = out + lora
        return out

    def _lora(self, ids: Array) -> Array:
        """`scale * lora_a.T[ids] @ lora_b.T`: f32[..., r] @ f32[r, D (or D/n)]; zero without LoRA."""
        if self.lora_a is None or self.lora_b is None:
            return jnp.zeros((), value_of(self.weight).dtype)
        after_a = jnp.take(value_of(self.lora_a).T, ids, axis=0)  # f32[..., r]
        return self.lora_scale * matmul_t(after_a, value_of(self.lora_b))

    def _mask_padding(self, ids: Array, out: Array) -> Array:
        # The padding row is zero; masking it also stops its gradient.
        if self.padding_idx is None:
            return out
        return jnp.where((ids == self.padding_idx)[..., None], jnp.zeros((), out.dtype), out)
