"""Drafting (speculative decoding) benchmarks, measured side by side in one run
(bench/README.md, "Drafting"). Models are generated into scratch/ on first use.

    python bench/drafting.py                 # every section
    python bench/drafting.py oracle model    # chosen sections

Sections:
  oracle  medium at the floor budget and resident: plain decoding against proposals from
          an oracle (the true continuation, each proposal spoiled with a seeded
          probability chosen so that verifying all 7 would commit 2.6, 3.7 or 5.5 tokens
          per pass on average): s/token, bytes read per generated token, tokens per pass;
          the tokens must be the same in every row.
  spec    prompt lookup whose proposals are all wrong, on medium at the floor: passes per
          token and bytes per pass against plain decoding (a rejection costs no second
          pass).
  plain   plain decoding of this tree against BASE (default: the commit before drafting
          reached the decode loop), small resident and medium at the floor, alternating
          rounds: this tree's s/token over BASE's.
  model   Kimi K3 modelled from pieces measured here (verify-pass compute at widths 1-8 on
          real-dims, the draft pass on the real-dims draft, the disk's read rate) and the
          model's own byte ledger, at the laptop preset and at 128 GB, with the published
          acceptance (mean 3.66, worst 2.63, best 5.55): s/token with drafting over plain,
          and the same with a pass's compute held at one token's (what perfectly
          batched arithmetic could reach: the expert reads' own bound).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, base_tree, checkpoint, packed, run, table, tool  # noqa: E402

from libk3.budget import ModelSizes, minimum_budget  # noqa: E402
from libk3.io.checkpoint import Checkpoint  # noqa: E402

PROMPT = [(37 * i + 11) % 30000 + 5 for i in range(32)]
BASE = "1492cb9"        # the last commit before verify/commit and the new sampler
CAP = 7                 # the published draft's block
WARM = 16               # tokens a drafting run decodes before it is measured


def _draft_checkpoint(preset: str) -> Path:
    """The synthetic checkpoint of ``preset`` with its draft in ``draft/``."""
    path = DATA / preset
    if not (path / "draft" / "config.json").exists():
        if (path / "config.json").exists():
            from libk3.synth.draft import synth_draft
            synth_draft(path, path / "draft")
        else:
            DATA.mkdir(parents=True, exist_ok=True)
            run(["k3-pack", "synth", "--preset", preset, "--draft", "--quiet", str(path)])
    return path


def _session(preset: str, where: str):
    from libk3.engine.session import open_session
    ck = checkpoint(preset)
    if where == "resident":
        return open_session(ck)
    with Checkpoint.open(ck) as c:
        floor = minimum_budget(ModelSizes.from_checkpoint(c))
    return open_session(ck, pack=packed(preset), trunk_bytes=floor.trunk_bytes + 1,
                        cache_bytes=floor.cache_bytes + 1)


def _read_bytes(sess) -> int:
    st = sess.weights.stats()
    return st.get("trunk", {}).get("bytes_read", 0) + st.get("experts", {}).get("bytes_read", 0)


def spoil_rate(mean: float, cap: int = CAP) -> float:
    """The per-proposal failure probability q with which verifying all ``cap`` proposals
    commits ``mean`` tokens per pass."""
    from libk3.speculate.speculative import acceptance_for
    return 1.0 - acceptance_for(mean, cap)


class Oracle:
    """Proposes the true continuation, each proposal replaced by another id with
    probability ``q``, drawn afresh for every verify (a generator seeded by the anchor's
    position and the proposal's index, so every run breaks it at the same places); its
    confidence is 1 - q, as a calibrated head's would be."""

    taps = None

    def __init__(self, truth, q, vocab):
        self.truth, self.q, self.vocab = truth, q, vocab

    def propose(self, state, anchor, n, pick):
        from libk3.speculate.speculative import Proposal
        at = state.pos + 1
        out = []
        for j, t in enumerate(self.truth[at:at + n]):
            bad = np.random.default_rng([7, state.pos, j]).random() < self.q
            out.append((t + 1) % self.vocab if bad else t)
        return Proposal(out, np.full(len(out), 1.0 - self.q))

    def observe(self, state, taps):
        pass


def _decode(sess, gen, drafting=None):
    """(generated ids, decode s/token, bytes read per generated token, stats)."""
    from libk3.engine.generate import GenSettings, Hooks, generate
    marks = {}

    def mark(_n):
        marks["bytes"] = _read_bytes(sess)
    r = generate(sess.forward, sess.new_state(), PROMPT, GenSettings(gen=gen),
                 hooks=Hooks(progress=mark),
                 drafting=drafting)
    n = len(r.generated_ids)
    return r.generated_ids, r.decode_seconds / n, (_read_bytes(sess) - marks["bytes"]) / n, r.spec


def section_oracle(gen: int = 96):
    from libk3.speculate.speculative import Drafting, SpecStats
    print(f"oracle proposals on medium, {gen} tokens after a {len(PROMPT)}-token prompt "
          f"(decode only, after {WARM} tokens that measure the pass costs), up to {CAP} "
          "proposals per pass")
    for where in ("floor", "resident"):
        sess = _session("medium", where)
        vocab = sess.cfg.vocab_size
        _decode(sess, 4)                                                 # warm
        base, base_s, base_b, _ = _decode(sess, gen)
        truth = PROMPT + base
        rows = [["plain", "-", "-", "1.00", f"{base_s:.3f}", f"{base_b / 1e6:.1f}", "1.00",
                 "yes"]]
        plain_s = [base_s]
        for mean in (2.6, 3.7, 5.5):
            q = spoil_rate(mean)
            drafting = Drafting(Oracle(truth, q, vocab), CAP)
            _decode(sess, WARM, drafting)          # the cost model measured: steady state
            drafting.stats = SpecStats(CAP)
            ids, s, b, st = _decode(sess, gen, drafting)
            rows.append([f"oracle {mean}", f"{q:.3f}", f"{st['acceptance_rate']:.2f}",
                         f"{st['tokens_per_pass']:.2f}",
                         f"{s:.3f}", f"{b / 1e6:.1f}", f"{s / base_s:.2f}",
                         "yes" if ids == base else "NO"])
            again, s2, _, _ = _decode(sess, gen)            # plain again: the noise
            plain_s.append(s2)
        sess.weights.close()
        print(f"  {where}: plain s/token over the rounds {min(plain_s):.3f}..{max(plain_s):.3f}")
        print(table(rows, ["proposals", "q", "kept", "tokens/pass", "s/token",
                           "MB read/token", "x plain", "same tokens"]))
    print()


def section_spec(gen: int = 24):
    from libk3.speculate.speculative import Drafting, Width

    class Wrong(Oracle):
        def __init__(self, truth, vocab):
            super().__init__(truth, 1.0, vocab)

    class Always(Width):        # verify every proposal: the worst case for a rejection
        def choose(self, confidence, others=0):
            return len(confidence), 2.0
    sess = _session("medium", "floor")
    _decode(sess, 4)
    base, base_s, base_b, _ = _decode(sess, gen)
    d = Drafting(Wrong(PROMPT + base, sess.cfg.vocab_size), 4)
    d.width = Always(4)
    p0 = sess.forward.passes
    ids, s, b, st = _decode(sess, gen, d)
    passes = sess.forward.passes - p0 - 1
    sess.weights.close()
    print(f"all-wrong proposals (4 per pass, every one verified) on medium at the floor, "
          f"{gen} tokens")
    print(table([["plain", gen, f"{base_b / 1e6:.1f}", f"{base_s:.3f}", "yes"],
                 ["4 wrong per pass", passes, f"{b * gen / passes / 1e6:.1f}", f"{s:.3f}",
                  "yes" if ids == base else "NO"]],
                ["decoding", "decode passes", "MB read per pass", "s/token", "same tokens"]))
    print()


def section_plain(rounds: int = 3, gen: int = 24):
    shim = base_tree(BASE, "drafting-base")
    here = base_tree("HEAD", "drafting-head")
    rows = []
    for preset, extra in (("small", ["--resident"]), ("medium", None)):
        ck = checkpoint(preset)
        if extra is None:
            with Checkpoint.open(ck) as c:
                floor = minimum_budget(ModelSizes.from_checkpoint(c))
            extra = ["--pack", packed(preset), "--trunk-gb", f"{(floor.trunk_bytes + 1) / 1e9:.9f}",
                     "--cache-gb", f"{(floor.cache_bytes + 1) / 1e9:.9f}"]
        args = [ck, "--ids", ",".join(map(str, PROMPT)), "--gen", gen, "--quiet", *extra]
        times = {"base": [], "head": []}
        tmp = DATA / "drafting-reports"
        tmp.mkdir(exist_ok=True)
        for _ in range(rounds):
            for name, tree in (("base", shim), ("head", here)):
                _, rep = tool(tree, "k3-run", args, report=tmp / f"{name}.json")
                times[name].append(rep["seconds_per_token"])
        b, h = np.median(times["base"]), np.median(times["head"])
        rows.append([preset + (" resident" if "--resident" in extra else " floor"),
                     f"{b:.4f}", f"{h:.4f}", f"{h / b:.3f}"])
    print(f"plain decoding, {gen} tokens, median of {rounds} alternating rounds: this tree "
          f"(HEAD) against {BASE}")
    print(table(rows, ["model", f"{BASE} s/token", "HEAD s/token", "HEAD / base"]))
    print()


# ---- Kimi K3 modelled ------------------------------------------------------------------

def _layer_compute(widths):
    """Seconds of one pass per real-dims layer kind (dense, KDA+MoE, MLA+MoE) and of the
    head, resident (compute only), at each verify width: {width: (dense, kda, mla, head)}."""
    from libk3.engine.generate import GenSettings, generate
    from libk3.engine.session import open_session
    from libk3.model.forward import Segment, commit
    sess = open_session(checkpoint("real-dims"))
    st = sess.new_state()
    generate(sess.forward, st, [11, 12, 13, 14], GenSettings(gen=2))             # warm
    out = {}
    for w in widths:
        sess.forward.layer_seconds = [0.0] * 3
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            seg = Segment(list(range(20, 20 + w)), st, all_logits=True, phase="decode",
                          verify=True)
            sess.forward.run([seg])
            commit(seg, 0)
        total = (time.perf_counter() - t0) / reps
        per = [t / reps for t in sess.forward.layer_seconds]
        out[w] = (per[0], per[1], per[2], total - sum(per))
    sess.weights.close()
    return out


def _draft_pass():
    """Seconds of one draft block pass with 7 proposals on the real-dims draft (resident),
    and the bytes of its weights."""
    from libk3.draft.checkpoint import load_draft
    from libk3.draft.forward import DraftForward
    from libk3.engine.session import open_session
    ck = _draft_checkpoint("real-dims")
    sess = open_session(ck)
    draft = load_draft(ck / "draft", sess.cfg)
    model = DraftForward(draft.cfg, draft.weights, sess.weights.embed,
                         sess.weights.model()["lm_head"])
    cache = model.new_cache()
    taps = np.random.default_rng(0).standard_normal(
        (64, draft.cfg.n_taps * draft.cfg.target_hidden_size)).astype(np.float32)
    model.ingest(cache, taps)
    model.propose(cache, 5, CAP)                                                  # warm
    t0 = time.perf_counter()
    for _ in range(3):
        model.propose(cache, 5, CAP)
    seconds = (time.perf_counter() - t0) / 3
    sess.weights.close()
    return seconds, draft.nbytes


def _read_rate() -> float:
    """Bytes per second of O_DIRECT sequential reads of the real-dims pack's trunk (the
    rate a streamed trunk pass sees here)."""
    from libk3.machine.storage import sequential_read_rate
    trunk = packed("real-dims") / "trunk.bin"
    return sequential_read_rate([(str(trunk), 0, trunk.stat().st_size)], seconds=3.0)


TRACE_TOKENS = 240


def _trace_keys() -> np.ndarray:
    """(tokens, requests per token) keys of a synthetic decode trace at K3's shape, with
    the default knobs of libk3.synth.traces (bench/README.md, "Drafting", compares its
    unions with published prefill reads)."""
    from libk3.synth.traces import synth_keys
    return synth_keys(TRACE_TOKENS, seed=3).reshape(TRACE_TOKENS, -1)


def union_factor(keys, w: int) -> float:
    """Distinct experts of w consecutive positions over one position's."""
    unions = [len(np.unique(keys[i:i + w])) for i in range(0, len(keys) - w, w)]
    return float(np.mean(unions)) / keys.shape[1]


def lru_hit_rate(keys, slots: int) -> float:
    """Hits / requests of an LRU cache of ``slots`` experts on the trace (second half)."""
    import collections
    cache = collections.OrderedDict()
    hits = reqs = 0
    for t, row in enumerate(keys):
        for k in np.unique(row):
            k = int(k)
            hit = k in cache
            if hit:
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > slots:
                    cache.popitem(last=False)
            if t >= len(keys) // 2:
                hits, reqs = hits + hit, reqs + 1
    return hits / reqs


def section_model():
    from libk3.budget import plan_trunk
    from libk3.speculate.speculative import acceptance_for, best_width
    from libk3.k3_dims import real_config
    cfg = real_config()
    sizes = ModelSizes.from_config(cfg)
    widths = range(1, CAP + 2)
    comp = _layer_compute(widths)
    draft_s, draft_bytes = _draft_pass()
    rate = _read_rate()
    keys = _trace_keys()
    unions = {w: union_factor(keys, w) for w in widths}
    expert_token = sizes.active_expert_bytes
    # (trunk, cache, whether the draft streams: at 8 GB it cannot be held beside the model)
    budgets = {"laptop (8 GB)": (3.7e9, 0.4e9, True), "128 GB": (110e9, 8e9, False)}
    print(f"Kimi K3 modelled: compute per pass from real-dims (1 dense + 68 KDA+MoE + 24 "
          f"MLA+MoE layers), read rate {rate / 1e9:.2f} GB/s measured here, draft pass "
          f"{draft_s:.2f} s ({draft_bytes / 1e9:.2f} GB resident), expert union from "
          f"synthetic traces")
    print(table([[w, f"{unions[w]:.2f}", f"{sum(c * k for c, k in zip(comp[w], (1, 68, 24, 1))):.1f}"]
                 for w in widths], ["width", "expert union / 1 token", "compute s/pass"]))
    for name, (trunk_b, cache_b, streams) in budgets.items():
        plan = plan_trunk(sizes.layer_bytes, int(trunk_b))
        draft_pass = draft_s + (draft_bytes / rate if streams else 0.0)
        streamed = plan.streamed_bytes
        hit = lru_hit_rate(keys, int(cache_b // sizes.expert_slot_bytes))

        def cost(w, arithmetic_of=None):
            """Seconds of a pass of w tokens; ``arithmetic_of`` prices its compute as a
            pass of that many tokens instead (1: a bound where widening costs no compute)."""
            experts = unions[w] * expert_token * (1 - hit)
            c = comp[arithmetic_of or w]
            return (streamed + experts) / rate + c[0] + 68 * c[1] + 24 * c[2] + c[3]
        plain = cost(1)

        def best(conf, pass_cost):
            L, e, c = best_width(conf, lambda n: pass_cost(n) + draft_pass)
            per_token = c[L] / e[L] if L else plain     # plain decoding runs no draft
            return (0, e, plain) if per_token > plain else (L, e, per_token)
        rows = []
        for label, mean in (("worst 2.63", 2.63), ("mean 3.66", 3.66), ("best 5.55", 5.55)):
            conf = np.full(CAP, acceptance_for(mean, CAP))
            L, e, per_token = best(conf, cost)
            bound = best(conf, lambda n: cost(n, arithmetic_of=1))[2]
            rows.append([label, L, f"{e[L]:.2f}", f"{per_token:.1f}",
                         f"{per_token / plain:.2f}", f"{bound / plain:.2f}"])
        print(f"  {name}: trunk streamed {streamed / 1e9:.1f} GB per pass, expert cache "
              f"hits {hit:.0%}, plain {plain:.1f} s/token; draft pass "
              f"{'streamed' if streams else 'held'} {draft_pass:.2f} s = "
              f"{draft_pass / plain:.1%} of it")
        print(table(rows, ["acceptance", "proposals verified", "tokens/pass",
                           "s/token", "x plain", "x plain, compute not widening"]))
    print()


SECTIONS = {"oracle": section_oracle, "spec": section_spec, "plain": section_plain,
            "model": section_model}


def main(argv) -> None:
    chosen = argv or list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    for name in chosen:
        SECTIONS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
