"""The ``k3-run --chat`` console: reading what the user types, the slash commands, history.

Owns: turning input into entries (a message, a command, nothing), the multi-line
conventions, the commands and what they print, the history file, and what Ctrl-C means
(at the prompt: drop the line; during a reply: stop it at the next token). Does not own:
generation, the state or the conversation (``chat_session.Chat``), printing a reply's tokens
(the front end's printer), or option parsing.

Why the stdlib ``readline`` and not ``prompt_toolkit``: readline gives what users bring
from a shell (arrow keys, Ctrl-R search, their ``~/.inputrc``, a history file) with no
new dependency, on the systems k3 runs on (Linux, macOS); prompt_toolkit would add
in-place editing of a multi-line message and Windows, at the price of a dependency in
every install (batch and server never read a terminal) and a library that takes over
the screen. Multi-line messages are typed with the continuations llama.cpp and Ollama
use instead. Without readline (or when stdout is not a terminal) lines are read plainly.

Why the same reading rules for a pipe: a script can then send commands (``/save``) and
multi-line messages too; a pipe only has no line editing, no history, and Ctrl-C while
waiting for input ends the chat there (there is no line to clear).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path

from ..engine.settings import SAMPLING_RULES, gen_or_until_end_problem
from ..errors import K3Error
from ..text.encodable import first_surrogate

PROMPT = "you> "
MORE = "... "                        # the prompt of a message's next line
BLOCK = '"""'                        # opens and closes a multi-line block
HISTORY_LINES = 1000                 # the newest lines kept in the file, as a shell does

# /set NAME VALUE: each value is read as the k3-run option of the same name reads it
# (click's INT and FLOAT are int() and float()) and checked by the same rule.
SETTINGS = {name: (int if name in ("seed", "top_k") else float, rule)
            for name, rule in SAMPLING_RULES.items()}
SETTINGS["gen"] = (int, gen_or_until_end_problem)


class Unfinished(EOFError):
    """End of input inside a block or after a ``\\``: the message so far is dropped."""


@dataclasses.dataclass(frozen=True)
class Command:
    """A line starting with one ``/``: the word after it and the rest, stripped."""
    name: str
    arg: str


def read_entry(read_line):
    """(text, block) of the next entry, from ``read_line(prompt)`` (EOFError at end of
    input, from any line). A line ending in ``\\`` continues on the next (the backslash
    becomes a newline); a first line starting with ``\"\"\"`` opens a block that the
    first line ending with ``\"\"\"`` closes, its text taken as typed (one newline after
    the opening quotes and one before the closing ones dropped)."""
    def more() -> str:
        try:
            return read_line(MORE)
        except EOFError:
            raise Unfinished from None

    line = read_line(PROMPT)
    if line.startswith(BLOCK):
        lines, line = [], line[len(BLOCK):]
        while not line.endswith(BLOCK):
            lines.append(line)
            line = more()
        lines.append(line[:-len(BLOCK)])
        text = "\n".join(lines)
        text = text[1:] if text.startswith("\n") else text
        return (text[:-1] if text.endswith("\n") else text), True
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = more()
    return "\n".join(lines + [line]), False


def parse(text: str, block: bool = False):
    """A message (its text), a Command, or None for a blank entry. A block is a message
    as typed; elsewhere a leading ``//`` sends the line from its second ``/``."""
    if not text.strip():
        return None
    if block or not text.startswith("/"):
        return text
    if text.startswith("//"):
        return text[1:]
    body = text[1:]
    name = body.split(None, 1)[0] if body[:1] and not body[:1].isspace() else ""
    return Command(name, body[len(name):].strip())


def setting(name: str, raw: str):
    """(GenSettings field, value) for ``/set NAME VALUE``; ValueError saying why not."""
    field = name.replace("-", "_")
    if field not in SETTINGS:
        raise ValueError(f"/set takes {', '.join(SETTINGS)}, not {name!r}")
    convert, problem = SETTINGS[field]
    try:
        value = convert(raw)
    except ValueError:
        value = raw
    why = problem(value)
    if why:
        raise ValueError(why)
    return field, value


