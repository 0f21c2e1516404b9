"""A model's prompts: text and conversations turned into ids, for a run and for the
server's reader process alike.

Owns: the tokenizer's absence as a clear error, a prompt or conversation that encodes to
no tokens refused, and the one ``ChatEncoder`` of the model (its template read on first
use). Does not own: tokenizing (``libk3.text.tokenizer``), templates (``chat_template``,
``chat_request``), contexts and prompt files (the run).
"""

from __future__ import annotations

from ..errors import UsageError
from .chat_request import ChatEncoder
from .chat_template import DEFAULT_LIMITS, RenderLimits


class Prompts:
    """Ids of one model's prompts: ``tokenizer`` (a ``LazyTokenizer`` or None when the
    model has none), chat templates rendered within ``limits``."""

    def __init__(self, model_dir, tokenizer, limits: RenderLimits = DEFAULT_LIMITS):
        self.model_dir, self._tokenizer, self.limits = model_dir, tokenizer, limits
        self._chat = None

    @property
    def tokenizer(self):
        """The model's tokenizer; UsageError when it has none."""
        if self._tokenizer is None:
            raise UsageError("this model has no tokenizer (tiktoken.model); use --ids")
        return self._tokenizer

    def encode(self, text: str, limit=None) -> list:
        """Ids of a prompt's text (``K3Tokenizer.encode``'s ``limit``)."""
        ids = self.tokenizer.encode(text, limit=limit)
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        return ids

    def chat(self, warn=None) -> ChatEncoder:
        """Conversations' prompt ids and turn ends (``chat_request``); ``warn`` hears,
        once, that the model has no template."""
        if self._chat is None:
            self._chat = ChatEncoder(self.model_dir, self.tokenizer, warn, self.limits)
        return self._chat

    def encode_messages(self, request: dict, warn=None, limit=None) -> list:
        """Prompt ids of a request's "messages" (with its "tools", "template_kwargs");
        ``limit``: stop once more than that many are known (``K3Tokenizer.encode``)."""
        ids = self.chat(warn).encode(request["messages"], request.get("tools"),
                                     request.get("template_kwargs"), limit)
        if not ids:
            raise UsageError("the conversation encodes to no tokens")
        return ids
