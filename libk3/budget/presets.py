"""The preset file (``libk3/presets.yaml``, formats/presets.md): named budgets, the
``auto`` rule's parameters and the overhead accounting, read and validated strictly.

Owns: the file's layout and every rule about its keys, the unit (decimal GB) and the
preset names. Does not own: what a budget means for a model (``plan``, ``admission``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

from ..errors import FormatError

GB = 1e9                              # presets.yaml and every flag count decimal GB
PRESETS_FILE = Path(__file__).parent.parent / "presets.yaml"
PRESET_FORMAT, PRESET_VERSION = "k3-presets", 1
NAMED = ("laptop", "desktop", "workstation", "server", "max")   # smallest to largest
PRESET_NAMES = NAMED + ("auto",)
FLAG_KEYS = ("preset", "trunk_gb", "cache_gb")     # the tokens of ``order``
_FLAG_TEXT = {"preset": "--preset", "trunk_gb": "--trunk-gb", "cache_gb": "--cache-gb"}


# ---- the preset file --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Preset:
    """One named budget. ``auto`` has trunk_gb = cache_gb = None (computed)."""

    name: str
    trunk_gb: float | None
    cache_gb: float | None
    description: str


@dataclasses.dataclass(frozen=True)
class Rules:
    """The ``auto`` and ``accounting`` sections of the preset file (formats/presets.md)."""

    headroom_fraction: float       # plan at most this share of usable memory
    cache_floor_bytes: int         # auto keeps at least this much cache when it can
    runtime_reserve_bytes: int     # interpreter, numba, activations, I/O staging
    context_positions: int         # MLA cache positions reserved in the overhead
    source: str


_PRESET_KEYS = ("trunk_gb", "cache_gb", "description")
_AUTO_KEYS = ("description", "headroom_fraction", "cache_floor_gb")
_ACCOUNTING_KEYS = ("runtime_reserve_gb", "context_positions")
_TOP_KEYS = ("format", "version", "presets", "auto", "accounting")


def _read_yaml(path) -> tuple[dict, str]:
    import yaml

    p = Path(path) if path is not None else PRESETS_FILE
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise FormatError(f"cannot read the preset file: {e.strerror}", path=p) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise FormatError(f"preset file is not valid YAML: {' '.join(str(e).split())}",
                          path=p) from None
    if not isinstance(doc, dict):
        raise FormatError("preset file is not a mapping", path=p)
    return doc, str(p)


def _section_problems(where: str, section, keys: tuple) -> list:
    if not isinstance(section, dict):
        return [f"{where} is not a mapping"]
    out = [f"{where}.{k} missing" for k in keys if k not in section]
    out += [f"{where}.{k} unknown" for k in section if k not in keys]
    return out


def _number(where: str, value, problems: list, *, minimum: float = 0.0,
            maximum: float = math.inf, integer: bool = False):
    ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float)))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) \
            or not minimum <= value <= maximum:
        kind = "an integer" if integer else "a number"
        problems.append(f"{where}={value!r} is not {kind} in [{minimum}, {maximum}]")
        return None
    return value


def _validated(path=None) -> tuple[dict, Rules]:
    """Parse and check the whole file; one FormatError listing every problem. A file is
    parsed once per version (path, size, modification time): a run asks for the presets
    and rules from several places."""
    p = Path(path) if path is not None else PRESETS_FILE
    try:
        st = os.stat(p)
    except OSError:
        return _parse(p)                  # the error names the file
    return _parse_version(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parse_version(path: str, size: int, mtime_ns: int) -> tuple[dict, Rules]:
    return _parse(path)


def _parse(path) -> tuple[dict, Rules]:
    doc, src = _read_yaml(path)
    problems = _section_problems("<top>", doc, _TOP_KEYS)
    if doc.get("format", PRESET_FORMAT) != PRESET_FORMAT:
        problems.append(f"format={doc.get('format')!r}, expected {PRESET_FORMAT!r}")
    if "version" in doc and doc["version"] != PRESET_VERSION:
        problems.append(f"version={doc['version']!r}, this k3 reads version {PRESET_VERSION}")
    presets = {}
    table = doc.get("presets", {})
    problems += _section_problems("presets", table, NAMED)
    for name in NAMED:
        entry = table.get(name) if isinstance(table, dict) else None
        if entry is None:
            continue
        where = f"presets.{name}"
        got = _section_problems(where, entry, _PRESET_KEYS)
        problems += got
        if got:
            continue
        trunk = _number(f"{where}.trunk_gb", entry["trunk_gb"], problems)
        cache = _number(f"{where}.cache_gb", entry["cache_gb"], problems)
        if not isinstance(entry["description"], str):
            problems.append(f"{where}.description is not a string")
        presets[name] = Preset(name, trunk, cache, str(entry["description"]))
    auto = doc.get("auto", {})
    auto_gaps = _section_problems("auto", auto, _AUTO_KEYS)
    acc = doc.get("accounting", {})
    acc_gaps = _section_problems("accounting", acc, _ACCOUNTING_KEYS)
    problems += auto_gaps + acc_gaps
    if not auto_gaps:
        head = _number("auto.headroom_fraction", auto["headroom_fraction"], problems,
                       minimum=0.05, maximum=1.0)
        floor = _number("auto.cache_floor_gb", auto["cache_floor_gb"], problems)
        if not isinstance(auto["description"], str):
            problems.append("auto.description is not a string")
    if not acc_gaps:
        reserve = _number("accounting.runtime_reserve_gb", acc["runtime_reserve_gb"],
                          problems)
        ctx = _number("accounting.context_positions", acc["context_positions"], problems,
                      integer=True)
    if problems:
        raise FormatError("invalid preset file: " + "; ".join(problems)
                          + " (k3 refuses to substitute defaults)", path=src)
    presets["auto"] = Preset("auto", None, None, auto["description"])
    rules = Rules(float(head), int(floor * GB), int(reserve * GB), int(ctx), src)
    return presets, rules


def load_presets(path=None) -> dict:
    """{name: Preset} for laptop, desktop, workstation, server, max and auto (in that
    order), from ``path`` or the packaged presets.yaml. FormatError naming the file and
    every missing, unknown or ill-typed key."""
    return _validated(path)[0]


def load_rules(path=None) -> Rules:
    """The auto rule's and the overhead accounting's parameters from the preset file."""
    return _validated(path)[1]
