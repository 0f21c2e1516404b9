"""The one error hierarchy of k3.

Owns: the exception classes and their exit codes. Does not own: printing; only the click
layer turns an error into a single stderr line (see ``k3cli.support``).

Every error carries what a user needs to act: the file, the tensor (or key), what was
expected against what was found, and where useful the next command to run.
"""

from __future__ import annotations


class K3Error(Exception):
    """Base of every error k3 raises on purpose. ``exit_code`` is documented in README."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, path=None, tensor: str | None = None,
                 expected=None, found=None, hint: str | None = None):
        self.message = message
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.expected = expected
        self.found = found
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = []
        if self.path:
            parts.append(self.path)
        if self.tensor:
            parts.append(f"tensor {self.tensor}")
        head = ": ".join(parts)
        text = f"{head}: {self.message}" if head else self.message
        if self.expected is not None or self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        if self.hint:
            text += f"; {self.hint}"
        return " ".join(text.split("\n"))

    def to_json(self) -> dict:
        return {"error": self.kind, "message": self.one_line(), "path": self.path,
                "tensor": self.tensor,
                "expected": None if self.expected is None else str(self.expected),
                "found": None if self.found is None else str(self.found),
                "hint": self.hint, "exit_code": self.exit_code}


class UsageError(K3Error):
    """Bad command-line use (conflicting or missing options)."""
    exit_code = 2
    kind = "usage"


class ConfigError(K3Error):
    """config.json is missing, malformed, incomplete or inconsistent."""
    exit_code = 3
    kind = "config"


class CheckpointError(K3Error):
    """A shard, its header or a tensor does not match what the spec and config require."""
    exit_code = 3
    kind = "checkpoint"


class FormatError(K3Error):
    """A k3 artifact (pack, index, trace, state, preset file) is malformed or stale."""
    exit_code = 3
    kind = "format"


class NonFiniteError(K3Error):
    """A layer's output became NaN or Inf: the weights (or a loaded state) hold
    non-finite values. Exit 3 like any rejected model, because that is the cause."""
    exit_code = 3
    kind = "nonfinite"


class BudgetError(K3Error):
    """The memory or disk budget cannot hold what the run needs."""
    exit_code = 4
    kind = "budget"


class BusyError(K3Error):
    """Another run holds the lock on the output this run would write (a results file)."""
    exit_code = 6
    kind = "busy"


class K3IOError(K3Error):
    """An operating-system I/O failure (read-only or full disk, vanished file)."""
    exit_code = 5
    kind = "io"
