"""The click pieces the four front ends share.

Owns: the command and group classes every tool's entry goes through: they set up the
kernels' thread team before anything loads numba (``libk3.machine.threads``), and print
a usage error as one line with exit 2 (click prints a usage block, a hint, a blank line
and the error), and take -h for --help; the ``-t/--threads`` and ``-q/--quiet`` options;
the group whose main form needs no subcommand name (``k3-pack CHECKPOINT OUT``), and the
option types that refuse NaN, infinities and out-of-range numbers at parse time (README
"Exit codes").
Does not own: the rules themselves (a libk3 function says what a temperature or a seed
may be; ``Rule`` applies it), any command's options, or errors raised by the work
(``k3cli.support.handle_errors``).
"""

from __future__ import annotations

import math
import sys

import click


class OneLineErrors:
    """Mixin for a command or group: the thread team is prepared first (``--threads``
    may change its size before numba loads); a usage error is ``PROG: error: MESSAGE``
    on one stderr line, exit 2 (click's ``exit_code`` for usage errors)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        from libk3.errors import K3Error
        from libk3.machine import threads
        try:
            threads.prepare()
        except K3Error as e:            # a bad NUMBA_NUM_THREADS: --threads may still replace it
            if not _gives_threads(sys.argv[1:] if args is None else args):
                click.echo(f"{prog_name or self.name}: error: {e.one_line()}", err=True)
                sys.exit(e.exit_code)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:      # bare group: its help
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)    # none for an option missing its argument
            if isinstance(e, click.NoSuchOption) and ctx is not None:
                e.possibilities = close_options(e.option_name, ctx.command)
            prog = (" ".join(ctx.command_path.split()) if ctx is not None    # a mode's
                    else (prog_name or _program(self.name)))         # name may be blank
            text = " ".join(e.format_message().split())
            click.echo(f"{prog}: error: {text} (see {prog} --help)", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo(f"{prog_name or self.name}: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if type(rv) is int else 0)


def _program(name: str) -> str:
    """The tool's name as it was run (``sys.argv[0]``'s last part), else ``name``: the
    command's own is its function's (``main``)."""
    run_as = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else ""
    return run_as if run_as and not run_as.startswith("-") else name


def close_options(typed: str, command: click.Command, most: int = 4) -> list:
    """The visible options of ``command`` a user who typed ``typed`` may have meant, each
    by its first long name: those it begins (``--tempe``), those that begin it, and the
    close spellings (difflib) of every name, aliases included, so ``--tmp``, close to the
    alias ``--temp``, finds ``--temperature``."""
    import difflib
    names = {}
    for p in command.params:
        if isinstance(p, click.Option) and not p.hidden:
            long_ = next((o for o in p.opts if o.startswith("--")), p.opts[0])
            for o in p.opts + p.secondary_opts:
                names[o] = long_
    bare = typed.lstrip("-")
    found = [o for o in names if min(len(bare), len(o.lstrip("-"))) >= 3 and
             (o.lstrip("-").startswith(bare) or bare.startswith(o.lstrip("-")))]
    found += difflib.get_close_matches(typed, list(names), n=most, cutoff=0.6)
    return list(dict.fromkeys(names[o] for o in found))[:most]


def _gives_threads(args) -> bool:
    return any(a in ("-t", "--threads") or a.startswith("--threads=") for a in args)


# -h is --help in every tool (and its subcommands, whose contexts inherit the names)
HELP_NAMES = {"help_option_names": ["-h", "--help"]}


def _short_help(kwargs: dict) -> dict:
    kwargs["context_settings"] = {**HELP_NAMES, **(kwargs.get("context_settings") or {})}
    return kwargs


class Command(OneLineErrors, click.Command):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **_short_help(kwargs))


class Group(OneLineErrors, click.Group):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **_short_help(kwargs))


class DefaultGroup(Group):
    """``prog ARGS`` runs the default command; ``prog SUBCOMMAND ARGS`` runs a subcommand."""

    def __init__(self, *args, default: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_command = default

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def _set_threads(ctx, param, value):
    if value is not None:
        from libk3.machine import threads
        threads.prepare(value)
    return value


def threads_option(fn):
    """``-t/--threads N``: the kernels' team size, set before numba loads (default: the
    CPUs this process may use: its affinity mask, capped by a cgroup CPU quota)."""
    return click.option("-t", "--threads", type=click.IntRange(1, 1024), callback=_set_threads,
                        help="Threads for the kernels (default: the CPUs this process may "
                             "use, from its affinity and cgroup quota). Same output at any "
                             "count.")(fn)


def quiet_option(fn, *aliases):
    """``-q/--quiet`` (and ``aliases``): no progress (bars on a terminal, periodic lines in
    a log); the summary line and errors are still printed."""
    return click.option("-q", "--quiet", *aliases, "quiet", is_flag=True,
                        help="No progress bars or progress lines; the summary and errors "
                             "are still printed.")(fn)


class Finite(click.FloatRange):
    """A finite float, optionally within bounds (FloatRange's arguments). FloatRange alone
    accepts NaN, for which every range comparison is false, and infinity when unbounded."""

    name = "finite number"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


MAX_GB = 1e6          # README: no size option exceeds 1,000,000 GB (10^15 bytes)


def gigabytes(positive: bool = False) -> Finite:
    """A size in GB (10^9 bytes): finite, 0 (or above 0 when ``positive``) .. MAX_GB."""
    return Finite(0, MAX_GB, min_open=positive)


class Shard(click.ParamType):
    """``K/N`` -> (K, N), 1 <= K <= N (``libk3.run.batch.parse_shard``'s rule)."""

    name = "K/N"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from libk3.run.batch import parse_shard
        try:
            return parse_shard(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Width(click.ParamType):
    """A lockstep width: ``auto`` or a positive integer."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or (isinstance(value, int) and value >= 1):
            return value
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            self.fail(f"must be a positive integer or auto, got {value!r}", param, ctx)
        return n


class JsonObject(click.ParamType):
    """A JSON object given as text (``--template-kwargs``) -> dict."""

    name = "JSON object"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        import json
        try:
            doc = json.loads(value)
        except ValueError as e:
            self.fail(f"is not valid JSON ({e})", param, ctx)
        if not isinstance(doc, dict):
            self.fail("must be a JSON object", param, ctx)
        return doc


class Rule(click.ParamType):
    """A ``base`` value (click.INT, click.FLOAT, ...) that a libk3 rule accepts:
    ``problem(value)`` returns None or why the value is refused."""

    def __init__(self, base, problem, name: str):
        self.base, self.problem, self.name = base, problem, name

    def convert(self, value, param, ctx):
        rv = self.base.convert(value, param, ctx)
        why = self.problem(rv)
        if why:
            self.fail(why, param, ctx)
        return rv


class NumberList(click.ParamType):
    """Comma-separated values of ``item`` ('8,16,32'; empty items are skipped), each
    converted and range-checked by ``item``."""

    name = "list"

    def __init__(self, item):
        self.item = item

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [t.strip() for t in str(value).split(",") if t.strip()]
        if not items:
            self.fail("expected a comma-separated list of numbers", param, ctx)
        return [self.item.convert(t, param, ctx) for t in items]
