"""Hostile HumanEval completions: none may fake a pass, read the harness user's files or copy what it
read into a record (issue 11, defect 2). The replies go through ``HumanEval.score``, as a model's
reply would, on a one-problem local data file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvcmas_bench.workloads.humaneval import HumanEval
from kvcmas_bench.workloads.sandbox import NOBODY, VERDICTS, file_reads_confined, run_check

PROMPT = 'def total(xs):\n    """Sum of xs.\n    >>> total([1, 2])\n    3\n    """\n'
TEST = (
    "def check(candidate):\n"
    "    assert candidate([1, 2]) == 3\n"
    "    assert candidate([5]) == 5\n"
    "    assert candidate([]) == 0\n"
)
ALWAYS_EQUAL = "    def __eq__(self, other):\n        return True\n\n"

FORGE = (
    "import os\nimport sys\n\n\n"
    "def _forge():\n"
    "    for fd in range(64):\n"
    "        try:\n"
    "            os.write(fd, b'passed')\n"
    "        except OSError:\n"
    "            pass\n"
    "    os._exit(0)\n"
)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    path = tmp_path_factory.mktemp("he") / "one.jsonl"
    path.write_text(json.dumps({"task_id": "T/0", "prompt": PROMPT, "test": TEST, "entry_point": "total"}) + "\n")
    (sample,) = HumanEval(data_path=str(path)).load()
    return HumanEval(data_path=str(path)), sample


def score(problem, code: str) -> tuple[str | None, bool]:
    workload, sample = problem
    return workload.score(sample, f"```python\n{code}```")


def test_a_correct_completion_passes_and_a_wrong_one_fails(problem):
    assert score(problem, "def total(xs):\n    return sum(xs)\n") == ("passed", True)
    assert score(problem, "def total(xs):\n    return 0\n") == ("failed: AssertionError", False)


@pytest.mark.parametrize(
    "code",
    [
        # the forgery: "passed" into the result pipe named in sys.argv[1], then leave at once
        "import os\nimport sys\n\n\ndef total(xs):\n    return 0\n\n\n"
        "_ = os.write(int(sys.argv[1]), b'passed') + os._exit(0)\n",
        # the same through every descriptor, from a top-level assignment (the entry point is never called)
        FORGE + "\n\ndef total(xs):\n    return 0\n\n\n_ = _forge()\n",
        # ... and from inside the entry function
        FORGE + "\n\ndef total(xs):\n    _forge()\n",
        # answers written ahead on every descriptor, then leave
        "import os\n\n\ndef total(xs):\n    for fd in range(64):\n        try:\n"
        '            os.write(fd, b\'{"ready": true}\\n{"ok": 3}\\n{"ok": 5}\\n{"ok": 0}\\npassed\\n\')\n'
        "        except OSError:\n            pass\n    os._exit(0)\n",
        # fake verdicts on stdout and stderr
        "import sys\n\n\ndef total(xs):\n    print('passed')\n    sys.stderr.write('passed\\n')\n    return None\n",
        # leaving "successfully"
        "def total(xs):\n    raise SystemExit(0)\n",
        "def total(xs):\n    return 0\n\n\n_ = exec('raise SystemExit(0)')\n",
        # an answer equal to everything
        f"class Any:\n{ALWAYS_EQUAL}\ndef total(xs):\n    return Any()\n",
        f"class Num(int):\n{ALWAYS_EQUAL}\ndef total(xs):\n    return Num(7)\n",
    ],
)
def test_forged_passes_fail(problem, code):
    result, ok = score(problem, code)
    assert not ok, result
    assert result != "passed" and result in VERDICTS


def test_answers_are_rebuilt_as_plain_data():
    test = (
        "def check(candidate):\n"
        "    assert candidate(1) == (1, [2.5, None], {'a': {3}}, b'x', True, 2**200, frozenset({1}), 1j)\n"
        "    assert type(candidate(1)[0]) is int and type(candidate(1)[4]) is bool\n"
    )
    code = "def f(x):\n    return (x, [2.5, None], {'a': {3}}, b'x', True, 2**200, frozenset({1}), 1j)\n"
    assert run_check(code, test, "f") == (True, "passed")
    wrong = code.replace("(x,", "([x],")
    assert run_check(wrong, test, "f")[0] is False


SECRET = "kvcmas-secret-4f1d"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


@pytest.mark.skipif(not file_reads_confined(), reason="needs Landlock, or root with a world-readable Python")
def test_the_completion_cannot_read_the_users_files(problem, secret_file):
    result, ok = score(problem, f"def total(xs):\n    open({str(secret_file)!r}).read()\n    return sum(xs)\n")
    assert not ok, result
    assert result in ("failed: PermissionError", "failed: OSError")


def test_failure_summaries_never_carry_what_the_completion_read_or_said(problem, secret_file):
    for code in (
        f"def total(xs):\n    raise ValueError('MARKER' + open({str(secret_file)!r}).read())\n",
        f"_ = open({str(secret_file)!r}).read()\n\n\ndef total(xs):\n    raise KeyError('MARKER' + _)\n",
        "def total(xs):\n    raise ValueError('MARKER' * 10000)\n",
    ):
        result, ok = score(problem, code)
        assert not ok and "MARKER" not in result and SECRET not in result, result
        assert result in VERDICTS


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_privileges_are_dropped_also_when_the_installation_is_private_to_root(tmp_path):
    """As root the child becomes ``nobody``; an installation below a directory private to root (as
    /root/.pyenv is) stays importable through a handle opened before the switch, and nothing else
    below that private directory becomes reachable."""
    probe = (
        "import os, sys\nfrom kvcmas_bench.workloads.sandbox import _drop_privileges\n"
        "sys.path.append(sys.argv[1] + '/lib')\n"
        "reached = _drop_privileges([sys.argv[1] + '/lib'])\n"
        "import probe_mod\n"
        "try:\n    open(sys.argv[1] + '/secret.txt').read(); secret = 'read'\n"
        "except PermissionError:\n    secret = 'denied'\n"
        "held = reached[0].startswith('/proc/')\n"
        "print(os.getuid(), os.getgid(), len(os.getgroups()), probe_mod.VALUE, secret, held)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def drop(root: Path) -> list[str]:
        (root / "lib").mkdir()
        (root / "lib" / "probe_mod.py").write_text("VALUE = 'imported'\n")
        (root / "secret.txt").write_text("s")
        os.chmod(root / "secret.txt", 0o600)
        os.chmod(root / "lib", 0o755), os.chmod(root / "lib" / "probe_mod.py", 0o644)
        cmd = [sys.executable, "-c", probe, str(root)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout.split()

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert drop(private) == [str(NOBODY), str(NOBODY), "0", "imported", "denied", "True"]
    with tempfile.TemporaryDirectory() as public:
        os.chmod(public, 0o755)
        if not all(os.stat(p).st_mode & stat.S_IXOTH for p in Path(public).parents):
            pytest.skip("the temporary directory is not searchable by others")
        os.chmod(public, 0o711)
        assert drop(Path(public)) == [str(NOBODY), str(NOBODY), "0", "imported", "denied", "False"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_the_completion_runs_as_nobody_when_the_harness_is_root(problem):
    """The candidate's uid, seen from inside: the check passes only where it is not 0."""
    code = f"import os\n\n\ndef total(xs):\n    return sum(xs) if os.getuid() == {NOBODY} else -1\n"
    assert score(problem, code) == ("passed", True)
