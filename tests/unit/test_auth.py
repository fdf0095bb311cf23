"""API keys, tenants and the `auth:` section of regions.yaml."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.auth.config import RateLimits
from router.auth.endpoints import EndpointAllowList, entry_problem
from router.auth.keys import AuthError, Keyring, hash_key, main
from router.config_loader import ConfigError, load_config, parse_config


def document(auth: dict[str, Any], **regions: Any) -> dict[str, Any]:
    return {
        "apiVersion": "globalpool/v1",
        "regions": regions or {"us-east": {"models": ["m"], "rtt_ms": {"eu-west": 80}},
                               "eu-west": {"models": ["m"]}},
        "auth": auth,
    }


AUTH = {
    "tenants": {
        "acme": {"key_limits": {"requests_per_min": 60}, "limits": {"tokens_per_min": 1000}},
        "euco": {"allowed_regions": ["eu-west"], "allowed_models": ["m"]},
    },
    "keys": [
        {"id": "acme-1", "tenant": "acme", "sha256": hash_key("gp-acme-1")},
        {"id": "acme-2", "tenant": "acme", "sha256": hash_key("gp-acme-2"),
         "limits": {"requests_per_min": 5}},
        {"id": "euco-1", "tenant": "euco", "sha256": hash_key("gp-euco-1")},
    ],
}


def test_keys_resolve_to_their_tenant_and_limits() -> None:
    keyring = Keyring.from_config(parse_config(document(AUTH)).auth)
    assert keyring.enabled
    acme = keyring.authenticate("Bearer gp-acme-1")
    assert (acme.key_id, acme.tenant, acme.allowed_regions) == ("acme-1", "acme", None)
    assert acme.key_limits == RateLimits(requests_per_min=60)
    assert acme.tenant_limits == RateLimits(tokens_per_min=1000)
    assert keyring.authenticate("bearer gp-acme-2").key_limits.requests_per_min == 5
    euco = keyring.authenticate("Bearer gp-euco-1")
    assert euco.allowed_regions == frozenset({"eu-west"})
    assert euco.allowed_models == frozenset({"m"})


@pytest.mark.parametrize(("header", "code"), [
    (None, "missing_api_key"), ("", "missing_api_key"), ("gp-acme-1", "invalid_api_key"),
    ("Basic Z3A6eA==", "invalid_api_key"), ("Bearer gp-acme-3", "invalid_api_key"),
    ("Bearer ", "invalid_api_key"),
])
def test_missing_and_unknown_keys_are_refused_without_echoing_them(
    header: str | None, code: str,
) -> None:
    keyring = Keyring.from_config(parse_config(document(AUTH)).auth)
    with pytest.raises(AuthError) as caught:
        keyring.authenticate(header)
    assert caught.value.code == code
    assert "gp-acme" not in caught.value.message


def test_no_keys_means_auth_is_off() -> None:
    assert not Keyring.from_config(parse_config(document({})).auth).enabled


def test_config_errors_name_the_path() -> None:
    bad = {
        "tenants": {"t": {"allowed_regions": ["mars"]}},
        "keys": [{"id": "a", "tenant": "nobody", "sha256": "0" * 64},
                 {"id": "a", "tenant": "t", "sha256": "0" * 64},
                 {"id": "b", "tenant": "t", "sha256": "not-a-hash"}],
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(document(bad))
    problems = caught.value.problems
    assert "regions.yaml: auth.keys.2.sha256: String should match pattern '^[0-9a-f]{64}$'" \
        in problems


def test_reference_errors_name_the_path() -> None:
    bad = {
        "tenants": {"t": {"allowed_regions": ["mars"]}},
        "keys": [{"id": "a", "tenant": "nobody", "sha256": "0" * 64},
                 {"id": "a", "tenant": "t", "sha256": "0" * 64}],
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(document(bad))
    assert caught.value.problems == [
        "regions.yaml: auth.keys.0.tenant: no tenant named 'nobody'",
        "regions.yaml: auth.keys.1.id: 'a' is used twice",
        "regions.yaml: auth.keys.1.sha256: the same key is listed twice",
        "regions.yaml: auth.tenants.t.allowed_regions: no region named 'mars'",
    ]


def test_keys_can_live_in_a_separate_file(tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"id": "file-1", "tenant": "acme", "sha256": hash_key("gp-file-1")}]}))
    config_path = tmp_path / "regions.yaml"
    config_path.write_text(yaml.safe_dump(document({**AUTH, "keys_file": "keys.yaml"})))
    keyring = Keyring.from_config(load_config(config_path).auth)
    assert keyring.authenticate("Bearer gp-file-1").key_id == "file-1"
    assert keyring.authenticate("Bearer gp-acme-1").key_id == "acme-1"


def test_keys_file_errors_name_the_keys_file(tmp_path: Path) -> None:
    config_path = tmp_path / "regions.yaml"
    config_path.write_text(yaml.safe_dump(document({**AUTH, "keys_file": "keys.yaml"})))
    with pytest.raises(ConfigError, match=r"keys\.yaml: \(file\): cannot read"):
        load_config(config_path)
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": [{"id": "x", "tenant": "acme",
                                                                   "sha256": "123"}]}))
    with pytest.raises(ConfigError) as caught:
        load_config(config_path)
    assert caught.value.problems[0].startswith(f"{tmp_path / 'keys.yaml'}: keys.0.sha256: ")


def test_endpoint_allow_lists_validate_and_match() -> None:
    assert entry_problem("10.0.0.0/8") is None
    assert entry_problem("fd00::/8") is None
    assert entry_problem("*.eu.internal") is None
    assert entry_problem("gpu-1") is None
    assert entry_problem("http://gpu-1") is not None
    assert entry_problem("bad host") is not None
    allow = EndpointAllowList.parse(["10.1.0.0/16", "192.0.2.7", "fd00::/8", "gpu-1.eu",
                                     "*.pool.eu"])
    assert allow.allows("http://10.1.200.3:8000")
    assert allow.allows("https://192.0.2.7")
    assert allow.allows("http://[fd00::1]:8000")
    assert allow.allows("http://GPU-1.eu:8000")
    assert allow.allows("http://a.b.pool.eu:8000")
    for outside in ("http://10.2.0.1", "http://192.0.2.8", "http://[fe80::1]",
                    "http://pool.eu", "http://xpool.eu", "http://gpu-1.eu@10.9.9.9",
                    "http://[::1", "not a url"):
        assert not allow.allows(outside), outside
    with pytest.raises(ConfigError, match="allowed_endpoints"):
        parse_config(document({}, **{"us-east": {"models": ["m"],
                                                 "allowed_endpoints": ["what?"]}}))


def test_the_key_tool_makes_a_key_and_its_config_line() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["new", "acme", "acme-ci"]) == 0
    lines = out.getvalue().splitlines()
    key = lines[0].rsplit(" ", 1)[1]
    assert key.startswith("gp-") and len(key) > 40
    assert f"sha256: {hash_key(key)}" in lines[2]
    assert key not in lines[2]
