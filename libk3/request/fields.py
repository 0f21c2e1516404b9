"""The field names each surface reads, and the one wording of a field it refuses.

Owns: the fields of a batch line, of an OpenAI chat or completion body and of an
Anthropic Messages body; those a surface accepts without reading (bookkeeping that never
changes a reply, and do-nothing values); and ``refusal``, the sentence a refused field
gets on every surface (a batch line is skipped with it, the server answers 400 with it).
Does not own: checking the values of the fields read (``model``), or the llama-server
and Ollama names (``libk3.serve.compat`` maps those onto OpenAI's first).
"""

from __future__ import annotations

import difflib
import json

from ..engine.settings import SAMPLING_RULES

# k3's own names of a generation request's fields (``model.Generation``)
SAMPLING = (*SAMPLING_RULES, "logit_bias")
CHAT = ("logprobs", "top_logprobs", "reasoning_effort", "tool_choice", "parallel_tool_calls")
BATCH = ("id", "prompt", "ids", "messages", "tools", "template_kwargs", "gen", "stop",
         "stop_ids", "response_format", "n", *CHAT, *SAMPLING)
# OpenAI: the fields each endpoint reads; any other is refused unless ignored below
OPENAI = {"model", "max_tokens", "max_completion_tokens", "stop", "stream", "stream_options",
          "n", "response_format", *SAMPLING}
OPENAI_CHAT = OPENAI | {"messages", "tools", "chat_template_kwargs", "logprobs",
                        "top_logprobs", "reasoning_effort", "tool_choice",
                        "parallel_tool_calls"}
OPENAI_COMPLETION = OPENAI | {"prompt", "logprobs", "echo"}
# bookkeeping a client may attach; it never changes the reply
OPENAI_IGNORED = {"user", "metadata", "store", "service_tier"}
# fields k3 does not implement, accepted only with the value that asks for nothing (a chat
# request reads tool_choice and parallel_tool_calls)
OPENAI_NEUTRAL = {"tool_choice": ("auto",), "parallel_tool_calls": (True,),
                  "best_of": (1,), "suffix": ("",)}
ANTHROPIC = {"model", "max_tokens", "messages", "system", "tools", "tool_choice",
             "stop_sequences", "temperature", "top_p", "top_k", "stream", "thinking"}
ANTHROPIC_IGNORED = {"metadata"}
# every field some surface reads: what a misspelt field is matched against, so that its
# refusal reads the same on every surface
KNOWN = frozenset((*BATCH, *OPENAI_CHAT, *OPENAI_COMPLETION, *OPENAI_IGNORED, *OPENAI_NEUTRAL,
                   *ANTHROPIC, *ANTHROPIC_IGNORED))

# the server's fields a batch line does not implement: why, and what to write instead
NOT_IN_BATCH = {
    "max_tokens": "the batch field is \"gen\"",
    "max_completion_tokens": "the batch field is \"gen\"",
    "chat_template_kwargs": "the batch field is \"template_kwargs\"",
}
# what a surface says of a field another surface reads: (where, the doc listing its fields)
SURFACES = {
    "batch": ("in batch lines", "formats/batch.md"),
    "openai": ("by k3 (with this value)", "docs/serve.md"),
    "anthropic": ("by k3's /v1/messages", "docs/serve.md \"Anthropic's Messages API\""),
}


def refusal(key, surface: str) -> str:
    """The one sentence refusing field ``key`` on ``surface`` ("batch", "openai",
    "anthropic"). A name no surface reads is an unknown field, worded the same everywhere
    (with the nearest known name when one is close: a misspelling); a name another
    surface reads is not implemented here, saying what to write instead when there is
    something."""
    name = json.dumps(key)
    where, doc = SURFACES[surface]
    if surface == "batch" and key in NOT_IN_BATCH:
        return f"{name} is not implemented {where}: {NOT_IN_BATCH[key]}"
    if key in KNOWN:
        return f"{name} is not implemented {where}; leave it out ({doc} lists the fields)"
    near = difflib.get_close_matches(str(key), sorted(KNOWN), n=1, cutoff=0.8)
    hint = f" (did you mean {json.dumps(near[0])}?)" if near else ""
    return (f"unknown field {name}{hint}; leave it out (formats/batch.md and docs/serve.md "
            "list the fields)")
