"""A generation request as types: ``Sampling`` (the sampling parameters), ``Generation``
(what to generate from, how much, where to stop, in what format, how many choices) and
``ChatGeneration`` (also log-probabilities, reasoning effort, tool calls: what a chat
request and a batch line ask), pydantic models whose validators are the rules of
``libk3.engine.settings``, one per field.

Owns: the types, ``check`` (a dict in k3's field names into a model, or the ``Problem``
of its first refused field: the field, a one-line reason naming it, the HTTP status and
code the server answers with). Does not own: a surface's own field names and shapes
(the adapters: ``libk3.run.batch``, ``libk3.serve.protocol``, ``libk3.serve.anthropic``
map theirs onto k3's and back), the wording of a field no surface reads (``fields``).

Pydantic, not msgspec: custom validators receive a context (the model's vocabulary) and
their refusals carry the field's location, so a rule is written once (bench/README.md
"Request validation" has the cost of each per request).

A value is checked by its rule as given (strict: no "0.5" string becomes a number); a
rule's refusal is ``invalid_type`` when the value is not even of the field's JSON type,
else ``invalid_value``. The context ``check`` passes: ``vocab_size`` (token ids, the
logit bias), ``until_end`` (``gen`` may be -1, as batch lines and --gen), ``min_gen``
(Anthropic's max_tokens >= 1), ``max_stop`` (the server's 4 stop strings).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..text.chat_request import conversation_problem
from ..constrain.grammar import response_format_problem
from ..constrain.schema_check import request_vendor_key
from ..constrain.tool_grammar import tool_choice_problem
from ..engine.logprobs import MAX_TOP
from ..engine.settings import (frequency_penalty_problem, gen_or_until_end_problem,
                               gen_problem, logit_bias_problem, min_p_problem,
                               presence_penalty_problem, repetition_penalty_problem,
                               seed_problem, stop_strings_problem, temperature_problem,
                               token_ids_problem, top_k_problem, top_p_problem)
from .fields import refusal

NUMBER, INTEGER = (int, float), (int,)
MAX_N = 16                       # choices per request (each a lane of its own)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")   # OpenAI's values


@dataclasses.dataclass
class Problem(Exception):
    """A refused request: the field (k3's name, or the surface's once ``named``), the
    one-line reason, and the server's status and code for it."""
    field: str | None
    message: str
    status: int = 422
    code: str = "invalid_value"

    def __str__(self):
        return self.message


def _said(name: str, why: str) -> str:
    """``"name" must be ...`` for a reason that is a predicate, else ``"name": why``."""
    return f"\"{name}\" {why}" if why.startswith("must ") else f"\"{name}\": {why}"


def ruled(problem, types: tuple, vocab: bool = False):
    """A field's validator: ``problem`` (``*_problem``) on the value as given."""
    def check(value, info):
        why = problem(value, info.context["vocab_size"]) if vocab else problem(value)
        if why:
            typed = isinstance(value, types) and not isinstance(value, bool)
            raise PydanticCustomError("invalid_value" if typed else "invalid_type", "{why}",
                                      {"why": why})
        return value
    return BeforeValidator(check)


def _finite_rule(problem):
    """A number rule that also refuses an integer too large for a float (not finite
    for the sampler: ``math.isfinite`` of it overflows)."""
    def check(value):
        try:
            return problem(value)
        except OverflowError:
            digits = str(value)
            return problem(float("inf")).replace(
                "got inf", f"got {digits[:12]}... ({len(digits):,} digits)")
    return check


def _gen(n, info):
    why = gen_or_until_end_problem(n) if info.context.get("until_end") else gen_problem(n)
    least = info.context.get("min_gen")
    if not why and least is not None and n < least:
        why = f"must be >= {least}"
    if why:
        kind = "invalid_value" if isinstance(n, int) and not isinstance(n, bool) \
            else "invalid_type"
        raise PydanticCustomError(kind, "{why}", {"why": why})
    return n


