"""Generating with a key/value cache under the training layout.

The code of the guide `docs/guides/generating.md`. Run it on a laptop CPU:

    python docs/examples/generating.py
"""

# --8<-- [start:setup]
import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equishard as es
from equishard.models import GPT, Generator, GPTConfig, Sampling

# Grouped-query attention: 2 key/value heads for 8 query heads.
config = GPTConfig(vocab_size=256, d_model=128, n_heads=8, n_kv_heads=2, n_layers=2, d_ff=256)


def model_on(spec):
    """The model under a layout, born sharded (the same parameters on every layout)."""
    layout = es.Layout(spec).resolve()
    mesh = layout.mesh()
    model = es.sharded_init(lambda k: GPT(config, layout, key=k), jax.random.key(0), mesh=mesh)
    return model, mesh
# --8<-- [end:setup]


# --8<-- [start:generate]
model, mesh = model_on("dp=2,tp=4")
generator = Generator(model, mesh, max_len=64)  # greedy by default
prompts = [[72, 101, 108, 108, 111], [1, 2, 3], [42]]  # three lengths in one batch
out = generator.generate(prompts, max_new_tokens=12)
for row, tokens in enumerate(out.tokens):
    print(f"row {row}: {tokens}")
print(f"decode steps {out.decode_steps}, compilations {generator.compilations()}")
# --8<-- [end:generate]


# --8<-- [start:layouts]
model2, mesh2 = model_on("fsdp=4,tp=2")
for gather in ("once", "per_layer"):
    other = Generator(model2, mesh2, max_len=64, gather=gather).generate(prompts, max_new_tokens=12)
    print(f"fsdp=4,tp=2, gathered {gather}: the same tokens: {other.tokens == out.tokens}")
# --8<-- [end:layouts]


# --8<-- [start:sampling]
sampling = Sampling(temperature=0.8, top_k=50, top_p=0.95)
keys = [jax.random.key(i) for i in range(3)]
batch = Generator(model, mesh, max_len=64, sampling=sampling).generate(prompts, max_new_tokens=12, keys=keys)
alone = Generator(model2, mesh2, max_len=64, sampling=sampling).generate(
    [prompts[1]], max_new_tokens=12, keys=[keys[1]]
)
print(f"sampled row 1: {batch.tokens[1]}")
print(f"alone on another layout: {alone.tokens[0] == batch.tokens[1]}")
# --8<-- [end:sampling]
