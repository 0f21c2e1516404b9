"""A new user's first steps: the README's two commands (a venv first, CI running the
test command verbatim), where k3-doctor suggests packing, the chat's banner, its word
on the saved state at exit and /stats after /load."""

from __future__ import annotations

import os
import re
from pathlib import Path

from libk3.doctor.report import default_pack_dir

from .scripts import k3_here

ROOT = Path(__file__).resolve().parents[1]


def _two_commands() -> list:
    """The code blocks of the README's "Two commands" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)\n```", section, re.S)


def test_readme_first_command_makes_a_venv_and_ci_runs_the_test_command_verbatim():
    """Catches a first command that installs into the system Python (refused on Debian
    and Ubuntu: externally-managed-environment) and a CI script whose test command
    drifted from the README's."""
    first, tests = _two_commands()
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert first.index("venv") < first.index("pip install") < first.index("k3-run")
    ci = (ROOT / ".ci" / "run").read_text()
    assert ". .venv/bin/activate" in ci
    assert f"{tests} || exit" in ci


def test_doctor_never_suggests_a_pack_inside_a_git_checkout_or_a_read_only_place(tmp_path,
                                                                                  monkeypatch):
    """Catches the sibling MODEL-pack suggested inside a git work tree (gigabytes of
    untracked files) or in a directory this user cannot write; control: beside a model in
    a plain writable directory the sibling is suggested."""
    env = {"HOME": str(tmp_path / "home"), "XDG_DATA_HOME": ""}
    plain = tmp_path / "plain" / "m"
    plain.mkdir(parents=True)
    assert default_pack_dir(plain, env) == plain.with_name("m-pack")
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "fixtures" / "tiny").mkdir(parents=True)
    got = default_pack_dir(repo / "fixtures" / "tiny", env)
    assert got == tmp_path / "home" / ".local" / "share" / "k3" / "packs" / "tiny-pack"
    assert default_pack_dir(ROOT / "fixtures" / "tiny", env).parts[:len(ROOT.parts)] != \
        ROOT.parts
    locked = tmp_path / "locked"
    (locked / "m").mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked
                        else real_access(p, mode))          # as root, chmod stops nothing
    got = default_pack_dir(locked / "m", env)
    assert got.parent == tmp_path / "home" / ".local" / "share" / "k3" / "packs"


def test_chat_banner_names_the_model_and_help_and_exit_says_where_the_state_went(
        tiny_dir, tmp_path):
    """Catches a chat that starts on a bare prompt (no model named, no /help hint) and
    a --save-state written silently at exit; control: without --save-state nothing is
    said about a state."""
    st = tmp_path / "c.k3state"
    p = k3_here(tiny_dir, "--chat", "-n", 2, "--save-state", st, input="Hi\n\n")
    assert p.returncode == 0, p.stderr
    first = p.stderr.splitlines()[0]
    assert "tiny" in first and "/help" in first
    assert f"state saved to {st}" in p.stderr and f"--load-state {st}" in p.stderr
    assert st.is_file()
    q = k3_here(tiny_dir, "--chat", "-n", 2, input="Hi\n\n")
    assert q.returncode == 0 and "state saved" not in q.stderr


def test_chat_stats_after_load_describe_the_loaded_conversation(tiny_dir, tmp_path):
    """Catches /stats after /load showing the previous conversation's last reply and
    turns: after /load it has no reply yet and no turns, and names the state; control:
    before /load it reports the reply."""
    st = tmp_path / "s.k3state"
    k3_here(tiny_dir, "--chat", "-n", 2, "--save-state", st, input="Hello\n\n")
    p = k3_here(tiny_dir, "--chat", "-n", 3,
                input=f"Hi there\nmore\n/stats\n/load {st}\n/stats\n\n")
    assert p.returncode == 0, p.stderr
    before, after = p.stderr.split(f"loaded {st}")
    assert "turns: 2" in before and "last reply: 3 tokens" in before
    assert f"turns: 0 since {st} was loaded" in after
    assert "last reply: none yet" in after
