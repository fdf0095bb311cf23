"""The compiled build of the request path, and `globalpool compile`.

`GLOBALPOOL_COMPILE=1 pip install .` compiles the modules `setup.py` lists with mypyc.
`globalpool compile --out DIR` makes the same build as a copy of a checkout (its files
that git tracks or would track, the listed modules compiled next to their source), for
what runs from a tree rather than an install: the test suite against the compiled build
(CI's compiled tier) and the benchmarks' compiled rows (`bench-proxy`'s
`globalpool-compiled`, `bench-instructions --tree DIR`). A copy is rebuilt only when its
sources changed. With `--wheel W` it takes the compiled modules from a wheel built by
`GLOBALPOOL_COMPILE=1 pip wheel .` from the same sources instead of compiling them again:
CI builds the production wheel once, runs the suite on its extensions and inspects it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# Written into a compiled copy: the digest of the sources it was built from. A directory
# without it is never emptied by `build_copy`.
MARKER = ".globalpool-compiled"
_SKIPPED_DIRS = {".git", ".venv", "build", "__pycache__", ".mypy_cache", ".ruff_cache",
                 ".pytest_cache", ".hypothesis", ".compiled", ".compiled-wheel"}


class CompileError(Exception):
    """The compiled build failed; the message says where its log is."""


def compiled_modules() -> list[str]:
    """The router's modules imported in this process that are compiled extensions."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(name for name, module in list(sys.modules.items())
                  if name.startswith("router.")
                  and str(getattr(module, "__file__", "") or "").endswith(suffixes))


def source_checkout() -> Path | None:
    """The checkout this process's `router` package runs from, when it is one (an
    editable install or a tree on the path; None for an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "setup.py").is_file() else None


def checkout_files(source: Path) -> list[Path]:
    """The checkout's files: tracked by git or not ignored by it (a tree without git:
    everything but caches, virtual environments and builds)."""
    listed = subprocess.run(
        ["git", "-C", str(source), "ls-files", "-z", "--cached", "--others",
         "--exclude-standard"], capture_output=True, check=False)
    if listed.returncode == 0:
        names = [name for name in listed.stdout.decode().split("\0") if name]
        return sorted(Path(name) for name in names if (source / name).is_file())
    found: list[Path] = []
    for directory, subdirs, files in os.walk(source):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found += [Path(directory, name).relative_to(source) for name in files
                  if not name.endswith((".so", ".pyc"))]
    return sorted(found)


def _build_inputs(files: list[Path]) -> list[Path]:
    """What the compiled build depends on: the Python sources and the build's own files
    (a copy whose documentation or fixtures changed is refreshed, not recompiled)."""
    return [name for name in files
            if name.suffix == ".py" or name.name in ("pyproject.toml", "setup.py")]


def _digest(source: Path, files: list[Path]) -> str:
    digest = hashlib.sha256(f"{sys.version}\0".encode())
    for name in files:
        digest.update(f"{name}\0".encode())
        digest.update((source / name).read_bytes())
    return digest.hexdigest()


# What a copy holds besides the checkout's files, kept when it is brought up to date.
_BUILT_SUFFIXES = (".so", ".pyc")
_BUILT_NAMES = {MARKER, "compile.log"}
_CACHE_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}


def sync_copy(source: Path, out: Path, files: list[Path]) -> None:
    """Copy `files` from `source` to `out` where missing or different (size, time), and
    remove the copy's files that the checkout no longer has (a deleted test must not run
    on)."""
    wanted = set(files)
    for directory, subdirs, names in os.walk(out):
        subdirs[:] = [d for d in subdirs if d not in _CACHE_DIRS]
        for name in names:
            path = Path(directory, name)
            relative = path.relative_to(out)
            if (relative not in wanted and not name.endswith(_BUILT_SUFFIXES)
                    and str(relative) not in _BUILT_NAMES):
                path.unlink()
    for relative in files:
        given, copied = (source / relative).stat(), out / relative
        if copied.is_file():
            kept = copied.stat()
            if (kept.st_size, kept.st_mtime_ns) == (given.st_size, given.st_mtime_ns):
                continue
        copied.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / relative, copied)


def wheel_sources_differ(wheel: Path, source: Path) -> list[str]:
    """The Python files of `wheel` that `source` holds with other contents (empty for a
    wheel built from these sources). Raises CompileError for a file that is no wheel."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return [name for name in archive.namelist() if name.endswith(".py")
                    and (source / name).is_file()
                    and archive.read(name) != (source / name).read_bytes()]
    except (OSError, zipfile.BadZipFile) as exc:
        raise CompileError(f"{wheel}: not a readable wheel ({exc})") from exc