def _stop(value, info):
    """A string, or a list of them (at most ``max_stop`` when the context sets one), as a
    tuple of non-empty stop strings."""
    strings = [value] if isinstance(value, str) else value
    most = info.context.get("max_stop")
    if stop_strings_problem(strings) or (most is not None and len(strings) > most):
        kind = "invalid_value" if isinstance(value, (str, list)) else "invalid_type"
        some = f"a list of at most {most} of them" if most is not None else "a list of them"
        raise PydanticCustomError(kind, "{why}",
                                  {"why": f"must be a non-empty string or {some}"})
    return tuple(strings)


def _prompt(value):
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _ids(value, vocab_size: int):
    if isinstance(value, list) and value and not token_ids_problem(value, vocab_size):
        return None
    return f"must be a non-empty list of ids in 0..{vocab_size - 1}"


def _stop_ids(value, vocab_size: int):
    if isinstance(value, list) and not token_ids_problem(value, vocab_size):
        return None
    return f"must be a list of ids in 0..{vocab_size - 1}"


def _response_format(value):
    """The format's rule, after its schema's vendor keys (400 on the server: the key is
    llguidance's setting, not a schema k3 cannot enforce)."""
    vendor = request_vendor_key(value, None)
    if vendor:
        raise PydanticCustomError("vendor_key", "{why}",
                                  {"why": vendor[1], "field": vendor[0]})
    return None if value is None else response_format_problem(value)


def _logit_bias(value, vocab_size: int):
    return logit_bias_problem(value, vocab_size, json_only=True)


