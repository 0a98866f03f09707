"""Model FLOPs of the reference GPT, accelerator profiles, and model FLOPs utilisation (MFU).

The FLOPs counted are the *model* FLOPs of a training step, as PaLM (Chowdhery et al.,
2022, appendix B), MaxText and torchtitan count them: every matrix product of the
forward pass costs `2` FLOPs per multiply-add, and the backward pass twice the forward,
so a token costs

    6 · N  +  12 · n_layers · d_model · seq_len

where `N` is the number of parameters a token is multiplied by (the attention and MLP
weights of every block — for a mixture-of-experts block only the `top_k` experts a token
is routed to, plus the router — and the output head; the embedding lookup multiplies
nothing), and the second term is attention's scores `QKᵀ` and weighted values `AV`
(`2 · 2 · seq_len · d_model` per layer forward, counted over the whole square as PaLM
does, not halved for the causal mask). Recomputation (`remat`) is not model FLOPs and is
not counted: MFU measures the model's useful work, not the hardware's.

MFU is the model FLOPs per second one device achieves divided by that device's peak for
the compute dtype (`DeviceProfile.peak_flops`). The peaks are the vendors' published
dense (not 2:4-sparse) numbers per chip.
"""

from __future__ import annotations

import dataclasses

from .._errors import LayerConfigError
from ..models import GPTConfig

__all__ = [
    "DEVICE_PROFILES",
    "DeviceProfile",
    "device_profile",
    "gpt_flops_per_token",
    "gpt_matmul_parameters",
    "mfu",
]


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one accelerator chip can do, as its vendor publishes it.

    **Fields:**

    - `name`: the name `equishard plan --device` takes (`"h100"`).
    - `description`: the chip in words (`"NVIDIA H100 SXM"`).
    - `peak_flops`: dense matrix-multiply FLOP/s by compute dtype name (`"bfloat16"`,
      `"float32"`). `"float32"` is what JAX's default matmul precision runs at: TF32 on
      NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs.
    - `memory_bytes`: HBM capacity.
    - `memory_bandwidth`: HBM bytes per second.
    - `link_bandwidth`: bytes per second one chip sends to its peers (NVLink or ICI, one
      direction, all links together).
    - `kinds`: lower-case fragments of `jax.Device.device_kind` that name this chip.
    """

    name: str
    description: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    link_bandwidth: float
    kinds: tuple[str, ...] = ()


_T = 1e12
_G = 1e9
_GIB = float(2**30)
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("h100", "NVIDIA H100 SXM", {"bfloat16": 989 * _T, "float32": 494.5 * _T},
                      80 * _G, 3350 * _G, 450 * _G, ("h100",)),
        DeviceProfile("h200", "NVIDIA H200 SXM", {"bfloat16": 989 * _T, "float32": 494.5 * _T},
                      141 * _G, 4800 * _G, 450 * _G, ("h200",)),
        DeviceProfile("a100", "NVIDIA A100 SXM 80GB", {"bfloat16": 312 * _T, "float32": 156 * _T},
                      80 * _G, 2039 * _G, 300 * _G, ("a100",)),
        DeviceProfile("tpu-v4", "Google TPU v4", {"bfloat16": 275 * _T, "float32": 275 * _T},
                      32 * _GIB, 1228 * _G, 300 * _G, ("tpu v4",)),
        DeviceProfile("tpu-v5e", "Google TPU v5e", {"bfloat16": 197 * _T, "float32": 197 * _T},
                      16 * _GIB, 819 * _G, 200 * _G, ("tpu v5 lite", "tpu v5e")),
        DeviceProfile("tpu-v5p", "Google TPU v5p", {"bfloat16": 459 * _T, "float32": 459 * _T},
                      95 * _GIB, 2765 * _G, 600 * _G, ("tpu v5p", "tpu v5")),
        DeviceProfile("tpu-v6e", "Google TPU v6e (Trillium)", {"bfloat16": 918 * _T, "float32": 918 * _T},
                      32 * _GIB, 1640 * _G, 448 * _G, ("tpu v6 lite", "tpu v6e")),
    )
}  # fmt: skip
"""The accelerators whose peaks equishard knows (`equishard plan --device NAME`; the step
log's MFU). Published per-chip numbers: dense FLOP/s, HBM, one-direction link bandwidth."""


def device_profile(kind: str) -> DeviceProfile | None:
    """The profile of a device, from a profile name or `jax.Device.device_kind`.

    **Arguments:**

    - `kind`: `"h100"`, or a device kind such as `"NVIDIA H100 80GB HBM3"`, `"TPU v5p"`.

    **Returns:**

    The `DeviceProfile`, or `None` for a device with no known peak (the CPU).
    """
    text = kind.lower()
    if text in DEVICE_PROFILES:
        return DEVICE_PROFILES[text]
    for profile in DEVICE_PROFILES.values():  # "tpu v5p" is listed before the bare "tpu v5"
        if any(fragment in text for fragment in profile.kinds):
            return profile
    return None


def gpt_matmul_parameters(config: GPTConfig) -> int:
    """`N` of the FLOPs formula: the weights one token is multiplied by in a forward pass.

    Per block: the query and output projections (`2 d²`), the keys' and values'
    (`2 d·d_kv`, `d_kv = n_kv_heads · d / n_heads` under grouped-query attention) and the
    SwiGLU MLP (`3 d·d_ff`), or for a mixture-of-experts block the router (`d·E`) and
    `top_k` experts (`2 d·d_ff` each); then the output head (`d·V`, tied or not).
    """
    d = config.d_model
    moe_blocks = config.n_layers // config.moe_every if config.moe_every else 0
    dense_blocks = config.n_layers - moe_blocks
    kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    attention = 2 * d * d + 2 * d * (kv_heads * (d // config.n_heads))
    dense = attention + 3 * d * config.d_ff
    moe = attention + d * config.num_experts + config.top_k * 2 * d * config.d_ff
    return dense_blocks * dense + moe_blocks * moe + d * config.vocab_size


def gpt_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Model FLOPs of one training token: `6 N + 12 n_layers d_model seq_len` (see the
    module documentation and the "Reading the train output" guide).

    **Arguments:**

    - `config`: the GPT's hyperparameters.
    - `seq_len`: the training sequence length.

    **Returns:**

    FLOPs per token of a forward and backward pass.
    """
    attention = 12 * config.n_layers * config.d_model * seq_len
    return 6 * gpt_matmul_parameters(config) + attention


def mfu(flops_per_second_per_device: float, profile: DeviceProfile, dtype: str) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak.

    **Arguments:**

    - `flops_per_second_per_device`: model FLOPs per token x tokens per second / devices.
    - `profile`: the device's profile.
    - `dtype`: the compute dtype name (`"bfloat16"`, `"float32"`).

    **Returns:**

    A fraction (0.42 for 42 %).

    **Raises:**

    `LayerConfigError` if the profile has no peak for `dtype`.
    """
    if dtype not in profile.peak_flops:
        raise LayerConfigError(
            f"the {profile.description} profile has no peak for {dtype!r} "
            f"(it has {', '.join(profile.peak_flops)})."
        )
    return flops_per_second_per_device / profile.peak_flops[dtype]
