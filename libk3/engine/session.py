"""Opening a model for a run: checkpoint, tokenizer, weight provider and forward.

Owns: the one place that wires a model directory (and later a pack and budgets) into a
ready ``Forward``. Does not own: generation or output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import UsageError
from ..io.checkpoint import Checkpoint
from ..model.forward import Forward
from ..model.state import State
from ..model.weights import ResidentWeights


@dataclasses.dataclass
class Session:
    ckpt: Checkpoint
    tokenizer: object
    weights: object
    forward: Forward

    @property
    def cfg(self):
        return self.ckpt.config

    def new_state(self) -> State:
        return State(self.cfg)


def load_tokenizer_if_present(model_dir):
    """The model's tokenizer, or None when the directory has no tiktoken.model."""
    d = Path(model_dir)
    if not (d / "tiktoken.model").is_file():
        return None
    from ..io.tokenizer import K3Tokenizer
    return K3Tokenizer.from_dir(d)


def open_session(model_dir, on_route=None) -> Session:
    ckpt = Checkpoint.open(model_dir)
    tok = load_tokenizer_if_present(model_dir)
    weights = ResidentWeights(ckpt)
    return Session(ckpt, tok, weights, Forward(ckpt.config, weights, on_route=on_route))


def parse_ids(text: str, vocab_size: int) -> list:
    """'1,2,3' -> [1, 2, 3], each in 0..vocab-1."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--ids is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"token ids {bad[:5]} are outside 0..{vocab_size - 1}")
    return ids
