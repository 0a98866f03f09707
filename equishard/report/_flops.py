"""Accelerator profiles and model FLOPs utilisation (MFU).

MFU is the model FLOPs per second (`equishard.models.gpt_flops_per_token` counts the
reference GPT's) one device achieves divided by that device's peak for
the compute dtype (`DeviceProfile.peak_flops`). The peaks are the vendors' published
dense (not 2:4-sparse) numbers per chip.
"""

from __future__ import annotations

import dataclasses

from .._errors import LayerConfigError

__all__ = [
    "DEVICE_PROFILES",
    "DeviceProfile",
    "device_profile",
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
