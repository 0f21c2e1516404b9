"""A conversation as a request gives it (a batch line, an HTTP body) turned into prompt ids.

Owns: checking the request's "messages", "tools" and "template_kwargs" fields; encoding
them with the model's template (read and compiled once per run, rendered within the
run's ``RenderLimits``), or as plain continuation when the model has none (said once,
through ``warn``); the stop ids of the assistant turn. Does not own: the template
semantics (``chat_template``), batch lines or HTTP.
"""

from __future__ import annotations

from .chat_template import (DEFAULT_LIMITS, ChatInputError, RenderLimits, check_conversation,
                            load_chat_template, plain_text, turn_stop_ids)

NO_TEMPLATE = ("this model ships no chat template (tokenizer_config.json chat_template or "
               "chat_template.jinja): conversations run as plain continuation of their "
               "messages' text")


def conversation_problem(obj: dict) -> str | None:
    """Why the request's "messages", "tools" and "template_kwargs" cannot be rendered
    (``chat_template.check_conversation``), or None."""
    try:
        check_conversation(obj.get("messages"), obj.get("tools"), obj.get("template_kwargs"))
    except ChatInputError as e:
        return e.message
    return None


class ChatEncoder:
    """Prompt ids of conversations for one model (its template read on first use)."""

    def __init__(self, model_dir, tokenizer, warn=None, limits: RenderLimits = DEFAULT_LIMITS):
        self.model_dir, self.tokenizer, self.warn = model_dir, tokenizer, warn
        self.limits = limits
        self._template = None
        self._read = False

    @property
    def template(self):
        """The model's ChatTemplate (None: it has none), read and compiled on first use:
        CheckpointError, naming the file, for one that cannot be."""
        if not self._read:
            template = load_chat_template(self.model_dir, self.limits)
            if template is not None:
                template.check()
            self._template, self._read = template, True
            if template is None and self.warn is not None:
                self.warn(NO_TEMPLATE)
        return self._template

    def encode(self, messages, tools=None, template_kwargs=None, limit=None) -> list:
        """Ids of the conversation with the generation prompt (the assistant's turn next);
        ``limit``: as ``K3Tokenizer.encode``'s."""
        if self.template is None:
            return self.tokenizer.encode(plain_text(messages), limit=limit)
        return self.template.encode(self.tokenizer, messages, tools=tools,
                                    template_kwargs=template_kwargs, limit=limit)

    def preamble(self, messages, ids, tools=None, template_kwargs=None) -> int:
        """How many of ``ids`` (``encode(messages, ...)``) are the conversation before its
        last message, as the template renders it without a generation prompt: the part a
        later request (the next turn, or a new conversation with the same system prompt)
        can share. 0 when there is no template, one message, or that rendering's ids are
        not a prefix of ``ids``."""
        if self.template is None or len(messages) < 2:
            return 0
        head = self.template.encode(self.tokenizer, messages[:-1], tools=tools,
                                    template_kwargs=template_kwargs,
                                    add_generation_prompt=False)
        return len(head) if 0 < len(head) < len(ids) and ids[:len(head)] == head else 0

    def reasoning_kwargs(self, effort: str, tools=None, template_kwargs=None) -> dict:
        """``template_kwargs`` with a request's ``reasoning_effort`` mapped onto the
        template's own switches: its ``reasoning_effort`` variable gets the value, its
        ``thinking`` one false for "none" and true otherwise; a keyword the request sets
        itself wins. ChatInputError when the template has neither switch (the effort
        would be ignored)."""
        kwargs = dict(template_kwargs or {})
        names = self.template.variables(tools=tools) if self.template is not None else ()
        if "reasoning_effort" not in names and "thinking" not in names:
            raise ChatInputError("reasoning_effort: this model's chat template has no "
                                 "reasoning switch (a 'thinking' or 'reasoning_effort' "
                                 "variable)")
        if "reasoning_effort" in names:
            kwargs.setdefault("reasoning_effort", effort)
        if "thinking" in names:
            kwargs.setdefault("thinking", effort != "none")
        return kwargs

    def stop_ids(self) -> tuple:
        return turn_stop_ids(self.tokenizer, self.template)
