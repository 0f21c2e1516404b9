"""llama.cpp's command-line names on k3-run: the ones that have no meaning here, and
llama-server's --host/--port.

Owns: the table of llama.cpp flags k3-run refuses, each with the reason a llama.cpp user
needs (added as hidden options, so ``-ngl 99`` is refused by name instead of being read
as ``-n gl``), and the --serve address built from --serve, --host and --port. Does not
own: the aliases with the same meaning (each is a second name on its k3 option in
``options.py``, so ``--help`` lists it beside the k3 name; docs/run.md has the table).
"""

from __future__ import annotations

import click

from libk3.errors import UsageError

DEFAULT_PORT = 8080          # llama-server's
DEFAULT_HOST = "127.0.0.1"   # llama-server's, and k3's: another address needs --api-key

_NO_GPU = "k3 runs on the CPU only: there is no GPU to offload layers to or split across"
_VALUE, _FLAG, _OPTIONAL = "value", "flag", "optional value"

# (names, what follows the flag, why k3-run has no such setting)
REFUSED = (
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), _VALUE,
     _NO_GPU + " (memory is set by --preset, --trunk-gb and --cache-gb)"),
    (("-sm", "--split-mode"), _VALUE, _NO_GPU),
    (("-ts", "--tensor-split"), _VALUE, _NO_GPU),
    (("-mg", "--main-gpu"), _VALUE, _NO_GPU),
    (("-fa", "--flash-attn"), _OPTIONAL,
     "k3 has one attention kernel, which gives the same bytes at every budget and thread "
     "count: there is nothing to switch"),
    (("--mlock",), _FLAG,
     "k3 streams the weights within its budgets; --resident holds every weight in RAM"),
    (("--no-mmap",), _FLAG,
     "k3 never maps the model, it reads it within its budgets (--buffered-io: without "
     "O_DIRECT)"),
    (("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), _VALUE,
     "k3's attention state has one type, so the logits are the same at every budget: "
     "there is no cache type to choose"),
    (("-b", "--batch-size", "-ub", "--ubatch-size"), _VALUE,
     "k3 sizes its prompt passes itself; --prefill-chunk N sets the prompt tokens per pass"),
)


def _refuse(names: tuple, why: str):
    def callback(ctx, param, value):
        if value is not None and value is not False:
            raise click.UsageError(f"{'/'.join(names)} (llama.cpp's) has no meaning here: "
                                   f"{why}", ctx)
        return value
    return callback


def refused_options(fn):
    """``fn`` with every flag of ``REFUSED`` as a hidden option that, when given, is a
    usage error (exit 2) saying why."""
    for names, takes, why in reversed(REFUSED):
        kind = dict(is_flag=True) if takes == _FLAG else \
            dict(is_flag=False, flag_value="on") if takes == _OPTIONAL else {}
        fn = click.option(*names, f"llama_{names[-1].lstrip('-').replace('-', '_')}",
                          hidden=True, expose_value=False, callback=_refuse(names, why),
                          **kind)(fn)
    return fn


def serve_address(serve: str | None, host: str | None, port: int | None) -> str | None:
    """The ``[HOST:]PORT`` to serve on: --serve's value, or --host and --port (llama-
    server's, defaults 127.0.0.1 and 8080) when --serve is given without one (``""``);
    None without --serve. UsageError when --serve has an address and --host or --port
    gives another."""
    if serve is None:
        return None
    if serve:
        if host is not None or port is not None:
            raise UsageError("give the address once: --serve [HOST:]PORT, or --serve with "
                             "--host and --port")
        return serve
    host = host or DEFAULT_HOST
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{shown}:{DEFAULT_PORT if port is None else port}"
