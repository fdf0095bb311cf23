"""`globalpool compile`'s copies: what is copied, when a copy is reused or rebuilt, and
which directories it refuses to replace. A checkout with a setup.py that compiles nothing
stands in for globalpool's (the real build runs in CI's compiled tier, `.ci/run`)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from router.compiled import MARKER, CompileError, build_copy, compiled_modules

SETUP = "from setuptools import setup\nsetup()\n"
BUILT = Path("pkg", "mod.cpython-311-x86_64-linux-gnu.so")  # as a compiled module would be


def _checkout(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "setup.py").write_text(SETUP)
    (root / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (root / ".gitignore").write_text("ignored.txt\n")
    (root / "ignored.txt").write_text("not copied\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_a_copy_holds_the_checkouts_files_and_is_reused_until_a_source_changes(
        tmp_path: Path) -> None:
    source = _checkout(tmp_path / "src")
    out = build_copy(source, tmp_path / "copy", progress=False)
    assert (out / "pkg" / "mod.py").read_text() == "VALUE = 1\n"
    assert not (out / "ignored.txt").exists()  # what git ignores is not copied
    assert (out / MARKER).is_file()
    (out / BUILT).write_text("left by the build")
    (source / "NOTES.md").write_text("a file that is not a build input\n")
    build_copy(source, out, progress=False)
    assert (out / BUILT).exists()  # same sources: reused, not rebuilt
    assert (out / "NOTES.md").read_text() == "a file that is not a build input\n"
    (source / "NOTES.md").unlink()
    build_copy(source, out, progress=False)
    assert not (out / "NOTES.md").exists()  # gone from the checkout: gone from the copy
    assert (out / MARKER).is_file() and (out / BUILT).exists()
    (source / "pkg" / "mod.py").write_text("VALUE = 2\n")
    build_copy(source, out, progress=False)
    assert (out / "pkg" / "mod.py").read_text() == "VALUE = 2\n"
    assert not (out / BUILT).exists()  # rebuilt from scratch


def test_a_directory_that_is_not_a_copy_is_never_replaced(tmp_path: Path) -> None:
    source = _checkout(tmp_path / "src")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(CompileError, match="not a compiled copy"):
        build_copy(source, precious, progress=False)
    assert (precious / "notes.txt").read_text() == "mine"
    with pytest.raises(CompileError, match="cannot be the checkout"):
        build_copy(source, tmp_path, progress=False)  # would contain the checkout
    with pytest.raises(CompileError, match="cannot be the checkout"):
        build_copy(source, source, progress=False)


def test_a_failed_build_says_where_its_log_is(tmp_path: Path) -> None:
    source = _checkout(tmp_path / "src")
    (source / "setup.py").write_text("raise SystemExit('no compiler here')\n")
    with pytest.raises(CompileError, match=r"failed \(exit 1\); see .*compile.log"):
        build_copy(source, tmp_path / "copy", progress=False)
    assert "no compiler here" in (tmp_path / "copy" / "compile.log").read_text()
    (source / "setup.py").write_text(SETUP)
    build_copy(source, tmp_path / "copy", progress=False)  # the failed copy is replaced
    assert "no compiler here" not in (tmp_path / "copy" / "compile.log").read_text()


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_a_copy_takes_its_compiled_modules_from_a_wheel_of_the_same_sources(
        tmp_path: Path) -> None:
    source = _checkout(tmp_path / "src")
    (source / "setup.py").write_text("raise SystemExit('compiled instead of taken')\n")
    wheel = _wheel(tmp_path / "pkg.whl", {
        "pkg/mod.py": b"VALUE = 1\n", BUILT.as_posix(): b"built by pip",
        "pkg-0.0.dist-info/RECORD": b""})
    out = build_copy(source, tmp_path / "copy", progress=False, wheel=wheel)
    assert (out / BUILT).read_bytes() == b"built by pip"
    assert (out / "pkg" / "mod.py").read_text() == "VALUE = 1\n"
    assert not (out / "pkg-0.0.dist-info").exists()  # only the extensions are taken
    assert (out / MARKER).read_text().strip() not in ("", "incomplete")


def test_a_wheel_of_other_sources_or_without_extensions_is_refused(tmp_path: Path) -> None:
    source = _checkout(tmp_path / "src")
    stale = _wheel(tmp_path / "stale.whl", {"pkg/mod.py": b"VALUE = 0\n",
                                             BUILT.as_posix(): b"built from VALUE = 0"})
    with pytest.raises(CompileError, match=r"not built from the sources .*pkg/mod.py"):
        build_copy(source, tmp_path / "copy", progress=False, wheel=stale)
    assert not (tmp_path / "copy" / BUILT).exists()
    pure = _wheel(tmp_path / "pure.whl", {"pkg/mod.py": b"VALUE = 1\n"})
    with pytest.raises(CompileError, match="holds no compiled module"):
        build_copy(source, tmp_path / "copy", progress=False, wheel=pure)
    (tmp_path / "junk.whl").write_text("not a zip")
    with pytest.raises(CompileError, match="not a readable wheel"):
        build_copy(source, tmp_path / "copy", progress=False, wheel=tmp_path / "junk.whl")


def test_compiled_modules_names_the_extension_modules_imported() -> None:
    import router.proxy.handlers as handlers

    compiled = compiled_modules()
    assert ("router.proxy.handlers" in compiled) == (
        handlers.__file__ is not None and not handlers.__file__.endswith(".py"))
