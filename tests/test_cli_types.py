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


def _rules_command():
    """A command with one rule of each kind, its handler printing 'ran'."""
    from k3cli import constraints as c
    from k3cli.group import Command
    from k3cli.support import handle_errors
    rules = (c.OneOf(("a", "b")), c.GoesWith(("a",), ("out",), "--a needs --out"),
             c.GoesWith(("wait",), ("a",), "--wait goes with --a"),
             c.Excludes("fast", ("slow",), "--fast excludes --slow"))

    @click.command(cls=Command)
    @click.option("--a")
    @click.option("--b")
    @click.option("--out")
    @click.option("--wait", is_flag=True)
    @click.option("--fast", is_flag=True)
    @click.option("--slow", is_flag=True)
    @click.option("--level", default=3, envvar="K3_TEST_LEVEL")
    @click.pass_context
    @handle_errors
    def cmd(ctx, **kw):
        c.check(ctx, rules)
        click.echo("ran")
    return cmd


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one of --a, --b"),
    (["--a", "1", "--b", "2", "--out", "o"], "give exactly one of --a, --b (got --a, --b)"),
    (["--a", "1"], "--a needs --out"),
    (["--b", "2", "--wait"], "--wait goes with --a"),
    (["--b", "2", "--fast", "--slow"], "--fast excludes --slow"),
])
def test_declared_option_rules_are_one_line_usage_errors(args, message):
    """Catches a rule that lets a broken combination run, or a refusal that is not the
    rule's own one-line message with exit 2."""
    from click.testing import CliRunner
    cmd = _rules_command()
    ok = CliRunner().invoke(cmd, ["--a", "1", "--out", "o", "--wait", "--fast"])
    assert ok.exit_code == 0 and ok.stdout == "ran\n"                   # control
    res = CliRunner().invoke(cmd, args)
    assert res.exit_code == 2 and "ran" not in res.stdout
    assert res.stderr.strip().endswith(message) and len(res.stderr.strip().splitlines()) == 1


def test_declared_rules_count_only_what_the_command_line_gave(monkeypatch):
    """Catches a default or an environment variable counted as given (a user who set
    K3_API_KEY for the server could then not run a prompt)."""
    from click.testing import CliRunner
    monkeypatch.setenv("K3_TEST_LEVEL", "5")
    res = CliRunner().invoke(_rules_command(), ["--b", "2"])
    assert res.exit_code == 0, res.stderr
