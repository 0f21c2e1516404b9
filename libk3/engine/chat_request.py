"""A conversation as a request gives it (a batch line, an HTTP body) turned into prompt ids.

Owns: checking the request's "messages", "tools" and "template_kwargs" fields; encoding
them with the model's template (read once per run), or as plain continuation when the
model has none (said once, through ``warn``); the stop ids of the assistant turn.
Does not own: the template semantics (``chat_template``), batch lines or HTTP.
"""

from __future__ import annotations

from .chat_template import load_chat_template, plain_text, turn_stop_ids

NO_TEMPLATE = ("this model ships no chat template (tokenizer_config.json chat_template or "
               "chat_template.jinja): conversations run as plain continuation of their "
               "messages' text")


def conversation_problem(obj: dict) -> str | None:
    """Why the request's conversation fields are malformed, or None: "messages" a
    non-empty list of objects with a string "role"; "tools" a list of objects;
    "template_kwargs" an object."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return "\"messages\" must be a non-empty list of message objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"\"messages\"[{i}] must be an object with a string \"role\""
    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        return "\"tools\" must be a list of objects"
    kwargs = obj.get("template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return "\"template_kwargs\" must be an object"
    return None


class ChatEncoder:
    """Prompt ids of conversations for one model (its template read on first use)."""

    def __init__(self, model_dir, tokenizer, warn=None):
        self.model_dir, self.tokenizer, self.warn = model_dir, tokenizer, warn
        self._template = None
        self._read = False

    @property
    def template(self):
        if not self._read:
            self._template = load_chat_template(self.model_dir)
            self._read = True
            if self._template is None and self.warn is not None:
                self.warn(NO_TEMPLATE)
        return self._template

    def encode(self, messages, tools=None, template_kwargs=None) -> list:
        """Ids of the conversation with the generation prompt (the assistant's turn next)."""
        if self.template is None:
            return self.tokenizer.encode(plain_text(messages))
        return self.template.encode(self.tokenizer, messages, tools=tools,
                                    template_kwargs=template_kwargs)

    def stop_ids(self) -> tuple:
        return turn_stop_ids(self.tokenizer, self.template)