def _take_extensions(wheel: Path, source: Path, out: Path) -> None:
    """Unpack `wheel`'s compiled modules into `out`, where `build_ext --inplace` puts
    them, after checking that the wheel was built from `source` as it is."""
    differ = wheel_sources_differ(wheel, source)
    if differ:
        raise CompileError(f"{wheel} was not built from the sources of {source} "
                           f"({len(differ)} files differ, first {differ[0]})")
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    with zipfile.ZipFile(wheel) as archive:
        extensions = [name for name in archive.namelist() if name.endswith(suffixes)]
        if not extensions:
            raise CompileError(f"{wheel} holds no compiled module (built without "
                               f"GLOBALPOOL_COMPILE=1, or for another Python)")
        for name in extensions:
            archive.extract(name, out)


def build_copy(source: Path, out: Path, log: Path | None = None,
               progress: bool = True, wheel: Path | None = None) -> Path:
    """A copy of `source` at `out` with setup.py's modules compiled in place, or taken
    from `wheel` (built from the same sources); `out` is
    reused when it was built from the same sources (its other files brought up to date),
    and replaced otherwise (only if it is empty or an earlier copy). The compiler's output
    goes to `log` (default: `out`/compile.log, kept on failure). Raises CompileError."""
    source, out = source.resolve(), out.resolve()
    if not (source / "setup.py").is_file():
        raise CompileError(f"{source} is not a globalpool checkout (no setup.py)")
    if out == source or out in source.parents:
        raise CompileError(f"{out}: the copy cannot be the checkout or contain it")
    files = [name for name in checkout_files(source) if out not in (source / name).parents]
    digest = _digest(source, _build_inputs(files))
    marker = out / MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        sync_copy(source, out, files)
        if progress:
            print(f"compiled copy at {out} is up to date", file=sys.stderr)
        return out
    if out.exists() and any(out.iterdir()) and not marker.is_file():
        raise CompileError(f"{out} exists and is not a compiled copy; not replacing it")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    marker.write_text("incomplete\n")  # ours, to replace, even if this build fails
    sync_copy(source, out, files)
    if wheel is not None:
        _take_extensions(wheel, source, out)
        marker.write_text(digest + "\n")
        if progress:
            print(f"compiled modules taken from {wheel} into {out}", file=sys.stderr)
        return out
    log = log or out / "compile.log"
    if progress:
        print(f"compiling the request path with mypyc into {out} (1-3 minutes; "
              f"log: {log})", file=sys.stderr)
    started = time.monotonic()
    with log.open("wb") as output:
        built = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=out,
            env={**os.environ, "GLOBALPOOL_COMPILE": "1"}, stdout=output,
            stderr=subprocess.STDOUT, check=False)
    if built.returncode != 0:
        raise CompileError(f"the compiled build failed (exit {built.returncode}); see {log}")
    shutil.rmtree(out / "build", ignore_errors=True)
    marker.write_text(digest + "\n")
    if progress:
        print(f"compiled in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return out


def run_compile(args: argparse.Namespace) -> int:
    """`globalpool compile`: build a compiled copy and say which modules are compiled."""
    source = Path(args.tree) if args.tree else source_checkout()
    if source is None:
        print("globalpool compile: this globalpool is not a checkout; pass --tree",
              file=sys.stderr)
        return 2
    try:
        out = build_copy(source, Path(args.out),
                         wheel=Path(args.wheel) if args.wheel else None)
    except CompileError as exc:
        print(f"globalpool compile: {exc}", file=sys.stderr)
        return 1
    check = subprocess.run(
        [sys.executable, "-c", "import router.app, router.compiled as c; "
         "print('\\n'.join(c.compiled_modules()))"],
        cwd=out, env={**os.environ, "PYTHONPATH": str(out)}, capture_output=True, text=True,
        check=False)
    modules = check.stdout.split()
    if check.returncode != 0 or not modules:
        print(f"globalpool compile: the copy at {out} does not import its compiled "
              f"modules:\n{check.stderr}", file=sys.stderr)
        return 1
    print(f"{out}: {len(modules)} modules compiled ({', '.join(modules)})")
    return 0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "compile", help="a copy of a checkout with the request path compiled (mypyc)")
    parser.add_argument("--out", required=True,
                        help="the copy's directory (reused when its sources are unchanged)")
    parser.add_argument("--tree", help="the checkout to copy (default: this one)")
    parser.add_argument("--wheel", help="take the compiled modules from this wheel, built "
                        "by `GLOBALPOOL_COMPILE=1 pip wheel .` from the same sources, "
                        "instead of compiling them")
    parser.set_defaults(run=run_compile)