def default_history_path(env=None) -> Path:
    """Where the chat's history is kept: ``$XDG_STATE_HOME/k3/chat_history`` when that
    is an absolute path (XDG base-directory rule), else
    ``~/.local/state/k3/chat_history``."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    root = (Path(base) if os.path.isabs(base)
            else Path(env.get("HOME") or Path.home()) / ".local" / "state")
    return root / "k3" / "chat_history"


class Console:
    """The chat's terminal: ``read()`` gives entries, ``say()`` writes a line on stderr
    (stdout holds only replies), ``reply()`` turns Ctrl-C into a request to stop.

    Used as a context manager: inside it SIGINT sets a flag instead of raising, except
    while waiting for input, so a Ctrl-C never lands inside a forward pass."""

    def __init__(self, history=None, stdin=None, stdout=None, stderr=None):
        self.stdin = stdin or sys.stdin
        if getattr(self.stdin, "errors", None) == "strict" and hasattr(self.stdin, "reconfigure"):
            # a byte that is not UTF-8 is kept as a lone surrogate, and its line refused
            # (``read``), instead of ending the chat
            self.stdin.reconfigure(errors="surrogateescape")
        self.stderr = stderr or sys.stderr
        stdout = stdout or sys.stdout
        self.interactive = self.stdin.isatty()
        self.readline = None
        if self.interactive and stdout.isatty() and self.stdin is sys.stdin:
            try:
                import readline                 # input() edits lines once it is loaded
                self.readline = readline
            except ImportError:                 # a Python built without it: plain lines
                pass
        self.history = None
        if self.readline is not None:
            self.history = _History(self.readline, history or default_history_path(),
                                    self.say)
        self.interrupted = False
        self._installed = False
        self._handler = None

    def __enter__(self):
        try:
            self._handler = signal.signal(signal.SIGINT, self._interrupt)
            self._installed = True
        except ValueError:                      # not the main thread: Ctrl-C as it was
            pass
        return self

    def __exit__(self, *exc):
        if self._installed:                     # None: a handler set outside Python
            signal.signal(signal.SIGINT, self._handler or signal.default_int_handler)
            self._installed = False

    def _interrupt(self, signum, frame):
        self.interrupted = True

    @contextlib.contextmanager
    def _raising(self):
        """Ctrl-C raises KeyboardInterrupt inside (waiting for a line), as Python's own."""
        if not self._installed:
            yield
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._interrupt)

    def _line(self, prompt: str) -> str:
        """One line without its newline; EOFError at end of input."""
        if self.readline is not None:
            return input(prompt)                # the prompt goes where readline draws
        self.stderr.write(prompt)
        self.stderr.flush()
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line[:-1] if line.endswith("\n") else line

    def read(self):
        """The next message (str) or Command; None at end of input. Blank entries are
        skipped at a terminal; from a pipe an empty line ends the chat, as it always has
        (scripts end a conversation that way). Ctrl-C drops the entry being typed (from
        a pipe: ends the chat)."""
        while True:
            try:
                with self._raising():
                    text, block = read_entry(self._line)
            except EOFError as e:
                self._end_line()
                if isinstance(e, Unfinished):
                    self.say("end of input inside a message: it was not sent")
                return None
            except KeyboardInterrupt:
                self._end_line()
                if not self.interactive:
                    return None
                continue
            if not self.interactive and text == "" and not block:
                return None
            at = first_surrogate(text)
            if at is not None:
                code = ord(text[at])
                what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else \
                    f"U+{code:04X}"
                self.say(f"error: the line holds {what} at character {at + 1}, which is not "
                         "UTF-8 text: it was not sent")
                continue
            if self.history is not None:
                self.history.keep()
            entry = parse(text, block)
            if entry is not None:
                return entry

    def _end_line(self) -> None:
        if self.interactive:                    # the cursor is after the prompt or ^C
            self.stderr.write("\n")
            self.stderr.flush()

    def say(self, text: str) -> None:
        self.stderr.write(text + "\n")
        self.stderr.flush()

    @contextlib.contextmanager
    def reply(self):
        """Yields ``interrupted()``, True once Ctrl-C was pressed during the reply."""
        self.interrupted = False
        yield lambda: self.interrupted
        self.interrupted = False


class _History:
    """readline's history kept in a file: read at start, each entry's lines appended as
    it is read (a crash loses nothing, two chats at once keep both), the file trimmed to
    HISTORY_LINES by readline as it appends. A file that cannot be used is said once and
    the chat goes on without it."""

    def __init__(self, readline, path, say):
        self.readline = readline
        self.path = Path(path).expanduser()
        readline.set_history_length(HISTORY_LINES)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))  # append needs it
            readline.read_history_file(str(self.path))
        except OSError as e:
            say(f"history not kept: {self.path}: {e.strerror or e}")
            self.path = None
        self.kept = readline.get_current_history_length()

    def keep(self) -> None:
        n = self.readline.get_current_history_length() - self.kept
        if self.path is None or n <= 0:
            return
        try:
            self.readline.append_history_file(n, str(self.path))
        except OSError:
            pass                    # said at start if the file was unusable; a full disk
        self.kept += n              # loses history lines, never the chat


