"""``k3-run MODEL --serve [HOST:]PORT``: an OpenAI-compatible HTTP endpoint (aiohttp).

Owns: the address rule (loopback by default; any other address needs an API key,
checked on every request but the liveness probe), the routes (POST /v1/chat/completions
and /v1/completions, streamed as server-sent events or not; Anthropic's POST
/v1/messages, its shapes ``anthropic``'s; GET /v1/models, /health and /livez), reading a
body as the chunks it arrives in and handing them to the request reader (``reader``: a
process of its own parses, renders and tokenizes, so the event loop keeps answering),
the CPU thread that waits for it and compiles a request's settings and grammars,
turning every refusal into an OpenAI-style error body (Anthropic's on /v1/messages)
while the server keeps serving. Does not own: the wire format's checks (``protocol``,
``anthropic``), reading bodies (``reader``), the jobs of a request and the answers
written from them (``answers``), the queue and the engine thread (``worker``), templates
or generation.

Every request gets an id (``x-request-id``), and every failure leaves the server as one
OpenAI error body and, for a 5xx, one log line naming that id: no exception reaches
aiohttp's bare 500 page or its traceback log. What aiohttp refuses in its parser, before
any k3 code runs (a header or request line past ``PARSER_LINE_BYTES``, over 128 headers,
bytes that are not HTTP), keeps aiohttp's plain-text 400, logged as one line: aiohttp
has no public hook for that answer (docs/serve.md).

Needs the optional ``serve`` extra (``pip install 'k3[serve]'``): the core install stays
lean, and HTTP is left to a maintained server library rather than written by hand.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import ipaddress
import itertools
import os
import signal
import uuid

from ..request.settings import settings_over
from ..errors import K3Error, UsageError
from ..text.encodable import text_problem
from .protocol import ApiError, check_model, client_line, error_parts, refusal_of
from . import anthropic
from .access import USAGE, Access, access_middleware, http_logger
from .answers import Answers
from .reader import ReaderProcess, ReaderSpec
from .worker import Worker

MAX_BODY_BYTES = 32 * 2 ** 20        # a larger request body is refused with 413
# The request reader at its peak: the interpreter, the tokenizer and the template (about
# 70 MB with Kimi K3's) and about ten times the body it reads (docs/serve.md "Reading
# requests"; bench/README.md "The server under hostile requests").
READER_RESERVE_BYTES = 100 * 10 ** 6 + 10 * MAX_BODY_BYTES
# A body still arriving after this long is refused with 408: a client that sends a byte
# now and then would otherwise hold its connection and handler for ever.
BODY_SECONDS = 60.0
# A stream with nothing to send for this long (a long prefill, a queue) sends an SSE
# comment, so clients and proxies that time out idle connections keep it open.
KEEPALIVE_SECONDS = 15.0
# A longer header field (name and value) is refused with 431, a longer request target
# with 414, each with an OpenAI error body: aiohttp's own default, so no client that
# worked before is refused now.
MAX_HEADER_BYTES = 8190
# What aiohttp's parser reads of one line before refusing the request itself (its own
# plain-text 400): room for the limit above to answer in JSON, while 128 headers
# (aiohttp's count limit) hold at most MAX_BODY_BYTES.
PARSER_LINE_BYTES = 2 ** 18
REQUEST_ID = "k3_request_id"         # the request's id, in the request's mapping
DEFAULT_HOST = "127.0.0.1"
LIVENESS = "/livez"                  # answered without the API key; says only "ok"


def parse_address(text: str) -> tuple:
    """"[HOST:]PORT" -> (host, port); an IPv6 host in brackets ("[::1]:8080")."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise UsageError(f"--serve takes [HOST:]PORT with PORT 0..65535, got {text!r}")
    return host or DEFAULT_HOST, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str, api_key) -> tuple:
    """(host, port) of ``--serve``; UsageError for a malformed address or a
    non-loopback one without an API key."""
    host, port = parse_address(address)
    if not is_loopback(host) and not api_key:
        raise UsageError(f"--serve on {host} would let other machines run the model: give "
                         "--api-key (checked on every request), or serve on 127.0.0.1")
    return host, port


def _check_sizes(request) -> None:
    """ApiError 414 / 431 for a request target or a header field over MAX_HEADER_BYTES
    (aiohttp's parser let it through, up to PARSER_LINE_BYTES)."""
    if len(request.raw_path.encode("utf-8", "surrogateescape")) > MAX_HEADER_BYTES:
        raise ApiError(414, f"the request target is over {MAX_HEADER_BYTES} bytes",
                       code="uri_too_long")
    for name, value in request.raw_headers:
        if len(name) + len(value) > MAX_HEADER_BYTES:
            shown = name[:40].decode("ascii", "replace")
            raise ApiError(431, f"the header {shown!r} is over {MAX_HEADER_BYTES} bytes",
                           code="header_too_large")


