"""Compiling k3's numba kernels before a tool needs them, and saying so.

Owns: the table of every numba entry point the tools call from Python, with the exact
argument types they call it with; finding which of those numba's on-disk cache does not
hold yet; compiling them up front under a one-line notice and a tqdm bar (nothing is
printed when all are cached), then loading the rest; and where numba keeps that cache.
Does not own: the kernels (``libk3.kernels``, ``libk3.cache_policy``, ``libk3.hwprobe``)
or when a tool runs (its front end, or the engine for k3-run, calls ``prepare``).

Why a table of signatures: numba compiles lazily at a kernel's first call, so a fresh
install sat silent for half a minute of "prefill" (issue 19). Knowing the argument types
up front lets a run look each one up in numba's cache index, then announce and compile
only what is missing, before the first layer and timed apart from prefill. The types
must be exactly those of a real call (C-contiguous, writable arrays; Python ints and
floats are int64 and float64), else numba files the compiled code under another key and
compiles again at the call: tests/test_precompile.py runs every tool path after
``prepare`` and fails on any compilation the table did not foresee. The lookup reads
numba's private cache index (``_cache``, ``_index_key``); if a numba release moves it,
``is_cached`` says None, nothing is announced and numba compiles lazily as before (and
that test fails, so it is noticed).

Where the cache lives (numba's rule, README "Set up"): ``$NUMBA_CACHE_DIR`` when set;
else ``__pycache__`` beside each kernel's source when that is writable (editable
install, wheel in a writable venv); else a user-wide directory,
``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba`` (read-only site-packages).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import sys
import time


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One numba entry point and the argument types one tool calls it with."""

    module: str
    name: str
    args: tuple          # numba types, in call order

    @property
    def label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"

    def dispatcher(self):
        return getattr(importlib.import_module(self.module), self.name)


def _groups() -> dict:
    """group name -> tuple of Kernel. Built on demand: it imports numba."""
    from numba import types as nt

    def a(dtype, ndim):
        return nt.Array(dtype, ndim, "C")

    f32_1, f32_2, f32_3 = a(nt.float32, 1), a(nt.float32, 2), a(nt.float32, 3)
    u16_2, u8_2 = a(nt.uint16, 2), a(nt.uint8, 2)
    i64_1, i64_2, f64_1 = a(nt.int64, 1), a(nt.int64, 2), a(nt.float64, 1)
    i64, f64 = nt.int64, nt.float64
    lru_state = nt.Tuple((i64_2, i64_1, i64_1))
    llfu_state = nt.Tuple((i64_2, i64_2, i64_1, f64_1, f64_1))

    def group(module, *entries):
        return tuple(Kernel(module, name, tuple(args)) for name, args in entries)

    k = "libk3.kernels."
    timing = (group(k + "bf16", ("matmul", (u16_2, f32_2, f32_2)))
              + group(k + "mxfp4", ("matmul", (u8_2, u8_2, f32_2, f32_2))))
    forward = timing + (
        # matrices stored as F32 (or F16, widened) reach the kernels as float32
        group(k + "bf16", ("matmul", (f32_2, f32_2, f32_2)))
        + group(k + "norms", ("rmsnorm", (f32_2, f32_1, f64, f32_2)),
              ("l2norm", (f32_2, f64, f32_2)))
        + group(k + "activations", ("sigmoid", (f32_1, f32_1)),
                ("situ", (f32_1, f32_1, f64, f64, f32_1)))
        + group(k + "attnres", ("attnres", (f32_3, i64, f32_2, f32_1, f64, f32_2)))
        + group(k + "kda", ("short_conv", (f32_2, f32_2, f32_2, f32_2)),
                ("kda_decay", (f32_2, f32_1, f32_1, f64, f32_2, f32_2)),
                ("kda_recurrence", (f32_3, f32_3, f32_3, f32_3, f32_2, f64, f32_3, f32_3)))
        + group(k + "mla", *[("mla_attention", (f32_3, f32_3, i64_1, f32_2, f32_2, kv_b, f64,
                                                 f32_3)) for kv_b in (u16_2, f32_2)])
        + group(k + "router", ("router_topk", (f32_2, f32_1, i64, nt.boolean, f64, i64_2,
                                               f32_2)))
        + group(k + "moe", ("combine_routed", (f32_3, f32_2, f32_2))))
    online_policies = group(
        "libk3.cache_policy", ("_lru_new", (i64, i64)), ("_lru_lookup", (lru_state, i64)),
        ("_lru_admit", (lru_state, i64)), ("_llfu_new", (i64, i64, i64, i64, f64)),
        ("_llfu_new_visit", (llfu_state, i64)), ("_llfu_lookup", (llfu_state, i64)),
        ("_llfu_admit", (llfu_state, i64)))
    replay = group(
        "libk3.cache_policy",
        ("_simulate_pin_lru", (i64_1, i64, i64, a(nt.boolean, 1), i64)),
        ("next_use_indices", (i64_1, i64)), ("_simulate_belady", (i64_1, i64_1, i64, i64)),
        ("_simulate_s3fifo", (i64_1, i64, i64, i64, i64, i64)),
        ("_simulate_llfu", (i64_1, i64, i64, i64, i64, f64)))
    probe = group("libk3.hwprobe", ("_prange_sum", (f64_1,)))
    u8_1, u16_1 = a(nt.uint8, 1), a(nt.uint16, 1)
    ro_u8_1 = nt.Array(nt.uint8, 1, "C", readonly=True)     # np.frombuffer of zstd's bytes
    trunk_codec = group(k + "bf16_planes", ("merge_planes", (ro_u8_1, u8_1, u16_1)),
                        ("merge_planes", (ro_u8_1, ro_u8_1, u16_1)),
                        ("split_planes", (u16_1, u8_1, u8_1)))
    timing += trunk_codec                         # k3-doctor times the trunk decoder too
    return {"forward": forward,                   # k3-run
            "expert-cache": online_policies + trunk_codec,   # k3-run, streamed
            "replay": replay,                     # k3-trace replay / size
            "probe": probe,                       # k3-doctor's threading-layer check
            "kernel-timing": timing}              # k3-doctor: BF16 and MXFP4 matmuls


