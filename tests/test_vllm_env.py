"""The install trap of the vllm extra: PyPI's torchvision beside vLLM's CPU torch does not
load, and vLLM then dies with `operator torchvision::nms does not exist`. kvheat's vLLM
integration and `python -m kvheat.integrations.vllm_env` say in one line what to run.
A real broken package (its import raises as the real one does) on the path of a real
subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def _run(args: list[str], path: Path | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture
def broken_torchvision(tmp_path: Path) -> Path:
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    return tmp_path


def test_the_check_names_the_package_and_the_command(broken_torchvision: Path) -> None:
    r = _run(["-m", "kvheat.integrations.vllm_env"], broken_torchvision)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert "torchvision" in line and FIX in line and "nms" in line


@pytest.mark.vllm
def test_a_healthy_environment_passes() -> None:
    pytest.importorskip("vllm")
    r = _run(["-m", "kvheat.integrations.vllm_env"], None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


@pytest.mark.vllm
def test_the_integration_import_says_what_to_run(broken_torchvision: Path) -> None:
    pytest.importorskip("vllm")
    r = _run(["-c", "import kvheat.integrations.vllm"], broken_torchvision)
    assert r.returncode == 1
    assert "BrokenTorchExtras" in r.stderr and FIX in r.stderr.strip().splitlines()[-1]
