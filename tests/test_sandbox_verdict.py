"""The HumanEval sandbox returns a verdict from a fixed vocabulary, never text either child chose
(issue 48): no exception message, class name of the completion's own, output or exit status of a
child reaches the ``prediction`` of a record, and a verdict outside the vocabulary is "failed:
other". Hostile completions get a secret (written literally, or read from a file they may read) and
try every way to get it into the result; the expected results are written out by hand."""

from __future__ import annotations

import builtins
import os
import signal
import sys
import tempfile
from types import SimpleNamespace

import pytest

from kvcmas_bench.workloads.sandbox import (
    OTHER,
    PASSED,
    TIMED_OUT,
    VERDICTS,
    CandidateError,
    _Candidate,
    _exception_name,
    _known_name,
    _outcome,
    run_check,
)

# letters and digits only, so that the old identifier filter would have let them through whole
SECRETS = ("kvcmasSecret4f1dA", "kvcmasSecret9e2cB")
PROMPT = 'def total(xs):\n    """Sum of xs."""\n'
TEST = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n"


@pytest.fixture(params=["literal", "file"])
def secret_source(request):
    """A function: secret -> a Python expression that yields it inside the completion, written into
    the completion ("literal") or read from a file the children may read ("file": a temporary file
    in the Python installation's prefix, which the sandbox lets them read)."""
    if request.param == "literal":
        yield repr
        return
    made: list[str] = []

    def from_file(secret: str) -> str:
        try:
            fd, path = tempfile.mkstemp(prefix=".kvcmas-test-secret-", dir=sys.prefix)
        except OSError:
            pytest.skip("the Python installation's prefix is not writable")
        made.append(path)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        os.chmod(path, 0o644)
        return f"open({path!r}).read()"

    yield from_file
    for path in made:
        os.unlink(path)


def check(code: str, test: str = TEST) -> str:
    """The result of checking ``code`` as the completion of ``total``; it must be a verdict."""
    ok, result = run_check(code, test, "total", prompt=PROMPT)
    assert result in VERDICTS, result
    assert ok is (result == PASSED)
    return result


def assert_no_secret(result: str, secret: str) -> None:
    assert secret not in result and "Secret" not in result and "Leak" not in result, result


# ---- the judge's exceptions: the test's own message may carry the completion's answer -------------
@pytest.mark.parametrize(
    "test, expected",
    [
        # the assertion message is the answer itself, or embeds str() of it
        ("def check(candidate):\n    assert candidate([1, 2]) == 3, candidate([1, 2])\n", "failed: AssertionError"),
        (
            "def check(candidate):\n    assert candidate([1, 2]) == 3, 'got ' + str(candidate([1, 2]))\n",
            "failed: AssertionError",
        ),
        # builtin exceptions whose message quotes the answer
        ("def check(candidate):\n    assert float(candidate([1, 2])) == 3.0\n", "failed: ValueError"),
        ("def check(candidate):\n    assert {3: 'ok'}[candidate([1, 2])] == 'ok'\n", "failed: KeyError"),
        ("def check(candidate):\n    assert [3].index(candidate([1, 2])) == 0\n", "failed: ValueError"),
    ],
)
def test_the_tests_messages_never_carry_the_answer(secret_source, test, expected):
    secret = SECRETS[0]
    result = check(f"def total(xs):\n    return {secret_source(secret)}\n", test)
    assert result == expected
    assert_no_secret(result, secret)


