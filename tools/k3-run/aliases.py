"""k3-run's command line before a mode parses it: which mode runs, the old one-command
spellings of the modes, -m MODEL, and the options of other modes (docs/run.md "Modes").

Owns: ``split``, which turns what the user typed into (mode, its arguments): a mode's name
first (``k3-run batch ...``), else the old spellings (``--batch FILE``, ``--chat``/``-i``/
``-cnv``/``--conversation``, ``--serve [[HOST:]PORT]``, ``--perplexity TEXT``; none: the
prompt mode), and ``-m MODEL`` as the MODEL argument; and ``add_foreign``, which gives each
mode the other modes' options as hidden ones that refuse with where they belong (one
line, exit 2). Does not own: the modes or their options (``modes``, ``options``).

Why here and not in each mode: the old spellings and -m change which word is which
argument, so they are settled once, before click binds arguments; an option of another
mode must be refused by its name, not read as a short option with a value (``-np 2`` as
``-n p``, ``-sys`` as ``-s ys``).
"""

from __future__ import annotations

import os

import click

DEFAULT = "prompt"
OLD_FLAGS = {"--batch": "batch", "--perplexity": "perplexity", "--serve": "serve",
             "--chat": "chat", "-i": "chat", "-cnv": "chat", "--conversation": "chat"}
_MODEL = ("-m", "--model")

# Where an option of each mode goes, in its old spelling and its new one.
ANCHOR = {"prompt": "one prompt", "batch": "--batch", "chat": "--chat",
          "serve": "--serve", "perplexity": "--perplexity"}
SHOWN = {"prompt": "k3-run MODEL PROMPT", "batch": "k3-run batch", "chat": "k3-run chat",
         "serve": "k3-run serve", "perplexity": "k3-run perplexity"}


def split(args: list, commands: dict) -> tuple:
    """(mode, name shown in messages: the mode's when typed, else ``""``, the mode's
    arguments). click.UsageError for two modes or two models."""
    if args and args[0] in commands:
        return args[0], args[0], _model_first(list(args[1:]), commands)
    mode, value, rest = _old_spelling(list(args), commands)
    rest = _model_first(rest, commands)
    if value is not None:           # the mode's argument comes after MODEL
        rest += [value] if value == "-" or not value.startswith("-") or "--" in rest \
            else ["--", value]
    return mode, "", rest


def _option_words(commands: dict) -> tuple:
    """Option strings of any mode (and the old mode flags): all of them, those that take
    a value, those whose value is optional."""
    known, need, optional = set(OLD_FLAGS), {"--batch", "--perplexity"}, {"--serve"}
    for cmd in commands.values():
        for p in cmd.params:
            if isinstance(p, click.Option):
                known.update(p.opts)
                if not p.is_flag and not p.count:
                    (optional if getattr(p, "_flag_needs_value", False) else need).update(
                        p.opts)
    return known, need, optional


def _tokens(args: list, commands: dict):
    """(option string or None, value or None, the words) for each option with its value,
    or positional word, in order: click's own reading of the words."""
    known, need, optional = _option_words(commands)
    i = 0
    while i < len(args):
        t = args[i]
        if t == "--":
            yield "--", None, args[i:i + 1]
            for rest in args[i + 1:]:
                yield None, rest, [rest]
            return
        if t.startswith("--") and "=" in t:
            name, value = t.split("=", 1)
            yield name, value, [t]
        elif t in need or (t in optional and i + 1 < len(args)
                           and not (args[i + 1][:1] == "-" and len(args[i + 1]) > 1)):
            yield t, args[i + 1] if i + 1 < len(args) else None, args[i:i + 2]
            i += 1
        elif t not in known and t[:1] == "-" and len(t) > 2 and t[1] != "-" \
                and t[:2] in need:
            yield t[:2], t[2:], [t]                 # -n5: a short option and its value
        elif t[:1] == "-" and len(t) > 1:
            yield t, None, [t]
        else:
            yield None, t, [t]
        i += 1


def _old_spelling(args: list, commands: dict) -> tuple:
    """(mode, its argument or None, the other words) of the one-command spelling."""
    found, value, rest = [], None, []
    for name, val, words in _tokens(args, commands):
        if name in OLD_FLAGS:
            found.append(name)
            value = val if name in ("--batch", "--perplexity", "--serve") else value
        else:
            rest += words
    modes = list(dict.fromkeys(OLD_FLAGS[f] for f in found))
    if len(modes) > 1:
        raise click.UsageError("give exactly one of a prompt, --batch, --chat, --serve or "
                               f"--perplexity (got {', '.join(dict.fromkeys(found))})")
    return (modes[0] if modes else DEFAULT), value, rest


def _model_first(args: list, commands: dict) -> list:
    """``-m MODEL`` as the MODEL argument: first of the positional words. A directory
    already there is the model given twice (else it is the mode's next argument, as
    llama.cpp's ``-m MODEL "Hello"``)."""
    models, rest, first = [], [], None
    for name, val, words in _tokens(args, commands):
        if name in _MODEL:
            models.append(val)
            continue
        if name is None and first is None:
            first = val
        rest += words
    if not models:
        return args
    if len(models) > 1 or (first is not None and os.path.isdir(first)):
        raise click.UsageError("give the model directory once: MODEL or -m/--model")
    if models[0] is None:
        raise click.UsageError("Option '-m' requires an argument.")
    return [models[0], *rest] if not models[0].startswith("-") else ["--", models[0], *rest]


def add_foreign(commands: dict, said: dict, lacks: dict) -> None:
    """Each mode takes the other modes' options as hidden ones that refuse: ``lacks[mode]
    [name]`` says why, else ``said[name]``, else where the option goes (``--api-key goes
    with --serve (k3-run serve)``)."""
    names = {m: {p.name for p in c.params} for m, c in commands.items()}
    for mode, cmd in commands.items():
        taken = {s for p in cmd.params for s in getattr(p, "opts", ())}
        seen = set()
        for other in commands.values():
            for p in other.params:
                if not isinstance(p, click.Option) or p.hidden or p.name in names[mode] \
                        or p.name in seen or taken & set(p.opts):
                    continue
                seen.add(p.name)
                homes = [m for m in commands if p.name in names[m]]
                why = lacks.get(mode, {}).get(p.name) or said.get(p.name) or \
                    _goes_with(p.opts, homes)
                cmd.params.append(click.Option(
                    [*p.opts, f"foreign_{p.name}"], is_flag=p.is_flag, hidden=True,
                    expose_value=False, callback=_refuse(why)))


def _goes_with(opts, homes) -> str:
    spelled = opts[0] if len(opts) == 1 else f"{', '.join(opts[:-1])} and {opts[-1]}"
    return (f"{spelled} {'goes' if len(opts) == 1 else 'go'} with "
            f"{' or '.join(ANCHOR[m] for m in homes)} ({', '.join(SHOWN[m] for m in homes)})")


def _refuse(why: str):
    def callback(ctx, param, value):
        if value is not None and value is not False:
            raise click.UsageError(why, ctx)
        return value
    return callback
