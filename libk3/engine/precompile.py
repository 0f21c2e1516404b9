"""Compiling k3's numba kernels before a tool needs them, and saying so.

Owns: the table of every numba entry point the tools call from Python, with the exact
argument types they call it with; finding which of those numba's on-disk cache does not
hold yet; compiling them up front under a one-line notice and a progress bar (nothing is
printed when all are cached), then loading the rest; and where numba keeps that cache.
Does not own: the kernels (``libk3.kernels``, ``libk3.policies``, ``libk3.trace.replay``,
``libk3.machine.parallel``) or when a tool runs (its front end, or the engine for k3-run, calls
``prepare``).

Why a table of signatures: numba compiles lazily at a kernel's first call, so a fresh
install sat silent for the length of the compile in what looked like prefill. Knowing the argument types
up front lets a run look each one up in numba's cache index, then announce and compile
only what is missing, before the first layer and timed apart from prefill. The types
must be exactly those of a real call (C-contiguous, writable arrays; Python ints and
floats are int64 and float64), else numba files the compiled code under another key and
compiles again at the call (a policy state's type, a nested tuple with strided views,
is taken from the constructor numba compiled: ``ReturnOf``). tests/test_precompile.py
runs every tool path after ``prepare`` and fails on any compilation the table did not
foresee. The lookup reads numba's private cache index (``_cache``, ``_index_key``); if a
numba release moves it, ``is_cached`` says None, nothing is announced and numba compiles
lazily as before (and that test fails, so it is noticed).

Where the cache lives (numba's rule, docs/install.md): ``$NUMBA_CACHE_DIR`` when set;
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

from .. import progress as _progress


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One numba entry point and the argument types one tool calls it with."""

    module: str
    name: str
    args: tuple          # numba types or ReturnOf, in call order

    @property
    def label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"

    def dispatcher(self):
        return getattr(importlib.import_module(self.module), self.name)

    def signature(self) -> tuple:
        """The numba argument types; a ReturnOf needs its kernel ready (earlier in the
        table)."""
        return tuple(t.resolve() if isinstance(t, ReturnOf) else t for t in self.args)


@dataclasses.dataclass(frozen=True)
class ReturnOf:
    """The type an earlier table entry returns. Why: a policy's state is a nested tuple
    of arrays, some of them strided views, and only numba's own inference names its
    type exactly as a call from Python will."""

    kernel: Kernel

    def resolve(self):
        sig = self.kernel.signature()
        ready = self.kernel.dispatcher().overloads.get(sig)
        if ready is None:
            raise RuntimeError(f"precompile table: {self.kernel.label} must be ready "
                               "before an entry that takes what it returns")
        return ready.signature.return_type


def _groups() -> dict:
    """group name -> tuple of Kernel. Built on demand: it imports numba."""
    from numba import types as nt

    from ..policies.registry import policy_module

    def a(dtype, ndim):
        return nt.Array(dtype, ndim, "C")

    f32_1, f32_2, f32_3 = a(nt.float32, 1), a(nt.float32, 2), a(nt.float32, 3)
    u16_2, u8_2 = a(nt.uint16, 2), a(nt.uint8, 2)
    i64_1, i64_2, f64_1 = a(nt.int64, 1), a(nt.int64, 2), a(nt.float64, 1)
    i64, f64 = nt.int64, nt.float64

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
    # the image tower and projector beside the forward's matmuls and norms: prepared when
    # a run may read images (an image may come at any turn of a chat or to the server)
    vision = (group(k + "vit", ("split_heads", (f32_2, i64, f32_2, f32_2, nt.boolean, f32_3)),
                    ("attention", (f32_3, f32_3, f32_3, f64, f32_2)))
              + group(k + "activations", ("gelu_tanh", (f32_1, f32_1)),
                      ("gelu_erf", (f32_1, f32_1))))
    # the DSpark draft (k3-run --draft): its own kernels; the rest are the forward's
    draft = forward + (
        group(k + "rope", ("rope_interleaved", (f32_3, i64_1, f64_1, f64, f32_3)))
        + group(k + "activations", ("silu_mul", (f32_1, f32_1, f32_1)))
        + group(k + "logistic", *[("logistic_unit", (w, f32_1, f64))
                                  for w in (f32_1, a(nt.uint16, 1))]))
    # a policy's state is what its constructor returns; drive.access and drive.hits
    # are compiled once per state type. Each policy's module comes from the registry.
    pol = policy_module
    lru_new = Kernel(pol("lru"), "new", (i64, i64))
    lfu_new = Kernel(pol("lfu"), "new", (i64, i64, i64))
    llfu_new = Kernel(pol("layer-lfu"), "new", (i64, i64, i64, i64, f64))
    adaptive_new = Kernel(pol("adaptive"), "new_on",
                          (a(nt.int32, 2), i64, i64, i64, i64, f64, f64))

    def driven(name, new, *args):
        return (new, Kernel("libk3.policies.drive", name, (ReturnOf(new), *args)))

    online_policies = (
        group("libk3.policies.online", ("_in_range", (i64_1, i64)),
              ("evicts_its_own_batch", (i64_1, i64_2)))
        + sum((driven("access", new, i64_1, i64_2)
               for new in (lru_new, llfu_new, adaptive_new)), ()))
    replay = (
        group(pol("belady"), ("next_use_indices", (i64_1, i64)),
              ("simulate", (i64_1, i64_1, i64, i64)))
        + group(pol("lru"), ("simulate_pin_lru", (i64_1, i64, i64, a(nt.boolean, 1),
                                                      i64)))
        + group(pol("s3fifo"), ("sizes", (i64,)), ("simulate", (i64_1, i64, i64, i64, i64,
                                                                 i64)))
        + sum((driven("hits", new, i64_1) for new in (lfu_new, llfu_new, adaptive_new)), ()))
    probe = group("libk3.machine.parallel", ("_prange_sum", (f64_1,)))
    u8_1, u16_1 = a(nt.uint8, 1), a(nt.uint16, 1)
    ro_u8_1 = nt.Array(nt.uint8, 1, "C", readonly=True)     # np.frombuffer of a file's bytes
    ro_u16_1 = nt.Array(nt.uint16, 1, "C", readonly=True)
    trunk_codec = group(k + "bf16_planes",
                        *(("decode_blocks", (src, u8_1, i64_1, i64_1, u8_1, i64_1, i64_1, i64,
                                             i64)) for src in (u8_1, ro_u8_1)),
                        *(("encode_block", (src, u8_1)) for src in (u16_1, ro_u16_1)))
    # a decoded block's NaN/Inf scan: BF16 and F16 as uint16, F32 as uint32
    trunk_codec += group(k + "finite", *(("first_special", (bits, i64))
                                         for bits in (u16_1, a(nt.uint32, 1))))
    timing += trunk_codec                         # k3-doctor times the trunk decoder too
    return {"forward": forward,                   # k3-run
            "draft": draft,                       # k3-run --draft
            "vision": vision,                     # k3-run reading images, with a tower
            "expert-cache": online_policies + trunk_codec,   # k3-run, streamed
            "replay": replay,                     # k3-trace replay / size
            "probe": probe,                       # k3-doctor's threading-layer check
            "kernel-timing": timing}              # k3-doctor: BF16 and MXFP4 matmuls


