"""What the chat template's limits cost: one rendering of the bundled template
(``fixtures/tiny``) on six conversations, three ways, alternated in one process.

* ``bounded``: k3's rendering (``ChatTemplate.render``: the time and output limits
  checked from inside the template, libk3/text/chat_template.py);
* ``plain``: the same steps (conversation checks, the template picked and its compiled
  form looked up, the variables) in jinja2's immutable sandbox with HF's options and no
  limits: what k3 rendered with before the limits;
* ``child``: ``plain`` in a child process that stays up (forkserver), the conversation
  sent and the text returned over a pipe: the other way to bound a rendering, paying
  the copying and the two process switches instead of checks.

Prints microseconds per rendering: the minimum over the rounds (the least disturbed by
the machine's other work) and the median. ``--only WAY`` renders one way ``--rounds``
times and prints nothing, for counting instructions, which a busy machine does not
disturb: the difference of two runs under ``valgrind --tool=cachegrind`` divided by the
renderings between them.

    python bench/template_render.py [--rounds 200] [--only bounded|plain]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libk3.text import chat_template as ct  # noqa: E402

TINY = ROOT / "fixtures" / "tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "The capital of France is"}], None),
    ([{"role": "system", "content": "Answer in one word."},
      {"role": "user", "content": "Capital of Italy?"}], None),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
      {"role": "user", "content": "and again"}], None),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}], TOOLS),
    ([{"role": "user", "content": "你好世界 — héllo 👋🏽"}], None),
    ([{"role": "user", "content": [{"type": "text", "text": "look: "},
                                   {"type": "text", "text": "a cat"}]}], None),
]


def plain_renderer():
    """``render(messages, tools)`` in jinja2's sandbox without limits (HF's options)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent)
    env.globals["raise_exception"] = raise_exception
    bounded = ct.load_chat_template(TINY)
    compiled = functools.lru_cache(maxsize=8)(lambda source, path: env.from_string(source))

    def render(messages, tools, template_kwargs=None):
        ct.check_conversation(messages, tools, template_kwargs)
        messages = ct.normalize_messages(messages)
        variables = {**bounded.special_tokens, **(template_kwargs or {})}
        template = compiled(bounded.pick(None, tools), bounded.source)
        return template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=True, **variables)
    return render


def child(conn) -> None:
    render = plain_renderer()
    while (job := conn.recv()) is not None:
        conn.send(render(*job))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--only", choices=("bounded", "plain"))
    args = ap.parse_args()
    bounded, plain = ct.load_chat_template(TINY), plain_renderer()
    if args.only:
        way = plain if args.only == "plain" else (lambda m, t: bounded.render(m, tools=t))
        for _ in range(args.rounds + 1):            # the first: compiling, caches
            for m, t in CONVERSATIONS:
                way(m, t)
        return
    ours, there = multiprocessing.get_context("forkserver").Pipe()
    proc = multiprocessing.get_context("forkserver").Process(target=child, args=(there,))
    proc.start()

    def in_child(messages, tools):
        ours.send((messages, tools))
        return ours.recv()

    ways = {"bounded": lambda m, t: bounded.render(m, tools=t), "plain": plain,
            "child": in_child}
    texts = {name: [way(m, t) for m, t in CONVERSATIONS] for name, way in ways.items()}
    assert texts["bounded"] == texts["plain"] == texts["child"], "the three renderings differ"
    times = {name: [] for name in ways}
    for i in range(args.rounds):
        for name, way in list(ways.items())[::1 if i % 2 else -1]:   # no way always first
            t0 = time.perf_counter()
            for _ in range(3):
                for m, t in CONVERSATIONS:
                    way(m, t)
            times[name].append((time.perf_counter() - t0) / (3 * len(CONVERSATIONS)) * 1e6)
    ours.send(None)
    proc.join()
    base = min(times["plain"])
    print(f"{'rendering':10s} {'min us':>8s} {'median us':>10s} {'min / plain':>12s}")
    for name, t in times.items():
        print(f"{name:10s} {min(t):8.1f} {statistics.median(t):10.1f} {min(t) / base:12.2f}")


if __name__ == "__main__":
    main()