# ---- the commands ---------------------------------------------------------------------

def banner(model, load_state=None, tokens: int = 0) -> str:
    """The chat's first line: the model, how to get help and how to end."""
    name = Path(os.path.abspath(model)).name
    where = f", continuing {load_state} ({tokens:,} tokens)" if load_state else ""
    return (f"k3 chat with {name}{where}: type a message; /help lists the commands, "
            "/exit or Ctrl-D ends the chat")


def _help(chat, console, arg):
    console.say("commands:")
    for name, (usage, text, _) in COMMANDS.items():
        console.say(f"  /{name}{' ' + usage if usage else ''}".ljust(22) + text)
    console.say(f"a line ending in \\ goes on on the next; {BLOCK} opens and closes a "
                "multi-line block;\n// sends a line starting with /; Ctrl-C stops a reply, "
                "Ctrl-D ends the chat")


def _clear(chat, console, arg):
    if arg:
        raise ValueError("/clear takes no argument")
    chat.clear()
    console.say("new conversation" + (" (with the system message)" if chat.system else ""))


def _system(chat, console, arg):
    now = chat.set_system(arg or None)
    if not arg:
        console.say("no system message for the next conversation")
    elif now:
        console.say("system message set: it opens this conversation")
    else:
        console.say("system message set: it opens the next conversation (/clear)")


def _save(chat, console, arg):
    if not arg:
        raise ValueError("/save needs a FILE")
    chat.save(os.path.expanduser(arg))
    console.say(f"saved {arg} ({chat.state.pos} tokens)")


def _load(chat, console, arg):
    if not arg:
        raise ValueError("/load needs a FILE")
    chat.load(os.path.expanduser(arg))
    console.say(f"loaded {arg} ({chat.state.pos} tokens): the conversation continues it")


def _image(chat, console, arg):
    if not arg:
        raise ValueError("/image needs a PATH")
    image = chat.attach(os.path.expanduser(arg))
    console.say(f"image {arg} ({image.size[0]}x{image.size[1]}, {image.rows.shape[0]} rows) "
                "opens the next message")


def _set(chat, console, arg):
    words = arg.split()
    if not words:
        console.say(", ".join(f"{f} {getattr(chat.settings, f)}" for f in SETTINGS))
        return
    if len(words) != 2:
        raise ValueError("/set takes NAME VALUE, e.g. /set temperature 0.7")
    field, value = setting(*words)
    chat.change(**{field: value})
    console.say(f"{field} {value}")


def _stats(chat, console, arg):
    s = chat.stats()
    share = 100 * s["tokens"] / s["context"]
    since = f" since {s['loaded']} was loaded" if s["loaded"] else ""
    console.say(f"tokens: {s['tokens']:,} in the state, {share:.2f} % of the "
                f"{s['context']:,}-token context; turns: {s['turns']}{since}")
    last = s["last"]
    if last is None:
        console.say("last reply: none yet")
        return
    n, secs = len(last.generated_ids), last.decode_seconds
    rate = f" ({n / secs:.1f} tokens/s)" if secs > 0 else ""
    console.say(f"last reply: {n} tokens in {secs:.2f} s{rate}; its prompt "
                f"{len(last.prompt_ids)} tokens in {last.prefill_seconds:.2f} s")


COMMANDS = {
    "help": ("", "this list", _help),
    "exit": ("", "end the chat (after saving --save-state)", None),
    "clear": ("", "a new conversation: a fresh state, opened by the system message",
              _clear),
    "system": ("[TEXT]", "the system message of the next fresh conversation", _system),
    "save": ("FILE", "save the state now, as --save-state does", _save),
    "load": ("FILE", "continue from a saved state", _load),
    "image": ("PATH", "attach an image to the next message", _image),
    "set": ("[NAME VALUE]", f"{', '.join(SETTINGS)} for the next turns", _set),
    "stats": ("", "tokens so far, context used, the last reply's speed", _stats),
}


def perform(command: Command, chat, console) -> bool:
    """Do ``command`` on ``chat`` (``chat_session.Chat``); False when it ends the chat. A
    command that fails says why in one line and leaves the chat as it was."""
    if command.name == "exit":
        return False
    entry = COMMANDS.get(command.name)
    if entry is None:
        console.say(f"error: unknown command /{command.name} (/help lists them; "
                    "// sends a line starting with /)")
        return True
    try:
        entry[2](chat, console, command.arg)
    except ValueError as e:
        console.say(f"error: {e}")
    except K3Error as e:
        console.say(f"error: {e.one_line()}")
    except OSError as e:
        console.say(f"error: {e.filename or command.arg}: {e.strerror or e}")
    return True