def _refusal(e: Exception, rid: str) -> tuple:
    """(status, OpenAI error body, what to log) of an exception a route raised."""
    from aiohttp import web
    if isinstance(e, web.HTTPException):
        return error_parts(e.status, e.reason)
    refused = refusal_of(e)
    if refused is not None:
        return refused
    # a defect in k3: the client learns the id, the log the exception
    status, body, _ = error_parts(500, f"internal error; the server's log names request {rid}",
                                  kind="server_error")
    return status, body, " ".join(f"{type(e).__name__}: {e}".split())


def _too_large() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                    code="request_too_large")


class Server(Answers):
    """The routes over one ``Worker`` and the run it decodes with (the answers they write:
    ``answers.Answers``)."""

    def __init__(self, run, worker: Worker, reader: ReaderProcess, base_settings, *,
                 model_name: str, api_key=None, log=None, access=None):
        self.run, self.worker, self.reader, self.base = run, worker, reader, base_settings
        self.model_name, self.api_key, self.log = model_name, api_key, log
        self.access = access or Access(log)
        self.ids = itertools.count(1)
        self.cpu = None               # the CPU thread's executor, while the app runs
        self.images = None            # ``run.images.Images``, at the first image
        self.keepalive_seconds = KEEPALIVE_SECONDS
        self.body_seconds = BODY_SECONDS

    def app(self):
        from aiohttp import web
        app = web.Application(middlewares=[self._access, self._errors, self._auth])
        app.on_response_prepare.append(self._tag)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post(anthropic.PATH, self.messages)
        app.router.add_post(anthropic.PATH + "/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(LIVENESS, self.livez)
        from .compat_routes import add_routes      # llama-server's and Ollama's
        add_routes(app, self)
        app.cleanup_ctx.append(self._cpu_thread)
        return app

    async def _cpu_thread(self, app):
        """The one thread for a request's CPU work, from the app's start to its end. One:
        the request reader is asked one request at a time, and the lazily built template
        encoder and HF tokenizers are only ever built and used by it (the engine thread
        only reads the tokenizer's id -> bytes table)."""
        self.cpu = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3-serve-cpu")
        try:
            yield
        finally:
            self.cpu.shutdown(wait=True, cancel_futures=True)
            self.cpu = None

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on the CPU thread; its exception is raised here, so the error
        middleware maps it as if it had run on the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    # ---- middlewares ----
    @property
    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            if self.api_key is not None and request.path != LIVENESS \
                    and not self._key_given(request):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, "
                                    "or x-api-key: KEY)", code="invalid_api_key")
            return await handler(request)
        return auth

    def _key_given(self, request) -> bool:
        """The API key in ``Authorization: Bearer KEY`` (OpenAI's clients) or in
        ``x-api-key: KEY`` (Anthropic's)."""
        for header, prefix in (("Authorization", "Bearer "), ("x-api-key", "")):
            given = request.headers.get(header)
            # a header that is not UTF-8 (aiohttp escapes its bytes) is no key at all
            if given is not None and not text_problem(given, header) and hmac.compare_digest(
                    given.encode(), f"{prefix}{self.api_key}".encode()):
                return True
        return False

    @property
    def _access(self):
        return access_middleware(self.access, REQUEST_ID, USAGE)

    @property
    def _errors(self):
        """The outermost middleware: the request's id; oversized headers refused; every
        exception a route raises turned into its OpenAI error body, a 5xx also logged."""
        from aiohttp import web

        @web.middleware
        async def errors(request, handler):
            request[REQUEST_ID] = rid = f"req_{uuid.uuid4().hex}"
            try:
                _check_sizes(request)
                return await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                status, body, said = _refusal(e, rid)
            except ConnectionError:         # the client left mid-reply: nobody to answer
                raise
            except Exception as e:          # noqa: BLE001 (each kind mapped by _refusal)
                status, body, said = _refusal(e, rid)
            if status >= 500:
                self._log_5xx(rid, status, said)
            if request.path.startswith(anthropic.PATH):     # Anthropic's clients' shape
                body = anthropic.error_body(status, body)
            return web.json_response(body, status=status)
        return errors

    async def _tag(self, request, response):
        """Every response carries its request's id (the one a 5xx's log line names)."""
        if REQUEST_ID in request:
            response.headers["x-request-id"] = request[REQUEST_ID]

    def _stream_failure(self, request, e: Exception) -> tuple:
        """(status, error body) of an exception met after a stream's headers went out (so
        it is told as an event), a 5xx logged once with the request's id."""
        status, body, said = _refusal(e, request[REQUEST_ID])
        if status >= 500:
            self._log_5xx(request[REQUEST_ID], status, said)
        return status, body

    def _log_5xx(self, rid: str, status: int, said: str) -> None:
        if self.log:
            self.log(f"request {rid} failed ({status}): {said}")

    # ---- routes ----
    def _model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "k3"}

    async def models(self, request):
        from aiohttp import web
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request):
        from aiohttp import web
        check_model(request.match_info["model"], self.model_name)
        return web.json_response(self._model_object())

    async def tokenize(self, request):
        return await self._json_answer("tokenize", request)

    async def detokenize(self, request):
        return await self._json_answer("detokenize", request)

    async def _json_answer(self, route: str, request):
        """A route whose JSON answer the reader process writes whole."""
        from aiohttp import web
        body = await self._off_loop(self._read, route, await self._body(request))
        return web.Response(body=body, content_type="application/json")

    async def metrics(self, request):
        from aiohttp import web
        from .metrics import exposition
        body, content_type = exposition(self.worker, self.run, self.access)
        kind, _, charset = content_type.partition("; charset=")
        return web.Response(body=body, content_type=kind, charset=charset or None)

    async def health(self, request):
        from aiohttp import web
        turns = self.worker.turns.summary() if self.worker.turns else None
        return web.json_response({"status": "ok", "queued": self.worker.queued(),
                                  "busy": self.worker.busy, **self.worker.counts,
                                  "engine": self.worker.figures(), "turn_reuse": turns})

    async def _body(self, request) -> list:
        """The request's body as the chunks it arrived in (never joined here: a long body
        is the reader process's to handle), whole within ``body_seconds`` (else ApiError
        408); 413 as soon as it is over MAX_BODY_BYTES, the rest unread."""
        if (request.content_length or 0) > MAX_BODY_BYTES:
            raise _too_large()

        async def read():
            chunks, size = [], 0
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large()
                chunks.append(chunk)
            return chunks
        try:
            return await asyncio.wait_for(read(), self.body_seconds)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.body_seconds:g} s", code="request_timeout") from None

    async def livez(self, request):
        from aiohttp import web
        return web.json_response({"status": "ok"})

    async def chat(self, request):
        return await self._answer(request, *await self._off_loop(
            self._prepared, "chat", await self._body(request)))

    async def completions(self, request):
        return await self._answer(request, *await self._off_loop(
            self._prepared, "completion", await self._body(request)))

    async def messages(self, request):
        """Anthropic's Messages API over the same path (``anthropic``)."""
        return await self._answer(request, *await self._off_loop(
            self._prepared, "messages", await self._body(request)))

    async def count_tokens(self, request):
        """Anthropic's token count: the prompt ids a Messages body renders to."""
        from aiohttp import web
        n = await self._off_loop(self._read, "count_tokens", await self._body(request))
        return web.json_response({"input_tokens": n})

    def _read(self, route: str, chunks: list):
        """What the reader process made of a body for ``route`` (on the CPU thread, which
        waits for it without holding the interpreter lock); what the template said
        meanwhile is logged."""
        value, heard = self.reader.call(route, chunks)
        for line in heard:
            if self.log:
                self.log(line)
        return value

    def _prepared(self, route: str, chunks: list) -> tuple:
        """A body read (``_read``), then its settings, grammar and reply reader (on the
        CPU thread): (Request, prompt ids, settings, ReplyReader, shareable preamble)."""
        req, ids, preamble = self._read(route, chunks)
        ids = ids.tolist()
        if req.images:
            ids = self._image_rows(req, ids)
        settings = self._settings(req)
        if req.chat:
            settings = self.run.chat_settings(settings, self.log)
            settings = self._tool_grammar(req, ids, settings)
        return req, ids, settings, self._reader(req, settings), preamble

    def _image_rows(self, req, ids) -> list:
        """The prompt ids with each image's pad expanded, its rows in ``req.image_rows``
        (each digest encoded once by this server: ``run.images.Images``); 400 for an image
        the tower cannot take or a conversation whose pads are not its images'."""
        from ..run.images import Images
        try:
            if self.images is None:
                self.images = Images(self.run.session, "an image part")
            loaded = [self.images.load_data(im.data, im.name) for im in req.images]
            ids, rows = self.images.expand(ids, loaded, "the rendered conversation")
        except K3Error as e:
            raise ApiError(400, client_line(e), param="messages", code="invalid_image") \
                from None
        req.images, req.image_rows = [], tuple(rows)
        return ids

    def _tool_grammar(self, req, ids, settings):
        """``settings`` with the grammar of the request's ``tool_choice``,
        ``parallel_tool_calls`` and thinking budget (docs/serve.md, tool_choice; compiled
        on this CPU thread, cached by its text). Unchanged when nothing is enforced ("auto"
        with parallel calls, no budget), or under a response_format's grammar (its JSON
        holds no call)."""
        choice, parallel, budget = req.tool_choice, req.parallel_tool_calls, req.think_budget
        if settings.grammar is not None or (choice == "auto" and (parallel or not req.tools)
                                            and budget is None):
            return settings
        if self.run.session.tokenizer is None or self.run.chat().template is None:
            if budget is not None:
                raise ApiError(422, "a thinking budget needs the model's chat template (its "
                                    "think channel)", param="thinking", code="invalid_value")
            if choice in ("none", "auto"):       # without a template no call is parsed
                return settings
            raise ApiError(422, "'tool_choice' needs the model's chat template (its calls are "
                                "read from the reply's markup)", param="tool_choice",
                           code="invalid_value")
        from ..constrain.tool_grammar import compile_tool_grammar, think_mode
        tok = self.run.session.tokenizer
        grammar = compile_tool_grammar(tok, req.tools, choice, parallel, think_mode(tok, ids),
                                       budget)
        return settings if grammar is None else dataclasses.replace(settings, grammar=grammar)

    def _settings(self, req):
        if req.stop and self.run.session.tokenizer is None:
            raise ApiError(422, "'stop' needs the model's tokenizer", param="stop")
        if (req.logprobs is not None or req.echo) and self.run.session.tokenizer is None:
            raise ApiError(422, "'logprobs' and 'echo' need the model's tokenizer (a token's "
                                "text)", param="logprobs" if req.logprobs is not None else "echo")
        # a format is compiled once per schema text (on this CPU thread) and enforced
        return self.run.structured(self.run.until_end(settings_over(req.generation, self.base)))


