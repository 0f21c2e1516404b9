"""One stop-string rule for k3-run, batch results and the server (docs/run.md "Stop
strings"): a stop string is matched in the bytes of ordinary tokens only (a special
token's text never matches, nor does a match span one), generation ends with the token
that completes it, and the returned text ends where it starts (the ids keep it all)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libk3.engine.generate import GenSettings, generate
from libk3.engine.session import open_session
from libk3.engine.stops import StopText, returned_pieces, returned_text

from .scripts import k3_here

# greedy on tiny: "The capital of France is" -> ... "ain", <|reserved_token_484|>, ...
SPECIAL_PROMPT = "The capital of France is"
# greedy on tiny: "Hello there" -> "ur", "е", "\ufffd", "00", "D", "HE", ...
PLAIN_PROMPT = "Hello there"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    s = open_session(tiny_dir)
    yield s
    s.weights.close()


def _runs(tok, ids):
    """[(bytes of a run of ordinary tokens, ids of the run)] and the specials between."""
    specials = set(tok.special_ids.values())
    out, run = [], []
    for i in ids:
        if i in specials:
            out.append(("run", run))
            out.append(("special", [i]))
            run = []
        else:
            run = run + [i]
    out.append(("run", run))
    return out


def _brute(tok, ids, stops):
    """(tokens kept, returned text) by the rule, from scratch at every prefix."""
    for k in range(1, len(ids) + 1):
        last_run = _runs(tok, ids[:k])[-1]
        if last_run[0] != "run" or not last_run[1]:
            continue
        data = tok.decode_bytes(last_run[1])
        starts = [data.find(s.encode()) for s in stops if s.encode() in data]
        if starts:
            head = tok.decode_bytes(ids[:k][:len(ids[:k]) - len(last_run[1])])
            return k, (head + data[:min(starts)]).decode("utf-8", "replace")
    return len(ids), tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_text_matches_the_brute_force_rule_streamed_or_whole(tok, data):
    """Catches a stop found inside a special token's text or across one, a match missed
    across a token boundary or inside a multi-byte character, the wrong one of two stops
    that complete in one token, or streamed text that differs from the returned text:
    where generation ends and the text it returns equal a from-scratch search of every
    prefix, and the text printed token by token equals it."""
    specials = sorted(tok.special_ids.values())
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.n_ranks - 1),
                                       st.sampled_from(specials[:12])), max_size=40))
    text = tok.decode(ids)
    subs = st.builds(lambda a, n: text[a:a + n], st.integers(0, max(len(text) - 1, 0)),
                     st.integers(1, 6)) if text else st.just("x")
    stops = data.draw(st.lists(st.one_of(subs, st.text(min_size=1, max_size=3)),
                               min_size=1, max_size=3).filter(lambda s: all(s)))
    want_n, want_text = _brute(tok, ids, stops)
    st_ = StopText(tok, stops)
    shown = []
    n = 0
    for i in ids:
        n += 1
        stopped = st_.feed(i)
        shown.append(st_.take())
        if stopped:
            break
    shown.append(st_.finish())
    assert n == want_n
    assert "".join(shown) == want_text
    assert returned_text(tok, ids[:n], stops) == want_text
    assert "".join(t for _, t in returned_pieces(tok, ids[:n], stops)) == want_text


def test_special_token_text_never_matches_a_stop_string(tok):
    """Catches stop strings matched in the decoded text of special tokens (a stop "end_of"
    ending every chat reply at <|end_of_msg|>) or across one; control: the same stop in
    ordinary text stops there, and its text is cut."""
    end = tok.id_of("<|end_of_msg|>")
    ids = tok.encode("Hello") + [end] + tok.encode(" world end_of it")
    assert returned_text(tok, ids[:6], ["end_of"]) == tok.decode(ids[:6])
    assert returned_text(tok, ids, ["lo<|end_of_msg|> w"]) == tok.decode(ids)
    st_ = StopText(tok, ["end_of"])
    at = next(k for k, i in enumerate(ids) if st_.feed(i))
    assert at > ids.index(end)
    assert st_.finish() == "Hello<|end_of_msg|> world "


def test_generate_stops_outside_special_tokens_and_keeps_ids(tiny):
    """Catches the engine ending generation at a stop string found in a special token's
    text: "served" appears only inside <|reserved_token_484|>, so generation runs to its
    length; control: "0D" (split over two tokens) ends it at the token that completes it."""
    tok = tiny.tokenizer
    ids = tok.encode(SPECIAL_PROMPT)
    plain = generate(tiny.forward, tiny.new_state(), ids, GenSettings(gen=16))
    got = generate(tiny.forward, tiny.new_state(), ids,
                   GenSettings(gen=16, stop_strings=("served",)), tokenizer=tok)
    assert got.stop_reason == "length" and got.generated_ids == plain.generated_ids
    ids = tok.encode(PLAIN_PROMPT)
    plain = generate(tiny.forward, tiny.new_state(), ids, GenSettings(gen=16))
    got = generate(tiny.forward, tiny.new_state(), ids,
                   GenSettings(gen=16, stop_strings=("0D",)), tokenizer=tok)
    assert got.stop_reason == "stop_string"
    assert got.generated_ids == plain.generated_ids[:5]
    want = tok.decode(plain.generated_ids[:3]) + "0"
    assert returned_text(tok, got.generated_ids, ("0D",)) == want


def test_server_replies_use_the_shared_rule(tok):
    """Catches the server cutting its reply by its own rule: a completion's text and a
    plain chat reply end where ``returned_text`` ends them, and a stop string inside a
    special token's text cuts nothing."""
    from libk3.engine.replies import ReplyReader
    end = tok.id_of("<|end_of_msg|>")
    ids = tok.encode("Hello") + [end] + tok.encode(" world end_of it")
    for stops in (["end_of"], ["wor"], ["o"]):
        want = returned_text(tok, ids, stops)
        assert ReplyReader(tok, False, stops).text(ids) == want
        assert ReplyReader(tok, False, stops).read(ids, final=True).content == want
    assert ReplyReader(tok, False, ["end_of_msg"]).text(ids[:6]) == tok.decode(ids[:6])