# ---- the candidate's exceptions: by builtin class only ------------------------------------------------
@pytest.mark.parametrize(
    "template, expected",
    [
        # a builtin exception with the secret as its message
        ("def total(xs):\n    raise AssertionError({s})\n", "failed: AssertionError"),
        ("_ = {s}\n\n\ndef total(xs):\n    raise KeyError(_)\n", "failed: KeyError"),
        # a class of its own, named after the secret: raised by the entry function, or at top level
        ("def total(xs):\n    raise type('Leak_' + {s}, (Exception,), {{}})()\n", "failed: other"),
        ("Leak = type('Leak_' + {s}, (ValueError,), {{}})\nraise Leak()\n", "failed: other"),
        # ... or named like a builtin one, in the completion's module or even put into builtins
        (
            "class AssertionError(Exception):\n    pass\n\n\ndef total(xs):\n    raise AssertionError({s})\n",
            "failed: other",
        ),
        (
            "import builtins\n\n\nclass KeyError(Exception):\n    pass\n\n\nbuiltins.KeyError = KeyError\n\n\n"
            "def total(xs):\n    raise KeyError({s})\n",
            "failed: other",
        ),
        # an exception name written straight into the answers pipe (the candidate's own process is
        # the completion's: it may send anything), for the call being answered
        (
            "import os\nimport sys\n\n\ndef total(xs):\n"
            "    os.write(int(sys.argv[3]), ('{{\"raise\": \"Leak_' + {s} + '\"}}\\n').encode())\n"
            "    os._exit(0)\n",
            "failed: other",
        ),
        (
            "import os\nimport sys\n\n\ndef total(xs):\n"
            "    os.write(int(sys.argv[3]), ('{{\"raise\": \"AssertionError: ' + {s} + '\"}}\\n').encode())\n"
            "    os._exit(0)\n",
            "failed: other",
        ),
    ],
)
def test_the_completions_exceptions_reach_the_result_as_a_builtin_class_name_only(secret_source, template, expected):
    secret = SECRETS[0]
    result = check(template.format(s=secret_source(secret)))
    assert result == expected
    assert_no_secret(result, secret)


# ---- output and exit: nothing of either reaches the result ------------------------------------------------
@pytest.mark.parametrize(
    "template, expected",
    [
        # the secret printed on stdout and stderr (also straight to the descriptors), a wrong answer
        (
            "import os\nimport sys\n\n\ndef total(xs):\n    s = {s}\n    print(s)\n    sys.stderr.write(s)\n"
            "    os.write(1, s.encode())\n    os.write(2, s.encode())\n    return 0\n",
            "failed: AssertionError",
        ),
        # ... then leave with an exit status, or a signal, that depends on the secret
        (
            "import os\nimport sys\n\n\ndef total(xs):\n    s = {s}\n    print(s)\n    sys.stderr.write(s)\n"
            "    os._exit(ord(s[-1]))\n",
            "failed: candidate ended",
        ),
        (
            "import signal\n\n\ndef total(xs):\n    s = {s}\n"
            "    signal.raise_signal((signal.SIGUSR1, signal.SIGTERM, signal.SIGSEGV)[ord(s[-1]) % 3])\n",
            "failed: candidate ended",
        ),
    ],
)
def test_output_and_exit_of_the_completion_never_reach_the_result(secret_source, template, expected):
    for secret in SECRETS:  # the same result whatever the secret
        result = check(template.format(s=secret_source(secret)))
        assert result == expected
        assert_no_secret(result, secret)


# ---- unit level: the judge's and the harness's checks of what a child sent -----------------------------
def test_exception_names_are_those_of_builtin_classes_only(monkeypatch):
    assert _exception_name(AssertionError("kvcmasSecret")) == "AssertionError"
    assert _exception_name(ZeroDivisionError()) == "ZeroDivisionError"
    assert _exception_name(KeyboardInterrupt()) == "KeyboardInterrupt"

    class AssertionError_(Exception):
        pass

    AssertionError_.__name__ = "AssertionError"
    assert _exception_name(AssertionError_()) == "other"
    assert _exception_name(type("Leak_kvcmasSecret", (Exception,), {})()) == "other"
    assert _exception_name(type("ValueError", (ValueError,), {})()) == "other"  # a subclass of a builtin
    monkeypatch.setattr(builtins, "KeyError", AssertionError_)
    assert _exception_name(AssertionError_()) == "other"  # rebinding builtins changes nothing
    monkeypatch.undo()

    assert _known_name("KeyError") == "KeyError"
    for forged in ("Leak_kvcmasSecret", "KeyError: kvcmasSecret", "other2", "", 7, None, ["KeyError"]):
        assert _known_name(forged) == "other"

    class Str(str):
        pass

    assert _known_name(Str("KeyError")) == "other"


