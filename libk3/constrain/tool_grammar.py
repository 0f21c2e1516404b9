"""The server's ``tool_choice`` constraint and reasoning budget as grammars of the chat
markup (docs/serve.md "tool_choice", formats/chat.md "Parsing the reply").

Owns: checking a ``tool_choice`` against its ``tools`` (``tool_choice_problem``: each
schema a call may be held to admitted as a response format's is, ``schema_check``),
where a rendered prompt leaves the think channel (``think_mode``), and compiling, for a
tokenizer and cached by its text, a Lark grammar (``compile_tool_grammar``): an optional
think channel, then the channels the choice allows, each call's arguments a ``%json``
sub-grammar of its tool's schema (with k3's JSON settings, never a client's); special
tokens written by id. And a reasoning budget (Anthropic's ``budget_tokens``:
``compile_think_budget``, or inside the tool grammar): the think channel's text cut at
N tokens by llguidance's ``max_tokens`` on its rule, so its closing tag must come next.
Does not own: the matcher and its masks (``grammar``), HTTP or the request's fields
(``libk3.serve``).
"""

from __future__ import annotations

import json
import re

from ..errors import UsageError
from .grammar import JSON_OPTIONS, Grammar, GrammarTokenizer, _kept, available, llguidance
from .schema_check import _first_line, schema_problem

TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")   # a name a call's head can carry
CALL_ID = r"[A-Za-z0-9_.:-]{1,40}"                  # a call's optional id="..." (bounded)
THINK_MODES = ("optional", "closed", "open")        # where the prompt leaves the think channel
_MARKS = ("<|open|>", "<|close|>", "<|sep|>")


def tool_schemas(tools) -> dict:
    """{name: parameters schema} of OpenAI-style ``tools`` (an absent schema: any JSON
    object); ValueError for a tool a call cannot name."""
    out = {}
    for k, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if fn is None or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise ValueError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ...}} to be called under tool_choice")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"tools[{k}]: a function's name must be 1-64 of A-Z a-z 0-9 "
                             "_ . : - to be called under tool_choice")
        if name in out:
            raise ValueError(f"tools[{k}]: the function name {name!r} is given twice")
        schema = fn.get("parameters")
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise ValueError(f"tools[{k}]: \"parameters\" must be a JSON schema (an object)")
        out[name] = schema
    return out


def tool_choice_name(choice):
    """The function a named ``tool_choice`` ({"type": "function", "function": {"name":
    N}}) asks for, None for "none" / "auto" / "required"; ValueError otherwise."""
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" \
            or not isinstance(fn.get("name"), str):
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": NAME}}')
    return fn["name"]


def tool_choice_problem(choice, tools, parallel=True) -> tuple | None:
    """(field, why) when ``choice`` (with ``parallel_tool_calls``) cannot be enforced for
    ``tools``, or None; each schema a call may be held to is checked as a response
    format's is (``schema_check``) when llguidance is there (else ``compile_tool_grammar``
    says it is missing)."""
    try:
        name = tool_choice_name(choice)
    except ValueError as e:
        return "tool_choice", str(e)
    if choice == "none" or (choice == "auto" and (parallel or not tools)):
        return None                  # no call asked for: the tools are not read
    if not tools:
        return "tool_choice", f"{json.dumps(choice)} needs 'tools' to call"
    try:
        schemas = tool_schemas(tools)
    except ValueError as e:
        return "tools", str(e)
    if name is not None and name not in schemas:
        return "tool_choice", f"names the function {name!r}, which is not in 'tools'"
    if choice == "none" or not available():
        return None
    for k, (fn, schema) in enumerate(schemas.items()):
        why = None if name not in (None, fn) else schema_problem(schema, JSON_OPTIONS)
        if why:
            return "tools", f"tools[{k}] ({fn}): \"parameters\": {why}"
    return None


def think_mode(tokenizer, prompt_ids) -> str:
    """Where a rendered chat prompt leaves the think channel: "closed" (the generation
    prompt closed one, as a template does with thinking off), "open" (it opened one the
    reply continues) or "optional" (the reply may open one)."""
    tok = tokenizer.get() if hasattr(tokenizer, "get") else tokenizer
    from ..text.chat_parse import pieces
    tail = pieces(tok, list(prompt_ids)[-8:])[-3:]
    if len(tail) == 3 and tail[1] == ("text", "think") and tail[2] == ("mark", "<|sep|>"):
        if tail[0] == ("mark", "<|close|>"):
            return "closed"
        if tail[0] == ("mark", "<|open|>"):
            return "open"
    return "optional"


def think_lark(marks, vocab_size: int, think: str, budget: int) -> str:
    """The Lark grammar of a chat reply whose reasoning holds at most ``budget`` tokens
    and is otherwise free: the think channel (opened by the reply when ``think`` is
    "optional", already open when "open"), its text cut at ``budget`` tokens so its
    closing tag must follow, then any tokens but another think channel (which would
    reason past the budget). A reply that does not open the channel first (another
    channel, text) is free too, with no think channel later. ``marks``: the ids of
    <|open|>, <|close|>, <|sep|>."""
    o, c, s = (f"<[{int(i)}]>" for i in marks)
    op = int(marks[0])
    others = ",".join(r for r in (f"0-{op - 1}" if op > 0 else "",
                                  f"{op + 1}-{vocab_size - 1}" if op + 1 < vocab_size else "")
                      if r)
    # after the channel: tokens other than <|open|>, and <|open|> only before a tag that
    # does not start with "think" (the reply's other channels)
    lines = ['TEXT: /(.|\n)+/',
             f'think_text[max_tokens={int(budget)}]: TEXT',
             f'think_rest: think_text? {c} "think" {s}',
             'OTHER_TAG: /([^t]|t[^h]|th[^i]|thi[^n]|thin[^k])[^\n]*/',
             f'rest: (<[{others}]> | {o} OTHER_TAG)*']
    if think == "open":
        return "\n".join(["start: think_rest rest"] + lines) + "\n"
    lines.append(f'think: {o} "think" {s} think_rest')
    return "\n".join(["start: think rest | rest"] + lines) + "\n"


