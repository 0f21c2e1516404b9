"""Anthropic's Messages API (``POST /v1/messages``) over k3's chat path, without any HTTP.

Owns: checking a Messages request body and converting it into the OpenAI-style chat
``Request`` the template path renders (``messages``, ``tools``, the ``thinking`` switch,
image blocks as image parts: base64 sources only), the response message (content blocks,
``stop_reason``, ``stop_sequence``, ``usage``), the stream's events (``message_start``
... ``message_stop``, one content block per run of reasoning, text or a tool call) and
Anthropic's error body. Does not own: routing,
queueing and generation (``app``, ``worker``), rendering and parsing conversations
(``libk3.text``), the stop rule (``libk3.engine.stops``), the OpenAI shapes (``protocol``).

The rules are ``protocol``'s: a field k3 does not implement is refused naming it (400,
in the words of ``request.fields.refusal``), never silently ignored, unless it cannot change the reply (``metadata``; ``cache_control``
on a block or tool: k3 reuses prompt prefixes by itself, formats/chat.md "Reuse of
earlier turns"); a field k3 uses with the wrong type or range is refused (422).
docs/serve.md "Anthropic's Messages API" lists the fields and the mapping.
"""

from __future__ import annotations

import dataclasses
import json

from ..constrain.tool_grammar import tool_choice_problem
from ..constrain.schema_check import request_vendor_key
from ..engine.stops import StopText
from ..request.fields import ANTHROPIC as READ
from ..request.fields import ANTHROPIC_IGNORED as IGNORED
from ..request.fields import refusal
from ..request.model import Generation, Problem, check, named
from .protocol import MAX_STOP, ApiError, Request, _field, _is_int, api_error

PATH = "/v1/messages"
# the sampling and length fields, checked by ``request.model.Generation``: theirs -> k3's
GENERATION = {"max_tokens": "gen", "temperature": "temperature", "top_p": "top_p",
              "top_k": "top_k", "stop_sequences": "stop"}
# Keys each block or tool may carry; "cache_control" is a caching hint (ignored: k3
# reuses prefixes by itself), "citations" null is a text block's "none".
BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"type", "thinking", "signature"},
              "image": {"type", "source", "cache_control"}}
TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type"}
# What a tool call's input becomes when the model wrote arguments that are not a JSON
# object (tool_use's input must be one): the arguments as written, under this key.
UNPARSED = "k3_unparsed_arguments"
# Anthropic's error type of each status (others: "api_error").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 414: "invalid_request_error",
               422: "invalid_request_error", 431: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}


@dataclasses.dataclass
class MessagesRequest(Request):
    """A checked Messages request: the chat ``Request`` it converts to (OpenAI-style
    messages and tools, ``reasoning_effort`` from ``thinking``), n always 1."""
    anthropic: bool = True


def error_body(status: int, openai_body: dict) -> dict:
    """Anthropic's error body for a refusal k3 made in OpenAI's shape."""
    message = openai_body.get("error", {}).get("message", "")
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _refuse(message: str, param: str, status: int = 400):
    raise ApiError(status, message, param=param, code="unsupported_field"
                   if status == 400 else "invalid_value")


def _unknown_keys(obj: dict, known: set, where: str) -> None:
    for key in obj:
        if key not in known:
            _refuse(f"{where}: {key!r} is not implemented by k3; leave it out (docs/serve.md "
                    "\"Anthropic's Messages API\")", where.split("[")[0].strip('"'))


def _text_blocks(content, where: str, param: str) -> list:
    """The texts of ``content``: a string, or a list of text blocks."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        _refuse(f"{where} must be a string or a list of text blocks", param, 422)
    out = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            _refuse(f"{where}[{i}]: a {kind!r} block is not implemented by k3 (text only)",
                    param)
        _unknown_keys(block, BLOCK_KEYS["text"], f"{where}[{i}]")
        if block.get("citations") is not None:
            _refuse(f"{where}[{i}]: 'citations' are not implemented by k3", param)
        if not isinstance(block.get("text"), str):
            _refuse(f"{where}[{i}][\"text\"] must be a string", param, 422)
        out.append(block["text"])
    return out


def _parts(texts: list, given) -> object:
    """A string as given, or a list of text blocks as OpenAI text parts."""
    return given if isinstance(given, str) else [{"type": "text", "text": t} for t in texts]


def _block(block, where: str) -> dict:
    """One content block, its type implemented and its keys known."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        _refuse(f"{where} must be a content block (an object with a \"type\")", "messages", 422)
    known = BLOCK_KEYS.get(block["type"])
    if known is None:
        _refuse(f"{where}: a {block['type']!r} block is not implemented by k3 (text, image, "
                "tool_use, tool_result and thinking are)", "messages")
    _unknown_keys(block, known, where)
    return block


