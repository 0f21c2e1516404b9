"""How long the rest of a batch run will take, from this run's own forward passes.

Owns: the cost model of one pass (a fixed part, a part per decoding sequence and a part
per prompt token, fitted to this run's recent passes and stretched by how far they strayed
from the fit) and the finish time of sequences sharing passes, simulated pass by pass
the way ``core.plan_pass`` fills them. Does not own: whether a prompt is admitted
(``batch_sink``), the passes themselves (``core``).

Why a fit and not one s/token: a pass that carries a newcomer's prefill chunk costs
several decode passes, and a wider pass costs more than a narrow one; the fit learns both
from the passes this run made, on this machine, under whatever else it is running.
"""

from __future__ import annotations

import collections
import dataclasses

WINDOW = 64              # recent passes the fit uses: the machine's load can change
WARMUP = 1               # a run's first passes, left out: they touch cold weights
FIXED_SHARE = 0.5        # until two sizes of pass are seen: this share of a pass is fixed
SAFETY = 1.15            # an estimate is stretched at least this much before it is trusted


@dataclasses.dataclass
class Work:
    """What one sequence still has to do: prompt tokens to feed, tokens to generate."""

    prompt_left: int
    gen_left: int


class Pace:
    """Passes seen so far (``record``); ``finish``: when sequences sharing passes end."""

    def __init__(self):
        self.passes = collections.deque(maxlen=WINDOW)
        self.seen = 0
        self.warm = []           # the warm-up passes: an estimate's last resort

    def record(self, prompt_tokens: int, decoders: int, seconds: float) -> None:
        """One pass: the prompt tokens it fed, the sequences it decoded a token for."""
        self.seen += 1
        if prompt_tokens + decoders > 0 and self.seen > WARMUP:
            self.passes.append((prompt_tokens, decoders, seconds))
        elif prompt_tokens + decoders > 0:
            self.warm.append((prompt_tokens, decoders, seconds))

    @property
    def measured(self) -> bool:
        return len(self.passes) >= 2

    def knows(self, width: int) -> bool:
        """Whether a pass of ``width`` decoding sequences is priced from what was seen: a
        decode pass that wide, or two widths (the fit's fixed part and slope). From one
        width alone the split is a guess (``FIXED_SHARE``), which a wider pass on a
        compute-bound machine outruns: admission widens one lane at a time until then."""
        widths = {w for p, w, _ in self.passes if p == 0}
        return len(widths) >= 2 or width in widths

    def _fit(self) -> tuple:
        """(a, b_decode, b_prompt, stretch): a pass costs a + b_decode per decoding
        sequence + b_prompt per prompt token, times ``stretch``, the 90th percentile of
        observed / modelled over the window (at least SAFETY): noise and load included.
        Before any pass past the warm-up, the warm-up passes stand in (a tick too short
        to measure still says what it would need)."""
        passes = self.passes or self.warm
        dec = [(w, s) for p, w, s in passes if p == 0]
        if len(dec) >= 2:
            a, b = fit_line(dec)
            fed = [(s - a - b * w) / p for p, w, s in passes if p > 0]
            bp = max(0.0, sorted(fed)[len(fed) // 2]) if fed else b
        else:                       # no decode passes yet: one cost per token fed
            a, b = fit_line([(p + w, s) for p, w, s in passes])
            bp = b
        ratios = sorted(s / max(a + b * w + bp * p, 1e-12) for p, w, s in passes)
        return a, b, bp, max(SAFETY, ratios[int(0.9 * (len(ratios) - 1))])

    def finish(self, works: list, chunk: int) -> float:
        """Seconds until every sequence of ``works`` (in slot order, sharing passes as in
        lockstep: ``chunk`` prompt tokens in all per pass, one token per decoding
        sequence) has generated its last token, stretched."""
        a, b, bp, stretch = self._fit()
        left = [dataclasses.replace(w) for w in works]
        total = 0.0
        while True:
            left = [w for w in left if w.prompt_left > 0 or w.gen_left > 0]
            if not left:
                return total * stretch
            room, fed, decoders = chunk, 0, 0
            for w in left:
                if w.prompt_left > 0:
                    n = min(room, w.prompt_left)
                    room -= n
                    fed += n
                    w.prompt_left -= n
                    if w.prompt_left == 0 and n:
                        w.gen_left -= 1           # the last chunk's logits give token 1
                else:
                    decoders += 1
                    w.gen_left -= 1
            total += a + b * decoders + bp * fed


def fit_line(points: list) -> tuple:
    """(a, b) >= 0 of seconds = a + b * x fitted to [(x, seconds)] by least squares; one
    size of x seen: FIXED_SHARE of it fixed, the rest per unit."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return my * FIXED_SHARE, my * (1 - FIXED_SHARE) / mx
    b = sum((x - mx) * (y - my) for x, y in points) / var
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b
