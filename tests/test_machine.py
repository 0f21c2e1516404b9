"""The machine room (libk3.machine): the cgroup CPU quota, the CPUs a process may use,
the thread team set up before numba loads, and the load sampled from /proc/stat.
Everything reads a fake /proc or cgroup tree, or dicts, except one check in a child
process pinned to one CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from libk3.errors import UsageError
from libk3.machine import cgroup, cpus, threads

PERIOD = 100_000


# ---- cgroup CPU quota -------------------------------------------------------------------

def _cpu_tree(root: Path, version: int, leaf: str | None, parent: str | None = None,
              period: str = str(PERIOD)) -> Path:
    """A fake /proc (self/cgroup, self/mounts) and one cgroup hierarchy under ``root``:
    this process in /user/job; ``leaf`` and ``parent`` are the quota files' text in the
    job's group and its parent (None: no file). v1 puts ``period`` beside each quota."""
    proc, cg = root / "proc", root / f"cg{version}"
    (proc / "self").mkdir(parents=True)
    (cg / "user" / "job").mkdir(parents=True)
    if version == 2:
        (proc / "self" / "cgroup").write_text("0::/user/job\n")
        (proc / "self" / "mounts").write_text(f"cgroup2 {cg} cgroup2 rw,nosuid 0 0\n")
        name = "cpu.max"
    else:
        (proc / "self" / "cgroup").write_text("5:memory:/user/job\n4:cpu,cpuacct:/user/job\n")
        (proc / "self" / "mounts").write_text(
            f"cgroup {root / 'mem'} cgroup rw,memory 0 0\n"
            f"cgroup {cg} cgroup rw,nosuid,cpu,cpuacct 0 0\n")
        name = "cpu.cfs_quota_us"
    for d, text in ((cg / "user" / "job", leaf), (cg / "user", parent)):
        if text is not None:
            (d / name).write_text(text + "\n")
            if version == 1:
                (d / "cpu.cfs_period_us").write_text(period + "\n")
    return proc


@pytest.mark.parametrize("version, text, quota, count", [
    (2, "200000 100000", 2.0, 2),
    (2, "max 100000", None, 8),
    (2, "150000 100000", 1.5, 2),        # a fraction of a CPU rounds up: 1.5 CPUs -> 2
    (2, "50000 100000", 0.5, 1),         # below one CPU: still one thread, never 0
    (1, "200000", 2.0, 2),
    (1, "-1", None, 8),                  # v1's "no quota"
    (1, "250000", 2.5, 3),
])
def test_cgroup_cpu_quota_v2_and_v1_from_a_fake_tree(tmp_path, version, text, quota, count):
    """Catches 'max' or v1's -1 read as a quota, the period ignored, a fractional quota
    rounded down (1.5 CPUs must give a team of 2: a team larger than the quota is only
    throttled in turns, a smaller one leaves half a CPU idle) or a count of 0."""
    proc = _cpu_tree(tmp_path, version, text)
    got, source = cgroup.cpu_quota(proc=str(proc))
    assert got == quota
    if quota is None:
        assert source is None
    else:
        assert f"cgroup v{version}" in source and str(tmp_path) in source
    allow = cpus.allowance(proc=str(proc), affinity=8)
    assert allow.quota == quota and allow.count == count


def test_cgroup_cpu_quota_is_the_smallest_on_the_path(tmp_path):
    """Catches reading only the leaf group: a parent's quota binds its children too."""
    proc = _cpu_tree(tmp_path / "a", 2, "max 100000", "300000 100000")
    assert cgroup.cpu_quota(proc=str(proc))[0] == 3.0
    proc = _cpu_tree(tmp_path / "b", 2, "400000 100000", "300000 100000")
    quota, source = cgroup.cpu_quota(proc=str(proc))
    assert quota == 3.0 and source.endswith(str(tmp_path / "b" / "cg2" / "user" / "cpu.max"))
    proc = _cpu_tree(tmp_path / "c", 1, "100000", "-1", period="50000")
    assert cgroup.cpu_quota(proc=str(proc))[0] == 2.0            # 100000 / 50000
    proc = _cpu_tree(tmp_path / "d", 2, None)                     # no file at all
    assert cgroup.cpu_quota(proc=str(proc)) == (None, None)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(quota=st.integers(0, 10**8), period=st.integers(1000, 1_000_000),
       affinity=st.integers(1, 512))
