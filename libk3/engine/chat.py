"""K3 chat turns: XTML markup when the tokenizer defines it, plain continuation otherwise.

Owns: turning one user message into token ids (markup encoded WITH special-token
recognition, the user's text WITHOUT it, so typed markup cannot inject structure) and
the stop ids of an assistant turn. Does not own: the REPL or generation.

XTML details are unverified (model.md §8.4): a message is
``<|open|>{role}<|sep|>{text}<|close|>{role}<|sep|><|end_of_msg|>`` and the assistant's
turn is opened with ``<|open|>assistant<|sep|>``. Generation stops at ``<|end_of_msg|>``
or ``[EOS]`` (the sources disagree on the usual turn end, so both; model.md §10).
"""

from __future__ import annotations

MARKUP = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
STOPS = ("<|end_of_msg|>", "[EOS]")


def has_xtml(tokenizer) -> bool:
    return tokenizer is not None and all(tokenizer.id_of(t) is not None for t in MARKUP)


def stop_ids(tokenizer) -> tuple:
    if tokenizer is None:
        return ()
    return tuple(i for i in (tokenizer.id_of(t) for t in STOPS) if i is not None)


def user_turn_ids(tokenizer, text: str) -> list:
    """Token ids for one user message plus the opening of the assistant's reply."""
    if not has_xtml(tokenizer):
        return tokenizer.encode(text)
    markup = lambda s: tokenizer.encode(s, allow_special=True)  # noqa: E731
    return (markup("<|open|>user<|sep|>") + tokenizer.encode(text)
            + markup("<|close|>user<|sep|><|end_of_msg|><|open|>assistant<|sep|>"))
