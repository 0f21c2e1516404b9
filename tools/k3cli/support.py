"""Shared plumbing for the thin click front ends: error mapping and JSON output.

Owns: turning a K3Error (or an OS error that escaped) into one stderr line and its exit
code, and writing ``--json`` documents. Does not own: any option parsing or logic.
"""

from __future__ import annotations

import functools
import json
import sys

from libk3.errors import BudgetError, K3Error, K3IOError


def handle_errors(fn):
    """Wrap a click callback: K3Error -> 'k3-xxx: error: <one line>' on stderr and its exit
    code; when the callback has ``json_out=True`` the error is also printed as JSON on
    stdout. Never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "k3"
        try:
            return fn(*args, **kwargs)
        except K3Error as e:
            _report(prog, e, kwargs.get("json_out", False))
        except OSError as e:
            err = K3IOError(e.strerror or str(e), path=getattr(e, "filename", None))
            _report(prog, err, kwargs.get("json_out", False))
        except MemoryError:
            err = BudgetError("out of memory", hint="choose a smaller --preset or budgets")
            _report(prog, err, kwargs.get("json_out", False))
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper


def _report(prog: str, e: K3Error, json_out: bool) -> None:
    if json_out:
        print_json(e.to_json())
    print(f"{prog}: error: {e.one_line()}", file=sys.stderr)
    sys.exit(e.exit_code)


def print_json(doc) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()
