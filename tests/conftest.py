"""Test bed: 8 simulated CPU devices, rank promotion raises, one compilation cache for
the run, shared helpers.

JAX must be told how many CPU devices to simulate before its backend starts, so this
runs at import time, before any test module imports JAX.

Many test files compile the same programs (the reference GPT's step on a layout, the
initialisations), and the command-line tests start `equishard train` processes that
compile the same step again. JAX's persistent compilation cache, in one fresh directory
for the whole run, lets each program be compiled once: pytest's first process creates it
and puts it in the environment, which the xdist workers and every subprocess inherit. A
test run never reads a cache it did not write (unless `JAX_COMPILATION_CACHE_DIR` is set
by the caller); the directory is removed when the run ends.
"""

import atexit
import functools
import gc
import importlib.metadata
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Off unless the caller turns it on (JAX_ENABLE_COMPILATION_CACHE=true): the whole suite
# took 11:47 with it and 11:59 without (fresh clone, 2 cores, 2026-11-28), too little for
# a disk cache's moving parts. (It was turned off after CI workers crashed in XLA while
# writing to it; the cause was the memory-map limit below, `_release_compiled_programs`.)
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="equishard-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(functools.partial(shutil.rmtree, _cache, ignore_errors=True))
# Programs that compile in under a quarter of a second are not worth a disk round trip.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
# The tests' programs are tiny and run once or a few times, so most of their time is
# XLA:CPU compiling them, and most of that is LLVM optimising the generated code. LLVM's
# -O0 (and without its expensive passes) cuts the compile time by about a third; the HLO
# — sharding, collectives, fusion, buffer assignment, the memory and cost analyses the
# tests read — is the same at every LLVM level, and the values stay within the tests'
# tolerances. A caller's own XLA_FLAGS come after these and win.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# These flags are the ones a user's program gets (the HLO unchanged); the examples whose
# output shows a compiled program's memory run with them (tests/test_docs.py).
os.environ.setdefault("TESTS_USERS_XLA_FLAGS", f"{_FAST_COMPILE} {os.environ.get('XLA_FLAGS', '')}".strip())
# JAX 0.10's XLA:CPU also has its older fusion emitters, which compile the suite's
# programs 2-3x faster than the default MLIR ones (a GPT step on fsdp=4,tp=2: 2.9 s
# against 1.1 s). They fuse a few elementwise ops differently: the sharding and the
# collectives are the same, the temporaries differ a little (by 128 and 64 bytes on two
# small GPT steps) and some values by an ulp, within every tolerance. So a test that needs bits equal across two fusions
# compiles its programs with `helpers.OPTIMISED` (what users get), and the examples
# that print a program's memory run with TESTS_USERS_XLA_FLAGS. JAX 0.12 has no such
# flag (its XLA refuses it).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if tuple(int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2]) >= (0, 11):
    _LEGACY_EMITTERS = ""
_FLAGS = f"{_FAST_COMPILE} {_LEGACY_EMITTERS} {os.environ.get('XLA_FLAGS', '')}"
os.environ["XLA_FLAGS"] = " ".join(_FLAGS.split())

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# The environment is read when JAX is imported; a plugin may have imported it earlier.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_enable_compilation_cache", os.environ["JAX_ENABLE_COMPILATION_CACHE"].lower() in ("1", "true"))
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)

import pytest  # noqa: E402

from .helpers import getkey as _getkey  # noqa: E402


@pytest.fixture
def getkey():
    """A function returning a fresh PRNG key on each call (deterministic per test)."""
    return _getkey()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test file, drop the programs it compiled.

    An xdist worker runs many files, and every program XLA:CPU compiles keeps its machine
    code in memory maps of its own while JAX's caches hold it. A worker that kept them
    all reached Linux's limit on a process's memory maps (`vm.max_map_count`, 65530)
    about 88 % of the way through the suite, and XLA, refused a map, crashed the worker
    mid-compile (an abort or a segmentation fault; seen in CI, 2026-11-28). A file's
    tests share their compiled functions (through JAX's caches and the file's own
    `functools.cache`s); the next file starts without them. With
    `EQUISHARD_TESTS_MAPS_LOG=FILE` set, each file's end appends the worker's pid, the
    file and its count of memory maps to FILE.
    """
    yield
    for value in list(vars(request.module).values()):
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()
    if os.environ.get("EQUISHARD_TESTS_MAPS_LOG"):
        with open("/proc/self/maps") as maps, open(os.environ["EQUISHARD_TESTS_MAPS_LOG"], "a") as log:
            log.write(f"{os.getpid()} {request.module.__name__} {sum(1 for _ in maps)}\n")
