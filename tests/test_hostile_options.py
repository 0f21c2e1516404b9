"""Hostile option values for all four tools: every numeric option refuses NaN, infinities
and out-of-range values with exit 2 and one stderr line naming the option; every usage
error is one line (README "Exit codes"; tests/hostile.py has the categories).

Each bad value runs the tool in-process on inputs where an option that slipped through
fails fast somewhere else (an empty model directory gives exit 3), so a missing check
shows as a wrong exit code instead of a long run. Each option also has good values,
checked at parse time (``make_context``): the control that the rule is not too strict.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3_doctor.cli import main as doctor_main
from k3_pack.cli import main as pack_main
from k3_run.cli import main as run_main
from k3_trace.cli import main as trace_main

from .hostile import check_refused, fail, invoke
from .hostile_inputs import small_trace

MIN_TEMPERATURE = 2.0 ** -126          # README: smallest normal float32
MAX_GB = 1e6                           # README: GB options are at most 1,000,000
MAX_GEN = 1 << 20                      # README: the trained context, 1,048,576 positions
MAX_TOP_K = 1 << 24                    # README: no vocabulary is wider than 2^24


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("opts")
    (d / "empty").mkdir()
    (d / "full").mkdir()
    (d / "full" / "keep.txt").write_text("not empty")
    raw = d / "raw.bin"
    np.array([[1, 2], [3, 4]], "<i4").tofile(raw)
    small_trace(d / "t.k3trace", n=64)
    return d


def _base(env, tool):
    """(click command, argv before the option under test)."""
    return {
        "run": (run_main, [env / "empty", "--ids", "1"]),
        "synth": (pack_main, ["synth", env / "full"]),
        "pack": (pack_main, [env / "empty", env / "packout"]),
        "import": (trace_main, ["import", env / "raw.bin", env / "imported.k3trace"]),
        "replay": (trace_main, ["replay", env / "t.k3trace"]),
        "size": (trace_main, ["size", env / "t.k3trace", "--pack", env / "empty",
                              "--seq-mbps", "100", "--rand-mbps", "100", "--budget-gb", "1"]),
        "doctor": (doctor_main, ["--quick"]),
    }[tool]


FLOAT_JUNK = ["nan", "NaN", "inf", "-inf", "1e400", "x"]
# (tool, option, bad values, good values)
OPTIONS = [
    ("run", "--gen", ["-2", "nan", "1.5", str(MAX_GEN + 1), str(10**18)],
     ["-1", "0", "16", str(MAX_GEN)]),
    ("run", "--top-k", ["-2", "nan", "1.5", str(MAX_TOP_K + 1)],
     ["-1", "0", "40", str(MAX_TOP_K)]),
    ("run", "--min-p", FLOAT_JUNK + ["-0.1", "1.01"], ["0", "0.05", "1"]),
    ("run", "--repeat-penalty", FLOAT_JUNK + ["0", "-1", "1e-39", "1e39"],
     ["1", "1.1", "0.5", "1.2e-38", "8e37"]),
    ("run", "--presence-penalty", FLOAT_JUNK + ["-2.01", "2.5"], ["-2", "0", "2"]),
    ("run", "--frequency-penalty", FLOAT_JUNK + ["-2.01", "2.5"], ["-2", "0.5", "2"]),
    ("run", "--temperature", FLOAT_JUNK + ["-0.5", "1e-320", "1e-45", "1e-39"],
     ["0", "0.7", "1.2e-38", "100"]),
    ("run", "--top-p", FLOAT_JUNK + ["0", "-0.1", "1.01"], ["1", "0.5", "1e-300"]),
    ("run", "--seed", ["-1", str(2**64), "nan", "1.5"], ["0", str(2**64 - 1)]),
    ("run", "--stop-id", ["-1", "nan", str(2**64)], ["0", "7"]),
    ("run", "--trunk-gb", FLOAT_JUNK + ["-1", "1e300", str(MAX_GB * 10)], ["0", "1.5"]),
    ("run", "--cache-gb", FLOAT_JUNK + ["-1", "1e300"], ["0", "1.5"]),
    ("run", "--io-threads", ["0", "65", "-1", "nan"], ["1", "64"]),
    ("run", "--prefetch-experts", ["-1", "4097", "nan", "1.5"], ["0", "16", "4096"]),
    ("run", "--prefill-chunk", ["0", "-1", "nan"], ["1", "64"]),
    ("run", "--spec", ["-1", "17"], ["0", "16"]),
    ("run", "--threads", ["0", "-1"], ["1"]),
    ("synth", "--seed", ["-1", str(2**64), "nan"], ["0", "7"]),
    ("pack", "--throttle-mbps", FLOAT_JUNK + ["0", "-1"], ["10"]),
    ("import", "--n-layers", ["0", "65536", "-1", "nan"], ["93", "65535"]),
    ("import", "--n-experts", ["0", "65536", "-1", "nan"], ["896", "65535"]),
    ("import", "--top-k", ["0", "-1", "65536"], ["16"]),
    ("import", "--expert-bytes", ["0", "-1", str(2**48 + 1)], ["1000"]),
    ("replay", "--capacity-gb", FLOAT_JUNK + ["-1", "0", "1,nan", "1,,x", "1e300"],
     ["1", "0.5,8"]),
    ("replay", "--slots", ["0", "-1", "nan", "1.5", "x", "3,-2"], ["17", "1000000000000"]),
    ("replay", "--expert-bytes", ["0", "-1", str(2**48 + 1)], ["1000"]),
    ("replay", "--jobs", ["0", "-1", "65"], ["1", "2"]),
    ("size", "--budget-gb", FLOAT_JUNK + ["0", "-1", "1e300"], ["1"]),
    ("size", "--seq-mbps", FLOAT_JUNK + ["0", "-1"], ["100"]),
    ("size", "--rand-mbps", FLOAT_JUNK + ["0", "-1"], ["100"]),
    ("size", "--steps", ["1", "65"], ["12"]),
    ("doctor", "--assume-memory-gb", FLOAT_JUNK + ["0", "-1", "1e300"], ["8"]),
    ("doctor", "--probe-size-mb", FLOAT_JUNK + ["0", "-1"], ["1000"]),
]
BAD = [(t, o, v) for t, o, bad, _ in OPTIONS for v in bad]
GOOD = [(t, o, v) for t, o, _, good in OPTIONS for v in good]


def _parses(main, argv):
    """Parse (and convert) argv as the tool would, without running it: None or the
    click error."""
    import click

    cmd, args = main, [str(a) for a in argv]
    if isinstance(main, click.Group):
        name = args[0] if args[0] in main.commands else "pack"
        cmd, args = main.commands[name], args[1:] if args[0] in main.commands else args
    try:
        cmd.make_context(cmd.name, args)
    except click.ClickException as e:
        return e
    return None


@pytest.mark.parametrize("tool,option,value", BAD, ids=[f"{t}{o}={v}" for t, o, v in BAD])
def test_option_bad_value_is_a_one_line_usage_error(env, tool, option, value):
    """Catches an option type that lets NaN, infinity or an out-of-range number through
    (to a traceback, a wrong answer or a later exit 3)."""
    main, base = _base(env, tool)
    check_refused(invoke(main, [*base, option, value]), 2, option)


@pytest.mark.parametrize("tool,option,value", GOOD, ids=[f"{t}{o}={v}" for t, o, v in GOOD])
def test_option_good_value_parses(env, tool, option, value):
    """Control: the documented range is accepted, ends included."""
    main, base = _base(env, tool)
    assert _parses(main, [*base, option, value]) is None


def test_option_import_top_k_above_n_experts_is_a_usage_error(env):
    """Catches a cross-option check left to the trace writer (exit 3 for a bad option)."""
    main, base = _base(env, "import")
    check_refused(invoke(main, [*base, "--n-experts", "10", "--top-k", "11"]), 2, "--top-k")
    ok = invoke(main, [*base, "--n-experts", "10", "--top-k", "10"])
    assert ok.code == 0, ok.stderr                                      # control


def _finite_float_texts():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                     st.sampled_from(["nan", "-nan", "inf", "+inf", "1e309", "4e-324",
                                      "0", "-0", "1e-38", "1.1754943508222875e-38"]))


def _in(v, lo, hi, lo_open=False, hi_open=False):
    return (math.isfinite(v) and (v > lo if lo_open else v >= lo)
            and (v < hi if hi_open else v <= hi))


# option -> (tool, documented domain of the parsed float)
FLOAT_DOMAINS = {
    "--temperature": ("run", lambda v: v == 0 or _in(v, MIN_TEMPERATURE, math.inf, hi_open=True)),
    "--top-p": ("run", lambda v: _in(v, 0, 1, lo_open=True)),
    "--min-p": ("run", lambda v: _in(v, 0, 1)),
    "--repeat-penalty": ("run", lambda v: _in(v, MIN_TEMPERATURE, 2.0 ** 126)),
    "--presence-penalty": ("run", lambda v: _in(v, -2, 2)),
    "--frequency-penalty": ("run", lambda v: _in(v, -2, 2)),
    "--trunk-gb": ("run", lambda v: _in(v, 0, MAX_GB)),
    "--budget-gb": ("size", lambda v: _in(v, 0, MAX_GB, lo_open=True)),
    "--assume-memory-gb": ("doctor", lambda v: _in(v, 0, MAX_GB, lo_open=True)),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(sorted(FLOAT_DOMAINS)), text=_finite_float_texts())
def test_option_float_accepted_exactly_on_its_documented_domain(env, option, text):
    """Property: a float option accepts a value iff it lies in the README's range; a
    refusal is one line, exit 2 (catches NaN slipping through a range check, which is
    false for every comparison)."""
    tool, domain = FLOAT_DOMAINS[option]
    main, base = _base(env, tool)
    err = _parses(main, [*base, option, text])
    if domain(float(text)):
        assert err is None, (option, text, err)
    else:
        check_refused(invoke(main, [*base, option, text]), 2, option)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.one_of(st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 2**64 - 1, 2**64])))
def test_option_seed_accepted_exactly_on_0_to_2_pow_64(env, seed):
    """Property: --seed is 0..2^64-1 (numpy's PCG64 refuses a negative seed at run time)."""
    main, base = _base(env, "run")
    if 0 <= seed < 2**64:
        assert _parses(main, [*base, "--seed", str(seed)]) is None, seed
    else:
        check_refused(invoke(main, [*base, "--seed", str(seed)]), 2, "--seed")


@pytest.mark.parametrize("main,argv,names", [
    (run_main, ["--bogus"], ["--bogus"]),
    (run_main, [], ["MODEL"]),
    (run_main, ["/nonexistent/model"], ["/nonexistent/model"]),
    (run_main, ["{empty}", "--cache-policy", "fifo"], ["--cache-policy"]),
    (pack_main, ["--bogus"], ["--bogus"]),
    (pack_main, ["synth", "--preset", "huge", "x"], ["--preset"]),
    (pack_main, ["verify"], ["OUT"]),
    (trace_main, ["replay"], ["TRACE"]),
    (trace_main, ["nosuch"], ["nosuch"]),
    (trace_main, ["size", "{trace}"], ["--budget-gb"]),
    (doctor_main, ["--bogus"], ["--bogus"]),
])
def test_usage_error_is_one_line_exit_2(env, main, argv, names):
    """Catches click's multi-line usage block (usage, hint, blank line, error)."""
    argv = [a.format(empty=env / "empty", trace=env / "t.k3trace") for a in argv]
    check_refused(invoke(main, argv), 2, *names)


def test_usage_help_and_version_still_exit_0(env):
    """Control: --help and --version are not errors and print to stdout."""
    for main in (run_main, pack_main, trace_main, doctor_main):
        for flag in ("--help", "--version"):
            out = invoke(main, [flag])
            assert out.code == 0 and out.stdout and not out.stderr, (main.name, flag)


def test_temperature_below_the_smallest_normal_float32_is_refused_not_noise():
    """Catches a subnormal temperature reaching the sampler, where logits / temperature
    overflows to inf and inf - inf = NaN probabilities (README: refused; the option case
    is in OPTIONS)."""
    from libk3.engine.sampler import Sampler

    logits = np.array([1e38, -1e38, 3.0], np.float32)
    assert Sampler(MIN_TEMPERATURE, 1.0, 0)(logits, 0) == 0     # control: the edge samples
    try:
        Sampler(1e-320, 1.0, 0)
    except ValueError:
        return
    fail("exit0", "the sampler accepted the subnormal temperature 1e-320")
