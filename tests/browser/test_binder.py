"""Binder's environment (binder/) against what the package and the chapters import.

Binder cannot be reached from CI, so these checks cover what can go wrong without it: a
chapter or klpen module importing a package that binder/environment.yml does not install, a
torch that could be a CUDA build, and pip being allowed to replace torch.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"

# Import name -> the conda-forge package of binder/environment.yml that provides it.
# klpen itself is installed by binder/postBuild.
PROVIDED_BY = {
    "torch": "pytorch-cpu",
    "numpy": "numpy",
    "matplotlib": "matplotlib-base",
    "IPython": "ipykernel",
    "transformers": "transformers",
    "klpen": None,
    "klpen_book": None,  # the book's laboratory, installed by binder/postBuild too
    "triton": None,  # optional: klpen's Triton backend, imported only where it is installed
}
# Registry hosts must not appear in committed files; Binder resolves channel and package names.
REGISTRY_HOSTS = ("pypi.org", "pythonhosted.org", "download.pytorch.org", "anaconda.org", "npmjs")


def environment() -> dict[str, Any]:
    env = yaml.safe_load((BINDER / "environment.yml").read_text())
    assert isinstance(env, dict)
    return env


def conda_packages() -> dict[str, str]:
    """Package name -> its version spec ('' if none), for the conda dependencies."""
    packages = {}
    for dep in environment()["dependencies"]:
        if isinstance(dep, str):
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", dep)
            assert match, dep
            packages[match.group(1)] = match.group(2)
    return packages


def top_level_imports(source: str) -> set[str]:
    # IPython magics and shell escapes are not Python.
    source = "\n".join(
        line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))
    )
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_by_book_and_package() -> dict[str, set[str]]:
    """Third-party top-level imports -> the files that import them."""
    sources = {p: p.read_text() for p in (ROOT / "src" / "klpen").rglob("*.py")}
    for notebook in sorted((ROOT / "book").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources[notebook] = "\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "code"
        )
    found: dict[str, set[str]] = {}
    for path, source in sources.items():
        for name in top_level_imports(source) - set(sys.stdlib_module_names):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_environment_is_conda_forge_only_with_cpu_torch() -> None:
    env = environment()
    assert env["channels"] == ["conda-forge"]
    packages = conda_packages()
    assert "pytorch-cpu" in packages
    # A bare `pytorch`/`torch` entry could resolve to a CUDA build; pip must not get torch.
    assert not {"pytorch", "torch", "pytorch-gpu"} & set(packages)
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    assert not any("torch" in line for section in pip_sections for line in section)


def test_python_version_matches_the_one_that_made_the_outputs() -> None:
    assert conda_packages()["python"] == f"={sys.version_info.major}.{sys.version_info.minor}"


def test_every_import_of_the_book_and_package_is_installed_by_binder() -> None:
    imports = imported_by_book_and_package()
    assert {"torch", "numpy"} <= set(imports)  # the scan itself works
    missing = {name: files for name, files in imports.items() if name not in PROVIDED_BY}
    assert missing == {}, "add these to binder/environment.yml and to PROVIDED_BY"
    packages = conda_packages()
    for name in imports:
        if PROVIDED_BY[name] is not None:
            assert PROVIDED_BY[name] in packages, name


def test_post_build_installs_klpen_alone_and_checks_torch() -> None:
    post_build = BINDER / "postBuild"
    assert os.access(post_build, os.X_OK)
    text = post_build.read_text()
    assert text.startswith("#!/bin/bash\n")
    install = [line for line in text.splitlines() if "pip install" in line]
    assert install == [
        "python -m pip install --no-cache-dir --no-deps -e .",
        "python -m pip install --no-cache-dir --no-deps -e src/klpen_book",
    ]
    assert "torch.version.cuda is None" in text


def test_no_registry_host_in_publishing_files() -> None:
    files = [*BINDER.iterdir(), *(ROOT / ".github").rglob("*.yml"), ROOT / "README.md"]
    for path in files:
        text = path.read_text()
        assert not [host for host in REGISTRY_HOSTS if host in text], path
