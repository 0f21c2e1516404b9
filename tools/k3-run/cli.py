"""k3-run: streamed inference of Kimi K3 (thin click front end over libk3.run), in modes:
``k3-run MODEL PROMPT`` (prompt, the default), ``batch``, ``chat``, ``serve`` and
``perplexity`` (docs/run.md "Modes").

Owns: the command that picks the mode (``aliases.split``: a mode's name first, else the
old one-command spellings) and runs it, and its --help listing the modes. Does not own:
the modes (``modes``) or their options (``options``).

Why a command and not a click group: the mode is often not a first word (``k3-run MODEL
--batch FILE``), so the words are read before any mode parses them, and ``k3-run``
parses and converts a whole command line in one ``make_context``, as every other tool.
"""

from __future__ import annotations

import click

from libk3 import __version__
from k3cli.group import Command

from . import aliases, modes


class Modes(Command):
    """A mode's name first runs that mode; anything else is the prompt mode or an old
    spelling of a mode (``--batch FILE``, ``--chat``, ...), shown in messages as plain
    ``k3-run``."""

    def __init__(self, *args, commands, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands = {c.name: c for c in commands}

    def parse_args(self, ctx, args):
        if args and args[0] in ("-h", "--help", "--version"):
            return super().parse_args(ctx, args)
        mode, shown, rest = aliases.split(list(args), self.commands)
        ctx.meta["k3_run.mode"] = self.commands[mode].make_context(shown, rest, parent=ctx)
        return []

    def invoke(self, ctx):
        sub = ctx.meta["k3_run.mode"]
        with sub:
            return sub.command.invoke(sub)

    def format_options(self, ctx, formatter):
        super().format_options(ctx, formatter)
        with formatter.section("Modes"):
            formatter.write_dl([(name, cmd.get_short_help_str(formatter.width - 16))
                                for name, cmd in self.commands.items()])


main = Modes("k3-run", commands=modes.MODES, help="""Run Kimi K3 (or a synthetic K3
checkpoint): on one prompt, a batch file or a chat, serve it, or score a text's
perplexity. Logits are identical at every budget.

\b
  k3-run MODEL PROMPT | -p TEXT | -f FILE | --ids IDS   one prompt
  k3-run batch MODEL PROMPTS.jsonl --out RESULTS.jsonl  a batch file
  k3-run chat MODEL                                     a chat on stdin
  k3-run serve MODEL [[HOST:]PORT]                      an OpenAI-compatible API
  k3-run perplexity MODEL TEXT                          one number for a text

`k3-run MODE --help` lists a mode's options. Every mode takes -m MODEL, the budget and
reading options (--pack, --preset, --trunk-gb, --cache-gb, --resident, -t/--threads,
-c/--ctx-size, ...) and -q/--quiet. The one-command spellings still work:
--batch FILE, --chat (-i, -cnv, --conversation), --serve [[HOST:]PORT] and
--perplexity TEXT after MODEL run that mode. A model directory named like a mode is
written as a path (./chat).""", options_metavar="[MODE]")
click.version_option(__version__, prog_name="k3-run")(main)
aliases.add_foreign(main.commands, modes.ELSEWHERE, {"perplexity": modes.PERPLEXITY_LACKS})
