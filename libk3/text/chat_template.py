"""The checkpoint's chat template, rendered as Hugging Face's ``apply_chat_template`` does.

Owns: finding the template a model directory ships, rendering a conversation with it
(formats/chat.md "Rendering") within a time and an output-size limit, and encoding the
result; the plain-continuation text of a model without a template; the stop ids of an
assistant turn. Does not own: the sandboxed environment and the limits checked from
inside the compiled template (``libk3.text.template_sandbox``, which says why jinja2 and
HF's variables), reading what the model writes back (``chat_parse``), the REPL, the batch
file or the server.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from pathlib import Path

from ..errors import CheckpointError, UsageError
from .encodable import text_problem
from .template_sandbox import BUDGET, OverSize, OverTime, compile_template, undeclared_variables

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens HF passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
# The names a message's reasoning arrives under; templates read the first (HF fills it,
# and "thinking", from whichever is given).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# K3's turn ends (model.md §8.4: the sources disagree which one is usual, so both).
K3_TURN_ENDS = ("<|end_of_msg|>", "[EOS]")


class ChatInputError(UsageError):
    """A conversation that cannot be rendered: malformed messages, tools or kwargs, or a
    template name the model does not have."""


class TemplateFailure(ChatInputError):
    """The template failed on a conversation: it raised (``raise_exception`` or an
    error), ran past its time or output limit, or wrote text k3 cannot encode. A
    request's error where conversations come from clients (422, the batch line skipped);
    exit 3, like any rejected model file, in the chat, whose messages k3 builds itself."""
    exit_code = 3
    kind = "template"


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """How long one rendering may run (``seconds``) and how much text it may write
    (``max_bytes``, UTF-8)."""
    seconds: float
    max_bytes: int


# Far past any real conversation's rendering (the output is about the size of the
# request, and a server body is at most 32 MiB); they only stop a template that loops
# or writes without end. docs/serve.md; k3-run --template-timeout, --template-max-bytes.
DEFAULT_LIMITS = RenderLimits(seconds=5.0, max_bytes=64 * 2 ** 20)


def _token_text(value):
    """A special-token field's text: a string, or an AddedToken object's "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """One model's templates: ``templates`` {name: source} ("default" for a single one),
    ``source`` (the file it came from), ``special_tokens`` {field: text} and the
    ``limits`` of each rendering."""
    templates: dict
    source: str
    special_tokens: dict
    limits: RenderLimits = DEFAULT_LIMITS

    def check(self) -> None:
        """Compile every template now (CheckpointError naming the file and line), so a
        broken one is refused before a server listens or a chat starts."""
        for text in self.templates.values():
            compile_template(text, self.source)

    def pick(self, name=None, tools=None) -> str:
        """HF's choice among named templates: ``name`` when given; else "tool_use" when
        there are tools and it exists; else "default"."""
        if name is not None:
            if name not in self.templates:
                raise ChatInputError(f"no chat template named {name!r}", path=self.source,
                                     expected=", ".join(sorted(self.templates)))
            return self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatInputError("the model has several chat templates and none is named "
                             "'default'", path=self.source,
                             hint="pick one by name: " + ", ".join(sorted(self.templates)))

    def variables(self, name=None, tools=None) -> frozenset:
        """The variables the template ``pick`` chooses reads from outside (jinja2's
        undeclared variables): what a request's keywords can switch, e.g. ``thinking``."""
        return undeclared_variables(self.pick(name, tools))

    def render(self, messages, *, tools=None, documents=None, add_generation_prompt=True,
               name=None, template_kwargs=None) -> str:
        """The conversation as text. ``template_kwargs`` (e.g. ``thinking``) reach the
        template beside the named special tokens and override them, as in HF.
        TemplateFailure when the template fails on it (``limits`` included)."""
        import jinja2

        check_conversation(messages, tools, template_kwargs)
        messages = normalize_messages(messages)
        variables = {**self.special_tokens, **(template_kwargs or {})}
        template = compile_template(self.pick(name, tools), self.source)
        limits = self.limits
        budget = BUDGET.set((time.monotonic() + limits.seconds, limits.max_bytes))
        try:
            text = template.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except OverTime:
            raise TemplateFailure(f"chat template ran past its time limit of {limits.seconds:g} "
                                  "s (--template-timeout)", path=self.source) from None
        except OverSize as e:
            raise self._over_size(str(e)) from None
        except jinja2.TemplateError as e:
            raise TemplateFailure(f"chat template refused the conversation: {e}",
                                  path=self.source) from None
        except Exception as e:              # noqa: BLE001 (the template is untrusted code)
            raise TemplateFailure(f"chat template failed on the conversation: "
                                  f"{type(e).__name__}: {e}", path=self.source) from None
        finally:
            BUDGET.reset(budget)
        why = None if text.isascii() else text_problem(text, "its output")
        if why:         # the conversation's own text, if it brought it, else the template's
            given = (text_problem(messages, '"messages"') or text_problem(tools, '"tools"')
                     or text_problem(template_kwargs, '"template_kwargs"'))
            if given:
                raise ChatInputError(given)
            raise TemplateFailure(f"chat template wrote text k3 cannot encode: {why}",
                                  path=self.source)
        # a character is at most 4 UTF-8 bytes: only a large output needs encoding to know
        if len(text) > limits.max_bytes // 4 and len(text.encode("utf-8")) > limits.max_bytes:
            raise self._over_size()
        return text

    def _over_size(self, what: str = "") -> TemplateFailure:
        return TemplateFailure(f"chat template {what or 'wrote'} past its limit of "
                               f"{self.limits.max_bytes} bytes (--template-max-bytes)",
                               path=self.source)

    def encode(self, tokenizer, messages, *, sanitize: bool = False, tools=None,
               template_kwargs=None, limit: int | None = None, **kw) -> list:
        """Token ids of the rendered conversation; special-token text in it is recognised
        (HF encodes the rendering with its added tokens and no BOS/EOS of its own). With
        ``sanitize`` (HF's ``sanitize_control_tokens``), special-token text inside the
        caller's strings is encoded as ordinary text; only the template's own is markup.
        ``limit``: as ``K3Tokenizer.encode``'s (the first ids, once more than it)."""
        if not sanitize:
            return tokenizer.encode(self.render(messages, tools=tools,
                                                template_kwargs=template_kwargs, **kw),
                                    allow_special=True, limit=limit)
        text = self.render(mark(tokenizer, messages), tools=mark(tokenizer, tools),
                           template_kwargs=mark(tokenizer, template_kwargs), **kw)
        return encode_marked(tokenizer, text, limit)


