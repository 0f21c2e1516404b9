"""The DSpark draft's checkpoint, checked strictly and read into RAM (or streamed).

Owns: finding a draft's shards (one ``model.safetensors``, or ``model.safetensors.index.json``
and the shards it names: dspark.md §3.2), checking every tensor against the inventory the
draft's config implies (names, shapes, dtypes: dspark.md §3.1) after the config has been
checked against the target (dspark.md §2.3), and reading every tensor but the embedding
copy into preallocated arrays with positioned reads, or, when the draft does not fit
beside the budget, holding its vectors and Markov head and reading each other matrix at
its use (``StreamedWeights``). Does not own: the container format
(``libk3.io.safetensors``, whose header parser refuses a tensor running past the end of
its file), the config and its inventory (``libk3.draft.config``), any arithmetic.

Why everything is checked before anything is read: a draft with a renamed, reshaped or
retyped tensor loads in lenient readers and then only accepts nothing (dspark.md §8);
here it is one error naming the file and the tensor.

Why the embedding copy is not read: k3 looks up the target's embedding rows, the same
values (dspark.md §3.1, §5.2). The copy is checked like every tensor (name, shape, dtype,
its bytes inside its file) and left on disk.

What ``DraftCheckpoint.weights`` holds, by bare name:

* 2-D BF16 matrices as uint16 arrays of the raw BF16 bits, the form the dense kernels
  take (``dtypes.matrix_operand``, as ``Checkpoint.read_matrix`` gives the target's);
* 1-D vectors (every norm gain, the confidence bias) widened to float32;
* the confidence head's weight widened to float32 in its stored 2-D shape [1, E + R]
  (it may be stored BF16 or F32, dspark.md §3.1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import K3Config
from ..errors import CheckpointError, K3IOError
from ..io.shards import INDEX_FILE, find_shards
from ..io.identity import digest_of, file_digest
from ..io.dtypes import matrix_operand, widen
from ..io.safetensors import pread_into, read_header
from .config import DraftConfig, load_draft_config

DRAFT_FILE = "model.safetensors"
PREFIX = "model."                    # the one prefix a draft's names may all carry
EMBED = "embed_tokens.weight"
CONFIDENCE_WEIGHT = "confidence_head.proj.weight"
# The two tensors whose stored dtype the published files leave open (dspark.md §3.1).
EITHER_FLOAT = {CONFIDENCE_WEIGHT: ("BF16", "F32"), "confidence_head.proj.bias": ("BF16", "F32")}
_SHOW = 5                            # how many offending names an error message lists


# Held even when the draft streams: the Markov head is used once per proposal, seven
# times a pass; everything else is used once or twice a pass.
ALWAYS_HELD = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


class DraftCheckpoint(NamedTuple):
    """A loaded draft: its config, its weights (every tensor but ``embed_tokens.weight``,
    by bare name, in the forms of the module docstring; a ``StreamedWeights`` when it
    streams), the draft directory, and the most bytes its weights hold in RAM at once:
    ``nbytes`` when every tensor is held, ``streamed_nbytes`` when the matrices are read
    at each use."""

    cfg: DraftConfig
    weights: object
    source: str
    nbytes: int
    streamed_nbytes: int
    streamed: bool = False
    identity: str = ""          # ``draft_identity``: what a saved draft context records


class StreamedWeights(dict):
    """The draft's weights when they do not fit beside the model: vectors and
    ALWAYS_HELD held (the dict's items); every other matrix read from the draft's files
    with a positioned read at each use (``__missing__``: a new array, not kept), so at
    most one is in RAM at a time. ``entry(name)``: where a streamed tensor lies, for
    checking its shape and dtype without reading it."""

    def __init__(self, held: dict, table: dict):
        super().__init__(held)
        self._table = {n: e for n, e in table.items() if n not in held and n != EMBED}

    def entry(self, name: str):
        return self._table.get(name)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self._table

    def __missing__(self, name: str) -> np.ndarray:
        ent = self._table[name]
        fd = _open(ent.path)
        try:
            raw = pread_into(fd, ent.offset, np.empty(ent.nbytes, np.uint8),
                             path=ent.path, tensor=ent.name)
        finally:
            os.close(fd)
        return matrix_operand(raw, ent.dtype, ent.shape)


def load_draft(path, target_cfg: K3Config, read: bool = True,
               stream: bool = False) -> DraftCheckpoint:
    """Check the draft directory ``path`` against ``target_cfg`` and read it (with
    ``read`` False: check only, ``weights`` empty; with ``stream``: read what
    ``StreamedWeights`` holds, the rest at each use).

    ConfigError for its config.json (unreadable, incomplete, or made for another
    target); CheckpointError naming the file and the tensor for its shards."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError("draft directory not found", path=d,
                              hint="pass the directory holding the draft's config.json "
                                   f"and {DRAFT_FILE}")
    cfg = load_draft_config(d)
    cfg.check_against(target_cfg)
    listing, table = _index(d)
    _check_inventory(cfg, table, listing)
    streamed = {n: e for n, e in table.items() if _as_matrix(n, e) and n not in ALWAYS_HELD}
    held = {n: e for n, e in table.items() if n not in streamed}
    largest = max((e.nbytes for e in streamed.values()), default=0)
    weights = {}
    if read:
        weights = StreamedWeights(_read(held), table) if stream else _read(table)
    return DraftCheckpoint(cfg, weights, str(d), _held_bytes(table),
                           _held_bytes(held) + largest, stream,
                           draft_identity(d, {e.path for e in table.values()}))


