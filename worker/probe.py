"""Read one vLLM server's /health, /metrics, /v1/models and /version.

Parsing is pure (text or JSON in, values out) so that it is tested against real vLLM
captures; `EngineProber` only adds HTTP. /metrics is parsed by worker.engine_metrics;
/v1/models and /version here. A value the engine does not expose is None, never a silent
0, and every name read is kept within the heartbeat's limits (worker.schema, MAX_*).
An answer longer than MAX_BODY_BYTES is not read, let alone parsed: the probe fails.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from worker.engine_metrics import MetricsSample, parse_metrics
from worker.schema import MAX_CONTEXT_TOKENS, MAX_NAME_CHARS, MAX_NAMES

log = logging.getLogger(__name__)

# vLLM's /metrics is some 50 KB (more with many models or LoRA adapters). Parsing 9 MB of
# Prometheus text takes ~2 s of CPU, and the agent must beat within a TTL meanwhile: an
# answer over this is refused after reading at most this much plus one byte.
MAX_BODY_BYTES = 2 * 1024 * 1024
# A /metrics body over this (legal, but unusually long) is parsed in a thread, so that the
# event loop goes on beating meanwhile.
PARSE_IN_THREAD_BYTES = 256 * 1024

_Parsed = TypeVar("_Parsed")


class BodyTooLargeError(ValueError):
    """The engine answered more than MAX_BODY_BYTES."""


@dataclass(frozen=True)
class ServedModels:
    """Base models and LoRA adapters listed by /v1/models."""

    models: tuple[str, ...]
    lora_adapters: tuple[str, ...]
    # The engine's context length (vLLM's `max_model_len` on each card: one per server,
    # the smallest if its cards differ); None when no card says.
    max_model_len: int | None = None


def parse_models(payload: Any) -> ServedModels:
    """Split an OpenAI /v1/models answer into base models and LoRA adapters, with the
    context length the cards give.

    vLLM sets `parent` on adapters only. `root` is not used: with --served-model-name a
    base model's `root` (its path) differs from its `id` too. A `max_model_len` that is
    not a whole number of tokens within the heartbeat's limits is left out (unknown), as
    an engine that names none: routers then never route by it.
    """
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("expected an object with a 'data' list")
    models: list[str] = []
    adapters: list[str] = []
    lengths: list[int] = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise ValueError("every entry needs a string 'id'")
        if not 1 <= len(entry["id"]) <= MAX_NAME_CHARS:
            raise ValueError(f"a model id of {len(entry['id'])} characters (a heartbeat "
                             f"carries 1 to {MAX_NAME_CHARS})")
        (adapters if entry.get("parent") else models).append(entry["id"])
        length = entry.get("max_model_len")
        if type(length) is int and 1 <= length <= MAX_CONTEXT_TOKENS:
            lengths.append(length)
    if max(len(models), len(adapters)) > MAX_NAMES:
        raise ValueError(f"{len(models)} models and {len(adapters)} adapters (a heartbeat "
                         f"carries at most {MAX_NAMES} of each)")
    return ServedModels(tuple(models), tuple(adapters), min(lengths, default=None))


@dataclass(frozen=True)
class EngineVersion:
    """/version: vLLM answers {"version": "0.32.0"}; globalpool's simulator adds
    "simulator": true, so that its heartbeats never pass for a real vLLM."""

    version: str
    simulator: bool = False


def parse_version(payload: Any) -> EngineVersion:
    version = payload.get("version") if isinstance(payload, dict) else None
    if not isinstance(version, str) or not 1 <= len(version) <= MAX_NAME_CHARS:
        raise ValueError(f"expected {{'version': '<string of 1 to {MAX_NAME_CHARS} "
                         "characters>'}")
    return EngineVersion(version, simulator=payload.get("simulator") is True)


@dataclass(frozen=True)
class ProbeResult:
    """What one probe saw. A part that failed is None and its reason is in `errors`."""

    health_ok: bool
    metrics: MetricsSample | None
    models: ServedModels | None
    version: EngineVersion | None
    errors: tuple[str, ...] = ()

    @property
    def engine_ok(self) -> bool:
        """Healthy and measurable: what `ready` requires of the engine."""
        return self.health_ok and self.metrics is not None


def open_engine_session(timeout_s: float = 1.0) -> aiohttp.ClientSession:
    """The one HTTP session to the engine. `timeout_s` bounds each request, connect included,
    so that a hung engine delays a heartbeat by at most that much."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 0.5))
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=8), raise_for_status=False
    )


