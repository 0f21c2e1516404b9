"""The state a K3 sequence carries between forward calls (model.md §6).

Owns: per KDA layer the recurrent S [H, D, D] and the short-conv history (the last K-1
PRE-activation inputs of q, k, v, oldest first); per MLA layer the latent cache
[positions, kv_lora] (normalised) and the shared key slice [positions, rope] (raw); the
position counter, the token ids fed so far and the logits of the last position fed, and
which images' rows it holds (``media``: position, rows, digest; such a state is not saved).
Saving and loading (formats/state.md), a draft model's context for the sequence with
the rest when it covers every position (``draft``: opaque here but for its committed rows
and its draft's identity; a loaded one is a ``SavedDraft`` until the draft adopts it).
Does not own: any math, the weights' identities a file records (computed by
``libk3.io.identity`` and ``libk3.draft.checkpoint``, handed in by the caller), or what
the draft's rows mean.

Why a state records its weights' identity: the config fingerprint alone would accept a
state computed by another checkpoint of the same architecture, which generates garbage.
Why it keeps its last logits (``logits``, set by the forward that fed it): a position
cannot be fed twice, so without them a saved state could be continued only with a new
prompt (``k3-run --load-state`` alone continues generating).

AttnRes blocks are not carried: they are rebuilt per token (model.md §6).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

from ..config import K3_CONTEXT, K3Config
from ..errors import FormatError, UsageError
from ..io.atomic import replacing

STATE_MAGIC = b"K3STATE\0"
STATE_VERSION = 5
READ_VERSIONS = (4, 5)                      # v4: the same without a draft context
# The trained context (model.md §2.1, max_position_embeddings): the most positions a state
# holds and the most tokens a run generates.
MAX_POSITIONS = K3_CONTEXT
_PREFIX = struct.Struct("<8sII")            # magic, version, header bytes
_DIGEST_BYTES = 32                          # sha256 of everything before it
_HEADER_KEYS = {4: ("arrays", "fingerprint", "ids", "pos", "weights"),
                5: ("arrays", "draft", "fingerprint", "ids", "pos", "weights")}
_DRAFT_KEYS = ("identity", "latent", "layers", "rope")
_DRAFT_DIM_MAX = 1 << 16                    # of a draft's layers and row widths, at most
# ids of MAX_POSITIONS tokens as JSON (at most 7 digits and a separator each), with room
MAX_HEADER_BYTES = 16 << 20
_HASH_CHUNK = 16 << 20
_FINITE_CHUNK = 1 << 20                     # values checked at a time (bounded temporaries)
LOGITS = "logits"                           # the array of the last position's logits


def array_layout(cfg: K3Config, pos: int, draft: dict | None = None) -> list:
    """[(name, shape)] of a state file's arrays in file order (formats/state.md);
    ``draft``: the header's ``draft`` object (None: no draft context)."""
    H, D, P, K = cfg.num_heads, cfg.head_dim, cfg.kda_dim, cfg.short_conv_kernel_size
    layers = range(cfg.num_hidden_layers)
    out = []
    for L in (L for L in layers if not cfg.is_mla(L)):
        out += [(f"kda_S.{L}", (H, D, D)), (f"kda_conv.{L}", (3, P, K - 1))]
    for L in (L for L in layers if cfg.is_mla(L)):
        out += [(f"mla_latent.{L}", (pos, cfg.kv_lora_rank)),
                (f"mla_rope.{L}", (pos, cfg.qk_rope_head_dim))]
    out.append((LOGITS, (min(pos, 1), cfg.vocab_size)))
    if draft is not None:
        out += [("draft_latent", (draft["layers"], pos, draft["latent"])),
                ("draft_rope", (draft["layers"], pos, draft["rope"]))]
    return out


class SavedDraft:
    """A draft context read from a state file: its draft's identity and the committed
    rows, latent [layers, pos, kv_lora] and k_pe [layers, pos, rope] (formats/state.md),
    for the draft that has that identity to adopt."""

    def __init__(self, identity: str, latent: np.ndarray, k_pe: np.ndarray):
        self.identity, self.latent, self.k_pe = identity, latent, k_pe
        self.length = latent.shape[1]

    def copy(self) -> "SavedDraft":
        return SavedDraft(self.identity, self.latent.copy(), self.k_pe.copy())

    def nbytes(self) -> int:
        return self.latent.nbytes + self.k_pe.nbytes


