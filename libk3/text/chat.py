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
An image attached to a message stands before its text as the release's markup
(formats/model/vision.md §8.1): a private-use mark the user cannot type goes through the
template and is replaced by the markup after rendering, so the markup is structure.
"""

from __future__ import annotations

import re

from .chat_template import ChatTemplate, encode_marked, mark

IMAGE_MARK = "\U000f0002"            # brackets an image's index while the template renders
_IMAGE = re.compile(f"{IMAGE_MARK}(\\d+){IMAGE_MARK}")


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
        self.markups: list = []          # each attached image's markup, in order

    def _render(self, messages, add_generation_prompt: bool) -> str:
        """The rendering with markup typed by the user marked as text (HF's sanitising)."""
        if not messages:
            return ""
        return _IMAGE.sub(lambda m: self.markups[int(m.group(1))], self.template.render(
            mark(self.tokenizer, messages), add_generation_prompt=add_generation_prompt,
            template_kwargs=mark(self.tokenizer, self.template_kwargs)))

    def add_user(self, text: str, limit: int | None = None, images=()) -> tuple:
        """(ids to feed, fresh): ``fresh`` True means the ids are the whole conversation
        and go into a new state (the template changed an earlier turn). A message that
        cannot be rendered leaves the conversation as it was. ``limit``: tokenizing
        stops once more ids than that are known (``K3Tokenizer.encode``). ``images``:
        the markup of each image the message opens with (one pad each, not expanded)."""
        text = text.replace(IMAGE_MARK, "")
        first = len(self.markups)
        self.markups += list(images)
        marks = "".join(f"{IMAGE_MARK}{first + k}{IMAGE_MARK}" for k in range(len(images)))
        message = {"role": "user", "content": marks + text}
        if self.template is None:
            earlier = [] if self.fed else [m["content"] for m in self.messages]
            ids = [i for t in earlier for i in self.tokenizer.encode(t, limit=limit)]
            ids += [i for m in images for i in self.tokenizer.encode(m, allow_special=True)]
            ids += self.tokenizer.encode(text, limit=limit)
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
