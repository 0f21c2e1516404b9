"""The machine section of k3-doctor's report: software, CPUs, the thread team, memory,
and what else is running.

Owns: putting the machine room's readings (``libk3.machine``) together with the Python
and package versions into the report's ``machine`` section, with its warnings. Does not
own: any reading itself (``libk3.machine``), timing kernels (``timing``) or decisions
(``report``).
"""

from __future__ import annotations

import importlib.metadata
import platform

from ..machine import cpus, memory, parallel, threads

PACKAGES = ("numpy", "numba", "llvmlite", "tokenizers", "zstandard")


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def probe_machine(mem: memory.MemoryInfo | None = None, load: cpus.Load | None = None) -> dict:
    """Python, packages, numba's threading, the CPUs, memory and the load sampled
    now (``load``: an earlier sample), with warnings."""
    mem = mem if mem is not None else memory.probe_memory()
    cpu = cpus.cpu_info()
    layer = parallel.layer_check()
    load = load if load is not None else cpus.sample_load(0.25)
    warnings = [layer["warning"]] if layer["warning"] else []
    if load.busy:
        warnings.append("the machine is busy (" + "; ".join(load.busy) + "): timings "
                        "taken now are low, and k3 runs slower while it lasts")
    if cpu["machine"] in ("x86_64", "AMD64") and not cpu["isa"]["avx2"]:
        warnings.append("no AVX2: numba kernels fall back to scalar code (slow)")
    return {"python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(), "packages": package_versions(),
            "numba": {**layer, **threads.in_force()}, "cpu": cpu, "memory": mem.to_json(),
            "load": load.to_json(), "warnings": warnings}
