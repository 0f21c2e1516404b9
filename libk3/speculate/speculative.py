"""Speculative decoding: propose several tokens, verify them in one pass, commit exactly.

Owns: one sequence's drafting step (``Speculator``): asking a proposer for up to N tokens
after the anchor, choosing how many to verify (``Width``: expected committed tokens over
the measured cost of a pass of that width), building the verify ``Segment``, accepting
the proposals that equal what the sampler picks from the target's rows, and committing
the anchor and the accepted ones (``forward.commit``: no second pass over any weight).
Also the counters a run reports (``SpecStats``). Does not own: the proposers
(``libk3.speculate.proposers``), the passes (``libk3.engine.core``), sampling
(``libk3.engine.sampler``: the pick at a position depends only on that position's logits and the
tokens before it, which for a verify row are the anchor and the proposals before it).

Exactness: a verify pass computes each row with the arithmetic of plain decoding
(model.md §7.4), and a proposal is kept only when it equals the token plain decoding picks
there, so the committed tokens and their logits are plain decoding's, greedy or sampled,
whatever is proposed and however many are verified (dspark.md §6). The width changes
speed only; so it may depend on timings.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from ..model.forward import Segment, commit
from ..engine.pace import fit_line

WINDOW = 32              # recent passes the cost model uses
FIXED_PRIOR = 0.9        # a width not measured yet, beside only one: its fixed share
MAX_PAUSE = 16           # steps without drafting, at most, after drafting did not pay
PLAIN_SAMPLES = 2        # plain passes kept in the window: the cost every choice is held to
RATE_MEMORY = 0.8        # weight of the earlier verifies in a proposer's acceptance rate


@dataclasses.dataclass
class Proposal:
    """What a proposer offers after an anchor: ``tokens`` (at most the n asked for) and,
    when it knows them, ``confidence[k]``, the chance that token k survives given that the
    ones before it did; ``dump``: arrays for --draft-dump (or None)."""

    tokens: list
    confidence: np.ndarray | None = None
    dump: dict | None = None


class SpecStats:
    """Counters of a run's drafting (one object may serve several sequences)."""

    def __init__(self, cap: int):
        self.passes = 0                   # decode passes of drafting sequences
        self.verifies = 0                 # of them, passes that checked proposals
        self.drafted = 0                  # proposals verified
        self.accepted = 0                 # proposals committed
        self.committed = collections.Counter()   # tokens committed per pass -> passes
        self.draft_seconds = 0.0
        self.pass_seconds = 0.0
        self.cap = cap

    def to_json(self) -> dict:
        tokens = sum(k * n for k, n in self.committed.items())
        return {
            "passes": self.passes, "verify_passes": self.verifies,
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 6) if self.drafted else None,
            "tokens_per_pass": round(tokens / self.passes, 6) if self.passes else None,
            "committed_per_pass": {str(k): self.committed.get(k, 0)
                                   for k in range(1, self.cap + 2)},
            "draft_seconds": round(self.draft_seconds, 6),
            "pass_seconds": round(self.pass_seconds, 6),
        }


