"""Checks klpen as installed from its wheel (``make wheel-test`` runs this in a fresh venv).

Run as ``python -I tests/wheel_smoke.py SOURCE_DIR`` with the venv's interpreter, from a directory
outside the source tree: ``-I`` keeps the script's folder, the working directory and
``PYTHONPATH`` off ``sys.path``, so ``import klpen`` can only find the installed package. Then:

1. klpen is imported from the venv's site-packages, and no folder on ``sys.path`` holds a
   source tree's ``klpen``;
2. every module and data file of ``SOURCE_DIR/src/klpen`` is in the installed package, and the
   installed version is the one ``_version.py`` states;
3. a smoke test: the public surface imports and computes what the contract says;
4. the doctests of every installed klpen module pass (pytest, warnings as errors).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import sysconfig
import tempfile
from pathlib import Path


def _check_location() -> Path:
    import klpen

    installed = Path(klpen.__file__).resolve().parent
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert installed.parent == site, f"klpen imported from {installed}, not from {site}"
    for entry in sys.path:
        if entry and (Path(entry) / "klpen" / "__init__.py").is_file():
            assert Path(entry).resolve() == site, f"a klpen source tree is on sys.path: {entry}"
    return installed


def _check_files(installed: Path, source: Path) -> None:
    wanted = {
        p.relative_to(source).as_posix()
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".typed"}
    }
    have = {p.relative_to(installed).as_posix() for p in installed.rglob("*") if p.is_file()}
    missing = sorted(wanted - have)
    assert not missing, f"files of src/klpen missing from the wheel: {missing}"
    namespace: dict[str, str] = {}
    exec((source / "_version.py").read_text(), namespace)
    version = namespace["__version__"]
    assert importlib.metadata.version("klpen") == version, importlib.metadata.version("klpen")
    import klpen

    assert klpen.__version__ == version, f"klpen.__version__ is {klpen.__version__}, not {version}"


def _smoke() -> None:
    import torch

    import klpen

    assert klpen.kl_penalty([-1, -2], [-1.5, -2.5], 0.1) == 0.05
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(11, (2, 5))
    logp = klpen.get_logprobs_for_tokens(logits, tokens)
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(logp, expected)
    logp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    reference = torch.randn(2, 5, 11, dtype=torch.float64)
    p = torch.softmax(logits.detach(), -1)
    exact = (p * (torch.log_softmax(logits.detach(), -1) - torch.log_softmax(reference, -1))).sum(
        -1
    )
    torch.testing.assert_close(klpen.full_kl(logits.detach(), reference), exact)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert klpen.aggregate(torch.ones(2, 5), mask, "token-sum").item() == 8.0
    for name in klpen.__all__:
        assert hasattr(klpen, name), name
    importlib.import_module("klpen.distributed")
    importlib.import_module("klpen.gradients")


def _doctests(installed: Path) -> None:
    import pytest

    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text(
            "[pytest]\n"
            "addopts = --doctest-modules -p no:cacheprovider -p no:randomly\n"
            "doctest_optionflags = NORMALIZE_WHITESPACE ELLIPSIS\n"
            "filterwarnings = error\n"
        )
        code = pytest.main(["-q", "-c", str(ini), "--rootdir", tmp, str(installed)])
    assert code == 0, f"doctests of the installed klpen failed (pytest exit code {code})"


def main(source_dir: str) -> None:
    installed = _check_location()
    _check_files(installed, Path(source_dir).resolve() / "src" / "klpen")
    _smoke()
    _doctests(installed)
    version = importlib.metadata.version("klpen")
    print(f"klpen {version} as installed from the wheel: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
