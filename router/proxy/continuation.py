"""Mid-stream failover: finish on another worker a streamed answer whose worker failed.

vLLM continues a partial answer: `/v1/completions` with the text so far appended to the
prompt, chat with the partial assistant message last and `continue_final_message: true,
add_generation_prompt: false`. The continuation asks for the tokens that are left
(`max_tokens` less those already sent) with the original sampling parameters; its events
are rewritten to carry the first answer's `id`, `created`, `model` and choice index, its
role event is dropped, and its usage counts cover the whole answer. The client sees one
stream with one finish reason and one `[DONE]`.

Not sound, so not attempted (the stream ends with an error event as before): more than
one choice, logprobs, `echo`, structured output (a grammar would restart), a prompt
that is not one text, a tool call or reasoning in progress, an event passed on half.
"""

from __future__ import annotations

import json
from typing import Any

from router.core.parse import token_limit
from router.proxy.progress import Progress, error_status, sse_data
from router.proxy.transcript import ErrorEvent, Transcript, after_last_event
from router.proxy.upstream.errors import ConnectionBroken, UpstreamError

FAILOVER_HEADER = "x-globalpool-failover"  # "off": this request's stream is not continued

_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")


def _one_choice(document: dict[str, Any]) -> bool:
    """Whether the request asks for one choice, sampled once (no `n`, `best_of` > 1)."""
    return document.get("n") in (None, 1) and document.get("best_of") in (None, 1)


def refusal(document: dict[str, Any], kind: str) -> str | None:
    """Why a request's stream cannot be continued on another engine, or None."""
    if not _one_choice(document):
        return "n > 1" if document.get("n") not in (None, 1) else "best_of > 1"
    if kind == "chat":
        if document.get("logprobs") or document.get("top_logprobs"):
            return "logprobs"
    elif document.get("logprobs") is not None:
        return "logprobs"
    if document.get("echo"):
        return "echo"
    response_format = document.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured output (response_format)"
    if any(document.get(name) is not None for name in _STRUCTURED):
        return "structured output"
    if kind == "completions" and _single_text(document.get("prompt")) is None:
        return "a prompt that is not one text"
    if kind == "chat" and not isinstance(document.get("messages"), list):
        return "no messages"
    return None


# What /v1/completions generates when the request names no max_tokens (OpenAI's default,
# and vLLM's: chat's is the context left, no limit here).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def tokens_left(document: dict[str, Any], kind: str, progress: Progress) -> int | None:
    """The completion tokens the continuation may still produce (None: no limit set)."""
    limit = token_limit(document)
    if limit is None and kind == "completions" and "max_tokens" not in document:
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS  # (an explicit null is no limit)
    if limit is None:
        return None
    return limit - progress.tokens


def continuation_body(document: dict[str, Any], kind: str, progress: Progress) -> bytes:
    """The request that continues `progress` (the original body, `document`, is not
    changed). Call only when `tokens_left` is None or positive."""
    body = dict(document)
    left = tokens_left(document, kind, progress)
    if left is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in document else "max_tokens"
        body[key] = left
    min_tokens = document.get("min_tokens")
    if type(min_tokens) is int:
        body["min_tokens"] = max(0, min_tokens - progress.tokens)
    answer = progress.answer
    if answer:
        if kind == "chat":
            messages = list(document["messages"])
            last = messages[-1] if messages else None
            if (document.get("continue_final_message") and isinstance(last, dict)
                    and last.get("role") == "assistant"
                    and isinstance(last.get("content"), str)):
                # The client prefilled the answer's start itself: it grows.
                messages[-1] = {**last, "content": last["content"] + answer}
            else:
                messages.append({"role": "assistant", "content": answer})
            body["messages"] = messages
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            body["prompt"] = _single_text(document["prompt"]) + answer  # type: ignore[operator]
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def closing_events(progress: Progress, prompt_tokens: int | None = None) -> bytes:
    """What ends a stream that needs no more tokens: a finish event (`length`: the answer
    used all its max_tokens) unless one was sent, the usage chunk when `prompt_tokens` is
    given (the prompt's count by an engine: `Failover.count_body`), then `[DONE]` unless
    it was sent."""
    parts: list[bytes] = []
    identity = {"id": progress.id, "object": progress.object, "created": progress.created,
                "model": progress.model}
    if progress.finish_reason is None:
        if progress.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        parts.append(_event({**identity, "choices": [choice]}))
    if prompt_tokens is not None:
        completion_tokens = progress.tokens
        parts.append(_event({**identity, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}}))
    if not progress.done:
        parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


# What /tokenize (vLLM's) needs of a request to count its prompt as the request's own
# endpoint does (the chat template and its switches; special tokens).
_COUNTED_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                        "tools", "documents")
_COUNTED_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")


