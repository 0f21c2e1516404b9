"""Sizes written for people (libk3/units.py): the unit that shows the difference, and
option values that round-trip to the byte."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libk3.units import gb_option, size_text, size_texts, unit_of

BYTES = st.integers(0, 10**16)


def test_size_text_picks_the_unit_a_size_reaches():
    """Catches every size printed in GB (0.00 GB for a small model's megabytes) and a
    size just under a unit printed as 1,000.00 of the unit below."""
    assert size_text(512) == "512 B"
    assert size_text(227_360) == "227.36 KB"
    assert size_text(3_300_000) == "3.30 MB"
    assert size_text(108_811_877_376) == "108.81 GB"
    assert size_text(999_999) == "1.00 MB"
    assert size_text(1_560_936_091_448) == "1,560.94 GB"


@given(st.lists(BYTES, min_size=2, max_size=6))
def test_size_texts_never_print_two_different_sizes_the_same(sizes):
    """Catches a comparison printed as '0.00 GB is below 0.00 GB': sizes given together
    read differently whenever they differ, and equal sizes read the same."""
    texts = size_texts(*sizes)
    for a, ta in zip(sizes, texts):
        for b, tb in zip(sizes, texts):
            assert (ta == tb) == (a == b), (a, b, ta, tb)


def test_size_texts_add_decimals_only_when_needed():
    """Catches extra decimals on sizes that already differ (control) next to the case that
    needs them."""
    assert size_texts(1_050_000, 1_310_000) == ["1.05 MB", "1.31 MB"]
    assert size_texts(1_000_100, 1_000_000) == ["1.0001 MB", "1.0000 MB"]


@given(st.integers(0, 10**15))
def test_gb_option_is_exact_to_the_byte(n):
    """Catches an option value rounded below the size it names ('raise --trunk-gb to at
    least 0.000227' for 227,360 bytes): the GB text, parsed as the --*-gb options parse
    it, gives back exactly n bytes (sizes up to the options' 1,000,000 GB)."""
    text = gb_option(n)
    assert int(round(float(text) * 10**9)) == n
    assert "e" not in text and not text.endswith(".")


def test_unit_of_a_column_is_the_one_its_largest_size_reaches():
    """Catches a table column in GB whose every entry reads 0.000 for a small model."""
    assert unit_of(16_384, 2_400_000) == ("MB", 10**6)
    assert unit_of(25.8e9, 1) == ("GB", 10**9)
    assert unit_of(300, 12) == ("B", 1)
