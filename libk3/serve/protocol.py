"""The OpenAI-compatible wire format of ``k3-run --serve``, without any HTTP.

Owns: checking a request body into a ``Request`` (or an ``ApiError`` with the status and
OpenAI-style error body), and building the response objects and stream chunks.
Does not own: sockets and routing (``app``), queueing and generation (``worker``),
rendering and parsing conversations (``libk3.engine.chat_*``).

A field k3 does not implement is refused (400 naming it, ``unsupported_field``, in the
words every surface uses: ``request.fields.refusal``), unless it cannot change the reply:
``IGNORED`` fields, and ``NEUTRAL`` fields given their do-nothing value (``logprobs``
false, ``best_of`` 1, ...). The fields a generation request shares with batch lines are
checked by ``request.model.Generation`` (a chat request's by ``ChatGeneration``:
also n, logprobs, reasoning_effort, tool_choice; one rule per field); a field k3 uses with the
wrong type or range is refused (422). Either way a request never runs with settings
other than those asked for. The sampling fields beyond OpenAI's (``top_k``, ``min_p``,
``repetition_penalty``) mean what vLLM's do, and ``logit_bias`` is applied as vLLM
applies it, to the raw logits before the penalties (formats/model/numerics.md section 12).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from ..errors import K3Error, UsageError
from ..text.encodable import field_problem
from ..request.fields import OPENAI_CHAT as READ_CHAT
from ..request.fields import OPENAI_COMPLETION as READ_COMPLETION
from ..request.fields import OPENAI_IGNORED as IGNORED
from ..request.fields import OPENAI_NEUTRAL as NEUTRAL
from ..request.fields import SAMPLING, refusal
from ..engine.logprobs import content, token_text
from ..request.fields import CHAT
from ..request.model import ChatGeneration, Generation, Problem, check, named

MAX_STOP = 4                     # stop sequences per request (as the OpenAI API)
MAX_COMPLETION_LOGPROBS = 5      # a completion's ``logprobs`` (alternatives), at most


class ApiError(Exception):
    """A refused request: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, *, param=None, code=None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param,
                               "code": code}}

    @classmethod
    def of(cls, status: int, body: dict) -> "ApiError":
        """The ApiError whose status and error body these are (sent between processes)."""
        e = body["error"]
        return cls(status, e["message"], param=e["param"], code=e["code"], kind=e["type"])


@dataclasses.dataclass
class Request:
    """One checked request: ``chat`` (messages) or a completion (``prompt`` text or
    ``prompt_ids``); sampling fields None when the request leaves them to the server."""
    chat: bool
    model: str | None = None
    messages: list | None = None
    tools: list | None = None
    template_kwargs: dict | None = None
    reasoning_effort: str | None = None   # mapped onto the template's switches
    think_budget: int | None = None       # reasoning tokens at most (Anthropic's budget_tokens)
    prompt: str | None = None
    prompt_ids: list | None = None
    max_tokens: int | None = None
    # the generation fields given (k3's names, ``request.settings.settings_over``)
    generation: dict = dataclasses.field(default_factory=dict)
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None   # alternatives per token with logprobs; None: none asked
    echo: bool = False            # a completion's prompt returned before its text
    n: int = 1                    # choices: lanes sharing one prefill of the prompt
    response_format: dict | None = None   # structured output (OpenAI's shape), enforced
    tool_choice: object = "auto"          # "none", "auto", "required" or a named function
    parallel_tool_calls: bool = True      # False: at most one call (enforced with a grammar)
    image_fields: list | None = None      # each image part's field, when not OpenAI's own
    images: list = dataclasses.field(default_factory=list)    # request.images.ImageInput
    image_rows: tuple = ()                # forward.ImageRows at the prompt's pads


def refusal_of(e: Exception):
    """(status, OpenAI error body, what to log) of a refusal raised while a request was
    read: an ApiError as it says, a UsageError 422 (the template refused the
    conversation, ...), another K3Error 500; None for anything else (a defect in k3)."""
    if isinstance(e, ApiError):
        return e.status, e.body, e.body["error"]["message"]
    if isinstance(e, UsageError):
        return error_parts(422, client_line(e), code="invalid_value")
    if isinstance(e, K3Error):
        status, body, _ = error_parts(500, client_line(e), kind="server_error")
        return status, body, e.one_line()
    return None


def client_line(e: K3Error) -> str:
    """``e``'s line with the file it names cut to its name (``tokenizer_config.json``):
    a client learns nothing of where the server keeps its files; the log keeps it all."""
    line = e.one_line()
    return line.replace(e.path, os.path.basename(e.path.rstrip("/"))) if e.path else line


def check_model(name, served: str) -> None:
    """404 ``model_not_found`` unless ``name`` (None: not given) is the ``served`` one."""
    if name is not None and name != served:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{served!r}", param="model", code="model_not_found")


def error_parts(status: int, message: str, code=None, kind="invalid_request_error") -> tuple:
    """(status, OpenAI error body, what to log) of a refusal with ``message``."""
    return status, ApiError(status, message, code=code, kind=kind).body, message


def parse_body(raw: bytes) -> dict:
    """The body's JSON object; 400 when it is not JSON, not an object, or holds text k3
    cannot encode (``encodable``: a ``\\ud800`` escape), naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON ({str(e)[:80]})",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    bad = field_problem(body)
    if bad:
        raise ApiError(400, bad[1], param=bad[0], code="invalid_text")
    return body


def _check_parts(messages) -> None:
    """400 for a content part k3 cannot read: text parts (``{"type": "text", "text":
    STRING}``) and image parts (``{"type": "image_url", "image_url": ...}``, read by
    ``request.images``) pass; an audio or file part would reach the template and be
    dropped or rendered as a placeholder, answering a question the client did not ask."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f'"messages"[{i}]["content"][{j}] is not a text or '
                                    f'image_url part (type {str(kind)[:40]!r}): k3 reads '
                                    'text and images', param="messages",
                               code="unsupported_content")


