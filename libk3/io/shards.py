"""A model directory's shards: which files they are and whether their sizes hold.

Owns: finding the shards (model.md §3.1: the index file ``model.safetensors.index.json``
when present, else every ``*.safetensors``), reading the index strictly, checking it
against the shards' headers, and surveying every shard's size against its header for
k3-doctor (``survey_shards``: problems collected, not raised). Does not own: the tensor
table, its validation or reads (``libk3.io.checkpoint``), the container format of one
shard (``libk3.io.safetensors``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointError, K3IOError
from .safetensors import scan_header

INDEX_FILE = "model.safetensors.index.json"
LM_PREFIX = "language_model."


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while the table is built. Parsing allocates
    millions of containers while keeping ~500,000 entries alive, so each collection
    rescans a growing heap (bench/README.md, "Reading the checkpoint index"). The
    entries hold no cycles; the previous state is restored on exit."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def find_shards(model_dir, missing: list | None = None):
    """(sorted shard paths, weight_map or None). Uses the index file when present, else
    every ``*.safetensors`` sorted by name (which covers a single ``model.safetensors``).

    A shard the index names but the directory lacks raises CheckpointError, or, when a
    ``missing`` list is given, is appended to it as an error and skipped."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError("model directory not found", path=d)
    index_path = d / INDEX_FILE
    if not index_path.exists():
        shards = sorted(p for p in d.glob("*.safetensors") if p.is_file())
        if not shards:
            raise CheckpointError("no *.safetensors shard and no index file", path=d,
                                  hint="point k3 at the model directory")
        return [str(p) for p in shards], None
    weight_map = _read_index(index_path)
    shards = []
    for fname in sorted(set(weight_map.values())):
        p = d / fname
        if not p.is_file():
            err = CheckpointError("shard named by the index is missing", path=p,
                                  hint=f"{sum(v == fname for v in weight_map.values())} "
                                       f"tensors of {INDEX_FILE} live in it")
            if missing is None:
                raise err
            missing.append(err)
            continue
        shards.append(str(p))
    return shards, weight_map


def _read_index(index_path: Path) -> dict:
    try:
        doc = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"index is not valid JSON: {e}", path=index_path) from None
    except OSError as e:
        raise K3IOError(f"cannot read index: {e.strerror}", path=index_path) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError("index has no weight_map object", path=index_path,
                              expected='{"weight_map": {name: shard file}}')
    bad = next((n for n, f in weight_map.items() if type(f) is not str), None)
    if bad is not None:
        raise CheckpointError("weight_map value is not a shard file name", path=index_path,
                              tensor=bad, found=repr(weight_map[bad]))
    for fname in set(weight_map.values()):   # ~100 distinct files among ~500,000 rows
        if not fname or fname != Path(fname).name or fname in (".", ".."):
            name = next(n for n, f in weight_map.items() if f == fname)
            raise CheckpointError("weight_map value is not a shard file name",
                                  path=index_path, tensor=name, found=repr(fname))
    return weight_map


def check_index(model_dir: Path, weight_map: dict, table: dict, others: dict) -> None:
    """The index and the headers must agree: every name the index lists is in that
    shard's header, and every language_model tensor of the headers is listed."""
    shard_path = {fname: str(model_dir / fname) for fname in set(weight_map.values())}
    lm_listed = 0
    for name, fname in weight_map.items():
        path = shard_path[fname]
        if name.startswith(LM_PREFIX):
            lm_listed += 1
            ent = table.get(name)
            ok = ent is not None and ent.path == path
        else:
            ok = name in others.get(path, ())
        if not ok:
            raise CheckpointError(f"the index places this tensor in {fname}, whose header "
                                  "lacks it", path=path, tensor=name,
                                  hint=f"{INDEX_FILE} is stale or the shard is wrong")
    if lm_listed != len(table):
        extra = next(n for n in table if n not in weight_map)
        raise CheckpointError(f"tensor is in a shard header but not in {INDEX_FILE}",
                              path=table[extra].path, tensor=extra,
                              hint="the index is stale")


class ShardSurvey(NamedTuple):
    """Every shard of a model directory read once, for k3-doctor (``survey_shards``)."""

    shards: list                 # the shard paths present, in name order
    weight_map: dict | None      # the index's, or None without one
    missing: list                # CheckpointError per shard the index names but lacks
    problems: list               # every problem (missing ones too), as CheckpointError
    headers: dict                # path -> TensorEntry rows, for each shard of its size


def survey_shards(model_dir) -> ShardSurvey:
    """The shards of ``model_dir`` with their size problems, not raised: a shard the index
    names but the directory lacks, a header that does not parse, a file shorter
    (truncated) or longer (trailing bytes) than its header implies. A survey without
    problems opens the checkpoint without reading a header again (``Checkpoint.open``)."""
    missing, problems, headers = [], [], {}
    shards, weight_map = find_shards(model_dir, missing=missing)
    problems += missing
    with gc_paused():
        for path in shards:
            try:
                entries, want = scan_header(path)
            except CheckpointError as e:
                problems.append(e)
                continue
            size = os.stat(path).st_size
            if size < want:
                problems.append(CheckpointError("shard is truncated", path=path,
                                                expected=f"{want} bytes",
                                                found=f"{size} bytes",
                                                hint="download this shard again"))
            elif size > want:
                problems.append(CheckpointError("shard has trailing bytes after its last "
                                                "tensor", path=path, expected=f"{want} bytes",
                                                found=f"{size} bytes"))
            else:
                headers[path] = entries
    return ShardSurvey(shards, weight_map, missing, problems, headers)
