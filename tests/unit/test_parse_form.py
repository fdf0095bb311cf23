"""The audio endpoints' multipart forms: the router reads the model as a multipart parser
does (here aiohttp's, on the same bytes), refuses what is ambiguous, and never fails
otherwise than with a 400."""

from __future__ import annotations

import asyncio

import httpx2 as httpx  # what the openai client encodes its forms with
import pytest
from aiohttp import BodyPartReader, MultipartReader
from aiohttp.streams import StreamReader
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import ApiError
from router.core.parse_form import AUDIO_BYTES_PER_TOKEN, parse_form


def encoded(fields: dict[str, str], audio: bytes = b"RIFF....WAVEfmt ") -> tuple[bytes, str]:
    """A form as the openai client (httpx) encodes it: the body and its Content-Type."""
    request = httpx.Request("POST", "http://x/v1/audio/transcriptions", data=fields,
                            files={"file": ("a.wav", audio, "audio/wav")})
    return request.read(), request.headers["content-type"]


def test_the_model_and_stream_are_read_from_a_clients_form() -> None:
    audio = bytes(range(256)) * 400  # binary, with CR LF and dashes inside
    body, content_type = encoded({"model": "whisper-tiny", "language": "en",
                                  "stream": "true"}, audio)
    parsed = parse_form(body, content_type, "transcription")
    assert (parsed.model, parsed.stream) == ("whisper-tiny", True)
    assert parsed.prompt_tokens >= len(audio) // AUDIO_BYTES_PER_TOKEN
    assert not parse_form(*encoded({"model": "m"}), "translation").stream


def form(*parts: tuple[str, bytes], boundary: str = "b0undary") -> tuple[bytes, str]:
    """A form written by hand: each part its header lines and value."""
    body = b"".join(b"--" + boundary.encode() + b"\r\n" + head.encode() + b"\r\n\r\n" + value
                    + b"\r\n" for head, value in parts) + b"--" + boundary.encode() + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


MODEL = 'Content-Disposition: form-data; name="model"'


@pytest.mark.parametrize(("body", "content_type", "why"), [
    (*encoded({"language": "en"}), "required"),
    (*form((MODEL, b"a"), (MODEL, b"b")), "once"),
    (*form(('Content-Disposition: form-data; name="model"; NAME="x"', b"a")), "one name"),
    (*form(('Content-Disposition: form-data; NAME="model"', b"a"), (MODEL, b"b")), "once"),
    (*form((MODEL, b"m"), ('Content-Disposition: form-data; name="stream"', b"yes")), "stream"),
    (*form((MODEL, b"x" * 5000)), "short"),
    (b'{"model": "m"}', "application/json", "multipart/form-data"),
    (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm", "multipart/form-data; "
     "boundary=b", "closing boundary"),
    (b"garbage", "multipart/form-data; boundary=b", "start"),
    (b"", "multipart/form-data", "boundary"),
])
def test_an_ambiguous_or_malformed_form_is_a_400(body: bytes, content_type: str,
                                                 why: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_form(body, content_type, "transcription")
    assert refused.value.status == 400 and why in refused.value.message


async def aiohttp_reads(body: bytes, content_type: str) -> dict[str, bytes]:
    """What aiohttp's multipart parser reads from the same bytes: field -> value."""
    stream = StreamReader(_Protocol(), 2 ** 16,  # type: ignore[arg-type]
                          loop=asyncio.get_running_loop())
    stream.feed_data(body)
    stream.feed_eof()
    reader = MultipartReader({"Content-Type": content_type}, stream)
    fields: dict[str, bytes] = {}
    while (part := await reader.next()) is not None:
        assert isinstance(part, BodyPartReader)
        if part.name is not None:
            fields[part.name] = await part.read()
    return fields


class _Protocol:
    """What aiohttp's StreamReader asks of its protocol (flow control), for a whole body."""

    _reading_paused = False

    def pause_reading(self, *args: object, **kwargs: object) -> None: ...

    def resume_reading(self, *args: object, **kwargs: object) -> None: ...


_NAMES = st.sampled_from(["model", "stream", "language", "prompt", "temperature", "x"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_NAMES, st.binary(max_size=60)), max_size=6),
       st.binary(max_size=300))
def test_the_router_reads_the_model_that_a_multipart_parser_reads(
        fields: list[tuple[str, bytes]], audio: bytes) -> None:
    parts = [(f'Content-Disposition: form-data; name="{name}"', value) for name, value in fields]
    parts.append(('Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                  "Content-Type: audio/wav", audio))
    body, content_type = form(*parts, boundary="Xy-1_boundary-7a")
    try:
        parsed = parse_form(body, content_type, "transcription")
    except ApiError as refused:
        assert refused.status == 400
        return
    seen = asyncio.run(aiohttp_reads(body, content_type))
    assert seen["model"].decode("utf-8", "replace").strip() == parsed.model
