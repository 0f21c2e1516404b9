"""What a pack must say (formats/pack.md): the layout a checkpoint implies, the pack's
identity, and the checks every pack passes before anything reads through it.

Owns: the pack's file names, versions (v2 raw trunk, v3 compressed) and record layout,
the compressed trunk's block index (trunk.blocks); the layer plan and index records
a checkpoint implies (the writer writes exactly these, the reader compares against
them); comparing the identity the pack records with the checkpoint's; reading
trunk.json and experts.idx and refusing, as a FormatError naming the file and field,
anything the format does not allow; ``open_pack``, the one gate k3-run and
``k3-pack verify`` both go through, so verify never passes a pack k3-run refuses.
Does not own: typed field access and strict JSON reading (``libk3.pack.fields``), copying
or re-reading trunk bytes (``libk3.pack.writer``), streaming
(``libk3.stream``), the inventory a config implies (``libk3.io.inventory``), the
identity itself (config fingerprint plus sampled content of every shard:
``libk3.io.identity``).

Why every field is checked before use: the manifest's numbers become file offsets and
array shapes, and a wrong one read another tensor's bytes or failed deep in a run
(bench/README.md "Pack integrity" counts what damaged packs did before these checks).
Why the pack stores its config: plain ``k3-pack verify`` (no checkpoint at hand) can then
check every layer's tensor table against the inventory that config implies.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from pathlib import Path

import numpy as np

from .. import names
from ..config import config_from_dict
from ..errors import ConfigError, FormatError
from ..io import inventory
from ..io.identity import shard_digest
from . import codec as trunk_codec, stripes
from .fields import REPACK_HINT, Fields, first_diff, parse_json, read_file, show
from ..io.direct import ALIGN, align_up

PACK_FORMAT = "k3-pack"
PACK_VERSION = 2                 # a raw trunk (trunk.bin); also experts.idx's version
COMPRESSED_VERSION = 3           # a compressed trunk (trunk.kz + trunk.blocks)
TRUNK_FILE, MANIFEST_FILE, EXPERT_INDEX_FILE = "trunk.bin", "trunk.json", "experts.idx"
COMPRESSED_TRUNK_FILE, BLOCK_INDEX_FILE = "trunk.kz", "trunk.blocks"
EXPERT_INDEX_MAGIC = b"K3EXPIDX"
EXPERT_RECORD = np.dtype([("shard", "<u2"), ("layer", "<u2"), ("expert", "<u4"),
                          ("offset", "<u8"), ("nbytes", "<u8"), ("sub", "<u4", (6,))])

_MANIFEST_KEYS = ("format", "version", "align", "source", "config", "trunk_file",
                  "trunk_bytes", "expert_index", "model_level", "layers")
_LAYER_KEYS = ("layer", "shard", "run_start", "nbytes", "padded", "file_off", "crc32", "tensors")
_CODEC_KEYS = ("name", "block_bytes", "min_coded_bytes", "block_index", "block_index_bytes",
               "block_index_crc32")
_TENSOR_KEYS = ("off", "nbytes", "dtype", "shape")
_MODEL_LEVEL_KEYS = ("shard", "offset", "nbytes", "dtype", "shape")
_INDEX_KEYS = ("version", "shards", "n_layers", "n_experts", "moe_layers", "parts",
               "records", "record_bytes")


# ---- the layout a checkpoint implies (written by libk3.pack.writer, compared here) ----------

@dataclasses.dataclass
class LayerPlan:
    layer: int
    shard: str             # file name inside the checkpoint directory
    run_start: int         # absolute offset of the run in the shard
    nbytes: int            # run length (unpadded)
    file_off: int          # offset in trunk.bin (multiple of ALIGN)
    tensors: dict          # suffix -> {off, nbytes, dtype, shape}

    def entry(self, crc32: int) -> dict:
        """This layer's row of trunk.json's ``layers``."""
        return {"layer": self.layer, "shard": self.shard, "run_start": self.run_start,
                "nbytes": self.nbytes, "padded": align_up(self.nbytes),
                "file_off": self.file_off, "crc32": crc32, "tensors": self.tensors}


def plan_pack(ckpt) -> list:
    """Layer runs and their places in trunk.bin; refuses non-contiguous runs."""
    plans, off = [], 0
    for L in range(ckpt.config.num_hidden_layers):
        path, start, nbytes, tensors = ckpt.layer_trunk_run(L)
        prefix = names.layer_prefix(L)
        tmap = {name[len(prefix):]: {"off": sub, "nbytes": nb, "dtype": dt, "shape": list(sh)}
                for name, (sub, nb, dt, sh) in tensors.items()}
        plans.append(LayerPlan(L, Path(path).name, start, nbytes, off, tmap))
        off += align_up(nbytes)
    return plans


def model_level_entries(ckpt) -> dict:
    """trunk.json's ``model_level``: where the tensors a pack indexes but does not copy live."""
    out = {}
    for name in names.MODEL_LEVEL:
        e = ckpt.entry(name)
        out[name] = {"shard": Path(e.path).name, "offset": e.offset, "nbytes": e.nbytes,
                     "dtype": e.dtype, "shape": list(e.shape)}
    return out


