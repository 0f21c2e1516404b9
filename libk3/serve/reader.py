"""The request reader: a process of its own that reads the server's request bodies.

Owns: the reader process (started with the server, given the model's tokenizer and chat
template, started again when it dies or overruns ``READ_SECONDS``), the messages to it (a
route's name and the body in the chunks it arrived in) and back (what the route needs,
or the refusal as its status and error body), and the reading itself (``Reader``: JSON
parsed and checked, a conversation's images read and checked (``request.images``), the
conversation rendered and tokenized, the context checked, the
preamble a later request can share found). Does not own: the checks (``protocol``,
``anthropic``, ``tokenize``), settings and grammars (the server's CPU thread), HTTP.

Why a process: parsing, rendering and tokenizing a long body are long calls that hold
Python's interpreter lock, and the server's event loop needs that lock to answer
anything, ``/health`` and every reply being streamed included (bench/README.md "The
server under hostile requests"). The server's process only passes the body's chunks
down a pipe, which lets go of the lock, and gets back ids and small objects.

Run as ``python -m libk3.serve.reader IN_FD OUT_FD`` by ``ReaderProcess`` only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
from multiprocessing.connection import Connection

import numpy as np

from ..errors import K3Error
from ..text.chat_template import RenderLimits
from ..text.prompts import Prompts
from . import anthropic, tokenize
from ..request.images import ImageRefused, read_parts
from .protocol import ApiError, check_model, check_request, parse_body, refusal_of

# A reading that takes longer is a reader gone wrong (a rendering is stopped far sooner,
# by its own time limit, and tokenizing stops at the context): it is stopped and started
# again, and that request is a 500.
READ_SECONDS = 300.0
START_SECONDS = 300.0     # for the process to read the tokenizer and template at its start
TRIM_BYTES = 4 << 20      # after a body longer than this, freed memory goes back at once
# The reader's address space, at most: reading the largest body a server takes (32 MiB)
# and rendering a template's largest output (64 MiB) stay far below it, while a template
# that builds a huge string in one call (``"x" | center(10 ** 10)``) fails there as that
# request's 422, and the server's own memory is never touched.
MEMORY_BYTES = 4 << 30
ROUTES = ("chat", "messages", "count_tokens", "completion", "tokenize", "detokenize")


@dataclasses.dataclass(frozen=True)
class ReaderSpec:
    """What the reader process needs to know of the server's model."""
    model_dir: str
    tokenizer: bool              # the model directory has a tokenizer
    tokenizer_cache: str | None  # where its derived form is kept (``LazyTokenizer``)
    limits: RenderLimits         # of each chat-template rendering
    vocab_size: int
    context: int                 # the model's context in tokens
    model_name: str              # the served model's name (a request may name only it)
    min_preamble: int            # preambles shorter are not shared; 0: none is
    ctx_size: int | None         # --ctx-size when it set ``context`` (refusals name it)
    media: object = None         # the checkpoint's MediaProcConfig (None: no vision tower)
    image_dir: str | None = None  # where image paths may be read (--image-dir; None: nowhere)