class Width:
    """How many proposals to verify: the count L that maximises the expected committed
    tokens E_L = sum_{i<=L} a_i (a_0 = 1, a_i = the product of the first i confidences)
    over the cost of the pass that feeds them (dspark.md §5.7). L = 0 is plain decoding,
    so the choice never expects to be slower than it.

    The cost of a pass feeding n tokens in all is the median of the recent passes of that
    size when there are some, else a line through the sizes measured; a verify's cost is
    not linear in its width (the second token brings its own experts), so plain decoding's
    cost is measured, not inferred: while fewer than PLAIN_SAMPLES of the window's passes
    were plain, the choice is plain. With only plain passes measured, a wider pass is
    priced with FIXED_PRIOR as its fixed share, and measured once chosen. In a lockstep
    pass the other sequences' tokens ride along (``others``): a sequence's rate is its
    expected tokens over the whole pass's cost.

    Also whether drafting pays at all, with the draft's own time counted: when the
    expected gain stays below 1, drafting pauses for 1, 2, 4, ... MAX_PAUSE steps and is
    tried again, verifying at least one proposal (a probe: without it a proposer judged by
    its acceptance rate would never be heard again)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.passes = collections.deque(maxlen=WINDOW)   # (tokens fed, seconds, plain)
        self.seen = 0
        self.draft = None                 # seconds of a draft pass (mean of the recent)
        self.pause = 0
        self.backoff = 1
        self.probe = False

    def record(self, tokens: int, seconds: float, plain: bool) -> None:
        """A decode pass that fed ``tokens`` tokens in all, ``plain`` when it verified no
        proposal (the first is left out: it touches cold weights)."""
        self.seen += 1
        if self.seen > 1:
            self.passes.append((tokens, seconds, plain))

    def record_draft(self, seconds: float) -> None:
        self.draft = seconds if self.draft is None else 0.75 * self.draft + 0.25 * seconds

    def cost(self, tokens: int) -> float:
        """Modelled seconds of a pass feeding ``tokens`` (relative until any is measured)."""
        by_size = collections.defaultdict(list)
        for n, s, _ in self.passes:
            by_size[n].append(s)
        if tokens in by_size:
            return float(np.median(by_size[tokens]))
        medians = [(n, float(np.median(v))) for n, v in by_size.items()]
        if len(medians) >= 2:
            a, b = fit_line(medians)
        elif medians:
            n, s = medians[0]
            a, b = s * FIXED_PRIOR, s * (1 - FIXED_PRIOR) / n
        else:
            a, b = FIXED_PRIOR, 1 - FIXED_PRIOR
        return a + b * tokens

    def choose(self, confidence, others: int = 0) -> tuple:
        """(L, expected gain over plain decoding with the draft's time counted)."""
        L, expected, costs = best_width(confidence, lambda n: self.cost(others + n))
        if self.probe and len(confidence):
            L, self.probe = max(L, 1), False
        return L, expected[L] / (costs[L] + (self.draft or 0.0)) * costs[0]

    def measuring_plain(self) -> bool:
        """Whether the next pass must be plain, to measure what every choice is held to
        (the proposer need not run)."""
        return sum(plain for _, _, plain in self.passes) < PLAIN_SAMPLES

    def allowed(self) -> bool:
        """Whether this step drafts (a pause counts down one step per call)."""
        if self.pause > 0:
            self.pause -= 1
            self.probe = self.pause == 0
            return False
        return True

    def judge(self, gain: float) -> None:
        """After a drafting step with expected ``gain``: pause when it is below 1."""
        if gain >= 1.0:
            self.backoff = 1
        else:
            self.pause = self.backoff
            self.backoff = min(2 * self.backoff, MAX_PAUSE)


def best_width(confidence, cost) -> tuple:
    """(L, E, C): the number of proposals L (0 .. len(confidence)) whose expected committed
    tokens E[L] per second of the pass feeding them, C[L] = cost(L + 1), is highest;
    E[L] = sum_{i<=L} a_i, a_0 = 1, a_i the product of the first i confidences."""
    a = np.concatenate([[1.0], np.cumprod(np.asarray(confidence, np.float64))])
    expected = np.cumsum(a)
    costs = np.array([cost(L + 1) for L in range(a.size)], np.float64)
    return int(np.argmax(expected / costs)), expected, costs


def acceptance_for(mean: float, cap: int) -> float:
    """The per-proposal chance a at which verifying all ``cap`` proposals commits ``mean``
    tokens per pass on average, (1 - a^(cap + 1)) / (1 - a) = mean: how a published mean
    accepted length turns into a confidence for modelling."""
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(200):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if (1 - a ** (cap + 1)) / (1 - a) < mean else (lo, a)
    return (lo + hi) / 2


class Drafting:
    """A run's drafting: the proposer, the most proposals a pass verifies, and what the
    run's sequences share: the cost model (``Width``) and the counters (``SpecStats``)."""

    def __init__(self, proposer, cap: int, on_dump=None):
        self.proposer, self.cap, self.on_dump = proposer, cap, on_dump
        self.width = Width(cap)
        self.stats = SpecStats(cap)

    def speculator(self) -> "Speculator":
        return Speculator(self.proposer, self.cap, self.width, self.stats, self.on_dump)


class Speculator:
    """One sequence's drafting around the passes its caller runs: ``plan`` before a
    decode pass (the Segment to run), ``accept`` and ``commit`` after it.

    ``proposer``: ``propose(state, anchor, n, pick) -> Proposal`` and ``observe(state,
    taps)`` (the committed positions' taps, for a draft that reads them; None rows when
    the pass captured none). ``width``: a shared ``Width`` (the cost of a pass is the
    machine's, not the sequence's); ``stats``: a shared ``SpecStats``; ``on_dump``:
    called with each verify's arrays when --draft-dump is on."""

    def __init__(self, proposer, cap: int, width: Width, stats: SpecStats, on_dump=None):
        self.proposer, self.cap, self.width, self.stats = proposer, cap, width, stats
        self.on_dump = on_dump
        self.drafts: list = []
        self.dump = None
        self.accepted, self.proposed = 0.0, 0.0   # decayed counts (no confidence head)

    def observe(self, state, taps) -> None:
        """A prefill pass fed the sequence: the proposer sees its taps."""
        self.proposer.observe(state, taps)

    def plan(self, state, anchor: int, room: int, stop_ids, pick, tag=None,
             others: int = 0) -> Segment:
        """The decode Segment for ``anchor`` at position state.pos: [anchor] plus the
        proposals chosen to verify. ``room``: tokens still allowed after the anchor;
        ``pick(logits, position, fed, pending)``: the sampler (``Sampler.__call__``);
        ``others``: tokens the rest of the pass feeds (lockstep). Proposals end at the
        first stop id."""
        self.drafts, self.dump = [], None
        n = min(self.cap, room)
        if n > 0 and anchor not in stop_ids and not self.width.measuring_plain() \
                and self.width.allowed():
            t0 = time.perf_counter()
            prop = self.proposer.propose(state, anchor, n, pick)
            spent = time.perf_counter() - t0
            self.stats.draft_seconds += spent
            self.width.record_draft(spent)
            if prop.tokens:
                if prop.confidence is None:
                    rate = (self.accepted + 1) / (self.proposed + 2)
                    conf = np.full(len(prop.tokens), rate)
                else:
                    conf = np.asarray(prop.confidence[:len(prop.tokens)], np.float64)
                L, gain = self.width.choose(conf, others)
                self.width.judge(gain)
                drafts = [int(t) for t in prop.tokens[:L]]
                stop_at = next((j for j, d in enumerate(drafts) if d in stop_ids), None)
                self.drafts = drafts if stop_at is None else drafts[:stop_at + 1]
                self.dump = prop.dump if self.drafts else None
        return Segment([anchor] + self.drafts, state, all_logits=True, phase="decode",
                       tag=tag, verify=bool(self.drafts))

    def accept(self, seg: Segment, logits: np.ndarray, pick) -> list:
        """The proposals that equal the sampler's pick from the verify rows, in order, up
        to the first that does not (row i's pick is at position state.pos + i + 1, after
        the state's ids, the anchor and the first i proposals)."""
        p = seg.state.pos                  # a verify pass leaves the state at the anchor
        block = [int(t) for t in seg.ids]          # [anchor, d_1, ...]
        out = []
        for i, d in enumerate(self.drafts):
            if pick(logits[i], p + i + 1, seg.state.ids, block[:i + 1]) != d:
                break
            out.append(d)
        if self.on_dump is not None and self.dump is not None:
            self.on_dump(dict(self.dump, block=np.asarray(seg.ids), taps=seg.taps,
                              verify_logits=logits, accepted=len(out)))
        return out

    def commit(self, seg: Segment, kept: int, seconds: float) -> None:
        """Make the state hold the anchor and the first ``kept`` proposals; the draft sees
        their taps; the pass's ``seconds`` go to the stats (and to ``Width`` via the
        caller, who knows the whole pass)."""
        if seg.verify:
            commit(seg, kept + 1)
        taps = None if seg.taps is None else seg.taps[:kept + 1]
        self.proposer.observe(seg.state, taps)
        st = self.stats
        st.passes += 1
        st.pass_seconds += seconds
        st.committed[kept + 1] += 1
        if self.drafts:
            st.verifies += 1
            st.drafted += len(self.drafts)
            st.accepted += kept
            self.accepted = RATE_MEMORY * self.accepted + kept
            self.proposed = RATE_MEMORY * self.proposed + len(self.drafts)
        self.drafts = []
