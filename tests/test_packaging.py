"""The wheel carries the CUDA sources inside the package (cupydecode/kernels/*.cu, *.cuh)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_COPY = {".git", "build", "dist", ".venv", "venv", ".pytest_cache", "__pycache__", ".whl", ".gl"}


def _build_backend_problem() -> str | None:
    """Why a wheel cannot be built here without network access, or None."""
    if not (ROOT / "pyproject.toml").is_file():
        return f"no pyproject.toml in {ROOT} (not running from a source checkout)"
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed (needed with --no-build-isolation)"
    major = int(setuptools.__version__.split(".")[0])
    if major < 64:
        return f"setuptools {setuptools.__version__} < 64"
    if major < 70:  # before 70.1, setuptools builds wheels through the separate `wheel` package
        try:
            import wheel  # noqa: F401
        except ImportError:
            return f"setuptools {setuptools.__version__} needs the `wheel` package, not installed"
    try:
        subprocess.run([sys.executable, "-m", "pip", "--version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return "pip is not available"
    return None


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory) -> Path:
    problem = _build_backend_problem()
    if problem:
        pytest.skip(f"cannot build a wheel: {problem}")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    # Build from a copy so the checkout gets no build/ or *.egg-info.
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if n in SKIP_COPY or n.endswith(".egg-info")])
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(out)],
        capture_output=True, text=True)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("cupydecode-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_kernel_sources(wheel_path):
    names = set(zipfile.ZipFile(wheel_path).namelist())
    repo_kernels = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert {"decode_split.cu", "merge_states.cu", "common.cuh"} <= set(repo_kernels)
    for name in repo_kernels:
        assert f"cupydecode/kernels/{name}" in names, sorted(names)
    for name in ("__init__.py", "_kernels.py", "_policy.py", "_validate.py", "decode.py", "reference.py"):
        assert f"cupydecode/{name}" in names, sorted(names)
    assert not any(n.startswith(("tests/", "kernels/")) for n in names), sorted(names)


def test_wheel_metadata(wheel_path):
    import cupydecode

    zf = zipfile.ZipFile(wheel_path)
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
    assert f"Version: {cupydecode.__version__}" in text
    assert "Requires-Python: >=3.10" in text
    for extra in ("cuda12", "cuda13", "nccl12", "nccl13", "test", "plot"):
        assert f"Provides-Extra: {extra}" in text, text
    entry = next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "cupydecode = cupydecode.cli:main" in zf.read(entry).decode()


def test_wheel_carries_licence_types_and_module_entry(wheel_path):
    zf = zipfile.ZipFile(wheel_path)
    names = set(zf.namelist())
    assert "cupydecode/py.typed" in names and "cupydecode/__main__.py" in names, sorted(names)
    meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License :: OSI Approved :: MIT License" in meta, meta
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names), names
    # names compared with _ as - (PEP 503): setuptools writes ml_dtypes or ml-dtypes by version
    requires = meta.replace(" ", "").lower().replace("_", "-")
    for bound in ("numpy>=1.24", "click>=8.0", "ml-dtypes>=0.3"):
        assert bound in requires, meta


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "cupydecode", "--version"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cupydecode, version "), proc.stdout