def _image(block, where: str) -> dict:
    """An image block as an OpenAI image part: base64 only (k3 fetches nothing); its
    bytes are checked with the request's other images (``request.images``)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        _refuse(f"{where}[\"source\"] must be an object with \"type\" \"base64\" (k3 "
                "fetches nothing from the network: no \"url\" source)", "messages")
    _unknown_keys(source, {"type", "media_type", "data"}, f"{where}[\"source\"]")
    if not isinstance(source.get("media_type"), str) or not isinstance(source.get("data"), str):
        _refuse(f"{where}[\"source\"] needs \"media_type\" and \"data\" strings", "messages")
    return {"type": "image_url",
            "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}


def _user(content, where: str, names: list) -> list:
    """A user message's OpenAI messages: each tool_result a "tool" message, runs of
    text and image blocks user messages (content parts), in the order given; each
    image's field appended to ``names``."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        _refuse(f"{where}[\"content\"] must be a string or a non-empty list of blocks",
                "messages", 422)
    out, texts = [], []
    for i, raw in enumerate(content):
        block = _block(raw, f"{where}[\"content\"][{i}]")
        if block["type"] == "text":
            texts.extend(_parts(_text_blocks([block], f"{where}[\"content\"]", "messages"),
                                None))
            continue
        if block["type"] == "image":
            names.append(f"{where}[\"content\"][{i}]")
            texts.append(_image(block, names[-1]))
            continue
        if block["type"] != "tool_result":
            _refuse(f"{where}[\"content\"][{i}]: a {block['type']!r} block belongs to an "
                    "assistant message", "messages", 422)
        if texts:
            out.append({"role": "user", "content": texts})
            texts = []
        if not isinstance(block.get("tool_use_id"), str):
            _refuse(f"{where}[\"content\"][{i}][\"tool_use_id\"] must be a string",
                    "messages", 422)
        result = block.get("content", "")
        texts_in = _text_blocks(result, f"{where}[\"content\"][{i}][\"content\"]", "messages")
        tool = {"role": "tool", "tool_call_id": block["tool_use_id"],
                "content": "".join(texts_in)}
        error = block.get("is_error")
        if error is not None and not isinstance(error, bool):
            _refuse(f"{where}[\"content\"][{i}][\"is_error\"] must be a boolean", "messages", 422)
        if error:
            tool["is_error"] = True          # for a template that reads it
        out.append(tool)
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(content, where: str) -> dict:
    """An assistant message: text blocks joined into ``content``, thinking into
    ``reasoning_content``, tool_use blocks into ``tool_calls``."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        _refuse(f"{where}[\"content\"] must be a string or a list of blocks", "messages", 422)
    text, reasoning, calls = [], [], []
    for i, raw in enumerate(content):
        at = f"{where}[\"content\"][{i}]"
        block = _block(raw, at)
        kind = block["type"]
        if kind == "text":
            text.extend(_text_blocks([block], f"{where}[\"content\"]", "messages"))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                _refuse(f"{at}[\"thinking\"] must be a string", "messages", 422)
            reasoning.append(block["thinking"])    # the signature is k3's own "": unused
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                _refuse(f"{at} needs a string \"id\" and \"name\" and an object \"input\"",
                        "messages", 422)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": _arguments(block["input"])}})
        else:
            _refuse(f"{at}: a {kind!r} block belongs to a user message", "messages", 422)
    msg = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _arguments(tool_input: dict) -> str:
    """A tool_use input as the call's arguments: the text the model wrote when it was
    kept unparsed, else its JSON."""
    if set(tool_input) == {UNPARSED} and isinstance(tool_input[UNPARSED], str):
        return tool_input[UNPARSED]
    return json.dumps(tool_input, ensure_ascii=False)


def _messages(body: dict, names: list) -> list:
    """The OpenAI-style messages of ``system`` and ``messages`` (each image's field
    appended to ``names``)."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system",
                    "content": _parts(_text_blocks(system, "\"system\"", "system"), system)})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        _refuse("\"messages\" must be a non-empty list of messages", "messages", 422)
    for i, m in enumerate(messages):
        where = f"\"messages\"[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            _refuse(f"{where} must be an object with \"role\" \"user\" or \"assistant\"",
                    "messages", 422)
        _unknown_keys(m, {"role", "content"}, where)
        if m["role"] == "user":
            out.extend(_user(m.get("content"), where, names))
        else:
            out.append(_assistant(m.get("content"), where))
    return out


