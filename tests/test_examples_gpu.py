"""The examples in examples/ run as a user would run them (each in its own process) and check
their own result against the float64 reference. Skipped without a GPU, or without the example's
optional package (JAX), which is never a dependency of cupydecode."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent


def _run_example(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_serving_loop_example(cupy):
    assert "relative error of the last step" in _run_example("serving_loop.py")


@pytest.mark.heavy
def test_speculative_verify_example(cupy):
    assert "relative error of the last step" in _run_example("speculative_verify.py")


def test_jax_interop_example(cupy):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed (an optional package for this example only)")
    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        pytest.skip("JAX has no CUDA plugin here (it would make host arrays)")
    assert "flash_decode on JAX arrays" in _run_example("jax_interop.py")


@pytest.mark.torch
@pytest.mark.heavy
def test_transformers_example(cupy):
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (an optional package for this example only)")
    assert "logits within" in _run_example("transformers_decode.py")