def _n(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_N
    return None if ok else f"must be an integer 1..{MAX_N}"


def _boolean(value):
    return None if isinstance(value, bool) else "must be a boolean"


def _top_logprobs(value):
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP
    return None if ok else f"must be an integer 0..{MAX_TOP}"


def _effort(value):
    return None if value in REASONING_EFFORTS else \
        "must be one of " + ", ".join(REASONING_EFFORTS)


class Sampling(BaseModel):
    """How each token is drawn; a field left out is the run's (its option's default)."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    temperature: Annotated[float, ruled(_finite_rule(temperature_problem), NUMBER)] = None
    top_p: Annotated[float, ruled(_finite_rule(top_p_problem), NUMBER)] = None
    top_k: Annotated[int, ruled(top_k_problem, INTEGER)] = None
    min_p: Annotated[float, ruled(_finite_rule(min_p_problem), NUMBER)] = None
    repetition_penalty: Annotated[
        float, ruled(_finite_rule(repetition_penalty_problem), NUMBER)] = None
    presence_penalty: Annotated[
        float, ruled(_finite_rule(presence_penalty_problem), NUMBER)] = None
    frequency_penalty: Annotated[
        float, ruled(_finite_rule(frequency_penalty_problem), NUMBER)] = None
    seed: Annotated[int, ruled(seed_problem, INTEGER)] = None
    # {"token id": bias}, OpenAI's shape (``settings.logit_bias_pairs`` turns it into pairs)
    logit_bias: Annotated[dict, ruled(_logit_bias, (dict,), vocab=True)] = None


class Generation(Sampling):
    """One generation: from a text, token ids or a conversation (messages, tools and the
    template's arguments: formats/chat.md), ``gen`` tokens at most, stopped by a stop
    string or id, shaped by a response format (OpenAI's)."""
    prompt: Annotated[str, ruled(_prompt, (str,))] = None
    ids: Annotated[list, ruled(_ids, (list,), vocab=True)] = None
    messages: Any = None          # the three checked together: ``conversation_problem``
    tools: Any = None
    template_kwargs: Any = None
    gen: Annotated[int, BeforeValidator(_gen)] = None
    stop: Annotated[tuple, BeforeValidator(_stop)] = ()
    stop_ids: Annotated[list, ruled(_stop_ids, (list,), vocab=True)] = None
    response_format: Annotated[dict | None, ruled(_response_format, (dict,))] = None
    n: Annotated[int, ruled(_n, INTEGER)] = None       # choices, choice i seeded seed + i

    @model_validator(mode="after")
    def _together(self, info):
        if "messages" in self.model_fields_set:
            why = conversation_problem({"messages": self.messages, "tools": self.tools,
                                        "template_kwargs": self.template_kwargs})
            if why:                              # the field is named first, in quotes
                raise PydanticCustomError("conversation", "{why}", {"why": why})
        vendor = request_vendor_key(self.response_format, self.tools)
        if vendor:
            raise PydanticCustomError("vendor_key", "{why}",
                                      {"why": vendor[1], "field": vendor[0]})
        return self

    def given(self) -> dict:
        """The fields the request gave, in k3's names (unset ones left to the run)."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class ChatGeneration(Generation):
    """A generation that also asks, as OpenAI's chat requests do, for each token's
    log-probability (``logprobs`` true, with ``top_logprobs`` alternatives), a reasoning
    effort (mapped onto the chat template's switches) and calls of its tools
    (``tool_choice``, ``parallel_tool_calls``: ``tool_grammar.tool_choice_problem``)."""
    logprobs: Annotated[bool, ruled(_boolean, ())] = None
    top_logprobs: Annotated[int, ruled(_top_logprobs, INTEGER)] = None
    reasoning_effort: Annotated[str, ruled(_effort, (str,))] = None
    tool_choice: Any = None
    parallel_tool_calls: Annotated[bool, ruled(_boolean, ())] = None

    @model_validator(mode="after")
    def _chat_together(self, info):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("needs", "{why}", {
                "field": "top_logprobs", "why": "\"top_logprobs\" needs \"logprobs\": true"})
        choice = "auto" if self.tool_choice is None else self.tool_choice
        why = tool_choice_problem(choice, self.tools, self.parallel_tool_calls is not False)
        if why:
            raise PydanticCustomError("needs", "{why}",
                                      {"field": why[0], "why": _said(why[0], why[1])})
        if choice not in ("none", "auto") and self.response_format is not None \
                and self.response_format.get("type") != "text":
            raise PydanticCustomError("needs", "{why}", {
                "field": "tool_choice", "why": "\"tool_choice\" other than \"none\" or "
                "\"auto\" cannot be enforced together with a \"response_format\" (the "
                "reply is either calls or that JSON)"})
        return self

    @property
    def alternatives(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# the order fields are reported in when a request has more than one problem
ORDER = ("id", "prompt", "ids", "messages", "tools", "template_kwargs", "gen",
         *Sampling.model_fields, "stop", "stop_ids", "response_format", "n", "logprobs",
         "top_logprobs", "reasoning_effort", "tool_choice", "parallel_tool_calls")


def check(model: type, obj: dict, surface: str, **context):
    """``obj`` (a dict in k3's field names) as a ``model`` instance, or the Problem of its
    first refused field (``surface``: whose refusal wording an unknown field gets,
    ``fields.refusal``); ``context`` for the rules (module docstring)."""
    try:
        return model.model_validate(obj, context=context)
    except ValidationError as e:
        raise _problem(e.errors(include_url=False, include_input=False), surface) from None


def _problem(errors: list, surface: str) -> Problem:
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        key = extra[0]["loc"][0]
        return Problem(key, refusal(key, surface), 400, "unsupported_field")
    first = min(errors, key=lambda e: ORDER.index(e["loc"][0])
                if e["loc"] and e["loc"][0] in ORDER else len(ORDER))
    ctx = first.get("ctx") or {}
    if first["type"] == "conversation":
        return Problem(ctx["why"].split('"')[1], ctx["why"])
    if first["type"] == "needs":
        return Problem(ctx["field"], ctx["why"])
    if first["type"] == "vendor_key":
        return Problem(ctx["field"], _said(ctx["field"], ctx["why"]), 400, "unsupported_field")
    field = first["loc"][0] if first["loc"] else None
    why = ctx.get("why") or first["msg"]
    return Problem(field, _said(field, why), 422,
                   first["type"] if first["type"] == "invalid_type" else "invalid_value")


def named(problem: Problem, names: dict) -> Problem:
    """``problem`` with k3's field name replaced by the surface's (``names``: k3's name ->
    the surface's), in its field and message alike."""
    theirs = names.get(problem.field)
    if theirs is None:
        return problem
    message = problem.message.replace(f"\"{problem.field}\"", f"\"{theirs}\"")
    return dataclasses.replace(problem, field=theirs, message=message)
