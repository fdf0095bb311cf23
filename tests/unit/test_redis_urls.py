"""The Redis URL forms the router and the agents accept, checked before anything connects
(`worker.redis_client`). Connecting through them is tested on real Valkey processes:
tests/integration/test_redis_sentinel.py, test_security.py (rediss://)."""

from __future__ import annotations

import pytest

from router.config import redis_url_problem
from worker.redis_client import SentinelURL, url_problem


def test_a_sentinel_url_names_its_sentinels_service_database_and_credentials() -> None:
    url = SentinelURL.parse("rediss+sentinel://app:p%40ss@10.0.0.1:26380,[::1],sentinel-c/"
                            "gp-main/3?sentinel_password=spw&sentinel_username=watcher")
    assert url.sentinels == (("10.0.0.1", 26380), ("::1", 26379), ("sentinel-c", 26379))
    assert (url.service, url.db, url.tls) == ("gp-main", 3, True)
    assert (url.username, url.password) == ("app", "p@ss")
    assert (url.sentinel_username, url.sentinel_password) == ("watcher", "spw")
    assert SentinelURL.parse("rediss+sentinel://s1/gp?ssl_ca_certs=/etc/gp/ca.pem"
                             ).ssl_ca_certs == "/etc/gp/ca.pem"
    plain = SentinelURL.parse("redis+sentinel://s1/gp")
    assert (plain.db, plain.tls, plain.password, plain.sentinel_password) == (0, False, None, None)


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+sentinel:///gp", "at least one sentinel"),
    ("redis+sentinel://s1:26379", "name the monitored service"),
    ("redis+sentinel://s1/gp/zero", "is not a number"),
    ("redis+sentinel://s1/gp/0/extra", "name the monitored service"),
    ("redis+sentinel://s1:99999/gp", "is not host:port"),
    ("redis+sentinel://s1/gp?master_password=x", "unknown URL parameters ['master_password']"),
    ("redis+sentinel://s1/gp?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs TLS"),
    ("redis+cluster://n1:7000", "is not supported"),
    ("redis://:pw@/0", "needs a host"),
    ("localhost:6379", "is not a URL"),
])
def test_malformed_urls_say_what_is_wrong(url: str, problem: str) -> None:
    found = url_problem(url)
    assert found is not None and problem in found
    assert redis_url_problem(url) == found


@pytest.mark.parametrize("url", [
    "redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///run/redis.sock",
    "redis+sentinel://s1,s2:26380/gp", "rediss+sentinel://:pw@s1/gp/2",
])
def test_the_supported_forms_pass(url: str) -> None:
    assert url_problem(url) is None
    assert redis_url_problem("embedded") is None
