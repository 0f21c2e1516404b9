"""Vision tower (issue 47 item 3): seconds for one image through the tower, merger and
projector at Kimi K3's published dimensions, and the engine's error against the float64
reference there.

Weights are random BF16 arrays at the published shapes (``libk3.synth.presets.VISIONS``
"real-dims", the release's ``vision_config``), drawn at the synthetic checkpoints' scales
(formats/model/vision.md §3.4), held in memory (0.9 GB): no checkpoint is written. Images are
random-noise PNGs of each size through ``libk3.media.preprocess_image`` (512² becomes a
38 × 38 patch grid, 1024² 74 × 74).

1. For each image size and thread count: preprocessing seconds, then the tower, the
   merger and projector, and their sum (best of ``--rounds``), with the patches L, the
   rows N and the CPU seconds of the tower and projector (all threads: on a busy machine
   the wall time at one thread overstates what a quiet one takes; the CPU time does not).
2. The engine against ``libk3.model.vision_reference`` on a small grid (``--ref-grid``):
   max |engine − reference| / max |reference| of the tower rows and the projected rows.

    python bench/vision.py [--sizes 512,1024] [--threads 1,2] [--rounds 1]
                           [--ref-grid 4x4] [--seed 0] [--blocks N]

``--blocks N`` runs the tower with its first N blocks only and scales the tower's seconds
by B / N (every block costs the same; the patch embedding and final norm are a small
part), for a busy machine where the whole tower at 1024² takes too long; the table says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402

from libk3.io.dtypes import bf16_to_f32, f32_to_bf16  # noqa: E402
from libk3.io.inventory import vision_specs  # noqa: E402
from libk3.k3_dims import MEDIA_PROC, real_config  # noqa: E402
from libk3.media.preprocess import preprocess_image  # noqa: E402
from libk3.model import vision_reference as ref  # noqa: E402
from libk3.model.vision import VisionTower, merge  # noqa: E402
from libk3.synth.presets import VISIONS  # noqa: E402
from libk3.vision_config import media_from_dict, vision_from_dict  # noqa: E402

_WIDE = ("patch_embed.proj.weight", "wqkv.weight", "mlp.fc0.weight")


def real_vision():
    text = real_config()
    media = media_from_dict({"media_proc_cfg": dict(MEDIA_PROC)}, source="<published>")
    doc = {"vision_config": dict(VISIONS["real-dims"]),
           "media_placeholder_token_id": text.vocab_size - 235}
    return vision_from_dict(doc, text, media, source="<published vision_config>")


def random_weights(vcfg, seed: int) -> dict:
    """BF16 bits at every published shape; the position table and norm gains float32."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in vision_specs(vcfg):
        if len(spec.shape) == 1:
            out[spec.name] = (1 + 0.1 * rng.standard_normal(spec.shape, np.float32))
        elif spec.name.endswith("pos_emb.weight"):
            out[spec.name] = bf16_to_f32(f32_to_bf16(rng.standard_normal(spec.shape, np.float32)))
        else:
            fan_in = int(np.prod(spec.shape[1:]))
            scale = (2.0 if spec.name.endswith(_WIDE) else 1.0) / np.sqrt(fan_in)
            out[spec.name] = f32_to_bf16(rng.standard_normal(spec.shape, np.float32)
                                         * np.float32(scale))
    return out


def noise_png(side: int, seed: int) -> bytes:
    from PIL import Image
    rgb = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cpu_timed(fn):
    """(result, wall seconds, CPU seconds of the process: every thread's)."""
    c0 = time.process_time()
    out, wall = timed(fn)
    return out, wall, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ref-grid", default="4x4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0)
    a = ap.parse_args()
    vcfg = real_vision()
    w, secs = timed(lambda: random_weights(vcfg, a.seed))
    print(f"[setup] random BF16 tower and projector at the published shapes in {secs:.0f} s",
          flush=True)
    tower = VisionTower(vcfg, w)
    timing, factor = tower, 1.0
    if a.blocks:
        timing = VisionTower(dataclasses.replace(vcfg, vt_num_hidden_layers=a.blocks), w)
        factor = vcfg.vt_num_hidden_layers / a.blocks
        print(f"[setup] tower timed on its first {a.blocks} blocks, seconds scaled by "
              f"{factor:.1f}", flush=True)
    m = vcfg.merge_kernel_size[0]
    tiny = np.zeros((4, 3, vcfg.patch_size, vcfg.patch_size), np.float32)
    _, secs = timed(lambda: tower.encode(tiny, (2, 2)))          # compiles or loads the kernels
    print(f"[setup] kernels ready, 2 x 2 grid in {secs:.1f} s", flush=True)
    before = numba.get_num_threads()
    rows = []
    try:
        for side in (int(s) for s in a.sizes.split(",")):
            png = noise_png(side, a.seed)
            for n in (int(t) for t in a.threads.split(",")):
                numba.set_num_threads(n)
                best = None
                for _ in range(a.rounds):
                    px, t_pre = timed(lambda: preprocess_image(png, vcfg.media, f"{side}.png"))
                    t, t_tower, c_tower = cpu_timed(lambda: timing.tower(px.patches, px.grid))
                    t_tower, c_tower = t_tower * factor, c_tower * factor
                    _, t_proj, c_proj = cpu_timed(lambda: tower.project(merge(t, px.grid, m)))
                    run = (t_pre, t_tower, t_proj, c_tower + c_proj)
                    best = run if best is None or sum(run[:3]) < sum(best[:3]) else best
                gh, gw = px.grid
                rows.append([f"{side}x{side}", n, f"{gh}x{gw}", gh * gw,
                             (gh // m) * (gw // m), f"{best[0]:.2f}", f"{best[1]:.1f}",
                             f"{best[2]:.2f}", f"{best[1] + best[2]:.1f}", f"{best[3]:.1f}"])
                print(table(rows[-1:], HEADERS).splitlines()[-1], flush=True)
    finally:
        numba.set_num_threads(before)
    scaled = f", tower scaled from {a.blocks} blocks" if a.blocks else ""
    print(f"\n1. One image, tower + merger + projector, real dimensions (seconds{scaled})\n")
    print(table(rows, HEADERS))

    gh, gw = (int(x) for x in a.ref_grid.split("x"))
    patches = np.random.default_rng(a.seed).uniform(
        -1, 1, (gh * gw, 3, vcfg.patch_size, vcfg.patch_size)).astype(np.float32)
    got, t_eng = timed(lambda: tower.encode(patches, (gh, gw)))

    def get(name):
        x = w[name]
        return (bf16_to_f32(x) if x.dtype == np.uint16 else x).astype(np.float64)
    (t, _, r), t_ref = timed(lambda: ref.encode(vcfg, get, patches, (gh, gw)))
    rel = lambda e, f: float(np.abs(e - f).max() / np.abs(f).max())     # noqa: E731
    print(f"\n2. Engine vs float64 reference, real dimensions, {gh}x{gw} grid "
          f"(engine {t_eng:.1f} s, reference {t_ref:.0f} s)\n")
    print(table([["tower rows", f"{rel(got.tower, t):.2e}"],
                 ["projected rows", f"{rel(got.rows, r):.2e}"]],
                ["output", "max rel. error"]))


HEADERS = ["image", "threads", "grid", "patches L", "rows N", "preprocess s", "tower s",
           "merger+projector s", "total s", "CPU s"]

if __name__ == "__main__":
    main()
