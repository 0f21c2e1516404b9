"""Hostile chat templates: a template is code from the checkpoint folder, so one that loops
or writes without end, raises, or does not compile must be that conversation's error
(TemplateFailure: 422 in the server, the batch line skipped, exit 3 in the chat) while
everything else keeps working, and one that does not compile is refused before a server
listens (docs/serve.md "Chat templates"; tests/hostile.py has the categories).

In-process first (the limits are the library's), then one run per front end: a server,
a batch and a chat on a model whose template misbehaves on cue (the first message's
text) and renders the bundled template otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from libk3.errors import CheckpointError
from libk3.text.chat_template import (ChatInputError, ChatTemplate, RenderLimits,
                                      TemplateFailure, load_chat_template)

from .hostile import fail
from .scripts import k3

LIMITS = RenderLimits(seconds=0.3, max_bytes=100_000)
MSGS = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested ranges": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                     "{% endfor %}",
    "one range reused": "{% set r = range(100000) %}{% for a in r %}{% for b in r %}"
                        "{% endfor %}{% endfor %}",
    "a long string": "{% set s = 'ab' * 40000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                     "{% endfor %}",
    "macro recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                       "{% endmacro %}{{ f(60) }}",
    "recursive loop": "{% for a in range(1000) recursive %}{% if loop.depth < 5 %}"
                      "{{ loop(range(1000)) }}{% endif %}{% endfor %}",
    "output flood": "{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxx"
                    "{% endfor %}{% endfor %}",
    "repetition": "{{ 'x' * 10 ** 12 }}",
    "power": "{{ 10 ** 100000000 }}",
    "division by zero": "{{ 1 // 0 }}",
    "a lone surrogate": "{{ '\\ud800' }}",
    "raise_exception": "{{ raise_exception('no thanks') }}",
    "unsafe attribute": "{{ messages.__class__.__mro__ }}",
    "call of a string": "{{ 'x'() }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_template_misbehaving_is_that_conversations_error_within_its_limits(name):
    """Catches a rendering without a time or size limit (a loop, a macro's recursion or
    a flood ran for hours or until memory ran out) and a template's exception escaping
    as a traceback (ZeroDivisionError, a lone surrogate reaching the tokenizer)."""
    t = ChatTemplate({"default": HOSTILE[name]}, "model/chat_template.jinja", {}, LIMITS)
    started = time.monotonic()
    try:
        t.render(MSGS)
    except TemplateFailure as e:
        assert e.exit_code == 3 and e.path == "model/chat_template.jinja", e.one_line()
    except Exception as e:          # noqa: BLE001 (classified here)
        fail("traceback", f"{name}: {type(e).__name__}: {e}")
    else:
        fail("exit0", f"{name}: rendered")
    took = time.monotonic() - started
    if took > LIMITS.seconds + 2:
        fail("unbounded", f"{name}: {took:.1f} s for a limit of {LIMITS.seconds} s")
    ok = ChatTemplate({"default": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                      "t", {}, LIMITS)
    assert ok.render(MSGS) == "hi"                                               # control


LOOPS = [
    "{% for x in range(3000) %}{% if loop.last %}{{ loop.length }},{{ loop.revindex0 }}"
    "{% endif %}{% endfor %}",
    "{% for x in range(3000) | map('string') %}{% if loop.last %}{{ loop.length }}|{{ x }}"
    "{% endif %}{% endfor %}",
    "{% for x in [] %}a{% else %}empty{% endfor %}{% for x in 'abc' %}{{ loop.index }}"
    "{{ x }}{{ loop.cycle('-', '+') }}{% endfor %}",
    "{% for x in [1, [2, [3, 4]], 5] recursive %}{% if x is iterable %}({{ loop(x) }})"
    "{% else %}{{ x }}.{{ loop.depth }}{% endif %}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ loop.index }}{{ m.content }}{% endfor %}"
    "{{ ('ab' * 3) ~ (2 ** 10) }}",
]


def test_template_loop_guard_stops_a_runaway_loop_and_changes_no_other():
    """Catches a loop guard that changes a loop's meaning (loop.length, revindex, last,
    else, cycle, a recursive loop, a filtered loop) or an intercepted * or ** that
    computes another value (each source writes what jinja's plain sandbox writes), or
    one that lets the same loops, nested in one more, run for minutes."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = MSGS + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    for src in LOOPS:
        ours = ChatTemplate({"default": src}, "t", {}, LIMITS).render(msgs)
        assert ours == plain.from_string(src).render(messages=msgs, add_generation_prompt=True)
        assert ours, src
    runaway = "{% for a in range(100000) %}" + LOOPS[0] + "{% endfor %}"
    started = time.monotonic()
    with pytest.raises(TemplateFailure, match="time limit"):
        ChatTemplate({"default": runaway}, "t", {}, LIMITS).render(msgs)
    assert time.monotonic() - started < LIMITS.seconds + 2


def test_template_nested_too_deeply_to_compile_is_refused_naming_the_file(tmp_path):
    """Catches a template whose parser recursion escapes as a RecursionError traceback
    (k3 must say which file it could not compile)."""
    (tmp_path / "chat_template.jinja").write_text("{% if 1 %}" * 5000 + "{% endif %}" * 5000)
    t = load_chat_template(tmp_path)
    with pytest.raises(CheckpointError, match="chat_template.jinja: chat template is nested"):
        t.check()
    (tmp_path / "chat_template.jinja").write_text("{% if 1 %}" * 50 + "{% endif %}" * 50)
    load_chat_template(tmp_path).check()                                        # control


def test_template_output_surrogate_from_the_conversation_is_the_conversations_error():
    """Catches a lone surrogate the caller's message brought blamed on the template
    (exit 3, "the model's template is broken") instead of the message (exit 2)."""
    t = ChatTemplate({"default": "{{ messages[0].content }}"}, "t", {}, LIMITS)
    with pytest.raises(ChatInputError, match=r'"messages"\[0\]\["content"\]') as e:
        t.render([{"role": "user", "content": "a\udcff"}])
    assert not isinstance(e.value, TemplateFailure) and e.value.exit_code == 2
    assert t.render([{"role": "user", "content": "a\u00ff"}]) == "a\u00ff"     # control


# ---- the front ends, on a model whose template misbehaves on cue ---------------------------

CUES = ("{%- set cue = messages[0].content if messages[0].content is string else '' -%}\n"
        "{%- if cue == 'spin' -%}{%- for a in range(100000) -%}{%- for b in range(100000) -%}"
        "{%- endfor -%}{%- endfor -%}\n"
        "{%- elif cue == 'boom' -%}{{ 1 // 0 }}\n"
        "{%- elif cue == 'flood' -%}{%- for a in range(10000) -%}{{ 'x' * 1000 }}"
        "{%- endfor -%}\n{%- endif -%}\n")


def model_with_template(tiny_dir, d, text: str):
    """A model directory ``d``: tiny's files (linked) and ``text`` as chat_template.jinja
    (which wins over tokenizer_config.json's template)."""
    d.mkdir(exist_ok=True)
    for f in tiny_dir.iterdir():
        if not (d / f.name).exists():
            (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def cued(tiny_dir, tmp_path_factory):
    """tiny with the bundled template behind the cues."""
    bundled = json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]
    return model_with_template(tiny_dir, tmp_path_factory.mktemp("cued") / "m", CUES + bundled)


def _no_traceback(stderr: str) -> None:
    if "Traceback" in stderr:
        fail("traceback", stderr[-400:])


def test_batch_template_failures_skip_their_lines_and_the_rest_run(cued, tmp_path):
    """Catches a template that stalls the batch (a loop for hours) or aborts it with a
    traceback (an exception): each such line is skipped with its reason, the others run."""
    batch = tmp_path / "b.jsonl"
    rows = [{"id": cue, "messages": [{"role": "user", "content": cue}], "gen": 2}
            for cue in ("first", "spin", "boom", "flood", "last")]
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.jsonl"
    p = k3(cued, "--batch", batch, "--out", out, "--json", "--template-timeout", 1,
           "--template-max-bytes", 1_000_000, timeout=120)
    _no_traceback(p.stderr)
    assert p.returncode == 0, p.stderr
    errors = {e["line"]: e["error"] for e in json.loads(p.stdout)["errors"]}
    assert sorted(errors) == [2, 3, 4], errors
    assert "time limit of 1 s" in errors[2] and "ZeroDivisionError" in errors[3]
    assert "limit of 1000000 bytes" in errors[4]
    assert all("chat_template.jinja" in e for e in errors.values())
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["first", "last"]


@pytest.mark.parametrize("cue,needle", [("boom", "ZeroDivisionError"),
                                        ("spin", "time limit of 1 s")])
def test_chat_template_failure_exits_3_naming_the_template(cued, cue, needle):
    """Catches a chat that hangs in the template or dies with a traceback: exit 3, one
    line naming the template file and what it did."""
    p = k3(cued, "--chat", "--gen", 1, "--template-timeout", 1, input=f"{cue}\n", timeout=120)
    _no_traceback(p.stderr)
    assert p.returncode == 3, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "chat_template.jinja" in last and needle in last, p.stderr
    ok = k3(cued, "--chat", "--gen", 1, input="hello\n", timeout=120)           # control
    assert ok.returncode == 0, ok.stderr


def test_serve_refuses_a_template_that_does_not_compile_before_listening(tiny_dir, tmp_path):
    """Catches a server that listens with a broken template and answers every chat
    request 500 (the template was compiled at the first request, and at every one)."""
    m = model_with_template(tiny_dir, tmp_path / "m", "ok\n{% for m in messages %}")
    p = k3(m, "--serve", "127.0.0.1:0", timeout=120)
    _no_traceback(p.stderr)
    assert p.returncode == 3 and "serving" not in p.stderr, p.stderr
    assert "chat_template.jinja: chat template line" in p.stderr


@pytest.fixture(scope="module")
def server(cued, tmp_path_factory):
    from .test_serve import _start, _stop
    srv = _start(cued, tmp_path_factory.mktemp("serve_tpl") / "stderr.log", "--gen", 2,
                 "--template-timeout", 1, "--template-max-bytes", 1_000_000)
    yield srv
    _stop(srv)


def test_serve_template_failures_are_422_and_the_server_keeps_serving(server):
    """Catches a template that holds the server's CPU thread for as long as it loops
    (every request waits behind it), or whose exception is a 500 with a traceback: each
    is a 422 OpenAI error naming the file; /health answers all along, a normal chat
    request beside it is served, and the server is healthy afterwards."""
    pytest.importorskip("aiohttp")
    from .test_serve import _health, _post
    from .test_serve_loop import STALL, _get

    def chat(cue):
        body = {"messages": [{"role": "user", "content": cue}], "max_tokens": 2}
        return _post(server, "/v1/chat/completions", json.dumps(body).encode())

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        spin = pool.submit(chat, "spin")
        time.sleep(0.2)
        beside = pool.submit(chat, "hello")
        latencies = []
        while not (spin.done() and beside.done()):
            t0 = time.monotonic()
            assert _get(server, "/health")[0] == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
        status, err = spin.result()
        assert status == 422 and "time limit of 1 s" in err["error"]["message"], err
        assert beside.result()[0] == 200
    assert len(latencies) > 5 and max(latencies) < STALL, latencies
    for cue, needle in (("boom", "ZeroDivisionError"), ("flood", "1000000 bytes")):
        status, err = chat(cue)
        assert status == 422 and needle in err["error"]["message"], (cue, err)
        assert "chat_template.jinja" in err["error"]["message"]
    assert chat("hello")[0] == 200 and _health(server)["status"] == "ok"       # control
    _no_traceback(server["log"].read_text())


# ---- random template programs --------------------------------------------------------------

def _programs():
    """Template programs from a small grammar of Jinja: text, expressions (huge numbers,
    repetition, powers, division by zero, undefined names, attributes of the
    conversation, raise_exception, filters), loops (over ranges up to 10^6, strings, the
    messages, recursive), conditionals, assignments and macros, nested."""
    from hypothesis import strategies as st
    exprs = st.sampled_from([
        "1", "10 ** 6", "10 ** 100000", "'ab' * 10 ** 7", "'x' * 3", "1 // 0", "nothing",
        "nothing.attr", "messages", "messages[0].content", "messages[5]", "(messages | length)",
        "raise_exception('no')", "range(10 ** 6) | list | length", "'\\ud800'", "loop",
        "[1, 2] + 3", "messages | tojson", "(messages[0].content * 10 ** 6) | length",
        "none.x", "'%s' % 5", "x", "v ~ v"])
    iters = st.sampled_from(["range(3)", "range(10 ** 6)", "messages", "'abc'", "x",
                             "range(10 ** 6) | map('string')", "[]", "nothing"])
    leaf = st.one_of(st.sampled_from(["text", " ", "\n", "<|open|>"]),
                     exprs.map(lambda e: "{{ " + e + " }}"))

    def grow(inner):
        body = st.lists(inner, min_size=1, max_size=3).map("".join)
        return st.one_of(
            st.tuples(iters, body).map(lambda t: f"{{% for x in {t[0]} %}}{t[1]}{{% endfor %}}"),
            st.tuples(exprs, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% endif %}}"),
            st.tuples(exprs, body).map(lambda t: f"{{% set v = {t[0]} %}}{t[1]}"),
            body.map(lambda b: f"{{% macro f(n) %}}{b}{{% if n %}}{{{{ f(n - 1) }}}}"
                               f"{{{{ f(n - 1) }}}}{{% endif %}}{{% endmacro %}}{{{{ f(30) }}}}"),
            st.tuples(iters, body).map(
                lambda t: f"{{% for x in {t[0]} recursive %}}{t[1]}{{% if loop.depth < 4 %}}"
                          f"{{{{ loop({t[0]}) }}}}{{% endif %}}{{% endfor %}}"))
    return st.recursive(leaf, grow, max_leaves=8)


