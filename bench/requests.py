"""Request validation (libk3/request/): the cost per request of checking a typical chat
request and a batch line with the request model (pydantic v2), next to the same rules
called by hand and the same model written for msgspec (when it is installed; it is not a
dependency: ``pip install msgspec`` to compare). Prints microseconds per request, the
best of 5 rounds. Run: python bench/requests.py"""

from __future__ import annotations

import json
import time

from libk3.engine.settings import SAMPLING_RULES, logit_bias_problem, stop_strings_problem
from libk3.request.model import Generation, check
from libk3.run.batch import BatchLine, parse_line
from libk3.serve.protocol import check_request
from libk3.text.chat_request import conversation_problem

VOCAB = 163_840
CHAT = {"model": "k3", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name three rivers."}],
        "max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "seed": 7, "stop": ["\n\n"]}
LINE = {"id": "q-17", "prompt": "Name three rivers.", "gen": 64, "temperature": 0.7,
        "top_k": 40, "seed": 7, "stop": ["\n\n"], "logit_bias": {"11": -5}}
FIELDS = {"messages": CHAT["messages"], "gen": 128, "temperature": 0.7, "top_p": 0.95,
          "seed": 7, "stop": ["\n\n"]}


def by_hand(obj: dict) -> None:
    """The rules called one by one, as the adapters did before the model."""
    for key, rule in SAMPLING_RULES.items():
        if key in obj and rule(obj[key]):
            raise ValueError(key)
    if "messages" in obj and conversation_problem(obj):
        raise ValueError("messages")
    if "logit_bias" in obj and logit_bias_problem(obj["logit_bias"], VOCAB, json_only=True):
        raise ValueError("logit_bias")
    if stop_strings_problem(obj.get("stop", [])):
        raise ValueError("stop")


def _msgspec_check():
    """The Generation fields as a msgspec Struct whose __post_init__ runs the same rules,
    or None without msgspec."""
    try:
        import msgspec
    except ImportError:
        return None

    class Struct(msgspec.Struct, forbid_unknown_fields=True):
        id: object = None
        prompt: object = None
        messages: object = None
        gen: object = None
        temperature: object = None
        top_p: object = None
        top_k: object = None
        seed: object = None
        stop: object = ()
        logit_bias: object = None

        def __post_init__(self):
            by_hand({k: v for k in self.__struct_fields__
                     if (v := getattr(self, k)) is not None})

    return lambda obj: msgspec.convert(obj, Struct)


def per_request(fn, arg, n: int = 5_000) -> float:
    """Microseconds per call of ``fn(arg)``: the best of 5 rounds of ``n``."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(arg)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    raw = json.dumps(LINE).encode()
    rows = [("chat request", "rules by hand", by_hand, FIELDS),
            ("chat request", "pydantic model", lambda o: check(Generation, o, "openai",
                                                               vocab_size=VOCAB), FIELDS),
            ("chat request", "OpenAI adapter (all fields)",
             lambda b: check_request(b, True, VOCAB), CHAT),
            ("batch line", "rules by hand", by_hand, LINE),
            ("batch line", "pydantic model", lambda o: check(BatchLine, o, "batch",
                                                             vocab_size=VOCAB,
                                                             until_end=True), LINE),
            ("batch line", "parse_line (bytes, JSON and all)",
             lambda r: parse_line(r, VOCAB), raw)]
    spec = _msgspec_check()
    if spec is not None:
        rows[2:2] = [("chat request", "msgspec struct", spec, FIELDS)]
        rows.append(("batch line", "msgspec struct", spec, LINE))
    print(f"{'request':14s} {'checked by':34s} {'us/request':>10s}")
    for what, how, fn, arg in rows:
        print(f"{what:14s} {how:34s} {per_request(fn, arg):10.1f}")


if __name__ == "__main__":
    main()