def _expert_parts(cfg) -> list:
    shapes = inventory.expert_shapes(cfg)
    return [[w, p, list(shapes[(w, p)]), math.prod(shapes[(w, p)])] for w, p in names.EXPERT_PARTS]


def expert_index_contents(ckpt) -> tuple:
    """(header dict, records) of experts.idx for ``ckpt``: MoE layer-major, then expert id."""
    cfg = ckpt.config
    t = ckpt.expert_table()
    moe = list(cfg.moe_layers)
    shards = [Path(p).name for p in ckpt.shards]          # name order, as source.shards
    rec = np.zeros(len(moe) * cfg.num_experts, EXPERT_RECORD)
    if moe:
        rows = np.asarray(moe)
        shard_of_path = np.array([shards.index(Path(p).name) for p in t.paths], np.int64)
        rec["shard"] = shard_of_path[t.shard[rows].reshape(-1)]
        rec["layer"] = np.repeat(rows, cfg.num_experts)
        rec["expert"] = np.tile(np.arange(cfg.num_experts), len(moe))
        rec["offset"] = t.offset[rows].reshape(-1)
        rec["nbytes"] = t.nbytes[rows].reshape(-1)
        rec["sub"] = t.part_offset[rows].reshape(-1, len(names.EXPERT_PARTS))
    head = {"version": PACK_VERSION, "shards": shards, "n_layers": cfg.num_hidden_layers,
            "n_experts": cfg.num_experts, "moe_layers": moe, "parts": _expert_parts(cfg),
            "records": int(rec.size), "record_bytes": EXPERT_RECORD.itemsize}
    return head, rec


# ---- reading and checking ------------------------------------------------------------

@dataclasses.dataclass
class PackIndex:
    """A checked pack: its manifest, the config it stores, and the expert index."""
    dir: Path
    manifest: dict
    config: object
    index_header: dict
    records: np.ndarray
    blocks: list | None = None     # a compressed pack: each layer's BlockPlan, with its index
    stripes: object = None         # a striped trunk: its checked stripes.Layout

    @property
    def compressed(self) -> bool:
        return self.blocks is not None


def open_pack(pack_dir, ckpt=None, stripe_dirs=None) -> PackIndex:
    """Read and check trunk.json and experts.idx; with ``ckpt``, also require that the pack
    was made from exactly that checkpoint (identity, every layer row and tensor entry,
    every model-level entry, every expert record). Raises FormatError naming the file and
    field of the first problem. Trunk bytes are not read (their CRCs are checked by the
    reader of each layer: ``libk3.stream.trunk`` and ``libk3.pack.writer.verify``). A
    striped trunk's files are checked too (``stripe_dirs``: where they are now)."""
    d = Path(pack_dir)
    man, cfg = _load_manifest(d)
    if ckpt is not None:
        _check_source(d, man["source"], ckpt)
        _check_layout(d / MANIFEST_FILE, man, ckpt)
    head, rec = _load_expert_index(d, man, cfg)
    if ckpt is not None:
        _check_records(d / EXPERT_INDEX_FILE, rec, ckpt)
    blocks = _load_block_index(d, man) if man["version"] == COMPRESSED_VERSION else None
    lay = stripes.open_layout(d, man, stripe_dirs) if "stripes" in man else None
    return PackIndex(d, man, cfg, head, rec, blocks, lay)


def load_manifest(pack_dir) -> dict:
    """trunk.json, checked against the schema, its stored config and trunk.bin's size."""
    return _load_manifest(Path(pack_dir))[0]


def load_expert_index(pack_dir):
    """(header dict, records ndarray of EXPERT_RECORD) from experts.idx, checked."""
    d = Path(pack_dir)
    man, cfg = _load_manifest(d)
    return _load_expert_index(d, man, cfg)