class EngineProber:
    """Probes one engine over a caller-owned session; caches /version while /health answers."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str) -> None:
        self._session = session
        self._base = engine_url.rstrip("/")
        self._version: EngineVersion | None = None
        self._refused: set[str] = set()  # paths whose last answer was too large

    async def probe(self) -> ProbeResult:
        """Read the four endpoints concurrently. Never raises for engine failures."""
        errors: list[str] = []
        health, metrics_text, models_json, version_json = await asyncio.gather(
            self._get("/health", errors, want="status"),
            self._get("/metrics", errors, want="text"),
            self._get("/v1/models", errors, want="json"),
            self._get("/version", errors, want="json") if self._version is None else _none(),
        )
        if metrics_text is not None and len(metrics_text) > PARSE_IN_THREAD_BYTES:
            metrics = await asyncio.to_thread(
                _guard, parse_metrics, metrics_text, "/metrics", errors)
        else:
            metrics = _guard(parse_metrics, metrics_text, "/metrics", errors)
        models = _guard(parse_models, models_json, "/v1/models", errors)
        if self._version is None:
            self._version = _guard(parse_version, version_json, "/version", errors)
        result = ProbeResult(
            health_ok=health is not None,
            metrics=metrics,
            models=models,
            version=self._version,
            errors=tuple(errors),
        )
        if not result.health_ok:
            # The engine that answers next may be another one (restarted, maybe upgraded):
            # ask it for its version again.
            self._version = None
        return result

    async def _get(self, path: str, errors: list[str], *, want: str) -> Any:
        try:
            async with self._session.get(self._base + path) as response:
                if response.status != 200:
                    errors.append(f"{path}: HTTP {response.status}")
                    return None
                if want == "status":
                    return True
                text = (await read_capped(response, MAX_BODY_BYTES)).decode(
                    _charset(response), errors="replace")
                self._refused.discard(path)
                if want == "json":
                    return json.loads(text) if text.strip() else None
                return text
        except TimeoutError:
            errors.append(f"{path}: timed out")
        except BodyTooLargeError as exc:
            errors.append(f"{path}: {exc}")
            if path not in self._refused:  # once until it answers within the limit again
                self._refused.add(path)
                log.warning("engine %s%s: %s; the probe fails while it does", self._base,
                            path, exc)
        except (aiohttp.ClientError, ValueError) as exc:
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
        return None


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, read up to `limit` bytes; BodyTooLargeError if there is more (refused at
    once when Content-Length says so, otherwise after `limit` + 1 bytes at most)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise BodyTooLargeError(f"an answer of {declared} bytes (the limit is {limit})")
    chunks: list[bytes] = []
    size = 0
    while chunk := await response.content.read(limit + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"an answer over {limit} bytes (the limit)")
    return b"".join(chunks)


def _charset(response: aiohttp.ClientResponse) -> str:
    """The declared charset if Python knows it, else UTF-8 (what Prometheus text and JSON
    are)."""
    charset = response.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        return "utf-8"
    return charset


async def _none() -> None:
    return None


def _guard(
    parse: Callable[[Any], _Parsed], payload: Any, path: str, errors: list[str]
) -> _Parsed | None:
    """Parse an answer that arrived; a malformed one becomes an error, not an exception."""
    if payload is None:
        return None
    try:
        return parse(payload)
    except ValueError as exc:
        errors.append(f"{path}: {exc}")
        return None
