"""k3-doctor's drive placement: where a pack's trunk should go when several drives are at
hand (the pack directory and each ``--stripe`` directory, or an existing striped pack's
stripe directories), the ``k3-pack --stripe`` command that puts it there, and the
warning when two stripe directories share one device.

Owns: grouping directories by device (st_dev of their nearest existing ancestor), the
placements compared (the trunk on each drive alone, over every drive, over every drive
but the checkpoint's) and the pick. Does not own: measuring the drives
(``libk3.machine.storage``), the per-token arithmetic (``advice.placement_estimate``) or
the stripe layout (``libk3.pack.stripes``).

Why leave the checkpoint's drive out as a candidate: experts are read from the shards
whatever the trunk does, so a trunk striped onto that drive competes with them there;
the estimate decides whether the extra drive is still worth it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..machine import storage
from .advice import placement_estimate


def device(path) -> int:
    return os.stat(storage.existing_ancestor(Path(path))).st_dev


def shared_device_warnings(dirs) -> list:
    """One warning per stripe directory on the same device as an earlier one: striping
    over two directories of one drive reads no faster than one."""
    seen, out = {}, []
    for d in dirs:
        dev = device(d)
        if dev in seen:
            out.append(f"stripe directories {seen[dev]} and {d} are on one device "
                       f"(st_dev {dev}): striping over them reads no faster than one; "
                       "give each stripe its own drive")
        else:
            seen[dev] = d
    return out


def pack_stripe_dirs(pack_dir) -> list:
    """An existing striped pack's stripe directories (after its own), as its manifest
    records them; [] for an unstriped, unfinished or unreadable pack (k3-run and verify
    do the checking)."""
    try:
        man = json.loads((Path(pack_dir) / "trunk.json").read_text())
        files = man["stripes"]["files"][1:]
        return [Path(pack_dir) / e["dir"] if not os.path.isabs(e["dir"]) else Path(e["dir"])
                for e in files]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def placement(stores: list, est: dict | None, expert_bytes: int, model_dir, pack_dir,
              stripe_dirs) -> dict | None:
    """The trunk placements over the pack directory and ``stripe_dirs`` (each drive once),
    their estimated s/token at the pick's budget (``est``: its single-drive estimate),
    and the fastest (the fewest drives on a tie); None without two drives or without an
    estimate. ``stores``: the report's storage sections (each has ``device`` and, when
    measured, ``reads``)."""
    if est is None or model_dir is None:
        return None
    speed = {}
    for s in stores:
        r = s.get("reads")
        if r and r.get("seq_best_bps"):
            speed.setdefault(s["device"], (r["seq_best_bps"], r.get("rand_best_bps")))
    cands, devs = [], []
    for d in [Path(pack_dir), *map(Path, stripe_dirs)]:
        dev = device(d)
        if dev not in devs and dev in speed:
            devs.append(dev)
            cands.append(d)
    model_dev = device(model_dir)
    if len(cands) < 2 or model_dev not in speed or not speed[model_dev][1]:
        return None
    options = [[c] for c in cands] + [cands]
    away = [c for c in cands if device(c) != model_dev]
    if 1 < len(away) < len(cands):
        options.append(away)
    rows = []
    for opt in options:
        e = placement_estimate(est, {device(c): speed[device(c)][0] for c in opt},
                               (model_dev, speed[model_dev][1]), expert_bytes)
        rows.append({"trunk_dirs": [str(c) for c in opt], **e})
    best = min(rows, key=lambda r: (round(r["seconds_per_token"], 6), len(r["trunk_dirs"])))
    return {"options": rows, "pick": best, "stripe_args": best["trunk_dirs"][1:],
            "pack_dir": best["trunk_dirs"][0]}
