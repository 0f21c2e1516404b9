"""Shared fixtures: the bundled tiny checkpoint and a `small` one made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory) -> Path:
    from libk3.synth.checkpoint import synth_checkpoint
    return synth_checkpoint(tmp_path_factory.mktemp("small") / "small", "small", seed=0,
                            progress=False)
