"""The answers of the server's generation routes, from a request read and prepared.

Owns: a request's jobs (one per choice, the others following the first's prefill) queued
and cancelled when its answer ends or its client leaves, the usage the access log counts,
each choice's reply reader, waiting for a job's tokens (``Answers._finished``: keep-alives
while none come, a worker's failure turned into its ApiError), OpenAI's chat and
completion answers (one JSON response, or server-sent events as the tokens come, with
logprobs and echo) and Anthropic's Messages answers (one message, or its events). Does not own: routing,
middlewares or reading bodies (``app``), the shapes of one object or event (``protocol``,
``anthropic``), the queue and the engine thread (``worker``).

``Answers`` is a part of ``app.Server``, apart only for size: its methods read the
server's ``run``, ``keepalive_seconds``, ``_off_loop`` and ``_stream_failure``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from ..errors import K3Error, UsageError
from . import anthropic
from .access import USAGE, Usage
from ..engine.replies import ReplyReader
from .worker import Job
from .protocol import (ApiError, chat_logprobs, client_line, completion_logprobs, envelope,
                       finish_reason, sse, usage)


class Answers:
    """The answer-writing methods of ``app.Server``."""

    async def _answer(self, request, req, ids, settings, reader, preamble):
        """Queue the request's jobs and write its answer (whole or streamed)."""
        loop = asyncio.get_running_loop()
        # choice i draws with seed + i (mod 2^64); the others follow the first, which
        # prefills the prompt once (``Worker``)
        jobs = [Job(list(ids), dataclasses.replace(settings, seed=(settings.seed + i) % 2 ** 64),
                    loop, preamble=preamble if i == 0 else 0, logprobs=req.logprobs,
                    echo=req.echo, images=req.image_rows) for i in range(req.n)]
        jobs[0].followers = jobs[1:]
        readers = [reader] + [self._reader(req, settings) for _ in jobs[1:]]
        self.worker.submit(jobs[0])
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-k3-{next(self.ids)}"
        model = req.model or self.model_name
        try:
            if isinstance(req, anthropic.MessagesRequest):
                rid = "msg_k3_" + rid.rpartition("-")[2]
                answer = self._messages_stream if req.stream else self._messages_whole
                return await answer(request, req, jobs[0], rid, model, reader)
            if req.stream:
                return await self._stream(request, req, jobs, rid, model, readers)
            return await self._whole(req, jobs, rid, model, readers)
        finally:
            for job in jobs:
                job.cancel()        # the client went away (or we are done): stop decoding
            firsts = [j.first_token_at for j in jobs if j.first_token_at is not None]
            lasts = [j.last_token_at for j in jobs if j.last_token_at is not None]
            request[USAGE] = Usage(len(ids), sum(j.generated for j in jobs),
                                   min(firsts, default=None), max(lasts, default=None))

    def _reader(self, req, settings) -> ReplyReader:
        """What turns a choice's ids into its message or text, as they come."""
        chat = req.chat and self.run.chat().template is not None
        ends = tuple(settings.stop_ids) + (settings.grammar.end_ids(settings.stop_ids)
                                           if settings.grammar is not None else ())
        return ReplyReader(self.run.session.tokenizer, chat, req.stop, ends)

    async def _finished(self, job, generated, on_token=None, on_idle=None):
        """Wait for the job's end, collecting its tokens; the GenResult. ``on_idle()`` is
        awaited after each ``keepalive_seconds`` without an event."""
        while True:
            if on_idle is None:
                item = await job.events.get()
            else:
                try:
                    item = await asyncio.wait_for(job.events.get(), self.keepalive_seconds)
                except asyncio.TimeoutError:
                    await on_idle()
                    continue
            if isinstance(item, int):
                job.last_token_at = loop_time = time.monotonic()
                if job.first_token_at is None:
                    job.first_token_at = loop_time
                generated.append(item)
                if on_token is not None:
                    await on_token()
                continue
            kind, value = item
            if kind == "done":
                return value
            if kind == "cancelled":
                raise ApiError(503, "the server is shutting down", kind="server_error")
            if isinstance(value, UsageError):
                raise ApiError(422, client_line(value), code="invalid_value")
            raise ApiError(500, client_line(value) if isinstance(value, K3Error)
                           else f"generation failed: {value!r}", kind="server_error")

    async def _whole(self, req, jobs, rid, model, readers):
        from aiohttp import web
        results = await asyncio.gather(*(self._finished(job, []) for job in jobs))
        return web.json_response(text=await self._off_loop(
            self._whole_text, req, jobs, results, rid, model, readers))

    def _whole_text(self, req, jobs, results, rid, model, readers) -> str:
        """The JSON of a finished request's response (on the CPU thread: it decodes the
        whole replies and writes every prompt id)."""
        first = results[0]
        k3 = {"prompt_ids": first.prompt_ids, "generated_ids": first.generated_ids,
              "reused_tokens": jobs[0].reused}
        if len(jobs) > 1:
            k3["choices"] = [{"generated_ids": r.generated_ids, "reused_tokens": j.reused}
                             for j, r in zip(jobs, results)]
        use = usage(len(first.prompt_ids), sum(len(r.generated_ids) for r in results))
        tok = self.run.session.tokenizer
        choices = []
        for i, (job, res, reader) in enumerate(zip(jobs, results, readers)):
            if req.chat:
                reply = reader.read(res.generated_ids, final=True)
                choices.append({
                    "index": i, "message": reply.message(),
                    "logprobs": None if req.logprobs is None else
                    chat_logprobs(tok, job.token_logprobs),
                    "finish_reason": finish_reason(res.stop_reason, bool(reply.tool_calls))})
            else:
                head = self._echoed(req, res.prompt_ids)
                choices.append({
                    "index": i, "text": head + reader.text(res.generated_ids),
                    "logprobs": None if req.logprobs is None else
                    self._completion_logprobs(req, job, res.generated_ids),
                    "finish_reason": finish_reason(res.stop_reason, False)})
        kind = "chat.completion" if req.chat else "text_completion"
        return json.dumps(envelope(kind, rid, model, choices, {"usage": use, "k3": k3}))

    def _echo_chunk(self, req, job, sent, chunk) -> bytes:
        """A streamed completion's first chunk under echo: the prompt, and its logprobs
        when asked (the prompt is all fed before the first token is sampled)."""
        head = self._echoed(req, job.prompt_ids)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(self.run.session.tokenizer, job.prompt_ids,
                                           [None] + job.prompt_logprobs)
        sent["chars"] = len(head)
        return chunk(text=head, logprobs=logprobs)

    def _echoed(self, req, prompt_ids) -> str:
        """A completion's text before its reply: the prompt under ``echo`` (the text sent,
        or its ids decoded), else nothing."""
        if not req.echo:
            return ""
        return req.prompt if req.prompt is not None else \
            self.run.session.tokenizer.decode(prompt_ids)

    def _completion_logprobs(self, req, job, generated, start: int = 0, offset: int = 0,
                             prompt: bool = True):
        """A completion's ``logprobs`` for generated tokens from ``start`` (after the
        prompt's, under echo with ``prompt``), their text offsets counting from
        ``offset``."""
        tok = self.run.session.tokenizer
        ids, entries = list(generated[start:]), job.token_logprobs[start:len(generated)]
        if req.echo and prompt:
            ids = list(job.prompt_ids) + ids
            entries = [None] + job.prompt_logprobs + entries
        return completion_logprobs(tok, ids, entries, offset)

    async def _stream(self, request, req, jobs, rid, model, readers):
        from aiohttp import web
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        try:
            results = await asyncio.gather(*(
                self._stream_choice(resp, req, i, job, reader, kind, rid, model)
                for i, (job, reader) in enumerate(zip(jobs, readers))))
            if req.include_usage:
                await resp.write(sse(envelope(kind, rid, model, [], {
                    "usage": usage(len(results[0].prompt_ids),
                                   sum(len(r.generated_ids) for r in results))})))
        except ConnectionError:             # the client left: nobody to tell
            raise
        except Exception as e:              # noqa: BLE001 (the headers are sent: an event)
            await resp.write(sse(self._stream_failure(request, e)[1]))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp

    async def _stream_choice(self, resp, req, index, job, reader, kind, rid, model):
        """Choice ``index``'s chunks, written as its tokens come (beside the other
        choices'); its GenResult."""
        generated = []
        # tokens whose logprobs went out, and characters of text sent (a completion's
        # text_offset counts from the echoed prompt)
        sent = {"tokens": 0, "chars": 0}

        def chunk(delta=None, finish=None, text=None, logprobs=None):
            c = {"index": index, "logprobs": logprobs, "finish_reason": finish}
            if req.chat:
                c["delta"] = delta or {}
            else:
                c["text"] = text or ""
            return sse(envelope(kind, rid, model, [c]))

        def new_logprobs(final):
            """The logprobs of the tokens generated since the last chunk (None: not asked,
            or none new)."""
            start, end = sent["tokens"], len(generated)
            if req.logprobs is None or (end == start and not final):
                return None
            sent["tokens"] = end
            if req.chat:
                return chat_logprobs(self.run.session.tokenizer, job.token_logprobs[start:end])
            return self._completion_logprobs(req, job, generated[:end], start, sent["chars"],
                                             prompt=False)

        def new_chunk(final):
            """The chunk of what the reply gained since the last one, or None."""
            if req.chat:
                delta = reader.delta(generated, final)
                return chunk(delta=delta, logprobs=new_logprobs(final)) if delta else None
            text = reader.text_delta(generated, final)
            if not text:
                return None
            logprobs = new_logprobs(final)
            sent["chars"] += len(text)
            return chunk(text=text, logprobs=logprobs)

        async def send_new(final=False):
            if req.echo and not sent.get("echoed"):   # the prompt is in: its logprobs too
                sent["echoed"] = True
                await resp.write(await self._off_loop(self._echo_chunk, req, job, sent, chunk))
            # on the CPU thread: each delta decodes the whole reply so far
            data = await self._off_loop(new_chunk, final)
            if data:
                await resp.write(data)

        if req.chat:
            await resp.write(chunk(delta={"role": "assistant", "content": ""}))
        async def keep_alive():
            await resp.write(b": keep-alive\n\n")   # an SSE comment: clients skip it

        res = await self._finished(job, generated, send_new, keep_alive)
        await send_new(final=True)
        await resp.write(chunk(finish=finish_reason(res.stop_reason, reader.sent_calls > 0)))
        return res

    # ---- Anthropic's Messages API: one job, the shapes ``anthropic``'s ----
    async def _messages_whole(self, request, req, job, rid, model, reader):
        from aiohttp import web
        res = await self._finished(job, [])
        return web.json_response(text=await self._off_loop(
            self._message_text, req, job, res, rid, model, reader))

    def _message_text(self, req, job, res, rid, model, reader) -> str:
        """The JSON of a finished Messages response (on the CPU thread)."""
        reply = reader.read(res.generated_ids, final=True)
        reason = anthropic.stop_reason(res, bool(reply.tool_calls), self.run.session.tokenizer,
                                       req.stop)
        k3 = {"prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids,
              "reused_tokens": job.reused}
        return json.dumps(anthropic.message(rid, model, reply, reason, anthropic.usage(
            len(res.prompt_ids), len(res.generated_ids)), k3))

    async def _messages_stream(self, request, req, job, rid, model, reader):
        """Anthropic's events as the tokens come; a ping after message_start and after
        each ``keepalive_seconds`` without a token; a failure once the headers are out
        is an ``error`` event."""
        from aiohttp import web
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        generated, blocks = [], anthropic.Blocks()

        async def send_new(final=False):
            # on the CPU thread: each delta decodes the whole reply so far
            data = await self._off_loop(lambda: blocks.events(reader.delta(generated, final)))
            if data:
                await resp.write(data)

        async def ping():
            await resp.write(anthropic.PING)

        try:
            await resp.write(anthropic.start_event(rid, model, len(job.prompt_ids)) +
                             anthropic.PING)
            res = await self._finished(job, generated, send_new, ping)
            await send_new(final=True)
            reason = await self._off_loop(anthropic.stop_reason, res, reader.sent_calls > 0,
                                          self.run.session.tokenizer, req.stop)
            await resp.write(blocks.close() +
                             anthropic.end_events(reason, len(res.generated_ids)))
        except ConnectionError:             # the client left: nobody to tell
            raise
        except Exception as e:              # noqa: BLE001 (the headers are sent: an event)
            await resp.write(anthropic.error_event(anthropic.error_body(
                *self._stream_failure(request, e))))
        await resp.write_eof()
        return resp
