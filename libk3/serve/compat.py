"""llama-server's and Ollama's request and response shapes, mapped onto the OpenAI
request k3 serves (docs/serve.md "llama-server and Ollama routes").

Owns: turning a body of llama-server's ``/completion`` or Ollama's ``/api/generate`` and
``/api/chat`` into the OpenAI body that ``protocol`` checks (so every value meets the
same rules, and a field k3 does not implement is refused, naming it), and the shapes of
their answers: llama-server's JSON and SSE events, Ollama's JSON and NDJSON lines, and
the read-only ``/props``, ``/slots``, ``/api/tags``, ``/api/show`` and ``/api/version``
documents. Does not own: HTTP, generation, or the checks themselves (``protocol``).
"""

from __future__ import annotations

import datetime
import json

from .. import __version__
from ..request.fields import refusal
from .protocol import ApiError

# llama-server /completion field -> OpenAI field (n_predict and seed below)
LLAMA_FIELDS = {"prompt": "prompt", "temperature": "temperature", "top_k": "top_k",
                "top_p": "top_p", "min_p": "min_p", "repeat_penalty": "repetition_penalty",
                "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "stop": "stop", "stream": "stream"}
# llama-server fields that cannot change k3's reply: cache_prompt (k3 resumes a prompt
# from a kept state whenever one matches, byte for byte the same), a slot id (k3 picks
# the lane), the defaults of samplers k3 does not have
LLAMA_NEUTRAL = {"cache_prompt": None, "id_slot": (-1,), "slot_id": (-1,), "n_probs": (0,),
                 "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,),
                 "n_keep": (0, -1), "return_tokens": (False,)}
# Ollama options -> OpenAI fields (num_predict and seed below)
OLLAMA_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "min_p": "min_p", "repeat_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "stop": "stop"}
# Ollama options that size or place the runner, not the reply (k3 sizes itself:
# --preset, --ctx-size, --threads)
OLLAMA_RESOURCE = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
                   "use_mlock", "numa", "low_vram", "num_keep"}