def test_template_random_programs_render_or_fail_cleanly_within_their_limits():
    """Catches a construct nobody listed above escaping the sandbox's limits or its error
    mapping: for Jinja programs drawn from a small grammar (``_programs``), a rendering
    returns text within the size limit or raises TemplateFailure naming the template (or
    the template is refused as it compiles, naming it), within the time limit plus a
    margin, and the same program renders the same way twice."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_programs())
    def check(source):
        outcomes = []
        for _ in range(2):
            started = time.monotonic()
            try:
                t = ChatTemplate({"default": source}, "model/chat_template.jinja", {}, LIMITS)
                out = ("text", t.render(MSGS))
                assert len(out[1].encode("utf-8", "surrogatepass")) <= LIMITS.max_bytes
            except (TemplateFailure, CheckpointError) as e:
                assert e.path == "model/chat_template.jinja", (source, e.one_line())
                out = ("error", type(e).__name__)
            except Exception as e:          # noqa: BLE001 (classified here)
                fail("traceback", f"{source!r}: {type(e).__name__}: {e}")
            took = time.monotonic() - started
            if took > LIMITS.seconds + 2:
                fail("unbounded", f"{source!r}: {took:.1f} s for {LIMITS.seconds} s")
            outcomes.append(out)
        assert outcomes[0] == outcomes[1], source
    check()
