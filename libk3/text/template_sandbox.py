"""The environment a chat template renders in, and its time and size limits checked
from inside the compiled template.

Owns: HF's sandboxed jinja2 environment (``tojson``, ``raise_exception``,
``strftime_now``, loop controls), compiling a template with every loop put through the
deadline guard, the undeclared variables a template reads, and the rendering's budget
(``BUDGET``: deadline and output size; ``OverTime``, ``OverSize`` when past them). Does
not own: which template a model ships, the conversation's checks or what a failure
tells the user (``libk3.text.chat_template``).

Why jinja2 and HF's variables: a template is code the checkpoint ships, written against
HF's renderer. Rendering it any other way (another engine, other whitespace rules, a
different ``tojson``) changes the prompt by a token and degrades every answer, so the
environment is HF's: sandboxed and immutable (templates are untrusted), ``trim_blocks``
and ``lstrip_blocks``, loop controls, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now``; the tests compare ids with ``transformers``.

Why the limits are checked from inside the template: the sandbox stops a template from
reaching out, not from looping or writing without end, and a template renders on the
thread that asked (the server's CPU thread, a batch, the chat). A child process would
bound everything but costs several renderings' worth in copying and process switches
(bench/README.md "Chat templates"); instead the compiled template checks the deadline
as each loop starts (and at each item of one over ``_UNCHECKED_ITEMS``) and the
deadline and size whenever pieces are joined (the whole rendering, each macro, call
block and recursive loop level), and ``*`` and ``**`` refuse a result past the size
before making it: a normal rendering pays a few microseconds. One filter call that
builds a huge string at once (``center(10**9)``) is caught only when it is joined.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import math
import sys
import time
from datetime import datetime

from ..errors import CheckpointError


# ---- the limits, checked from inside the template ----------------------------------------

# The rendering under way on this thread (the server's CPU thread, or the main thread):
# (the time.monotonic() at which it is stopped, its RenderLimits.max_bytes), or None.
BUDGET: contextvars.ContextVar = contextvars.ContextVar("k3 template budget", default=None)
_LOOP_GUARD = "k3_loop_guard"       # the filter every compiled loop's iterable goes through
# A power Python could not even print (its int-to-text limit) is refused before it is made.
_MAX_POWER_BITS = int(sys.int_info.default_max_str_digits * math.log2(10))


class OverTime(Exception):
    pass


class OverSize(Exception):
    """Past the output size; its text, if any, says what went past (else: the output)."""


def _loop_guard(context, items):
    """What a template's ``{% for %}`` loops over (a filter given the template's
    ``context``, so never run at compile time): ``items`` itself when short, the
    deadline checked here as the loop starts; else ``_guarded``. Short: a loop body
    without loops or macros of its own is straight-line code, so a short loop cannot
    outrun the next check (a loop's start, a join) by much; a nested loop checks at each
    of its starts."""
    budget = BUDGET.get()
    if budget is None:
        return items
    if time.monotonic() > budget[0]:
        raise OverTime()
    try:
        if len(items) <= _UNCHECKED_ITEMS:
            return items
    except TypeError:               # a generator (map, select, ...): no length
        pass
    return _guarded(items, budget[0])


_UNCHECKED_ITEMS = 1024             # loop items between two deadline checks, at most


def _guarded(items, deadline: float):
    """``items``, ``deadline`` checked at each. A generator: a loop asking ``loop.length``
    gets the rest as a list, as jinja does for any iterator, so every loop variable keeps
    its value."""
    for item in items:
        if time.monotonic() > deadline:
            raise OverTime()
        yield item


def _joined(pieces) -> str:
    """How the environment joins the pieces a rendering, a macro or a recursive loop's
    level writes: OverTime past the deadline, OverSize as soon as they pass the
    rendering's ``max_bytes`` characters (a character is at least a byte); a slice at a
    time, so the checks cost nothing per piece."""
    budget = BUDGET.get()
    if budget is None:
        return "".join(pieces)
    if time.monotonic() > budget[0]:
        raise OverTime()
    if type(pieces) is list:                        # a macro's pieces: already in memory
        text = "".join(pieces)
        if len(text) > budget[1]:
            raise OverSize()
        return text
    pieces = iter(pieces)
    parts, size = [], 0
    while True:
        chunk = list(itertools.islice(pieces, _SLICE))
        parts.append("".join(chunk))
        size += len(parts[-1])
        if size > budget[1]:
            raise OverSize()
        if len(chunk) < _SLICE:
            return parts[0] if len(parts) == 1 else "".join(parts)


_SLICE = 256                        # pieces joined between two size checks


def _too_big(operator: str, left, right, max_bytes: int) -> bool:
    """Whether ``left * right`` repeats a sequence past ``max_bytes`` items or characters,
    or ``left ** right`` is a number Python could not print."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**":
        # bit_length() - 1 <= log2|left|: a lower bound of the result's bits
        return ints and right > 0 and (abs(left).bit_length() - 1) * right > _MAX_POWER_BITS
    if ints:
        return False
    count, seq = (right, left) if isinstance(right, int) else (left, right)
    return isinstance(count, int) and isinstance(seq, (str, list, tuple)) \
        and len(seq) * count > max_bytes


def _guard(node):
    """The template expression ``node`` put through the loop guard."""
    from jinja2 import nodes
    return nodes.Filter(node, _LOOP_GUARD, [], [], None, None, lineno=node.lineno)


@functools.lru_cache(maxsize=8)
def compile_template(source: str, path):
    """The template compiled in HF's environment (once per source text), every
    ``{% for %}`` iterable, and every next level of a recursive loop, put through the
    loop guard (the rendering's deadline)."""
    import jinja2
    from jinja2 import nodes
    env = _environment()
    try:
        tree = env.parse(source)
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = _guard(loop.iter)
            if loop.recursive:              # loop(items): the next level's items
                for call in loop.find_all(nodes.Call):
                    if isinstance(call.node, nodes.Name) and call.node.name == "loop" \
                            and call.args:
                        call.args[0] = _guard(call.args[0])
        return env.from_string(tree)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template line {e.lineno}: {e.message}", path=path) from None
    except RecursionError:
        raise CheckpointError("chat template is nested too deeply to compile",
                              path=path) from None


@functools.lru_cache(maxsize=16)
def undeclared_variables(source: str) -> frozenset:
    from jinja2 import meta
    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


@functools.lru_cache(maxsize=1)
def _environment():
    """The one sandboxed environment, built on first use (jinja2 is imported late)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        """HF's sandbox plus the rendering's limits: pieces are joined by ``_joined``
        (the whole rendering, and each macro, call block, recursive loop level and set
        block: where a recursion ends), and ``*`` and ``**`` refuse a result past the
        output size before making it."""
        intercepted_binops = frozenset({"*", "**"})
        concat = staticmethod(_joined)      # as jinja's NativeEnvironment replaces it

        def call_binop(self, context, operator, left, right):
            budget = BUDGET.get()
            if budget is not None and _too_big(operator, left, right, budget[1]):
                raise OverSize(f"asked for {left!r:.20} {operator} {right!r:.20}, far")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters[_LOOP_GUARD] = jinja2.pass_context(_loop_guard)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
