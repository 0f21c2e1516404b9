"""The state a K3 sequence carries between forward calls (spec K3-MODEL.md section 6).

Owns: per KDA layer the recurrent S [H, D, D] and the short-conv history (the last K-1
PRE-activation inputs of q, k, v, oldest first); per MLA layer the latent cache
[positions, kv_lora] (normalised) and the shared key slice [positions, rope] (raw); the
position counter and the token ids fed so far. Saving and loading (formats/state.md).
Does not own: any math.

AttnRes blocks are not carried: they are rebuilt per token (spec 6).
"""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..config import K3Config
from ..errors import FormatError

STATE_MAGIC = b"K3STATE\0"
STATE_VERSION = 1


class State:
    def __init__(self, cfg: K3Config, capacity: int = 64):
        self.cfg = cfg
        self.pos = 0
        self.ids: list[int] = []
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

    def snapshot(self):
        """What a rollback needs: position, ids, and copies of the KDA state. MLA rows past
        ``pos`` are simply overwritten later, so they need no copy."""
        return (self.pos, len(self.ids), {L: S.copy() for L, S in self.kda_S.items()},
                {L: c.copy() for L, c in self.kda_conv.items()})

    def restore(self, snap) -> None:
        pos, n_ids, S, conv = snap
        self.pos = pos
        del self.ids[n_ids:]
        for L in S:
            self.kda_S[L][...] = S[L]
            self.kda_conv[L][...] = conv[L]

    def nbytes(self) -> int:
        return sum(a.nbytes for d in (self.kda_S, self.kda_conv, self.mla_latent, self.mla_rope)
                   for a in d.values())

    # ---- persistence (formats/state.md) ----------------------------------------------
    def save(self, path) -> None:
        """Write atomically: magic, version, header JSON (fingerprint, pos, ids), arrays."""
        meta = {"fingerprint": self.cfg.fingerprint(), "pos": self.pos, "ids": self.ids}
        arrays = {}
        for L in sorted(self.kda_S):
            arrays[f"kda_S.{L}"] = self.kda_S[L]
            arrays[f"kda_conv.{L}"] = self.kda_conv[L]
        for L in sorted(self.mla_latent):
            arrays[f"mla_latent.{L}"] = self.mla_latent[L][:self.pos]
            arrays[f"mla_rope.{L}"] = self.mla_rope[L][:self.pos]
        meta["arrays"] = [[k, list(v.shape)] for k, v in arrays.items()]
        head = json.dumps(meta, sort_keys=True).encode()
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(STATE_MAGIC + struct.pack("<II", STATE_VERSION, len(head)) + head)
            for v in arrays.values():
                f.write(np.ascontiguousarray(v, dtype="<f4").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, cfg: K3Config, path) -> "State":
        path = Path(path)
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise FormatError(f"cannot read state file: {e.strerror}", path=path) from None
        if len(blob) < 16 or blob[:8] != STATE_MAGIC:
            raise FormatError("not a k3 state file (bad magic)", path=path)
        version, hlen = struct.unpack("<II", blob[8:16])
        if version != STATE_VERSION:
            raise FormatError("unsupported state version", path=path,
                              expected=STATE_VERSION, found=version)
        try:
            meta = json.loads(blob[16:16 + hlen])
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FormatError("state header is not valid JSON", path=path) from None
        if meta.get("fingerprint") != cfg.fingerprint():
            raise FormatError("state was saved for a different model configuration", path=path,
                              hint="load it with the model it was saved from")
        st = cls(cfg, capacity=max(64, meta["pos"]))
        st.pos, st.ids = meta["pos"], list(meta["ids"])
        buf = io.BytesIO(blob[16 + hlen:])
        for key, shape in meta["arrays"]:
            n = int(np.prod(shape)) * 4
            raw = buf.read(n)
            if len(raw) != n:
                raise FormatError("state file is truncated", path=path, tensor=key)
            arr = np.frombuffer(raw, dtype="<f4").reshape(shape)
            kind, L = key.rsplit(".", 1)
            store = getattr(st, kind)
            if int(L) not in store:
                raise FormatError("state array for an unknown layer", path=path, tensor=key)
            if kind.startswith("mla"):
                store[int(L)][:st.pos] = arr
            else:
                if store[int(L)].shape != arr.shape:
                    raise FormatError("state array has the wrong shape", path=path, tensor=key,
                                      expected=store[int(L)].shape, found=arr.shape)
                store[int(L)][...] = arr
        if buf.read(1):
            raise FormatError("state file has trailing bytes", path=path)
        return st
