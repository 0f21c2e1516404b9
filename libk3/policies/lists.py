"""An intrusive doubly-linked list over cache slots, shared by the policies that keep one.

Owns: unlinking a slot and pushing one to the front. The list lives in rows of an
``(slots, 3)`` int64 array ``sl`` (``sl[s] = [prev, next, key]``) and its head and tail
in two consecutive cells ``sc[h]``, ``sc[h + 1]`` of the owner's scalar array, so one
owner can keep a list without extra arrays. Does not own: what the list orders.
"""

from __future__ import annotations

from numba import njit

PREV, NEXT, KEY = 0, 1, 2


@njit(cache=True, nogil=True, inline='always')
def unlink(sl, sc, h, s):
    """Unlink slot s from the list whose head and tail are sc[h] and sc[h + 1]."""
    p, n = sl[s, PREV], sl[s, NEXT]
    if p >= 0:
        sl[p, NEXT] = n
    else:
        sc[h] = n
    if n >= 0:
        sl[n, PREV] = p
    else:
        sc[h + 1] = p
    sl[s, PREV] = -1
    sl[s, NEXT] = -1


@njit(cache=True, nogil=True, inline='always')
def push_front(sl, sc, h, s):
    first = sc[h]
    sl[s, PREV] = -1
    sl[s, NEXT] = first
    if first >= 0:
        sl[first, PREV] = s
    else:
        sc[h + 1] = s
    sc[h] = s
