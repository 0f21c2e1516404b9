"""Shared fixtures: the bundled tiny checkpoint and a `small` one made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tok(tiny_dir):
    """The tiny checkpoint's tokenizer."""
    from libk3.io.tokenizer import K3Tokenizer
    return K3Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def template(tiny_dir):
    """The tiny checkpoint's chat template (the synthetic one, libk3.synth.bpe)."""
    from libk3.engine.chat_template import load_chat_template
    return load_chat_template(tiny_dir)


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory) -> Path:
    from libk3.synth.checkpoint import synth_checkpoint
    return synth_checkpoint(tmp_path_factory.mktemp("small") / "small", "small", seed=0,
                            progress=False)


@pytest.fixture(scope="session", autouse=True)
def _private_user_cache(tmp_path_factory):
    """Per-user caches (the tokenizer's derived form) go to a session temp directory,
    never to the home directory of whoever runs the tests; subprocesses inherit it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run tests marked slow (they compile every numba kernel "
                          "from an empty cache: minutes each)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles every kernel from an empty cache "
                                       "(minutes); skipped unless --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (compiles every kernel): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