def test_run_stop_string_cut_from_text_kept_in_ids(tiny_dir, tmp_path):
    """Catches k3-run printing and reporting the stop string (the server leaves it out),
    or matching it inside a special token's text; control: the ids keep every token."""
    p = k3_here(tiny_dir, "--prompt", PLAIN_PROMPT, "--gen", 16, "--stop", "0D", "--report-json",
                tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["stop_reason"] == "stop_string" and len(rep["generated_ids"]) == 5
    from libk3.text.tokenizer import K3Tokenizer
    tok = K3Tokenizer.from_dir(tiny_dir)
    want = tok.decode(rep["generated_ids"][:3]) + "0"
    assert rep["generated_text"] == want
    assert p.stdout == want + "\n"
    q = k3_here(tiny_dir, "--prompt", SPECIAL_PROMPT, "--gen", 16, "--stop", "served", "--json")
    assert q.returncode == 0, q.stderr
    rep = json.loads(q.stdout)
    assert rep["stop_reason"] == "length" and len(rep["generated_ids"]) == 16


def test_run_token_ending_by_its_id_is_left_out_of_the_text(tiny_dir, tmp_path):
    """Catches k3-run printing and reporting the text of the token that ended generation
    by its id (a turn's end such as <|end_of_msg|>, or a --stop-id; the server leaves it
    out of a completion's text), in the report, a batch result and the printed text;
    control: the ids keep it, and the same run without the stop id shows its text."""
    from libk3.text.tokenizer import K3Tokenizer
    tok = K3Tokenizer.from_dir(tiny_dir)
    free = json.loads(k3_here(tiny_dir, "--prompt", PLAIN_PROMPT, "--gen", 6, "--json").stdout)
    stop = free["generated_ids"][3]
    p = k3_here(tiny_dir, "--prompt", PLAIN_PROMPT, "--gen", 6, "--stop-id", stop,
                "--report-json", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    first = free["generated_ids"].index(stop)
    assert rep["stop_reason"] == "stop_id" and rep["generated_ids"][-1] == stop
    want = tok.decode(rep["generated_ids"][:first])
    assert rep["generated_text"] == want and p.stdout == want + "\n"
    assert free["generated_text"].startswith(tok.decode(free["generated_ids"][:first + 1]))
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"id": 1, "prompt": PLAIN_PROMPT, "gen": 6}) + "\n")
    q = k3_here(tiny_dir, "--batch", batch, "--out", tmp_path / "o.jsonl", "--stop-id", stop)
    assert q.returncode == 0, q.stderr
    assert json.loads((tmp_path / "o.jsonl").read_text())["generated_text"] == want


def test_batch_results_cut_stop_strings_as_the_cli_does(tiny_dir, tmp_path):
    """Catches batch results keeping the stop text (or a "messages" line's parsed reply
    keeping it) where the CLI and server cut it."""
    from libk3.text.tokenizer import K3Tokenizer
    tok = K3Tokenizer.from_dir(tiny_dir)
    batch = tmp_path / "b.jsonl"
    lines = [{"id": "p", "prompt": PLAIN_PROMPT, "gen": 16, "stop": "0D"},
             {"id": "s", "prompt": SPECIAL_PROMPT, "gen": 16, "stop": ["served"]},
             {"id": "m", "messages": [{"role": "user", "content": "hi"}], "gen": 16,
              "stop": ["r", "e"]}]
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.jsonl"
    p = k3_here(tiny_dir, "--batch", batch, "--out", out, "--batch-width", 2)
    assert p.returncode == 0, p.stderr
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["p"]["generated_text"] == tok.decode(rows["p"]["generated_ids"][:3]) + "0"
    assert rows["s"]["stop_reason"] == "length" and len(rows["s"]["generated_ids"]) == 16
    m = rows["m"]
    from libk3.text.chat_parse import parse_reply, pieces
    assert m["stop_reason"] == "stop_string"
    assert m["generated_text"] == returned_text(tok, m["generated_ids"], ["r", "e"])
    cut = parse_reply(returned_pieces(tok, m["generated_ids"], ["r", "e"])).message()
    assert m["message"] == cut != parse_reply(pieces(tok, m["generated_ids"])).message()
