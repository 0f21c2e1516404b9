"""``POST /tokenize`` and ``POST /detokenize``: the model's tokenizer over HTTP, as vLLM
serves it, without any HTTP.

Owns: checking the two bodies and answering them: a prompt's ids (text, or a
conversation rendered by the chat template exactly as a chat request is), and the text of
ids. Does not own: the tokenizer or the template (``libk3.text.prompts``), routing
(``app``), the process they run in (``reader``).

Why here and not in ``protocol``: these bodies are not OpenAI's and share none of a
completion's fields; they follow the same rules (an unknown field is refused naming it,
a wrong type is 422).
"""

from __future__ import annotations

from ..engine.settings import token_ids_problem
from ..text.chat_request import conversation_problem
from ..request.images import is_image_part
from .protocol import ApiError

TOKENIZE_TEXT = {"model", "prompt", "add_special_tokens"}
TOKENIZE_CHAT = {"model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt"}
DETOKENIZE = {"model", "tokens"}


def _unknown(body: dict, known: set) -> None:
    for name in body:
        if name not in known:
            raise ApiError(400, f"'{name}' is not a field of this endpoint", param=name,
                           code="unsupported_field")


def tokenize(prompts, body: dict) -> list:
    """The ids of ``body``'s "prompt" (text, special tokens' text recognised as in a
    completion) or "messages" (rendered with the generation prompt unless
    "add_generation_prompt" is false, as a chat request is)."""
    if "messages" in body:
        _unknown(body, TOKENIZE_CHAT)
        why = conversation_problem({"messages": body.get("messages"), "tools": body.get("tools"),
                                    "template_kwargs": body.get("chat_template_kwargs")})
        if why:
            raise ApiError(422, why.replace("template_kwargs", "chat_template_kwargs"),
                           param="messages", code="invalid_value")
        gen_prompt = body.get("add_generation_prompt", True)
        if not isinstance(gen_prompt, bool):
            raise ApiError(422, "'add_generation_prompt' must be a boolean",
                           param="add_generation_prompt", code="invalid_type")
        messages, tools = body["messages"], body.get("tools")
        for i, m in enumerate(messages):       # pads without rows would be other ids
            parts = m.get("content") if isinstance(m.get("content"), list) else []
            if any(map(is_image_part, parts)):
                raise ApiError(400, f'"messages"[{i}]: /tokenize does not read images (the '
                                    "prompt's ids: a chat request's k3.prompt_ids)",
                               param="messages", code="unsupported_content")
        chat = prompts.chat()
        kwargs = body.get("chat_template_kwargs")
        if gen_prompt or chat.template is None:
            return prompts.encode_messages({"messages": messages, "tools": tools,
                                            "template_kwargs": kwargs})
        return chat.template.encode(chat.tokenizer, messages, tools=tools,
                                    template_kwargs=kwargs, add_generation_prompt=False)
    _unknown(body, TOKENIZE_TEXT)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(422, "'prompt' must be a string (or give 'messages')", param="prompt",
                       code="invalid_type")
    if body.get("add_special_tokens", False) not in (False, None):
        # K3's tokenizer adds no BOS/EOS of its own: there is nothing to add
        raise ApiError(400, "'add_special_tokens' true is not implemented by k3 (its "
                            "tokenizer adds no special tokens)", param="add_special_tokens",
                       code="unsupported_field")
    return prompts.encode(prompt) if prompt else []


def detokenize(prompts, vocab_size: int, body: dict) -> str:
    """The text of ``body``'s "tokens" (bytes that are not UTF-8 become U+FFFD)."""
    _unknown(body, DETOKENIZE)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(422, "'tokens' must be a list of token ids", param="tokens",
                       code="invalid_type")
    why = token_ids_problem(tokens, vocab_size) if tokens else None
    if why:
        raise ApiError(422, f"'tokens': {why}", param="tokens", code="invalid_value")
    return prompts.tokenizer.decode(tokens)