GROUPS = ("forward", "expert-cache", "replay", "probe", "kernel-timing")


def kernels(groups=GROUPS) -> list:
    """The Kernel entries of ``groups``, each once, in table order."""
    table = _groups()
    out = []
    for g in groups:
        out += [kern for kern in table[g] if kern not in out]
    return out


def is_cached(kern: Kernel):
    """True when numba's on-disk cache (or this process) holds ``kern`` for this CPU,
    False when calling it would compile, None when this numba's cache index cannot be
    read (its internals moved)."""
    disp = kern.dispatcher()
    if kern.args in disp.overloads:
        return True
    try:
        cache = disp._cache
        if not hasattr(cache, "_cache_file"):    # NullCache: no writable cache anywhere
            return False
        key = cache._index_key(kern.args, disp.targetctx.codegen())
        index = cache._cache_file._load_index()
        name = index.get(key)
        return name is not None and os.path.exists(cache._cache_file._data_path(name))
    except AttributeError:
        return None
    except (OSError, EOFError, ValueError, pickle.UnpicklingError):
        return False                    # an unreadable index: numba compiles too


def cache_dir(kern: Kernel):
    """Where numba keeps ``kern``'s compiled code, or None when it cannot cache it."""
    return getattr(kern.dispatcher()._cache, "cache_path", None)


def compile_kernels(todo, *, stream=None) -> float:
    """Compile ``todo`` (Kernel list) under a notice and a tqdm bar on ``stream``
    (stderr by default); returns the seconds spent. Numba saves each to its cache."""
    if not todo:
        return 0.0
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    if cache_dir(todo[0]) is None:
        stream.write("compiling k3 kernels for this CPU; numba has no writable cache "
                     "directory here, so every run compiles (set NUMBA_CACHE_DIR)…\n")
    else:
        stream.write("compiling k3 kernels for this CPU, first run only…\n")
    stream.flush()
    t0 = time.perf_counter()
    with tqdm(total=len(todo), unit="kernel", desc="compiling", file=stream,
              leave=False, disable=None) as bar:
        for kern in todo:
            bar.set_postfix_str(kern.label, refresh=True)
            kern.dispatcher().compile(kern.args)
            bar.update(1)
    return time.perf_counter() - t0


def prepare(groups, *, stream=None) -> float:
    """Make every kernel of ``groups`` callable without further work (see
    ``prepare_kernels``); the seconds spent compiling, 0.0 when all were cached."""
    return prepare_kernels(kernels(groups), stream=stream)


def prepare_kernels(todo, *, stream=None) -> float:
    """Compile the kernels of ``todo`` that numba's cache lacks (announced once, with a
    bar), load the rest from the cache; returns the seconds spent compiling. Why load
    eagerly: the first call would load them anyway, inside the first layer; loaded here
    they count as start-up, and prefill times only the forward."""
    spent = compile_kernels([kern for kern in todo if is_cached(kern) is False],
                            stream=stream)
    for kern in todo:
        kern.dispatcher().compile(kern.args)        # a cache load, or nothing if loaded
    return spent


def compile_all(*, stream=None) -> dict:
    """``k3-doctor --compile``: every kernel of every group ready; what it took and where
    numba keeps them."""
    todo = kernels(GROUPS)
    t0 = time.perf_counter()
    before = [kern for kern in todo if is_cached(kern) is False]
    seconds = prepare_kernels(todo, stream=stream)
    dirs = sorted({d for d in (cache_dir(kern) for kern in todo) if d is not None})
    return {"kernels": len(todo), "compiled": len(before),
            "compile_seconds": round(seconds, 3),
            "total_seconds": round(time.perf_counter() - t0, 3), "cache_dirs": dirs,
            "cached": all(is_cached(kern) for kern in todo) and bool(dirs)}


def render_summary(s: dict) -> str:
    head = (f"k3 kernels: {s['kernels']} ready; compiled {s['compiled']} in "
            f"{s['compile_seconds']:.1f} s" if s["compiled"]
            else f"k3 kernels: all {s['kernels']} were already compiled")
    where = ("numba cache: " + ", ".join(s["cache_dirs"]) if s["cached"]
             else "numba cannot cache them here (no writable cache directory): every run "
                  "compiles; set NUMBA_CACHE_DIR to a writable directory")
    return f"{head}\n{where}"
