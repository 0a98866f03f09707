"""What a layout costs before you rent a cluster: `equishard inspect`, `equishard plan`,
and `equishard.report` on a step of your own.

The code of the guide `docs/guides/inspect-and-plan.md`. Run it on a laptop CPU:

    python docs/examples/inspect_and_plan.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import subprocess
import sys

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import equishard as es
from equishard.report import fsdp_minimum, report


def equishard(*args):
    """Run the command line in a process of its own (it simulates its own devices)."""
    argv = [sys.executable, "-m", "equishard", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
# --8<-- [end:setup]

# --8<-- [start:inspect]
print(equishard("inspect", "--model", "tiny", "--layout", "fsdp=4,tp=2",
                "--batch-size", "8", "--seq-len", "32"))
# --8<-- [end:inspect]

# --8<-- [start:plan]
print(equishard("plan", "--model", "gpt2-small", "--layout", "fsdp=16,tp=4",
                "--devices", "64", "--device-memory", "16GiB", "--device", "h100",
                "--dtype", "bfloat16"))
# --8<-- [end:plan]

# --8<-- [start:own]
mesh = es.make_mesh("fsdp=8")


class Batched(eqx.Module):
    """A one-example model called on a batch (so FSDP gathers once, outside the vmap)."""

    model: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.model)(x)


def make(key):  # an unmodified eqx.nn.MLP, every matrix split over "fsdp"
    mlp = eqx.nn.MLP(256, 256, 1024, depth=2, key=key)
    return es.nn.FSDP(Batched(mlp), "fsdp", min_weight_size=4096)


model = es.sharded_init(make, jax.random.key(0), mesh=mesh)


@es.filter_shard_map(mesh=mesh, in_specs=(None, P("fsdp")), out_specs=P())
def loss(model, x):  # local view: this device's rows of x
    return jax.lax.pmean(jnp.mean((model(x) - x) ** 2), "fsdp")


x = jnp.ones((64, 256))
compiled = eqx.filter_jit(eqx.filter_grad(loss)).lower(model, x).compile()
rows = es.param_table(model, mesh)
step = report(compiled, mesh=mesh, params=rows, description="FSDP-8 gradient of an eqx.nn.MLP")
print(step)

split = sum(r.total_bytes for r in rows if "fsdp" in str(r.spec))  # P_sharded, whole
whole = sum(r.total_bytes for r in rows if "fsdp" not in str(r.spec))  # P_replicated
minimum = fsdp_minimum(split, whole, n=8)  # 3(n-1)/n P_sharded + 2(n-1)/n P_replicated
print(f"measured {step.collective_bytes / 1024:.1f} KiB, minimum {minimum / 1024:.1f} KiB, "
      f"ratio {step.collective_bytes / minimum:.3f}")
# --8<-- [end:own]