class State:
    def __init__(self, cfg: K3Config, capacity: int = 64):
        self.cfg = cfg
        self.pos = 0
        self.ids: list[int] = []
        self.logits = None       # float32 [vocab]: the last fed position's (None at pos 0)
        self.draft = None        # a draft model's context for this sequence (module doc)
        self.media: list = []    # (pos, rows, digest) of each image's rows it holds
        H, D, P, K = cfg.num_heads, cfg.head_dim, cfg.kda_dim, cfg.short_conv_kernel_size
        self.kda_S = {}
        self.kda_conv = {}
        self.mla_latent = {}
        self.mla_rope = {}
        for L in range(cfg.num_hidden_layers):
            if cfg.is_mla(L):
                self.mla_latent[L] = np.zeros((capacity, cfg.kv_lora_rank), np.float32)
                self.mla_rope[L] = np.zeros((capacity, cfg.qk_rope_head_dim), np.float32)
            else:
                self.kda_S[L] = np.zeros((H, D, D), np.float32)
                self.kda_conv[L] = np.zeros((3, P, K - 1), np.float32)   # q, k, v: [C, K-1] oldest first

    def reserve(self, n_new: int) -> None:
        """Make room in every MLA cache for ``n_new`` more positions (capacity doubles)."""
        need = self.pos + n_new
        for L, lat in self.mla_latent.items():
            if lat.shape[0] < need:
                cap = max(need, 2 * lat.shape[0])
                for store in (self.mla_latent, self.mla_rope):
                    old = store[L]
                    new = np.zeros((cap, old.shape[1]), np.float32)
                    new[:self.pos] = old[:self.pos]
                    store[L] = new

    def copy(self) -> "State":
        """An independent state at the same position (MLA caches trimmed to ``pos``)."""
        new = State.__new__(State)
        new.cfg, new.pos, new.ids = self.cfg, self.pos, list(self.ids)
        new.logits = None if self.logits is None else self.logits.copy()
        new.draft = None if self.draft is None else self.draft.copy()
        new.media = list(self.media)
        new.kda_S = {L: a.copy() for L, a in self.kda_S.items()}
        new.kda_conv = {L: a.copy() for L, a in self.kda_conv.items()}
        new.mla_latent = {L: a[:self.pos].copy() for L, a in self.mla_latent.items()}
        new.mla_rope = {L: a[:self.pos].copy() for L, a in self.mla_rope.items()}
        return new

    def nbytes(self) -> int:
        arrays = (self.kda_S, self.kda_conv, self.mla_latent, self.mla_rope)
        return sum(a.nbytes for d in arrays for a in d.values()) + \
            (0 if self.logits is None else self.logits.nbytes) + \
            (0 if self.draft is None else self.draft.nbytes())

    def _array(self, name: str) -> np.ndarray:
        """The live array a state-file array name refers to (MLA: the first pos rows;
        the logits as [1, vocab], or [0, vocab] at position 0)."""
        if name in ("draft_latent", "draft_rope"):
            rows = self.draft.latent if name == "draft_latent" else self.draft.k_pe
            return rows[:, :self.pos]
        if name == LOGITS:
            if not self.pos:
                return np.zeros((0, self.cfg.vocab_size), np.float32)
            if self.logits is None:
                raise ValueError("a state fed without the forward has no last logits")
            return self.logits.reshape(1, -1)
        kind, L = name.rsplit(".", 1)
        arr = getattr(self, kind)[int(L)]
        return arr[:self.pos] if kind.startswith("mla") else arr

    # ---- persistence (formats/state.md) ----------------------------------------------
    def draft_identity(self) -> str | None:
        """The identity of the draft whose context a save would keep: the context's when it
        covers every position fed, else None (a context that does not is of no use: the
        draft stays off for the sequence)."""
        d = self.draft
        if d is None or not self.pos or d.length != self.pos:
            return None
        return getattr(d, "identity", None)

    def _draft_header(self):
        """The header's ``draft`` object: the draft context's identity and row shapes, or
        None (``draft_identity``)."""
        if self.draft_identity() is None:
            return None
        d = self.draft
        return {"identity": d.identity, "layers": int(d.latent.shape[0]),
                "latent": int(d.latent.shape[2]), "rope": int(d.k_pe.shape[2])}

    def save(self, path, weights_identity: str) -> None:
        """Write atomically: prefix, header JSON (fingerprint, ``weights_identity`` of the
        weights that computed this state, pos, ids, the draft context's identity and
        shapes or null, arrays), the arrays as little-endian float32, then the sha256 of
        all of it. A state holding image rows is refused: its ids alone (pad ids where
        the rows stand) do not say which image it holds (formats/model/vision.md §8.3)."""
        if self.media:
            raise UsageError(f"{path}: this state holds image rows, which a state file "
                             "cannot name: it is not saved (formats/model/vision.md §8.3)")
        draft = self._draft_header()
        layout = array_layout(self.cfg, self.pos, draft)
        meta = {"fingerprint": self.cfg.fingerprint(), "weights": weights_identity,
                "pos": self.pos, "ids": self.ids, "draft": draft,
                "arrays": [[name, "F32", list(shape)] for name, shape in layout]}
        head = json.dumps(meta, sort_keys=True).encode()
        digest = hashlib.sha256()
        with replacing(path) as f:
            for part in [_PREFIX.pack(STATE_MAGIC, STATE_VERSION, len(head)) + head] + [
                    # the array's own bytes, not a copy (a cache's first rows are contiguous)
                    memoryview(np.ascontiguousarray(self._array(name), dtype="<f4")).cast("B")
                    for name, _ in layout]:
                f.write(part)
                digest.update(part)
            f.write(digest.digest())

    @classmethod
    def load(cls, cfg: K3Config, path, weights_identity: str) -> "State":
        """Read a state saved for ``cfg`` by weights whose identity is ``weights_identity``
        (``libk3.io.identity.weights_identity``). The framing, every header field against
        the config and the identity, and the file's size against the header are checked
        before any array is allocated; the arrays are then read in place and hashed as
        they land (one pass over the file), the checksum compared, and each array refused
        if it holds NaN or Inf (formats/state.md, invariants); any failure is a
        FormatError naming the file."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head, meta, layout = _checked_header(f, cfg, path, weights_identity,
                                                     digest=False)
                st = cls(cfg, capacity=max(64, meta["pos"]))
                st.pos, st.ids = meta["pos"], meta["ids"]
                st.logits = np.zeros(cfg.vocab_size, np.float32) if st.pos else None
                d = meta["draft"]
                if d is not None:
                    st.draft = SavedDraft(
                        d["identity"], np.zeros((d["layers"], st.pos, d["latent"]), np.float32),
                        np.zeros((d["layers"], st.pos, d["rope"]), np.float32))
                f.seek(0)
                sha = hashlib.sha256(f.read(_PREFIX.size + len(head)))
                for name, _ in layout:
                    dest = memoryview(st._array(name)).cast("B")
                    if f.readinto(dest) != dest.nbytes:
                        raise FormatError("state file is truncated", path=path, tensor=name)
                    sha.update(dest)
                if f.read(_DIGEST_BYTES) != sha.digest():
                    raise _checksum_error(path)
                for name, _ in layout:
                    arr = st._array(name)
                    if sys.byteorder == "big":
                        arr.byteswap(inplace=True)
                    if not _all_finite(arr):
                        raise FormatError(f"state array {name} holds NaN or Inf", path=path,
                                          hint="it was saved from damaged weights or "
                                               "altered: re-create it")
        except OSError as e:
            raise FormatError(f"cannot read state file: {e.strerror or e}", path=path) from None
        return st


def check_file(cfg: K3Config, path, weights_identity: str) -> dict:
    """``State.load``'s checks that read only the header (framing, the header against
    ``cfg`` and ``weights_identity``, the file's size; not the checksum or the arrays'
    values, which ``load`` checks): the header, or a FormatError naming the file. Why: a
    run checks a state it was asked to load before compiling or reading anything for the
    model, so a state of another model is refused at once."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _checked_header(f, cfg, path, weights_identity, digest=False)[1]
    except OSError as e:
        raise FormatError(f"cannot read state file: {e.strerror or e}", path=path) from None


