"""llama-server's and Ollama's routes on k3's server: ``/completion``, ``/props``,
``/slots``, ``/api/generate``, ``/api/chat``, ``/api/tags``, ``/api/show`` and
``/api/version`` (docs/serve.md "llama-server and Ollama routes").

Owns: the handlers, which turn a body into the OpenAI request (``compat``), run it as
one job through the same reader, settings and worker as ``/v1/completions`` and
``/v1/chat/completions`` (``app.Server``), and answer in the client's shape, whole or
streamed: SSE events for llama-server, NDJSON lines for Ollama. Does not own: the
shapes (``compat``), the request checks (``protocol``, in the reader process) or
generation (``worker``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from . import compat
from .access import USAGE, Usage
from .protocol import check_model, parse_body
from .worker import Job

SSE, NDJSON = "text/event-stream", "application/x-ndjson"


def add_routes(app, server) -> None:
    """Every route of this module on ``app``, answered by ``server`` (``app.Server``)."""
    routes = Routes(server)
    r = app.router
    r.add_post("/completion", routes.llama_completion)
    r.add_get("/props", routes.props)
    r.add_get("/slots", routes.slots)
    r.add_post("/api/generate", routes.ollama_generate)
    r.add_post("/api/chat", routes.ollama_chat)
    r.add_get("/api/tags", routes.tags)
    r.add_post("/api/show", routes.show)
    r.add_get("/api/version", routes.version)


class Routes:
    def __init__(self, server):
        self.s = server

    # ---- read-only ----
    def _template(self) -> str:
        run = self.s.run
        if run.session.tokenizer is None or run.chat().template is None:
            return ""
        templates = run.chat().template.templates
        return templates.get("default") or next(iter(templates.values()), "")

    async def props(self, request):
        from aiohttp import web
        return web.json_response(compat.llama_props(self.s.model_name, self.s.run.context,
                                                    self.s.worker.width, self._template()))

    async def slots(self, request):
        from aiohttp import web
        w = self.s.worker
        return web.json_response(compat.llama_slots(self.s.run.context, w.width, len(w.jobs)))

    async def tags(self, request):
        from aiohttp import web
        model = Path(self.s.run.opts.model)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        return web.json_response(compat.ollama_tags(self.s.model_name, size))

    async def show(self, request):
        from aiohttp import web
        doc = await self._doc(request)
        check_model(compat.served_name(doc.get("model", doc.get("name")), self.s.model_name),
                    self.s.model_name)
        return web.json_response(compat.ollama_show(self.s.model_name, self.s.run.context,
                                                    self._template()))

    async def version(self, request):
        from aiohttp import web
        return web.json_response(compat.version())

    async def _doc(self, request) -> dict:
        chunks = await self.s._body(request)
        return await self.s._off_loop(lambda: parse_body(b"".join(chunks)))

    # ---- generation ----
    async def llama_completion(self, request):
        doc = compat.llama_completion(await self._doc(request))
        return await self._run(request, "completion", doc, "llama")

    async def ollama_generate(self, request):
        raw = await self._doc(request)
        route, doc = compat.ollama_generate(raw, self.s.model_name)
        if not raw.get("prompt") and not raw.get("system"):
            return self._loaded(doc, chat=False)
        return await self._run(request, route, doc, "generate")

    async def ollama_chat(self, request):
        doc = compat.ollama_chat(await self._doc(request), self.s.model_name)
        if doc.get("messages") == []:
            return self._loaded(doc, chat=True)
        return await self._run(request, "chat", doc, "chat")

    def _loaded(self, doc: dict, chat: bool):
        """A load request (nothing to generate): the model named must be this one."""
        from aiohttp import web
        check_model(doc.get("model"), self.s.model_name)
        return web.json_response(compat.ollama_loaded(self.s.model_name, chat))

    async def _run(self, request, route: str, doc: dict, shape: str):
        """``doc`` (an OpenAI body) as one job; the answer in ``shape``'s words: "llama"
        (/completion), "generate" or "chat" (Ollama's, whose /api/generate may run a
        chat request: the prompt as a user turn)."""
        from aiohttp import web
        s = self.s
        stream = bool(doc.get("stream"))
        body = [json.dumps(doc).encode()]
        req, ids, settings, reader, preamble = await s._off_loop(s._prepared, route, body)
        job = Job(list(ids), settings, asyncio.get_running_loop(), preamble=preamble,
                  images=req.image_rows)
        s.worker.submit(job)
        model = s.model_name
        started = time.monotonic()
        try:
            if not stream:
                res = await s._finished(job, [])
                return web.json_response(await s._off_loop(
                    self._whole, req, res, reader, shape, model, started))
            return await self._stream(request, req, job, reader, shape, model, started)
        finally:
            job.cancel()
            request[USAGE] = Usage(len(ids), job.generated, job.first_token_at,
                                          job.last_token_at)

    def _whole(self, req, res, reader, shape, model, started) -> dict:
        if shape == "llama":
            return compat.llama_answer(reader.text(res.generated_ids), res, model)
        seconds = time.monotonic() - started
        message = compat.ollama_message(reader.read(res.generated_ids, final=True).message()) \
            if req.chat else {"role": "assistant", "content": reader.text(res.generated_ids)}
        if shape == "chat":
            return compat.ollama_answer(model, res, chat=True, message=message, seconds=seconds)
        return compat.ollama_answer(model, res, chat=False, seconds=seconds,
                                    text=message["content"])

    async def _stream(self, request, req, job, reader, shape, model, started):
        from aiohttp import web
        s = self.s
        resp = web.StreamResponse(headers={"Content-Type": SSE if shape == "llama" else NDJSON,
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        generated = []

        def line(doc) -> bytes:
            text = json.dumps(doc)
            return (f"data: {text}\n\n" if shape == "llama" else text + "\n").encode()

        def delta(final) -> dict:
            if req.chat:
                return reader.delta(generated, final)
            text = reader.text_delta(generated, final)
            return {"content": text} if text else {}

        async def send_new(final=False):
            d = await s._off_loop(delta, final)
            if d.get("content") or d.get("reasoning_content"):
                doc = {"content": d.get("content", ""), "stop": False} if shape == "llama" \
                    else compat.ollama_chunk(model, chat=shape == "chat", delta=d)
                await resp.write(line(doc))
        try:
            res = await s._finished(job, generated, send_new)
            await send_new(final=True)
            if shape == "llama":
                await resp.write(line(compat.llama_answer("", res, model)))
            else:
                await resp.write(line(compat.ollama_answer(
                    model, res, chat=shape == "chat", seconds=time.monotonic() - started)))
        except ConnectionError:
            raise
        except Exception as e:              # noqa: BLE001 (the headers are sent: a line)
            status, body = s._stream_failure(request, e)
            await resp.write(line(body if shape == "llama" else
                                  {"error": body["error"]["message"]}))
        await resp.write_eof()
        return resp