class Reader:
    """The reading of each route's body (in the reader process). ``warn`` hears what the
    template has to say (that the model has none)."""

    def __init__(self, spec: ReaderSpec, warn=None):
        from ..text.tokenizer import LazyTokenizer
        self.spec, self.warn = spec, warn
        tok = LazyTokenizer(spec.model_dir, spec.vocab_size, spec.tokenizer_cache) \
            if spec.tokenizer else None
        self.prompts = Prompts(spec.model_dir, tok, spec.limits)

    def start(self) -> None:
        """Read the tokenizer and the template now, before the first request waits."""
        if self.spec.tokenizer:
            self.prompts.tokenizer.get()
            _ = self.prompts.chat(self.warn).template

    # ---- routes: each takes the body's bytes ----
    def chat(self, raw: bytes) -> tuple:
        """(Request, prompt ids, shareable preamble) of a chat body."""
        return self._rendered(check_request(parse_body(raw), True, self.spec.vocab_size))

    def messages(self, raw: bytes) -> tuple:
        """The same for a Messages body (converted to a chat Request)."""
        return self._rendered(anthropic.check_request(parse_body(raw)))

    def count_tokens(self, raw: bytes) -> int:
        """Anthropic's token count: how many prompt ids a Messages body renders to."""
        body = parse_body(raw)
        if body.get("max_tokens") is None:       # not part of a count's body
            body["max_tokens"] = 1
        req, ids, _ = self._rendered(anthropic.check_request(body))
        return len(ids) + sum(im.rows - 1 for im in req.images)

    def completion(self, raw: bytes) -> tuple:
        """(Request, prompt ids, 0) of a completion body."""
        req = check_request(parse_body(raw), False, self.spec.vocab_size)
        check_model(req.model, self.spec.model_name)
        ids = req.prompt_ids if req.prompt_ids is not None else \
            self.prompts.encode(req.prompt, limit=self.spec.context)
        self._check_context(req, ids)
        return req, np.asarray(ids, np.int32), 0

    def tokenize(self, raw: bytes) -> bytes:
        """The JSON answer of /tokenize (made here: a long list of ids is long to write)."""
        ids = tokenize.tokenize(self.prompts, self._tokenizer_body(raw))
        return json.dumps({"count": len(ids), "max_model_len": self.spec.context,
                           "tokens": ids}).encode()

    def detokenize(self, raw: bytes) -> bytes:
        """The JSON answer of /detokenize."""
        text = tokenize.detokenize(self.prompts, self.spec.vocab_size,
                                   self._tokenizer_body(raw))
        return json.dumps({"prompt": text}).encode()

    # ---- the parts ----
    def _rendered(self, req) -> tuple:
        """(Request, prompt ids, shareable preamble) of a chat request: its images read
        (``req.images``; each image one pad in the ids, not expanded), its conversation
        rendered and tokenized, the context checked with the images' rows."""
        check_model(req.model, self.spec.model_name)
        try:
            req.messages, req.images = read_parts(req.messages, self.spec.media,
                                                  self.spec.image_dir, req.image_fields)
        except ImageRefused as e:
            raise ApiError(400, str(e), param="messages", code="invalid_image") from None
        chat = self.prompts.chat(self.warn)
        if req.reasoning_effort is not None:
            req.template_kwargs = chat.reasoning_kwargs(req.reasoning_effort, req.tools,
                                                        req.template_kwargs)
        ids = self.prompts.encode_messages({"messages": req.messages, "tools": req.tools,
                                            "template_kwargs": req.template_kwargs},
                                           self.warn, limit=self.spec.context)
        self._check_context(req, ids, sum(im.rows - 1 for im in req.images))
        # a state holding an image's rows is never kept (formats/model/vision.md §8.3)
        preamble = 0 if req.images else self._preamble(req, ids)
        req.messages = None          # rendered: the server needs only the ids
        return req, np.asarray(ids, np.int32), preamble

    def _check_context(self, req, ids, rows: int = 0) -> None:
        """413 for a prompt over the context (``ids`` may stop short past it; ``rows``:
        the images' rows beyond their pads): the model's, or the one --ctx-size set."""
        if len(ids) + rows > self.spec.context:
            name = "the model's context" if self.spec.ctx_size is None else \
                "the context set by --ctx-size"
            raise ApiError(413, f"the prompt is over {name} of {self.spec.context} tokens",
                           param="messages" if req.chat else "prompt",
                           code="context_length_exceeded")

    def _preamble(self, req, ids) -> int:
        """The ids a later request can share (``ChatEncoder.preamble``), when prefixes are
        kept and it is at least ``min_preamble``; else 0. A template that cannot render
        the shorter conversation only costs the sharing."""
        if not self.spec.min_preamble:
            return 0
        try:
            n = self.prompts.chat().preamble(req.messages, ids, req.tools,
                                             req.template_kwargs)
        except K3Error:
            return 0
        return n if n >= self.spec.min_preamble else 0

    def _tokenizer_body(self, raw: bytes) -> dict:
        """A /tokenize or /detokenize body, its model checked, the tokenizer there."""
        body = parse_body(raw)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(422, "'model' must be a string", param="model", code="invalid_type")
        check_model(model, self.spec.model_name)
        if not self.spec.tokenizer:
            raise ApiError(422, "this model has no tokenizer (tiktoken.model)",
                           code="no_tokenizer")
        return body


class ReaderDefect(Exception):
    """A defect in k3 met in the reader process (what it said of its exception)."""


