"""openapi.yaml describes the router as it runs: schemathesis against a live router, and
the documented paths are exactly the app's routes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CheckFunction
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    positive_data_acceptance,
)

from router.app import RouterSettings, build_app
from router.config_loader import parse_config
from tests.conftest import ROOT
from tests.integration.test_hostile import LiveRouter
from tests.integration.test_security_fleet import API_KEYS, auth_section

pytestmark = pytest.mark.integration

SCHEMA = schemathesis.openapi.from_path(ROOT / "openapi.yaml")
ADMIN_TOKEN_ENV = "GP_TEST_OPENAPI_ADMIN_TOKEN"
ADMIN_TOKEN = "admin-token-for-the-openapi-test"
# Examples per operation; GP_OPENAPI_EXAMPLES=250 searches harder, on demand (~2 min).
EXAMPLES = int(os.environ.get("GP_OPENAPI_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def live(redis_url: str) -> Iterator[LiveRouter]:
    os.environ[ADMIN_TOKEN_ENV] = ADMIN_TOKEN
    router = LiveRouter(redis_url, auth_section(),
                        {"admin": {"token_env": ADMIN_TOKEN_ENV}}).start()
    try:
        yield router
    finally:
        router.stop()
        del os.environ[ADMIN_TOKEN_ENV]


@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_router_answers_as_documented(
    case: schemathesis.Case[Any], live: LiveRouter,
) -> None:
    token = ADMIN_TOKEN if case.path.startswith("/admin/") else API_KEYS["acme"]
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) \
            and case.body["model"]:
        case.body["model"] = "m"  # the model the live router serves: reach the engine
    # Whether a well-formed request is served depends on the deployment (its regions,
    # models, context lengths), which the document cannot list: a schema-valid request
    # may rightly get a 400 (e.g. an unknown x-globalpool-client-region) or 404.
    excluded: list[CheckFunction] = [positive_data_acceptance]
    if case.media_type == "multipart/form-data":
        # Every field of a form is text: an "integer" prompt arrives as the string "-5422",
        # which is a valid prompt. schemathesis counts it as a type violation the router
        # should have refused (1 run in ~5 drew one): no form can be refused for that.
        excluded.append(negative_data_rejection)
    # A negative case may leave the required Authorization header out on purpose: sent
    # so, the router must refuse it (401). Any other case carries a valid credential, set
    # on the case itself so that schemathesis knows the header is no longer what made the
    # case negative (an extra query parameter it also drew is dropped on the wire or
    # ignored, as HTTP servers do, and must not be what the check then blames).
    headers = case.headers.copy()  # (case-insensitive: 'authorization' is the same)
    if not (case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER)
            and "Authorization" not in headers):
        headers["Authorization"] = f"Bearer {token}"
    case.headers = headers
    case.call_and_validate(base_url=live.url, excluded_checks=excluded, timeout=30)


def test_every_route_is_documented_and_every_documented_path_exists() -> None:
    config = parse_config({"apiVersion": "globalpool/v1",
                           "regions": {"us-east": {"models": ["m"]}}})
    app = build_app(RouterSettings(config=config, redis_url="redis://127.0.0.1:1/0",
                                   region="us-east", heartbeat_keys={}))
    served = {(route.method.lower(), route.resource.canonical)
              for route in app.router.routes()
              if route.resource is not None and route.method != "HEAD"}
    documented = {(method, path) for path, item in SCHEMA.raw_schema["paths"].items()
                  for method in item if method in ("get", "post", "put", "delete", "patch")}
    assert served == documented
