"""Byte counts written for people: the one place k3 picks a size's unit and decimals.

Owns: sizes in messages, reports and tables (``size_text``, ``size_texts``: GB, MB, KB =
10^9, 10^6, 10^3 bytes, as every k3 option and document counts them, else bytes) and a
byte count written as a ``--*-gb`` option value (``gb_option``). Does not own: parsing
options (``k3cli.group``), speeds, or what a size means.

Why several sizes at once: a message that compares sizes ("budget 1.05 MB is below
1.31 MB") must never print two different ones the same, so their decimals grow together
until each differing pair reads differently. Why the unit a size reaches rather than one
fixed unit: in GB every size of a small model reads 0.00.
"""

from __future__ import annotations

GB, MB, KB = 10**9, 10**6, 10**3
DECIMALS = 2                    # the fewest decimals a size above a KB is written with
_UNITS = (("KB", KB), ("MB", MB), ("GB", GB))       # smallest first


def size_text(n) -> str:
    """One byte count in the largest unit it reaches, e.g. ``227.36 KB``, ``512 B``."""
    return size_texts(n)[0]


def size_texts(*sizes) -> list:
    """Byte counts (rounded to whole bytes), each in the largest unit it reaches, with
    DECIMALS decimals or more: as many as it takes for counts that differ to read
    differently (at most the unit's exact digits, so the loop always ends)."""
    sizes = [int(round(n)) for n in sizes]
    distinct = len(set(sizes))
    for decimals in range(DECIMALS, 10):
        texts = [_text(n, decimals) for n in sizes]
        if len(set(texts)) == distinct:
            break
    return texts


def _text(n: int, decimals: int) -> str:
    if abs(n) < KB:
        return f"{n:,} B"
    for i, (unit, scale) in enumerate(_UNITS):
        places = min(decimals, len(str(scale)) - 1)      # beyond that, digits are bytes
        text = f"{n / scale:,.{places}f}"
        # 999,999 B rounds to 1,000.00 KB: the next unit says it better
        if abs(float(text.replace(",", ""))) < 1000 or i == len(_UNITS) - 1:
            return f"{text} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def gb_option(n: int) -> str:
    """A byte count as a ``--*-gb`` option value, exact to the byte and never in exponent
    form (a hint rounded down would name a budget still below the floor)."""
    n = int(n)
    whole, frac = divmod(abs(n), GB)
    text = f"{whole}.{frac:09d}".rstrip("0").rstrip(".")
    return f"-{text}" if n < 0 else text


def unit_of(*sizes) -> tuple:
    """(name, bytes) of the largest unit the largest size reaches: one unit for a column
    of numbers, e.g. ("MB", 10**6); ("B", 1) when every size is under a KB."""
    top = max((abs(int(round(n))) for n in sizes), default=0)
    reached = [(unit, scale) for unit, scale in _UNITS if top >= scale]
    return reached[-1] if reached else ("B", 1)
