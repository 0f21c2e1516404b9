"""The CPUs this process may use, what they can do, and what else is running on them.

Owns: the usable CPU count (the affinity mask, capped by a cgroup CPU quota), the CPU's
model and ISA flags, and a short sample of the machine's load (load average, the
share of our CPUs other processes and the hypervisor took while we were idle). Does not
own: the thread team built from the count (``threads``) or what a busy machine means for
a report (``libk3.doctor``).

``proc`` lets tests point at a fake /proc.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from pathlib import Path

from . import cgroup

ISA_FLAGS = ("avx2", "fma", "avx512f", "asimd", "neon")


@dataclasses.dataclass(frozen=True)
class Allowance:
    """CPUs a process may run on: ``affinity`` (the mask), ``quota`` (a cgroup's CPU
    time limit in CPUs, or None) and the count a thread team should use: the mask's size,
    capped at the quota rounded up (a team larger than the quota is throttled in turns)."""

    affinity: int
    quota: float | None
    quota_source: str | None

    @property
    def count(self) -> int:
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.ceil(self.quota - 1e-9)))

    @property
    def why(self) -> str:
        if self.quota is not None and self.count < self.affinity:
            return f"cgroup CPU quota {self.quota:g} ({self.quota_source})"
        return f"{self.affinity} CPUs in this process's affinity mask"

    def to_json(self) -> dict:
        return {"affinity": self.affinity, "quota": self.quota,
                "quota_source": self.quota_source, "count": self.count, "why": self.why}


def affinity_cpus() -> set:
    """The CPU numbers this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def allowance(proc: str = "/proc", cgroup_root: str | None = None,
              affinity: int | None = None) -> Allowance:
    quota, source = cgroup.cpu_quota(proc=proc, cgroup_root=cgroup_root)
    return Allowance(len(affinity_cpus()) if affinity is None else affinity, quota, source)


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """Cores this process may use, and which of ISA_FLAGS the CPU reports."""
    flags = set()
    model = None
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features") and not flags:
                    flags = set(value.split())
                elif key in ("model name", "cpu model") and model is None:
                    model = value.strip()
    except OSError:
        pass
    allow = allowance()
    return {"model": model, "machine": platform.machine(), "cores_usable": allow.count,
            "cores_online": os.cpu_count(), "allowance": allow.to_json(),
            "isa": {f: f in flags for f in ISA_FLAGS}}


# ---- load --------------------------------------------------------------------------------

def _cpu_times(proc: str, cpus: set) -> tuple | None:
    """(busy, steal, total) jiffies summed over ``cpus`` from /proc/stat, and how many of
    ``cpus`` it listed; busy excludes idle and iowait, steal is time the hypervisor gave
    another guest."""
    try:
        lines = (Path(proc) / "stat").read_text().splitlines()
    except OSError:
        return None
    busy = steal = total = seen = 0
    for line in lines:
        f = line.split()
        if not f or not f[0].startswith("cpu") or f[0] == "cpu":
            continue
        try:
            n = int(f[0][3:])
            v = [int(x) for x in f[1:9]]
        except ValueError:
            continue
        if n not in cpus or len(v) < 8:
            continue
        seen += 1
        user, nice, system, idle, iowait, irq, softirq, st = v
        busy += user + nice + system + irq + softirq
        steal += st
        total += user + nice + system + idle + iowait + irq + softirq + st
    return (busy, steal, total, seen) if seen else None


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclasses.dataclass(frozen=True)
class Load:
    """What else ran on this process's CPUs: ``others`` and ``steal`` in CPUs (of
    ``usable``) over a sample of ``seconds`` while this process was idle; the 1-minute
    load average. None where /proc did not say."""

    usable: int
    others: float | None
    steal: float | None
    loadavg_1m: float | None
    seconds: float

    @property
    def busy(self) -> list:
        """Why kernel timings taken now are unreliable; empty when the CPUs were free
        (less than a fifth of one CPU taken by others or the hypervisor)."""
        out = []
        if self.others is not None and self.others >= BUSY_CPUS:
            out.append(f"other processes used {self.others:.1f} of {self.usable} CPUs")
        if self.steal is not None and self.steal >= BUSY_CPUS:
            out.append(f"the hypervisor took {self.steal:.1f} of {self.usable} CPUs (steal)")
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["busy"] = self.busy
        return d


BUSY_CPUS = 0.2               # others' use, in CPUs, from which a timing is not trusted


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The CPU counters at one moment: /proc/stat's (busy, steal, total, cpus listed) on
    our CPUs, this process's CPU seconds and the clock."""

    times: tuple | None
    own: float
    at: float


def snapshot(cpus: set, proc: str = "/proc", *, clock=time.monotonic,
             own_seconds=_own_cpu_seconds) -> Snapshot:
    return Snapshot(_cpu_times(proc, cpus), own_seconds(), clock())


def others_between(a: Snapshot, b: Snapshot) -> tuple:
    """(others, steal) in CPUs on average from ``a`` to ``b``: what other processes and
    the hypervisor kept busy, our own CPU time subtracted; (None, None) where /proc did
    not say."""
    if a.times is None or b.times is None or b.times[2] <= a.times[2]:
        return None, None
    total, n = b.times[2] - a.times[2], min(a.times[3], b.times[3])
    busy_cpus = (b.times[0] - a.times[0]) / total * n      # CPUs kept busy, on average
    dt = b.at - a.at
    own_cpus = (b.own - a.own) / dt if dt > 0 else 0.0
    return max(0.0, busy_cpus - own_cpus), (b.times[1] - a.times[1]) / total * n


def sample_load(seconds: float = 0.5, proc: str = "/proc", sleep=time.sleep, *,
                cpu_set=None, clock=time.monotonic, own_seconds=_own_cpu_seconds) -> Load:
    """Sample /proc/stat over ``seconds`` on this process's CPUs (``cpu_set``, default
    its affinity mask) while it sleeps (``others_between``). ``clock`` and
    ``own_seconds`` (this process's CPU seconds) let tests replay a sample."""
    cpus = affinity_cpus() if cpu_set is None else set(cpu_set)
    before = snapshot(cpus, proc, clock=clock, own_seconds=own_seconds)
    sleep(seconds)
    after = snapshot(cpus, proc, clock=clock, own_seconds=own_seconds)
    dt = after.at - before.at
    others, steal = others_between(before, after)
    try:
        loadavg = float((Path(proc) / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        loadavg = None
    return Load(len(cpus), None if others is None else round(others, 3),
                None if steal is None else round(steal, 3), loadavg, round(dt, 3))
