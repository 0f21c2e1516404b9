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

With --model, instead: Kimi K3's modelled time to first token for one ``--side``² image
(1024) at the laptop preset on this machine, the sum of

* preprocessing, measured here;
* reading the tower and projector (their bytes at ``--drive-gbps``: held once read);
* the tower, merger and projector: the CPU seconds of one ``--from-side``² image (512) at
  one thread (``--tower-cpu S``, section 1's "CPU s", else measured here), split into the
  attention (``vit.attention``, timed here alone on one block at each grid, times B) and
  the rest, which grows with the patches L (every matmul, norm and activation is per
  patch or per merged row); the attention is timed at the larger grid, not scaled; the
  wall seconds are the CPU seconds over the cores (kernels split by rows);
* the language model's prefill of the image's N rows plus ``--text-tokens`` (the
  markup's markers and size text and a short question), priced as
  ``bench/arithmetic.py --model`` prices text (``K3Prefill``: kernel rates measured here,
  one thread, on every core; the laptop preset's chunk; a pass reads the trunk not held
  and its experts' union while it computes and takes the longer).

    python bench/vision.py --model [--side 1024] [--from-side 512] [--tower-cpu S]
                           [--text-tokens 16] [--drive-gbps G]

Without ``--drive-gbps`` the drive is measured as ``bench/arithmetic.py`` measures it
(reading a ``real-dims`` shard, generated on first use).
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


def attention_cpu(vcfg, grid: tuple, seed: int) -> float:
    """CPU seconds of one block's ``vit.attention`` over a grid's patches (random q, k, v)."""
    from libk3.kernels import vit
    L = grid[0] * grid[1]
    H, hd = vcfg.vt_num_attention_heads, vcfg.vt_head_dim
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((H, L, hd), np.float32) for _ in range(3))
    out = np.empty((L, H * hd), np.float32)
    small = np.zeros((H, 4, hd), np.float32)
    vit.attention(small, small, small, 1.0, np.empty((4, H * hd), np.float32))   # loaded
    return cpu_timed(lambda: vit.attention(q, k, v, 1.0 / np.sqrt(hd), out))[2]


def model_section(a) -> None:
    """Kimi K3's time to first token for one image at the laptop preset (module doc)."""
    import math
    import os

    from arithmetic import K3Prefill, drive_rate, rates
    from libk3.budget import vision_bytes
    from common import ROOT, checkpoint
    vcfg = real_vision()
    m, B = vcfg.merge_kernel_size[0], vcfg.vt_num_hidden_layers
    cores = os.cpu_count() or 1
    grids = {}
    for side in (a.from_side, a.side):
        px, t_pre = timed(lambda: preprocess_image(noise_png(side, a.seed), vcfg.media,
                                                   f"{side}.png"))
        grids[side] = (px.grid, t_pre)
    (g0, _), (g1, pre1) = grids[a.from_side], grids[a.side]
    L0, L1 = g0[0] * g0[1], g1[0] * g1[1]
    N1 = (g1[0] // m) * (g1[1] // m)
    if a.tower_cpu is None:
        numba.set_num_threads(1)
        tower = VisionTower(vcfg, random_weights(vcfg, a.seed))
        tower.encode(np.zeros((4, 3, vcfg.patch_size, vcfg.patch_size), np.float32), (2, 2))
        px = preprocess_image(noise_png(a.from_side, a.seed), vcfg.media, "x.png")
        cpu0 = cpu_timed(lambda: tower.encode(px.patches, px.grid))[2]
        del tower
        print(f"[setup] the tower at {a.from_side}² measured here: {cpu0:.1f} CPU s", flush=True)
    else:
        cpu0 = a.tower_cpu
    numba.set_num_threads(1)
    att0, att1 = (B * attention_cpu(vcfg, g, a.seed) for g in (g0, g1))
    rest1 = (cpu0 - att0) * L1 / L0
    tower_cpu = rest1 + att1
    bps = a.drive_gbps * 1e9 if a.drive_gbps else drive_rate(checkpoint("real-dims"))
    tower_bytes = vision_bytes(vcfg)           # as held: a little over the BF16 file's bytes
    lm = K3Prefill()
    r = rates(ROOT)
    n_rows = N1 + a.text_tokens
    lm_s, lm_comp = lm.ttft(r, n_rows, cores, bps)
    parts = [("preprocessing (measured)", pre1),
             (f"reading the tower and projector ({tower_bytes / 1e9:.2f} GB)", tower_bytes / bps),
             (f"tower + merger + projector ({tower_cpu:.0f} CPU s / {cores} cores)",
              tower_cpu / cores),
             (f"LM prefill of {n_rows:,} rows ({math.ceil(n_rows / lm.K)} passes of "
              f"{lm.K}; compute alone {lm_comp / 60:.1f} min)", lm_s)]
    total = sum(s for _, s in parts)
    print(f"\nKimi K3, one {a.side}x{a.side} image at the laptop preset, this machine "
          f"({cores} cores, drive {bps / 1e9:.2f} GB/s)\n")
    print(f"grid {g1[0]}x{g1[1]}: {L1:,} patches, {N1:,} rows into the language model "
          f"(+ {a.text_tokens} text tokens assumed: markup and question)")
    print(f"tower at {a.from_side}² ({g0[0]}x{g0[1]}, {L0:,} patches): {cpu0:.1f} CPU s"
          f"{' (given)' if a.tower_cpu is not None else ''}, of which attention "
          f"{att0:.1f} (timed here, {B} blocks); the rest x {L1 / L0:.2f} (patches) = "
          f"{rest1:.0f} s; attention at {a.side}² {att1:.0f} s (timed here, {B} blocks)")
    print(lm.describe())
    print(f"kernel rates here, one thread: BF16 {r['bf16'][64] / 1e9:.1f} GFLOP/s at 64 "
          f"tokens; MXFP4 " + ", ".join(f"{r['mxfp4'][n] / 1e9:.1f}" for n in (1, 2, 8))
          + f" GFLOP/s at 1, 2, 8 tokens; MLA {r['mla_per_position'] / 1e9:.1f} GFLOP/s\n")
    rows = [[what, f"{s:,.1f}", f"{s / 60:.2f}"] for what, s in parts]
    rows.append(["time to first token", f"{total:,.0f}", f"{total / 60:.1f}"])
    print(table(rows, ["part", "seconds", "minutes"]))
    print("(assumed: the tower's non-attention CPU grows with the patches; its kernels and "
          "the LM's use every core at one core's rate; the LM's passes read with no cache "
          "hits, uniform routing; image rows cost what text tokens do)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true",
                    help="Kimi K3's modelled time to first token for one image (see above)")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--from-side", type=int, default=512)
    ap.add_argument("--tower-cpu", type=float, default=None)
    ap.add_argument("--text-tokens", type=int, default=16)
    ap.add_argument("--drive-gbps", type=float, default=None)
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ref-grid", default="4x4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0)
    a = ap.parse_args()
    if a.model:
        model_section(a)
        return
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
