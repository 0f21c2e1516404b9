"""Brute-force cache policies for the tests: each written from its module's docstring
with sets, dicts, deques and scans, never the numba steps, so that a test comparing the
two catches a bug in either. ``request(key) -> (hit, evicted key or None)``.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from libk3.policies import adaptive, layer_lfu, s3fifo

NL, NE = 3, 4                      # hypothesis traces: keys 0..11, layer = key // 4


class LruBrute:
    def __init__(self, slots, n_layers=NL, n_experts=NE):
        self.slots, self.cache = slots, OrderedDict()

    def request(self, k):
        if k in self.cache:
            self.cache.move_to_end(k)
            return True, None
        if self.slots == 0:
            return False, None
        ev = self.cache.popitem(last=False)[0] if len(self.cache) >= self.slots else None
        self.cache[k] = True
        return False, ev

    def holds(self, k):
        return k in self.cache


class S3Brute:
    """The documented S3-FIFO rules with deques (oldest on the left)."""

    def __init__(self, slots, n_layers=NL, n_experts=NE, small=None, ghost_cap=None):
        self.slots = slots
        self.small, self.ghost_cap = s3fifo.sizes(slots)
        if small is not None:
            self.small, self.ghost_cap = small, ghost_cap
        self.S, self.M, self.G, self.freq = deque(), deque(), deque(), {}

    def request(self, k):
        S, M, G, freq = self.S, self.M, self.G, self.freq
        if k in S or k in M:
            freq[k] = min(freq[k] + 1, s3fifo.MAX_FREQ)
            return True, None
        ev = None
        while len(S) + len(M) >= self.slots:
            if len(S) >= self.small or not M:
                t = S.popleft()
                if freq[t] > 0:
                    freq[t] = 0
                    M.append(t)
                else:
                    ev = t
                    G.append(t)
                    if len(G) > self.ghost_cap:
                        G.popleft()
            else:
                t = M.popleft()
                if freq[t] > 0:
                    freq[t] -= 1
                    M.append(t)
                else:
                    ev = t
        freq[k] = 0
        if k in G:
            G.remove(k)
            M.append(k)
        else:
            S.append(k)
        return False, ev

    def holds(self, k):
        return k in self.S or k in self.M


class LfuBrute:
    """Full-history request counts; evict the resident with the fewest requests, ties to
    the oldest last visit then the smaller key, never a key of the current layer visit
    unless every resident is one (then the first of the visit's resident keys)."""

    def __init__(self, slots, n_layers=NL, n_experts=NE):
        self.slots, self.ne = slots, n_experts
        self.count, self.last_visit = {}, {}
        self.cache, self.visit_keys = set(), []
        self.cur, self.visit = None, -1

    def request(self, k):
        if k // self.ne != self.cur:
            self.cur, self.visit, self.visit_keys = k // self.ne, self.visit + 1, []
        self.count[k] = self.count.get(k, 0) + 1
        first_in_visit = self.last_visit.get(k) != self.visit
        self.last_visit[k] = self.visit
        if k in self.cache:
            if first_in_visit:
                self.visit_keys.append(k)
            return True, None
        ev = None
        if len(self.cache) >= self.slots:
            free = [x for x in self.cache if x not in self.visit_keys]
            if free:
                ev = min(free, key=lambda x: (self.count[x], self.last_visit[x], x))
            else:
                ev = self.visit_keys.pop(0)
            self.cache.discard(ev)
        self.cache.add(k)
        self.visit_keys.append(k)
        return False, ev

    def holds(self, k):
        return k in self.cache


class LayerLfuBrute:
    """The layer-lfu rule evaluated afresh at every eviction: per resident key outside
    the current visit, n_layers * (1/p - 1) + dist(layer), p from the decayed count
    scaled by the layer's clock (the same float operations as the documented formula)."""

    def __init__(self, slots, n_layers=NL, n_experts=NE, alpha=1):
        self.slots, self.ne, self.nl, self.alpha = slots, n_experts, n_layers, alpha
        self.step = 2.0 ** (1.0 / layer_lfu.HALF_LIFE_VISITS)
        self.omb = 1.0 - 1.0 / self.step
        self.g, self.scale = {}, [1.0] * n_layers
        self.cache, self.visit_keys = set(), []          # visit_keys: most recent last
        self.last_visit, self.cur, self.visit = {}, None, -1

    def request(self, k):
        L = k // self.ne
        if L != self.cur:
            self.cur, self.visit, self.visit_keys = L, self.visit + 1, []
            self.scale[L] *= self.step
        if self.last_visit.get(k) != self.visit:
            self.last_visit[k] = self.visit
            self.g[k] = self.g.get(k, 0.0) + self.scale[L]
        if k in self.cache:
            if k in self.visit_keys:
                self.visit_keys.remove(k)
            self.visit_keys.append(k)
            return True, None
        ev = None
        if len(self.cache) >= self.slots:
            ev = self._victim()
            self.cache.discard(ev)
            if ev in self.visit_keys:
                self.visit_keys.remove(ev)
        self.cache.add(k)
        self.visit_keys.append(k)
        return False, ev

    def _victim(self):
        by_layer = {}
        for x in self.cache:
            if x not in self.visit_keys:
                by_layer.setdefault(x // self.ne, []).append(x)
        if not by_layer:
            return self.visit_keys[0]
        best, arg = -np.inf, None
        order = list(range(self.cur + 1, self.nl)) + list(range(0, self.cur + 1))
        for L in order:
            if L not in by_layer:
                continue
            m = min(by_layer[L], key=lambda x: (self.g[x], x))
            score = self.nl * (self.scale[L] / (self.omb * max(self.g[m], 1e-300)) - 1.0) \
                + self.alpha * L
            if L <= self.cur:
                score += self.alpha * self.nl
            if score > best:
                best, arg = score, m
        return arg

    def holds(self, k):
        return k in self.cache


class AdaptiveBrute:
    """The adaptive rules from its docstring: four brute shadows scored per window; the
    real cache evicts the leader's victims (oldest first, skipping keys of the current
    visit), else the next key outside the visit under a clock hand, else the least
    recently requested key."""

    def __init__(self, slots, n_layers, n_experts, window, decay, margin):
        self.shadows = [cls(slots, n_layers, n_experts)
                        for cls in (LruBrute, S3Brute, LfuBrute, LayerLfuBrute)]
        self.slots, self.ne = slots, n_experts
        self.window, self.decay, self.margin = window, decay, margin
        self.leader, self.switches = adaptive.FIRST_LEADER, 0
        self.scores, self.wmiss, self.count = [0.0] * 4, [0] * 4, 0
        self.slot_of, self.key_of, self.hand = {}, [], 0
        self.ring, self.queued = deque(), set()
        self.rvisit, self.cur, self.visit = {}, None, -1
        self.last, self.n = {}, 0                        # key -> its latest request number

    def _queue(self, k):
        if len(self.ring) < self.slots:
            self.ring.append(k)
            self.queued.add(k)

    def request(self, k):
        for j, sh in enumerate(self.shadows):
            hit, ev = sh.request(k)
            if not hit:
                self.wmiss[j] += 1
                if j == self.leader and ev is not None and ev in self.slot_of \
                        and ev not in self.queued:
                    self._queue(ev)
        self.count += 1
        if self.count == self.window:
            self._end_window()
        if k // self.ne != self.cur:
            self.cur, self.visit = k // self.ne, self.visit + 1
        self.rvisit[k] = self.visit
        self.n += 1
        self.last[k] = self.n
        if k in self.slot_of:
            return True, None
        ev = None
        if len(self.key_of) < self.slots:
            s = len(self.key_of)
            self.key_of.append(k)
        else:
            ev = self._victim()
            s = self.slot_of.pop(ev)
            self.key_of[s] = k
        self.slot_of[k] = s
        return False, ev

    def _victim(self):
        leader = self.shadows[self.leader]
        for _ in range(len(self.ring)):
            c = self.ring.popleft()
            self.queued.discard(c)
            if c not in self.slot_of or leader.holds(c):
                continue
            if self.rvisit[c] != self.visit:
                return c
            self._queue(c)
        for _ in range(self.slots):
            c = self.key_of[self.hand]
            self.hand = (self.hand + 1) % self.slots
            if self.rvisit[c] != self.visit:
                return c
        return min(self.key_of, key=lambda c: self.last[c])

    def _end_window(self):
        self.scores = [s * self.decay + m for s, m in zip(self.scores, self.wmiss)]
        self.wmiss, self.count = [0] * 4, 0
        best = min(range(4), key=lambda j: (self.scores[j], j != self.leader, j))
        if best != self.leader and self.scores[best] < (1.0 - self.margin) * self.scores[self.leader]:
            self.leader, self.switches = best, self.switches + 1
            self.ring.clear()
            self.queued.clear()
            for c in self.key_of:
                if not self.shadows[best].holds(c):
                    self._queue(c)


def brute_hits(policy, keys):
    return [policy.request(int(k))[0] for k in keys]
