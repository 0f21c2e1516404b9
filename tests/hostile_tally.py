"""Tally the hostile suite's failures by category (the ``HOSTILE[category]`` prefix of
tests/hostile.py), for reports: ``python -m pytest tests/test_hostile_*.py -p
tests.hostile_tally``. A failure without a category is counted as ``other``."""

from __future__ import annotations

import re
from collections import Counter

_counts: Counter = Counter()


def pytest_runtest_logreport(report):
    if report.failed:
        m = re.search(r"HOSTILE\[([a-z0-9-]+)\]", str(report.longrepr))
        _counts[m.group(1) if m else "other"] += 1


def pytest_terminal_summary(terminalreporter):
    total = sum(_counts.values())
    terminalreporter.write_line(f"hostile failures by category ({total}): " + (", ".join(
        f"{k} {v}" for k, v in sorted(_counts.items())) or "none"))