def beside_bytes(reuse_ram_bytes: int) -> int:
    """What a server holds beside the model, counted in its budget's admission
    (``RunOptions.beside_bytes``): the states it keeps for reuse (``--reuse-gb``) and its
    request reader at its peak."""
    return int(reuse_ram_bytes) + READER_RESERVE_BYTES


def serve(run, address: str, base_settings, *, api_key=None, log=print,
          reuse_ram_bytes: int = 0, model_name=None, log_json: bool = False) -> None:
    """Serve ``run`` on ``address`` until SIGINT or SIGTERM (then exit cleanly). States
    of finished requests are kept for reuse within ``reuse_ram_bytes`` (0: none), then
    in the run's prefix cache, with every conversation's preamble (formats/chat.md). The
    model is served as ``model_name`` (default: the checkpoint directory's name). Each
    request's access-log line goes to ``log``, as JSON with ``log_json``."""
    try:
        from aiohttp import web
    except ImportError:
        raise UsageError("--serve needs the serve extra: pip install 'k3[serve]' "
                         "(or -e '.[serve]' in a checkout)") from None
    host, port = check_address(address, api_key)
    if run.session.tokenizer is not None:
        run.session.tokenizer.get()            # read once, before two threads use it
        run.chat(log).template                 # read and compiled: a broken one exits 3 here
    from .turn_cache import TurnCache
    turns = TurnCache(run.cfg, reuse_ram_bytes, run.prefix_cache) \
        if reuse_ram_bytes or run.prefix_cache is not None else None
    model_name = model_name or os.path.basename(os.path.normpath(str(run.opts.model)))
    tok = run.session.tokenizer
    vision = run.session.ckpt.vision_config if tok is not None and run.opts.vision else None
    reader = ReaderProcess(ReaderSpec(
        str(run.opts.model), tok is not None,
        None if tok is None or tok.cache is None else str(tok.cache), run.opts.template_limits,
        run.cfg.vocab_size, run.context, model_name,
        base_settings.prefill_chunk if turns is not None else 0,
        run.ctx_size, vision.media if vision is not None else None, run.opts.image_dir))
    worker = Worker(run, run.width, log, turns, chunk=base_settings.prefill_chunk)
    server = Server(run, worker, reader, base_settings, api_key=api_key, log=log,
                    model_name=model_name, access=Access(log, log_json))

    async def main():
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                               logger=http_logger(log), max_line_size=PARSER_LINE_BYTES,
                               max_field_size=PARSER_LINE_BYTES)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise UsageError(f"--serve cannot listen on {host}:{port}: {e.strerror}") from None
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        log(f"k3 serving {server.model_name} on http://{shown}:{bound}/v1 "
            f"(chat/completions, completions, messages, models; /health; {LIVENESS} without the "
            f"key; llama-server's /completion and Ollama's /api), "
            f"up to {run.width} requests decoded together; Ctrl-C stops")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        reader.ready()              # its tokenizer and template read, before listening
        asyncio.run(main())
    finally:
        worker.close()
        reader.close()
        if turns is not None:
            turns.close()
