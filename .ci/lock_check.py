"""`python .ci/lock_check.py LOCK [EXTRA...]`: exit 1 unless every distribution that the
installed globalpool (with those extras) needs, directly or not, is installed at the version
LOCK pins for it (LOCK's markers evaluated on this Python).

`pip install -c LOCK` pins only what LOCK names: a dependency that pyproject.toml gained
and the lock lacks would install unpinned, silently. The fix this prints is `.ci/lock`.
Other tools installed beside (a profiler in a developer's venv) are not its business.
A build requirement of pyproject.toml that LOCK pins (mypy, whose mypyc compiles the
request path) must be pinned there to the same version: pip builds a compiled install in
an isolated environment that the lock does not reach.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

PROJECT = "globalpool"


def locked_versions(lock: Path) -> dict[NormalizedName, Version]:
    """Name -> pinned version, for the lines whose markers hold on this Python."""
    pins: dict[NormalizedName, Version] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate():
            (spec,) = requirement.specifier
            pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def _wanted(requirement: Requirement, extras: frozenset[str]) -> bool:
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in {"", *extras})


def needed(project: str, extras: frozenset[str]) -> set[NormalizedName]:
    """Every distribution `project[extras]` requires on this Python, directly or not."""
    found: set[NormalizedName] = set()
    seen: set[tuple[NormalizedName, frozenset[str]]] = set()
    todo = [(canonicalize_name(project), extras)]
    while todo:
        name, wanted_extras = todo.pop()
        if (name, wanted_extras) in seen:
            continue
        seen.add((name, wanted_extras))
        found.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # reported by `problems` as not installed
        for line in requires:
            requirement = Requirement(line)
            if _wanted(requirement, wanted_extras):
                todo.append((canonicalize_name(requirement.name),
                             frozenset(requirement.extras)))
    return found


def problems(lock: Path, extras: frozenset[str]) -> list[str]:
    pins = locked_versions(lock)
    found: list[str] = []
    for name in sorted(needed(PROJECT, extras) - {canonicalize_name(PROJECT)}):
        try:
            version = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            found.append(f"{name} is needed and not installed")
            continue
        if name not in pins:
            found.append(f"{name} {version} is installed and {lock} does not pin it")
        elif version != pins[name]:
            found.append(f"{name} {version} is installed and {lock} pins {pins[name]}")
    return found


def build_problems(lock: Path, pyproject: Path) -> list[str]:
    """The build requirements that LOCK pins and pyproject.toml does not pin the same."""
    pins = locked_versions(lock)
    requires = tomllib.loads(pyproject.read_text(encoding="utf-8"))["build-system"]["requires"]
    found: list[str] = []
    for line in requires:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name not in pins:
            continue
        exact = [spec for spec in requirement.specifier if spec.operator == "=="]
        if not exact or Version(exact[0].version) != pins[name]:
            found.append(f"{pyproject}'s build requirement {line!r}: {lock} pins "
                         f"{name} {pins[name]}; pin it to that (`{name}=={pins[name]}`)")
    return found


def main() -> int:
    lock, extras = Path(sys.argv[1]), frozenset(sys.argv[2:])
    found = problems(lock, extras) + build_problems(lock, Path("pyproject.toml"))
    for problem in found:
        print(f"lock: {problem}", file=sys.stderr)
    if found:
        print("lock: refresh it with `.ci/lock` (pyproject.toml changed?)", file=sys.stderr)
        return 1
    print(f"lock: what {PROJECT} needs is installed at the versions {lock} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
