"""`python .ci/lock_check.py LOCK`: exit 1 unless every distribution installed in this
Python is the version LOCK pins for it (markers evaluated here), but the project itself and
the installer's own tools.

`pip install -c LOCK` pins only what LOCK names: a dependency that pyproject.toml gained
and the lock lacks would install unpinned, silently. The fix this prints is `.ci/lock`.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

NOT_LOCKED = {"globalpool", "pip", "setuptools", "wheel"}


def locked_versions(lock: Path) -> dict[str, Version]:
    """Name -> pinned version, for the lines whose markers hold on this Python."""
    pins: dict[str, Version] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate():
            (spec,) = requirement.specifier
            pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def problems(lock: Path) -> list[str]:
    pins = locked_versions(lock)
    found: list[str] = []
    for distribution in metadata.distributions():
        name = canonicalize_name(distribution.metadata["Name"])
        version = Version(distribution.version)
        if name in NOT_LOCKED:
            continue
        if name not in pins:
            found.append(f"{name} {version} is installed and {lock} does not pin it")
        elif version != pins[name]:
            found.append(f"{name} {version} is installed and {lock} pins {pins[name]}")
    return sorted(found)


def main() -> int:
    lock = Path(sys.argv[1])
    found = problems(lock)
    for problem in found:
        print(f"lock: {problem}", file=sys.stderr)
    if found:
        print("lock: refresh it with `.ci/lock` (pyproject.toml changed?)", file=sys.stderr)
        return 1
    print(f"lock: every installed distribution is the version {lock} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
