"""k3-run's image options (formats/model/vision.md §8-§9): ``--image``, ``--vision-dump`` and
``--image-dir``, which options they go with, and a prompt's images read and put at its pads.

Owns: the three options' declarations and rules, and turning raw prompt mode's text ids and
image files into the expanded ids and rows the run generates from. Does not own: reading
or encoding images (``libk3.run.images``) or the run (``libk3.run.runner``).
"""

from __future__ import annotations

import click

from k3cli import constraints

RULES = (
    constraints.GoesWith(("image",), ("prompt_arg", "prompt", "prompt_file", "ids", "chat"),
                         "--image goes with a prompt (-p, -f or --ids) or --chat (its first "
                         "message; later ones: /image PATH)"),
    constraints.GoesWith(("vision_dump",), ("image",), "--vision-dump goes with --image"),
    constraints.Excludes("chat", ("vision_dump",), "--vision-dump goes with a prompt "
                         "(-p, -f or --ids)"),
    constraints.GoesWith(("image_dir",), ("serve_address", "batch"),
                         "--image-dir goes with --serve or --batch (the directory their "
                         "requests' image paths are read from)"),
    constraints.Excludes("image", ("save_state",), "--image excludes --save-state: a state "
                         "file cannot name the image it holds (formats/model/vision.md §8.3)"),
)


def image_options(f):
    """The three options, on the command ``f``."""
    f = click.option("--image-dir", type=click.Path(exists=True, file_okay=False),
                     help="With --serve or --batch: image parts may name files in this "
                          "directory (a path relative to it, or inside it; symlinks resolved, "
                          "nothing outside it read). Without it only data: URLs are read "
                          "(docs/serve.md \"Images\").")(f)
    f = click.option("--vision-dump", type=click.Path(dir_okay=False),
                     help="With --image: write each image's pixels, grid, tower rows, "
                          "projected rows and the ids around it as .npz "
                          "(formats/model/vision.md §9).")(f)
    return click.option("--image", "image", multiple=True, type=click.Path(dir_okay=False),
                        help="An image the prompt (with --chat: the first message) begins "
                             "with (repeatable, in order), in the model's image markup before "
                             "the text (docs/run.md \"Images\"). The checkpoint must have a "
                             "vision tower.")(f)


def prompt_images(a, run, prompt_ids: list, gen: int) -> tuple:
    """(expanded ids, ImageRows) of raw prompt mode: each ``--image`` in the release's
    markup, then the text ids; the expanded length checked against the context. The
    images' report entries are kept in ``a.image_report``."""
    a.image_report = []
    if not a.image:
        return prompt_ids, []
    from libk3.run.images import Images, report_entry, write_dump
    images = Images(run.session)
    loaded = [images.load(path) for path in a.image]
    a.image_report = [report_entry(im) for im in loaded]
    ids = images.raw_prompt(loaded, prompt_ids)
    expanded, rows = images.expand(ids, loaded)
    run.check_fits(len(expanded), gen)
    if a.vision_dump:
        write_dump(a.vision_dump, loaded, ids, images.pad)
    return expanded, rows