def draft_identity(d: Path, files) -> str:
    """The identity of a draft's weights as 64 hex digits (formats/state.md ``draft``):
    the sha256 of its config.json's sha256 and each weights file's name, size and sampled
    digest (``libk3.io.identity``: four 64 KiB blocks), as canonical JSON. What a saved
    draft context is checked against: another draft's rows would only propose worse."""
    config = hashlib.sha256((d / "config.json").read_bytes()).hexdigest()
    shards = []
    for f in sorted(files):
        size, digest = file_digest(f)
        shards.append({"name": Path(f).name, "size": size, "sampled_sha256": digest})
    return digest_of({"config_sha256": config, "files": shards})


# ---- finding the tensors ----------------------------------------------------------------

def _index(d: Path):
    """(the file that lists the names, {bare name: TensorEntry}) over every shard."""
    if (d / INDEX_FILE).exists():
        shards, weight_map = find_shards(d)         # a missing shard: an error naming it
        listing = str(d / INDEX_FILE)
    elif (d / DRAFT_FILE).is_file():
        shards, weight_map, listing = [str(d / DRAFT_FILE)], None, str(d / DRAFT_FILE)
    else:
        raise CheckpointError(f"no {DRAFT_FILE} and no {INDEX_FILE}", path=d,
                              hint="a draft directory holds config.json and its weights "
                                   "(dspark.md §3.2)")
    stored = {}
    for shard in shards:
        for ent in read_header(shard):              # strict: every tensor inside its file
            prev = stored.setdefault(ent.name, ent)
            if prev is not ent:
                raise CheckpointError(f"tensor appears in two shards (also in "
                                      f"{Path(prev.path).name})", path=shard, tensor=ent.name)
    if weight_map is not None:
        _check_index(d, weight_map, stored)
    return listing, _bare(stored)


def _check_index(d: Path, weight_map: dict, stored: dict) -> None:
    """The index and the headers agree: each name it lists is in the header of the shard
    it names, and each tensor of the headers is listed."""
    for name, fname in weight_map.items():
        ent = stored.get(name)
        if ent is None or ent.path != str(d / fname):
            raise CheckpointError(f"the index places this tensor in {fname}, whose header "
                                  "lacks it", path=d / fname, tensor=name,
                                  hint=f"{INDEX_FILE} is stale or the shard is wrong")
    if len(weight_map) != len(stored):
        extra = next(n for n in stored if n not in weight_map)
        raise CheckpointError(f"tensor is in a shard header but not in {INDEX_FILE}",
                              path=stored[extra].path, tensor=extra, hint="the index is stale")


def _bare(stored: dict) -> dict:
    """{bare name: entry}: every name bare, or every one with the ``model.`` prefix, never
    a mix (dspark.md §3.1). The entries keep the stored names, for messages."""
    prefixed = [n for n in stored if n.startswith(PREFIX)]
    if not prefixed:
        return dict(stored)
    if len(prefixed) != len(stored):
        bare = next(n for n in stored if not n.startswith(PREFIX))
        raise CheckpointError(f"tensor names mix bare and '{PREFIX}'-prefixed forms (e.g. "
                              f"{prefixed[0]} and {bare})", path=stored[bare].path, tensor=bare,
                              hint=f"every name bare, or every name with the {PREFIX} prefix")
    return {n[len(PREFIX):]: ent for n, ent in stored.items()}


