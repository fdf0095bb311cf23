"""checkov over terraform/ with the accepted findings in terraform/.checkov.yaml.

checkov pins `packaging<24` while pytest needs `packaging>=24`, so it cannot live in the
project's environment: the first run installs a pinned checkov into its own virtual
environment under the user's cache folder (about a minute, once per machine) and later
runs reuse it. Set CHECKOV_BIN to use a checkov you already have.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.terraform.tfcli import REPO, TERRAFORM_DIR

CHECKOV_VERSION = "3.3.30"
CONFIG = TERRAFORM_DIR / ".checkov.yaml"
README = REPO / "README.md"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "globalpool"


def _install_checkov() -> list[str]:
    """The command that runs checkov; installs it on first use. Skips if it cannot."""
    override = os.environ.get("CHECKOV_BIN")
    if override:
        return [override]
    tag = f"checkov-{CHECKOV_VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
    venv = _cache_dir() / tag
    command = [str(venv / "bin" / "python"), str(venv / "bin" / "checkov")]
    if (venv / "bin" / "checkov").is_file():
        return command
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the final place, then rename: a run that is interrupted, or a
    # concurrent one, never sees a half-installed environment.
    staging = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=venv.parent))
    try:
        steps = [
            [sys.executable, "-m", "venv", str(staging)],
            [str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", f"checkov=={CHECKOV_VERSION}"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot install checkov {CHECKOV_VERSION} into {staging}: "
                            f"{' '.join(step[:4])} ... failed: {done.stderr.strip()[-600:]}")
        with contextlib.suppress(OSError):  # OSError: another run finished first
            staging.rename(venv)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return command


@pytest.fixture(scope="module")
def checkov() -> list[str]:
    return _install_checkov()


def _skips() -> dict[str, str]:
    """The skip-check entries of .checkov.yaml with the reason after each `#`."""
    text = CONFIG.read_text(encoding="utf-8")
    section = text.split("skip-check:", 1)[1] if "skip-check:" in text else ""
    return dict(re.findall(r"^\s*-\s*(CKV2?_[A-Z0-9_]+)\s*#\s*(.+?)\s*$", section, re.M))


@pytest.mark.timeout(1200)
def test_checkov_finds_nothing_beyond_the_accepted_findings(checkov: list[str]) -> None:
    result = subprocess.run([*checkov, "--config-file", str(CONFIG), "--output", "json"],
                            cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    try:
        parsed: Any = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON (exit {result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    reports = parsed if isinstance(parsed, list) else [parsed]
    by_type = {report["check_type"]: report for report in reports if "check_type" in report}
    assert "terraform" in by_type, f"checkov scanned no Terraform: {result.stdout[-2000:]}"
    summary = by_type["terraform"]["summary"]
    assert summary["parsing_errors"] == 0, summary
    assert summary["resource_count"] >= 30 and summary["passed"] >= 50, summary
    failed = [f"{check['check_id']} {check['check_name']}: {check['resource']} "
              f"({check['file_path']}:{check['file_line_range']})"
              for report in reports for check in report.get("results", {}).get("failed_checks", [])]
    assert not failed, ("checkov findings (fix them, or accept them with a reason in "
                        "terraform/.checkov.yaml and README.md):\n" + "\n".join(failed))
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_accepted_finding_has_a_reason_and_is_in_the_readme() -> None:
    text = CONFIG.read_text(encoding="utf-8")
    listed = re.findall(r"^\s*-\s*(CKV2?_[A-Z0-9_]+)", text.split("skip-check:", 1)[-1], re.M)
    skips = _skips()
    assert set(listed) == set(skips), f"skips without a `# reason`: {set(listed) - set(skips)}"
    readme = README.read_text(encoding="utf-8")
    assert "## Deploy with Terraform" in readme
    section = readme.split("## Deploy with Terraform", 1)[1]
    for check_id in skips:
        assert re.search(rf"^\|\s*`?{check_id}`?\s*\|", section, re.M), (
            f"{check_id} is skipped in .checkov.yaml but not in the README's table")
