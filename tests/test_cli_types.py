"""The option types the front ends parse with (tools/k3cli/group.py): what each accepts,
and that a refusal is click's usage error (one line, exit 2, through OneLineErrors)."""

from __future__ import annotations

import click
import pytest

from k3cli.group import JsonObject, Shard, Width


@pytest.mark.parametrize("kind, text, want", [
    (Shard(), "2/8", (2, 8)), (Shard(), "1/1", (1, 1)),
    (Width(), "auto", "auto"), (Width(), "3", 3),
    (JsonObject(), '{"thinking": false}', {"thinking": False}),
])
def test_option_types_accept(kind, text, want):
    assert kind.convert(text, None, None) == want


@pytest.mark.parametrize("kind, text", [
    (Shard(), "3/2"), (Shard(), "0/2"), (Shard(), "2"), (Shard(), "a/b"),
    (Width(), "0"), (Width(), "-1"), (Width(), "two"), (Width(), "1.5"),
    (JsonObject(), "[1]"), (JsonObject(), "{"), (JsonObject(), '"x"'),
])
def test_option_types_refuse_as_usage_errors(kind, text):
    """Catches a type that lets a bad value through to the run (or fails with a traceback)."""
    with pytest.raises(click.BadParameter):
        kind.convert(text, None, None)
