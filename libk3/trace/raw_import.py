"""Importing the public C engine's headerless expert traces (formats/trace.md, "The public
C engine's trace").

Owns: ``import_raw_c_trace``: checking and converting ``expert_trace.bin`` (little-endian
int32 (layer, expert) pairs) into a ``.k3trace``. Does not own: the trace layout
(``libk3.trace.format``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import FormatError
from .format import PHASE_UNKNOWN, RECORD_DTYPE, TraceHeader, TraceWriter

RAW_PAIR_BYTES = 8
IMPORT_CHUNK_PAIRS = 1 << 20


def import_raw_c_trace(raw_path, out_path, *, n_layers: int, n_experts: int,
                       expert_bytes: int, top_k: int, created_by: str) -> dict:
    """Convert the public C engine's ``expert_trace.bin`` (headerless little-endian int32
    (layer, expert) pairs, one per cache request) into a trace
    file. Position, sequence and phase are unknown there: -1, -1, unknown. Streams in
    chunks; an odd number of int32s or an out-of-range pair is a FormatError naming the
    pair and its byte offset, and leaves no output. -> {requests, frames, path}."""
    raw_path, out_path = Path(raw_path), Path(out_path)
    size = raw_path.stat().st_size
    if size % 4:
        raise FormatError("raw trace is not a whole number of int32s", path=raw_path,
                          expected="a multiple of 4 bytes", found=f"{size} bytes")
    if size % RAW_PAIR_BYTES:
        raise FormatError("raw trace holds an odd number of int32s (pairs are layer, "
                          "expert)", path=raw_path, expected="an even count",
                          found=f"{size // 4} int32s")
    if size == 0:
        raise FormatError("raw trace is empty", path=raw_path)
    header = TraceHeader(checkpoint=None, expert_bytes=expert_bytes, n_layers=n_layers,
                         n_experts=n_experts, top_k=top_k, source="import",
                         created_by=created_by, meta={"imported_from": raw_path.name})
    writer = TraceWriter(out_path, header)
    try:
        pairs_done = 0
        with open(raw_path, "rb") as f:
            while True:
                pairs = np.fromfile(f, dtype="<i4", count=2 * IMPORT_CHUNK_PAIRS)
                if pairs.size == 0:
                    break
                pairs = pairs.reshape(-1, 2)
                layer, expert = pairs[:, 0], pairs[:, 1]
                bad = (layer < 0) | (layer >= n_layers) | (expert < 0) | (expert >= n_experts)
                if bad.any():
                    i = int(np.argmax(bad))
                    raise FormatError(
                        f"pair {pairs_done + i} at byte offset {(pairs_done + i) * RAW_PAIR_BYTES}"
                        f": layer {layer[i]}, expert {expert[i]} out of range",
                        path=raw_path, expected=f"layer 0..{n_layers - 1}, expert "
                                                f"0..{n_experts - 1}",
                        found=f"({layer[i]}, {expert[i]})",
                        hint="check --n-layers and --n-experts")
                rec = np.empty(layer.size, RECORD_DTYPE)
                rec["pos"] = -1
                rec["seq"] = -1
                rec["layer"] = layer
                rec["expert"] = expert
                rec["phase"] = PHASE_UNKNOWN
                writer.append_records(rec)
                pairs_done += layer.size
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"requests": pairs_done, "frames": writer.n_frames, "path": str(out_path)}
