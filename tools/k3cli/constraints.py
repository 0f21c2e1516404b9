"""Which options go together: a command's rules declared as data, checked in one place.

Owns: the three kinds of rule the front ends state (``OneOf``, ``GoesWith``,
``Excludes``) and ``check``, which applies a command's rules, in order, to what the user
gave on the command line (an option counts as given when its value came from the command
line, not from a default or the environment) and raises the first broken rule as a
one-line usage error (exit 2). Does not own: any command's rules (each front end declares
its own next to its options) or the checks of a value (option types, ``k3cli.group``).

Why declared: a list of rules reads as the command's contract, each message is written
once beside its rule, and a new option joins a rule instead of another branch in ``main``.
"""

from __future__ import annotations

import dataclasses

import click
from click.core import ParameterSource

from libk3.errors import UsageError


@dataclasses.dataclass(frozen=True)
class OneOf:
    """Exactly one of ``names`` (parameter names) is given, or none when one of
    ``or_none_with`` is (``--load-state`` alone continues a state); ``text``, when given,
    is the message."""

    names: tuple
    or_none_with: tuple = ()
    text: str | None = None

    def broken(self, given, flag) -> str | None:
        got = [n for n in self.names if n in given]
        if len(got) == 1 or (not got and any(n in given for n in self.or_none_with)):
            return None
        if self.text is not None:
            return self.text
        alone = (f" (or {' or '.join(flag(n) for n in self.or_none_with)} alone)"
                 if self.or_none_with and not got else "")
        return (f"give exactly one of {', '.join(flag(n) for n in self.names)}{alone}"
                + (f" (got {', '.join(flag(n) for n in got)})" if got else ""))


@dataclasses.dataclass(frozen=True)
class GoesWith:
    """Any of ``names`` is given only with one of ``anchors`` (also: an option that needs
    another); ``text`` says so."""

    names: tuple
    anchors: tuple
    text: str

    def broken(self, given, flag) -> str | None:
        if any(n in given for n in self.names) and not any(a in given for a in self.anchors):
            return self.text
        return None


@dataclasses.dataclass(frozen=True)
class Excludes:
    """``name``, when given, excludes every one of ``others``; ``text`` says so."""

    name: str
    others: tuple
    text: str

    def broken(self, given, flag) -> str | None:
        if self.name in given and any(o in given for o in self.others):
            return self.text
        return None


def check(ctx: click.Context, rules, given_too=()) -> None:
    """UsageError for the first of ``rules`` that the command line breaks; ``given_too``:
    names counted as given whatever the command line says (a mode's own name, for rules
    that name it as an option)."""
    given = {p.name for p in ctx.command.params
             if ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE}
    given.update(given_too)
    flags = {p.name: next((o for o in p.opts if o.startswith("--")), p.opts[0])
             if isinstance(p, click.Option) else p.make_metavar(ctx).strip("[].")
             for p in ctx.command.params if p.opts}

    def flag(name: str) -> str:
        return flags.get(name, name)
    for rule in rules:
        why = rule.broken(given, flag)
        if why:
            raise UsageError(why)
