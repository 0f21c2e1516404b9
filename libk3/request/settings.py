"""A checked request's settings over a run's: the ``GenSettings`` one generation runs with.

Owns: which of a request's fields replace which of the run's settings (a batch line's
over the options, a server request's over the server's defaults). Does not own: checking
the fields (``model``), generation (``libk3.engine.generate``).
"""

from __future__ import annotations

import dataclasses

from ..engine.generate import GenSettings
from ..engine.settings import SAMPLING_RULES, logit_bias_pairs


def settings_over(given: dict, base: GenSettings) -> GenSettings:
    """``base`` with each field ``given`` (a checked request's, in k3's names:
    ``model.Generation.given``) in place of its setting: "gen", the sampling fields, a
    "logit_bias" the whole of --logit-bias ({} none), a "response_format" that of
    --response-format ({"type": "text"} none), non-empty "stop" strings and "stop_ids"."""
    fields = {key: given[key] for key in ("gen", *SAMPLING_RULES)
              if given.get(key) is not None}
    if given.get("logit_bias") is not None:
        fields["logit_bias"] = logit_bias_pairs(given["logit_bias"])
    if given.get("response_format") is not None:
        fields["response_format"], fields["grammar"] = given["response_format"], None
    if given.get("stop"):
        fields["stop_strings"] = tuple(given["stop"])
    if given.get("stop_ids") is not None:
        fields["stop_ids"] = tuple(given["stop_ids"])
    return dataclasses.replace(base, **fields)
