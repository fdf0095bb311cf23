"""POST /v1/audio/transcriptions and /v1/audio/translations, in vLLM 0.32's shapes.

The shapes are read from vLLM 0.32's source (vllm/entrypoints/speech_to_text/: base and
transcription protocol.py and serving.py), not captured: the tiny test model is not a
speech model, so the real server cannot serve these routes with it. What vLLM answers:

- a multipart form with `file` and `model` (and optional `language`, `prompt`,
  `response_format`, `temperature`, `stream`, `stream_include_usage`);
- transcription: `{"text": ..., "usage": {"type": "duration", "seconds": <ceil of the
  audio's length>}}`; translation: `{"text": ...}` (vLLM sends no usage there);
- `response_format` "json" or "text" both get that JSON (vLLM 0.32 has no plain-text
  answer); "verbose_json" and "diarized_json" are refused for a model without segment
  timestamps, "srt" and "vtt" always;
- `stream=true`: `data: {"id": "transcribe-...", "object": "transcription.chunk",
  "created", "model", "choices": [{"delta": {"content": ...}}]}` per piece of text, the
  last with "finish_reason": "stop", "stop_reason": null; with stream_include_usage a
  chunk of `"choices": [], "usage": {...}`; then `data: [DONE]`.

The text is fixed (TRANSCRIPT); each of its words is one decode step of the simulated
engine, after a prefill of ~50 tokens per second of audio (Whisper's encoder rate).
"""

from __future__ import annotations

import contextlib
import io
import math
import secrets
import time
import wave
import zlib
from http import HTTPStatus
from typing import Any, Literal

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from lab.sim.config import SimConfig
from lab.sim.engine import Engine, QueueFullError
from lab.sim.errors import ApiError, compact_text, json_response
from lab.sim.responses import DONE, SSE_CONTENT_TYPE
from lab.sim.sequence import Sequence
from lab.sim.tokens import prompt_from_token_ids

TRANSCRIPT = "The simulated audio says what every simulated audio says."
AUDIO_TOKENS_PER_S = 50
# Bytes per second of an audio file that is not WAV: 16 kHz, 16-bit mono PCM.
ASSUMED_BYTES_PER_S = 32_000
Task = Literal["transcribe", "translate"]
_FORMATS = ("json", "text", "verbose_json", "diarized_json")
_CHUNK_OBJECT = {"transcribe": "transcription.chunk", "translate": "translation.chunk"}


def audio_seconds(data: bytes) -> float:
    """The length of a WAV file from its header; of anything else, from its size."""
    with contextlib.suppress(wave.Error, EOFError), wave.open(io.BytesIO(data)) as audio:
        frames: int = audio.getnframes()
        rate: int = audio.getframerate()
        return frames / max(1, rate)
    return len(data) / ASSUMED_BYTES_PER_S



class AudioHandlers:
    """Handlers of the two audio routes over one engine."""

    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self._config = config
        self._engine = engine

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/audio/transcriptions", self.transcriptions),
            web.post("/v1/audio/translations", self.translations),
        ]

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "translate")

    async def _serve(self, request: web.Request, task: Task) -> web.StreamResponse:
        try:
            try:
                form = await request.post()
            except (ValueError, HttpProcessingError) as exc:  # a form FastAPI refuses
                raise ApiError(HTTPStatus.BAD_REQUEST, f"There was an error parsing the "
                               f"body: {type(exc).__name__}") from None
            data, model = self._read_form(form)
            seconds = audio_seconds(data)
            seq = self._submit(data, seconds)
        except ApiError as exc:
            return exc.response()
        try:
            if str(form.get("stream", "false")).lower() in ("true", "1"):
                include_usage = str(form.get("stream_include_usage", "false")).lower()
                return await self._stream(request, seq, task, model,
                                          include_usage in ("true", "1"))
            await seq.wait_finished()
            if task == "translate":
                return json_response({"text": TRANSCRIPT})
            return json_response({"text": TRANSCRIPT, "usage": {
                "type": "duration", "seconds": math.ceil(seconds)}})
        finally:
            self._engine.abort(seq)

    def _read_form(self, form: Any) -> tuple[bytes, str]:
        """The audio's bytes and the model's name, or vLLM's refusal."""
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            raise ApiError(HTTPStatus.BAD_REQUEST, "Field required: file", param="file")
        model = str(form.get("model") or self._config.served_model_names[0])
        if model not in self._config.served_model_names:
            aliases = ", ".join(self._config.served_model_names)
            raise ApiError(HTTPStatus.NOT_FOUND,
                           f"The model `{model}` does not exist. Valid aliases: {aliases}.",
                           param="model")
        response_format = str(form.get("response_format") or "json")
        if response_format not in _FORMATS:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Currently only support response_format: "
                           "`text`, `json`, `verbose_json` or `diarized_json`")
        if response_format in ("verbose_json", "diarized_json"):
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           f"Currently do not support {response_format} for {model}")
        data = upload.file.read()
        if not data:
            raise ApiError(HTTPStatus.BAD_REQUEST, "Invalid or unsupported audio file.",
                           param="file")
        return data, model

    def _submit(self, data: bytes, seconds: float) -> Sequence:
        words = len(TRANSCRIPT.split())
        tokens = max(1, min(math.ceil(seconds * AUDIO_TOKENS_PER_S),
                            self._config.max_model_len - words - 1))
        first = zlib.crc32(data)
        prompt = prompt_from_token_ids([first + i for i in range(tokens)],
                                       self._config.block_size, self._config.seed)
        try:
            return self._engine.submit("audio-" + secrets.token_hex(8), prompt, words, True)
        except QueueFullError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc

    async def _stream(self, request: web.Request, seq: Sequence, task: Task, model: str,
                      include_usage: bool) -> web.StreamResponse:
        words = TRANSCRIPT.split()
        head = (f'data: {{"id":"{task}-{secrets.token_hex(8)}","object":"{_CHUNK_OBJECT[task]}",'
                f'"created":{int(time.time())},"model":{compact_text(model)},')
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        try:
            await response.prepare(request)
            sent = 0
            while sent < len(words) and not (seq.finished and sent >= len(seq.output)):
                await seq.wait_for_output(sent)
                chunks = [self._chunk(head, words, index)
                          for index in range(sent, min(len(seq.output), len(words)))]
                sent += len(chunks)
                await response.write(b"".join(chunks))
            if include_usage:
                usage = {"prompt_tokens": seq.prompt.num_tokens, "total_tokens":
                         seq.prompt.num_tokens + sent, "completion_tokens": sent}
                await response.write(
                    f'{head}"choices":[],"usage":{compact_text(usage)}}}\n\n'.encode())
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; _serve aborts the sequence
        return response

    @staticmethod
    def _chunk(head: str, words: list[str], index: int) -> bytes:
        """One word of the text; the last says why the text ended."""
        choice: dict[str, Any] = {
            "delta": {"content": words[index] if index == 0 else " " + words[index]}}
        if index == len(words) - 1:
            choice.update(finish_reason="stop", stop_reason=None)
        return f'{head}"choices":[{compact_text(choice)}]}}\n\n'.encode()
