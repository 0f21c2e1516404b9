"""A click group whose main form needs no subcommand name (``k3-pack CHECKPOINT OUT``).

Owns: routing the first argument: a known subcommand name dispatches to it, anything
else goes to the group's default command. Does not own: any command's options.
"""

from __future__ import annotations

import click


class DefaultGroup(click.Group):
    """``prog ARGS`` runs the default command; ``prog SUBCOMMAND ARGS`` runs a subcommand."""

    def __init__(self, *args, default: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_command = default

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
