"""Generation from the reference GPT with a key/value cache, under the training layout.

The prompts are prefilled in one pass; then one compiled decode step per token runs
every layer on one new token a row, its attention reading the cache
(`equishard.nn.TransformerBlock.cached`). The cache is preallocated to the maximum
length, per layer `[B, kv_slots, L, head_dim]` for the keys and the values, split over
the batch on the data axes and over the key/value heads on the tensor axis (with more
tensor devices than key/value heads, one slot per device, each holding the head its
query heads read: replicated as the weights are). Sampling keys are per row and per
position, so a seeded generation does not depend on the layout or on the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import is_bound
from .._errors import GenerationError
from ..core import mp_gather
from ..nn import FSDP, PipelineModule, fsdp_gather_params
from ..sharding import drop_leading_axis, filter_shard_map, is_sharded, restrict_specs, shard
from ..sharding._internal import spec_axes
from ._gpt import GPT, TP

GATHER_MODES = ("once", "per_layer")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits.

    **Fields:**

    - `temperature`: `0` for greedy decoding (the most likely token); otherwise the
      logits are divided by it before sampling (must not be negative).
    - `top_k`: keep only the `top_k` most likely tokens (`0`: all).
    - `top_p`: keep the smallest set of most likely tokens whose probability reaches
      `top_p` (nucleus sampling), in `(0, 1]` (`1`: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        """**Raises:** `GenerationError` naming the option out of range."""
        if not self.temperature >= 0:
            raise GenerationError(f"generate: temperature={self.temperature} must be at least 0.")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"generate: top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise GenerationError(f"generate: top_k={self.top_k} must be at least 0 (0: all tokens).")


def sample_token(
    logits: Float[Array, " vocab"], key: PRNGKeyArray, sampling: Sampling, vocab_limit: int
) -> Int[Array, ""]:
    """One token from one row's logits `f32[V]` (ids from `vocab_limit` on never drawn)."""
    logits = logits.astype(jnp.float32)
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab_limit, logits, -jnp.inf)
    if sampling.temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / sampling.temperature
    ordered = jnp.sort(logits)[::-1]  # descending
    if 0 < sampling.top_k < logits.shape[-1]:
        logits = jnp.where(logits < ordered[sampling.top_k - 1], -jnp.inf, logits)
        ordered = jnp.where(jnp.arange(ordered.shape[-1]) < sampling.top_k, ordered, -jnp.inf)
    if sampling.top_p < 1:
        probs = jax.nn.softmax(ordered)
        # Keep a token while the probability before it is short of top_p.
        kept = (jnp.cumsum(probs) - probs) < sampling.top_p
        floor = jnp.min(jnp.where(kept, ordered, jnp.inf))
        logits = jnp.where(logits < floor, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def _check_model(model: GPT) -> None:
    """Refuse, by name, the layouts and models generation does not run under."""
    par, config = model.parallelism, model.config
    what = None
    if par.pipeline or isinstance(model.units, PipelineModule):
        what = f"a pipeline axis {par.pipeline!r} (build the model under a layout without pp)"
    elif par.context:
        what = f"a context axis {par.context!r}"
    elif par.sequence_parallel:
        what = "sequence parallelism"
    elif config.moe_every:
        what = "mixture-of-experts layers"
    if what is not None:
        raise GenerationError(
            f"generate: the reference GPT with {what} is not supported; checkpoints restore "
            f"under any layout, so generate under one of dp, fsdp and tp."
        )


def _has_axis(tree: Any, axis: str) -> bool:
    """Whether some box of `tree` splits an array over `axis`."""
    boxes = jax.tree.leaves(tree, is_leaf=is_sharded)
    return any(is_sharded(b) and axis in spec_axes(b.spec) for b in boxes)


def unstack_units(model: GPT) -> GPT:
    """`model` with its stacked units as a tuple of layers (outside `jit`, global arrays).

    A decode step runs the layers as straight-line code on these: each matrix product
    reads its layer's weights where they lie (a scan over the stack copies each layer's
    slice out first, reading the weights three times over). Compile time grows with
    depth.
    """
    units = model.units
    layers = tuple(
        drop_leading_axis(jax.tree.map(lambda x, i=i: x[i] if eqx.is_array(x) else x, units))
        for i in range(model.config.n_layers)
    )
    return eqx.tree_at(lambda m: m.units, model, layers)


def _stack(
    model: GPT, x: Array, positions: Array, cache: Any = None, slot: Any = None, seen: Any = None
) -> tuple[Array, Any]:
    """The blocks on `x` `[B, S, D]` (local view), the layers of `unstack_units` in turn.

    Under fsdp each layer's parameters are all-gathered before it runs, as in training
    (nothing is gathered for parameters already whole). `cache`: per layer `(k, v)`,
    each `[B, Hkv_local, L, hd]`, or `None` (prefill); `slot`, `seen`: see
    `TransformerBlock.cached`. Returns the hidden states and per layer the new keys and
    values `[B, S, Hkv_local, hd]` (prefill) or the written cache.
    """
    fsdp = model.parallelism.fsdp
    out = []
    for i, unit in enumerate(model.units):
        if isinstance(unit, FSDP):
            unit = unit.module
            if fsdp is not None and is_bound(fsdp) and _has_axis(unit, fsdp):
                unit = fsdp_gather_params(unit, fsdp)
        layer_cache = None if cache is None else cache[i]
        x, kv = unit.blocks[0].cached(x, positions=positions, cache=layer_cache, slot=slot, seen=seen)
        out.append(kv)
    return x, tuple(out)


def _full_logits(model: GPT, h: Array) -> Float[Array, "batch vocab"]:
    """The logits of one hidden state a row, `[B, 1, D] -> f32[B, V]` (gathered over tp)."""
    logits = model.logits(h)[:, 0].astype(jnp.float32)  # f32[B, V/tp]
    if is_bound(TP):
        logits = mp_gather(logits, 1, axis_name=TP)  # f32[B, V], the same on every tp device
    return logits


def _draw(logits: Array, keys: Array, positions: Array, sampling: Sampling, vocab_limit: int) -> Array:
    """Each row's token at its position `positions[b]`: `int32[B]` from `f32[B, V]`.

    `keys`: `uint32[B, 2]`, each row's key data; the draw's key is the row's key folded
    with the position, so it depends on neither the batch nor the layout.
    """

    def one(row: Array, key_data: Array, position: Array) -> Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
        return sample_token(row, key, sampling, vocab_limit)

    return jax.vmap(one)(logits, keys, positions)


def _whole_batch(model: GPT, tokens: Array) -> Array:
    """`int32[B/data] -> int32[B]`, the same on every device: every process can read the
    tokens (a few bytes a row) without a collective of its own."""
    data = tuple(a for a in model.parallelism.data_axes if is_bound(a))
    return mp_gather(tokens, 0, axis_name=data) if data else tokens


def _prefill(
    model: GPT, ids: Array, lengths: Array, keys: Array, *, max_len: int, sampling: Sampling, vocab_limit: int
) -> tuple[Array, Array, Any]:
    """Local view: `ids` `int32[B/data, S]` (right-padded), `lengths` `int32[B/data]`.

    Returns every row's first new token `int32[B]` (whole on every device), its logits
    `f32[B/data, V]` and the cache, per layer `(k, v)`, each `[B/data, Hkv_local, L, hd]`
    (slots from a row's length on hold padding, masked until overwritten).
    """
    batch, seq = ids.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    x = model._gathered(model.embed, ids)(ids)  # f32[B, S, D]
    x, kvs = _stack(model, x, positions)
    # f32[B, S, Hkv, hd] -> f32[B, Hkv, L, hd] per layer
    pad = ((0, 0), (0, 0), (0, max_len - seq), (0, 0))
    cache = jax.tree.map(lambda a: jnp.pad(jnp.swapaxes(a, 1, 2), pad), kvs)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # f32[B, 1, D]
    logits = _full_logits(model, last)
    return _whole_batch(model, _draw(logits, keys, lengths, sampling, vocab_limit)), logits, cache


def _decode(
    model: GPT, cache: Any, tokens: Array, positions: Array, lengths: Array, slot: Array,
    prefilled: Array, keys: Array, *, sampling: Sampling, vocab_limit: int,
) -> tuple[Array, Array, Any]:  # fmt: skip
    """Local view: feed `tokens` `int32[B/data]` at `positions` `int32[B/data]`.

    Every row's token is written into cache slot `slot` (a scalar: one in-place update
    for the batch); a row sees its prompt's slots (`< lengths[b]`) and the decoded ones
    (`prefilled` up to `slot`) and its new token. Returns the next tokens `int32[B]` (at
    `positions + 1`, whole on every device), their logits `f32[B/data, V]` and the
    written cache.
    """
    x = model._gathered(model.embed, tokens)(tokens[:, None])  # f32[B, 1, D]
    slots = jnp.arange(cache[0][0].shape[2], dtype=jnp.int32)[None, :]
    seen = (slots < lengths[:, None]) | ((slots >= prefilled) & (slots < slot))  # bool[B, L]
    x, cache = _stack(model, x, positions[:, None], cache, slot, seen[:, None, :])
    logits = _full_logits(model, x)
    return _whole_batch(model, _draw(logits, keys, positions + 1, sampling, vocab_limit)), logits, cache


@dataclasses.dataclass
class Generation:
    """The result of `Generator.generate`.

    **Fields:**

    - `tokens`: each prompt's new tokens (a stop token included, as the last).
    - `stopped`: whether each row ended on a stop token.
    - `logits`: with `record_logits`, each row's logits `f32[n, V]` for its `n` new tokens;
      else `None`.
    - `prefill_seconds`, `decode_seconds`: wall time of the prefill and the decode steps.
    - `decode_steps`: decode steps run.
    """

    tokens: list[list[int]]
    stopped: list[bool]
    logits: list[np.ndarray] | None
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int


def _check_prompts(prompts: Sequence[Sequence[int]], max_len: int, vocab: int) -> list[list[int]]:
    if not prompts:
        raise GenerationError("generate: no prompts given.")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise GenerationError(f"generate: prompt {i} is empty; give at least one token.")
        if len(p) >= max_len:
            raise GenerationError(
                f"generate: prompt {i} has {len(p)} tokens, longer than max_len={max_len} "
                f"leaves room for (at most {max_len - 1}, then at least one new token)."
            )
        if min(p) < 0 or max(p) >= vocab:
            raise GenerationError(
                f"generate: prompt {i} holds token ids outside [0, {vocab}) (the vocabulary)."
            )
        out.append(p)
    return out


def _prefill_length(longest: int, max_len: int) -> int:
    """The prefill's padded length: `longest` rounded up to a multiple of 16, at most
    `max_len - 1`, so that prompts of many lengths share a few compilations."""
    return min(-(-longest // 16) * 16, max_len - 1)


class Generator:
    """Generation from a `GPT` on its mesh: a compiled prefill and decode step, reused.

    The decode step is compiled once per batch size (the prompts' count rounded up to a
    multiple of the data-parallel size) for the generator's `max_len`; the prefill once
    per batch size and padded prompt length (a multiple of 16, see `generate`). The
    generator holds its own copy of the parameters, the layers taken out of the stack
    (and, with `gather="once"`, whole over fsdp): drop the training state's model to
    free its memory.

    **Arguments:**

    - `model`: a `GPT` whose arrays are placed on `mesh` (e.g. a train state's model),
      under a layout of data (dp), fsdp and tensor (tp) axes.
    - `mesh`: the model's mesh.
    - `max_len`: the cache's length: a prompt and its new tokens fit in it.
    - `sampling`: a `Sampling` (default greedy).
    - `gather`: under fsdp, `"once"` (the default) all-gathers the parameters over the
      fsdp axis before the first step and keeps them whole (over fsdp; still split over
      tp) for every step; `"per_layer"` gathers each layer's parameters inside every
      step, as training does (less memory, every weight sent for every token).
    - `vocab_size`: the tokenizer's vocabulary, at most the model's: ids from it on
      (the model's padding) are never drawn (default: the model's).

    **Raises:**

    `GenerationError` for a pipeline, context or sequence-parallel layout or an MoE
    model, a sampling option out of range, a `gather` mode unknown, a vocabulary larger
    than the model's or a `max_len` below 2.
    """

    def __init__(
        self, model: GPT, mesh: Mesh, *, max_len: int, sampling: Sampling = Sampling(),
        gather: str = "once", vocab_size: int | None = None,
    ):  # fmt: skip
        _check_model(model)
        sampling.check()
        if gather not in GATHER_MODES:
            raise GenerationError(f"generate: gather={gather!r}; expected one of {GATHER_MODES}.")
        vocab = model.config.vocab_size
        if vocab_size is not None and not 1 <= vocab_size <= vocab:
            raise GenerationError(
                f"generate: the tokenizer's vocabulary of {vocab_size} does not fit the "
                f"model's vocabulary of {vocab} (it may be smaller, the rest padding, not larger)."
            )
        if max_len < 2:
            raise GenerationError(f"generate: max_len={max_len} must be at least 2.")
        par = model.parallelism
        if gather == "once" and par.fsdp is not None and _has_axis(model, par.fsdp):
            # Re-placed without the fsdp axis in its specs: an all-gather, once.
            model = shard(restrict_specs(model, [a for a in mesh.axis_names if a != par.fsdp]), mesh)
        model = unstack_units(model)
        self.model, self.mesh, self.max_len, self.sampling = model, mesh, max_len, sampling
        self.vocab_limit = vocab if vocab_size is None else vocab_size
        self.arrays, static = eqx.partition(model, eqx.is_array)
        data = tuple(a for a in par.data_axes if a in mesh.axis_names)
        self.data_size = int(np.prod([mesh.shape[a] for a in data]))
        self.batch_spec = P(data or None)
        tp = TP if TP in mesh.axis_names else None
        self.cache_spec = P(data or None, tp, None, None)
        opts = {"sampling": sampling, "vocab_limit": self.vocab_limit}
        prefill = filter_shard_map(
            lambda m, ids, lengths, keys: _prefill(m, ids, lengths, keys, max_len=max_len, **opts),
            mesh=mesh, in_specs=(None, self.batch_spec, self.batch_spec, self.batch_spec),
            out_specs=(P(), self.batch_spec, self.cache_spec),
        )  # fmt: skip
        rows, scalar = self.batch_spec, P()
        decode = filter_shard_map(
            lambda m, cache, *args: _decode(m, cache, *args, **opts),
            mesh=mesh, in_specs=(None, self.cache_spec, rows, rows, rows, scalar, scalar, rows),
            out_specs=(scalar, rows, self.cache_spec),
        )  # fmt: skip
        self.prefill = jax.jit(lambda arrays, *args: prefill(eqx.combine(arrays, static), *args))
        self.decode = jax.jit(
            lambda arrays, cache, *args: decode(eqx.combine(arrays, static), cache, *args),
            donate_argnums=(1,),
        )

    def _put(self, x: Any, spec: P | None = None) -> Array:
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, self.batch_spec if spec is None else spec))

    def compilations(self) -> dict[str, int]:
        """How many programs the prefill and the decode step have compiled so far."""
        return {
            "prefill": self.prefill._cache_size(),  # pyright: ignore[reportAttributeAccessIssue]
            "decode": self.decode._cache_size(),  # pyright: ignore[reportAttributeAccessIssue]
        }

    def padded_batch(self, n: int) -> int:
        """The batch `n` prompts run in: `n` rounded up to a multiple of the data axes' size."""
        return -(-n // self.data_size) * self.data_size

    def compiled_decode(self, batch: int) -> Any:
        """The decode step compiled for `batch` rows (for its cost and memory analysis)."""
        slots, head_dim = self._cache_heads()
        one = jax.ShapeDtypeStruct((batch, slots, self.max_len, head_dim), jax.tree.leaves(self.arrays)[0].dtype)
        cache = ((one, one),) * self.model.config.n_layers
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        keys = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
        return self.decode.lower(self.arrays, cache, rows, rows, rows, scalar, scalar, keys).compile()

    def _cache_heads(self) -> tuple[int, int]:
        """The cache's global `(kv_slots, head_dim)`."""
        config = self.model.config
        n_kv = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
        tp = self.mesh.shape.get(TP, 1)
        return max(n_kv, tp), config.d_model // config.n_heads

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
        key: PRNGKeyArray | None = None, keys: Sequence[PRNGKeyArray] | None = None,
        stop_tokens: Sequence[int] = (), record_logits: bool = False, on_token: Any = None,
    ) -> Generation:  # fmt: skip
        """Continue each prompt by up to `max_new_tokens` tokens.

        **Arguments:**

        - `prompts`: token ids, one sequence per prompt, of any lengths (at least one
          token each, fewer than `max_len`).
        - `max_new_tokens`: the most tokens a row gets: at most `max_len` less the
          prefill's length (the longest prompt rounded up to a multiple of 16), the
          cache's slots left for decoding.
        - `key`: the sampling key of every row (default `jax.random.key(0)`); rows with
          the same prompt and key draw the same tokens. `keys`: one key per prompt
          instead. A row's draw at position `t` uses `fold_in(its key, t)`, whatever
          the batch and the layout.
        - `stop_tokens`: a row ends after drawing one of these.
        - `record_logits`: keep each step's logits (`Generation.logits`).
        - `on_token`: called as `on_token(row, token)` for each token as it comes.

        **Returns:**

        A `Generation`.

        **Raises:**

        `GenerationError` for an empty prompt, a prompt with no room under `max_len`,
        ids outside the vocabulary, `max_new_tokens < 1` or a count of `keys` that is
        not the prompts'.
        """
        rows = _check_prompts(prompts, self.max_len, self.model.config.vocab_size)
        if max_new_tokens < 1:
            raise GenerationError(f"generate: max_new_tokens={max_new_tokens} must be at least 1.")
        n, b = len(rows), self.padded_batch(len(rows))
        if keys is not None and len(keys) != n:
            raise GenerationError(f"generate: {len(keys)} keys for {n} prompts.")
        row_keys = list(keys) if keys is not None else [jax.random.key(0) if key is None else key] * n
        key_data = np.stack([np.asarray(jax.random.key_data(k)) for k in row_keys + row_keys[:1] * (b - n)])
        rows = rows + rows[:1] * (b - n)  # padding rows: their tokens are dropped
        lengths = np.array([len(r) for r in rows], np.int32)
        prefilled = _prefill_length(int(lengths.max()), self.max_len)
        ids = np.zeros((b, prefilled), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        room = self.max_len - prefilled
        state = _Rows(n, min(max_new_tokens, room), set(stop_tokens), record_logits, on_token)
        start = time.perf_counter()
        kd, lengths_d = self._put(key_data), self._put(lengths)
        tokens, logits, cache = self.prefill(self.arrays, self._put(ids), lengths_d, kd)
        state.take(np.asarray(tokens), logits)
        prefill_s, steps = time.perf_counter() - start, 0
        scalar = functools.partial(self._put, spec=P())
        while not state.finished():
            # Every row feeds the token at position lengths[b] + steps into slot
            # prefilled + steps (< max_len: `room` bounds the new tokens).
            tokens, logits, cache = self.decode(
                self.arrays, cache, tokens, self._put(lengths + steps), lengths_d,
                scalar(np.int32(prefilled + steps)), scalar(np.int32(prefilled)), kd,
            )  # fmt: skip
            state.take(np.asarray(tokens), logits)
            steps += 1
        return Generation(
            state.tokens, state.stopped, state.logits_per_row(), prefill_s,
            time.perf_counter() - start - prefill_s, steps,
        )  # fmt: skip


class _Rows:
    """The host's bookkeeping of a generation: each row's tokens, and which have ended."""

    def __init__(self, n: int, max_new: int, stop: set[int], record: bool, on_token: Any):
        self.n, self.max_new = n, max_new
        self.stop, self.on_token = stop, on_token
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.stopped = [False] * n
        self.done = [False] * n
        self.logits: list[list[np.ndarray]] | None = [[] for _ in range(n)] if record else None

    def take(self, tokens: np.ndarray, logits: Array) -> None:
        values = np.asarray(logits) if self.logits is not None else None
        for i in range(self.n):
            if self.done[i]:
                continue
            token = int(tokens[i])
            self.tokens[i].append(token)
            if self.logits is not None and values is not None:
                self.logits[i].append(values[i])
            if self.on_token is not None:
                self.on_token(i, token)
            self.stopped[i] = token in self.stop
            self.done[i] = self.stopped[i] or len(self.tokens[i]) >= self.max_new

    def finished(self) -> bool:
        return all(self.done)

    def logits_per_row(self) -> list[np.ndarray] | None:
        return None if self.logits is None else [np.stack(rows) for rows in self.logits]


def generate(
    model: GPT, mesh: Mesh, prompts: Sequence[Sequence[int]], *, max_len: int, max_new_tokens: int,
    sampling: Sampling = Sampling(), key: PRNGKeyArray | None = None, stop_tokens: Sequence[int] = (),
    gather: str = "once", vocab_size: int | None = None,
) -> Generation:  # fmt: skip
    """Continue `prompts` with `model` on `mesh`, with a key/value cache.

    A one-call form of `Generator(model, mesh, max_len=..., ...).generate(prompts, ...)`
    (see both for the arguments); keep a `Generator` to reuse its compiled steps.

    **Returns:**

    A `Generation`.

    **Raises:**

    `GenerationError`, as `Generator` and `Generator.generate`.
    """
    generator = Generator(model, mesh, max_len=max_len, sampling=sampling, gather=gather, vocab_size=vocab_size)
    return generator.generate(prompts, max_new_tokens=max_new_tokens, key=key, stop_tokens=stop_tokens)
