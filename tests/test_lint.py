"""ruff lint and format check of the whole tree (configured in pyproject.toml), as CI runs it, with the
size rules of CONTRIBUTING.md on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["kvcmas_bench", "tests", "benchmarks"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: run `bash scripts/setup.sh` (it installs the dev extras)")
    return [exe]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_clean(args):
    proc = subprocess.run(_ruff() + args + TARGETS, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_size_rules_flag_a_long_parameter_list_and_a_tangled_function(tmp_path):
    args = ", ".join(f"a{i}" for i in range(11))
    branches = "".join(f"    if a0 > {i}:\n        a1 += {i}\n" for i in range(16))
    probe = tmp_path / "probe.py"
    probe.write_text(f"def too_many({args}):\n    return a0\n\n\ndef tangled(a0, a1):\n{branches}    return a1\n")
    cmd = [*_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise"]
    proc = subprocess.run([*cmd, str(probe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PLR0913" in proc.stdout and "(11 > 10)" in proc.stdout and "C901" in proc.stdout, proc.stdout
