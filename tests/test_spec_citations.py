"""Every spec citation in the repository resolves into formats/model/model.md, dspark.md or vision.md.

Code, tests and docs cite the model spec as ``model.md §N`` (or ``§N.M``; a list may go on
``, §N.M``), the draft's spec as ``dspark.md §N`` and the image input's as ``vision.md §N``. This scans every .py and .md file of
the repository and fails on a cited section that the named page does not have, on a bare
``§N`` that does not say which document it means (a spec page's own bare ``§N`` means
itself), on the retired citation forms (``spec 5.3``, ``spec §5``, ``spec-8.5``),
and on any mention of a document or folder outside the repository (the old spec's file
name, the shared conformance folder) except in tests/conformance.py, which loads those
vectors. In the code (libk3/, tools/) it also fails on history and measurements, whose
places are git and bench/README.md: an issue number, the prior-art or draft documents
by name, and a figure of speed or time (MB/s, GB/s, ms, µs, s/token, tokens/s, "3x
faster").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "formats" / "model" / "model.md"
# The pages a citation may name, by the name it uses; each resolves in formats/.
PAGES = ("model.md", "dspark.md", "vision.md")
# The one module allowed to know where the shared conformance vectors live.
LOADER = Path("tests") / "conformance.py"
SKIP_DIRS = {".git", ".venv", "venv", "scratch", "build", "dist", "__pycache__",
             ".pytest_cache", ".hypothesis"}

HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.M)
SECTION = re.compile(r"§ ?(\d+(?:\.\d+)*)")
# A uniform citation: "model.md §5.3", optionally continued as a list or a range.
CITATION = re.compile(r"(model|dspark|vision)\.md §\d+(?:\.\d+)*(?:(?:, | and | or |-)§\d+(?:\.\d+)*)*")
# Retired forms: "spec 5.3", "Spec 7.4", "spec §5", "spec-8.5" (not the --spec option).
OLD_FORM = re.compile(r"(?<![-\w])spec[ -]?§? ?\d|spec PRIOR-ART", re.I)
# Built from parts so that this file does not trip its own check.
FOREIGN = re.compile("|".join((re.escape("K3-" + "MODEL"), re.escape(".." + "/shared"))))
CODE = ("libk3", "tools")
HISTORY = re.compile(r"\bissues? \d+|\bissue-\d+|" + "PRIOR" + "-ART|" + "DSPARK" + "-K3", re.I)
FIGURE = re.compile(r"\d[\d,.]*\s?(?:MB/s|GB/s|ms\b|µs|s/token|tokens/s)"
                    r"|\d[\d.]*x (?:faster|slower|longer)")


def spec_sections(spec: Path = SPEC) -> set:
    """Section numbers of the numbered headings of the spec."""
    return set(HEADING.findall(spec.read_text(encoding="utf-8")))


def scanned_files(root: Path = ROOT):
    """Every .py and .md file of the tree, except this checker (virtualenvs, caches and
    scratch models are not walked)."""
    me = Path(__file__).resolve()
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(top) / name
            if path.suffix in (".py", ".md") and path.resolve() != me:
                yield path.relative_to(root)


def problems(root: Path = ROOT, spec: Path = SPEC) -> list:
    """One line per bad citation: 'path:line: what is wrong'. ``spec`` is the model page;
    the other pages of PAGES are looked for beside it (absent: no sections)."""
    pages = {name: spec.parent / name for name in PAGES}
    sections = {name: spec_sections(p) if p.is_file() else set() for name, p in pages.items()}
    own = {p.relative_to(root): name for name, p in pages.items()}
    out = []
    for rel in scanned_files(root):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{n}"
            cited = [(c.span(), c.group(1) + ".md") for c in CITATION.finditer(line)]
            for m in SECTION.finditer(line):
                page = next((name for (a, b), name in cited if a <= m.start() < b),
                            own.get(rel))
                if page is None:
                    out.append(f"{where}: bare §{m.group(1)}; write 'model.md §N', "
                               "'dspark.md §N' or 'vision.md §N'")
                elif m.group(1) not in sections[page]:
                    out.append(f"{where}: §{m.group(1)} is not a section of formats/{page}")
            for m in OLD_FORM.finditer(line):
                out.append(f"{where}: old citation form {m.group(0)!r}; write 'model.md §N'")
            if rel != LOADER:
                for m in FOREIGN.finditer(line):
                    out.append(f"{where}: mentions {m.group(0)!r}, which is not in the repository")
            if rel.parts[0] in CODE and rel.suffix == ".py":
                for m in HISTORY.finditer(line):
                    out.append(f"{where}: history in code ({m.group(0)!r}); git keeps it")
                for m in FIGURE.finditer(line):
                    out.append(f"{where}: a measurement in code ({m.group(0)!r}); "
                               "bench/README.md keeps it")
    return out


def test_spec_citations_all_resolve_into_model_md():
    """Catches a citation of a section model.md lacks, the old 'spec N' form, a bare '§N',
    and a reference to the old spec file or the shared folder outside the loader."""
    bad = problems()
    assert not bad, f"{len(bad)} bad citations:\n" + "\n".join(bad[:60])


def test_spec_citations_model_md_has_the_cited_sections():
    """Catches a renumbered spec: the sections the code leans on most must exist."""
    sections = spec_sections()
    for s in ("2.1", "2.2", "3.4", "4.1", "4.2", "5.0", "5.3", "5.5", "5.6", "5.8", "6",
              "7.2", "7.3", "8.2", "8.5", "10"):
        assert s in sections, s


def test_spec_citations_checker_control(tmp_path):
    """Control: the checker reports each kind of fault it exists for, and passes a clean
    tree, so the test above cannot pass by scanning nothing."""
    (tmp_path / "formats").mkdir()
    spec = tmp_path / "formats" / "model.md"
    spec.write_text("# Model\n\n## 1. One\n\n### 1.2 Sub\n\nSee §1.2.\n", encoding="utf-8")
    good = tmp_path / "good.py"
    (tmp_path / "formats" / "dspark.md").write_text("# Draft\n\n## 2. Two\n\nSee §2.\n",
                                                    encoding="utf-8")
    good.write_text('"""Cites model.md §1.2 and model.md §1, §1.2, dspark.md §2; run with '
                    '--spec 4."""\n')
    assert problems(tmp_path, spec) == []
    faults = {
        "missing.py": "# model.md §7.3\n",
        "draft_missing.py": "# dspark.md §1.2\n",
        "bare.md": "see §1.2\n",
        "old.py": "# (spec 1.2)\n",
        "oldmark.md": "spec §1\n",
        "foreign.md": "read " + "K3-" + "MODEL.md\n",
        "shared.py": "# loads " + ".." + "/shared/conformance\n",
        "libk3/history.py": "# fixed in issue " + "12\n",
        "libk3/prior.py": "# as " + "PRIOR" + "-ART 3 says\n",
        "tools/figure.py": "# reads at 1,878 " + "MB/s here\n",
        "libk3/faster.py": "# 3x " + "faster than before\n",
    }
    for name, text in faults.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    found = problems(tmp_path, spec)
    for name in faults:
        assert any(p.startswith(name + ":") for p in found), (name, found)
    assert not any(p.startswith("good.py") for p in found), found
