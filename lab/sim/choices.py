"""n > 1: one request, `n` sequences of the same prompt in the engine, answered as vLLM
answers them (one body with n choices; or one stream whose chunks each carry one
choice's `index`, in the order the engine produced the tokens).

The fault knobs that cut a response mid-way (mid_stream_cut_rate) apply to n = 1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from http import HTTPStatus
from typing import Any

from aiohttp import web

from lab.sim.engine import Engine, QueueFullError
from lab.sim.errors import ApiError, json_response
from lab.sim.protocol import GenerationRequest
from lab.sim.responses import (
    DONE,
    SSE_CONTENT_TYPE,
    StreamEncoder,
    chat_completion,
    text_completion,
    usage,
)
from lab.sim.sequence import FinishReason, Sequence

_DONE_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


def submit_all(engine: Engine, generation: GenerationRequest, id_prefix: str
               ) -> tuple[str, list[Sequence]]:
    """The request's id and its n sequences (each choice's words seeded apart). Raises
    ApiError(503) when the engine's queue cannot take them all (none stays queued)."""
    request_id = id_prefix + uuid.uuid4().hex
    seqs: list[Sequence] = []
    try:
        for index in range(generation.choices):
            prompt = dataclasses.replace(generation.prompt, seed=generation.prompt.seed + index)
            seqs.append(engine.submit(f"{request_id}-{index}", prompt, generation.max_tokens,
                                      generation.ignore_eos))
    except QueueFullError as exc:
        for seq in seqs:
            engine.abort(seq)
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc
    return request_id, seqs


async def respond_all(generation: GenerationRequest, request_id: str,
                      seqs: list[Sequence]) -> web.Response:
    for seq in seqs:
        await seq.wait_finished()
    if any(seq.finish_reason not in _DONE_REASONS for seq in seqs):
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "The request was aborted.").response()
    build = chat_completion if generation.kind == "chat" else text_completion
    completion_tokens = sum(len(seq.output) for seq in seqs)
    choices: list[dict[str, Any]] = []
    body: dict[str, Any] = {}
    for index, seq in enumerate(seqs):
        reason = seq.finish_reason
        assert reason is not None
        body = build(request_id, int(time.time()), generation.model, "".join(seq.output),
                     reason.value, usage(seqs[0].prompt.num_tokens, completion_tokens))
        choices.append({**body["choices"][0], "index": index})
    return json_response({**body, "choices": choices})


async def stream_all(request: web.Request, generation: GenerationRequest, request_id: str,
                     seqs: list[Sequence]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    created = int(time.time())
    encoders = [StreamEncoder(generation.kind, request_id, created, generation.model, index)
                for index in range(len(seqs))]
    sent = [0] * len(seqs)
    open_ = set(range(len(seqs)))
    try:
        await response.prepare(request)
        while open_:
            waits = [asyncio.ensure_future(seqs[i].wait_for_output(sent[i])) for i in open_]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            chunks: list[bytes] = []
            for index in sorted(open_):
                seq, available = seqs[index], len(seqs[index].output)
                completed = seq.finished and seq.finish_reason in _DONE_REASONS
                if seq.finished and not completed:  # aborted: drop the connection
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if sent[index] == 0 and available > 0:
                    chunks.append(encoders[index].first())
                for at in range(sent[index], available):
                    last = completed and at == available - 1
                    reason = seq.finish_reason if last else None
                    chunks.append(encoders[index].token(seq.output[at],
                                                        reason.value if reason else None))
                sent[index] = available
                if completed:
                    open_.discard(index)
            if chunks:
                await response.write(b"".join(chunks))
        if generation.include_usage:
            await response.write(encoders[0].usage(seqs[0].prompt.num_tokens, sum(sent)))
        await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the caller aborts the sequences
    return response