def test_cgroup_quota_gives_a_team_of_at_least_one_and_at_most_the_mask(tmp_path, quota,
                                                                        period, affinity):
    """Catches a count of 0 (a tiny or zero quota), a count above the affinity mask, or
    a fractional quota rounded down: the team is ceil(quota / period), between 1 and
    the mask's size."""
    proc = tmp_path / "proc"
    if not proc.exists():
        proc = _cpu_tree(tmp_path, 2, "max 100000")
    (tmp_path / "cg2" / "user" / "job" / "cpu.max").write_text(f"{quota} {period}\n")
    allow = cpus.allowance(proc=str(proc), affinity=affinity)
    assert allow.quota == quota / period
    assert allow.count == max(1, min(affinity, -(-quota // period)))
    assert 1 <= allow.count <= affinity


# ---- the allowance ------------------------------------------------------------------------

def test_allowance_is_the_smaller_of_affinity_and_quota_and_says_which():
    """Catches a count that ignores the quota or the mask, or a reason that names the
    source that did not limit it."""
    by_quota = cpus.Allowance(8, 2.0, "cgroup v2 /sys/fs/cgroup/job/cpu.max")
    assert by_quota.count == 2
    assert "quota" in by_quota.why and "/sys/fs/cgroup/job/cpu.max" in by_quota.why
    by_mask = cpus.Allowance(3, 6.0, "cgroup v2 /x/cpu.max")
    assert by_mask.count == 3 and "affinity" in by_mask.why and "quota" not in by_mask.why
    free = cpus.Allowance(4, None, None)
    assert free.count == 4 and "affinity" in free.why
    assert cpus.Allowance(0, None, None).count == 1
    j = by_quota.to_json()
    assert j["count"] == 2 and j["why"] == by_quota.why and j["affinity"] == 8


def test_allowance_affinity_defaults_to_the_real_mask(tmp_path):
    proc = _cpu_tree(tmp_path, 2, "max 100000")
    assert cpus.allowance(proc=str(proc)).affinity == len(os.sched_getaffinity(0))


# ---- the thread team ------------------------------------------------------------------

@pytest.fixture
def before_numba(monkeypatch):
    """prepare() as a tool's entry runs it: numba not loaded yet (this test process has
    loaded it; prepare only looks at sys.modules and never imports numba then)."""
    monkeypatch.delitem(sys.modules, "numba", raising=False)


A3 = cpus.Allowance(3, None, None)


def test_prepare_takes_the_allowance_and_sets_wait_policy_and_layers(before_numba):
    """Catches a team not sized from the allowance, or the spin before sleeping or the
    layer order left unset (libgomp then spins idle threads 3x longer; numba may pick
    workqueue)."""
    env: dict = {}
    team = threads.prepare(environ=env, user={}, allowance=A3)
    assert env == {"NUMBA_NUM_THREADS": "3", "GOMP_SPINCOUNT": str(threads.SPIN_COUNT),
                   "NUMBA_THREADING_LAYER_PRIORITY": "omp tbb workqueue"}
    assert (team.threads, team.threads_from) == (3, A3.why)
    assert (team.wait_policy, team.wait_from) == (f"GOMP_SPINCOUNT={threads.SPIN_COUNT}", "k3")
    assert team.layer_from == "k3" and not team.late
    quota = cpus.Allowance(8, 1.5, "cgroup v2 /q/cpu.max")
    assert threads.prepare(environ={}, user={}, allowance=quota).threads == 2


def test_prepare_threads_option_wins_then_the_users_count(before_numba):
    """Catches --threads losing to the environment, the user's NUMBA_NUM_THREADS
    overridden by the allowance, or a second prepare taking k3's own write as the user's."""
    env: dict = {}
    team = threads.prepare(2, environ=env, user={"NUMBA_NUM_THREADS": "5"}, allowance=A3)
    assert (team.threads, team.threads_from, env["NUMBA_NUM_THREADS"]) == (2, "--threads", "2")
    env = {}
    team = threads.prepare(environ=env, user={"NUMBA_NUM_THREADS": "5"}, allowance=A3)
    assert (team.threads, team.threads_from, env["NUMBA_NUM_THREADS"]) == (5, "environment", "5")
    env = {}
    threads.prepare(environ=env, user={}, allowance=A3)          # a tool's entry
    again = threads.prepare(environ=env, user={}, allowance=cpus.Allowance(1, None, None))
    assert again.threads == 1 and env["NUMBA_NUM_THREADS"] == "1"


@pytest.mark.parametrize("bad", ["abc", "0", "-2", "1.5", " "])
def test_prepare_bad_user_count_is_a_one_line_usage_error(before_numba, bad):
    """Catches a bad NUMBA_NUM_THREADS passed on to numba (which fails at import with a
    traceback) or an error that does not say which variable, or how to fix it."""
    with pytest.raises(UsageError) as e:
        threads.prepare(environ={}, user={"NUMBA_NUM_THREADS": bad}, allowance=A3)
    line = e.value.one_line()
    assert "\n" not in line and "NUMBA_NUM_THREADS" in line and repr(bad) in line
    assert "--threads" in line and e.value.exit_code == 2
    assert threads.prepare(4, environ={}, user={"NUMBA_NUM_THREADS": bad},
                           allowance=A3).threads == 4                  # --threads wins


def test_prepare_keeps_the_users_wait_policy_and_layer(before_numba):
    """Catches k3 overwriting a wait policy or a threading layer the user chose."""
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    team = threads.prepare(environ=env, user={"OMP_WAIT_POLICY": "ACTIVE"}, allowance=A3)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "NUMBA_NUM_THREADS": "3",
                   "NUMBA_THREADING_LAYER_PRIORITY": "omp tbb workqueue"}
    assert (team.wait_policy, team.wait_from) == ("OMP_WAIT_POLICY=ACTIVE", "environment")
    env = {"GOMP_SPINCOUNT": "7"}
    team = threads.prepare(environ=env, user={"GOMP_SPINCOUNT": "7"}, allowance=A3)
    assert env["GOMP_SPINCOUNT"] == "7" and team.wait_from == "environment"
    env = {"NUMBA_THREADING_LAYER": "tbb"}
    team = threads.prepare(environ=env, user={"NUMBA_THREADING_LAYER": "tbb"}, allowance=A3)
    assert "NUMBA_THREADING_LAYER_PRIORITY" not in env and env["NUMBA_THREADING_LAYER"] == "tbb"
    assert (team.layer, team.layer_from) == ("tbb", "environment")
    order = "tbb omp workqueue"
    env = {"NUMBA_THREADING_LAYER_PRIORITY": order}
    team = threads.prepare(environ=env, user={"NUMBA_THREADING_LAYER_PRIORITY": order},
                           allowance=A3)
    assert env["NUMBA_THREADING_LAYER_PRIORITY"] == order and team.layer == order
    assert env["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT)   # the rest is still k3's


def test_prepare_after_numba_loaded_only_sets_the_team_size():
    """Catches a late prepare that writes NUMBA_NUM_THREADS (numba read it already)
    instead of setting the team size, or that says it was in time."""
    import numba
    threads_before = numba.get_num_threads()
    try:
        env: dict = {}
        team = threads.prepare(1, environ=env, user={}, allowance=A3)
        assert team.late and team.threads == 1 and numba.get_num_threads() == 1
        assert "NUMBA_NUM_THREADS" not in env
        assert threads.in_force()["threads"] == 1
    finally:
        numba.set_num_threads(threads_before)


def _clean_env() -> dict:
    env = dict(os.environ)
    for name in ("NUMBA_NUM_THREADS", "OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER",
                 "NUMBA_THREADING_LAYER_PRIORITY"):
        env.pop(name, None)
    return env


_CHILD = ("from libk3.machine import threads; t = threads.prepare(); import numba; "
          "print(t.threads, numba.config.NUMBA_NUM_THREADS, numba.get_num_threads())")


def test_prepare_in_a_process_pinned_to_one_cpu_makes_a_team_of_one():
    """Catches a team sized from os.cpu_count() (every CPU of the machine) instead of the
    CPUs the process may run on: under ``taskset -c 0`` numba must get one thread."""
    taskset = shutil.which("taskset")
    mine = sorted(os.sched_getaffinity(0))
    if taskset is None or len(mine) < 2:
        pytest.skip("needs taskset and at least two CPUs")
    pinned = subprocess.run([taskset, "-c", str(mine[0]), sys.executable, "-c", _CHILD],
                            capture_output=True, text=True, timeout=120, env=_clean_env())
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == ["1", "1", "1"]
    free = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120, env=_clean_env())                       # control
    n = str(cpus.allowance().count)
    assert free.returncode == 0 and free.stdout.split() == [n, n, n], free.stderr


# ---- load ---------------------------------------------------------------------------------

def _stat(*cpu_lines) -> str:
    """/proc/stat text: an aggregate line (ignored) and one line per CPU of
    (user, nice, system, idle, iowait, irq, softirq, steal), plus guest fields."""
    agg = [sum(c[i] for c in cpu_lines) for i in range(8)]
    rows = ["cpu  " + " ".join(map(str, agg)) + " 0 0"]
    rows += [f"cpu{i} " + " ".join(map(str, c)) + " 0 0" for i, c in enumerate(cpu_lines)]
    return "\n".join(rows + ["intr 1 2 3", "ctxt 42", "btime 1700000000"]) + "\n"


def _sample(tmp_path, before: str, after: str, own=(10.0, 10.0), cpu_set=(0, 1),
            loadavg="1.50 1.00 0.50 2/300 4242\n") -> cpus.Load:
    """sample_load over a fake /proc whose stat reads ``before`` then ``after`` one
    second later, this process having used ``own`` CPU seconds before and after."""
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "stat").write_text(before)
    (proc / "loadavg").write_text(loadavg)
    ticks, owns = iter([100.0, 101.0]), iter(own)
    return cpus.sample_load(1.0, str(proc), sleep=lambda s: (proc / "stat").write_text(after),
                            cpu_set=cpu_set, clock=lambda: next(ticks),
                            own_seconds=lambda: next(owns))


BASE = ((1000, 0, 500, 9000, 10, 0, 0, 0), (800, 0, 400, 9500, 0, 0, 0, 0),
        (50, 0, 50, 10000, 0, 0, 0, 0))


def _plus(base, *deltas):
    return tuple(tuple(a + b for a, b in zip(c, d)) for c, d in zip(base, deltas))


def test_sample_load_counts_others_and_steal_in_cpus(tmp_path):
    """Catches a busy share measured in CPU-seconds (scaled by the sample's length)
    instead of CPUs, steal left out, idle or iowait counted as busy, a CPU outside the
    affinity mask counted, or our own CPU time not subtracted. Over one second (100
    jiffies per CPU): cpu0 70 busy, cpu1 40 busy and 30 steal, cpu2 (not ours) all busy;
    we used 0.3 CPU seconds ourselves."""
    after = _plus(BASE, (50, 5, 10, 20, 10, 3, 2, 0), (30, 0, 10, 30, 0, 0, 0, 30),
                  (90, 0, 10, 0, 0, 0, 0, 0))
    load = _sample(tmp_path, _stat(*BASE), _stat(*after), own=(10.0, 10.3))
    assert load.usable == 2 and load.seconds == 1.0 and load.loadavg_1m == 1.5
    assert load.others == pytest.approx((70 + 40) / 200 * 2 - 0.3, abs=1e-3)     # 0.8
    assert load.steal == pytest.approx(30 / 200 * 2, abs=1e-3)                   # 0.3
    assert load.busy == ["other processes used 0.8 of 2 CPUs",
                         "the hypervisor took 0.3 of 2 CPUs (steal)"]
    j = load.to_json()
    assert j["busy"] == load.busy and j["others"] == load.others


def test_sample_load_idle_machine_is_not_busy(tmp_path):
    """Catches the busy judgement firing on an idle machine (iowait is idle time; our own
    threads' work is not another process's) or below BUSY_CPUS."""
    after = _plus(BASE, (2, 0, 1, 90, 7, 0, 0, 0), (3, 0, 2, 95, 0, 0, 0, 0),
                  (100, 0, 0, 0, 0, 0, 0, 0))
    load = _sample(tmp_path, _stat(*BASE), _stat(*after))
    assert load.others == pytest.approx(0.08, abs=1e-3) and load.steal == 0
    assert load.busy == []
    ours = _plus(BASE, (60, 0, 0, 40, 0, 0, 0, 0), (60, 0, 0, 40, 0, 0, 0, 0), (0,) * 8)
    assert _sample(tmp_path, _stat(*BASE), _stat(*ours), own=(5.0, 6.2)).busy == []
    j = round(cpus.BUSY_CPUS * 100)                  # jiffies of 200: BUSY_CPUS CPUs
    edge = _plus(BASE, (j, 0, 0, 100 - j, 0, 0, 0, 0), (0, 0, 0, 100, 0, 0, 0, 0), (0,) * 8)
    assert _sample(tmp_path, _stat(*BASE), _stat(*edge)).busy        # at the threshold


def test_sample_load_without_proc_stat_says_nothing(tmp_path):
    """Catches a crash, or an invented figure, where /proc/stat cannot be read."""
    proc = tmp_path / "noproc"
    proc.mkdir()
    load = cpus.sample_load(0.0, str(proc), sleep=lambda s: None, cpu_set={0})
    assert load.others is None and load.steal is None and load.loadavg_1m is None
    assert load.busy == []


def _two_cpu_stat(path, busy_per_cpu, idle_per_cpu):
    """A /proc/stat of 2 CPUs, each with ``busy`` user and ``idle`` jiffies."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {busy_per_cpu} 0 0 {idle_per_cpu} 0 0 0 0 0 0" for i in range(2)]
    (path / "stat").write_text("\n".join(lines) + "\n")


def test_fit_narrows_at_once_and_grows_back_after_two_free_looks(tmp_path):
    """Catches a team that keeps waiting on a core another process holds (the cliff of
    issue 30), one that never grows back, or one that flaps on a single free look."""
    clock = {"t": 0.0}
    own = {"s": 0.0}
    busy, idle = [0], [0]

    def tick(other_busy: float, ours: float):
        """FIT_EVERY seconds pass: others keep ``other_busy`` CPUs busy, we ``ours``."""
        dt = threads.FIT_EVERY
        jiffies = dt * 100
        busy[0] += (other_busy + ours) / 2 * jiffies
        idle[0] += (2 - other_busy - ours) / 2 * jiffies
        own["s"] += ours * dt
        clock["t"] += dt
        _two_cpu_stat(tmp_path, int(busy[0]), int(idle[0]))

    _two_cpu_stat(tmp_path, 0, 0)
    fit = threads._Fit(2, {0, 1}, clock=lambda: clock["t"], proc=str(tmp_path),
                       own_seconds=lambda: own["s"])
    assert fit.look() is None                          # too soon: no look yet
    tick(0.0, 2.0)
    assert fit.look() == 2                             # free machine: the whole team
    tick(1.0, 1.0)
    assert fit.look() == 1                             # a busy loop on one core: at once
    tick(0.0, 1.0)
    assert fit.look() == 1                             # one free look is not enough
    tick(0.0, 1.0)
    assert fit.look() == 2                             # two in a row: back to the team
    tick(0.4, 1.6)
    assert fit.look() == 2                             # under half a CPU: kept
