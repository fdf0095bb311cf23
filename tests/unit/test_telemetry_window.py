"""The status page's last-minute window: shares, errors and quantiles, with a fake clock."""

from __future__ import annotations

from router.core.outcome import Attempt, RequestRecord
from router.telemetry.window import TrafficWindow, quantile_ms


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _record(region: str | None, ttft_ms: float, *, status: int = 200,
            stream: bool = True, now_s: float = 1000.0) -> RequestRecord:
    record = RequestRecord(model="m", kind="chat", stream=stream, origin_region="us-east",
                           received_s=now_s, status=status, finished_s=now_s + 1.0)
    if region is not None:
        attempt = Attempt(worker_id="w", region=region, predicted_ttft_ms=1.0, reason="local",
                          started_s=now_s)
        attempt.first_byte_s = now_s + ttft_ms / 1000.0 if status < 500 else None
        record.attempts.append(attempt)
    return record


def test_quantiles_are_within_a_bin_of_the_truth() -> None:
    clock = Clock()
    window = TrafficWindow(clock)
    for ms in range(1, 1001):  # 1..1000 ms, uniform
        window.request_finished(_record("us-east", float(ms)))
    east = window.summary()["us-east"]
    assert east.requests == 1000 and east.share == 1.0 and east.errors == 0
    assert east.ttft_p50_ms is not None and abs(east.ttft_p50_ms - 500) / 500 < 0.06
    assert east.ttft_p99_ms is not None and abs(east.ttft_p99_ms - 990) / 990 < 0.06
    assert east.e2e_p50_ms is not None and abs(east.e2e_p50_ms - 1000) / 1000 < 0.06


def test_shares_errors_and_the_window_moving_on() -> None:
    clock = Clock()
    window = TrafficWindow(clock)
    for _ in range(3):
        window.request_finished(_record("us-east", 10.0))
    window.request_finished(_record("eu-west", 10.0, status=502))
    window.request_finished(_record(None, 0.0, status=503))
    summary = window.summary()
    assert summary["us-east"].share == 0.6 and summary["eu-west"].errors == 1
    assert summary["none"].requests == 1 and summary["eu-west"].ttft_p50_ms is None
    clock.now_s += 30
    window.request_finished(_record("eu-west", 10.0, stream=False, now_s=clock.now_s))
    assert window.summary()["eu-west"].requests == 2
    assert window.summary()["eu-west"].ttft_p50_ms is None  # not a stream
    clock.now_s += 45  # the first second has left the window
    summary = window.summary()
    assert set(summary) == {"eu-west"} and summary["eu-west"].requests == 1


def test_quantile_of_nothing_is_none() -> None:
    assert quantile_ms([0] * 10, 0.5) is None
