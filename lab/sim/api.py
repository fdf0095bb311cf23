"""The simulator's HTTP API: vLLM's OpenAI server routes plus /sim/faults and /sim/arrivals.

`build_app` wires one engine, its metrics and its fault knobs into an aiohttp app. Serve
it with handler cancellation on (`SimServer` does; aiohttp's TestServer does too), so a
client that disconnects cancels its handler and the handler aborts the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from pydantic import ValidationError

from lab.sim.audio import AudioHandlers
from lab.sim.choices import respond_all, stream_all, submit_all
from lab.sim.clock import Clock, SystemClock
from lab.sim.config import SIM_VERSION, SimConfig
from lab.sim.engine import Engine, QueueFullError
from lab.sim.errors import ApiError, json_response
from lab.sim.faults import FaultInjector, FaultKnobs
from lab.sim.metrics import CONTENT_TYPE, SimMetrics
from lab.sim.misbehave import WrongAnswer
from lab.sim.pooling import PoolingHandlers
from lab.sim.protocol import GenerationRequest, parse_chat, parse_completion
from lab.sim.responses import (
    DONE,
    SSE_CONTENT_TYPE,
    StreamEncoder,
    chat_completion,
    model_card,
    text_completion,
    usage,
)
from lab.sim.responses_api import ResponsesHandlers
from lab.sim.sequence import FinishReason, Sequence

_MAX_BODY_BYTES = 64 * 1024 * 1024  # long-context benchmarks send prompts of many MB
# Each token is its own write: aiohttp sets TCP_NODELAY on every server connection
# (BaseProtocol.connection_made) and StreamResponse.write hands data to the socket at
# once, so a token leaves without Nagle delay or buffering.

Parser = Callable[[bytes, SimConfig], GenerationRequest]


class SimHandlers:
    """Request handlers over one engine, its metrics and its fault knobs."""

    def __init__(self, config: SimConfig, engine: Engine, metrics: SimMetrics) -> None:
        self._config = config
        self._engine = engine
        self._metrics = metrics
        # Shared with the Responses API's handlers (lab.sim.responses_api).
        self.faults = FaultInjector(
            FaultKnobs(error_rate=config.error_rate, slow_factor=config.slow_factor), config.seed
        )
        self._created_s = int(time.time())
        # Handlers parked by the `hang` and `misbehave` faults; released at shutdown so that
        # stopping the server does not wait for requests that would never end.
        self.parked: set[asyncio.Future[None]] = set()
        # Those parked by `hang` alone: clearing it lets them go on (an engine that stalled
        # and came back, as a SIGSTOPped or starved one does).
        self.hung: set[asyncio.Future[None]] = set()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/version", self.version),
            web.get("/metrics", self.metrics),
            web.get("/sim/faults", self.get_faults),
            web.post("/sim/faults", self.set_faults),
            web.get("/sim/arrivals", self.get_arrivals),
        ]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl-")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl-")

    async def models(self, request: web.Request) -> web.Response:
        cards = [model_card(name, self._created_s, self._config.max_model_len)
                 for name in self._config.served_model_names]
        return json_response({"object": "list", "data": cards})

    async def health(self, request: web.Request) -> web.Response:
        status = 503 if self.faults.knobs.unhealthy else 200
        return web.Response(status=status)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": SIM_VERSION, "simulator": True})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.knobs.model_dump())

    async def get_arrivals(self, request: web.Request) -> web.Response:
        """Completion requests read since the knobs last changed (FaultInjector.arrivals)."""
        return json_response(self.faults.arrivals())

    async def set_faults(self, request: web.Request) -> web.StreamResponse:
        """Change the knobs named in the JSON body; answers with all knobs after the change."""
        try:
            changes = await request.json()
        except ValueError as exc:
            return ApiError(HTTPStatus.BAD_REQUEST, f"Invalid JSON: {exc}").response()
        if not isinstance(changes, dict):
            return ApiError(HTTPStatus.BAD_REQUEST, "Expected a JSON object of knobs.").response()
        try:
            knobs = self.faults.update(changes)
        except ValidationError as exc:
            return ApiError(HTTPStatus.BAD_REQUEST, str(exc)).response()
        self._engine.slow_factor = knobs.slow_factor
        self._engine.wedged = knobs.wedge
        if not knobs.hang:
            for waiter in self.hung:
                _wake(waiter)
        if knobs.crash:
            return await self._crash(request)
        return json_response(knobs.model_dump())

    async def release_parked(self, app: web.Application) -> None:
        for waiter in self.parked:
            waiter.cancel()
        if self._engine.wedged:  # what a wedged engine holds fails as it stops
            self._engine.abort_all()

    async def _crash(self, request: web.Request) -> web.StreamResponse:
        # Send the answer first so the caller knows the crash was on purpose, then die
        # without cleanup, the way a killed GPU server goes.
        response = json_response(self.faults.knobs.model_dump())
        await response.prepare(request)
        await response.write_eof()
        os._exit(1)

    async def _generate(
        self, request: web.Request, parse: Parser, id_prefix: str
    ) -> web.StreamResponse:
        try:
            generation = parse(await request.read(), self._config)
        except ApiError as exc:
            return exc.response()
        self.faults.arrived()
        knobs = self.faults.knobs
        if knobs.unserved:
            return ApiError(HTTPStatus.NOT_FOUND,
                            f"The model `{generation.model}` does not exist.",
                            param="model").response()
        if knobs.hang:
            await self.park(hung=True)
            if request.transport is None or request.transport.is_closing():
                return web.Response()  # its client left meanwhile (never sent: vLLM aborts)
            knobs = self.faults.knobs
        if knobs.misbehave != "none":
            return await self._misbehave(request, generation, knobs, id_prefix)
        if self.faults.draw_error():
            return ApiError(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                "Simulated engine failure (fault knob error_rate).",
            ).response()
        if generation.choices > 1:
            return await self._generate_many(request, generation, id_prefix)
        request_id = id_prefix + uuid.uuid4().hex
        try:
            seq = self._engine.submit(
                request_id, generation.prompt, generation.max_tokens, generation.ignore_eos
            )
        except QueueFullError as exc:
            refusal = ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
            if generation.stream and self.faults.knobs.busy_in_stream:
                return await self._stream_refusal(request, refusal)
            return refusal.response()
        cut_after = self.faults.draw_mid_stream_cut()
        try:
            if generation.stream:
                return await self._stream(request, generation, seq, cut_after)
            return await self._respond(request, generation, seq, cut_after)
        finally:
            # A no-op for finished sequences; otherwise the client went away (the handler
            # was cancelled) and its slot and KV blocks go back to the pool.
            self._engine.abort(seq)

    async def _generate_many(self, request: web.Request, generation: GenerationRequest,
                             id_prefix: str) -> web.StreamResponse:
        """n > 1 (lab.sim.choices)."""
        try:
            request_id, seqs = submit_all(self._engine, generation, id_prefix)
        except ApiError as refusal:
            if generation.stream and self.faults.knobs.busy_in_stream:
                return await self._stream_refusal(request, refusal)
            return refusal.response()
        try:
            if generation.stream:
                return await stream_all(request, generation, request_id, seqs)
            return await respond_all(generation, request_id, seqs)
        finally:
            for seq in seqs:
                self._engine.abort(seq)

    async def _misbehave(self, request: web.Request, generation: GenerationRequest,
                         knobs: FaultKnobs, id_prefix: str) -> web.StreamResponse:
        """The engine serves the request as usual, so that its metrics (and the agent's
        heartbeats) look healthy, while the answer goes wrong: a fault between a working
        engine and the router, which only the router's own observations can find."""
        try:
            seq: Sequence | None = self._engine.submit(
                id_prefix + uuid.uuid4().hex, generation.prompt, generation.max_tokens,
                generation.ignore_eos)
        except QueueFullError:
            seq = None  # a full engine: the answer goes wrong all the same
        try:
            return await WrongAnswer(request, generation, knobs, self.park).play(knobs.misbehave)
        finally:
            if seq is not None:
                self._engine.abort(seq)

    async def _stream_refusal(self, request: web.Request, refusal: ApiError) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await response.prepare(request)
        await response.write(refusal.event())
        await response.write(DONE)
        await response.write_eof()
        return response

    async def park(self, timeout_s: float | None = None, *, hung: bool = False) -> None:
        """Wait until released at shutdown (CancelledError), or `timeout_s` has passed, or
        (`hung`) the `hang` knob is cleared."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _wake, waiter)
        self.parked.add(waiter)
        if hung:
            self.hung.add(waiter)
        try:
            await waiter
        finally:
            self.parked.discard(waiter)
            self.hung.discard(waiter)
            if timer is not None:
                timer.cancel()

    async def _stream(
        self,
        request: web.Request,
        generation: GenerationRequest,
        seq: Sequence,
        cut_after: int | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        encoder = StreamEncoder(generation.kind, seq.request_id, int(time.time()), generation.model)
        try:
            # vLLM (Starlette) sends the headers at once; the body starts with the first token.
            await response.prepare(request)
            completed = await self._send_tokens(response, encoder, seq, cut_after)
            if not completed:
                self._cut(request, seq)
                return response
            if generation.include_usage:
                await response.write(encoder.usage(seq.prompt.num_tokens, len(seq.output)))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; _generate aborts the sequence
        return response

    async def _send_tokens(
        self,
        response: web.StreamResponse,
        encoder: StreamEncoder,
        seq: Sequence,
        cut_after: int | None,
    ) -> bool:
        """Write one SSE event per token, as soon as the engine step produced it.

        Returns False when the stream must be cut instead of finished: after `cut_after`
        tokens (mid-stream fault), or if the engine stopped the sequence.
        """
        sent = 0
        while True:
            await seq.wait_for_output(sent)
            available = len(seq.output)
            if cut_after is not None:
                available = min(available, cut_after)
            completed = (
                cut_after is None
                and seq.finished
                and seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            )
            chunks = [encoder.first()] if sent == 0 and available > 0 else []
            for index in range(sent, available):
                reason = seq.finish_reason if completed and index == available - 1 else None
                chunks.append(encoder.token(seq.output[index], reason.value if reason else None))
            sent = available
            if chunks:
                await response.write(b"".join(chunks))
            if completed:
                return True
            if seq.finished or (cut_after is not None and sent >= cut_after):
                return False

    async def _respond(
        self,
        request: web.Request,
        generation: GenerationRequest,
        seq: Sequence,
        cut_after: int | None,
    ) -> web.StreamResponse:
        if cut_after is None:
            await seq.wait_finished()
        else:
            while len(seq.output) < cut_after and not seq.finished:
                await seq.wait_for_output(len(seq.output))
            self._cut(request, seq)
            return web.Response()
        reason = seq.finish_reason
        if reason is None or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "The request was aborted.").response()
        build = chat_completion if generation.kind == "chat" else text_completion
        body = build(
            seq.request_id,
            int(time.time()),
            generation.model,
            "".join(seq.output),
            reason.value,
            usage(seq.prompt.num_tokens, len(seq.output)),
        )
        return json_response(body)

    def _cut(self, request: web.Request, seq: Sequence) -> None:
        """Drop the connection without finishing the response (mid-stream failure)."""
        self._engine.abort(seq, FinishReason.ERROR)
        transport = request.transport
        if transport is not None:
            transport.abort()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@web.middleware
async def _json_not_found(
    request: web.Request,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """An unknown path answers as vLLM's (FastAPI's) does: 404 {"detail": "Not Found"}."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)


def build_app(config: SimConfig, *, clock: Clock | None = None) -> web.Application:
    """The simulator as an aiohttp app; the engine loop runs while the app is running.

    `clock` defaults to real time. Serve with handler_cancellation=True (see module doc).
    """
    metrics = SimMetrics(config)
    engine = Engine(config, clock or SystemClock(), metrics)
    metrics.watch(engine)
    handlers = SimHandlers(config, engine, metrics)

    async def run_engine(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run(), name="sim-engine")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_json_not_found])
    app.add_routes(handlers.routes())
    app.add_routes(PoolingHandlers(config, engine).routes())
    app.add_routes(AudioHandlers(config, engine).routes())
    responses = ResponsesHandlers(config, engine, handlers.faults, handlers.park)
    app.add_routes(responses.routes())
    app.cleanup_ctx.append(run_engine)
    app.on_shutdown.append(handlers.release_parked)
    app.on_shutdown.append(responses.stop_background)
    return app