GROUPS = ("forward", "draft", "vision", "expert-cache", "replay", "probe",
          "kernel-timing")


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
    read (its internals moved). The entries its types come from must be ready."""
    disp = kern.dispatcher()
    sig = kern.signature()
    if sig in disp.overloads:
        return True
    try:
        cache = disp._cache
        if not hasattr(cache, "_cache_file"):    # NullCache: no writable cache anywhere
            return False
        key = cache._index_key(sig, disp.targetctx.codegen())
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


_announced = False              # the notice is said once per process, whatever the groups


def _announce(kern: Kernel, stream) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    if cache_dir(kern) is None:
        stream.write("compiling k3 kernels for this CPU; numba has no writable cache "
                     "directory here, so every run compiles (set NUMBA_CACHE_DIR)…\n")
    else:
        stream.write("compiling k3 kernels for this CPU, first run only…\n")
    stream.flush()


class Count:
    """One progress count over the kernels of ``groups`` for work that prepares them in
    several calls (``prepare(..., count=)``): one bar, from the first kernel numba's
    cache lacks to the last kernel of every group, each kernel counted once, instead of
    a bar per call counting its own (two counters one after the other). ``close()`` when
    the last call is done."""

    def __init__(self, groups=(), *, show: bool = True, todo=None):
        self.todo = kernels(groups) if todo is None else list(todo)
        self.show, self.seen, self.bar = show, set(), None

    def begin(self, stream) -> None:
        if self.bar is None:
            self.bar = _progress.bar(total=len(self.todo), initial=len(self.seen),
                                     unit="kernel", desc="compiling", stream=stream,
                                     show=self.show)

    def step(self, kern) -> None:
        if kern.label not in self.seen:
            self.seen.add(kern.label)
            if self.bar is not None:
                self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _prepare(todo, stream, show: bool = True, count: Count | None = None) -> tuple:
    """Each kernel of ``todo`` in table order compiled or loaded from the cache (an entry
    may take a type an earlier one returns, so they are checked one by one). The notice
    and a bar (``count``'s, else one over ``todo``; unless not ``show``) come at the
    first kernel numba's cache lacks.
    -> (seconds spent compiling, kernels compiled)."""
    stream = sys.stderr if stream is None else stream
    own = count is None
    count = Count(show=show, todo=todo) if own else count
    spent, compiled = 0.0, 0
    try:
        for kern in todo:
            missing = is_cached(kern) is False
            if missing and count.bar is None:
                from ..kernels import team
                team.launch()     # a kernel compiled here may link the cached team calls
                _announce(kern, stream)
                count.begin(stream)
            if count.bar is not None:
                count.bar.set_postfix_str(kern.label, refresh=True)
            t0 = time.perf_counter()
            kern.dispatcher().compile(kern.signature())     # a cache load if not missing
            if missing:
                spent += time.perf_counter() - t0
                compiled += 1
            count.step(kern)
    finally:
        if own:
            count.close()
    return spent, compiled


def prepare(groups, *, stream=None, show: bool = True, count: Count | None = None) -> float:
    """Make every kernel of ``groups`` callable without further work (see
    ``prepare_kernels``); the seconds spent compiling, 0.0 when all were cached.
    ``count``: the one progress count of several calls (``Count``)."""
    return _prepare(kernels(groups), stream, show, count)[0]


def prepare_kernels(todo, *, stream=None, show: bool = True) -> float:
    """Compile the kernels of ``todo`` that numba's cache lacks (announced once, with a
    bar), load the rest from the cache; returns the seconds spent compiling. Why load
    eagerly: the first call would load them anyway, inside the first layer; loaded here
    they count as start-up, and prefill times only the forward."""
    return _prepare(todo, stream, show)[0]


def compile_all(*, stream=None, show: bool = True) -> dict:
    """``k3-doctor --compile``: every kernel of every group ready; what it took and where
    numba keeps them."""
    todo = kernels(GROUPS)
    t0 = time.perf_counter()
    seconds, compiled = _prepare(todo, stream, show)
    dirs = sorted({d for d in (cache_dir(kern) for kern in todo) if d is not None})
    return {"kernels": len(todo), "compiled": compiled,
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
