"""A conversation the engine carries turn by turn (the ``--chat`` REPL).

Owns: which ids each new message adds to a state that already holds the earlier turns,
and the messages so far. Does not own: rendering (``chat_template``), parsing the
replies (``chat_parse``), the REPL's input and output, or generation.

Each turn feeds the text the template adds for the new message: the rendering of the
messages so far plus the new one (with the generation prompt) minus the rendering of
the messages so far (formats/chat.md "Turns"). Why not re-render and prefill it all:
the state already holds those turns; a template that rewrites an earlier turn (drops
old reasoning, say) makes the two renderings disagree, and only then is the whole
conversation prefilled again into a fresh state. Markup a user types is text, never
structure (HF's ``sanitize_control_tokens``). A model without a template runs plain
continuation: each message's text is fed as typed. A system message, when given, goes
into the state with the first user message (its rendering, or its text as typed).
"""

from __future__ import annotations

from .chat_template import ChatTemplate, encode_marked, mark


class Conversation:
    """The messages of one chat and how each new one is fed (``template`` None: plain)."""

    def __init__(self, tokenizer, template: ChatTemplate | None, template_kwargs=None,
                 system: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list = ([] if system is None
                               else [{"role": "system", "content": system}])
        self.fed = False                 # whether any message is in the state yet

    def _render(self, messages, add_generation_prompt: bool) -> str:
        """The rendering with markup typed by the user marked as text (HF's sanitising)."""
        if not messages:
            return ""
        return self.template.render(mark(self.tokenizer, messages),
                                    add_generation_prompt=add_generation_prompt,
                                    template_kwargs=mark(self.tokenizer, self.template_kwargs))

    def add_user(self, text: str, limit: int | None = None) -> tuple:
        """(ids to feed, fresh): ``fresh`` True means the ids are the whole conversation
        and go into a new state (the template changed an earlier turn). A message that
        cannot be rendered leaves the conversation as it was. ``limit``: tokenizing
        stops once more ids than that are known (``K3Tokenizer.encode``)."""
        message = {"role": "user", "content": text}
        if self.template is None:
            typed = ([] if self.fed else [m["content"] for m in self.messages]) + [text]
            ids = [i for t in typed for i in self.tokenizer.encode(t, limit=limit)]
            self.messages.append(message)
            self.fed = True
            return ids, False
        before = self._render(self.messages, add_generation_prompt=False) if self.fed else ""
        after = self._render(self.messages + [message], add_generation_prompt=True)
        self.messages.append(message)
        self.fed = True
        if after.startswith(before):
            return encode_marked(self.tokenizer, after[len(before):], limit), False
        return encode_marked(self.tokenizer, after, limit), True

    def add_reply(self, message: dict) -> None:
        """Record the model's reply (the message parsed from its ids)."""
        self.messages.append(message)