def compile_think_budget(tokenizer, think: str, budget: int) -> "Grammar | None":
    """The grammar capping a reply's reasoning at ``budget`` tokens (``think_lark``) for
    ``tokenizer``, cached by its text; None when the prompt closed the think channel
    (nothing to cap). UsageError for a vocabulary without the markup or llguidance
    missing."""
    if think not in THINK_MODES:
        raise ValueError(f"think must be one of {THINK_MODES}")
    if think == "closed":
        return None
    tok, marks = _markup(tokenizer, "a thinking budget")
    text = think_lark(marks, tok.vocab_size, think, budget)
    gt = GrammarTokenizer.for_tokenizer(tok)
    llg = llguidance()
    return _kept(gt, "think:" + text, lambda key: Grammar(
        gt, llg.LLMatcher.grammar_from_lark(text), key, what="thinking budget"))


def _markup(tokenizer, what: str) -> tuple:
    """(the tokenizer, the ids of <|open|>, <|close|>, <|sep|>): UsageError naming
    ``what`` needs them when the vocabulary lacks one."""
    tok = tokenizer.get() if hasattr(tokenizer, "get") else tokenizer
    marks = [tok.id_of(m) for m in _MARKS]
    if None in marks:
        raise UsageError(f"{what} needs the chat markup (<|open|>, <|close|>, <|sep|>) in "
                         "the vocabulary")
    return tok, marks


def tool_lark(marks, schemas: dict, choice, parallel: bool, think: str,
              think_budget: int | None = None) -> str:
    """The Lark grammar of a reply under ``choice``: an optional think channel (any text;
    per ``think``), then for "none" an optional reply (a response channel or plain text),
    for "auto" (``parallel`` False) that and at most one call, for "required" or a named
    function a tools channel only (one call, or one or more when ``parallel``), each
    call ``call name="F"`` with an optional bounded id and arguments valid JSON for F's
    schema; then optionally the closing assistant tag; the think channel's text cut at
    ``think_budget`` tokens when given (``think_lark``). ``marks``: the ids of <|open|>,
    <|close|>, <|sep|>."""
    o, c, s = (f"<[{int(i)}]>" for i in marks)
    name = tool_choice_name(choice)
    lines = ['TEXT: /(.|\\n)+/',
             f'close: {c} "assistant" {s}',
             f'reply: {o} "response" {s} TEXT? {c} "response" {s} | TEXT']
    head = {"optional": "think? ", "closed": "", "open": "think_rest "}[think]
    cap = "" if think_budget is None else f"[max_tokens={int(think_budget)}]"
    lines += [f'think: {o} "think" {s} think_rest', f'think_text{cap}: TEXT',
              f'think_rest: think_text? {c} "think" {s}']
    if choice == "none":
        body = "reply?"
    else:
        names = [name] if name is not None else list(schemas)
        calls = []
        for k, fn in enumerate(names):
            schema = dict(schemas[fn], **{"x-guidance": JSON_OPTIONS})   # k3's, never a client's
            calls.append(f"call_{k}")
            lines.append(f'call_{k}: {o} {json.dumps(f"call name={json.dumps(fn)}")} call_id? '
                         f'{s} %json {json.dumps(schema, ensure_ascii=False)} {c} "call" {s}')
        lines += [f'call_id: " id=\\"" /{CALL_ID}/ "\\""',
                  "call: " + " | ".join(calls),
                  f'tools: {o} "tools" {s} call{"+" if parallel else ""} {c} "tools" {s}']
        body = "reply? tools?" if choice == "auto" else "tools"
    return "\n".join([f"start: {head}{body} close?"] + lines) + "\n"


def compile_tool_grammar(tokenizer, tools, choice, parallel: bool = True,
                         think: str = "optional",
                         think_budget: int | None = None) -> "Grammar | None":
    """The grammar enforcing ``tool_choice`` ``choice`` and ``parallel_tool_calls``
    ``parallel`` on a chat reply (``tool_lark``) for ``tokenizer``, cached by its text,
    the reasoning cut at ``think_budget`` tokens when given; for "auto" with parallel
    calls (or no tools) only that cut (``compile_think_budget``), or None when nothing is
    enforced. UsageError
    for what ``tool_choice_problem`` refuses, a schema llguidance refuses, a vocabulary
    without the markup, or llguidance missing."""
    why = tool_choice_problem(choice, tools, parallel)
    if why:
        raise UsageError(f"{why[0]}: {why[1]}")
    if choice == "auto" and (parallel or not tools):
        return None if think_budget is None else compile_think_budget(tokenizer, think,
                                                                      think_budget)
    if think not in THINK_MODES:
        raise ValueError(f"think must be one of {THINK_MODES}")
    tok, marks = _markup(tokenizer, "tool_choice")
    schemas = {} if choice == "none" else tool_schemas(tools)
    text = tool_lark(marks, schemas, choice, parallel, think, think_budget)
    llg = llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError) as e:
        raise UsageError(f"tools: schema refused: {_first_line(e)}") from None
    why = llg.LLMatcher.validate_grammar(grammar)
    if why and not why.startswith("WARNING"):
        raise UsageError(f"tools: schema refused: {_first_line(why)}")
    gt = GrammarTokenizer.for_tokenizer(tok)
    return _kept(gt, "tools:" + text, lambda key: Grammar(gt, grammar, key, what="tools"))
