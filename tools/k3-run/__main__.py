"""``python -m k3_run``: the k3-run console script, for callers that must not look a
program up on PATH (``k3-trace record`` runs ``sys.executable -m k3_run``)."""

import sys

from .cli import main

sys.argv[0] = "k3-run"          # errors read "k3-run: error: ...", as from the script
main(prog_name="k3-run")
