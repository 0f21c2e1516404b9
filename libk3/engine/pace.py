"""How long the rest of a batch run will take, from this run's own forward passes.

Owns: the cost model of one pass (seconds = a + b * tokens fed, fitted to this run's
recent passes) and the finish time of sequences sharing passes, simulated pass by pass
the way ``lockstep.plan_pass`` fills them. Does not own: whether a prompt is admitted
(``batch_sink``), the passes themselves (``lockstep``, ``generate``).

Why a fit and not one s/token: a pass that carries a newcomer's prefill chunk costs
several decode passes, and a wider pass costs more than a narrow one; both show in the
token count, and the fit learns from the passes this run made, on this machine, under
whatever else it is running.
"""

from __future__ import annotations

import collections
import dataclasses
import math

WINDOW = 64              # recent passes the fit uses: the machine's load can change
WARMUP = 1               # a run's first passes, left out: they touch cold weights
FIXED_SHARE = 0.5        # until two sizes of pass are seen: this share of a pass is fixed
SAFETY = 1.15            # an estimate is stretched by this before it is trusted


@dataclasses.dataclass
class Work:
    """What one sequence still has to do: prompt tokens to feed, tokens to generate."""

    prompt_left: int
    gen_left: int


class Pace:
    """Passes seen so far (``record``); ``seconds`` of a pass of n tokens; ``finish``."""

    def __init__(self):
        self.passes = collections.deque(maxlen=WINDOW)
        self.seen = 0

    def record(self, tokens: int, seconds: float) -> None:
        self.seen += 1
        if tokens > 0 and self.seen > WARMUP:
            self.passes.append((tokens, seconds))

    @property
    def measured(self) -> bool:
        return len(self.passes) >= 2

    def _fit(self) -> tuple:
        n = len(self.passes)
        xs = [t for t, _ in self.passes]
        ys = [s for _, s in self.passes]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:              # one size of pass seen: part fixed, part per token
            return my * FIXED_SHARE, my * (1 - FIXED_SHARE) / mx
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        a = my - b * mx
        if b < 0:
            return my, 0.0
        if a < 0:
            return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        return a, b

    def seconds(self, tokens: int) -> float:
        """Expected seconds of a pass that feeds ``tokens`` tokens (needs ``measured``)."""
        a, b = self._fit()
        return a + b * tokens

    def finish(self, works: list, chunk: int) -> float:
        """Seconds until every sequence of ``works`` (in slot order, sharing passes as in
        lockstep: ``chunk`` prompt tokens in all per pass, one token per decoding
        sequence) has generated its last token, stretched by SAFETY."""
        a, b = self._fit()
        left = [dataclasses.replace(w) for w in works]
        total = 0.0
        while True:
            left = [w for w in left if w.prompt_left > 0 or w.gen_left > 0]
            if not left:
                return total * SAFETY
            room, tokens = chunk, 0
            for w in left:
                if w.prompt_left > 0:
                    n = min(room, w.prompt_left)
                    room -= n
                    tokens += n
                    w.prompt_left -= n
                    if w.prompt_left == 0 and n:
                        w.gen_left -= 1           # the last chunk's logits give token 1
                else:
                    tokens += 1
                    w.gen_left -= 1
            total += a + b * tokens


def passes_alone(prompt_tokens: int, gen: int, chunk: int) -> int:
    """Passes one sequence needs by itself (for the estimate a message states)."""
    return math.ceil(prompt_tokens / chunk) + max(0, gen - 1)