# ---- checking them --------------------------------------------------------------------------

def _inventory(cfg: DraftConfig, held: int):
    """(the {bare name: shape} to check, how many tensors ``cfg`` implies). When it implies
    more than the files hold, only its first layers: enough to name missing ones without
    building a table sized by a number read from the config."""
    base = len(dataclasses.replace(cfg, num_hidden_layers=0).tensor_shapes())
    per_layer = len(dataclasses.replace(cfg, num_hidden_layers=1).tensor_shapes()) - base
    total = base + per_layer * cfg.num_hidden_layers
    if total <= held:
        return cfg.tensor_shapes(), total
    layers = min(cfg.num_hidden_layers, held // per_layer + 1)
    return dataclasses.replace(cfg, num_hidden_layers=layers).tensor_shapes(), total


def _check_inventory(cfg: DraftConfig, table: dict, listing: str) -> None:
    """Exactly the tensors ``cfg`` implies, each with its shape and an allowed dtype."""
    shapes, total = _inventory(cfg, len(table))
    whole = len(shapes) == total
    missing = [n for n in shapes if n not in table]
    extra = sorted(n for n in table if n not in shapes) if whole else []
    if missing or extra:
        parts = []
        if missing:
            count = (f"{total - (len(table) - len(extra))} tensor(s) the draft config "
                     "requires are" if whole else
                     f"the draft config implies {total} tensors, the files hold "
                     f"{len(table)}; tensors")
            parts.append(f"{count} missing, e.g. " + ", ".join(missing[:_SHOW]))
        if extra:
            parts.append(f"{len(extra)} tensor(s) the draft config does not describe, e.g. "
                         + ", ".join(table[n].name for n in extra[:_SHOW]))
        first = None if missing else table[extra[0]]
        raise CheckpointError("; ".join(parts), path=listing if missing else first.path,
                              tensor=missing[0] if missing else first.name,
                              hint=f"check that {cfg.source} belongs to these weights "
                                   "(names as in dspark.md §3.1)")
    wrong = []
    for name, shape in shapes.items():
        ent = table[name]
        if ent.shape != tuple(shape):
            wrong.append((ent, f"shape {list(shape)}", f"shape {list(ent.shape)}"))
        allowed = EITHER_FLOAT.get(name, ("BF16",))
        if ent.dtype not in allowed:
            wrong.append((ent, "dtype " + "/".join(allowed), "dtype " + ent.dtype))
    if wrong:
        ent, want, got = wrong[0]
        raise CheckpointError(
            f"{len(wrong)} tensor(s) have the wrong shape or dtype, e.g. "
            + ", ".join(f"{e.name} {list(e.shape)} {e.dtype}" for e, _, _ in wrong[:_SHOW]),
            path=ent.path, tensor=ent.name, expected=want, found=got)


# ---- reading them ---------------------------------------------------------------------------

def _as_matrix(name: str, ent) -> bool:
    """Whether a tensor is held as its stored matrix bits (else widened to float32)."""
    return len(ent.shape) == 2 and name != CONFIDENCE_WEIGHT


def _held_bytes(table: dict) -> int:
    """Bytes ``_read`` holds: matrices as stored, the rest as float32."""
    return sum(ent.nbytes if _as_matrix(name, ent) else 4 * int(np.prod(ent.shape))
               for name, ent in table.items() if name != EMBED)


def _read(table: dict) -> dict:
    """Every tensor but the embedding copy, by positioned reads into new arrays."""
    fds = {}
    weights = {}
    try:
        for name, ent in table.items():
            if name == EMBED:
                continue
            fd = fds.get(ent.path)
            if fd is None:
                fd = fds[ent.path] = _open(ent.path)
            raw = pread_into(fd, ent.offset, np.empty(ent.nbytes, np.uint8),
                             path=ent.path, tensor=ent.name)
            if _as_matrix(name, ent):
                weights[name] = matrix_operand(raw, ent.dtype, ent.shape)   # BF16 bits
            else:
                weights[name] = widen(raw, ent.dtype, ent.shape)            # float32
    finally:
        for fd in fds.values():
            os.close(fd)
    return weights


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError("shard file vanished after its header was read",
                              path=path) from None
    except OSError as e:
        raise K3IOError(f"cannot open shard: {e.strerror}", path=path) from None