def _check_version(f: Fields, v, field: str, readable=(PACK_VERSION,)) -> None:
    if type(v) is int and 1 <= v < PACK_VERSION:
        raise FormatError(f"pack format v{v} is from an older k3 (this one reads "
                          f"v{PACK_VERSION})", path=f.path, hint=REPACK_HINT)
    if type(v) is not int or v not in readable:
        f.fail(field, "unsupported pack version", expected=" or ".join(map(str, readable)),
               found=v)


def _load_manifest(d: Path):
    p = d / MANIFEST_FILE
    if not p.is_file():
        raise FormatError("no trunk.json: not a finished pack", path=d,
                          hint="run `k3-pack CHECKPOINT OUT` (it resumes an interrupted pack)")
    doc = parse_json(read_file(p, "trunk.json"), p, "trunk.json")
    f = Fields(p)
    if type(doc) is not dict:
        f.fail("trunk.json", "must be a JSON object", found=doc)
    f.eq(doc.get("format"), PACK_FORMAT, "format", "not a k3 pack manifest")
    _check_version(f, doc.get("version"), "version", (PACK_VERSION, COMPRESSED_VERSION))
    compressed = doc["version"] == COMPRESSED_VERSION
    f.obj(doc, "trunk.json", _MANIFEST_KEYS + (("trunk_codec",) if compressed else ())
          + (("stripes",) if "stripes" in doc else ()))      # formats/pack.md "Striped trunk"
    f.eq(doc["align"], ALIGN, "align")
    f.eq(doc["trunk_file"], COMPRESSED_TRUNK_FILE if compressed else TRUNK_FILE, "trunk_file")
    if compressed:
        _check_codec_schema(f, doc["trunk_codec"])
    f.eq(doc["expert_index"], EXPERT_INDEX_FILE, "expert_index")
    sizes = _check_source_schema(f, doc["source"])
    if type(doc["config"]) is not dict:
        f.fail("config", "must be a JSON object", found=doc["config"])
    try:
        cfg = config_from_dict(doc["config"], source=f"{p} (config)")
    except ConfigError as e:
        f.fail("config", e.message)
    diff = first_diff(cfg.to_flat_dict(), doc["config"], "config")
    if diff:
        f.fail(diff[0], "is not what k3-pack writes for this config (the flat config.json "
               "form)", expected=show(diff[1]), found=diff[2])
    f.eq(cfg.fingerprint(), doc["source"]["config_fingerprint"], "source.config_fingerprint",
         "does not match the stored config")
    ml = f.obj(doc["model_level"], "model_level", names.MODEL_LEVEL)
    for spec in inventory.model_level(cfg):
        fld = f"model_level[{spec.name}]"
        ent = ml[spec.name]
        f.obj(ent, fld, _MODEL_LEVEL_KEYS)
        if f.file_name(ent["shard"], f"{fld}.shard") not in sizes:
            f.fail(f"{fld}.shard", "not a shard of source.shards", found=ent["shard"])
        f.tensor(ent, fld, "offset", spec, cfg, sizes[ent["shard"]])
    layers = f.list(doc["layers"], "layers")
    if len(layers) != cfg.num_hidden_layers:
        f.fail("layers", "one row per layer of the config", expected=cfg.num_hidden_layers,
               found=len(layers))
    end = 0
    for i, lay in enumerate(layers):
        end = _check_layer(f, i, lay, cfg, sizes, end, compressed)
    f.eq(doc["trunk_bytes"], end, "trunk_bytes", "is not where the last layer ends")
    if "stripes" in doc:            # its files are checked by open_pack (stripes.open_layout)
        stripes.check_field(f, doc["stripes"], doc["trunk_file"], end)
        return doc, cfg
    trunk = d / doc["trunk_file"]
    size = trunk.stat().st_size if trunk.is_file() else None
    if size is None:
        raise FormatError(f"{doc['trunk_file']} is missing or not a file", path=trunk,
                          hint=REPACK_HINT)
    if size != end:
        raise FormatError(f"{doc['trunk_file']} size does not match the manifest", path=trunk,
                          expected=end, found=size)
    return doc, cfg


