"""terraform/ read with python-hcl2: what `terraform validate` cannot check here, because
the Google provider cannot be downloaded.

- every module call passes every variable that has no default, and nothing undeclared;
- every root variable without a default is in terraform.tfvars.example;
- pools, routers and Redis nodes are iterated from the topology module, which reads
  ../regions.yaml (one source of truth);
- the router endpoints are outputs;
- no secret value can reach Terraform state; files named by file() exist; the
  start-up scripts are valid bash (and pass shellcheck, where it is installed);
- Redis (issue #25): clients get only TLS Sentinel URLs, Redis and its sentinels listen
  with TLS only, the firewall lets clients and nodes reach both ports, the quorum and
  timings reach the sentinels from the topology, the CA key reaches Redis nodes only,
  failover needs no Terraform, and the router groups autoscale on CPU. What the scripts
  write is checked by running them: test_terraform_redis_scripts.py.
- the Files and Batch APIs' bucket (issue 24): private (uniform access, public access
  prevention), never force-destroyed, objects expired after files_retention_days, object
  access for the routers' service account on that bucket only, and the routers'
  regions.yaml naming it (what that file says is checked by running Terraform:
  modules/topology/tests/files.tftest.hcl and test_terraform_cli.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import skip_for_missing_tool
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
    # The router replicas get that file as the topology module re-renders it (batch.storage
    # set to the deployment's bucket) as their --config.
    assert root.calls["router"].arguments["regions_yaml"] == (
        "${module.topology.router_regions_yaml}")


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


@pytest.mark.parametrize("script", ["gpu-worker.sh", "router.sh", "redis.sh"])
def test_startup_scripts_pass_shellcheck(script: str) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        skip_for_missing_tool("shellcheck is not installed (apt-get install shellcheck)")
    text = "#!/bin/bash\n" + (SCRIPTS_DIR / "lib.sh").read_text(encoding="utf-8") + "\n" + (
        SCRIPTS_DIR / script).read_text(encoding="utf-8")
    checked = subprocess.run([shellcheck, "--severity=warning", "-"], input=text,
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout


# Which lib.sh functions read which settings.
_LIB_READS = {
    "redis_url": {"redis_password_secret", "redis_sentinels", "redis_service",
                  "redis_tls_ca_cert_secret"},
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


# Redis: Sentinel across regions, TLS and AUTH on every connection (issue #25).

REDIS_PORT = "6379"
SENTINEL_PORT = "26379"


def _script(name: str) -> str:
    return (SCRIPTS_DIR / name).read_text(encoding="utf-8")


def _function(script: str, name: str) -> str:
    """The body of the bash function NAME in a start-up script."""
    found = re.search(rf"^{name}\(\) {{\n(.*?)^}}$", _script(script), re.M | re.S)
    assert found is not None, f"{script} defines no function {name}"
    return found[1]


def test_clients_get_only_tls_sentinel_urls() -> None:
    """No script or .tf file spells a plain redis:// or rediss:// URL, nor a sentinel URL
    without TLS; lib.sh's redis_url builds rediss+sentinel:// with the CA and the sentinels'
    password, and routers and agents take their REDIS_URL from it."""
    scheme = re.compile(r"\b(rediss?(?:\+sentinel)?)://")
    sources = [*SCRIPTS_DIR.glob("*.sh"), *TERRAFORM_DIR.rglob("*.tf")]
    for path in sources:
        spelled = set(scheme.findall(path.read_text(encoding="utf-8")))
        assert spelled <= {"rediss+sentinel"}, (
            f"{path.relative_to(TERRAFORM_DIR)} spells {sorted(spelled - {'rediss+sentinel'})}"
            ":// URLs; clients must use rediss+sentinel:// (TLS, primary found by the sentinels)")
    url = _function("lib.sh", "redis_url")
    assert "rediss+sentinel://" in url
    for parameter in ("ssl_ca_certs=", "sentinel_password="):
        assert parameter in url, f"redis_url leaves out {parameter}"
    for script in ("router.sh", "gpu-worker.sh"):
        assignments = re.findall(r"REDIS_URL=[^\s\"]*", _script(script))
        assert assignments == ["REDIS_URL=$(redis_url)"], (script, assignments)


@pytest.mark.parametrize("function", ["redis_conf", "sentinel_conf"])
def test_redis_and_its_sentinel_listen_with_tls_only(function: str) -> None:
    """The configurations redis.sh writes open no plain-text port (`port` other than 0),
    listen with TLS, replicate (and, for the sentinel, talk to the nodes) over TLS, and
    require the password."""
    body = _function("redis.sh", function)
    ports = re.findall(r"^port (\S+)$", body, re.M)
    assert ports == ["0"], f"{function}: port {ports}: every listener must be TLS (port 0)"
    port = "$REDIS_PORT" if function == "redis_conf" else "$SENTINEL_PORT"
    for directive in (f"tls-port {port}", "tls-replication yes", "tls-auth-clients no",
                      "tls-cert-file ", "tls-key-file ", "tls-ca-cert-file ",
                      "requirepass $(redis_quote"):
        assert re.search(rf"^{re.escape(directive)}", body, re.M), f"{function}: no {directive!r}"
    constants = dict(re.findall(r"^readonly (REDIS_PORT|SENTINEL_PORT)=(\d+)$",
                                _script("redis.sh"), re.M))
    assert constants == {"REDIS_PORT": REDIS_PORT, "SENTINEL_PORT": SENTINEL_PORT}


def test_firewall_lets_clients_and_nodes_reach_redis_and_its_sentinels(
        modules: dict[Path, Module], root: Module) -> None:
    network = modules[TERRAFORM_DIR / "modules" / "network"]
    to_redis = [body for name, body in network.resources.items()
                if name.startswith("google_compute_firewall.")
                and "var.service_accounts.redis" in str(body.get("target_service_accounts"))]
    assert len(to_redis) == 1, "one rule lets traffic in to the Redis nodes"
    rule = to_redis[0]
    sources = str(rule["source_service_accounts"])
    assert "values(var.service_accounts)" in sources or all(
        f"var.service_accounts.{kind}" in sources for kind in ("router", "worker", "redis")), (
        "routers, workers and the Redis nodes themselves (replication, sentinels) need Redis")
    ports = {port for allow in rule["allow"] if allow["protocol"] == "tcp"
             for port in allow["ports"]}
    assert {REDIS_PORT, SENTINEL_PORT} <= ports, f"the firewall opens only {sorted(ports)}"
    # The clients are given the sentinels' port that the firewall opens.
    assert f":{SENTINEL_PORT}" in root.locals["redis_sentinels"]
    assert "module.redis" in root.locals["redis_sentinels"]


def test_quorum_and_timings_reach_the_sentinels_from_the_topology(
        modules: dict[Path, Module], root: Module) -> None:
    """The quorum is computed once (a majority of the nodes; its values are checked by the
    topology's terraform tests and test_terraform_cli.py) and passed to every sentinel."""
    topology = modules[TERRAFORM_DIR / "modules" / "topology"]
    redis = topology.locals["redis"]
    assert re.fullmatch(r"\$\{floor\(local\.redis_nodes / 2\) \+ 1\}", redis["quorum"]), (
        redis["quorum"])
    assert "length(local.region_names)" in topology.locals["redis_nodes"]
    settings = root.calls["redis"].arguments["settings"]
    for setting, source in (("sentinel_quorum", "quorum"), ("down_after_ms", "down_after_ms"),
                            ("failover_timeout_ms", "failover_timeout_ms"),
                            ("redis_service", "service")):
        assert settings[setting] == f"${{module.topology.redis.{source}}}", setting
    main = _function("redis.sh", "main")
    assert re.search(r"sentinel_conf .*\$\(setting sentinel_quorum\)", main)
    assert "sentinel monitor $service $monitored $REDIS_PORT $quorum" in _function(
        "redis.sh", "sentinel_conf")


def test_sentinel_file_is_merged_not_overwritten_at_boot() -> None:
    """The start-up script writes the sentinel's file only through sentinel_conf, which reads
    the file it replaces (test_terraform_redis_scripts.py runs it), into the sentinel's
    state folder."""
    redis = _script("redis.sh")
    allowed = [
        r'fallback=\$\(learnt_primary "\$SENTINEL_CONF" "\$service"\)',
        r'sentinel_conf "\$SENTINEL_CONF" .*',
        r'install [^\n]*/dev/stdin "\$SENTINEL_CONF\.new"',
        r'mv "\$SENTINEL_CONF\.new" "\$SENTINEL_CONF"',
        r"ExecStart=/usr/bin/redis-server \$SENTINEL_CONF --sentinel .*",
    ]
    uses = [line.strip() for line in redis.splitlines() if "$SENTINEL_CONF" in line]
    others = [line for line in uses if not any(re.fullmatch(p, line) for p in allowed)]
    assert not others, f"redis.sh touches the sentinel's file other than by merging: {others}"
    assert len(uses) == len(allowed), uses
    assert re.search(r"^readonly SENTINEL_DIR=/var/lib/\S+$", redis, re.M)
    assert re.search(r"^readonly SENTINEL_CONF=\$SENTINEL_DIR/\S+$", redis, re.M)


def test_redis_failover_needs_no_terraform(root: Module) -> None:
    """No watcher of instance metadata, no DNS name that must move: the sentinels fail
    over, and every client knows every sentinel."""
    redis = _script("redis.sh")
    assert "wait_for_change" not in redis and "globalpool-redis-role <<" not in redis
    records = [body for name, body in root.resources.items()
               if name.startswith("google_dns_record_set.")]
    assert all("redis_primary_region" not in str(body) for body in records)
    for call in ("router", "gpu_pool"):
        settings = str(root.calls[call].arguments["settings"])
        assert "local.redis_sentinels" in settings and "redis_host" not in settings, call


def test_redis_tls_secrets_have_the_right_readers(modules: dict[Path, Module],
                                                  root: Module) -> None:
    """The CA's key only on Redis nodes (they sign their own certificates); the CA
    certificate wherever Redis is a client or a server. Both come from Secret Manager."""
    secrets = modules[TERRAFORM_DIR / "modules" / "secrets"].locals["secrets"]
    assert secrets["redis-tls-ca-key"]["readers"] == ["redis"]
    assert set(secrets["redis-tls-ca-cert"]["readers"]) == {"worker", "router", "redis"}
    assert not secrets["redis-tls-ca-key"]["optional"]
    for call in ("router", "gpu_pool"):
        settings = str(root.calls[call].arguments["settings"])
        assert "redis-tls-ca-key" not in settings, f"{call} must not be given the CA key"
        assert "redis-tls-ca-cert" in settings, call
    assert "redis-tls-ca-key" in str(root.calls["redis"].arguments["settings"])


def test_router_groups_autoscale_on_cpu(modules: dict[Path, Module], root: Module) -> None:
    router = modules[TERRAFORM_DIR / "modules" / "router"]
    group = router.resources["google_compute_region_instance_group_manager.routers"]
    assert "target_size" not in group, "an autoscaled group leaves its size to the autoscaler"
    autoscalers = [body for name, body in router.resources.items()
                   if name.startswith("google_compute_region_autoscaler.")]
    assert len(autoscalers) == 1
    autoscaler = autoscalers[0]
    assert "google_compute_region_instance_group_manager.routers" in autoscaler["target"]
    policy = autoscaler["autoscaling_policy"][0]
    assert policy["min_replicas"] == "${var.replicas}"
    assert policy["max_replicas"] == "${var.max_replicas}"
    assert policy["cpu_utilization"][0]["target"] == "${var.cpu_target}"
    arguments = root.calls["router"].arguments
    assert arguments["max_replicas"] == "${each.value.router.max_replicas}"
    assert arguments["cpu_target"] == "${each.value.router.cpu_target}"


# The Files and Batch APIs' bucket (issue 24).

FILES_DIR = TERRAFORM_DIR / "modules" / "files"
BUCKET = "google_storage_bucket.files"
# Roles that let a principal read and write objects, and nothing about the bucket itself.
OBJECT_ROLES = {"roles/storage.objectUser", "roles/storage.objectAdmin"}


def _only_block(value: Any) -> dict[str, Any]:
    assert isinstance(value, list) and len(value) == 1, value
    block = value[0]
    assert isinstance(block, dict)
    return block


def test_files_bucket_is_private_kept_and_expires_its_objects(
        modules: dict[Path, Module], root: Module) -> None:
    buckets = {f"{module.path.name}/{name}": body for module in modules.values()
               for name, body in module.resources.items()
               if name.startswith("google_storage_bucket.")}
    assert list(buckets) == [f"files/{BUCKET}"], "one bucket: the files bucket"
    bucket = modules[FILES_DIR].resources[BUCKET]
    assert bucket["uniform_bucket_level_access"] is True, "no per-object ACLs"
    assert bucket["public_access_prevention"] == "enforced"
    assert bucket["force_destroy"] is False, "destroy must not delete tenants' files"
    assert _only_block(bucket["versioning"])["enabled"] is False
    assert bucket["location"] == "${upper(var.location)}"
    # A later change of the location (or of the home region it defaults from) must not
    # plan to replace the bucket: a bucket cannot move.
    assert "location" in str(_only_block(bucket["lifecycle"])["ignore_changes"])
    assert "var.name_prefix" in modules[FILES_DIR].locals["bucket_name"]
    assert bucket["name"] == "${local.bucket_name}"
    rules = {_only_block(rule["action"])["type"]: _only_block(rule["condition"])
             for rule in bucket["lifecycle_rule"]}
    assert rules["Delete"] == {"__is_block__": True, "age": "${var.retention_days}"}, rules
    assert "AbortIncompleteMultipartUpload" in rules, "unfinished uploads are not kept"
    # Google-managed keys unless a KMS key is given.
    encryption = _only_block(bucket["dynamic"])["encryption"]
    assert "var.kms_key_name == null ? []" in encryption["for_each"]
    assert modules[FILES_DIR].variables["kms_key_name"]["default"] is None
    # No ACL can open it up, anywhere.
    acls = [name for module in modules.values() for name in module.resources
            if re.match(r"google_storage_(bucket|default_object|object)_acl\.", name)]
    assert not acls, acls
    # The root's knobs reach it.
    assert root.variables["files_retention_days"]["default"] == 30
    arguments = root.calls["files"].arguments
    assert arguments["retention_days"] == "${var.files_retention_days}"
    assert arguments["kms_key_name"] == "${var.files_kms_key_name}"
    assert arguments["location"] == (
        "${coalesce(var.files_location, module.topology.files_location)}")
    assert root.variables["files_location"]["default"] is None
    assert "storage.googleapis.com" in root.locals["services"]
    assert re.search(r"^\s*depends_on\s*=\s*\[google_project_service\.api\]",
                     _module_block("files"), re.M), "the bucket waits for the Storage API"


def _module_block(name: str) -> str:
    source = (TERRAFORM_DIR / "main.tf").read_text(encoding="utf-8")
    block = re.search(rf'module "{name}" {{(.*?)\n}}', source, re.S)
    assert block is not None, name
    return block[1]


def test_only_the_routers_may_use_the_files_bucket_and_only_that_bucket(
        modules: dict[Path, Module], root: Module) -> None:
    """Every grant of a Cloud Storage role is the one on the files bucket, to the routers'
    service account, of object access: no project-wide storage role, no public member."""
    grants = {f"{module.path.name}/{name}": body for module in modules.values()
              for name, body in module.resources.items()
              if re.match(r"google_\w+_iam_(member|binding|policy)\.", name)
              and "roles/storage." in str(body.get("role", body.get("policy_data", "")))}
    assert list(grants) == ["files/google_storage_bucket_iam_member.router"], grants
    grant = grants["files/google_storage_bucket_iam_member.router"]
    assert grant["bucket"] == f"${{{BUCKET}.name}}"
    assert grant["role"] in OBJECT_ROLES
    assert grant["member"] == "serviceAccount:${var.router_service_account}"
    assert root.calls["files"].arguments["router_service_account"] == (
        "${module.iam.emails.router}")
    everything = "".join(path.read_text(encoding="utf-8") for path in TERRAFORM_DIR.rglob("*.tf"))
    assert "allUsers" not in everything and "allAuthenticatedUsers" not in everything


def test_routers_config_names_the_bucket(modules: dict[Path, Module], root: Module) -> None:
    """The topology module renders the routers' regions.yaml with batch.storage =
    gs://<bucket>/files (known only once the routers may write there), the router module
    puts it in the instance metadata, and router.sh runs the router on it."""
    files = modules[FILES_DIR]
    storage = files.outputs["storage"]
    assert storage["value"] == f"gs://${{{BUCKET}.name}}/files"
    assert "google_storage_bucket_iam_member.router" in str(storage["depends_on"])
    assert root.calls["topology"].arguments["batch_storage"] == "${module.files.storage}"
    topology = modules[TERRAFORM_DIR / "modules" / "topology"]
    assert "var.batch_storage" in topology.locals["router_regions_yaml"]
    assert "router_regions_yaml" in topology.outputs
    router = modules[TERRAFORM_DIR / "modules" / "router"]
    template = router.resources["google_compute_instance_template.router"]
    assert template["metadata"]["globalpool-regions-yaml"] == "${var.regions_yaml}"
    # The machine's token must cover Cloud Storage (the bucket's IAM does the limiting).
    assert _only_block(template["service_account"])["scopes"] == ["cloud-platform"]
    script = _script("router.sh")
    assert re.search(r'meta instance/attributes/globalpool-regions-yaml \| write_private '
                     r'"\$ETC/regions\.yaml"', script)
    assert "--config $ETC/regions.yaml" in script
    # obstore finds the service account through the metadata server; a key file or a
    # GOOGLE_* variable would take its place.
    for name in ("router.sh", "lib.sh"):
        assert not re.search(r"GOOGLE_[A-Z_]+=", _script(name)), name
    assert {"name", "storage"} <= set(_keys(root.outputs["files_bucket"]["value"]))