def _checked_header(f, cfg: K3Config, path, weights_identity: str, digest: bool = True):
    """(header bytes, header, array layout) of an open state file, every check that
    reads no array's values done."""
    size = os.fstat(f.fileno()).st_size
    version, head = _read_header(f, size, path, digest)
    meta = _check_meta(cfg, head, version, path, weights_identity)
    layout = array_layout(cfg, meta["pos"], meta["draft"])
    need = _PREFIX.size + len(head) + sum(
        4 * int(np.prod(shape, dtype=np.int64)) for _, shape in layout) + _DIGEST_BYTES
    if size != need:
        raise FormatError("state file size does not match its arrays "
                          "(truncated or trailing bytes)", path=path,
                          expected=f"{need} bytes", found=f"{size} bytes")
    return head, meta, layout


def read_meta(path, check: bool = False) -> dict:
    """A state file's header (formats/state.md) without a model: what ``k3-pack cache``
    lists. With ``check``, also the checksum and that every array its header lists is
    finite and fits the file (what needs no model to tell); FormatError naming the file
    otherwise. The model-specific checks are ``State.load``'s."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            version, head = _read_header(f, size, path, digest=check)
            meta = _header_json(head, version, path)
            if check:
                _check_arrays(f, meta, _PREFIX.size + len(head), size, path)
    except OSError as e:
        raise FormatError(f"cannot read state file: {e.strerror or e}", path=path) from None
    return meta


def _check_arrays(f, meta: dict, start: int, size: int, path) -> None:
    """Every array the header lists is float32, fills the file exactly, and is finite."""
    try:
        shapes = [(str(name), [int(d) for d in shape]) for name, dtype, shape in meta["arrays"]
                  if dtype == "F32"]
    except (TypeError, ValueError):
        shapes = None
    if shapes is None or len(shapes) != len(meta["arrays"]) or any(
            d < 0 for _, shape in shapes for d in shape):
        raise FormatError("state arrays list is malformed", path=path)
    need = start + sum(4 * int(np.prod(shape, dtype=np.int64)) for _, shape in shapes) \
        + _DIGEST_BYTES
    if need != size:
        raise FormatError("state file size does not match its arrays", path=path,
                          expected=f"{need} bytes", found=f"{size} bytes")
    f.seek(start)
    for name, shape in shapes:
        left = int(np.prod(shape, dtype=np.int64))
        while left:
            n = min(left, _FINITE_CHUNK)
            a = np.frombuffer(f.read(4 * n), dtype="<f4")
            if a.size != n:
                raise FormatError("state file is truncated", path=path, tensor=name)
            if not np.isfinite(a).all():
                raise FormatError(f"state array {name} holds NaN or Inf", path=path)
            left -= n


def _read_header(f, size: int, path, digest: bool = True) -> tuple:
    """Check the prefix, the header length and (``digest``) the checksum; -> (version,
    the header bytes)."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size or prefix[:8] != STATE_MAGIC:
        raise FormatError("not a k3 state file (empty, or bad magic)", path=path,
                          expected=repr(STATE_MAGIC), found=repr(prefix[:8]))
    _, version, hlen = _PREFIX.unpack(prefix)
    if version not in READ_VERSIONS:
        raise FormatError(f"state format version {version} is not read by this k3",
                          path=path, expected=STATE_VERSION, found=version,
                          hint="it was saved by an older k3: re-create it with this one "
                               "(run its prompt again with --save-state)"
                          if version < STATE_VERSION else "use the k3 that saved it")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen + _DIGEST_BYTES > size:
        raise FormatError("state header length runs past the file (truncated?)", path=path,
                          expected=f"<= {min(MAX_HEADER_BYTES, size - _PREFIX.size - 32)}",
                          found=hlen)
    if not digest:
        return version, f.read(hlen)
    sha = hashlib.sha256(prefix)
    left = size - _PREFIX.size - _DIGEST_BYTES
    while left > 0:
        chunk = f.read(min(_HASH_CHUNK, left))
        if not chunk:
            raise FormatError("state file is truncated", path=path)
        sha.update(chunk)
        left -= len(chunk)
    if f.read(_DIGEST_BYTES) != sha.digest():
        raise _checksum_error(path)
    f.seek(_PREFIX.size)
    return version, f.read(hlen)


