"""terraform/ read with python-hcl2: what `terraform validate` cannot check here, because
the Google provider cannot be downloaded.

- every module call passes every variable that has no default, and nothing undeclared;
- every root variable without a default is in terraform.tfvars.example;
- pools, routers and Redis nodes are iterated from the topology module, which reads
  ../regions.yaml (one source of truth);
- the router endpoints are outputs;
- no secret value can reach Terraform state; files named by file() exist; the
  start-up scripts are valid bash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.terraform.tfcli import TERRAFORM_DIR

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is not installed (pip install python-hcl2)")

SCRIPTS_DIR = TERRAFORM_DIR / "scripts"


@dataclass
class ModuleCall:
    name: str
    source: str
    arguments: dict[str, Any]
    caller: Path


@dataclass
class Module:
    """The parts of one Terraform module (a folder of .tf files) these checks need."""

    path: Path
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: dict[str, ModuleCall] = field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    data: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    terraform: list[dict[str, Any]] = field(default_factory=list)

    @property
    def required_variables(self) -> set[str]:
        return {name for name, body in self.variables.items() if "default" not in body}


_META_ARGUMENTS = {"source", "version", "for_each", "count", "depends_on", "providers"}


def _label(raw: str) -> str:
    return raw.strip('"')


def _blocks(document: dict[str, Any], kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(_label(name), body)
            for entry in document.get(kind, []) for name, body in entry.items()]


def load_module(path: Path) -> Module:
    options = hcl2.SerializationOptions(with_comments=False, strip_string_quotes=True)
    module = Module(path)
    for file in sorted(path.glob("*.tf")):
        with file.open(encoding="utf-8") as handle:
            document = hcl2.load(handle, serialization_options=options)
        module.variables.update(_blocks(document, "variable"))
        module.outputs.update(_blocks(document, "output"))
        for name, body in _blocks(document, "module"):
            arguments = {k: v for k, v in body.items()
                         if k not in _META_ARGUMENTS and not k.startswith("__")}
            module.calls[name] = ModuleCall(name, body["source"], arguments, file)
        for kind, instances in _blocks(document, "resource"):
            for name, body in instances.items():
                module.resources[f"{kind}.{_label(name)}"] = body
        for kind, instances in _blocks(document, "data"):
            for name, body in instances.items():
                module.data[f"{kind}.{_label(name)}"] = body
        for entry in document.get("locals", []):
            module.locals.update({k: v for k, v in entry.items() if not k.startswith("__")})
        module.terraform.extend(document.get("terraform", []))
    return module


@pytest.fixture(scope="module")
def modules() -> dict[Path, Module]:
    """Every module under terraform/, by folder."""
    folders = {file.parent for file in TERRAFORM_DIR.rglob("*.tf")}
    return {folder: load_module(folder) for folder in sorted(folders)}


@pytest.fixture(scope="module")
def root(modules: dict[Path, Module]) -> Module:
    return modules[TERRAFORM_DIR]


def _callee(call: ModuleCall, modules: dict[Path, Module]) -> Module:
    assert call.source.startswith("./") or call.source.startswith("../"), (
        f"{call.caller}: module {call.name}: only local modules are expected, got {call.source}")
    path = (call.caller.parent / call.source).resolve()
    assert path in modules, f"{call.caller}: module {call.name}: no module at {path}"
    return modules[path]


def test_every_module_call_passes_required_variables_and_only_declared_ones(
        modules: dict[Path, Module]) -> None:
    calls = [call for module in modules.values() for call in module.calls.values()]
    assert calls, "no module calls found"
    problems: list[str] = []
    for call in calls:
        callee = _callee(call, modules)
        where = f"{call.caller.relative_to(TERRAFORM_DIR)}: module {call.name}"
        for missing in sorted(callee.required_variables - set(call.arguments)):
            problems.append(f"{where}: variable {missing} has no default and is not passed")
        for unknown in sorted(set(call.arguments) - set(callee.variables)):
            problems.append(f"{where}: {unknown} is not a variable of {call.source}")
    assert not problems, "\n".join(problems)


def test_every_module_is_called(modules: dict[Path, Module], root: Module) -> None:
    called = {_callee(call, modules).path for module in modules.values()
              for call in module.calls.values()}
    assert set(modules) - {root.path} == called


def test_root_variables_without_default_are_in_the_tfvars_example(root: Module) -> None:
    example = (TERRAFORM_DIR / "terraform.tfvars.example").read_text(encoding="utf-8")
    assigned = set(re.findall(r"^([a-z_][a-z0-9_]*)\s*=", example, re.M))
    assert root.required_variables, "the root module should need a project and a domain"
    assert root.required_variables <= assigned, root.required_variables - assigned
    assert assigned <= set(root.variables), assigned - set(root.variables)


def test_root_reads_regions_yaml_once_into_the_topology_module(root: Module) -> None:
    assert "../regions.yaml" in root.locals["regions_yaml_path"]
    assert "file(local.regions_yaml_path)" in root.locals["regions_yaml"]
    topology = root.calls["topology"]
    assert topology.source == "./modules/topology"
    assert "yamldecode(local.regions_yaml)" in topology.arguments["config"]
    # The router replicas get the same file as their --config.
    assert "local.regions_yaml" in root.calls["router"].arguments["regions_yaml"]


@pytest.mark.parametrize(("call", "iterates"), [
    ("gpu_pool", "module.topology.gpu_pools"),
    ("router", "module.topology.regions"),
    ("redis", "module.topology.regions"),
])
def test_per_region_modules_iterate_over_the_topology(root: Module, call: str,
                                                      iterates: str) -> None:
    source = (TERRAFORM_DIR / "main.tf").read_text(encoding="utf-8")
    block = re.search(rf'module "{call}" {{(.*?)\n}}', source, re.S)
    assert block is not None
    assert re.search(rf"^\s*for_each\s*=\s*{re.escape(iterates)}\s*$", block[1], re.M), (
        f"module {call} must be for_each = {iterates}")


def test_topology_module_has_no_provider(modules: dict[Path, Module]) -> None:
    topology = modules[TERRAFORM_DIR / "modules" / "topology"]
    assert not topology.resources and not topology.data
    assert all("required_providers" not in block for block in topology.terraform)
    assert {"regions", "gpu_pools", "redis_primary_region", "router", "worker"} <= set(
        topology.outputs)


def test_router_endpoints_are_outputs(modules: dict[Path, Module], root: Module) -> None:
    outputs = root.outputs
    assert {"router_endpoint", "router_ip_address", "router_instance_groups"} <= set(outputs)
    assert "module.global_lb.url" in outputs["router_endpoint"]["value"]
    assert "module.global_lb.ip_address" in outputs["router_ip_address"]["value"]
    assert "module.router" in outputs["router_instance_groups"]["value"]
    router = modules[TERRAFORM_DIR / "modules" / "router"]
    global_lb = modules[TERRAFORM_DIR / "modules" / "global_lb"]
    assert "instance_group" in router.outputs
    assert {"url", "ip_address"} <= set(global_lb.outputs)
    # Every region's routers are a backend of the global entry point.
    assert "module.router" in root.calls["global_lb"].arguments["router_groups"]


def test_no_secret_value_can_reach_terraform_state(modules: dict[Path, Module]) -> None:
    secretish = re.compile(r"password|token|secret|api_key|signing|private_key", re.I)
    for module in modules.values():
        kinds = {name.split(".")[0] for name in [*module.resources, *module.data]}
        assert "google_secret_manager_secret_version" not in kinds, module.path
        for name, body in module.variables.items():
            assert not body.get("sensitive"), f"{module.path}: variable {name} is sensitive"
            assert not secretish.search(name), (
                f"{module.path}: variable {name} looks like a secret value; secrets come "
                "from Secret Manager at boot")


def test_machines_run_with_own_service_accounts_and_no_public_address(
        modules: dict[Path, Module]) -> None:
    machines = {f"{module.path.name}/{name}": body for module in modules.values()
                for name, body in module.resources.items()
                if name.split(".")[0] in ("google_compute_instance",
                                          "google_compute_instance_template")}
    assert len(machines) == 3, machines.keys()
    for name, body in machines.items():
        interface = body["network_interface"][0]
        assert "access_config" not in interface, f"{name}: public IP"
        assert "var.service_account" in body["service_account"][0]["email"], name
        assert body["metadata"]["block-project-ssh-keys"] == "true", name


def test_files_named_by_file_calls_exist(modules: dict[Path, Module]) -> None:
    pattern = re.compile(r'file\("\$\{path\.module\}/([^"]+)"\)')
    found = 0
    for module in modules.values():
        for tf in module.path.glob("*.tf"):
            for relative in pattern.findall(tf.read_text(encoding="utf-8")):
                found += 1
                assert (module.path / relative).is_file(), f"{tf}: {relative} does not exist"
    assert found >= 6


@pytest.mark.parametrize("script", ["gpu-worker.sh", "router.sh", "redis.sh"])
def test_startup_scripts_are_valid_bash(script: str) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    text = (SCRIPTS_DIR / "lib.sh").read_text(encoding="utf-8") + "\n" + (
        SCRIPTS_DIR / script).read_text(encoding="utf-8")
    checked = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True,
                             check=False)
    assert checked.returncode == 0, checked.stderr


# Which lib.sh functions read which settings.
_LIB_READS = {
    "redis_url": {"redis_password_secret", "redis_host"},
    "install_ops_agent": {"ops_agent"},
    "globalpool_install": {"globalpool_pip_spec", "requirements_lock"},
}


def _keys(value: Any) -> set[str]:
    """The attribute names of an HCL object: a dict, or an expression such as merge(...)."""
    if isinstance(value, dict):
        return {key for key in value if not key.startswith("__")}
    return set(re.findall(r"(\w+)\s*=", str(value)))


@pytest.mark.parametrize(("call", "script"), [
    ("gpu_pool", "gpu-worker.sh"), ("router", "router.sh"), ("redis", "redis.sh"),
])
def test_startup_scripts_read_only_settings_that_terraform_writes(
        modules: dict[Path, Module], root: Module, call: str, script: str) -> None:
    """Every `setting KEY` a script reads is a key Terraform puts in globalpool-settings."""
    module_call = root.calls[call]
    passed = module_call.arguments["settings"]
    written = _keys(passed) | _keys(_callee(module_call, modules).locals["settings"])
    if "module.topology.worker" in str(passed):
        topology = modules[TERRAFORM_DIR / "modules" / "topology"]
        written |= _keys(topology.outputs["worker"]["value"])
    text = (SCRIPTS_DIR / script).read_text(encoding="utf-8")
    read = set(re.findall(r"\bsetting (\w+)", text)) | set(re.findall(r"\bfield (\w+)", text))
    for function, keys in _LIB_READS.items():
        if re.search(rf"\b{function}\b", text):
            read |= keys
    assert read, script
    assert read <= written, f"{script} reads {sorted(read - written)}, which Terraform never writes"
