"""The inference endpoints: the paths whose requests name a model and are routed by it
(router.proxy.handlers serves them; the front, router.proxy.front_head, reads their heads
itself), each with the kind of request its body is parsed as (router.core.parse)."""

from __future__ import annotations

KIND_BY_PATH = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    # The Responses API's create; its stored responses (GET, cancel) are served by
    # router.proxy.responses, at the worker that holds each.
    "/v1/responses": "responses",
    "/v1/messages": "messages",  # Anthropic's Messages API, as vLLM serves it
    # Audio uploads: a multipart form whose `model` field names the model
    # (router.core.parse_form).
    "/v1/audio/transcriptions": "transcription",
    "/v1/audio/translations": "translation",
    # vLLM's other endpoints that name a model (tests/fixtures/vllm-0.32-cpu-endpoints.json),
    # routed by it like chat; the kinds are router.core.parse.OTHER_KINDS.
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
    "/pooling": "pooling",
    "/classify": "classify",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/generative_scoring": "generative_scoring",
    "/v2/embed": "cohere_embed",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/chat/completions/batch": "batch_chat",
    "/v1/systemone": "structured_decision",
}
