"""Continuing a broken stream: the request for the rest, and its events rewritten."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.proxy.continuation import (
    Failover,
    Rewriter,
    closing_events,
    continuation_body,
    refusal,
    tokens_left,
)
from router.proxy.progress import Progress
from router.proxy.transcript import ErrorEvent, Transcript


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _chat_chunk(id_: str, created: int, delta: dict[str, Any], finish: str | None = None,
                **extra: Any) -> bytes:
    return _event({"id": id_, "object": "chat.completion.chunk", "created": created,
                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}], **extra})


def _sent(kind: str, *events: bytes) -> Transcript:
    transcript = Transcript(kind, None)
    for event in events:
        transcript.admit(event)
    return transcript


def test_chat_continues_with_the_partial_answer_as_the_last_assistant_message() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 10, "temperature": 0.3, "seed": 5, "min_tokens": 4}
    transcript = _sent("chat", _chat_chunk("c1", 7, {"role": "assistant", "content": ""}),
                       _chat_chunk("c1", 7, {"content": "Hel"}),
                       _chat_chunk("c1", 7, {"content": "lo"}))
    body = json.loads(continuation_body(request, "chat", transcript.read()))
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["min_tokens"]) == (8, 2)
    assert (body["temperature"], body["seed"]) == (0.3, 5)  # sampling as asked
    assert request["messages"] == [{"role": "user", "content": "hi"}]  # not changed


def test_a_client_prefilled_answer_grows_instead_of_a_second_assistant_message() -> None:
    request = {"model": "m", "continue_final_message": True, "add_generation_prompt": False,
               "messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "Sure: "}],
               "max_completion_tokens": 5}
    transcript = _sent("chat", _chat_chunk("c1", 7, {"content": "one"}))
    body = json.loads(continuation_body(request, "chat", transcript.read()))
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert body["max_completion_tokens"] == 4 and "max_tokens" not in body


def test_completions_continue_with_the_text_appended_to_the_prompt() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "m",
             "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}
    transcript = _sent("completions", _event(chunk))
    body = json.loads(continuation_body({"model": "m", "prompt": ["Once"], "max_tokens": 3},
                                        "completions", transcript.read()))
    assert (body["prompt"], body["max_tokens"]) == ("Once upon", 2)


@pytest.mark.parametrize(("request_", "kind", "reason"), [
    ({"n": 2}, "chat", "n > 1"),
    ({"logprobs": True}, "chat", "logprobs"),
    ({"logprobs": 2}, "completions", "logprobs"),
    ({"echo": True, "prompt": "x"}, "completions", "echo"),
    ({"response_format": {"type": "json_schema"}}, "chat", "structured output (response_format)"),
    ({"guided_json": {}}, "chat", "structured output"),
    ({"prompt": [1, 2, 3]}, "completions", "a prompt that is not one text"),
])
def test_requests_that_cannot_be_continued_say_why(request_: dict[str, Any], kind: str,
                                                    reason: str) -> None:
    if kind == "chat":
        request_ = {"messages": [{"role": "user", "content": "x"}], **request_}
    assert refusal(request_, kind) == reason


def test_the_continuation_looks_like_the_first_answer_going_on() -> None:
    transcript = _sent("chat", _chat_chunk("c1", 7, {"role": "assistant", "content": ""}),
                       _chat_chunk("c1", 7, {"content": "a"}),
                       _chat_chunk("c1", 7, {"content": "b"}))
    rewrite = Rewriter(transcript)
    continuation = (_chat_chunk("c2", 99, {"role": "assistant", "content": ""})
                    + _chat_chunk("c2", 99, {"content": "c"}, "length"))
    out = rewrite(continuation[:30]) + rewrite(continuation[30:])  # split mid-event
    out += rewrite(_event({"id": "c2", "object": "chat.completion.chunk", "created": 99,
                           "model": "m", "choices": [],
                           "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                                     "total_tokens": 13}}) + b"data: [DONE]\n\n")
    payloads = [json.loads(line[6:]) for line in out.decode().split("\n\n")
                if line.startswith("data: {")]
    assert [(p["id"], p["created"]) for p in payloads] == [("c1", 7)] * 2  # no role event
    assert payloads[0]["choices"][0]["delta"] == {"content": "c"}
    assert payloads[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3,
                                    "total_tokens": 13}
    assert out.endswith(b"data: [DONE]\n\n")
    progress = transcript.read()
    assert (progress.answer, progress.finish_reason, progress.done) == ("abc", "length", True)


def test_an_error_event_from_the_continuation_breaks_it_too() -> None:
    rewrite = Rewriter(_sent("chat", _chat_chunk("c1", 7, {"content": "a"})))
    with pytest.raises(ErrorEvent):
        rewrite(b'data: {"error": {"message": "no", "code": 503}}\n\n')


def test_events_owed_go_first_once_and_only_when_the_continuation_answers() -> None:
    transcript = _sent("chat", _chat_chunk("c1", 7, {"content": "a"}))
    owed = _chat_chunk("c1", 7, {"content": "b"})
    with pytest.raises(ErrorEvent):
        transcript.admit(owed + b'data: {"error": {"message": "x", "code": 500}}\n\n')
    Rewriter(transcript)  # a continuation that was refused: its rewriter never called
    assert transcript.owed == owed
    rewrite = Rewriter(transcript)
    out = rewrite(_chat_chunk("c2", 9, {"content": "c"}))
    assert out.startswith(owed) and out.count(b"\n\n") == 2
    progress = transcript.read()
    assert (progress.answer, progress.tokens, transcript.owed) == ("abc", 3, b"")


def test_events_before_a_continuations_error_are_owed() -> None:
    transcript = _sent("chat", _chat_chunk("c1", 7, {"content": "a"}))
    rewrite = Rewriter(transcript)
    with pytest.raises(ErrorEvent):
        rewrite(_chat_chunk("c2", 9, {"content": "b"})
                + b'data: {"error": {"message": "no", "code": 503}}\n\n')
    assert transcript.read().answer == "ab"
    assert b'"content":"b"' in transcript.owed and b"c2" not in transcript.owed
    owed = transcript.owed
    rewrite = Rewriter(transcript)
    assert rewrite(b": ping\n\n") == owed  # the next worker's first bytes send them
    assert transcript.owed == b"" and transcript.read().answer == "ab"  # (not twice)
    assert rewrite.ended() is None
    rewrite(b"data: {\"id\"")
    assert rewrite.ended() is not None  # the body ended inside an event


def test_many_choices_are_never_taken_for_finished() -> None:
    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 2, "n": 2}).encode()
    failover = Failover(request, "chat", None)
    failover.transcript.admit(_chat_chunk("c1", 7, {"content": "a"}, "length")
                              + _chat_chunk("c1", 7, {"content": "b"}))
    assert not failover.finished() and failover.refusal() == "n > 1"


def test_completions_without_max_tokens_have_the_default_16() -> None:
    progress = Progress("completions")
    progress.tokens = 3
    assert tokens_left({"prompt": "x"}, "completions", progress) == 13
    assert tokens_left({"prompt": "x", "max_tokens": None}, "completions", progress) is None
    assert tokens_left({"messages": []}, "chat", progress) is None


def test_an_answer_with_all_its_tokens_only_needs_its_end() -> None:
    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "max_tokens": 2}).encode()
    failover = Failover(request, "chat", None)
    failover.transcript.admit(_chat_chunk("c1", 7, {"content": "a"})
                              + _chat_chunk("c1", 7, {"content": "b"}))
    assert failover.finished() and failover.refusal() is None
    events = failover.closing_events().decode().split("\n\n")
    assert json.loads(events[0][6:])["choices"][0]["finish_reason"] == "length"
    assert events[1] == "data: [DONE]"


def test_closing_events_add_only_what_is_missing() -> None:
    progress = Progress("chat")
    progress.finish_reason, progress.done = "stop", False
    assert closing_events(progress) == b"data: [DONE]\n\n"
    progress.done = True
    assert closing_events(progress) == b""


def _usage_request(**extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
                       "temperature": 0.3, **extra}).encode()


def test_a_stream_ended_here_asks_for_the_prompt_count_only_for_usage_it_lacks() -> None:
    wants = {"stream_options": {"include_usage": True}}
    failover = Failover(_usage_request(**wants), "chat", None)
    # what /tokenize needs to count as the chat endpoint does: no sampling, no max_tokens
    assert json.loads(failover.count_body() or b"") == {
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False}}
    assert Failover(_usage_request(), "chat", None).count_body() is None
    assert Failover(_usage_request(stream_options={"include_usage": "yes"}), "chat",
                    None).count_body() is None
    failover.transcript.admit(_event({"id": "c1", "object": "chat.completion.chunk",
                                      "created": 7, "model": "m", "choices": [],
                                      "usage": {"prompt_tokens": 3}}))
    assert failover.count_body() is None  # it had its usage chunk
    completion = Failover(json.dumps({"model": "m", "prompt": "p", "echo": False,
                                      "add_special_tokens": False, **wants}).encode(),
                          "completions", None)
    assert json.loads(completion.count_body() or b"") == {
        "model": "m", "prompt": "p", "add_special_tokens": False}


def test_closing_events_carry_a_usage_chunk_over_the_whole_answer() -> None:
    failover = Failover(_usage_request(), "chat", None)
    failover.transcript.admit(_chat_chunk("c1", 7, {"role": "assistant", "content": ""})
                              + _chat_chunk("c1", 7, {"content": "a"})
                              + _chat_chunk("c1", 7, {"content": "b"}))
    events = failover.closing_events(prompt_tokens=11).decode().split("\n\n")
    finish, usage = json.loads(events[0][6:]), json.loads(events[1][6:])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage == {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                     "choices": [], "usage": {"prompt_tokens": 11, "total_tokens": 13,
                                              "completion_tokens": 2}}
    assert events[2] == "data: [DONE]"
