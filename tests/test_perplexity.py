"""--perplexity, --save-logits and --kl-divergence (docs/run.md "Perplexity",
formats/logits.md): llama-perplexity's windows and figures, the float64 reference's
perplexity, the same bytes at every budget and thread count, and the saved-logits file's
invariants."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from k3_run.cli import main as run_main
from libk3.errors import FormatError, UsageError
from libk3.io.logits_file import HEADER, LogitsHeader, LogitsReader, writing
from libk3.run import perplexity as ppl

from .hostile import check_refused, invoke
from .scripts import k3, k3_here

TEXT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "perplexity.txt")


def _fake_logits(seed: int, vocab: int = 11):
    """A window_logits whose rows depend on the window's tokens and positions only."""
    def window_logits(ids, first):
        rows = []
        for j in range(first, len(ids) - 1):
            r = np.random.default_rng([seed, j, *ids[:j + 1]])
            rows.append(r.normal(0, 2, vocab).astype(np.float32))
        return np.array(rows)
    return window_logits


def _brute(window_logits, ids, ctx):
    """Every window's positions ctx//2 .. ctx-2, each scored against the next token."""
    nll = []
    for w in range(len(ids) // ctx):
        win = ids[w * ctx:(w + 1) * ctx]
        rows = window_logits(win, ctx // 2).astype(np.float64)
        for j, row in zip(range(ctx // 2, ctx - 1), rows):
            nll.append(math.log(np.exp(row).sum()) - row[win[j + 1]])
    return np.array(nll)


def test_perplexity_scores_the_second_half_of_each_window():
    """Catches scoring the whole window, an off-by-one target (a position scored against
    its own token), a trailing part window scored, or a ± that is not ppl × the standard
    error of the mean NLL: the figures equal a brute-force loop."""
    ids = list(np.random.default_rng(0).integers(0, 11, 53))
    fake = _fake_logits(1)
    doc = ppl.evaluate(fake, ids, ppl.plan(ids, 10, "t"), 11)
    want = _brute(fake, ids, 10)
    assert doc["windows"] == 5 and doc["scored"] == len(want) == 5 * 4
    assert doc["mean_nll"] == pytest.approx(want.mean(), rel=1e-12)
    stderr = want.std() / math.sqrt(len(want) - 1)
    assert doc["ppl"] == pytest.approx(math.exp(want.mean()), rel=1e-12)
    assert doc["ppl_stderr"] == pytest.approx(math.exp(want.mean()) * stderr, rel=1e-9)


def test_perplexity_refuses_a_text_shorter_than_a_window():
    """Catches a text under one window scored as nothing (a NaN perplexity): a usage
    error naming the file; control: one window exactly is scored."""
    with pytest.raises(UsageError, match="t.txt: 9 tokens"):
        ppl.plan(list(range(9)), 10, "t.txt")
    assert ppl.plan(list(range(10)), 10, "t.txt").windows == 1


def test_kl_divergence_is_zero_against_itself_and_the_brute_force_otherwise(tmp_path):
    """Catches a KL taken the wrong way round (Q||P), from logits instead of
    probabilities, or a same-top share counting the wrong rows: against its own saved
    logits KL is 0 and every top token the same; against another model's it is the
    brute-force sum of P (log P - log Q)."""
    ids = list(np.random.default_rng(2).integers(0, 11, 40))
    p = ppl.plan(ids, 8, "t")
    base, other = _fake_logits(3), _fake_logits(4)
    saved = tmp_path / "base.logits"
    ppl.evaluate(base, ids, p, 11, save=saved)
    same = ppl.evaluate(base, ids, p, 11, base=saved)["kl_divergence"]
    assert same["mean"] == 0.0 and same["same_top"] == 1.0
    got = ppl.evaluate(other, ids, p, 11, base=saved)["kl_divergence"]
    kl, top = [], []
    for w in range(p.windows):
        win = p.window(ids, w)
        lp, lq = (ppl.log_softmax(f(win, p.first)) for f in (base, other))
        kl += list((np.exp(lp) * (lp - lq)).sum(1))
        top += list(lp.argmax(1) == lq.argmax(1))
    assert got["mean"] == pytest.approx(np.mean(kl), rel=1e-12) and got["mean"] > 0
    assert got["same_top"] == pytest.approx(np.mean(top))


def test_logits_file_refuses_each_broken_invariant(tmp_path):
    """Catches a reader that trusts a damaged or foreign file: a wrong magic, version,
    length, target or CRC is a FormatError naming the file; control: the file as
    written reads back, its rows and targets equal."""
    h = LogitsHeader(vocab=5, ctx=4, per_window=1, windows=2)
    rows = np.arange(10, dtype=np.float32).reshape(2, 1, 5)
    good = tmp_path / "good.logits"
    with writing(good, h, [1, 4]) as w:
        for r in rows:
            w.add(r)
    r = LogitsReader(good)
    assert r.header == h and list(r.targets) == [1, 4]
    assert np.array_equal(r.window(0), rows[0])
    r.finish()
    data = good.read_bytes()
    cases = {"magic": b"K3LOGITX" + data[8:], "version": data[:8] + bytes([2]) + data[9:],
             "length": data[:-1], "target": data[:40] + bytes([9]) + data[41:],
             "CRC": data[:60] + bytes([data[60] ^ 1]) + data[61:]}
    for what, bad in cases.items():
        path = tmp_path / f"{what}.logits"
        path.write_bytes(bad)
        with pytest.raises(FormatError) as e:
            LogitsReader(path).finish()
        assert str(path) in e.value.one_line(), what


def test_logits_file_left_unchanged_when_a_run_fails(tmp_path):
    """Catches a half-written logits file: when scoring fails mid-way nothing is left at
    the path or beside it; control: the run that finishes writes it."""
    ids = list(range(1, 9)) * 4
    p = ppl.plan(ids, 8, "t")
    calls = []

    def failing(win, first):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return _fake_logits(5)(win, first)
    out = tmp_path / "x.logits"
    with pytest.raises(Exception):
        ppl.evaluate(failing, ids, p, 11, save=out)
    assert os.listdir(tmp_path) == []
    ppl.evaluate(_fake_logits(5), ids, p, 11, save=out)
    assert out.stat().st_size == HEADER.size + 4 * 4 * 3 + 4 * 4 * 3 * 11 + 4


def test_perplexity_of_tiny_matches_the_float64_reference(tiny_dir):
    """Catches an engine perplexity that is not the model's (a wrong row, a window that
    carries state from the last, a float32 log-softmax): within 1e-6 relative of the
    float64 reference forward on the committed text."""
    from libk3.engine.session import open_session
    from libk3.model import reference as ref
    sess = open_session(tiny_dir)
    ids = sess.tokenizer.encode(open(TEXT, encoding="utf-8").read())[:96]
    weights = {}

    def get(name):
        if name not in weights:
            weights[name] = sess.ckpt.read(name)
        return weights[name]

    def ref_logits(win, first):
        return ref.forward(sess.cfg, get, win[:-1])[first:]
    p = ppl.plan(ids, 32, "t")
    want = ppl.evaluate(ref_logits, ids, p, sess.cfg.vocab_size)
    got = ppl.evaluate(ppl.engine_window_logits(sess, 64), ids, p, sess.cfg.vocab_size)
    assert got["windows"] == 3
    assert abs(got["ppl"] - want["ppl"]) <= 1e-6 * want["ppl"], (got["ppl"], want["ppl"])


def test_perplexity_is_the_same_bytes_at_every_budget_and_thread_count(tiny_dir, tmp_path):
    """Catches a perplexity or KL that depends on the budget, the prefill chunk or the
    team size (a reduction order): --json output byte-identical for the resident run,
    the floor budget, and one and two threads; the saved logits too, so KL is 0."""
    from libk3.budget import ModelSizes, minimum_budget
    from libk3.io.checkpoint import Checkpoint
    with Checkpoint.open(tiny_dir) as ckpt:
        floor = minimum_budget(ModelSizes.from_checkpoint(ckpt))
    gb = lambda b: f"{b / 1e9:.9f}"  # noqa: E731
    base = ["--perplexity", TEXT, "-c", 48, "--json"]
    runs = {"resident": (k3_here, ["--resident"]),
            "floor": (k3_here, ["--trunk-gb", gb(floor.trunk_bytes + 1),
                                "--cache-gb", gb(floor.cache_bytes + 1)]),
            "t1": (k3, ["--threads", 1]), "t2": (k3, ["--threads", 2])}
    outs, saved = {}, {}
    for name, (run, extra) in runs.items():
        saved[name] = tmp_path / f"{name}.logits"
        p = run(tiny_dir, *base, *extra, "--save-logits", saved[name])
        assert p.returncode == 0, p.stderr
        outs[name] = json.loads(p.stdout)
        outs[name].pop("saved_logits")
    first = outs["resident"]
    assert first["windows"] == 5 and first["ppl"] > 1
    assert all(o == first for o in outs.values()), outs
    assert len({f.read_bytes() for f in saved.values()}) == 1
    kl = k3_here(tiny_dir, *base, "--kl-divergence", saved["t2"])
    assert kl.returncode == 0, kl.stderr
    doc = json.loads(kl.stdout)["kl_divergence"]
    assert doc["mean"] == 0.0 and doc["same_top"] == 1.0


def test_perplexity_cli_prints_llama_perplexity_lines_and_refuses_mismatches(tiny_dir,
                                                                            tmp_path):
    """Catches the text output without the running figures or the final estimate, and a
    KL base of another -c accepted (its positions are other positions): exit 2 naming
    it; control: the same -c compares."""
    saved = tmp_path / "b.logits"
    p = k3_here(tiny_dir, "--perplexity", TEXT, "-c", 64, "--save-logits", saved)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("[1]") and "[4]" in p.stdout
    assert "Final estimate: PPL = " in p.stdout and " +/- " in p.stdout
    check_refused(invoke(run_main, [tiny_dir, "--perplexity", TEXT, "-c", 32,
                                    "--kl-divergence", saved]), 2, "--ctx-size", str(saved))
    ok = k3_here(tiny_dir, "--perplexity", TEXT, "-c", 64, "--kl-divergence", saved)
    assert ok.returncode == 0 and "KL divergence: mean 0.000000" in ok.stdout
    check_refused(invoke(run_main, [tiny_dir, "--ids", "1", "--save-logits", saved]), 2,
                  "--perplexity")


@pytest.mark.parametrize("extra", [["--temperature", "0.8"], ["-n", "4"], ["--spec", "2"],
                                   ["--stop", "x"]])
def test_perplexity_refuses_generation_options(tiny_dir, extra):
    """Catches a sampling, --gen, --stop or drafting option taken with --perplexity and
    silently ignored (the figure never samples or generates): exit 2 naming it; control:
    the run without it is scored."""
    base = [tiny_dir, "--perplexity", TEXT, "-c", 64, "--json"]
    check_refused(invoke(run_main, base + extra), 2, "--perplexity", "generation options")
    assert invoke(run_main, base).code == 0


def test_perplexity_with_a_damaged_base_fails_and_saves_nothing(tiny_dir, tmp_path):
    """Catches a KL figure printed from a base whose bytes changed (its CRC), or the
    run's own --save-logits published anyway: exit 3 naming the base, no final estimate,
    no file saved; control: the undamaged base compares."""
    base, again = tmp_path / "b.logits", tmp_path / "again.logits"
    args = [tiny_dir, "--perplexity", TEXT, "-c", 64]
    assert k3_here(*args, "--save-logits", base).returncode == 0
    data = bytearray(base.read_bytes())
    ok = k3_here(*args, "--kl-divergence", base, "--save-logits", again)
    assert ok.returncode == 0 and again.is_file()
    again.unlink()
    data[len(data) // 2] ^= 0x40
    base.write_bytes(bytes(data))
    out = invoke(run_main, args + ["--kl-divergence", base, "--save-logits", again])
    assert out.code == 3 and str(base) in out.stderr and "CRC" in out.stderr
    assert "Final estimate" not in out.stdout and not again.exists()
