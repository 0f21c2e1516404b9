"""Opening a model for a run: checkpoint, tokenizer, weight provider and forward.

Owns: the one place that wires a model directory (and later a pack and budgets) into a
ready ``Forward``. Does not own: generation or output.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

from ..errors import UsageError
from ..io.checkpoint import Checkpoint
from ..io.identity import weights_identity
from ..model.forward import Forward
from ..model.state import State
from ..model.weights import ResidentWeights, StreamedWeights
from ..policies.registry import DEFAULT_POLICY
from .defaults import IO_THREADS


@dataclasses.dataclass
class Session:
    ckpt: Checkpoint
    tokenizer: object
    weights: object
    forward: Forward
    pack_source: dict | None = None    # a pack's ``source``, checked against ``ckpt``
    # the pack the trunk streams from, as the sha256 of its manifest (canonical JSON), or
    # "shards": what prefix-cache snapshots are keyed by besides the weights
    pack_identity: str = "shards"

    @property
    def cfg(self):
        return self.ckpt.config

    @functools.cached_property
    def weights_identity(self) -> str:
        """The identity of the weights this session computes with (``libk3.io.identity``),
        read on first use: what a saved state records and is checked against."""
        return weights_identity(self.ckpt, self.pack_source)

    def new_state(self) -> State:
        return State(self.cfg)


def load_tokenizer_if_present(model_dir, vocab_size=None, pack=None):
    """The model's tokenizer, read on first use (its derived form cached in the pack
    directory when there is one, else per user: ``libk3.text.tokenizer_cache``), or None
    when the directory has no tiktoken.model."""
    from ..text.tokenizer import LazyTokenizer
    from ..text.tokenizer_files import TIKTOKEN_FILE
    from ..text.tokenizer_cache import cache_path

    d = Path(model_dir)
    if not (d / TIKTOKEN_FILE).is_file():
        return None
    return LazyTokenizer(d, vocab_size, cache_path(d, pack))


@dataclasses.dataclass(frozen=True)
class Reads:
    """How a streamed session reads: expert read threads, O_DIRECT, when a pack's layer
    CRCs are checked ("first" read in this process, or "every" read), where a striped
    pack's stripes are (None: where its manifest says), each drive queue's cap in MB/s."""
    io_threads: int = IO_THREADS
    direct_io: bool = True
    verify_reads: str = "first"
    stripe_dirs: tuple | None = None
    throttle_mbps: float | None = None


def open_session(model_dir, *, ckpt=None, pack=None, trunk_bytes=None, cache_bytes=None,
                 cache_policy: str = DEFAULT_POLICY, on_route=None, reads: Reads = Reads(),
                 prefetch_experts: int | None = None) -> Session:
    """Open ``model_dir`` for a run (or use ``ckpt``, its already opened Checkpoint).
    Without budgets every weight is resident; with ``trunk_bytes`` and ``cache_bytes`` the
    trunk streams (from ``pack`` when given, else straight from the shards) and experts go
    through the cache. The arithmetic is the same either way. A pack is checked against
    the checkpoint first (``open_pack``). Every read goes through its drive's queue
    (``libk3.io.direct.FileSet``); ``reads`` says how (``Reads``).
    ``prefetch_experts`` experts per MoE layer are read ahead from a prediction (None:
    top_k; 0: none), only when the budget pins a MoE layer's trunk (the prediction needs
    its router at hand)."""
    if ckpt is None:
        ckpt = Checkpoint.open(model_dir)
    cfg = ckpt.config
    tok = load_tokenizer_if_present(model_dir, cfg.vocab_size, pack)
    pack_source, pack_identity = None, "shards"
    if trunk_bytes is None and cache_bytes is None and pack is None:
        weights = ResidentWeights(ckpt)
    else:
        from ..pack.schema import open_pack
        from ..io.direct import FileSet
        from ..stream.experts import ExpertCache
        from ..stream.trunk import runs_from_checkpoint, runs_from_pack
        from ..stream.trunk_modes import open_trunk
        if trunk_bytes is None or cache_bytes is None:
            raise UsageError("a streamed run needs both a trunk and a cache budget "
                             "(--trunk-gb and --cache-gb, or --preset)")
        if pack is not None:
            pk = open_pack(pack, ckpt, reads.stripe_dirs)
            if reads.stripe_dirs and pk.stripes is None:
                raise UsageError(f"{pack}: --stripe-dir is for a striped pack; this one is not")
            runs = runs_from_pack(pack, pk.manifest, pk.blocks)
            pack_source = pk.manifest["source"]
            pack_identity = hashlib.sha256(json.dumps(
                pk.manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        else:
            runs = runs_from_checkpoint(ckpt)
        from ..budget import plan_trunk
        files = FileSet(use_direct=reads.direct_io, throttle_mbps=reads.throttle_mbps)
        if pack is not None and pk.stripes is not None:
            from ..pack.stripes import StripedFile
            trunk_path = Path(pack) / pk.manifest["trunk_file"]
            files.register(trunk_path, StripedFile(pk.stripes, files, trunk_path))
        pinned = plan_trunk([r.held_bytes for r in runs], trunk_bytes).pinned
        ahead = cfg.num_experts_per_token if prefetch_experts is None else prefetch_experts
        cache = ExpertCache(cfg, ckpt.expert_table(), cache_bytes, files,
                            io_threads=reads.io_threads,
                            policy=cache_policy, prefetch=ahead if any(
                                not cfg.is_dense(L) for L in pinned) else 0)
        trunk = open_trunk(cfg, runs, trunk_bytes, files, verify_reads=reads.verify_reads)
        weights = StreamedWeights(ckpt, trunk, cache, files)
    return Session(ckpt, tok, weights, Forward(cfg, weights, on_route=on_route), pack_source,
                   pack_identity)


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