def check_conversation(messages, tools=None, template_kwargs=None) -> None:
    """ChatInputError unless ``messages`` is a non-empty list of objects with a string
    "role", ``tools`` None or a list of objects, ``template_kwargs`` None or an object
    not naming a variable the request sets itself."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("\"messages\" must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatInputError(f"\"messages\"[{i}] must be an object with a string \"role\"")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise ChatInputError("\"tools\" must be a list of objects")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise ChatInputError("\"template_kwargs\" must be an object")
    for key in ("messages", "tools", "documents", "add_generation_prompt"):
        if key in (template_kwargs or {}):
            raise ChatInputError(f"\"template_kwargs\" may not set {key!r} (the request does)")


def normalize_messages(messages) -> list:
    """HF's view of checked messages: keys whose value is null dropped (templates test
    presence, not null); the reasoning, under any of its names, also given as
    "reasoning_content" and "thinking"."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# Private-use characters that bracket special-token text from the caller's strings while
# the template renders (HF's markers, so the same text sanitises the same way).
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


@functools.lru_cache(maxsize=4)
def _special_pattern(specials: tuple):
    """A regex matching any special-token text, longest first."""
    return re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))


def mark(tokenizer, obj):
    """``obj`` with every special-token text in its strings bracketed by the markers
    (markers already there removed first, so they cannot be forged); dict keys kept."""
    pattern = _special_pattern(tuple(tokenizer.special_ids))

    def walk(x):
        if isinstance(x, str):
            x = x.replace(MARK_START, "").replace(MARK_END, "")
            return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x
    return walk(obj)


def encode_marked(tokenizer, text: str, limit: int | None = None) -> list:
    """Ids of a rendering with marked caller text: a marked special is ordinary text, a
    lone marker (a template split one) is dropped but still separates the text around
    it, the rest is encoded with specials recognised. Each piece after the first is
    encoded after a newline that is then removed, as HF does (a piece is encoded as it
    would be mid-text, not as the start of a string). ``limit``: as
    ``K3Tokenizer.encode``'s (each piece is encoded on its own, so the first ids hold)."""
    pattern = _special_pattern(tuple(tokenizer.special_ids))
    splitter = re.compile(f"{MARK_START}({pattern.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
    parts = splitter.split(text)
    newline = tokenizer.encode("\n")
    ids = tokenizer.encode(parts[0], allow_special=True, limit=limit)
    for i, part in enumerate(parts[1:], start=1):
        if limit is not None and len(ids) > limit:
            break
        if not part:
            continue
        as_text = i % 2 == 1
        piece = tokenizer.encode("\n" + part, allow_special=not as_text)
        if piece[:len(newline)] == newline:
            ids += piece[len(newline):]
        else:
            ids += tokenizer.encode(part, allow_special=not as_text)
    return ids


def message_text(message) -> str:
    """A message's text: its string content, or its text parts joined ("" for none)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def plain_text(messages) -> str:
    """A conversation as plain continuation (a model without a template): the messages'
    texts, concatenated, nothing added."""
    check_conversation(messages)
    return "".join(message_text(m) for m in normalize_messages(messages))


def _read_config(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"cannot read the chat template's config: {e}", path=path) from None
    return doc if isinstance(doc, dict) else {}


def load_chat_template(model_dir, limits: RenderLimits = DEFAULT_LIMITS) -> ChatTemplate | None:
    """The template ``model_dir`` ships, or None; rendered within ``limits``.
    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (as
    in HF), which is a string or a list of {"name", "template"}."""
    d = Path(model_dir)
    config_path = d / CONFIG_FILE
    doc = _read_config(config_path)
    specials = {f: t for f in SPECIAL_TOKEN_FIELDS if (t := _token_text(doc.get(f))) is not None}
    jinja_path = d / TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            text = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read the chat template: {e}", path=jinja_path) from None
        return ChatTemplate({"default": text}, str(jinja_path), specials, limits)
    field = doc.get("chat_template")
    if field is None:
        return None
    if isinstance(field, str):
        return ChatTemplate({"default": field}, str(config_path), specials, limits)
    if isinstance(field, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in field):
        names = [t["name"] for t in field]
        if len(set(names)) == len(names) and names:
            return ChatTemplate({t["name"]: t["template"] for t in field}, str(config_path),
                                specials, limits)
    raise CheckpointError("\"chat_template\" must be a string or a list of distinct "
                          "{\"name\", \"template\"} objects", path=config_path)


def turn_stop_ids(tokenizer, template: ChatTemplate | None) -> tuple:
    """Ids that end an assistant turn: the template's ``eos_token`` and K3's turn ends,
    those the vocabulary has, in that order, each once."""
    names = ([template.special_tokens["eos_token"]]
             if template is not None and "eos_token" in template.special_tokens else [])
    ids = [tokenizer.id_of(n) for n in names + list(K3_TURN_ENDS)]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
