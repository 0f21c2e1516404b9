"""cgroup v2 and v1 limits on this process: memory and CPU quota.

Owns: finding this process's groups (``/proc/self/cgroup``) and where each hierarchy is
mounted (``mounts``), and reading a limit file on every level from the group
up to the mount root, since a parent's limit binds its children too. Does not own: what
a limit means for a run (``memory``, ``cpus``).

``proc`` and ``cgroup_root`` let tests point at a fake tree.
"""

from __future__ import annotations

from pathlib import Path

from .mounts import mounts

UNLIMITED = 1 << 60                 # cgroup v1 reports "no limit" as ~2^63


def _walk(root: Path, cg_path: str, fname: str):
    """The limit files from this process's group up to the mount root. When the group's
    directory is not visible (a namespaced mount), the mount root is the group."""
    d = root / Path(cg_path.lstrip("/"))
    if not d.is_dir():
        d = root
    while True:
        yield d / fname
        if d == root or root not in d.parents:
            break
        d = d.parent


def limit_files(v2_name: str, v1_controller: str, v1_name: str, *, proc: str = "/proc",
                cgroup_root: str | None = None):
    """(version, path) of every file named ``v2_name`` (cgroup v2) or ``v1_name`` in the
    ``v1_controller`` hierarchy (v1) on this process's cgroup path, leaf first."""
    table = mounts(Path(proc) / "self" / "mounts")
    try:
        lines = (Path(proc) / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, cg_path = parts
        if controllers == "":
            version, fname = 2, v2_name
            roots = [m for m, (fs, _) in table.items() if fs == "cgroup2"]
        elif v1_controller in controllers.split(","):
            version, fname = 1, v1_name
            roots = [m for m, (fs, opts) in table.items()
                     if fs == "cgroup" and v1_controller in opts.split(",")]
        else:
            continue
        for root in [cgroup_root] if cgroup_root is not None else roots:
            for f in _walk(Path(root), cg_path, fname):
                yield version, f


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_limit(path: Path) -> int | None:
    text = _read_text(path)
    if text is None or text == "max" or not text.isdigit():
        return None
    v = int(text)
    return None if v >= UNLIMITED else v


def memory_limit(proc: str = "/proc", cgroup_root: str | None = None) -> tuple:
    """(smallest memory limit on this process's cgroup path, the file it came from) or
    (None, None). v2 ``memory.max`` and v1 ``memory.limit_in_bytes`` ('max' or a huge
    number mean none)."""
    best = (None, None)
    for version, f in limit_files("memory.max", "memory", "memory.limit_in_bytes",
                                  proc=proc, cgroup_root=cgroup_root):
        v = _read_limit(f)
        if v is not None and (best[0] is None or v < best[0]):
            best = (v, f"cgroup v{version} {f}")
    return best


def cpu_quota(proc: str = "/proc", cgroup_root: str | None = None) -> tuple:
    """(smallest CPU quota on this process's cgroup path in CPUs, e.g. 1.5, the file it
    came from) or (None, None). v2 ``cpu.max`` is "QUOTA PERIOD" or "max PERIOD"; v1 is
    ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us`` beside it."""
    best = (None, None)
    for version, f in limit_files("cpu.max", "cpu", "cpu.cfs_quota_us", proc=proc,
                                  cgroup_root=cgroup_root):
        text = _read_text(f)
        if text is None:
            continue
        if version == 2:
            fields = text.split()
            quota, period = (fields + [""])[:2] if fields else ("max", "")
        else:
            quota, period = text, _read_text(f.with_name("cpu.cfs_period_us")) or ""
        if not (quota.isdigit() and period.isdigit() and int(period) > 0):
            continue                           # "max", -1 or unreadable: no quota here
        cpus = int(quota) / int(period)
        if best[0] is None or cpus < best[0]:
            best = (cpus, f"cgroup v{version} {f}")
    return best