class Failover:
    """One stream's failover across its attempts: what its client got (`transcript`) and
    how to ask another worker for the rest."""

    __slots__ = ("_body", "_document", "kind", "transcript")

    def __init__(self, body: bytes, kind: str, limit: int | None) -> None:
        self._body = body
        self._document: dict[str, Any] | None = None  # parsed when first needed
        self.kind = kind
        self.transcript = Transcript(kind, limit)

    def _request(self) -> dict[str, Any]:
        if self._document is None:
            document = json.loads(self._body)
            self._document = document if isinstance(document, dict) else {}
        return self._document

    def refusal(self) -> str | None:
        """Why the stream cannot be continued, or None."""
        reason = refusal(self._request(), self.kind)
        return reason if reason is not None else self.transcript.read().unsound

    def finished(self) -> bool:
        """Whether the client has had all it asked for, or the answer's end was sent: the
        stream needs only its closing events (`closing_events`)."""
        progress = self.transcript.read()
        if progress.done:
            return True
        document = self._request()
        if not _one_choice(document):
            # One choice's finish, or the tokens of all counted against one's max_tokens,
            # say nothing of the others': not finished, and `refusal` says why.
            return False
        if progress.finish_reason is not None:
            return True
        left = tokens_left(document, self.kind, progress)
        return left is not None and left <= 0

    def count_body(self) -> bytes | None:
        """The body of a `/tokenize` request that counts the prompt's tokens, when the
        stream is to be ended here (`finished`) and its client asked for usage
        (`stream_options.include_usage`) that it has not had; else None."""
        document = self._request()
        options = document.get("stream_options")
        if (not isinstance(options, dict) or options.get("include_usage") is not True
                or self.transcript.read().usage):
            return None
        fields = _COUNTED_CHAT_FIELDS if self.kind == "chat" else _COUNTED_COMPLETION_FIELDS
        body = {name: document[name] for name in fields if name in document}
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def closing_events(self, prompt_tokens: int | None = None) -> bytes:
        """The events that end the stream (`closing_events`), after those it was owed."""
        transcript = self.transcript
        return transcript.take_owed() + closing_events(transcript.read(), prompt_tokens)

    def next_body(self) -> bytes:
        """The request body that asks another worker for the rest of the answer."""
        return continuation_body(self._request(), self.kind, self.transcript.read())


class Rewriter:
    """A continuation's body bytes -> the events its client gets (see the module's
    docstring). Holds the start of an event split across reads until its end comes."""

    __slots__ = ("_held", "_prior_tokens", "_progress", "_transcript")

    def __init__(self, transcript: Transcript) -> None:
        self._transcript = transcript
        # The start of an event the broken stream ended inside never reached the client.
        transcript.drop_held()
        self._progress = transcript.read()
        self._prior_tokens = self._progress.tokens
        self._held = b""

    def __call__(self, data: bytes) -> bytes:
        """The client's events for `data`: first those owed to it (recorded when they
        came, before an error event: taken only now, as the continuation answers, so a
        worker that refuses it does not lose them), then the continuation's, recorded.
        Raises as `Transcript.admit` does, or ErrorEvent: what the client has not had
        by then stays owed."""
        data = self._held + data
        cut = after_last_event(data)
        self._held = data[cut:]
        out: list[bytes] = []
        error: ErrorEvent | None = None
        for event in data[:cut].replace(b"\r\n", b"\n").split(b"\n\n"):
            try:
                rewritten = self._event(event)
            except ErrorEvent as exc:
                error = exc
                break
            if rewritten:
                out.append(rewritten)
        transcript = self._transcript
        owed = transcript.take_owed()
        try:
            new = transcript.admit(b"".join(out)) if out else b""
        except UpstreamError:
            transcript.owed = owed + transcript.owed
            raise
        if error is not None:
            transcript.owed = owed + new  # recorded, not sent: whoever goes on sends them
            raise error
        return owed + new if owed else new

    def ended(self) -> UpstreamError | None:
        """At the end of the continuation's body: ConnectionBroken if it ended inside an
        event (dropped: the client never gets half an event), else None. A last
        `data: [DONE]` without its blank line counts as broken too: the stream's
        closing events then give the client its one `[DONE]`."""
        held, self._held = self._held, b""
        if not held.strip():
            return None
        return ConnectionBroken("the continuation ended inside an event", stale=False,
                                received_any=True)

    def _event(self, event: bytes) -> bytes:
        payload = sse_data(event)
        if not payload:
            return b""
        if payload == b"[DONE]":
            return b"data: [DONE]\n\n"
        try:
            chunk = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        error = chunk.get("error")
        if error is not None:
            raise ErrorEvent(*error_status(error))
        return self._chunk(chunk)

    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        progress = self._progress
        chunk["id"] = progress.id
        if progress.created is not None:
            chunk["created"] = progress.created
        if progress.model is not None:
            chunk["model"] = progress.model
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                choice["index"] = 0
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    delta.pop("role", None)  # the client had the role from the first worker
                    if (not delta.get("content") and len(delta) <= 1
                            and choice.get("finish_reason") is None and len(choices) == 1):
                        return b""  # the continuation's role event: nothing new
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._whole_usage(usage)
        return _event(chunk)

    def _whole_usage(self, usage: dict[str, Any]) -> None:
        """Counts for the whole answer: the continuation's prompt held the text so far."""
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is int and type(completion) is int:
            prior = self._prior_tokens
            usage["prompt_tokens"] = max(0, prompt - prior)
            usage["completion_tokens"] = completion + prior
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False
                                  ).encode() + b"\n\n"


def _single_text(prompt: object) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None
