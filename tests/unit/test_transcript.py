"""The transcript of a stream: whole events only, counted, error events stopped."""

from __future__ import annotations

import json

import pytest

from router.proxy.transcript import ErrorEvent, TooManyEvents, Transcript, event_limit
from router.proxy.upstream.errors import ConnectionBroken


def _token(text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


def test_an_event_split_across_reads_is_held_until_it_is_whole() -> None:
    transcript = Transcript("chat", None)
    event = _token("Hello")
    assert transcript.admit(event[:10]) == b""
    assert transcript.admit(event[10:25]) == b""
    assert transcript.admit(event[25:] + _token(" there")[:5]) == event
    assert transcript.read().answer == "Hello"
    with pytest.raises(ConnectionBroken):  # the body ended inside an event: broken there
        transcript.take_held()
    assert transcript.take_held() == b""  # (dropped, never recorded)
    assert transcript.read().answer == "Hello"


def test_a_last_done_without_its_blank_line_is_the_end() -> None:
    transcript = Transcript("chat", None)
    assert transcript.admit(_token("a") + b"data: [DONE]") == _token("a")
    assert transcript.take_held() == b"data: [DONE]"
    assert transcript.read().done
    transcript.admit(b"\r\n")
    assert transcript.take_held() == b""  # only blank: nothing to send, nothing broken


def test_the_half_event_of_a_broken_stream_is_dropped_for_the_continuation() -> None:
    transcript = Transcript("chat", None)
    transcript.admit(_token("a") + _token("b")[:12])
    transcript.drop_held()
    assert transcript.admit(_token("c")) == _token("c")
    assert transcript.read().answer == "ac"


def test_whole_frames_pass_as_they_are_and_are_recorded() -> None:
    transcript = Transcript("chat", None)
    assert transcript.admit_frame(_frame(_token("a")))
    assert transcript.admit_frame(_frame(_token("b")))
    progress = transcript.read()
    assert (progress.answer, progress.tokens, progress.id, progress.created) == ("ab", 2, "c1", 7)


def test_frames_that_do_not_end_an_event_take_the_slow_path() -> None:
    transcript = Transcript("chat", None)
    event = _token("a")
    assert not transcript.admit_frame(_frame(event[:10]))  # half an event
    error = b'data: {"error": {"message": "x", "code": 500}}\n\n'
    assert not transcript.admit_frame(_frame(error))  # `admit` raises for it
    assert transcript.events == 0
    assert transcript.admit_frame(_frame(event) + _frame(event))  # two whole chunks
    assert transcript.events == 1  # a lower bound: a read is counted as one event
    assert transcript.read().answer == "aa"
    # An error event anywhere in a read, not only at its start.
    assert not transcript.admit_frame(_frame(event) + _frame(error) + _frame(b"data: [DONE]\n\n"))
    assert transcript.events == 1


def test_a_stream_past_its_max_tokens_is_cut_before_the_extra_event_is_passed() -> None:
    limit = event_limit(4, 1)
    assert limit is not None
    transcript = Transcript("chat", limit)
    for _ in range(limit):
        transcript.admit(_token("x"))
    with pytest.raises(TooManyEvents):
        transcript.admit(_token("x"))
    assert transcript.events == limit
    assert event_limit(None, 1) is None


def test_an_error_event_is_stopped_and_the_events_before_it_are_owed() -> None:
    transcript = Transcript("chat", None)
    transcript.admit(_token("a"))
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    with pytest.raises(ErrorEvent) as raised:
        transcript.admit(_token("b") + error + b"data: [DONE]\n\n")
    assert (raised.value.status, raised.value.message) == (500, "engine died")
    assert transcript.owed == _token("b")  # recorded, not yet sent: the next worker sends it
    assert transcript.read().answer == "ab"


def test_text_that_mentions_an_error_is_not_an_error_event() -> None:
    transcript = Transcript("chat", None)
    event = _token('{"error": 1}')  # escaped inside the JSON string
    assert transcript.admit(event) == event


def test_progress_notes_what_makes_a_stream_unsound_to_continue() -> None:
    transcript = Transcript("chat", None)
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]},
                                     "finish_reason": None}]}
    transcript.admit(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert transcript.read().unsound == "a tool call in progress"


def test_a_token_that_decodes_to_nothing_still_counts_and_the_role_event_does_not() -> None:
    transcript = Transcript("chat", None)
    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}
    transcript.admit(b"data: " + json.dumps(role).encode() + b"\n\n" + _token("")
                     + _token("\u00e9"))
    progress = transcript.read()
    assert (progress.tokens, progress.answer, progress.role_sent) == (2, "\u00e9", True)
