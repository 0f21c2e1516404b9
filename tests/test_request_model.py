"""One request model (libk3/request/): a batch line, an OpenAI body and an Anthropic body
are checked by the same rules, and a field no surface reads is refused on each in the
same words (request/fields.py ``refusal``): a batch line is skipped with them, the
server answers 400 with them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.request.fields import BATCH, KNOWN, OPENAI_CHAT, refusal
from libk3.request.model import Generation, Problem, check
from libk3.run.batch import BatchLineError, parse_line
from libk3.serve import anthropic
from libk3.serve.protocol import ApiError, check_request

VOCAB = 512
MESSAGES = [{"role": "user", "content": "hi"}]
# the fields a batch line and a chat request both read
SHARED = sorted(set(BATCH) & OPENAI_CHAT)


def batch_refusal(key, value=1) -> str:
    with pytest.raises(BatchLineError) as e:
        parse_line(json.dumps({"id": 1, "prompt": "x", key: value}).encode(), VOCAB)
    return str(e.value)


def server_refusals(key, value=1) -> list:
    """(status, message, param) of the chat, completion and Messages endpoints."""
    out = []
    for call in (lambda: check_request({"messages": MESSAGES, key: value}, True, VOCAB),
                 lambda: check_request({"prompt": "x", key: value}, False, VOCAB),
                 lambda: anthropic.check_request({"max_tokens": 1, "messages": MESSAGES,
                                                  key: value})):
        with pytest.raises(ApiError) as e:
            call()
        err = e.value.body["error"]
        out.append((e.value.status, err["message"], err["param"]))
    return out


def test_the_same_unknown_field_gets_the_same_refusal_on_every_surface():
    """Catches the surfaces wording an unknown field each their own way (or one of them
    running the request without it: a misspelt temperature sampled greedily)."""
    said = batch_refusal("temprature")
    assert said == refusal("temprature", "batch")
    assert 'unknown field "temprature" (did you mean "temperature"?)' in said
    assert server_refusals("temprature") == [(400, said, "temprature")] * 3


def _misspell(key: str, op: int, at: int, char: str) -> str:
    at %= len(key) + 1
    if op == 0:
        return key[:at] + key[at + 1:]                      # a letter dropped
    if op == 1:
        return key[:at] + char + key[at:]                   # one added
    if op == 2:
        return key[:at] + char + key[at + 1:]               # one replaced
    return key[:at] + key[at + 1:at + 2] + key[at:at + 1] + key[at + 2:]   # two swapped


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SHARED), st.integers(0, 3), st.integers(0, 30),
       st.sampled_from("abcdeilmnoprstuy_-"))
def test_any_misspelt_field_is_refused_alike_on_batch_lines_and_the_server(key, op, at, ch):
    """Catches a misspelling of a field both surfaces read that one of them ignores (it
    would run with the default) or words differently from the other."""
    typo = _misspell(key, op, at, ch)
    if typo in KNOWN or not typo:
        return                                              # a real field, not a typo
    said = batch_refusal(typo)
    assert said == refusal(typo, "batch") and json.dumps(typo) in said
    assert said.startswith("unknown field")
    assert server_refusals(typo) == [(400, said, typo)] * 3


def test_a_field_another_surface_reads_says_so_where_it_is_not_read():
    """Catches a server field in a batch line (or the reverse) refused as unknown, without
    saying what to write instead."""
    assert "the batch field is \"gen\"" in batch_refusal("max_tokens", 8)
    status, message, param = server_refusals("stop_ids", [1])[1]
    assert status == 400 and param == "stop_ids" and "not implemented" in message
    # bookkeeping the server ignores by design stays accepted (docs/serve.md)
    assert check_request({"prompt": "x", "user": "me", "metadata": {}, "best_of": 1}, False,
                         VOCAB).prompt == "x"
    assert anthropic.check_request({"max_tokens": 1, "messages": MESSAGES,
                                    "metadata": {"user_id": "u"}}).max_tokens == 1


@pytest.mark.parametrize("field,value,code", [
    ("temperature", "hot", "invalid_type"), ("temperature", -1, "invalid_value"),
    ("temperature", 10 ** 400, "invalid_value"), ("top_p", 0, "invalid_value"),
    ("top_k", 1.5, "invalid_type"), ("seed", -3, "invalid_value"),
    ("min_p", 2, "invalid_value"),
    ("logit_bias", [[5, 1]], "invalid_type"), ("logit_bias", {"600": 1}, "invalid_value"),
    ("stop", ["a", ""], "invalid_value"), ("gen", -2, "invalid_value"),
])
def test_each_field_is_refused_by_its_rule_alike_in_batch_and_server(field, value, code):
    """Catches a field checked by one surface and not the other, or a value too large for
    a float (10^400) escaping as an exception instead of the line's reason."""
    with pytest.raises(Problem) as e:
        check(Generation, {field: value}, "batch", vocab_size=VOCAB, until_end=True)
    assert e.value.field == field and e.value.code == code and f'"{field}"' in e.value.message
    said = batch_refusal(field, value)
    assert said == e.value.message
    name = "max_tokens" if field == "gen" else field
    with pytest.raises(ApiError) as api:
        check_request({"prompt": "x", name: value}, False, VOCAB)
    assert api.value.status == 422 and api.value.body["error"]["param"] == name
    if field in ("gen", "stop"):     # the server's own bounds: no -1, 4 stop strings at most
        assert api.value.body["error"]["message"].startswith(f'"{name}"')
    else:
        assert api.value.body["error"]["message"] == said


def test_a_valid_request_keeps_its_values():
    """Catches the model changing a value it passes (a stop string into a tuple of
    characters, an unset field given a default that overrides the run's)."""
    g = check(Generation, {"prompt": "x", "stop": "end", "temperature": 0.5}, "batch",
              vocab_size=VOCAB)
    assert g.stop == ("end",) and g.temperature == 0.5 and g.top_p is None
    assert g.given() == {"prompt": "x", "stop": ("end",), "temperature": 0.5}
    line = parse_line(b'{"id": "a", "ids": [3], "stop": "x", "gen": -1}', VOCAB)
    assert line == {"id": "a", "ids": [3], "stop": ["x"], "gen": -1}