class ReaderProcess:
    """The reader process, seen from the server: ``call`` from one thread at a time."""

    def __init__(self, spec: ReaderSpec):
        self.spec = spec
        self._proc = self._inbox = self._outbox = None
        self._start()

    def _start(self) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "libk3.serve.reader", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            os.close(down_r)
            os.close(up_w)
        self._outbox = Connection(down_w, readable=False)
        self._inbox = Connection(up_r, writable=False)
        self._outbox.send(self.spec)
        self._started = False

    def ready(self) -> None:
        """Wait until the process has read the tokenizer and the template: K3Error when
        it could not."""
        if not self._started:
            self._started = True
            self._answer("start", START_SECONDS)

    def call(self, route: str, chunks: list):
        """(what ``Reader.<route>`` returned for the body ``chunks``, what the template
        said meanwhile). Its refusal is raised as an ApiError; a defect as ReaderDefect;
        a process that died or overran READ_SECONDS is started again (K3Error)."""
        if self._proc.poll() is not None:        # died between requests: this one is fine
            self._restart()
        try:
            self._outbox.send((route, len(chunks)))
            for chunk in chunks:
                self._outbox.send_bytes(chunk)
        except OSError:
            return self._lost("stopped")
        return self._answer(route, READ_SECONDS)

    def _answer(self, route: str, seconds: float):
        try:
            if not self._inbox.poll(seconds):
                return self._lost(f"took over {seconds:g} s", route)
            out = self._inbox.recv()
        except (EOFError, OSError):
            return self._lost("stopped", route)
        kind = out[0]
        if kind == "ok":
            return out[1], out[2]
        if route == "start":
            said = out[2]["error"]["message"] if kind == "refused" else out[1]
            raise K3Error(f"the server's request reader could not start: {said}")
        if kind == "refused":
            raise ApiError.of(out[1], out[2])
        raise ReaderDefect(out[1])

    def _lost(self, how: str, route: str = ""):
        self._proc.kill()               # it may be alive but stuck: no waiting for it
        if route == "start":            # starting again would fail again
            self._proc.wait()
            raise K3Error(f"the server's request reader could not start: it {how} (exit "
                          f"code {self._proc.returncode})")
        self._restart()
        raise K3Error(f"the server's request reader {how} while reading this request; it "
                      "was started again")

    def _restart(self) -> None:
        self.close()
        self._start()
        self.ready()

    def close(self) -> None:
        """Stop the process: the end of its input tells it to exit; killed if it has not
        within a few seconds."""
        for conn in (self._outbox, self._inbox):
            conn.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _outcome(fn, heard: list) -> tuple:
    """("ok", fn(), what was heard) or its refusal ("refused", status, body, heard) or a
    defect ("defect", what its exception says, heard)."""
    heard.clear()
    try:
        return "ok", fn(), list(heard)
    except MemoryError:
        e = ApiError(422, f"reading this request needed more than the request reader's "
                          f"{MEMORY_BYTES / 2 ** 30:g} GiB of memory (the chat template, or "
                          "the body's JSON)", code="out_of_memory")
        return "refused", e.status, e.body, list(heard)
    except Exception as e:              # noqa: BLE001 (each kind told apart below)
        refused = refusal_of(e)
        if refused is not None:
            return "refused", refused[0], refused[1], list(heard)
        return "defect", " ".join(f"{type(e).__name__}: {e}".split()), list(heard)


def main(argv=None) -> int:
    """The reader process: the spec, then one request after another until its input
    ends."""
    # Ctrl-C reaches the whole process group; the server ends this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    fd_in, fd_out = map(int, (argv or sys.argv[1:]))
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    heard: list = []
    spec, made = inbox.recv(), []

    def start():
        made.append(Reader(spec, heard.append))
        made[0].start()
    started = _outcome(start, heard)
    outbox.send(started)
    if started[0] != "ok":
        return 1
    reader = made[0]
    while True:
        try:
            route, n = inbox.recv()
            raw = b"".join([inbox.recv_bytes() for _ in range(n)])
        except EOFError:
            return 0
        method = getattr(reader, route) if route in ROUTES else None
        out = _outcome(lambda: method(raw), heard) if method else \
            ("defect", f"no route {route!r}", [])
        outbox.send(out)
        if out[0] == "refused" and out[2]["error"]["code"] == "out_of_memory":
            return 0            # a fresh reader for the next request, in case any state broke
        if len(raw) > TRIM_BYTES:
            del raw
            _trim()


def _trim() -> None:
    """Give the memory a long body took back to the system (glibc keeps what is freed
    for reuse, several times the body); nothing where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
