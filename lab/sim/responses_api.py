"""The Responses API as vLLM 0.32 serves it with VLLM_ENABLE_RESPONSES_API_STORE=1
(shapes: lab.sim.responses_body; captured: tests/fixtures/vllm-0.32-cpu-responses.json).

POST /v1/responses runs one sequence through the engine as chat does (queueing, prefill,
decode steps, metrics), streamed or not, and stores the finished response unless
`store: false`. `background: true` answers at once with the response "queued" (and with
its stream, if `stream` is set) while the engine works on it; GET shows "queued" until it
finishes (vLLM never stores "in_progress"), then "completed" or "incomplete". POST
.../cancel cancels a queued one (its sequence is aborted) and refuses any other with 400.

Faults: `hang`, `error_rate` (500 before the first byte), `mid_stream_error_rate` (the
connection is cut after 1-3 tokens) and a full queue (503) apply as to chat; the
`misbehave` modes apply to chat and completions only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from aiohttp import web

from lab.sim.config import SimConfig
from lab.sim.engine import Engine, QueueFullError
from lab.sim.errors import ApiError, json_response
from lab.sim.faults import FaultInjector
from lab.sim.misbehave import Park
from lab.sim.responses import SSE_CONTENT_TYPE
from lab.sim.responses_body import ResponseEvents, response_body, responses_usage, status_of
from lab.sim.responses_request import INVALID_REQUEST, ResponsesTurn, not_found, parse_responses
from lab.sim.responses_store import EventLog, ResponseStore, StoredResponse
from lab.sim.sequence import FinishReason, Sequence

_DONE_REASONS = (FinishReason.STOP, FinishReason.LENGTH)
_CANCELLABLE = ("queued", "in_progress")


class StreamCut(Exception):
    """The stream ends without response.completed: a mid-stream fault, or an aborted
    sequence."""


class ResponsesHandlers:
    """Handlers of /v1/responses over one engine, sharing the chat handlers' fault knobs."""

    def __init__(self, config: SimConfig, engine: Engine, faults: FaultInjector,
                 park: Park) -> None:
        self._config = config
        self._engine = engine
        self._faults = faults
        self._park = park
        self._store = ResponseStore(config.responses_store_max)
        # Background requests run as tasks owned by the app: cancelled at shutdown.
        self._background: set[asyncio.Task[None]] = set()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{response_id}", self.retrieve),
            web.post("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    async def stop_background(self, app: web.Application) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            turn = parse_responses(await request.read(), self._config, self._store)
        except ApiError as exc:
            return exc.response()
        self._faults.arrived()
        if self._faults.knobs.hang:
            await self._park()
        if self._faults.draw_error():
            return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                            "Simulated engine failure (fault knob error_rate).").response()
        try:
            seq = self._engine.submit(turn.header.response_id, turn.prompt, turn.max_tokens,
                                      turn.ignore_eos)
        except QueueFullError as exc:
            return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)).response()
        if turn.background:
            return await self._start_background(request, turn, seq)
        cut_after = self._faults.draw_mid_stream_cut()
        try:
            if turn.stream:
                return await self._stream(request, turn, seq, cut_after)
            return await self._respond(request, turn, seq, cut_after)
        finally:
            # A no-op once finished; else the client went away and the slot is freed.
            self._engine.abort(seq)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """The stored response; with ?stream=true, a background stream's events from
        sequence number `starting_after` + 1 on."""
        response_id = request.match_info["response_id"]
        stored = self._store.get(response_id)
        if stored is None:
            return not_found(response_id).response()
        if request.query.get("stream", "false").lower() not in ("true", "1"):
            return json_response(stored.body)
        after = request.query.get("starting_after")
        if stored.events is None or (after is not None and not after.lstrip("-").isdigit()):
            # vLLM fails such a stream after its 200; the simulator refuses it up front.
            return ApiError(HTTPStatus.BAD_REQUEST, f"Unknown response_id: {response_id}",
                            param="response_id").response()
        start = 0 if after is None else max(0, int(after) + 1)
        return await self._follow(request, stored.events, start)

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self._store.get(response_id)
        if stored is None:
            return not_found(response_id).response()
        if stored.status not in _CANCELLABLE:
            return ApiError(HTTPStatus.BAD_REQUEST, "Cannot cancel a synchronous response.",
                            param="response_id", error_type=INVALID_REQUEST).response()
        stored.body = {**stored.body, "status": "cancelled"}
        if stored.task is not None:
            stored.task.cancel()
            await asyncio.wait([stored.task])
        return json_response(stored.body)

    # -- one request ---------------------------------------------------------------------

    async def _respond(self, request: web.Request, turn: ResponsesTurn, seq: Sequence,
                       cut_after: int | None) -> web.StreamResponse:
        if cut_after is not None:
            while len(seq.output) < cut_after and not seq.finished:
                await seq.wait_for_output(len(seq.output))
            self._cut(request, seq)
            return web.Response()
        await seq.wait_finished()
        body = self._finish(turn, seq, ResponseEvents(turn.header))
        if body is None:
            return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                            "The request was aborted.").response()
        return json_response(body)

    async def _stream(self, request: web.Request, turn: ResponsesTurn, seq: Sequence,
                      cut_after: int | None) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        try:
            await response.prepare(request)
            async for batch in self._events(turn, seq, ResponseEvents(turn.header), cut_after):
                await response.write(b"".join(batch))
            await response.write_eof()
        except StreamCut:
            self._cut(request, seq)
        except ConnectionResetError:
            pass  # the client went away; create() aborts the sequence
        return response

    async def _events(self, turn: ResponsesTurn, seq: Sequence, events: ResponseEvents,
                      cut_after: int | None) -> AsyncIterator[list[bytes]]:
        """The stream's events, a batch per engine step; raises StreamCut instead of
        finishing when the stream must break. Stores the response before its
        response.completed goes out, so that a client that has it can GET it."""
        yield events.opening()
        sent = 0
        while True:
            await seq.wait_for_output(sent)
            available = len(seq.output)
            if cut_after is not None:
                available = min(available, cut_after)
            batch = events.first_token() if sent == 0 and available > 0 else []
            batch.extend(events.delta(token) for token in seq.output[sent:available])
            sent = available
            if batch:
                yield batch
            if cut_after is not None and sent >= cut_after:
                raise StreamCut
            if seq.finished and sent == len(seq.output):
                break
        body = self._finish(turn, seq, events)
        if body is None:
            raise StreamCut
        yield events.closing(body)

    def _finish(self, turn: ResponsesTurn, seq: Sequence, events: ResponseEvents
                ) -> dict[str, Any] | None:
        """The finished response (stored if asked), or None if the sequence was aborted."""
        reason = seq.finish_reason
        if reason not in _DONE_REASONS:
            return None
        text = "".join(seq.output)
        usage = responses_usage(seq.prompt.num_tokens, len(seq.output), seq.cached_tokens)
        body = events.final_body(text, status_of(reason), usage)
        if turn.store:
            earlier = self._store.get(turn.header.response_id)
            if earlier is None or earlier.status != "cancelled":  # a cancel is final
                self._store.put(StoredResponse(body, f"{turn.conversation}\n{text}",
                                               earlier.events if earlier else None))
        return body

    def _cut(self, request: web.Request, seq: Sequence) -> None:
        """Drop the connection without finishing the response (mid-stream failure)."""
        self._engine.abort(seq, FinishReason.ERROR)
        if request.transport is not None:
            request.transport.abort()

    # -- background ----------------------------------------------------------------------

    async def _start_background(self, request: web.Request, turn: ResponsesTurn,
                                seq: Sequence) -> web.StreamResponse:
        queued = response_body(turn.header, "queued")
        log = EventLog() if turn.stream else None
        stored = StoredResponse(queued, turn.conversation, log)
        self._store.put(stored)
        task = asyncio.create_task(self._run_background(turn, seq, log),
                                   name=f"sim-background-{turn.header.response_id}")
        stored.task = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if log is None:
            return json_response(queued)
        return await self._follow(request, log, 0)

    async def _run_background(self, turn: ResponsesTurn, seq: Sequence,
                              log: EventLog | None) -> None:
        """Runs the sequence to its end whoever listens; a cancel aborts it."""
        events = ResponseEvents(turn.header)
        finished = False
        try:
            if log is None:
                await seq.wait_finished()
                finished = self._finish(turn, seq, events) is not None
            else:
                async for batch in self._events(turn, seq, events, None):
                    log.extend(batch)
                finished = True
        except StreamCut:
            pass
        finally:
            self._engine.abort(seq)
            if log is not None:
                log.close()
        stored = self._store.get(turn.header.response_id)
        if not finished and stored is not None and stored.status in _CANCELLABLE:
            stored.body = {**stored.body, "status": "failed"}

    async def _follow(self, request: web.Request, log: EventLog, start: int
                      ) -> web.StreamResponse:
        """A background stream's events to this client, from index `start` on."""
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        try:
            await response.prepare(request)
            async for event in log.follow(start):
                await response.write(event)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; the background request goes on
        return response