@pytest.mark.parametrize(
    "line, verdict",
    [
        (b'{"raise": "Leak_kvcmasSecret"}\n', OTHER),
        (b'{"error": "AssertionError: kvcmasSecret"}\n', OTHER),
        (b'{"error": 7}\n', OTHER),
        (b'{"raise": "KeyError"}\n', "failed: KeyError"),
        (b'{"error": "NameError"}\n', "failed: NameError"),
        (b'{"kvcmasSecret": 1}\n', "failed: bad answer"),
        (b"kvcmasSecret\n", "failed: bad answer"),
    ],
)
def test_the_judge_accepts_only_verdicts_from_the_candidates_messages(line, verdict):
    answers_r, answers_w = os.pipe()
    calls_r, calls_w = os.pipe()
    os.write(answers_w, line)
    os.close(answers_w)
    candidate = _Candidate(answers_r, calls_w)  # the judge's stand-in, answered by ``line``
    try:
        with pytest.raises(CandidateError) as caught:
            candidate([1, 2])
        assert caught.value.verdict == verdict
    finally:
        candidate._answers.close()
        os.close(calls_r)
        os.close(calls_w)


def test_a_forged_judge_verdict_is_failed_other():
    ok, cpu, killed = (SimpleNamespace(returncode=rc) for rc in (0, -signal.SIGXCPU, -signal.SIGKILL))
    for forged in (
        "failed: AssertionError: kvcmasSecret",
        "failed: Leak_kvcmasSecret",
        "failed: other kvcmasSecret",
        "passed kvcmasSecret",
        "passed\nfailed",
        "timed out: kvcmasSecret",
        "kvcmasSecret",
    ):
        assert _outcome(forged, False, ok, ok) == (False, OTHER), forged
        assert _outcome(forged, False, ok, cpu) == (False, OTHER), forged
    assert _outcome("passed", False, ok, ok) == (True, PASSED)
    assert _outcome("passed", True, ok, ok) == (False, TIMED_OUT)
    assert _outcome("failed: AssertionError", False, ok, ok) == (False, "failed: AssertionError")
    assert _outcome("failed: bad answer", False, ok, ok) == (False, "failed: bad answer")
    # how a child ended is a fixed word, never its status or signal
    for rc in (0, 3, 65, -signal.SIGKILL, -signal.SIGUSR1, -signal.SIGSEGV):
        proc = SimpleNamespace(returncode=rc)
        assert _outcome("failed: candidate ended", False, proc, ok) == (False, "failed: candidate ended")
        assert _outcome("", False, ok, proc) == (False, "failed: judge ended")
    assert _outcome("failed: candidate ended", False, cpu, ok) == (False, TIMED_OUT)
    assert _outcome("", False, killed, cpu) == (False, TIMED_OUT)
    # every verdict of the vocabulary comes through as it is
    for verdict in VERDICTS - {PASSED}:
        assert _outcome(verdict, False, ok, ok) == (False, verdict)


def test_the_vocabulary_is_fixed():
    fixed = {PASSED, TIMED_OUT, OTHER, "failed: candidate ended", "failed: bad answer", "failed: judge ended"}
    assert fixed <= VERDICTS
    names = {v.removeprefix("failed: ") for v in VERDICTS - fixed}
    assert all(v.startswith("failed: ") for v in VERDICTS - {PASSED, TIMED_OUT})
    assert names == {n for n, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, BaseException)}
    assert {"AssertionError", "MemoryError", "SyntaxError", "RecursionError"} <= names
