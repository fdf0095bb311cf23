"""A new user's journey through README.md against a real `globalpool up` (a child process:
embedded Valkey, simulators, agents, router), with the unchanged `openai` client, plain
HTTP and raw sockets: what the README promises a client and an operator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from openai import BadRequestError, NotFoundError, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ROOT
from tests.integration.stack import RunningUp, small_config, start_up

pytestmark = pytest.mark.integration

TOKEN = "new-user-admin-token-5c1e"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello!"}]
RAW_HELLO: list[Any] = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    tmp_path = tmp_path_factory.mktemp("journey")
    config = small_config(tmp_path, batch={"max_file_bytes": 64 * 1024})
    before = os.environ.get("GLOBALPOOL_ADMIN_TOKEN")
    os.environ["GLOBALPOOL_ADMIN_TOKEN"] = TOKEN  # README: GLOBALPOOL_ADMIN_TOKEN=... up
    try:
        running = start_up(tmp_path, config)
    finally:
        if before is None:
            os.environ.pop("GLOBALPOOL_ADMIN_TOKEN", None)
        else:
            os.environ["GLOBALPOOL_ADMIN_TOKEN"] = before
    try:
        _wait_ready(running.url)
        yield running
    finally:
        assert running.stop() == 0, running.output()


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            models = requests.get(f"{url}/v1/models", timeout=5).json()
            reply = requests.post(f"{url}/v1/chat/completions", timeout=10, json={
                "model": "tiny-llama", "messages": RAW_HELLO, "max_tokens": 2})
            if reply.status_code == 200 and models.get("data"):
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError("the router never served a chat request")


def client(up: RunningUp) -> OpenAI:
    return OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def assert_openai_error(response: requests.Response) -> dict[str, Any]:
    """The body is OpenAI-format JSON and names no internal address."""
    assert response.headers.get("content-type", "").startswith("application/json"), (
        response.status_code, response.headers, response.text[:300])
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert "127.0." not in response.text, response.text
    return dict(error)


def sse_events(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and set(labels.items()) <= set(sample.labels.items()):
                total += sample.value
    return total


# --- Send a request -------------------------------------------------------------------------

def test_readme_chat_example_with_the_openai_client(up: RunningUp) -> None:
    openai = client(up)
    reply = openai.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=HELLO, max_tokens=8)
    assert reply.headers["x-globalpool-region"] in {"us-east", "eu-west", "ap-south"}
    assert reply.headers["x-globalpool-worker"]
    assert reply.headers["x-globalpool-route"]
    assert float(reply.headers["x-globalpool-predicted-ttft-ms"]) >= 0
    assert reply.parse().choices[0].message.content
    chunks = list(openai.chat.completions.create(
        model="tiny-llama", stream=True, stream_options={"include_usage": True},
        messages=HELLO, max_tokens=8))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_completions_models_and_model_card(up: RunningUp) -> None:
    openai = client(up)
    completion = openai.completions.create(model="tiny-llama", prompt="Once", max_tokens=5)
    assert completion.choices[0].text
    ids = {m.id for m in openai.models.list()}
    assert {"tiny-llama", "tiny-coder"} <= ids
    assert openai.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(NotFoundError) as caught:
        openai.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_embeddings_on_a_generate_model_is_an_openai_error(up: RunningUp) -> None:
    response = requests.post(f"{up.url}/v1/embeddings", timeout=30,
                             json={"model": "tiny-llama", "input": "hi"})
    if response.status_code == 200:  # the simulator may serve embeddings
        assert response.json()["data"][0]["embedding"]
    else:
        assert_openai_error(response)


# --- Errors the README promises ------------------------------------------------------------

@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    (b'{"model": "tiny-llama"}', 400),                               # no messages
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400),     # no model
    (b'{"model": "tiny-llama", "stream": "yes", "messages": []}', 400),
    (b'{"model": 123, "messages": [{"role": "user", "content": "x"}]}', 400),
    (b'[1, 2, 3]', 400),
    (b'{"model": "nope-model", "messages": [{"role": "user", "content": "x"}]}', 404),
])
def test_bad_requests_are_openai_errors(up: RunningUp, body: bytes, status: int) -> None:
    response = requests.post(f"{up.url}/v1/chat/completions", data=body, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert_openai_error(response)


def test_wrong_types_the_engine_refuses_are_openai_errors(up: RunningUp) -> None:
    bodies: list[dict[str, Any]] = [
                 {"model": "tiny-llama", "messages": "hi"},
                 {"model": "tiny-llama", "messages": HELLO, "max_tokens": "ten"},
                 {"model": "tiny-llama", "messages": HELLO, "max_tokens": 0},
                 {"model": "tiny-llama", "messages": HELLO, "n": "three"}]
    for body in bodies:
        response = requests.post(f"{up.url}/v1/chat/completions", json=body, timeout=30)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        assert_openai_error(response)


def test_wrong_method_is_a_405_openai_error(up: RunningUp) -> None:
    response = requests.get(f"{up.url}/v1/chat/completions", timeout=30)
    assert response.status_code == 405
    assert_openai_error(response)


def test_a_10_mb_body_is_a_413_openai_error(up: RunningUp) -> None:
    body = json.dumps({"model": "tiny-llama",
                       "messages": [{"role": "user", "content": "x" * (10 << 20)}]})
    response = requests.post(f"{up.url}/v1/chat/completions", data=body, timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert_openai_error(response)


def test_max_tokens_zero_through_the_openai_client(up: RunningUp) -> None:
    with pytest.raises(BadRequestError):
        client(up).chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=0)


# --- Streams: n=3, slow and vanishing clients ----------------------------------------------

def test_n3_stream_has_three_choices_each_finished(up: RunningUp) -> None:
    chunks = list(client(up).chat.completions.create(
        model="tiny-llama", stream=True, n=3, max_tokens=6, messages=HELLO,
        stream_options={"include_usage": True}))
    finished = {c.index for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert finished == {0, 1, 2}
    assert chunks[-1].usage is not None


def test_a_slow_reader_gets_the_whole_stream(up: RunningUp) -> None:
    with requests.post(f"{up.url}/v1/chat/completions", stream=True, timeout=60, json={
            "model": "tiny-llama", "stream": True, "max_tokens": 60, "messages": RAW_HELLO,
            "ignore_eos": True}) as response:
        assert response.status_code == 200
        raw = b""
        for piece in response.iter_content(chunk_size=64):
            raw += piece
            time.sleep(0.01)
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert sum(1 for e in events[:-1] if e["choices"] and "role" not in e["choices"][0][
        "delta"] and e["choices"][0]["delta"].get("content") is not None) == 60


def test_a_client_that_vanishes_mid_stream_is_counted_and_the_router_keeps_serving(
        up: RunningUp) -> None:
    before = metric(up.url, "globalpool_client_disconnects_total", reason="left")
    host, port = up.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-llama", "stream": True, "max_tokens": 400,
                       "ignore_eos": True, "messages": RAW_HELLO}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    deadline = time.monotonic() + 10
    while metric(up.url, "globalpool_client_disconnects_total", reason="left") <= before:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.2)
    reply = client(up).chat.completions.create(model="tiny-llama", messages=HELLO,
                                               max_tokens=2)
    assert reply.choices[0].message.content is not None


# --- Routing headers -----------------------------------------------------------------------

def test_routing_headers(up: RunningUp) -> None:
    openai = client(up)
    workers = set()
    for _ in range(4):
        reply = openai.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=HELLO, max_tokens=2,
            extra_headers={"x-globalpool-session-id": "journey-1"})
        workers.add(reply.headers["x-globalpool-worker"])
    assert len(workers) == 1, workers
    reply = openai.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=HELLO, max_tokens=2,
        extra_headers={"x-globalpool-client-region": "ap-south"})
    assert reply.headers["x-globalpool-region"] == "ap-south"
    for headers in ({"x-globalpool-ttft-budget-ms": "500"}, {"x-globalpool-failover": "off"},
                    {"x-globalpool-hedge": "on"}, {"x-globalpool-hedge": "off"},
                    {"x-globalpool-class": "batch"}):
        chunks = list(openai.chat.completions.create(
            model="tiny-llama", messages=HELLO, max_tokens=3, stream=True,
            extra_headers=headers))
        assert chunks, headers


def test_tiny_coder_is_served_only_where_listed(up: RunningUp) -> None:
    reply = client(up).chat.completions.with_raw_response.create(
        model="tiny-coder", messages=HELLO, max_tokens=2)
    assert reply.headers["x-globalpool-region"] == "eu-west"


# --- Operating -----------------------------------------------------------------------------

def test_admin_status_page_and_metrics(up: RunningUp) -> None:
    assert requests.get(f"{up.url}/admin/status", timeout=10).status_code in {401, 403}
    status = requests.get(f"{up.url}/admin/status", timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert status.status_code == 200, status.text
    document = status.json()
    assert {"us-east", "eu-west", "ap-south"} <= set(json.dumps(document["regions"]).replace(
        '"', " ").split())
    page = requests.get(f"{up.url}/status", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    text = requests.get(f"{up.url}/metrics", timeout=10).text
    assert "globalpool_" in text
    health = requests.get(f"{up.url}/health", timeout=10)
    assert health.status_code == 200


def test_admin_drain_and_undrain_a_region(up: RunningUp) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    drained = requests.post(f"{up.url}/admin/drain", headers=headers, timeout=10,
                            json={"region": "ap-south", "reason": "journey"})
    assert drained.status_code == 200, drained.text
    try:
        for _ in range(5):
            reply = client(up).chat.completions.with_raw_response.create(
                model="tiny-llama", messages=HELLO, max_tokens=2,
                extra_headers={"x-globalpool-client-region": "ap-south"})
            assert reply.headers["x-globalpool-region"] != "ap-south"
    finally:
        undrained = requests.post(f"{up.url}/admin/undrain", headers=headers, timeout=10,
                                  json={"region": "ap-south"})
        assert undrained.status_code == 200, undrained.text


# --- Files and Batch APIs ------------------------------------------------------------------

def batch_file(count: int, model: str = "tiny-llama") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"j-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": 3, "messages": HELLO}}).encode() + b"\n"
        for i in range(count))


def test_files_api_and_its_limits(up: RunningUp) -> None:
    openai = client(up)
    uploaded = openai.files.create(file=("in.jsonl", batch_file(2)), purpose="batch")
    assert openai.files.retrieve(uploaded.id).bytes == len(batch_file(2))
    assert uploaded.id in {f.id for f in openai.files.list(purpose="batch")}
    assert openai.files.content(uploaded.id).content == batch_file(2)
    too_big = requests.post(f"{up.url}/v1/files", timeout=30, data={"purpose": "batch"},
                            files={"file": ("big.jsonl", b"x" * (200 * 1024))})
    assert too_big.status_code == 413
    assert_openai_error(too_big)
    no_purpose = requests.post(f"{up.url}/v1/files", timeout=30,
                               files={"file": ("a.jsonl", b"{}\n")})
    assert no_purpose.status_code == 400
    assert assert_openai_error(no_purpose)["param"] == "purpose"
    bad_purpose = requests.post(f"{up.url}/v1/files", timeout=30,
                                data={"purpose": "batch_output"},
                                files={"file": ("a.jsonl", b"{}\n")})
    assert bad_purpose.status_code == 400
    assert_openai_error(bad_purpose)
    openai.files.delete(uploaded.id)
    with pytest.raises(NotFoundError):
        openai.files.retrieve(uploaded.id)


def test_batch_api_end_to_end(up: RunningUp) -> None:
    openai = client(up)
    uploaded = openai.files.create(file=("in.jsonl", batch_file(3)), purpose="batch")
    batch = openai.batches.create(input_file_id=uploaded.id,
                                  endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "journey"})
    assert batch.status in {"validating", "in_progress"}
    deadline = time.monotonic() + 60
    while batch.status not in {"completed", "failed", "expired", "cancelled"}:
        assert time.monotonic() < deadline, batch
        time.sleep(0.25)
        batch = openai.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == 3
    assert batch.output_file_id
    lines = [json.loads(line) for line in
             openai.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["j-0", "j-1", "j-2"]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert batch.id in {b.id for b in openai.batches.list()}
    conflict = requests.post(f"{up.url}/v1/batches/{batch.id}/cancel", timeout=30)
    assert conflict.status_code == 409
    assert_openai_error(conflict)


def _long_batch(openai: OpenAI, count: int) -> str:
    lines = b"".join(json.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-llama", "max_tokens": 300, "ignore_eos": True,
                 "messages": HELLO}}).encode() + b"\n" for i in range(count))
    uploaded = openai.files.create(file=("in.jsonl", lines), purpose="batch")
    return openai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def _until_cancelled(openai: OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 60
    batch = openai.batches.retrieve(batch_id)
    while batch.status != "cancelled":
        assert time.monotonic() < deadline, batch
        time.sleep(0.25)
        batch = openai.batches.retrieve(batch_id)
    return batch


def test_batch_cancel_in_progress_lists_the_lines_not_run(up: RunningUp) -> None:
    openai = client(up)
    batch_id = _long_batch(openai, 40)
    deadline = time.monotonic() + 30
    while openai.batches.retrieve(batch_id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert openai.batches.cancel(batch_id).status in {"cancelling", "cancelled"}
    batch = _until_cancelled(openai, batch_id)
    assert batch.request_counts is not None and batch.request_counts.total == 40
    assert batch.error_file_id
    errors = openai.files.content(batch.error_file_id).content.splitlines()
    assert len(errors) + batch.request_counts.completed == 40


def test_batch_cancelled_while_validating_lists_its_lines(up: RunningUp) -> None:
    openai = client(up)
    batch_id = _long_batch(openai, 40)
    assert openai.batches.cancel(batch_id).status in {"cancelling", "cancelled"}
    batch = _until_cancelled(openai, batch_id)
    # Cancelled before its validation ended (the runner looks every ~0.5 s: almost always;
    # should it have validated the batch between the two calls, the lines are listed too).
    assert batch.error_file_id, batch
    errors = openai.files.content(batch.error_file_id).content.splitlines()
    assert len(errors) == 40
    assert all(json.loads(line)["error"]["code"] == "batch_cancelled" for line in errors)


def test_every_answer_carries_a_request_id(up: RunningUp) -> None:
    answers = [
        requests.get(f"{up.url}/v1/chat/completions", timeout=30),
        requests.post(f"{up.url}/v1/batches", timeout=30, json={
            "input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}),
        requests.post(f"{up.url}/v1/files", timeout=30, files={"file": ("a", b"{}\n")}),
        requests.get(f"{up.url}/v1/files", timeout=30),
    ]
    missing = [(a.request.method, a.request.path_url, a.status_code) for a in answers
               if not a.headers.get("x-request-id")]
    assert missing == []


def test_batch_create_refusals(up: RunningUp) -> None:
    for body, param in (({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                          "completion_window": "24h"}, "input_file_id"),
                        ({"input_file_id": "file-nope", "endpoint": "/v1/nope",
                          "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                          "completion_window": "1h"}, "completion_window")):
        response = requests.post(f"{up.url}/v1/batches", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert assert_openai_error(response)["param"] == param


def test_the_batch_command(up: RunningUp, tmp_path: Path) -> None:
    requests_file = tmp_path / "requests.jsonl"
    requests_file.write_bytes(batch_file(2))
    env = {**os.environ, "GLOBALPOOL_ROUTER_URL": up.url, "OPENAI_API_KEY": "unused"}
    env.pop("GLOBALPOOL_API_KEY", None)
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "batch", "submit", str(requests_file),
         "--out", str(tmp_path / "out"), "--metadata", "job=nightly"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    outputs = list((tmp_path / "out").glob("*_output.jsonl"))
    assert len(outputs) == 1, list((tmp_path / "out").iterdir())
    assert len(outputs[0].read_text().splitlines()) == 2
    listed = subprocess.run([sys.executable, "-m", "router.cli", "batch", "list"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr


def test_the_batch_command_takes_router_after_the_action(up: RunningUp) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLOBALPOOL_ROUTER_URL"}
    listed = subprocess.run(
        [sys.executable, "-m", "router.cli", "batch", "list", "--router", up.url],
        cwd=ROOT, env={**env, "OPENAI_API_KEY": "unused"}, capture_output=True, text=True,
        timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr


def test_the_readme_curl_stream(up: RunningUp) -> None:
    done = subprocess.run(
        ["curl", "-sN", f"{up.url}/v1/chat/completions", "-H", "Content-Type: application/json",
         "-d", '{"model": "tiny-llama", "stream": true, "max_tokens": 4, '
         '"messages": [{"role": "user", "content": "Hi"}]}', "-i"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("HTTP/1.1 200"), done.stdout[:500]
    lowered = done.stdout.lower()
    assert "x-globalpool-region:" in lowered and "x-request-id:" in lowered, done.stdout
    assert done.stdout.rstrip().endswith("data: [DONE]"), done.stdout[-500:]


@pytest.mark.parametrize("headers", [
    {"x-globalpool-ttft-budget-ms": "soon"}, {"x-globalpool-ttft-budget-ms": "-5"},
    {"x-globalpool-hedge": "maybe"}, {"x-globalpool-client-region": "mars"},
    {"x-globalpool-failover": "perhaps"}, {"x-globalpool-class": "vip"},
    {"x-globalpool-session-id": "s" * 5000},
])
def test_odd_routing_headers_never_break_a_request(up: RunningUp,
                                                   headers: dict[str, str]) -> None:
    response = requests.post(f"{up.url}/v1/chat/completions", headers=headers, timeout=30,
                             json={"model": "tiny-llama", "messages": RAW_HELLO,
                                   "max_tokens": 2, "stream": True})
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_openai_error(response)


def test_n3_stream_with_max_tokens_zero_is_an_openai_error(up: RunningUp) -> None:
    response = requests.post(f"{up.url}/v1/chat/completions", timeout=30, json={
        "model": "tiny-llama", "messages": RAW_HELLO, "max_tokens": 0, "n": 3,
        "stream": True})
    assert response.status_code == 400, response.text
    assert_openai_error(response)
