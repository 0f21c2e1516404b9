"""The --chat REPL (libk3/run/repl.py): reading entries and the commands in process, then
k3-run in a pseudo-terminal (keystrokes in, screen out: history across sessions, Ctrl-C
at the prompt and mid-reply, Ctrl-D, the commands) and from a pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time

import pytest

from libk3.io.identity import weights_identity
from libk3.text.tokenizer import K3Tokenizer
from libk3.run.repl import Command, default_history_path, parse, read_entry, setting
from libk3.text.chat_template import load_chat_template
from .scripts import k3

PAUSE = 0.3     # before each keystroke: a human's pace. CPython's readline loop checks for
#                 a signal only when its select() is interrupted, so a Ctrl-C landing
#                 between two reads of one burst of keys waits for the next key.


# ---- in process: entries, commands, settings -------------------------------------------

def _lines(*lines):
    """A read_line(prompt) giving ``lines``, then EOFError; the prompts go to .asked."""
    it = iter(lines)

    def read_line(prompt):
        read_line.asked.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    read_line.asked = []
    return read_line


def test_repl_entry_continues_after_a_backslash_and_inside_a_block():
    """Catches multi-line input sent line by line, a block whose quotes or edge newlines
    stay in the text, or a plain line waiting for more (control: one line, one prompt)."""
    one = _lines("hello", "next")
    assert read_entry(one) == ("hello", False) and one.asked == ["you> "]
    more = _lines("first \\", "second\\", "third", "next")
    assert read_entry(more) == ("first \nsecond\nthird", False)
    assert more.asked == ["you> ", "... ", "... "]
    assert read_entry(_lines('"""', "a", "", '  b"""')) == ("a\n\n  b", True)
    assert read_entry(_lines('"""', "a", '"""')) == ("a", True)
    assert read_entry(_lines('"""one"""')) == ("one", True)
    assert read_entry(_lines('"""x', '/help"""')) == ("x\n/help", True)
    with pytest.raises(EOFError) as e:
        read_entry(_lines('"""', "never closed"))
    assert type(e.value).__name__ == "Unfinished"


def test_repl_parse_tells_commands_from_messages():
    """Catches a command sent to the model as text, '//' not sending a literal slash, a
    blank entry sent, or a block's leading '/' taken for a command."""
    assert parse("/set  temperature 0.5 ") == Command("set", "temperature 0.5")
    assert parse("/exit") == Command("exit", "")
    assert parse("/system\nBe brief.") == Command("system", "Be brief.")
    assert parse("/") == Command("", "") and parse("/ x") == Command("", "x")
    assert parse("//etc/hosts is a file") == "/etc/hosts is a file"
    assert parse("/help", block=True) == "/help"
    assert parse("") is None and parse("  \n ") is None
    assert parse("a /b") == "a /b"                                            # control


def test_repl_set_checks_values_by_the_option_rules():
    """Catches /set accepting what the k3-run options refuse (a negative temperature, a
    fractional gen, top_p 0), or a value left as text."""
    assert setting("temperature", "0.7") == ("temperature", 0.7)
    assert setting("top-p", "0.9") == ("top_p", 0.9)
    assert setting("seed", "42") == ("seed", 42) and setting("gen", "8") == ("gen", 8)
    for name, raw, why in (("temperature", "-1", "temperature must be"),
                           ("temperature", "nan", "temperature must be"),
                           ("top_p", "0", "top_p must be"), ("gen", "1.5", "gen must be"),
                           ("seed", "-3", "seed must be"), ("speed", "1", "/set takes")):
        with pytest.raises(ValueError, match=why):
            setting(name, raw)


def test_repl_history_lives_in_the_xdg_state_dir():
    """Catches a history file written into the working directory or the cache dir, or a
    relative XDG_STATE_HOME obeyed (the XDG rule: ignore it)."""
    assert str(default_history_path({"XDG_STATE_HOME": "/s", "HOME": "/h"})) == \
        "/s/k3/chat_history"
    assert str(default_history_path({"XDG_STATE_HOME": "rel", "HOME": "/h"})) == \
        "/h/.local/state/k3/chat_history"


# ---- a pseudo-terminal ------------------------------------------------------------------

