"""Capture a real vLLM 0.32's Responses API into tests/fixtures/vllm-0.32-cpu-responses.json.

The simulator's /v1/responses (lab/sim/responses_api.py) answers in these shapes, and its
tests (tests/integration/test_sim_responses.py) check it against this file. To rerun it:

    python tests/vllm/prepare.py --model /tmp/gp-tiny      # venv + tiny model, once
    # start one CPU vLLM as tests/vllm/pool.py does, with the store switched on:
    env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \\
        VLLM_HOST_IP=127.0.0.1 VLLM_CPU_OMP_THREADS_BIND=1 \\
        VLLM_ENABLE_RESPONSES_API_STORE=1 \\
        ~/.cache/globalpool/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \\
        --model /tmp/gp-tiny --served-model-name tiny-llama --host 127.0.0.1 --port 18321 \\
        --dtype float32 --max-model-len 2048 --max-num-seqs 16 --max-num-queued-reqs 24 \\
        --enable-prefix-caching --enforce-eager --kv-cache-memory-bytes 67108864 &
    python tests/vllm/capture_responses.py --url http://127.0.0.1:18321
    kill <the server's pid>

Ids (`resp_...`, `msg_...`) and `created_at` are the real ones of that run; they differ on
every run (the fixture's "varies" says which fields). The model has random weights, so
the generated text is noise; only its shape matters.

Standard library and httpx2 (the httpx fork in .venv, which the openai client uses) only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx  # the httpx fork the openai client in .venv ships with

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-responses.json"
MODEL = "tiny-llama"
UNKNOWN = "resp_doesnotexist"
# Long enough that a background request is still running when it is cancelled (the tiny
# model decodes ~100 tokens/s on one CPU core; the model has 2048 positions).
LONG_TOKENS = 1500


def _call(client: httpx.Client, method: str, path: str, body: Any = None) -> dict[str, Any]:
    """One plain JSON exchange, recorded as {request, status, response}."""
    response = client.request(method, path, json=body)
    try:
        answer: Any = response.json()
    except ValueError:
        answer = response.text
    return {"request": {"method": method, "path": path, "body": body},
            "status": response.status_code,
            "content_type": response.headers.get("content-type"), "response": answer}


def _stream(client: httpx.Client, path: str, body: Any, method: str = "POST",
            ) -> dict[str, Any]:
    """A streamed exchange: the raw bytes' framing and each event, in order."""
    with client.stream(method, path, json=body) as response:
        raw = b"".join(response.iter_raw())
        status, content_type = response.status_code, response.headers.get("content-type")
    text = raw.decode()
    events: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            event[field] = json.loads(value) if field == "data" and value != "[DONE]" else value
        events.append(event)
    first_id = text.find('"resp_')
    return {"request": {"method": method, "path": path, "body": body}, "status": status,
            "content_type": content_type,
            "framing": {"bytes": len(raw), "first_block": text.split("\n\n", 1)[0][:120],
                        "ends_with": text[-40:], "has_done_sentinel": "[DONE]" in text,
                        "first_resp_id_at_byte": first_id},
            "events": events}


def _poll(client: httpx.Client, response_id: str, until: set[str],
          timeout_s: float = 120.0) -> list[str]:
    """Distinct statuses GET reports, in order, until one in `until`."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get(f"/v1/responses/{response_id}").json().get("status")
        if not seen or seen[-1] != status:
            seen.append(status)
        if status in until:
            break
        time.sleep(0.05)
    return seen


def _get_during_stream(client: httpx.Client, url: str) -> dict[str, Any]:
    """GET of a (stored) streamed response while it is still streaming; then hang up."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": LONG_TOKENS, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as response:
        head = next(response.iter_text())
        rid = head.split('"id":"', 1)[1].split('"', 1)[0]
        with httpx.Client(base_url=url, timeout=30) as other:
            during = _call(other, "GET", f"/v1/responses/{rid}")
    time.sleep(0.5)
    return {"during": during, "after_hang_up": _call(client, "GET", f"/v1/responses/{rid}")}


