"""The release artefacts: the wheel holds the library and nothing else, with the right metadata.

``make wheel-test`` installs the wheel into a fresh venv and tests it there
(tests/wheel_smoke.py); this file checks what the wheel and the sdist hold.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "src" / "klpen" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_version_is_semver_and_written_once() -> None:
    version = _version()
    assert [part.isdigit() for part in version.split(".")] == [True, True, True], version
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and version not in pyproject
    assert f"## [{version}]" in (ROOT / "CHANGELOG.md").read_text()


def test_wheel_holds_only_klpen(dist: Path) -> None:
    version = _version()
    (wheel,) = dist.glob("klpen-*.whl")
    assert wheel.name == f"klpen-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    info = f"klpen-{version}.dist-info/"
    strays = [n for n in names if not (n.startswith("klpen/") or n.startswith(info))]
    assert not strays, f"the wheel holds files outside klpen/ and {info}: {strays}"
    # Every module and data file of src/klpen is in it (the book's package, klpen_book, is not).
    source = ROOT / "src" / "klpen"
    wanted = {
        "klpen/" + p.relative_to(source).as_posix()
        for p in source.rglob("*")
        if p.is_file() and p.suffix in {".py", ".typed"} and "__pycache__" not in p.parts
    }
    assert wanted <= set(names), sorted(wanted - set(names))
    assert "klpen/py.typed" in names and "klpen/_version.py" in names


def test_wheel_metadata(dist: Path) -> None:
    (wheel,) = dist.glob("klpen-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        meta = Parser().parsestr(zf.read(f"klpen-{_version()}.dist-info/METADATA").decode())
    assert meta["Name"] == "klpen" and meta["Version"] == _version()
    requires = meta.get_all("Requires-Dist")
    assert "torch>=2.4" in requires and "numpy>=1.24" in requires
    assert set(meta.get_all("Provides-Extra")) == {"plot", "triton"}
    assert 'triton>=3.9; extra == "triton"' in requires
    assert 'matplotlib>=3.7; extra == "plot"' in requires


def test_sdist_builds_the_same_package(dist: Path) -> None:
    (sdist,) = dist.glob("klpen-*.tar.gz")
    prefix = f"klpen-{_version()}/"
    names = tarfile.open(sdist).getnames()
    for needed in ("pyproject.toml", "README.md", "src/klpen/_version.py", "src/klpen/py.typed"):
        assert prefix + needed in names, needed