def _check_source_schema(f: Fields, src) -> dict:
    """{shard name: size} of ``source``, after checking its form."""
    f.obj(src, "source", ("config_fingerprint", "shards"))
    f.hex64(src["config_fingerprint"], "source.config_fingerprint")
    shards = f.list(src["shards"], "source.shards")
    if not shards:
        f.fail("source.shards", "must name at least one shard")
    sizes, prev = {}, None
    for i, s in enumerate(shards):
        fld = f"source.shards[{i}]"
        f.obj(s, fld, ("name", "size", "sampled_sha256"))
        name = f.file_name(s["name"], f"{fld}.name")
        if prev is not None and name <= prev:
            f.fail(f"{fld}.name", "shard names must be unique and in name order", found=name)
        sizes[name] = f.int(s["size"], f"{fld}.size")
        f.hex64(s["sampled_sha256"], f"{fld}.sampled_sha256")
        prev = name
    return sizes


def _check_codec_schema(f: Fields, codec) -> None:
    """``trunk_codec``: this k3's codec and block plan, and the block index's size and CRC."""
    f.obj(codec, "trunk_codec", _CODEC_KEYS)
    for k, want in trunk_codec.codec_params().items():
        f.eq(codec[k], want, f"trunk_codec.{k}", "is not the codec this k3 decodes",
             hint=REPACK_HINT.replace("NEW_OUT", "NEW_OUT --compress-trunk"))
    f.eq(codec["block_index"], BLOCK_INDEX_FILE, "trunk_codec.block_index")
    f.int(codec["block_index_bytes"], "trunk_codec.block_index_bytes")
    f.int(codec["block_index_crc32"], "trunk_codec.block_index_crc32", hi=0xFFFFFFFF)


def _check_layer(f: Fields, i: int, lay, cfg, sizes: dict, end: int,
                 compressed: bool = False) -> int:
    """One row of ``layers``; returns where it ends in the trunk file."""
    fld = f"layers[{i}]"
    f.obj(lay, fld, _LAYER_KEYS + (("stored",) if compressed else ()))
    f.eq(lay["layer"], i, f"{fld}.layer", "layers must be listed in order, from 0")
    shard = f.file_name(lay["shard"], f"{fld}.shard")
    if shard not in sizes:
        f.fail(f"{fld}.shard", "not a shard of source.shards", found=shard)
    start = f.int(lay["run_start"], f"{fld}.run_start")
    nbytes = f.int(lay["nbytes"], f"{fld}.nbytes", lo=1)
    if start + nbytes > sizes[shard]:
        f.fail(f"{fld}.nbytes", "the run ends past the end of its shard",
               expected=f"<= {sizes[shard] - start}", found=nbytes)
    held = f.int(lay["stored"], f"{fld}.stored", lo=1) if compressed else nbytes
    f.eq(lay["padded"], align_up(held), f"{fld}.padded",
         f"is not {'stored' if compressed else 'nbytes'} rounded up to 4096")
    f.eq(lay["file_off"], end, f"{fld}.file_off",
         "layers must follow each other in trunk.bin without gaps, 4096-aligned")
    f.int(lay["crc32"], f"{fld}.crc32", hi=0xFFFFFFFF)
    specs = {s.name[len(names.layer_prefix(i)):]: s for s in inventory.layer_trunk(cfg, i)}
    tensors = f.obj(lay["tensors"], f"{fld}.tensors", tuple(specs))
    spans = []
    for sfx, spec in specs.items():
        tfld = f"{fld}.tensors[{sfx}]"
        t = f.tensor(f.obj(tensors[sfx], tfld, _TENSOR_KEYS), tfld, "off", spec, cfg, nbytes)
        spans.append((t["off"], t["nbytes"], sfx))
    pos = 0
    for off, nb, sfx in sorted(spans):
        if nb and off != pos:
            f.fail(f"{fld}.tensors[{sfx}].off",
                   "tensors must tile the run without gaps or overlaps", expected=pos, found=off)
        pos = max(pos, off + nb)
    f.eq(nbytes, pos, f"{fld}.nbytes", "is not the sum of its tensors")
    return end + align_up(held)


def layer_block_plan(lay: dict):
    """The BlockPlan (without its index) of a checked manifest's layer row."""
    return trunk_codec.plan_blocks([(sfx, t["off"], t["nbytes"], t["dtype"])
                                    for sfx, t in lay["tensors"].items()])