def _background(client: httpx.Client) -> dict[str, Any]:
    short = {"model": MODEL, "input": "Hi", "max_output_tokens": 8, "background": True}
    created = _call(client, "POST", "/v1/responses", short)
    rid = created["response"].get("id", "")
    flow = _poll(client, rid, {"completed", "failed", "cancelled", "incomplete"})
    final = _call(client, "GET", f"/v1/responses/{rid}")
    long = {**short, "max_output_tokens": LONG_TOKENS}
    long_created = _call(client, "POST", "/v1/responses", long)
    long_id = long_created["response"].get("id", "")
    time.sleep(0.5)
    cancelled = _call(client, "POST", f"/v1/responses/{long_id}/cancel")
    after_cancel = _call(client, "GET", f"/v1/responses/{long_id}")
    cancel_again = _call(client, "POST", f"/v1/responses/{long_id}/cancel")
    streamed = _stream(client, "/v1/responses", {**short, "stream": True})
    streamed_id = next((e["data"]["response"]["id"] for e in streamed["events"]
                        if isinstance(e.get("data"), dict) and "response" in e["data"]), "")
    replay = _stream(client, f"/v1/responses/{streamed_id}?stream=true&starting_after=3",
                     None, method="GET")
    return {
        "create": created, "status_flow_by_get": flow, "get_when_done": final,
        "cancel_running": {"create": long_created, "cancel": cancelled,
                           "get_after": after_cancel, "cancel_again": cancel_again},
        "stream": streamed, "get_stream_replay_starting_after_3": replay,
        "with_store_false": _call(client, "POST", "/v1/responses", {**short, "store": False}),
    }


def capture(url: str) -> dict[str, Any]:
    client = httpx.Client(base_url=url, timeout=300)
    hi = {"model": MODEL, "input": "Hi", "max_output_tokens": 8}
    first = _call(client, "POST", "/v1/responses", hi)
    rid = first["response"]["id"]
    stream = _stream(client, "/v1/responses", {**hi, "stream": True})
    stream_id = stream["events"][0]["data"]["response"]["id"]
    not_stored = _call(client, "POST", "/v1/responses", {**hi, "store": False})
    cases: dict[str, Any] = {
        "create": first,
        "create_stream": stream,
        "get_after_stream": _call(client, "GET", f"/v1/responses/{stream_id}"),
        "get": _call(client, "GET", f"/v1/responses/{rid}"),
        "get_unknown": _call(client, "GET", f"/v1/responses/{UNKNOWN}"),
        "cancel_finished": _call(client, "POST", f"/v1/responses/{rid}/cancel"),
        "cancel_unknown": _call(client, "POST", f"/v1/responses/{UNKNOWN}/cancel"),
        "previous_response_id": _call(client, "POST", "/v1/responses",
                                      {**hi, "input": "And then?",
                                       "previous_response_id": rid}),
        "previous_response_id_unknown": _call(client, "POST", "/v1/responses",
                                              {**hi, "previous_response_id": UNKNOWN}),
        "input_messages_and_instructions": _call(
            client, "POST", "/v1/responses",
            {**hi, "input": [{"role": "user", "content": "Hi"}],
             "instructions": "Answer briefly."}),
        "store_false": not_stored,
        "get_store_false": _call(client, "GET",
                                 f"/v1/responses/{not_stored['response']['id']}"),
        "get_while_streaming": _get_during_stream(client, url),
        "background": _background(client),
        "background_store_false": _call(client, "POST", "/v1/responses",
                                        {**hi, "background": True, "store": False}),
        "model_unknown": _call(client, "POST", "/v1/responses", {**hi, "model": "no-such"}),
    }
    version = client.get("/version").json()
    return {"source": f"vllm-cpu {version.get('version')} (CPU, tiny-llama random weights, "
                      "VLLM_ENABLE_RESPONSES_API_STORE=1), tests/vllm/capture_responses.py",
            "varies": ["id", "created_at", "output[].id", "item_id", "item.id",
                       "generated text (random weights)", "framing.bytes"],
            "cases": cases}


_ONE_LINE = frozenset({"request", "response", "framing", "varies", "status_flow_by_get"})


def _render(value: Any, key: str = "", depth: int = 0) -> str:
    """Readable JSON: cases indented; each request, body and SSE event on one line."""
    if key in _ONE_LINE or not isinstance(value, dict | list) or not value:
        return json.dumps(value, ensure_ascii=False)
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, list):  # the events of a stream
        items = [inner + json.dumps(item, ensure_ascii=False) for item in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    items = [f"{inner}{json.dumps(name)}: {_render(item, name, depth + 1)}"
             for name, item in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:18321")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    captured = capture(args.url)
    args.out.write_text(_render(captured) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
