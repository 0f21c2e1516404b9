"""The checkpoint index: every language-model tensor of a model directory, by name.

Owns: one table name -> TensorEntry over all the shards, validating it against the
inventory a config implies (model.md §3.4, §4.1), positioned reads of tensors and byte
spans, the contiguous byte runs of routed experts (model.md §4.1) and of a layer's trunk
tensors (model.md §3.3), and the checkpoint's identity for packs and traces.
Does not own: finding the shards, the index file and surveying their sizes
(``libk3.io.shards``), the container format of one shard (``libk3.io.safetensors``),
expected shapes (``libk3.io.inventory``), widening (``libk3.io.dtypes``), MXFP4 decoding,
caching or streaming policy (``libk3.stream``).

Why no mmap: the model is ~1.56 TB; mapping shards makes the page cache, not k3's budget,
decide what stays resident. Every read is an explicit ``pread`` into a buffer the caller
owns, through one read-only descriptor per shard (opened lazily, closed by ``close()``).

Why one dict of NamedTuples: the real checkpoint has 497,220 tensors in 96 shards with
~78 MB of JSON headers. Each entry shares its path string, dtype string, shape tuple and
size int with its neighbours; what remains per tensor is its name, one tuple, one offset
int and a dict slot (a columnar layout would save memory but not the parse, which
dominates; bench/README.md, "Reading the checkpoint index", has the costs). Image tower
and projector tensors (``vision_tower.``, ``mm_projector.``) are kept apart from the
language-model table: when config.json has ``vision_config`` they are validated against
its inventory (``libk3.io.inventory``, formats/model/vision.md §3), otherwise ignored.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import names
from ..config import K3Config, load_config
from ..errors import CheckpointError, K3IOError
from ..vision_config import load_vision_config
from . import inventory
from .inventory import check_vision_tensors
from .dtypes import matrix_operand, widen
from .safetensors import TensorEntry, pread_into, read_header
from .shards import LM_PREFIX, ShardSurvey, check_index, gc_paused, find_shards

_EXPERT_MARK = ".block_sparse_moe.experts."
_SHOW = 5                    # how many offending names an error message lists


class ExpertRun(NamedTuple):
    """One routed expert's six tensors as one contiguous byte run (model.md §4.1).
    ``parts[(w, part)] = (suboffset inside the run, nbytes, shape)``."""

    path: str
    offset: int
    nbytes: int
    parts: dict


class TrunkRun(NamedTuple):
    """A layer's non-expert tensors as one contiguous byte run inside one shard.
    ``tensors[name] = (suboffset inside the run, nbytes, dtype, shape)``."""

    path: str
    offset: int
    nbytes: int
    tensors: dict


class ExpertTable(NamedTuple):
    """Every routed expert's run, as arrays indexed [L, e] (dense layers: shard -1).
    ``part_offset``/``part_nbytes`` are [L, e, 6] in ``names.EXPERT_PARTS`` order."""

    paths: tuple              # shard paths; shard[L, e] indexes this
    shard: np.ndarray         # (num_hidden_layers, num_experts) int32
    offset: np.ndarray        # (num_hidden_layers, num_experts) int64, absolute run start
    nbytes: np.ndarray        # (num_hidden_layers, num_experts) int64, run length
    part_offset: np.ndarray   # (num_hidden_layers, num_experts, 6) int64, within the run
    part_nbytes: np.ndarray   # (num_hidden_layers, num_experts, 6) int64


class _ExpertScan(NamedTuple):
    found: int
    first_missing: tuple | None     # (L, e) of the first expert with a missing tensor
    offsets: list                   # flat, six per expert, names.EXPERT_PARTS order
    sizes: list
    shard_ids: list


class Checkpoint:
    """An opened model directory. Build with ``Checkpoint.open``; use as a context manager
    (or call ``close()``) to release the shard descriptors."""

    def __init__(self, model_dir: Path, config: K3Config, shards: list, sizes: dict,
                 table: dict, trunk_names: dict, vision_table: dict):
        self.model_dir = model_dir
        self.config = config
        self.shards = tuple(shards)            # shard paths in name order
        self._sizes = sizes                    # path -> bytes at open
        self._table = table                    # name -> TensorEntry
        self._trunk_names = trunk_names        # L -> [name] of non-expert layer tensors
        self._vision_table = vision_table      # name -> TensorEntry of image tensors
        self.vision_config = None              # VisionConfig once validated, if any
        self._fds = {}
        self._fd_lock = threading.Lock()
        self._expert_table = None

    # ---- opening ------------------------------------------------------------------------
    @classmethod
    def open(cls, model_dir, config: K3Config | None = None, validate: bool = True,
             survey: ShardSurvey | None = None):
        """Index every shard of ``model_dir``; with ``validate``, require exactly the
        tensors ``config`` implies (shapes, dtypes, A_log padding, contiguous experts).
        ``survey``: ``survey_shards(model_dir)`` without problems, whose headers are used
        instead of reading them again."""
        model_dir = Path(model_dir)
        if config is None:
            config = load_config(model_dir)
        if survey is not None and survey.problems:
            raise ValueError("a survey with problems cannot open a checkpoint")
        with gc_paused():
            ckpt = cls._index(model_dir, config, survey)
        if validate:
            try:
                ckpt.validate()
            except BaseException:
                ckpt.close()
                raise
        return ckpt

    @classmethod
    def _index(cls, model_dir: Path, config: K3Config, survey):
        if survey is None:
            shards, weight_map = find_shards(model_dir)
            header = read_header
        else:
            shards, weight_map, header = survey.shards, survey.weight_map, survey.headers.get
        table, others, sizes, vision_table = {}, {}, {}, {}
        trunk_names = {}
        for path in shards:
            sizes[path] = os.stat(path).st_size
            others[path] = set()
            for ent in header(path):
                name = ent.name
                if not name.startswith(LM_PREFIX):
                    others[path].add(name)
                    if names.is_vision(name):
                        vision_table.setdefault(name, ent)
                    continue
                prev = table.setdefault(name, ent)
                if prev is not ent:
                    raise CheckpointError(f"tensor appears in two shards (also in "
                                          f"{Path(prev.path).name})", path=path, tensor=name)
                if _EXPERT_MARK not in name:
                    key = names.parse_layer_key(name)
                    if key is not None:
                        trunk_names.setdefault(key[0], []).append(name)
        if weight_map is not None:
            check_index(model_dir, weight_map, table, others)
        return cls(model_dir, config, shards, sizes, table, trunk_names, vision_table)

    def validate(self) -> None:
        """Raise CheckpointError unless the table holds exactly the inventory of
        ``self.config`` with exact shapes and allowed dtypes, A_log's padding is zero and
        every routed expert is one contiguous run; with ``vision_config`` in the model
        directory's config.json, also exactly its image tensors (formats/model/vision.md §3)."""
        cfg = self.config
        problems = inventory.experts_mxfp4_ok(cfg)
        if problems:
            raise CheckpointError("config cannot describe MXFP4 experts: " + "; ".join(problems),
                                  path=cfg.source)
        table = self._table
        if inventory.count(cfg) > len(table):
            self._refuse_missing()
        missing, wrong = [], []
        found = 0
        a_logs = []
        specs = list(inventory.model_level(cfg))
        for L in range(cfg.num_hidden_layers):
            specs += inventory.layer_trunk(cfg, L)
        for spec in specs:
            ent = table.get(spec.name)
            if ent is None:
                missing.append(spec.name)
                continue
            found += 1
            if spec.shape is None:                      # A_log: (n,), n >= num_heads
                if len(ent.shape) != 1 or ent.shape[0] < cfg.num_heads:
                    wrong.append((ent, f"(n,) with n >= {cfg.num_heads}"))
                a_logs.append(ent)
            elif ent.shape != spec.shape:
                wrong.append((ent, str(spec.shape)))
            if ent.dtype not in spec.dtypes:
                wrong.append((ent, "dtype " + "/".join(spec.dtypes)))
        scan = self._scan_experts(missing, wrong)
        found += scan.found
        if missing:
            raise CheckpointError(
                f"{len(missing)} tensor(s) the config requires are missing, e.g. "
                + ", ".join(missing[:_SHOW]), path=self.model_dir, tensor=missing[0],
                hint=f"check that {cfg.source} belongs to this checkpoint")
        if wrong:
            ent, want = wrong[0]
            raise CheckpointError(
                f"{len(wrong)} tensor(s) have the wrong shape or dtype, e.g. "
                + ", ".join(f"{e.name} {list(e.shape)} {e.dtype}" for e, _ in wrong[:_SHOW]),
                path=ent.path, tensor=ent.name, expected=want,
                found=f"{list(ent.shape)} {ent.dtype}")
        if found != len(table):
            expected_names = {s.name for s in specs}
            extra = sorted(n for n in table if n not in expected_names and not
                           inventory.is_expected_expert(cfg, n))
            raise CheckpointError(
                f"{len(extra)} language_model tensor(s) the config does not describe, e.g. "
                + ", ".join(extra[:_SHOW]), path=table[extra[0]].path, tensor=extra[0],
                hint=f"check that {cfg.source} belongs to this checkpoint")
        for ent in a_logs:
            a_log = self.read(ent.name)
            pad = a_log[cfg.num_heads:]
            if np.any(pad != 0):
                bad = int(np.flatnonzero(pad != 0)[0]) + cfg.num_heads
                raise CheckpointError("A_log padding entries (index >= num_heads) are not zero",
                                      path=ent.path, tensor=ent.name, expected="0.0",
                                      found=f"A_log[{bad}] = {a_log[bad]!r}",
                                      hint="A_log is per head (model.md §3.4)")
        self._expert_table = self._runs_from_scan(scan)
        vcfg = load_vision_config(self.model_dir, cfg)
        if vcfg is not None:
            check_vision_tensors(self._vision_table, vcfg, self.model_dir)
        self.vision_config = vcfg

    def _refuse_missing(self) -> None:
        """Raise for a config that implies more tensors than the shards hold, in time and
        memory bounded by the shards, not by the config's sizes (10^9 experts must not be
        listed): the exact count from the table, the first names by a lazy walk."""
        cfg, table = self.config, self._table
        kinds, model = {}, {s.name for s in inventory.model_level(cfg)}
        present = 0
        for name in table:
            key = names.parse_layer_key(name)
            if key is not None and key[0] < cfg.num_hidden_layers:
                kind = (cfg.is_mla(key[0]), cfg.is_dense(key[0]))
                if kind not in kinds:
                    kinds[kind] = {names.parse_layer_key(s.name)[1]
                                   for s in inventory.layer_trunk(cfg, key[0])}
                present += key[1] in kinds[kind] or inventory.is_expected_expert(cfg, name)
            else:
                present += name in model
        gone = list(itertools.islice((n for n in inventory.expected_names(cfg) if n not in table), _SHOW))
        raise CheckpointError(
            f"{inventory.count(cfg) - present} tensor(s) the config requires are missing, "
            "e.g. " + ", ".join(gone), path=self.model_dir, tensor=gone[0],
            hint=f"check that {cfg.source} belongs to this checkpoint")

    # ---- lookup -------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._table

    def __len__(self) -> int:
        return len(self._table)

    def names(self):
        """Every indexed (language_model.) tensor name, in no particular order."""
        return self._table.keys()

    def entry(self, name: str) -> TensorEntry:
        ent = self._table.get(name)
        if ent is None:
            raise CheckpointError("no such tensor in the checkpoint", path=self.model_dir,
                                  tensor=name)
        return ent

    def vision_entry(self, name: str) -> TensorEntry:
        """An image tower or projector tensor's entry (kept apart from the language
        model's table, formats/model/vision.md §3.3)."""
        ent = self._vision_table.get(name)
        if ent is None:
            raise CheckpointError("no such image tensor in the checkpoint",
                                  path=self.model_dir, tensor=name)
        return ent

    # ---- reading ------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._fd_lock:
            fd = self._fds.get(path)
            if fd is None:
                if path not in self._sizes:
                    raise CheckpointError("not a shard of this checkpoint", path=path)
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise K3IOError(f"cannot open shard: {e.strerror}", path=path) from None
                self._fds[path] = fd
            return fd

    def read_raw(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array. ``out``, if given, is a contiguous
        uint8 buffer of at least nbytes; the returned array is a view of its head."""
        ent = self.entry(name)
        buf = _take(out, ent.nbytes)
        pread_into(self._fd(ent.path), ent.offset, buf, path=ent.path, tensor=name)
        return buf

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor shaped: float32 for BF16/F16/F32 (exact widening), raw uint8 for U8.
        ``out``, if given, is a contiguous array of that dtype and the tensor's size."""
        ent = self.entry(name)
        arr = widen(self.read_raw(name), ent.dtype, ent.shape)
        if out is None:
            return arr
        if out.dtype != arr.dtype or out.size != arr.size or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous {arr.dtype} array of {arr.size} "
                             f"elements for {name}")
        view = out.reshape(ent.shape)
        np.copyto(view, arr)
        return view

    def read_matrix(self, name: str) -> np.ndarray:
        """A float tensor shaped as the dense kernels take it, in its stored dtype
        (``dtypes.matrix_operand``: BF16 bits as uint16, F32 as float32, F16 widened)."""
        ent = self.entry(name)
        if ent.dtype not in inventory.FLOAT:
            raise CheckpointError("tensor is not a float matrix", path=ent.path, tensor=name,
                                  expected="/".join(inventory.FLOAT), found=ent.dtype)
        return matrix_operand(self.read_raw(name), ent.dtype, ent.shape)

    def read_span(self, path: str, offset: int, nbytes: int,
                  out: np.ndarray | None = None) -> np.ndarray:
        """``nbytes`` bytes of shard ``path`` from absolute ``offset`` (e.g. an expert or
        trunk run) into ``out`` (contiguous uint8, at least nbytes); returns the view."""
        buf = _take(out, nbytes)
        pread_into(self._fd(str(path)), offset, buf, path=path)
        return buf

    def close(self) -> None:
        with self._fd_lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- runs ---------------------------------------------------------------------------
    def expert_run(self, L: int, e: int) -> ExpertRun:
        """Expert e of layer L as one contiguous run; CheckpointError naming layer and
        expert when a tensor is missing, the six span two shards, or leave gaps."""
        ents = []
        for name in names.expert_names(L, e):
            ent = self._table.get(name)
            if ent is None:
                raise CheckpointError(f"layer {L} expert {e}: tensor missing",
                                      path=self.model_dir, tensor=name)
            ents.append(ent)
        path = ents[0].path
        start = min(x.offset for x in ents)
        end = max(x.offset + x.nbytes for x in ents)
        total = sum(x.nbytes for x in ents)
        if any(x.path != path for x in ents) or end - start != total:
            raise CheckpointError(f"layer {L} expert {e}: its six tensors are not one "
                                  "contiguous run (model.md §4.1)", path=path, tensor=ents[0].name,
                                  expected=f"max end - min start = {total}",
                                  found=_span_text(ents, start, end))
        parts = {wp: (x.offset - start, x.nbytes, x.shape)
                 for wp, x in zip(names.EXPERT_PARTS, ents)}
        return ExpertRun(path, start, total, parts)

    def expert_table(self) -> ExpertTable:
        """Every expert of every MoE layer of the config, in one pass (built once, then
        kept). Raises like ``expert_run`` for the first bad expert."""
        if self._expert_table is None:
            missing = []
            scan = self._scan_experts(missing, None)
            if missing:
                L, e = scan.first_missing
                self.expert_run(L, e)               # raises, naming layer and expert
            self._expert_table = self._runs_from_scan(scan)
        return self._expert_table

    def _scan_experts(self, missing: list, wrong: list | None) -> "_ExpertScan":
        """Look up the six tensors of every (MoE layer, expert) of the config once.
        Appends absent names to ``missing`` and, if ``wrong`` is a list, (entry, wanted)
        for each tensor whose shape or dtype is not the inventory's."""
        cfg = self.config
        shapes = inventory.expert_shapes(cfg)
        expected = [shapes[wp] for wp in names.EXPERT_PARTS]
        shard_id = {p: i for i, p in enumerate(self.shards)}
        table = self._table
        offs, sizes, sids = [], [], []
        first_missing = None
        for L in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for name, shape in zip(names.expert_names(L, e), expected):
                    ent = table.get(name)
                    if ent is None:
                        missing.append(name)
                        first_missing = first_missing or (L, e)
                        continue
                    if wrong is not None and (ent.shape != shape or ent.dtype != "U8"):
                        wrong.append((ent, f"{shape} U8"))
                    offs.append(ent.offset)
                    sizes.append(ent.nbytes)
                    sids.append(shard_id[ent.path])
        return _ExpertScan(len(offs), first_missing, offs, sizes, sids)

    def _runs_from_scan(self, scan: "_ExpertScan") -> ExpertTable:
        """Vectorised contiguity check (model.md §4.1) and the [L, e] arrays of a complete scan."""
        cfg = self.config
        n_layers, n_exp, n_parts = cfg.num_hidden_layers, cfg.num_experts, len(names.EXPERT_PARTS)
        moe = list(cfg.moe_layers)
        m = len(moe) * n_exp
        offs = np.array(scan.offsets, np.int64).reshape(m, n_parts)
        sizes = np.array(scan.sizes, np.int64).reshape(m, n_parts)
        sids = np.array(scan.shard_ids, np.int32).reshape(m, n_parts)
        start = offs.min(axis=1)
        total = sizes.sum(axis=1)
        ok = ((offs + sizes).max(axis=1) - start == total) \
            & (sids == sids[:, :1]).all(axis=1)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            self.expert_run(moe[i // n_exp], i % n_exp)   # raises with the details
        shard = np.full((n_layers, n_exp), -1, np.int32)
        offset = np.zeros((n_layers, n_exp), np.int64)
        nbytes = np.zeros((n_layers, n_exp), np.int64)
        part_offset = np.zeros((n_layers, n_exp, n_parts), np.int64)
        part_nbytes = np.zeros((n_layers, n_exp, n_parts), np.int64)
        if moe:
            rows = np.asarray(moe)
            shard[rows] = sids[:, 0].reshape(len(moe), n_exp)
            offset[rows] = start.reshape(len(moe), n_exp)
            nbytes[rows] = total.reshape(len(moe), n_exp)
            part_offset[rows] = (offs - start[:, None]).reshape(len(moe), n_exp, n_parts)
            part_nbytes[rows] = sizes.reshape(len(moe), n_exp, n_parts)
        return ExpertTable(self.shards, shard, offset, nbytes, part_offset, part_nbytes)

    def layer_trunk_run(self, L: int) -> TrunkRun:
        """Layer L's non-expert tensors as one contiguous run inside one shard (what
        k3-pack copies). CheckpointError when they are absent, split or gapped."""
        tensor_names = self._trunk_names.get(L)
        if not tensor_names:
            raise CheckpointError(f"layer {L} has no trunk tensors", path=self.model_dir,
                                  tensor=names.layer_prefix(L) + "*")
        ents = [self._table[n] for n in tensor_names]
        path = ents[0].path
        other = next((x for x in ents if x.path != path), None)
        if other is not None:
            raise CheckpointError(f"layer {L}: trunk tensors are split over two shards "
                                  f"({Path(path).name} and {Path(other.path).name})",
                                  path=other.path, tensor=other.name)
        filled = [x for x in ents if x.nbytes] or ents
        start = min(x.offset for x in filled)
        end = max(x.offset + x.nbytes for x in filled)
        total = sum(x.nbytes for x in ents)
        stray = next((x for x in ents if not start <= x.offset <= end), None)
        if end - start != total or stray is not None:
            raise CheckpointError(f"layer {L}: trunk tensors are not one contiguous run",
                                  path=path, tensor=(stray or ents[0]).name,
                                  expected=f"max end - min start = {total}",
                                  found=_span_text(ents, start, end))
        tensors = {x.name: (x.offset - start, x.nbytes, x.dtype, x.shape)
                   for x in sorted(ents, key=lambda x: (x.offset, x.nbytes, x.name))}
        return TrunkRun(path, start, total, tensors)

    # ---- identity -----------------------------------------------------------------------
    def identity(self) -> dict:
        """What a pack or trace records to recognise this checkpoint later."""
        return {"config_fingerprint": self.config.fingerprint(),
                "shards": [[Path(p).name, self._sizes[p]] for p in self.shards]}

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.model_dir)!r}, {len(self.shards)} shards, "
                f"{len(self._table)} tensors)")


def _span_text(ents, start: int, end: int) -> str:
    paths = {Path(x.path).name for x in ents}
    return (f"{end - start} bytes from {start} in {', '.join(sorted(paths))}: "
            + ", ".join(f"{x.name.rsplit('.', 2)[-2]}.{x.name.rsplit('.', 1)[-1]}@{x.offset}"
                        if _EXPERT_MARK in x.name else f"{x.name}@{x.offset}" for x in ents[:6]))


def _take(out, nbytes: int) -> np.ndarray:
    if out is None:
        return np.empty(nbytes, np.uint8)
    if out.dtype != np.uint8 or not out.flags.c_contiguous or out.size < nbytes:
        raise ValueError(f"out must be a contiguous uint8 buffer of at least {nbytes} bytes")
    return out.reshape(-1)[:nbytes]