def _tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        _refuse("\"tools\" must be a list of tools", "tools", 422)
    out = []
    for i, tool in enumerate(tools):
        where = f"\"tools\"[{i}]"
        if not isinstance(tool, dict):
            _refuse(f"{where} must be an object", "tools", 422)
        _unknown_keys(tool, TOOL_KEYS, where)
        if tool.get("type", "custom") not in ("custom", None):
            _refuse(f"{where}: a {tool['type']!r} tool (Anthropic's own) is not implemented "
                    "by k3", "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                    dict):
            _refuse(f"{where} needs a string \"name\" and an object \"input_schema\"",
                    "tools", 422)
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                _refuse(f"{where}[\"description\"] must be a string", "tools", 422)
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def _thinking(body: dict, max_tokens: int) -> tuple:
    """(the reasoning effort ``thinking`` asks for ("high", "none") or None, its budget of
    reasoning tokens or None when it does not cap below max_tokens)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None, None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        _refuse("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                "{\"type\": \"disabled\"}", "thinking", 422)
    _unknown_keys(thinking, {"type", "budget_tokens"}, "thinking")
    if thinking["type"] == "disabled":
        if "budget_tokens" in thinking:
            _refuse("'thinking': budget_tokens goes with \"enabled\"", "thinking", 422)
        return "none", None
    budget = thinking.get("budget_tokens")
    if budget is not None and (not _is_int(budget) or budget < 1):
        _refuse("'thinking': budget_tokens must be an integer >= 1", "thinking", 422)
    # enforced on the think channel by a grammar (``tool_grammar.think_lark``); at or over
    # max_tokens the reply's own limit caps it already
    return "high", (budget if budget is not None and budget < max_tokens else None)


def _tool_choice(choice, req) -> None:
    """Anthropic's tool_choice as the chat path's (enforced by the same grammar): auto,
    any ("required"), tool (a named function), none; ``disable_parallel_tool_use`` true:
    at most one call."""
    if choice is None:
        return
    kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise ApiError(422, "'tool_choice' must be an object with a type: auto, any, tool or "
                            "none", param="tool_choice", code="invalid_value")
    _unknown_keys(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    mapped = kinds[choice["type"]]
    if mapped is None:
        name = choice.get("name")
        if not isinstance(name, str):
            raise ApiError(422, "'tool_choice' of type tool needs the tool's name",
                           param="tool_choice", code="invalid_value")
        mapped = {"type": "function", "function": {"name": name}}
    no_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise ApiError(422, "'disable_parallel_tool_use' must be a boolean",
                       param="tool_choice", code="invalid_type")
    req.parallel_tool_calls = not no_parallel
    why = tool_choice_problem(mapped, req.tools, req.parallel_tool_calls)
    if why:
        raise ApiError(422, f"'{why[0]}': {why[1]}", param=why[0], code="invalid_value")
    req.tool_choice = mapped


def check_request(body: dict) -> MessagesRequest:
    """The body of POST /v1/messages, checked and converted (ApiError when refused)."""
    for name, value in body.items():
        if name not in READ and name not in IGNORED and value is not None:
            _refuse(refusal(name, "anthropic"), name)
    req = MessagesRequest(chat=True)
    req.model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens",
                       code="missing_field")
    _field(body, "stop_sequences", lambda v: isinstance(v, list), "a list of strings")
    given = {k3: body[theirs] for theirs, k3 in GENERATION.items()
             if body.get(theirs) is not None}
    try:
        gen = check(Generation, given, "anthropic", max_stop=MAX_STOP, min_gen=1)
    except Problem as e:
        raise api_error(named(e, {k3: theirs for theirs, k3 in GENERATION.items()})) from None
    req.max_tokens, req.stop = gen.gen, gen.stop
    req.generation = {**{k: v for k, v in given.items() if k != "stop"}, "stop": gen.stop}
    names = []
    req.messages = _messages(body, names)
    req.image_fields = names or None
    req.tools = _tools(body.get("tools"))
    vendor = request_vendor_key(None, req.tools)
    if vendor:
        _refuse(f"'{vendor[0]}': {vendor[1]}".replace("\"parameters\"", "\"input_schema\""),
                "tools")
    _tool_choice(body.get("tool_choice"), req)
    req.reasoning_effort, req.think_budget = _thinking(body, req.max_tokens)
    req.stream = bool(_field(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    return req


# ---- the response ----

def matched_stop(tokenizer, ids, strings):
    """The stop string that ended ``ids`` (the first listed of those matching where the
    returned text ends), or None."""
    if not strings or tokenizer is None:
        return None
    st, run = StopText(tokenizer, strings), bytearray()
    specials = {i for i in tokenizer.special_ids.values()}
    for tok in ids:
        if tok in specials:
            run = bytearray()
        else:
            run += tokenizer.token_bytes(tok)
        if st.feed(tok):
            start = len(st.run)
            return next((s for s in strings
                         if run[start:start + len(s.encode("utf-8"))] == s.encode("utf-8")),
                        None)
    return None


def stop_reason(result, tool_calls: bool, tokenizer, strings) -> tuple:
    """(stop_reason, stop_sequence) of a finished generation (whose reply has
    ``tool_calls``) under the request's stop ``strings``; the precedence of
    ``protocol.finish_reason``."""
    if tool_calls:
        return "tool_use", None
    if result.stop_reason == "length":
        return "max_tokens", None
    if result.stop_reason == "stop_string":
        return "stop_sequence", matched_stop(tokenizer, result.generated_ids, strings)
    return "end_turn", None


def tool_input(arguments: str) -> dict:
    """A call's arguments as tool_use ``input``: the JSON object they spell, or the text
    as written under ``UNPARSED`` (nothing the model wrote is dropped)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {UNPARSED: arguments}


def _tool_block(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": tool_input(call["function"]["arguments"])}


def message(rid: str, model: str, reply, reason: tuple, usage: dict, k3=None) -> dict:
    """A whole response: the reply's blocks (thinking, text, tool_use in that order)."""
    content = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content.extend(_tool_block(c) for c in reply.tool_calls)
    out = {"id": rid, "type": "message", "role": "assistant", "model": model,
           "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
           "usage": usage}
    if k3 is not None:
        out["k3"] = k3
    return out


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def event(name: str, data: dict) -> bytes:
    """One server-sent event of Anthropic's stream."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}" \
           "\n\n".encode("utf-8")


PING = event("ping", {})


def start_event(rid: str, model: str, input_tokens: int) -> bytes:
    return event("message_start", {"message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(input_tokens, 0)}})


class Blocks:
    """A stream's content blocks from ReplyReader deltas: a run of reasoning is one
    thinking block, a run of text one text block, each tool call a block of its own; a
    change of kind closes the open block."""

    def __init__(self):
        self.index = -1               # the last block opened
        self.open = None              # its kind while open: "thinking" | "text"

    def _start(self, block: dict) -> bytes:
        out = self.close()
        self.index += 1
        return out + event("content_block_start", {"index": self.index,
                                                   "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> bytes:
        """The open block's stop event (b"" when none is open)."""
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", {"index": self.index})

    def events(self, delta: dict) -> bytes:
        """The events of one ReplyReader delta."""
        out = b""
        for key, kind, start, field in (
                ("reasoning_content", "thinking",
                 {"type": "thinking", "thinking": "", "signature": ""}, "thinking"),
                ("content", "text", {"type": "text", "text": ""}, "text")):
            if delta.get(key):
                if self.open != kind:
                    out += self._start(start)
                    self.open = kind
                out += self._delta({"type": f"{field}_delta", field: delta[key]})
        for call in delta.get("tool_calls", ()):
            block = _tool_block(call)
            out += self._start(dict(block, input={}))
            self.open = "tool_use"
            arguments = call["function"]["arguments"]
            partial = arguments if UNPARSED not in block["input"] else \
                json.dumps(block["input"], ensure_ascii=False)
            out += self._delta({"type": "input_json_delta", "partial_json": partial})
            out += self.close()
        return out


def end_events(reason: tuple, output_tokens: int) -> bytes:
    return event("message_delta", {"delta": {"stop_reason": reason[0],
                                             "stop_sequence": reason[1]},
                                   "usage": {"output_tokens": output_tokens}}) + \
        event("message_stop", {})


def error_event(body: dict) -> bytes:
    """A refusal or failure after the stream's headers went out (``body``: Anthropic's)."""
    return event("error", {"error": body["error"]})
