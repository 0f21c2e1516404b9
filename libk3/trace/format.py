"""Expert-routing trace files, formats v1 and v2 (formats/trace.md): writer and reader.

Owns: the byte layout of ``.k3trace`` files, enforcing every numbered invariant of
formats/trace.md on read, and the crash-tolerant writer (v2). Does not own: importing the
public C engine's traces (``libk3.trace.raw_import``), replaying (``libk3.trace.replay``),
statistics and reports (``libk3.trace.report``) or recording a run (k3-run).

Why independent zstd frames with their own checksum: a long run must not hold its trace
in memory, and a crash must cost at most the frame being written. Each frame is flushed
to the OS when full, so after a crash every complete frame is readable
(``tolerate_truncated_tail=True``); a clean close writes an end marker, fsyncs and renames
the temporary file into place, so a file under its final name is complete.

Why a packed record of 13 bytes rather than the C engine's 8: token position, sequence
and phase are what tell a decode step from a prefill chunk and one request of a batch from
another; zstd removes most of the redundancy (a token's 1,472 records share a position).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import zstandard

from ..config import MAX_EXPERTS, MAX_LAYERS
from ..errors import FormatError
from ..io.atomic import fsync_dir, write_error

MAGIC = b"K3TRACE\0"
VERSION = 2                                  # written; read: READ_VERSIONS
READ_VERSIONS = (1, 2)
FILE_HEAD = struct.Struct("<8sIII")          # magic, version, header bytes, header crc32
FRAME_HEAD = struct.Struct("<4sIII")         # b"K3TF", records, payload bytes, crc32
END_MARK = struct.Struct("<4sIQ")            # b"K3TE", frames, records
FRAME_TAG = b"K3TF"
END_TAG = b"K3TE"
MAX_HEADER_BYTES = 1 << 20                   # invariant 3
MAX_EXPERT_BYTES = 1 << 48                   # invariant 5 (header table)
MAX_FRAME_RECORDS = 1 << 20                  # invariant 7
# Replays and statistics keep a few words per key (layer x expert): a header may declare
# up to 65535 x 65535 keys, which no replay can hold; K3 has 93 x 896 = 83,328.
MAX_REPLAY_KEYS = 1 << 22
DEFAULT_FRAME_RECORDS = 1 << 16
ZSTD_LEVEL = 3
PARTIAL_SUFFIX = ".partial"

# Record layout (formats/trace.md, "Records"): packed, little-endian.
RECORD_DTYPE = np.dtype([("pos", "<i4"), ("seq", "<i4"), ("layer", "<u2"),
                         ("expert", "<u2"), ("phase", "u1")])
PHASE_PREFILL, PHASE_DECODE, PHASE_UNKNOWN, PHASE_PREDICTED = 0, 1, 2, 3
PHASE_NAMES = {PHASE_PREFILL: "prefill", PHASE_DECODE: "decode", PHASE_UNKNOWN: "unknown",
               PHASE_PREDICTED: "predicted"}
MAX_PHASE = {1: PHASE_UNKNOWN, 2: PHASE_PREDICTED}   # by version: v2 adds predictions
SOURCES = ("k3-run", "import")
_HEADER_KEYS = ("checkpoint", "expert_bytes", "n_layers", "n_experts", "top_k", "source",
                "created_by")
_OPTIONAL_KEYS = ("meta",)


@dataclasses.dataclass(frozen=True)
class TraceHeader:
    """The JSON header of a trace (formats/trace.md, "Header"). No field has a default."""

    checkpoint: str | None       # config fingerprint of the model; None only for imports
    expert_bytes: int            # bytes of one routed expert as stored (MXFP4)
    n_layers: int                # layers of the model (keys are layer * n_experts + e)
    n_experts: int               # routed experts per MoE layer
    top_k: int                   # experts selected per token per MoE layer
    source: str                  # "k3-run" or "import"
    created_by: str              # tool and version that wrote the file
    meta: dict | None = None     # free-form, optional (e.g. synthetic knobs, prompt file)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in _HEADER_KEYS}
        if self.meta is not None:
            d["meta"] = self.meta
        return d

    @property
    def n_keys(self) -> int:
        return self.n_layers * self.n_experts


def header_for_config(cfg, *, created_by: str, meta: dict | None = None) -> TraceHeader:
    """The header k3-run writes for a K3Config (checkpoint = its fingerprint)."""
    return TraceHeader(checkpoint=cfg.fingerprint(), expert_bytes=cfg.expert_bytes,
                       n_layers=cfg.num_hidden_layers, n_experts=cfg.num_experts,
                       top_k=cfg.num_experts_per_token, source="k3-run",
                       created_by=created_by, meta=meta)


def _check_header(doc, path) -> TraceHeader:
    """Invariants 4 and 5: every field present, typed and in range; no unknown field."""
    if not isinstance(doc, dict):
        raise FormatError("trace header is not a JSON object", path=path, tensor="header")
    missing = [k for k in _HEADER_KEYS if k not in doc]
    unknown = [k for k in doc if k not in _HEADER_KEYS and k not in _OPTIONAL_KEYS]
    if missing or unknown:
        raise FormatError("trace header fields wrong", path=path, tensor="header",
                          expected=", ".join(_HEADER_KEYS),
                          found=f"missing {missing}, unknown {unknown}")

    def int_field(k, lo, hi):
        v = doc[k]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise FormatError(f"header field {k} out of range", path=path, tensor="header",
                              expected=f"integer {lo}..{hi}", found=repr(v))
        return v

    n_layers = int_field("n_layers", 1, MAX_LAYERS)
    n_experts = int_field("n_experts", 1, MAX_EXPERTS)
    top_k = int_field("top_k", 1, n_experts)
    expert_bytes = int_field("expert_bytes", 1, MAX_EXPERT_BYTES)
    source = doc["source"]
    if source not in SOURCES:
        raise FormatError("header field source unknown", path=path, tensor="header",
                          expected=" or ".join(SOURCES), found=repr(source))
    ckpt = doc["checkpoint"]
    if not (isinstance(ckpt, str) and ckpt) and not (ckpt is None and source == "import"):
        raise FormatError("header field checkpoint must name the model (null only for "
                          "imported traces)", path=path, tensor="header", found=repr(ckpt))
    if not isinstance(doc["created_by"], str):
        raise FormatError("header field created_by must be a string", path=path,
                          tensor="header", found=repr(doc["created_by"]))
    meta = doc.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise FormatError("header field meta must be an object", path=path, tensor="header",
                          found=type(meta).__name__)
    return TraceHeader(checkpoint=ckpt, expert_bytes=expert_bytes, n_layers=n_layers,
                       n_experts=n_experts, top_k=top_k, source=source,
                       created_by=doc["created_by"], meta=meta)


def _bad_records(records, header: TraceHeader, version: int = VERSION) -> str | None:
    """Invariant 9, vectorised: the first out-of-range record, described, or None."""
    top = MAX_PHASE[version]
    bad = ((records["layer"] >= header.n_layers) | (records["expert"] >= header.n_experts)
           | (records["phase"] > top) | (records["pos"] < -1)
           | (records["seq"] < -1))
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    r = records[i]
    return (f"record {i}: layer {r['layer']} (< {header.n_layers}), expert {r['expert']} "
            f"(< {header.n_experts}), phase {r['phase']} (0..{top}), pos {r['pos']} (>= -1), "
            f"seq {r['seq']} (>= -1)")


class TraceWriter:
    """Write a trace file (formats/trace.md). Records buffer in memory up to
    ``frame_records`` and are then written as one frame; ``close()`` writes the end
    marker, fsyncs and renames ``<path>.partial`` to ``path``. Leaving the ``with`` block
    by an exception writes the buffered records as a last frame and keeps the partial
    file (readable with ``tolerate_truncated_tail``); ``abort()`` deletes it."""

    def __init__(self, path, header: TraceHeader, *, frame_records: int = DEFAULT_FRAME_RECORDS,
                 level: int = ZSTD_LEVEL):
        if not 1 <= frame_records <= MAX_FRAME_RECORDS:
            raise ValueError(f"frame_records must be 1..{MAX_FRAME_RECORDS}")
        self.path = Path(path)
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.header = _check_header(header.to_json(), self.path)
        self._buf = np.empty(frame_records, RECORD_DTYPE)
        self._n = 0
        self.n_frames = 0
        self.n_records = 0
        self._cctx = zstandard.ZstdCompressor(level=level)
        blob = json.dumps(self.header.to_json(), sort_keys=True).encode()
        self._f = None
        self._write_failed = False
        with self._naming_errors():
            self._f = open(self.partial_path, "wb")
            try:
                self._f.write(FILE_HEAD.pack(MAGIC, VERSION, len(blob), zlib.crc32(blob)))
                self._f.write(blob)
            except OSError:
                self.abort()                  # not even a header: nothing to keep
                raise

    @contextlib.contextmanager
    def _naming_errors(self):
        """An OSError while writing (a full disk) names the trace; a write's own OSError
        carries no file name."""
        try:
            yield
        except OSError as e:
            self._write_failed = True
            raise write_error(self.path, e) from None

    # ---- appending ---------------------------------------------------------------------
    def append(self, pos: int, phase: int, layer: int, experts, *, seq: int = 0) -> None:
        """One layer's routing for one token: ``experts`` in selection order."""
        experts = np.asarray(experts).reshape(-1)
        if not 0 <= layer < self.header.n_layers or (experts.size and not (
                0 <= experts.min() and experts.max() < self.header.n_experts)):
            raise FormatError("routing record out of range", path=self.partial_path,
                              tensor=f"layer {layer}", found=f"experts {experts.tolist()}",
                              expected=f"layer < {self.header.n_layers}, experts < "
                                       f"{self.header.n_experts}")
        rec = np.empty(experts.size, RECORD_DTYPE)
        rec["pos"] = pos
        rec["seq"] = seq
        rec["layer"] = layer
        rec["expert"] = experts
        rec["phase"] = phase
        self.append_records(rec)

    def append_records(self, records) -> None:
        """Append a RECORD_DTYPE array (validated against the header, invariant 9)."""
        if self._f is None:
            raise ValueError(f"{self.path}: trace writer is closed")
        records = np.asarray(records)
        if records.dtype != RECORD_DTYPE:
            raise ValueError(f"records must have dtype RECORD_DTYPE, got {records.dtype}")
        why = _bad_records(records, self.header)
        if why:
            raise FormatError(f"refusing to write an out-of-range {why}", path=self.partial_path)
        i = 0
        cap = self._buf.size
        while i < records.size:
            take = min(cap - self._n, records.size - i)
            self._buf[self._n:self._n + take] = records[i:i + take]
            self._n += take
            i += take
            if self._n == cap:
                self._flush_frame()

    def _flush_frame(self) -> None:
        if self._n == 0:
            return
        raw = self._buf[:self._n].tobytes()
        payload = self._cctx.compress(raw)
        with self._naming_errors():
            self._f.write(FRAME_HEAD.pack(FRAME_TAG, self._n, len(payload), zlib.crc32(raw)))
            self._f.write(payload)
            self._f.flush()                   # a crash of this process keeps the frame
        self.n_frames += 1
        self.n_records += self._n
        self._n = 0

    # ---- finishing ---------------------------------------------------------------------
    def close(self) -> Path:
        """Finish the file: last frame, end marker, fsync, rename into place."""
        if self._f is None:
            return self.path
        try:
            self._flush_frame()
            with self._naming_errors():
                self._f.write(END_MARK.pack(END_TAG, self.n_frames, self.n_records))
                self._f.flush()
                os.fsync(self._f.fileno())
        except BaseException:
            self.keep_partial()
            raise
        with self._naming_errors():
            self._f.close()
            self._f = None
            os.replace(self.partial_path, self.path)
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Stop and delete the partial file (nothing is left under either name)."""
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        self.partial_path.unlink(missing_ok=True)

    def keep_partial(self) -> None:
        """Stop without the end marker, as a crash would: the records so far stay in the
        ``.partial`` file (readable with ``tolerate_truncated_tail``); the final name is
        never written. What a failed run does with its trace."""
        if self._f is not None:
            try:
                if not self._write_failed:    # never append after a torn write
                    self._flush_frame()
            finally:
                with contextlib.suppress(OSError):
                    self._f.close()
                self._f = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.keep_partial()
        return False


class TraceReader:
    """Read and check a trace file (formats/trace.md). The header is checked on open;
    frames are checked as they are read. Strict by default: any bad frame or a missing end
    marker raises FormatError naming the frame index and byte offset. With
    ``tolerate_truncated_tail=True`` a damaged LAST frame (or a missing end marker, as
    after a crash) ends the stream instead, and ``tail_error`` says what was dropped;
    damage followed by more data is still an error (a crash cannot cause it)."""

    def __init__(self, path, *, tolerate_truncated_tail: bool = False):
        self.path = Path(path)
        self.tolerate = tolerate_truncated_tail
        self.tail_error: FormatError | None = None
        self.n_frames: int | None = None      # known after a full read
        self.n_records: int | None = None
        self._size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(FILE_HEAD.size)
            if len(head) < FILE_HEAD.size or head[:8] != MAGIC:
                raise FormatError("not a k3 trace (bad magic)", path=self.path,
                                  expected=repr(MAGIC), found=repr(head[:8]),
                                  hint="raw C-engine traces are converted with "
                                       "`k3-trace import RAW OUT`")
            _, version, hlen, hcrc = FILE_HEAD.unpack(head)
            if version not in READ_VERSIONS:
                raise FormatError("unsupported trace format version", path=self.path,
                                  expected=" or ".join(map(str, READ_VERSIONS)), found=version)
            self.version = version
            if hlen > MAX_HEADER_BYTES or FILE_HEAD.size + hlen > self._size:
                raise FormatError("trace header length runs past the file", path=self.path,
                                  tensor="header", expected=f"<= {self._size - FILE_HEAD.size}",
                                  found=hlen)
            blob = f.read(hlen)
        if zlib.crc32(blob) != hcrc:
            raise FormatError("trace header checksum mismatch (corrupt header)",
                              path=self.path, tensor="header", expected=f"{hcrc:08x}",
                              found=f"{zlib.crc32(blob):08x}")
        try:
            doc = json.loads(blob.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise FormatError(f"trace header is not JSON ({str(e)[:200] or type(e).__name__})",
                              path=self.path, tensor="header") from None
        self.header = _check_header(doc, self.path)
        self._data_start = FILE_HEAD.size + hlen

    def require_replayable(self) -> None:
        """Refuse a header whose key space (n_layers x n_experts) no replay or statistic
        can hold in memory (MAX_REPLAY_KEYS), before anything is sized by it."""
        h = self.header
        if h.n_keys > MAX_REPLAY_KEYS:
            raise FormatError("trace declares too many layer x expert keys to replay",
                              path=self.path, tensor="header",
                              expected=f"n_layers x n_experts <= {MAX_REPLAY_KEYS:,}",
                              found=f"{h.n_layers} x {h.n_experts} = {h.n_keys:,}")

    # ---- frames ------------------------------------------------------------------------
    def _damage(self, index: int, offset: int, what: str, at_tail: bool):
        err = FormatError(f"frame {index} at byte offset {offset}: {what}", path=self.path,
                          tensor=f"frame {index}",
                          hint=("the earlier frames are intact; read them with "
                                "--tolerate-truncated" if at_tail and not self.tolerate
                                else None))
        if at_tail and self.tolerate:
            self.tail_error = err
            return
        raise err

    def iter_frames(self, predictions: bool = False):
        """Yield each frame's records (RECORD_DTYPE arrays), checked (invariants 6-11):
        the requests only, or with ``predictions`` the predicted records too."""
        self.tail_error = None
        dctx = zstandard.ZstdDecompressor()
        frames = records = 0
        with open(self.path, "rb") as f:
            off = self._data_start
            f.seek(off)
            while True:
                head = f.read(FRAME_HEAD.size)
                if len(head) == 0:
                    self._damage(frames, off, "file ends without the end marker (the writer "
                                 "did not finish: a crash?)", at_tail=True)
                    break
                if len(head) < FRAME_HEAD.size:
                    self._damage(frames, off, f"truncated frame header ({len(head)} of "
                                 f"{FRAME_HEAD.size} bytes)", at_tail=True)
                    break
                tag = head[:4]
                if tag == END_TAG:
                    _, n_frames, n_records = END_MARK.unpack(head)
                    if (n_frames, n_records) != (frames, records):
                        raise FormatError("end marker disagrees with the frames read",
                                          path=self.path, tensor="end marker",
                                          expected=f"{frames} frames, {records} records",
                                          found=f"{n_frames} frames, {n_records} records")
                    if off + END_MARK.size != self._size:
                        raise FormatError("bytes after the end marker", path=self.path,
                                          tensor="end marker",
                                          expected=off + END_MARK.size, found=self._size)
                    self.n_frames, self.n_records = frames, records
                    return
                if tag != FRAME_TAG:
                    self._damage(frames, off, f"bad frame tag {tag!r}",
                                 at_tail=off + FRAME_HEAD.size >= self._size)
                    break
                _, n, plen, crc = FRAME_HEAD.unpack(head)
                end = off + FRAME_HEAD.size + plen
                if not 1 <= n <= MAX_FRAME_RECORDS or plen == 0:
                    self._damage(frames, off, f"bad frame header (records {n}, payload "
                                 f"{plen} bytes)", at_tail=end >= self._size)
                    break
                payload = f.read(plen)
                if len(payload) < plen:
                    self._damage(frames, off, f"truncated frame ({len(payload)} of {plen} "
                                 f"payload bytes)", at_tail=True)
                    break
                at_tail = end == self._size
                try:
                    # zstd allocates what the frame declares, whatever max_output_size says
                    declared = zstandard.frame_content_size(payload)
                    if declared not in (-1, n * RECORD_DTYPE.itemsize):
                        self._damage(frames, off, "frame checksum or size mismatch (corrupt "
                                     f"frame: zstd declares {declared} bytes)", at_tail)
                        break
                    raw = dctx.decompress(payload, max_output_size=n * RECORD_DTYPE.itemsize)
                except zstandard.ZstdError as e:
                    self._damage(frames, off, f"zstd payload does not decode ({e})", at_tail)
                    break
                if len(raw) != n * RECORD_DTYPE.itemsize or zlib.crc32(raw) != crc:
                    self._damage(frames, off, "frame checksum or size mismatch (corrupt "
                                 "frame)", at_tail)
                    break
                rec = np.frombuffer(raw, RECORD_DTYPE)
                why = _bad_records(rec, self.header, self.version)
                if why:
                    raise FormatError(f"frame {frames} at byte offset {off}: out-of-range "
                                      f"{why}", path=self.path, tensor=f"frame {frames}")
                yield rec if predictions else rec[rec["phase"] != PHASE_PREDICTED]
                frames += 1
                records += n
                off = end
        self.n_frames, self.n_records = frames, records

    def read_all(self, predictions: bool = False) -> np.ndarray:
        """Every request (RECORD_DTYPE; with ``predictions`` every record), in order."""
        parts = list(self.iter_frames(predictions))
        return np.concatenate(parts) if parts else np.empty(0, RECORD_DTYPE)

    def layer_expert_keys(self) -> np.ndarray:
        """(requests,) int64 replay keys layer * n_experts + expert, in request order."""
        ne = self.header.n_experts
        parts = [r["layer"].astype(np.int64) * ne + r["expert"] for r in self.iter_frames()]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)