class Terminal:
    """k3-run with a pseudo-terminal as its controlling terminal, so Ctrl-C reaches it as
    a real terminal's line discipline sends it (SIGINT to the foreground group)."""

    def __init__(self, *args, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                                        # the child: become k3-run
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 500, 0, 0))
                os.execvpe("k3-run", ["k3-run", *map(str, args)], env)
            finally:
                os._exit(127)
        self.screen = ""                    # all output so far
        self.pos = 0                        # where the next expect() looks from
        self.code = None

    def _read(self, deadline) -> bool:
        left = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self.fd], [], [], left)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:                     # EIO: the child closed the terminal
            data = b""
        if not data:
            raise EOFError(f"k3-run ended; screen:\n{self.screen[-2000:]}")
        self.screen += data.decode("utf-8", "replace")
        return True

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """The first match of ``pattern`` (a regex) in the output after the last one."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.screen, self.pos)
            if m:
                self.pos = m.end()
                return m
            if not self._read(deadline) and time.monotonic() >= deadline:
                raise AssertionError(f"no {pattern!r} in {timeout} s; screen:\n"
                                     f"{self.screen[-2000:]}")

    def send(self, keys: str) -> None:
        time.sleep(PAUSE)
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once the child has ended (its output read to the end)."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self._read(deadline)
        except EOFError:
            pid, status = os.waitpid(self.pid, 0)
            self.code = os.waitstatus_to_exitcode(status)
            return self.code
        raise AssertionError(f"k3-run still running after {timeout} s; screen:\n"
                             f"{self.screen[-2000:]}")

    def close(self) -> None:
        if self.code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


PROMPT = r"you> "
UP, CTRL_C, CTRL_D = "\x1b[A", "\x03", "\x04"


@pytest.fixture
def term(tiny_dir, tmp_path):
    """Start k3-run --chat on the tiny model in a terminal, with a private home, state dir
    and no inputrc; every terminal is closed at the end."""
    env = dict(os.environ, TERM="xterm", INPUTRC="/dev/null", HOME=str(tmp_path / "home"),
               XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("K3_CHAT_HISTORY", None)
    started = []

    def start(*args):
        t = Terminal(tiny_dir, "--chat", "--quiet", *args, env=env)
        started.append(t)
        t.expect(PROMPT)
        return t
    yield start
    for t in started:
        t.close()


def _state_ids(tiny_dir, path) -> list:
    from libk3.io.checkpoint import Checkpoint
    from libk3.model.state import State
    with Checkpoint.open(tiny_dir) as ckpt:
        return State.load(ckpt.config, path, weights_identity(ckpt)).ids


def _turn_ids(tiny_dir, messages) -> list:
    """The ids a fresh conversation feeds for ``messages`` (user text sanitised)."""
    tok = K3Tokenizer.from_dir(tiny_dir)
    return load_chat_template(tiny_dir).encode(tok, messages, sanitize=True)


def test_chat_repl_up_arrow_recalls_an_earlier_sessions_line(term, tiny_dir, tmp_path):
    """Catches a chat without line editing (the arrow sent as '^[[A' text) or without a
    history file kept between sessions, and Ctrl-D ending without --save-state."""
    one = term("--gen", 2)
    one.send("what is k3?\r")
    one.expect(PROMPT)
    one.send("/exit\r")
    assert one.wait() == 0, one.screen
    assert "what is k3?" in (tmp_path / "state" / "k3" / "chat_history").read_text()
    st = tmp_path / "s.k3state"
    two = term("--gen", 2, "--save-state", st)
    two.send(UP + UP)                                 # /exit, then the question before it
    two.expect(r"what is k3\?")
    two.send("\r")
    two.expect(PROMPT)
    two.send(CTRL_D)
    assert two.wait() == 0, two.screen
    prompt = _turn_ids(tiny_dir, [{"role": "user", "content": "what is k3?"}])
    ids = _state_ids(tiny_dir, st)
    assert ids[:len(prompt)] == prompt and 1 <= len(ids) - len(prompt) <= 2


def test_chat_repl_ctrl_c_at_the_prompt_clears_the_line(term, tiny_dir, tmp_path):
    """Catches Ctrl-C at the prompt ending the chat (exit 130, the state not saved) or
    leaving the dropped text in the next message."""
    st = tmp_path / "s.k3state"
    t = term("--gen", 2, "--save-state", st)
    t.send("dropped text")
    t.expect("dropped text")
    t.send(CTRL_C)
    t.expect(PROMPT)
    t.send("Hi there\r")
    t.expect(PROMPT)
    t.send(CTRL_D)
    assert t.wait() == 0, t.screen
    prompt = _turn_ids(tiny_dir, [{"role": "user", "content": "Hi there"}])
    assert _state_ids(tiny_dir, st)[:len(prompt)] == prompt


def test_chat_repl_ctrl_c_mid_reply_keeps_the_reply_so_far(term, tiny_dir, tmp_path):
    """Catches Ctrl-C mid-reply killing the session, or a state left mid-token: the turn
    after the cut must be what a run whose --gen ended at the cut token says next."""
    cut = tmp_path / "cut.k3state"
    t = term("--gen", 100000, "--save-state", cut)
    t.send("Tell me a story\r")
    t.expect(r"Tell me a story\r\n[\s\S]{8}")             # the reply has begun
    t.send(CTRL_C)
    n = int(t.expect(r"reply stopped after (\d+) tokens").group(1))
    t.expect(PROMPT)
    t.send("/set gen 6\r")
    t.expect(PROMPT)
    t.send("And then?\r")
    t.expect(PROMPT)
    t.send("/exit\r")
    assert t.wait() == 0, t.screen
    whole = tmp_path / "whole.k3state"
    p = k3(tiny_dir, "--chat", "--gen", n, "--save-state", whole,
           input="Tell me a story\n/set gen 6\nAnd then?\n")
    assert p.returncode == 0, p.stderr
    assert n >= 1 and cut.read_bytes() == whole.read_bytes()


def test_chat_repl_commands_and_the_empty_line(term, tiny_dir, tmp_path):
    """Catches an empty line ending the chat, an unknown command sent to the model, /set
    not changing the next turn, /save not writing the state (as --save-state writes it)
    and /exit not saving --save-state."""
    saved, at_exit = tmp_path / "a.k3state", tmp_path / "b.k3state"
    t = term("--gen", 9, "--save-state", at_exit)
    t.send("\r")
    t.expect(PROMPT)
    t.send("/bogus\r")
    t.expect(r"error: unknown command /bogus")
    t.send("/set gen 2\r")
    t.expect(r"[\r\n]gen 2\r\n")                          # the note, not the echo
    t.send("Hi there\r")
    t.expect(PROMPT)
    t.send(f"/save {saved}\r")
    t.expect(r"saved ")
    t.send("/exit\r")
    assert t.wait() == 0, t.screen
    prompt = _turn_ids(tiny_dir, [{"role": "user", "content": "Hi there"}])
    ids = _state_ids(tiny_dir, saved)
    assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + 2
    assert saved.read_bytes() == at_exit.read_bytes()


# ---- from a pipe ------------------------------------------------------------------------

def test_chat_piped_commands_blocks_and_system_file(tiny_dir, tmp_path):
    """Catches a pipe's commands, blocks or '//' sent as typed text, /load not continuing
    the saved state, --system @FILE not opening the conversation, or text after /exit
    still sent."""
    system = tmp_path / "system.txt"
    system.write_text("Be brief.\n")
    a, b = tmp_path / "a.k3state", tmp_path / "b.k3state"
    talk = (f"Hi there\n/save {a}\n\"\"\"\ntwo\nlines\n\"\"\"\n/load {a}\n"
            "//slash \\\ncontinued\n/exit\nnever sent\n")
    p = k3(tiny_dir, "--chat", "--gen", 3, "--system", f"@{system}", "--save-state", b,
           input=talk)
    assert p.returncode == 0, p.stderr
    first = _turn_ids(tiny_dir, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi there"}])
    kept, ids = _state_ids(tiny_dir, a), _state_ids(tiny_dir, b)
    assert kept[:len(first)] == first
    after_load = _turn_ids(tiny_dir, [{"role": "user", "content": "/slash \ncontinued"}])
    assert ids[:len(kept)] == kept
    assert ids[len(kept):len(kept) + len(after_load)] == after_load
    assert len(ids) - len(kept) - len(after_load) <= 3


def test_chat_piped_system_command_waits_for_a_fresh_conversation(tiny_dir, tmp_path):
    """Catches /system ignored before the first turn, or spliced into a conversation in
    progress instead of opening the next one (/clear)."""
    first, st = tmp_path / "first.k3state", tmp_path / "s.k3state"
    p = k3(tiny_dir, "--chat", "--gen", 2, "--save-state", st,
           input=f"/system Be brief.\nHi there\n/system Other.\nYo\n/save {first}\n"
                 "/clear\nAgain\n")
    assert p.returncode == 0, p.stderr
    assert "opens this conversation" in p.stderr and "next conversation" in p.stderr
    opened = _turn_ids(tiny_dir, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi there"}])
    ids = _state_ids(tiny_dir, first)
    assert ids[:len(opened)] == opened
    assert K3Tokenizer.from_dir(tiny_dir).decode(ids).count("Other.") == 0
    fresh = _turn_ids(tiny_dir, [{"role": "system", "content": "Other."},
                                 {"role": "user", "content": "Again"}])
    ids = _state_ids(tiny_dir, st)
    assert ids[:len(fresh)] == fresh and len(ids) - len(fresh) <= 2


def test_chat_from_a_pipe_ends_at_an_empty_line(tiny_dir, tmp_path):
    """Catches piped input that lost its old rule: an empty line ends the chat (a script
    ends a conversation that way), so what follows it is never sent; the state saved is
    the first turn's."""
    st = tmp_path / "s.k3state"
    p = k3(tiny_dir, "--chat", "--gen", 3, "--save-state", st, input="Hi there\n\nnever sent\n")
    assert p.returncode == 0, p.stderr
    first = _turn_ids(tiny_dir, [{"role": "user", "content": "Hi there"}])
    ids = _state_ids(tiny_dir, st)
    assert ids[:len(first)] == first and len(ids) == len(first) + 3


def test_chat_line_of_invalid_utf8_is_refused_at_once_and_the_chat_goes_on(tiny_dir, tmp_path):
    """Catches a 4 MB chat line of bytes that are not UTF-8 worked on for minutes, a
    traceback, or the chat ended by it (exit 2, the state lost): it is refused in seconds
    with its reason, the next line is a turn, and --save-state is written."""
    st = tmp_path / "s.k3state"
    p = subprocess.run(["k3-run", str(tiny_dir), "--chat", "--gen", "2", "--save-state", st],
                       input=b"\xff" * 4_000_000 + b"\nHi there\n", capture_output=True,
                       timeout=60)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 0, err
    assert "byte 0xFF at character 1" in err and "Traceback" not in err
    first = _turn_ids(tiny_dir, [{"role": "user", "content": "Hi there"}])
    assert _state_ids(tiny_dir, st)[:len(first)] == first
