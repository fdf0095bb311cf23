"""The drill's definitions on literal request records (times in s since the load started)."""

from __future__ import annotations

from lab.devstack.loadgen import RequestResult
from lab.drill.analysis import (
    Target,
    Timeline,
    per_second,
    percentile,
    phase_stats,
    returned,
    time_to_detect,
    time_to_reroute,
    time_to_return,
)

TIMELINE = Timeline(warmup_end_s=1.0, fault_s=10.0, cleared_s=20.0, end_s=30.0)
US_EAST = Target(regions=frozenset({"us-east"}))


def _req(start_s: float, region: str = "eu-west", *, retried: bool = False,
         failure: str | None = None, ttft_ms: float = 50.0) -> RequestResult:
    ok = failure is None
    return RequestResult(
        index=0, origin_region="us-east", start_s=start_s, end_s=start_s + 0.5,
        status=200 if failure != "before_first_byte" else 502,
        first_byte_s=start_s + ttft_ms / 1000 if ok else None,
        first_token_s=start_s + ttft_ms / 1000 if ok else None,
        region=region if failure != "before_first_byte" else None,
        worker=f"{region}-1", retried=retried,
        failure=failure,  # type: ignore[arg-type]
    )


def _steady(start_s: float, end_s: float, region: str = "eu-west",
            every_s: float = 0.1) -> list[RequestResult]:
    count = round((end_s - start_s) / every_s)
    return [_req(start_s + i * every_s, region) for i in range(count)]


def test_detect_is_the_last_touch_before_a_quiet_second() -> None:
    requests = [*_steady(0, 10, "us-east"), _req(10.05, "us-east"), _req(10.2, retried=True),
                _req(10.4, "us-east"), *_steady(10.5, 20), _req(15.0, retried=True)]
    detect, later = time_to_detect(sorted(requests, key=lambda r: r.start_s), US_EAST,
                                   TIMELINE)
    assert detect is not None and abs(detect - 0.4) < 1e-9
    assert later == 1  # the isolated retry at 15 s (a half-open probe, say)


def test_detect_is_zero_when_nothing_touches_the_target() -> None:
    assert time_to_detect(_steady(10, 20), US_EAST, TIMELINE) == (0.0, 0)


def test_detect_is_none_when_the_router_never_stops() -> None:
    assert time_to_detect(_steady(10, 20, "us-east"), US_EAST, TIMELINE) == (None, 0)


def test_reroute_needs_a_whole_second_of_clean_requests_elsewhere() -> None:
    requests = [*_steady(10, 10.5), _req(10.55, retried=True), *_steady(10.6, 20)]
    reroute = time_to_reroute(requests, US_EAST, TIMELINE)
    assert reroute is not None and abs(reroute - 0.6) < 1e-9
    failed = [*_steady(10, 10.3), _req(10.4, failure="mid_stream"), *_steady(10.5, 20)]
    reroute = time_to_reroute(failed, US_EAST, TIMELINE)
    assert reroute is not None and abs(reroute - 0.5) < 1e-9
    assert time_to_reroute(_steady(10, 20), US_EAST, TIMELINE) == 0.0
    assert time_to_reroute(_steady(10, 20, "us-east"), US_EAST, TIMELINE) is None


def test_return_after_clearing() -> None:
    before = _steady(1, 10, "us-east")
    single = [*before, *_steady(10, 21), _req(21.0, "us-east"), *_steady(21.1, 30)]
    assert time_to_return(single, US_EAST, TIMELINE) is None  # one request is not a return
    back = time_to_return([*before, *_steady(10, 22.5), *_steady(22.5, 30, "us-east")],
                          US_EAST, TIMELINE)
    assert back is not None and abs(back - 2.0) < 1e-9  # the window [22, 23) is half back


def test_the_return_is_told_while_the_load_runs_once_its_window_has_ended() -> None:
    before = _steady(1, 10, "us-east")
    so_far = [*before, *_steady(10, 22.5), *_steady(22.5, 23.6, "us-east")]
    # The window [22, 23) is half back: told once RETURN_LAG_S has passed since its end.
    assert not returned(so_far, US_EAST, TIMELINE, now_s=23.6)
    assert returned(so_far, US_EAST, TIMELINE, now_s=24.05)
    assert not returned([*before, *_steady(10, 40)], US_EAST, TIMELINE, now_s=40.0)
    # Past the planned end too: a return late in a long wait still counts.
    late = [*before, *_steady(10, 35), *_steady(35, 37, "us-east")]
    assert returned(late, US_EAST, TIMELINE, now_s=37.0)


def test_a_target_that_served_nothing_before_has_no_return_to_wait_for() -> None:
    assert returned(_steady(1, 25), US_EAST, TIMELINE, now_s=21.0)
    assert returned([], US_EAST, TIMELINE, now_s=21.0)


def test_phases_and_seconds() -> None:
    requests = [_req(0.5), _req(5, "us-east", ttft_ms=40), _req(12, ttft_ms=120),
                _req(12.5, failure="before_first_byte"), _req(25, "us-east")]
    stats = phase_stats(requests, TIMELINE)
    assert stats["before"]["requests"] == 1  # the warm-up request is in no phase
    assert stats["during"]["failed"] == {"total": 1, "before_first_byte": 1, "mid_stream": 0}
    assert stats["during"]["ttft_p99_ms"] == 120.0
    assert stats["after"]["served_by_region"] == {"us-east": 1}
    rows = per_second(requests, TIMELINE.end_s)
    assert len(rows) == 30
    assert rows[12]["requests"] == 2 and rows[12]["failed_before_first_byte"] == 1


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 99) is None
    assert percentile([float(v) for v in range(1, 101)], 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