def _field(body, name, check, expected):
    """``body[name]`` when present and not null, refused (422) when ``check`` says no."""
    value = body.get(name)
    if value is None:
        return None
    if not check(value):
        raise ApiError(422, f"'{name}' must be {expected}, got {json.dumps(value)[:60]}",
                       param=name, code="invalid_type")
    return value


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def unsupported_field(body: dict, chat: bool) -> str | None:
    """The first field of ``body`` that k3 would have to ignore to answer, or None."""
    read = READ_CHAT if chat else READ_COMPLETION
    for name, value in body.items():
        if name in read or name in IGNORED or value is None:
            continue
        if name in NEUTRAL and any(value == v and type(value) is type(v)
                                   for v in NEUTRAL[name]):
            continue
        return name
    return None


def check_request(body: dict, chat: bool, vocab_size: int) -> Request:
    """The body of POST /v1/chat/completions (``chat``) or /v1/completions, checked."""
    bad = unsupported_field(body, chat)
    if bad is not None:
        raise ApiError(400, refusal(bad, "openai"), param=bad, code="unsupported_field")
    req = Request(chat=chat)
    req.model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    given, names = _generation(body, chat, vocab_size)
    try:
        gen = check(ChatGeneration if chat else Generation, given, "openai",
                    vocab_size=vocab_size, max_stop=MAX_STOP)
    except Problem as e:
        raise api_error(named(e, names)) from None
    req.n = gen.n or 1
    if chat:
        _check_parts(body["messages"])
        req.messages, req.tools = body["messages"], body.get("tools")
        req.template_kwargs = body.get("chat_template_kwargs")
        req.reasoning_effort, req.logprobs = gen.reasoning_effort, gen.alternatives
        req.tool_choice = "auto" if gen.tool_choice is None else gen.tool_choice
        req.parallel_tool_calls = gen.parallel_tool_calls is not False
    else:
        req.prompt, req.prompt_ids = gen.prompt, gen.ids
    req.max_tokens, req.stop, req.response_format = gen.gen, gen.stop, gen.response_format
    req.generation = {**{k: v for k, v in given.items() if k in (*SAMPLING, "gen")},
                      "stop": gen.stop, "response_format": gen.response_format}
    if not chat:
        _logprobs(body, req)
    req.stream = bool(_field(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    req.include_usage = options.get("include_usage") is True
    return req


def api_error(problem: Problem) -> ApiError:
    """The ApiError of a request model's refusal."""
    return ApiError(problem.status, problem.message, param=problem.field, code=problem.code)


def _generation(body: dict, chat: bool, vocab_size: int) -> tuple:
    """(the body's generation fields in k3's names, k3's name -> the body's) for
    ``request.model.Generation``; a null field is one not given."""
    given = {k: body[k] for k in (*SAMPLING, "stop", "response_format", "n",
                                  *(CHAT if chat else ()))
             if body.get(k) is not None}
    names = {}
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            given["gen"], names["gen"] = body[name], name
            break
    if chat:
        given.update(messages=body.get("messages"), tools=body.get("tools"),
                     template_kwargs=body.get("chat_template_kwargs"))
        names["template_kwargs"] = "chat_template_kwargs"
        return given, names
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        given["prompt"] = prompt
    elif isinstance(prompt, list):
        given["ids"], names["ids"] = prompt, "prompt"
    else:
        raise ApiError(422, "\"prompt\" must be a non-empty string or a non-empty list of "
                            f"token ids 0..{vocab_size - 1}", param="prompt",
                       code="invalid_value")
    return given, names


def finish_reason(stop_reason: str, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if stop_reason == "length" else "stop"


def chat_logprobs(tokenizer, entries) -> dict:
    """A chat choice's ``logprobs``: ``content``, one object per TokenLogprob."""
    return {"content": content(tokenizer, entries)}


def completion_logprobs(tokenizer, ids, entries, offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` for ``ids``, each with its TokenLogprob (None:
    the first prompt id under echo, which nothing predicts): tokens, token_logprobs,
    top_logprobs ({text: logprob}) and text_offset (characters before each token in the
    choice's text, counting from ``offset``)."""
    import codecs
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = offset
    for token, e in zip(ids, entries):
        out["tokens"].append(token_text(tokenizer, token)[0])
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else
                                   {token_text(tokenizer, t)[0]: lp for t, lp in e.top})
        out["text_offset"].append(at)
        at += len(decoder.decode(tokenizer.token_bytes(token)))
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, rid: str, model: str, choices: list, extra=None) -> dict:
    """An OpenAI response or stream chunk of ``kind`` ("chat.completion", ...)."""
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
           "choices": choices}
    out.update(extra or {})
    return out


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


def _logprobs(body: dict, req: Request) -> None:
    """A completion's ``logprobs``: 0..5 alternatives (null or false: none), and ``echo``
    (a chat request's are ``request.model.ChatGeneration``'s)."""
    if body.get("logprobs") is not False:        # false: what clients send for "none"
        req.logprobs = _field(body, "logprobs",
                              lambda v: _is_int(v) and 0 <= v <= MAX_COMPLETION_LOGPROBS,
                              f"an integer 0..{MAX_COMPLETION_LOGPROBS}")
    req.echo = bool(_field(body, "echo", lambda v: isinstance(v, bool), "a boolean"))