OLLAMA_TOP = {"model", "prompt", "messages", "stream", "options", "system", "raw", "format",
              "keep_alive", "think", "tools"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def served_name(name, served: str):
    """Ollama's ``NAME:latest`` for the served model is the model (Ollama's clients add
    the tag); anything else is left for ``protocol.check_model`` (404)."""
    if isinstance(name, str) and name.endswith(":latest") and name[:-7] == served:
        return served
    return name


def _refuse(field: str, why: str | None = None):
    """400 naming ``field``; without a ``why``, in the words every surface refuses a field
    with (``request.fields.refusal``)."""
    message = refusal(field, "openai") if why is None else \
        f"{field!r} {why} (docs/serve.md lists the fields)"
    raise ApiError(400, message, param=field, code="unsupported_field")


def _seed(value, out: dict) -> None:
    """llama.cpp's and Ollama's seed -1 asks for a random seed: k3's default seed then."""
    if value is not None and value != -1:
        out["seed"] = value


def _limit(value, out: dict) -> None:
    """n_predict / num_predict: -1 (or -2, until the context is full) is no limit."""
    if value is not None and not (isinstance(value, int) and value in (-1, -2)):
        out["max_tokens"] = value


def llama_completion(doc: dict) -> dict:
    """The OpenAI completion body of a llama-server ``/completion`` body."""
    out = {}
    for field, value in doc.items():
        if field in LLAMA_FIELDS:
            out[LLAMA_FIELDS[field]] = value
        elif field == "n_predict":
            _limit(value, out)
        elif field == "seed":
            _seed(value, out)
        elif field in LLAMA_NEUTRAL:
            allowed = LLAMA_NEUTRAL[field]
            if allowed is not None and value not in allowed:
                _refuse(field, f"= {value!r} is not supported by k3 (only {allowed[0]!r})")
        else:
            _refuse(field)
    return out


def _ollama_common(doc: dict, served: str) -> dict:
    for field in doc:
        if field not in OLLAMA_TOP:
            _refuse(field)
    if doc.get("images") or any(m.get("images") for m in doc.get("messages") or []
                                if isinstance(m, dict)):
        _refuse("images", "are not read on Ollama's routes: send each image as an image_url "
                "part (a data: URL) to /v1/chat/completions")
    out = {"model": served_name(doc.get("model"), served), "stream": doc.get("stream", True)}
    options = doc.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(422, "'options' must be an object", param="options")
    for key, value in options.items():
        if key in OLLAMA_OPTIONS:
            out[OLLAMA_OPTIONS[key]] = value
        elif key == "num_predict":
            _limit(value, out)
        elif key == "seed":
            _seed(value, out)
        elif key not in OLLAMA_RESOURCE:
            _refuse(f"options.{key}")
    fmt = doc.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(422, "'format' must be \"json\" or a JSON schema", param="format")
    if doc.get("tools"):
        out["tools"] = doc["tools"]
    if doc.get("think") is not None:         # the template's own switch (formats/chat.md)
        if not isinstance(doc["think"], bool):
            raise ApiError(422, "'think' must be true or false", param="think")
        out["chat_template_kwargs"] = {"thinking": doc["think"]}
    return out


def ollama_generate(doc: dict, served: str) -> tuple:
    """("chat" or "completion", OpenAI body) of an Ollama ``/api/generate`` body: the
    prompt in the model's chat template as a user turn (after ``system``), or as plain
    text with ``raw``."""
    for field in ("tools", "messages"):
        if field in doc:
            _refuse(field, "go with /api/chat")
    out = _ollama_common(doc, served)
    prompt = doc.get("prompt", "")
    for field in ("prompt", "system"):
        if not isinstance(doc.get(field, ""), str):
            raise ApiError(422, f"'{field}' must be a string", param=field)
    if doc.get("raw"):
        if doc.get("system"):
            _refuse("system", "does not go with raw (raw text has no template)")
        out["prompt"] = prompt
        return "completion", out
    messages = [{"role": "system", "content": doc["system"]}] if doc.get("system") else []
    out["messages"] = messages + [{"role": "user", "content": prompt}]
    return "chat", out


def ollama_chat(doc: dict, served: str) -> dict:
    """The OpenAI chat body of an Ollama ``/api/chat`` body."""
    for field in ("prompt", "raw", "system"):
        if field in doc:
            _refuse(field, "goes with /api/generate")
    out = _ollama_common(doc, served)
    out["messages"] = doc.get("messages")
    return out


# ---- answers ----------------------------------------------------------------------

def done_reason(stop_reason: str) -> str:
    """Ollama's done_reason: "length" when the limit ended it, else "stop"."""
    return "length" if stop_reason == "length" else "stop"


def llama_stop_type(stop_reason: str) -> str:
    """llama-server's stop_type: limit (n_predict), word (a stop string), eos."""
    return {"length": "limit", "stop": "word"}.get(stop_reason, "eos")


def llama_answer(text: str, res, model: str, final: bool = True) -> dict:
    """llama-server's /completion answer (and a stream's last event)."""
    return {"content": text, "stop": final, "model": model,
            "tokens_predicted": len(res.generated_ids),
            "tokens_evaluated": len(res.prompt_ids),
            "stop_type": llama_stop_type(res.stop_reason), "truncated": False,
            "timings": {"prompt_n": len(res.prompt_ids),
                        "prompt_ms": res.prefill_seconds * 1000,
                        "predicted_n": len(res.generated_ids),
                        "predicted_ms": res.decode_seconds * 1000}}


def ollama_answer(model: str, res, *, chat: bool, message=None, text: str = "",
                  seconds: float = 0.0) -> dict:
    """Ollama's final object (done: true), whole or as a stream's last line."""
    doc = {"model": model, "created_at": _now()}
    if chat:
        doc["message"] = message or {"role": "assistant", "content": ""}
    else:
        doc["response"] = text
    doc.update(done=True, done_reason=done_reason(res.stop_reason),
               total_duration=int(seconds * 1e9), load_duration=0,
               prompt_eval_count=len(res.prompt_ids),
               prompt_eval_duration=int(res.prefill_seconds * 1e9),
               eval_count=len(res.generated_ids),
               eval_duration=int(res.decode_seconds * 1e9))
    return doc


def ollama_loaded(model: str, chat: bool) -> dict:
    """Ollama's answer to a request with nothing to generate (an empty prompt or no
    messages: a client loading the model): done at once; k3's model is always loaded."""
    doc = {"model": model, "created_at": _now()}
    if chat:
        doc["message"] = {"role": "assistant", "content": ""}
    else:
        doc["response"] = ""
    doc.update(done=True, done_reason="load")
    return doc


def ollama_message(message: dict) -> dict:
    """An OpenAI assistant message in Ollama's words (reasoning is ``thinking``)."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"])}}
                             for c in message["tool_calls"]]
    return out


def _arguments(function: dict):
    """A call's arguments as Ollama gives them, an object (OpenAI's: its JSON text)."""
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def ollama_chunk(model: str, *, chat: bool, delta: dict) -> dict:
    """One streamed Ollama line (done: false) of a chat's delta or a generation's text."""
    doc = {"model": model, "created_at": _now()}
    if chat:
        doc["message"] = ollama_message({"content": delta.get("content", ""),
                                         "reasoning_content": delta.get("reasoning_content")})
    else:
        doc["response"] = delta.get("content", "")
    doc["done"] = False
    return doc


def details() -> dict:
    return {"format": "safetensors", "family": "kimi_k3", "families": ["kimi_k3"],
            "parameter_size": "", "quantization_level": "MXFP4"}


def ollama_tags(model: str, size: int) -> dict:
    return {"models": [{"name": f"{model}:latest", "model": f"{model}:latest",
                        "modified_at": "1970-01-01T00:00:00Z", "size": size, "digest": "",
                        "details": details()}]}


def ollama_show(model: str, context: int, template: str) -> dict:
    return {"modelfile": "", "parameters": "", "template": template, "details": details(),
            "model_info": {"general.architecture": "kimi_k3",
                           "kimi_k3.context_length": context},
            "capabilities": ["completion"]}


def version() -> dict:
    return {"version": __version__}


def llama_props(model: str, context: int, slots: int, template: str) -> dict:
    return {"default_generation_settings": {"n_ctx": context, "model": model},
            "total_slots": slots, "model_path": model, "chat_template": template,
            "build_info": f"k3 {__version__}"}


def llama_slots(context: int, slots: int, busy: int) -> list:
    """One entry per lane; the first ``busy`` are decoding."""
    return [{"id": i, "n_ctx": context, "is_processing": i < busy} for i in range(slots)]