def _load_block_index(d: Path, man: dict) -> list:
    """Each layer's BlockPlan with its stored lengths and CRCs from trunk.blocks, after
    checking the file's size and CRC against trunk_codec and every layer's lengths."""
    codec = man["trunk_codec"]
    p = d / BLOCK_INDEX_FILE
    blob = read_file(p, BLOCK_INDEX_FILE)
    f = Fields(p)
    plans = [layer_block_plan(lay) for lay in man["layers"]]
    want = sum(len(pl) for pl in plans) * trunk_codec.INDEX_RECORD.itemsize
    f.eq(len(blob), codec["block_index_bytes"], "size", "differs from trunk.json's "
         "trunk_codec.block_index_bytes")
    f.eq(len(blob), want, "size", "is not one record per block the layers' tensors imply")
    crc = zlib.crc32(blob)
    if crc != codec["block_index_crc32"]:
        f.fail("crc32", "does not match trunk.json's trunk_codec.block_index_crc32",
               expected=f"{codec['block_index_crc32']:#010x}", found=f"{crc:#010x}")
    rec = np.frombuffer(blob, trunk_codec.INDEX_RECORD)
    out, at = [], 0
    for lay, pl in zip(man["layers"], plans):
        pl = pl.with_index(rec[at:at + len(pl)])
        at += len(pl)
        L = lay["layer"]
        bad = pl.stored_problem()
        if bad:
            f.fail(f"{pl.where(L, bad[0])}.stored", bad[1], found=int(pl.in_len[bad[0]]))
        total = int(pl.in_len.sum())
        if total != lay["stored"]:
            f.fail(f"layer {L}", "its blocks' stored lengths do not add up to the layer's "
                   "stored bytes", expected=lay["stored"], found=total)
        out.append(pl)
    return out


def _manifest_shards(man: dict) -> list:
    return [s["name"] for s in man["source"]["shards"]]


def _load_expert_index(d: Path, man: dict, cfg):
    p = d / EXPERT_INDEX_FILE
    blob = read_file(p, "experts.idx")
    f = Fields(p)
    if len(blob) < 12 or blob[:8] != EXPERT_INDEX_MAGIC:
        f.fail("magic", "not a k3 expert index", expected=EXPERT_INDEX_MAGIC, found=blob[:8])
    hlen = int.from_bytes(blob[8:12], "little")
    if 12 + hlen > len(blob):
        f.fail("header length", "runs past the end of the file",
               expected=f"<= {len(blob) - 12}", found=hlen)
    head = parse_json(blob[12:12 + hlen], p, "the expert index header")
    if type(head) is not dict:
        f.fail("header", "must be a JSON object", found=head)
    _check_version(f, head.get("version"), "version")
    f.obj(head, "header", _INDEX_KEYS)
    f.eq(head["record_bytes"], EXPERT_RECORD.itemsize, "record_bytes")
    shards = _manifest_shards(man)
    f.eq(head["shards"], shards, "shards", "must list trunk.json's source shards in order")
    f.eq(head["n_layers"], cfg.num_hidden_layers, "n_layers", "differs from the pack's config")
    f.eq(head["n_experts"], cfg.num_experts, "n_experts", "differs from the pack's config")
    moe = list(cfg.moe_layers)
    f.eq(head["moe_layers"], moe, "moe_layers", "differs from the pack's config")
    parts = _expert_parts(cfg)
    f.eq(head["parts"], parts, "parts", "differs from the expert shapes of the pack's config")
    f.eq(head["records"], len(moe) * cfg.num_experts, "records",
         "is not one per expert of every MoE layer")
    body = memoryview(blob)[12 + hlen:]
    if len(body) != head["records"] * EXPERT_RECORD.itemsize:
        f.fail("records", "file size does not match the record count",
               expected=f"{head['records'] * EXPERT_RECORD.itemsize} bytes of records",
               found=f"{len(body)} bytes")
    rec = np.frombuffer(body, dtype=EXPERT_RECORD)
    _check_record_schema(f, rec, cfg, moe, shards, man, parts)
    return head, rec


