"""Prometheus /metrics on the router: present, in Prometheus naming, and moving under load."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from tests.conftest import ROOT
from tests.integration.operators_fleet import (
    CHAT,
    OpsFleet,
    admin,
    chat,
    fleet_config,
    scrape,
    value,
    wait_for,
)

pytestmark = pytest.mark.integration

async def test_metrics_move_under_load(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "us-east", "c": "eu-west"})
    before = await scrape(fleet.url)
    assert value(before, "globalpool_requests_total") == 0
    assert value(before, "globalpool_redis_connected") == 1
    assert 0 <= value(before, "globalpool_snapshot_age_seconds") < 5
    assert value(before, "globalpool_workers", region="us-east", state="ready") == 2
    assert value(before, "globalpool_config_reload_errors_total") == 0

    bodies = [{**CHAT, "stream": i % 2 == 0} for i in range(20)]
    results = await asyncio.gather(*(chat(fleet.url, body) for body in bodies))
    assert [status for status, _, _ in results] == [200] * 20
    assert (await chat(fleet.url, {**CHAT, "model": "nope"}))[0] == 404

    after = await scrape(fleet.url)
    assert value(after, "globalpool_requests_total", status="200") == 20
    assert value(after, "globalpool_requests_total", model="m", kind="chat",
                 **{"class": "interactive"}) == 20
    assert value(after, "globalpool_requests_total", region="none", model="(other)",
                 status="404") == 1
    assert value(after, "globalpool_ttft_seconds_count") == 10  # the streams
    assert value(after, "globalpool_e2e_seconds_count") == 20
    assert value(after, "globalpool_ttft_seconds_sum") > 0
    assert value(after, "globalpool_upstream_ttfb_seconds_count") == 20
    assert value(after, "globalpool_route_seconds_count") == 20
    decisions = value(after, "globalpool_routing_decisions_total")
    assert decisions == 20 and value(after, "globalpool_routing_decisions_total",
                                     reason="local", region="us-east") > 0
    assert value(after, "globalpool_retries_total") == 0
    assert value(after, "globalpool_worker_capacity_seqs", worker="a") == 8
    assert value(after, "globalpool_config_info") == 1


async def test_the_fleet_views_intake_is_counted(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    before = await scrape(fleet.url)
    assert value(before, "globalpool_heartbeats_parsed_total") >= 2  # the first full read
    await fleet.publish("a", running=3)  # only its load changed: a load record, no message

    async def a_reads_three() -> bool:
        return value(await scrape(fleet.url), "globalpool_worker_load_seqs", worker="a") == 3

    await wait_for(a_reads_three)
    after = await scrape(fleet.url)
    assert value(after, "globalpool_load_records_applied_total") > value(
        before, "globalpool_load_records_applied_total")
    assert value(after, "globalpool_load_records_read_total") >= value(
        after, "globalpool_load_records_applied_total")
    assert value(after, "globalpool_heartbeat_messages_total") == value(
        before, "globalpool_heartbeat_messages_total")
    assert value(after, "globalpool_heartbeats_malformed_total") == 0
    # What keeping the view cost: CPU spent, snapshots built, the pace of builds now.
    assert value(after, "globalpool_fleet_view_builds_total") > value(
        before, "globalpool_fleet_view_builds_total")
    assert value(after, "globalpool_fleet_view_cpu_seconds_total") > value(
        before, "globalpool_fleet_view_cpu_seconds_total") >= 0
    # Within its bounds (two workers cost almost nothing: 20 ms, unless a garbage
    # collection of this test process happened to fall into a build).
    assert 0.02 <= value(after, "globalpool_fleet_view_rebuild_interval_seconds") <= 0.5


async def test_retries_failures_drains_and_reload_errors_show(fleet: OpsFleet,
                                                              redis_url: str,
                                                              key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "us-east"})
    async with aiohttp.ClientSession() as session, session.post(
            f"{fleet.sims['a'].url}/sim/faults", json={"error_rate": 1.0}) as response:
        assert response.status == 200
    for _ in range(6):
        assert (await chat(fleet.url))[0] == 200
    samples = await scrape(fleet.url)
    assert value(samples, "globalpool_attempt_failures_total", failure="server_error") >= 1
    assert value(samples, "globalpool_retries_total", region="us-east") >= 1
    assert value(samples, "globalpool_routing_decisions_total", reason="retry") >= 1

    await admin(fleet.url, "POST", "/admin/drain", body={"worker": "b"})
    samples = await scrape(fleet.url)
    assert value(samples, "globalpool_drained", kind="worker", name="b") == 1

    bad = fleet_config(redis_url, key_prefix)
    bad["regions"]["eu-west"]["rtt_ms"] = {"us-east": -1}
    fleet.write_config(bad)

    async def refused() -> bool:
        return value(await scrape(fleet.url), "globalpool_config_reload_errors_total") == 1

    await wait_for(refused)
    assert value(await scrape(fleet.url), "globalpool_config_last_reload_ok") == 0


async def test_every_metric_on_the_grafana_dashboard_is_exported(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"})
    assert (await chat(fleet.url, {**CHAT, "stream": True}))[0] == 200
    async with aiohttp.ClientSession() as session, session.get(f"{fleet.url}/metrics") as reply:
        text = await reply.text()
    # Families are declared (# TYPE) even before their first labelled sample.
    declared = {re.sub(r"_total$", "", name)
                for name in re.findall(r"^# TYPE (globalpool_[a-z0-9_]+) ", text, re.MULTILINE)}
    dashboard = json.loads((ROOT / "dashboards" / "globalpool.json").read_text())
    used = {re.sub(r"_(total|bucket|count|sum)$", "", name)
            for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"globalpool_[a-z0-9_]+", target["expr"])}
    assert len(used) > 15 and used - declared == set()