def _checksum_error(path) -> FormatError:
    return FormatError("state checksum mismatch (the file is damaged or incomplete)",
                       path=path)


def _all_finite(a: np.ndarray) -> bool:
    """No NaN or Inf in ``a``, checked in slices so the temporary stays small."""
    flat = a.reshape(-1)
    return all(np.isfinite(flat[i:i + _FINITE_CHUNK]).all()
               for i in range(0, flat.size, _FINITE_CHUNK))


def _header_json(head: bytes, version: int, path) -> dict:
    """The header's JSON object, holding exactly the keys of its format version (a v4
    header gets ``draft`` null)."""
    try:
        meta = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"state header is not valid JSON ({type(e).__name__})",
                          path=path) from None
    keys = _HEADER_KEYS[version]
    if not isinstance(meta, dict) or sorted(meta) != list(keys):
        raise FormatError("state header fields wrong", path=path, expected=", ".join(keys),
                          found=", ".join(sorted(meta)) if isinstance(meta, dict)
                          else type(meta).__name__)
    meta.setdefault("draft", None)
    return meta


def _check_meta(cfg: K3Config, head: bytes, version: int, path, weights_identity: str) -> dict:
    """The header, every field checked against ``cfg`` and ``weights_identity``
    (formats/state.md, invariant 4)."""
    meta = _header_json(head, version, path)
    if meta["fingerprint"] != cfg.fingerprint():
        raise FormatError("state was saved for a different model configuration", path=path,
                          hint="load it with the model it was saved from")
    if meta["weights"] != weights_identity:
        raise FormatError("state was computed with other weights (a checkpoint of the same "
                          "configuration with other content)", path=path,
                          expected=f"weights {weights_identity[:16]}",
                          found=f"weights {str(meta['weights'])[:16]}",
                          hint="load it with the checkpoint it was saved from")
    pos, ids = meta["pos"], meta["ids"]
    if type(pos) is not int or not 0 <= pos <= MAX_POSITIONS:
        raise FormatError("state position out of range", path=path,
                          expected=f"an integer 0..{MAX_POSITIONS}", found=repr(pos)[:40])
    if not isinstance(ids, list) or len(ids) != pos or not all(
            type(i) is int and 0 <= i < cfg.vocab_size for i in ids):
        raise FormatError("state ids must be the pos token ids fed so far", path=path,
                          expected=f"{pos} ids in 0..{cfg.vocab_size - 1}",
                          found=f"{len(ids) if isinstance(ids, list) else type(ids).__name__}"
                                " entries")
    _check_draft(meta["draft"], path)
    want = [[name, "F32", list(shape)] for name, shape in array_layout(cfg, pos, meta["draft"])]
    got = meta["arrays"]
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None) \
            if isinstance(got, list) else None
        if i is None:
            raise FormatError("state arrays do not match the model", path=path,
                              expected=f"{len(want)} arrays",
                              found=f"{len(got)} arrays" if isinstance(got, list)
                              else type(got).__name__)
        raise FormatError("state array does not match the model", path=path,
                          tensor=want[i][0], expected=want[i], found=repr(got[i])[:80])
    return meta


def _check_draft(draft, path) -> None:
    """The header's ``draft``: null, or the draft's identity (64 hex digits) and its
    row shapes, each an integer 1..65536 (the file's size then bounds the arrays)."""
    if draft is None:
        return
    ok = isinstance(draft, dict) and sorted(draft) == list(_DRAFT_KEYS)
    ok = ok and isinstance(draft["identity"], str) and len(draft["identity"]) == 64 and \
        all(c in "0123456789abcdef" for c in draft["identity"])
    ok = ok and all(type(draft[k]) is int and 1 <= draft[k] <= _DRAFT_DIM_MAX
                    for k in ("layers", "latent", "rope"))
    if not ok:
        raise FormatError("state draft context header is malformed", path=path,
                          expected="null, or identity (64 hex digits), layers, latent, "
                                   f"rope (integers 1..{_DRAFT_DIM_MAX})",
                          found=repr(draft)[:80])
