"""k3-run's option callbacks: each turns one option's text into its value, or a one-line
usage error naming the option.

Owns: the order budget flags were given in, --system's @FILE, the UTF-8 check of text options, --stop, --logit-bias and
--response-format parsing, and the checks of the last two against the model and the
library before any work. Does not own: the rules themselves (``libk3.engine.settings``,
``libk3.constrain.grammar``) or which options go together (``modes.RULES``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from libk3.config import MAX_SIZE
from libk3.engine.settings import logit_bias_pairs, logit_bias_problem, stop_strings_problem
from libk3.text.encodable import text_problem


def system_text(ctx, param, value):
    """--system TEXT, or @FILE: the file's text (UTF-8, final newlines dropped); a leading
    @@ stands for a literal @. Empty: no system message."""
    if value is not None and value.startswith("@") and not value.startswith("@@"):
        from libk3.errors import K3Error
        from libk3.io.bounded import read_bounded
        from libk3.text.chat_template import DEFAULT_LIMITS
        try:      # no longer than a rendering may be (--template-max-bytes' default)
            value = read_bounded(value[1:], DEFAULT_LIMITS.max_bytes, "the system file")
            value = value.decode("utf-8").rstrip("\r\n")
        except (K3Error, UnicodeDecodeError) as e:
            raise click.BadParameter(e.one_line() if isinstance(e, K3Error)
                                     else f"{value[1:]}: {e}") from None
    elif value is not None and value.startswith("@@"):
        value = value[1:]
    return value or None


def encodable(ctx, param, value):
    """An option's text (each of a repeated option's), refused when UTF-8 cannot encode
    it: bytes the shell passed that are not UTF-8 arrive as lone surrogates."""
    for item in value if isinstance(value, tuple) else (value,):
        why = text_problem(item, "the value")
        if why:
            raise click.BadParameter(why)
    return value


def stop_strings(ctx, param, value):
    """--stop values: encodable (``encodable``) and not empty (one would match at once)."""
    why = stop_strings_problem(encodable(ctx, param, value))
    if why:
        raise click.BadParameter(why)
    return value


def logit_bias(ctx, param, value):
    """--logit-bias ID=BIAS values as (id, bias) pairs sorted by id: an id twice, a bias
    outside [-100, 100] or over 300 ids refused here; the ids are checked against the
    model's vocabulary once its config is read (``check_logit_bias``)."""
    pairs = []
    for item in value:
        tid, sep, bias = item.partition("=")
        try:
            if not sep or not (tid.strip().isascii() and tid.strip().isdigit()):
                raise ValueError
            pairs.append((int(tid), float(bias)))
        except ValueError:
            raise click.BadParameter(f"expected ID=BIAS, a token id and a number (e.g. "
                                     f"1234=-100), got {item[:40]!r}") from None
    why = logit_bias_problem(pairs, MAX_SIZE)
    if why:
        raise click.BadParameter(why)
    return logit_bias_pairs(pairs)


def check_logit_bias(model, pairs) -> None:
    """--logit-bias ids against the model's vocabulary (its config.json), before any work
    (UsageError, exit 2, naming the id)."""
    if pairs:
        from libk3.config import load_config
        from libk3.errors import UsageError
        why = logit_bias_problem(pairs, load_config(model).vocab_size)
        if why:
            raise UsageError(f"--logit-bias: {why}")


SCHEMA_FILE_BYTES = 1_048_576      # a --response-format @FILE read at most


def response_format(ctx, param, value):
    """--response-format json_object, or @SCHEMA.json (a JSON schema file): OpenAI's
    response_format object; the file's JSON is read here (a bad one names the file), the
    schema is checked by the library before any work (``check_response_format``)."""
    if value is None:
        return None
    if value == "json_object":
        return {"type": "json_object"}
    if not value.startswith("@") or len(value) < 2:
        raise click.BadParameter("expected json_object or @SCHEMA.json (a JSON schema file)")
    path = value[1:]
    from libk3.errors import K3Error
    from libk3.io.bounded import read_bounded
    try:          # a schema file: its schema's bound, with room for indentation
        schema = json.loads(read_bounded(path, SCHEMA_FILE_BYTES, "the schema file")
                            .decode("utf-8"))
    except K3Error as e:
        raise click.BadParameter(e.one_line()) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise click.BadParameter(f"{path}: not a JSON file ({str(e)[:80]})") from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{path}: a JSON schema must be an object")
    return {"type": "json_schema",
            "json_schema": {"name": Path(path).stem, "schema": schema, "strict": True},
            "file": path}


def check_response_format(fmt) -> None:
    """--response-format's schema against the library, before any work (UsageError, exit
    2, naming the file; also when the ``structured`` extra is missing)."""
    if fmt is not None:
        from libk3.constrain.grammar import response_format_problem
        from libk3.errors import UsageError
        fmt = dict(fmt)
        where = fmt.pop("file", None)
        why = response_format_problem(fmt)
        if why:
            raise UsageError(f"--response-format {where or fmt['type']}: {why}")
    return fmt


def note_order(ctx, param, value):
    """Record budget flags in argv order: a later flag overrides an earlier one."""
    if value is not None:
        ctx.meta.setdefault("k3_budget_order", []).append(param.name)
    return value
