"""The simulator's /v1/audio/transcriptions and /translations, in the shapes of vLLM 0.32's
source (lab/sim/audio.py says where), through the unchanged openai client and raw."""

from __future__ import annotations

import io
import json
import wave

import aiohttp
import pytest
from openai import AsyncOpenAI

from lab.sim.audio import TRANSCRIPT
from lab.sim.server import SimServer

pytestmark = pytest.mark.integration


def wav(seconds: float, rate: int = 16_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(b"\0\0" * int(seconds * rate))
    return out.getvalue()


def form(**fields: str | bytes) -> aiohttp.FormData:
    data = aiohttp.FormData()
    for name, value in fields.items():
        if isinstance(value, bytes):
            data.add_field(name, value, filename="a.wav", content_type="audio/wav")
        else:
            data.add_field(name, value)
    return data


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # translations, in openai
async def test_the_openai_client_transcribes_and_translates(sim: SimServer) -> None:
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as client:
        text = await client.audio.transcriptions.create(
            file=("a.wav", wav(2.5)), model="tiny-llama")
        translated = await client.audio.translations.create(
            file=("a.wav", wav(1.0)), model="tiny-llama")
    assert text.text == TRANSCRIPT
    assert text.usage is not None and text.usage.type == "duration"
    assert text.usage.seconds == 3  # rounded up, as vLLM (and OpenAI) say
    assert translated.text == TRANSCRIPT


async def test_the_bodies_are_vllms(sim: SimServer, http: aiohttp.ClientSession) -> None:
    url = sim.url + "/v1/audio/"
    async with http.post(url + "transcriptions",
                         data=form(file=wav(1.0), model="tiny-llama",
                                   response_format="text")) as response:
        assert response.status == 200
        # vLLM 0.32 answers JSON for response_format "text" too.
        assert await response.json() == {"text": TRANSCRIPT,
                                         "usage": {"type": "duration", "seconds": 1}}
    async with http.post(url + "translations",
                         data=form(file=wav(1.0), model="tiny-llama")) as response:
        assert await response.json() == {"text": TRANSCRIPT}  # no usage for translations


async def test_a_stream_sends_chunks_then_done(sim: SimServer,
                                               http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/audio/transcriptions",
                         data=form(file=wav(1.0), model="tiny-llama", stream="true",
                                   stream_include_usage="true")) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        blocks = (await response.text()).split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]
    words = chunks[:-1]
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in words) == TRANSCRIPT
    assert {chunk["object"] for chunk in chunks} == {"transcription.chunk"}
    assert chunks[0]["id"].startswith("transcribe-") and len({c["id"] for c in chunks}) == 1
    assert list(words[0]["choices"][0]) == ["delta"]
    assert words[-1]["choices"][0] == {"delta": {"content": " says."},
                                       "finish_reason": "stop", "stop_reason": None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(words)


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"model": "tiny-llama"}, 400, "file"),
    ({"model": "no-such", "file": b"abc"}, 404, "model"),
    ({"model": "tiny-llama", "file": b"abc", "response_format": "srt"}, 400, None),
    ({"model": "tiny-llama", "file": b"abc", "response_format": "verbose_json"}, 400, None),
])
async def test_refusals(sim: SimServer, http: aiohttp.ClientSession,
                        fields: dict[str, str | bytes], status: int, param: str | None) -> None:
    async with http.post(sim.url + "/v1/audio/transcriptions", data=form(**fields)) as response:
        body = await response.json()
    assert response.status == status and body["error"]["code"] == status
    assert body["error"]["param"] == param


async def test_a_form_with_a_malformed_part_header_is_a_400(
        sim: SimServer, http: aiohttp.ClientSession) -> None:
    """(schemathesis found it through the router: a part named with control and non-UTF-8
    bytes made aiohttp's form reader raise, and the simulator answered 500)"""
    boundary = "b0undary"
    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"\xf3\xa2\x14a\"\r\n\r\nx\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n"
            b"--b0undary--\r\n")
    async with http.post(f"{sim.url}/v1/audio/transcriptions", data=body, headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}"}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["message"]