def _check_record_schema(f: Fields, rec, cfg, moe, shards, man, parts) -> None:
    """Vectorised: records in order, shard indexes in range, runs inside their shard, the
    six parts tiling each run."""
    if not rec.size:
        return
    n_exp = cfg.num_experts
    sizes = np.array([s["size"] for s in man["source"]["shards"]], np.uint64)
    part_nbytes = np.array([p[3] for p in parts], np.uint64)
    in_range = rec["shard"] < len(shards)
    shard_size = sizes[np.where(in_range, rec["shard"], 0)]
    order = np.argsort(rec["sub"], axis=1, kind="stable")
    sub = np.take_along_axis(rec["sub"].astype(np.uint64), order, axis=1)
    ends = sub + part_nbytes[order]
    checks = [
        ("layer", rec["layer"] == np.repeat(np.asarray(moe), n_exp), "records must be MoE "
         "layer-major"),
        ("expert", rec["expert"] == np.tile(np.arange(n_exp), len(moe)), "records must be in "
         "expert order within a layer"),
        ("shard", in_range, f"shard index outside 0..{len(shards) - 1}"),
        ("nbytes", rec["nbytes"] == np.uint64(cfg.expert_bytes), "is not the size of one expert"),
        ("offset", (rec["offset"] <= shard_size - np.minimum(rec["nbytes"], shard_size)),
         "the run ends past the end of its shard"),
        ("sub", (sub[:, 0] == 0) & (sub[:, 1:] == ends[:, :-1]).all(axis=1)
         & (ends[:, -1] == rec["nbytes"]), "the six parts must tile the run"),
    ]
    for field, ok, problem in checks:
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            r = rec[i]
            f.fail(f"record {i} (layer {int(r['layer'])} expert {int(r['expert'])}).{field}",
                   problem, found=r[field].tolist())


def _check_source(d: Path, src: dict, ckpt) -> None:
    ident = ckpt.identity()
    if src["config_fingerprint"] != ident["config_fingerprint"]:
        raise FormatError("this pack was built from a different checkpoint (its config "
                          "differs)", path=d, hint="re-run k3-pack for this checkpoint")
    have, want = [[s["name"], s["size"]] for s in src["shards"]], ident["shards"]
    if have != want:
        i = next(i for i in range(max(len(have), len(want)))
                 if i >= len(have) or i >= len(want) or have[i] != want[i])
        raise FormatError("this pack was built from a different checkpoint (its shard list "
                          "or sizes differ)", path=d,
                          expected=show(have[i] if i < len(have) else None),
                          found=show(want[i] if i < len(want) else None),
                          hint="re-run k3-pack for this checkpoint")
    for s, path in zip(src["shards"], ckpt.shards):
        if shard_digest(ckpt, path, s["size"]) != s["sampled_sha256"]:
            raise FormatError(f"this pack was built from a different checkpoint: shard "
                              f"{s['name']} has other content (sampled blocks differ)", path=d,
                              hint="re-run k3-pack for this checkpoint")


def _check_layout(p: Path, man: dict, ckpt) -> None:
    """Every layer row, tensor entry and model-level entry as this checkpoint implies."""
    for plan, lay in zip(plan_pack(ckpt), man["layers"]):
        want = plan.entry(lay["crc32"])
        if "stored" in lay:              # a compressed trunk's place is its own (checked)
            want = {**want, "padded": lay["padded"], "file_off": lay["file_off"],
                    "stored": lay["stored"]}
        diff = first_diff(want, lay, f"layers[{plan.layer}]")
        if diff:
            raise FormatError(f"{diff[0]}: differs from the checkpoint", path=p,
                              expected=show(diff[1]), found=show(diff[2]),
                              hint="the pack does not belong to this checkpoint: re-pack")
    diff = first_diff(model_level_entries(ckpt), man["model_level"], "model_level")
    if diff:
        raise FormatError(f"{diff[0]}: differs from the checkpoint", path=p,
                          expected=show(diff[1]), found=show(diff[2]),
                          hint="the pack does not belong to this checkpoint: re-pack")


def _check_records(p: Path, rec, ckpt) -> None:
    _, want = expert_index_contents(ckpt)
    for field in EXPERT_RECORD.names:
        bad = want[field] != rec[field]
        if bad.ndim > 1:
            bad = bad.any(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FormatError(f"record {i} (layer {int(want[i]['layer'])} expert "
                              f"{int(want[i]['expert'])}).{field}: differs from the checkpoint",
                              path=p, expected=want[i][field].tolist(),
                              found=rec[i][field].tolist(),
                              hint="the pack does not belong to this checkpoint: re-pack")


def crc_mismatch(path, layer: int, want: int, found: int) -> FormatError:
    """The one error for a packed trunk layer whose bytes differ from the manifest's CRC
    (raised here at run time and by ``k3-pack verify``)."""
    return FormatError(f"layer {layer}: trunk bytes do not match the manifest's checksum "
                       "(crc32)",
                       path=path, expected=f"{want:#010x}", found=f"{found:#010x}",
                       hint="the pack is damaged: re-pack (k3-pack verify names every bad layer)")
