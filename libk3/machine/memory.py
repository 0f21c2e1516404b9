"""Memory a run can count on.

Owns: ``MemoryInfo`` (MemTotal, MemAvailable, swap, and the cgroup limit on this
process), the probe that reads them, and a simulated machine of a given size. Does not
own: the cgroup files (``cgroup``) or what a budget does with the figures
(``libk3.budget``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from . import cgroup


@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """Memory as a run may plan with it. ``assumed`` when a caller overrode the probe."""

    total_bytes: int
    available_bytes: int              # MemAvailable
    swap_total_bytes: int
    cgroup_limit_bytes: int | None    # None: no limit applies
    cgroup_source: str | None         # the file the limit came from
    assumed: bool

    @property
    def usable_bytes(self) -> int:
        """min(MemAvailable, cgroup limit): what a run can count on."""
        if self.cgroup_limit_bytes is None:
            return self.available_bytes
        return min(self.available_bytes, self.cgroup_limit_bytes)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["usable_bytes"] = self.usable_bytes
        return d


def assumed_memory(nbytes: int) -> MemoryInfo:
    """A simulated machine with ``nbytes`` of memory, all available, no swap, no cgroup."""
    n = int(nbytes)
    return MemoryInfo(n, n, 0, None, None, assumed=True)


def probe_memory(override_bytes: int | None = None, *, proc: str = "/proc",
                 cgroup_root: str | None = None) -> MemoryInfo:
    """This machine's memory, or ``assumed_memory(override_bytes)`` when given.
    ``proc``/``cgroup_root`` let tests point at a fake tree."""
    if override_bytes is not None:
        return assumed_memory(override_bytes)
    info = _meminfo(Path(proc) / "meminfo")
    limit, source = cgroup.memory_limit(proc=proc, cgroup_root=cgroup_root)
    return MemoryInfo(info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0)),
                      info.get("SwapTotal", 0), limit, source, assumed=False)


def _meminfo(path: Path) -> dict:
    out = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out
