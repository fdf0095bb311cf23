"""The simulator's endpoints that generate nothing, in vLLM 0.32's shapes
(tests/fixtures/vllm-0.32-cpu-shapes.json): embeddings, pooling, rerank and score (a
one-step pass through the engine, so they take a slot and prefill time like vLLM's pooling
runner), tokenize and detokenize (answered at once, as vLLM's API server does without the
engine).

Vectors and scores are deterministic stand-ins: the same text gives the same unit vector
(a hash-seeded random direction); a score is the cosine of two texts' vectors. One server
serves both families, which one vLLM does not (a model runs either the generate or the
pooling runner): a simulator's convenience.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from lab.sim.config import SimConfig
from lab.sim.engine import Engine, QueueFullError
from lab.sim.errors import ApiError, json_response
from lab.sim.tokens import CHARS_PER_TOKEN, WORDS, prompt_from_text

EMBEDDING_DIMENSIONS = 128  # tiny-llama's hidden size, as the real server answers
VOCAB_SIZE = 32_000


def embedding_of(text: str) -> list[float]:
    """A unit vector that depends only on `text`."""
    rng = random.Random(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    vector = [rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIMENSIONS)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def token_ids_of(text: str) -> list[int]:
    """One id per CHARS_PER_TOKEN characters (tokens.py's count), from their hash."""
    return [int.from_bytes(hashlib.blake2b(text[i:i + CHARS_PER_TOKEN].encode(
        "utf-8", "surrogatepass"), digest_size=4).digest(), "little") % VOCAB_SIZE
            for i in range(0, len(text), CHARS_PER_TOKEN)] or [0]


def _message_texts(messages: list[Any]) -> list[str]:
    """The texts of chat messages, as the chat endpoint joins them into its prompt
    (lab.sim.protocol.parse_chat): a string content, or the texts of its parts."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return texts


def _cosine(a: str, b: str) -> float:
    return sum(x * y for x, y in zip(embedding_of(a), embedding_of(b), strict=True))


def _texts(value: Any, param: str) -> list[str]:
    """A field that holds one text or a list of texts (or text parts / documents)."""
    items = value if isinstance(value, list) else [value]
    texts: list[str] = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"'{param}' must be text or a list of texts.",
                           param=param)
        texts.append(item)
    if not texts:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{param}' must not be empty.", param=param)
    return texts


def _usage(prompt_tokens: int, *, short: bool = False) -> dict[str, Any]:
    if short:  # rerank's
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def _tokens(texts: list[str]) -> int:
    return sum(max(1, -(-len(text) // CHARS_PER_TOKEN)) for text in texts)


def _packed(vector: list[float], encoding: Any) -> list[float] | str:
    """`encoding_format`: "float" (the default) or "base64" (little-endian float32, which
    the openai client asks for and decodes)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    if encoding in (None, "float"):
        return vector
    raise ApiError(HTTPStatus.BAD_REQUEST, "'encoding_format' must be 'float' or 'base64'.",
                   param="encoding_format")


Handler = Callable[[dict[str, Any], str], Awaitable[dict[str, Any]]]


def _top_n(document: dict[str, Any]) -> int:
    """`top_n` as vLLM's RerankRequest (pydantic: `int`, default 0) takes it: an integer,
    or a float without a fractional part; anything else (a fraction, a boolean, null, a
    string) is a 400. (Pydantic would also take a numeric string: refused here.)"""
    if "top_n" not in document:
        return 0
    top_n = document["top_n"]
    if type(top_n) is float and top_n.is_integer():
        return int(top_n)
    if type(top_n) is not int:
        raise ApiError(HTTPStatus.BAD_REQUEST, "top_n: Input should be a valid integer.",
                       param="top_n")
    return top_n


class PoolingHandlers:
    """Handlers for one simulator's engine and config."""

    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self._config = config
        self._engine = engine

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/embeddings", self._wrap(self.embeddings)),
            web.post("/pooling", self._wrap(self.pooling)),
            *(web.post(path, self._wrap(self.rerank))
              for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
            *(web.post(path, self._wrap(self.score)) for path in ("/v1/score", "/score")),
            web.post("/tokenize", self._wrap(self.tokenize)),
            web.post("/detokenize", self._wrap(self.detokenize)),
        ]

    def _wrap(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def serve(request: web.Request) -> web.Response:
            try:
                try:
                    document = await request.json()
                except ValueError as exc:
                    raise ApiError(HTTPStatus.BAD_REQUEST,
                                   f"Invalid JSON in request body: {exc}") from exc
                if not isinstance(document, dict):
                    raise ApiError(HTTPStatus.BAD_REQUEST,
                                   "The request body must be a JSON object.")
                return json_response(await handler(document, self._model(document)))
            except ApiError as exc:
                return exc.response()
        return serve

    def _model(self, document: dict[str, Any]) -> str:
        model = document.get("model") or self._config.served_model_names[0]
        if model not in self._config.served_model_names:
            aliases = ", ".join(self._config.served_model_names)
            raise ApiError(HTTPStatus.NOT_FOUND,
                           f"The model `{model}` does not exist. Valid aliases: {aliases}.",
                           param="model")
        return str(model)

    async def _pass(self, texts: list[str]) -> None:
        """One engine pass over the texts: a slot, their prefill and one step."""
        prompt = prompt_from_text("\n".join(texts), self._config.block_size, self._config.seed)
        try:
            seq = self._engine.submit("pool-" + uuid.uuid4().hex, prompt, 1, True)
        except QueueFullError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)) from exc
        try:
            await seq.wait_finished()
        finally:
            self._engine.abort(seq)

    def _required(self, document: dict[str, Any], *names: str) -> Any:
        for name in names:
            if name in document:
                return document[name]
        raise ApiError(HTTPStatus.BAD_REQUEST, f"Field required: {names[0]}", param=names[0])

    async def _vectors(self, document: dict[str, Any], model: str, prefix: str,
                       object_name: str, field: str) -> dict[str, Any]:
        texts = _texts(self._required(document, "input"), "input")
        encoding = document.get("encoding_format")
        await self._pass(texts)
        return {"id": prefix + uuid.uuid4().hex[:16], "object": "list",
                "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": object_name,
                          field: _packed(embedding_of(text), encoding)}
                         for i, text in enumerate(texts)],
                "usage": _usage(_tokens(texts))}

    async def embeddings(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        return await self._vectors(document, model, "embd-", "embedding", "embedding")

    async def pooling(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        return await self._vectors(document, model, "pooling-", "pooling", "data")

    async def rerank(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        query = _texts(self._required(document, "query"), "query")[0]
        documents = _texts(self._required(document, "documents"), "documents")
        await self._pass([query, *documents])
        scores = [_cosine(query, text) for text in documents]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        results = [{"index": i, "document": {"text": documents[i], "multi_modal": None},
                    "relevance_score": scores[i]} for i in order]
        top_n = _top_n(document)
        if top_n > 0:
            results = results[:top_n]
        return {"id": "score-" + uuid.uuid4().hex[:16], "model": model,
                "usage": _usage(_tokens([query, *documents]), short=True), "results": results}

    async def score(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        firsts = _texts(self._required(document, "text_1", "queries"), "text_1")
        seconds = _texts(self._required(document, "text_2", "documents"), "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ApiError(HTTPStatus.BAD_REQUEST,
                           "text_1 must be one text or as many as text_2.", param="text_1")
        await self._pass([*firsts, *seconds])
        return {"id": "score-" + uuid.uuid4().hex[:16], "object": "list",
                "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": _cosine(a, b)}
                         for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))],
                "usage": _usage(_tokens([*firsts, *seconds]))}

    async def tokenize(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        if "messages" in document:
            messages = document["messages"]
            if not isinstance(messages, list):
                raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' must be a list.",
                               param="messages")
            text = "\n".join(_message_texts(messages))
        else:
            text = _texts(self._required(document, "prompt"), "prompt")[0]
        tokens = token_ids_of(text)
        strings = ([WORDS[t % len(WORDS)] for t in tokens]
                   if document.get("return_token_strs") else None)
        return {"count": len(tokens), "max_model_len": self._config.max_model_len,
                "tokens": tokens, "token_strs": strings}

    async def detokenize(self, document: dict[str, Any], model: str) -> dict[str, Any]:
        tokens = self._required(document, "tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ApiError(HTTPStatus.BAD_REQUEST, "'tokens' must be a list of integers.",
                           param="tokens")
        return {"prompt": "".join(WORDS[t % len(WORDS)] for t in tokens)}
