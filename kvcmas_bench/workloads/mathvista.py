"""MathVista (testmini) on LLaVA-OneVision with the GSM8K role structure adapted to the image.

Data: by default (or with ``--data-path hub`` / ``hub:REPO``) the ``testmini`` split of
``AI4Math/MathVista`` through ``datasets`` (online or from the local HF cache). ``--data-path DIR``
loads a local snapshot of that hub repo (``datasets.load_dataset(DIR, split="testmini")``);
``--data-path FILE.json|.jsonl`` reads MathVista annotations (a list, or the hub's
``annot_testmini.json`` dict keyed by pid) whose ``image`` paths are relative to the file.

Every sample's image goes through LLaVA-OneVision's any-resolution path as the shared visual PH
segment; the PH_q text is MathVista's own ``query`` (hint + question + choices). Scoring follows
MathVista's normalization per ``question_type`` / ``answer_type``: the option letter for
``multi_choice`` (a reply naming the option's text also counts), otherwise the integer, the float
rounded to ``precision`` decimals, the list, or the case-folded text. The answer is extracted by
rules (``The answer is X`` / ``\\boxed{}`` / last value), not by the GPT-4 extractor of the paper.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import BenchError
from .base import DataRow, Role, Workload, first_line, indexed_rows, jsonl_rows, load_hub, register
from .gsm8k import _boxed, extract_number, normalize_number
from .visual import VisualContent, VisualSample

REPO = "AI4Math/MathVista"
SPLIT = "testmini"
LETTERS = "ABCDEFGHIJ"

_FORMAT = (
    "End your reply with the line: The answer is X, where X is the option letter for a "
    "multiple-choice question and otherwise the final value (a number, list or short phrase) "
    "without units."
)

ROLES = (
    Role(
        "Math Solver",
        "You are a math expert. You solve math problems about an image step by step, reading the "
        "values you need from the image and using the hints of other agents when they are given.",
        "Solve the problem step by step using the image. " + _FORMAT,
    ),
    Role(
        "Mathematical Analyst",
        "You are a mathematical analyst. You describe the quantities shown in the image with "
        "variables, then substitute their values to compute the result.",
        "Describe the quantities in the image with variables, check the reasoning above, then "
        "substitute the values and compute the result. " + _FORMAT,
    ),
    Role(
        "Programming Expert",
        "You are a programming expert. You solve math problems about an image by combining "
        "step-by-step reasoning with short Python code.",
        "Write a short Python function without arguments that computes and returns the answer from "
        "the values in the image, and state the value it returns. " + _FORMAT,
    ),
)

FINAL = Role(
    "FinalRefer",
    "You are the final decision maker. You read the solutions of other agents and give the "
    "final answer to a math problem about an image.",
    "Based on the image, the problem and the solutions above, decide the correct final answer. "
    "Reply briefly and end with the line: The answer is X, where X is the option letter for a "
    "multiple-choice question and otherwise a single value without units.",
)

_CUE = re.compile(r"answer\s*(?:is|was|would be|will be|[:=])", re.IGNORECASE)
_LETTER = re.compile(r"^\(?\s*([A-J])\s*(?:\)|\.|:|$|\s)")


def build_query(question: str, choices: list[str] | None, hint: str | None = None) -> str:
    """MathVista-style prompt text when a row has no ``query``."""
    hint = hint or (
        "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
        if choices
        else "Please answer the question and provide the final answer at the end."
    )
    text = f"Hint: {hint}\nQuestion: {question.strip()}"
    if choices:
        text += "\nChoices:\n" + "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(choices))
    return text


def final_answer(text: str) -> str:
    """The answer span of a reply: the latest ``\\boxed{}`` or ``answer is`` cue, else the last line."""
    cues = [(pos, content) for pos, content in _boxed(text)]
    for m in _CUE.finditer(text):
        span = text[m.end() :].strip().split("\n")[0]
        cues.append((m.start(), span))
    if cues:
        span = max(cues)[1]
    else:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        span = lines[-1] if lines else ""
    return span.strip().strip("*").strip().rstrip(".").strip().strip("\"'`$").strip()


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", " ", str(s).strip().strip(".").lower())


def _num(s) -> float | None:
    n = normalize_number(str(s))
    if n is None:
        n = extract_number(str(s))
    try:
        return float(n) if n is not None else None
    except ValueError:
        return None


def normalize(value, answer_type: str, precision: int | None) -> str | None:
    """MathVista's answer normalization: int / rounded float / list / text."""
    if value is None:
        return None
    if answer_type == "integer":
        x = _num(value)
        return str(int(x)) if x is not None else None  # MathVista: str(int(float(x)))
    if answer_type == "float":
        x = _num(value)
        return f"{round(x, int(precision or 0)):.{int(precision or 0)}f}" if x is not None else None
    if answer_type == "list":
        m = re.findall(r"\[([^\[\]]*)\]", str(value))
        body = m[-1] if m else str(value)
        nums = [normalize_number(t) for t in re.split(r"[,;\s]+", body) if t.strip()]
        return "[" + ", ".join(n if n is not None else "?" for n in nums) + "]" if nums else None
    return _norm_text(value) or None


def choice_letter(span: str, full: str, choices: list[str]) -> str | None:
    """Option letter named by a reply: a letter, or an option's text."""
    valid = LETTERS[: len(choices)]
    m = _LETTER.match(span)
    if m and m.group(1) in valid:
        return m.group(1)
    span_n = _norm_text(span)
    for i, c in enumerate(choices):
        if span_n and span_n == _norm_text(c):
            return valid[i]
    x = _num(span) if span else None
    if x is not None:
        for i, c in enumerate(choices):
            y = _num(c)
            if y is not None and abs(x - y) < 1e-9 and normalize_number(str(c)) is not None:
                return valid[i]
    for pat in (r"answer\s*(?:is|:)\s*\(?([A-J])\b", r"\(([A-J])\)", r"\b([A-J])\b"):
        for m2 in reversed(list(re.finditer(pat, full))):
            if m2.group(1) in valid:
                return m2.group(1)
    return None


@register
class MathVista(Workload):
    name = "mathvista"
    summary = "MathVista testmini math on images (AI4Math/MathVista), GSM8K roles adapted to the image"
    modality = "image"
    roles = ROLES
    final_role = FINAL
    default_tau = 0.50
    max_new_tokens = 128
    final_max_new_tokens = 64

    def load(self) -> list:
        dp = self.data_path
        if dp is None or dp.startswith("hub"):
            repo = (dp.partition(":")[2] if dp else "") or REPO
            return self._from_dataset(self._load_hub(repo), repo)
        p = Path(dp).expanduser()
        if p.is_dir():
            return self._from_dataset(self._load_hub(str(p)), str(p))
        if p.is_file():
            return self._from_rows(self._read_annotations(p), p.parent)
        raise BenchError(
            f"MathVista data not found: {dp} (use a local snapshot of {REPO}, an annotation "
            f".json/.jsonl file, or 'hub')"
        )

    # ---- sources ---------------------------------------------------------------------------
    @staticmethod
    def _load_hub(repo: str):
        return load_hub(repo, split=SPLIT, what=f"MathVista ({repo}, split {SPLIT})")

    @staticmethod
    def _read_annotations(path: Path) -> list[DataRow]:
        """The annotation rows of a .jsonl (by line) or .json file (a list by index, or the hub's
        ``annot_testmini.json`` dict keyed by pid)."""
        if path.suffix == ".jsonl":
            return jsonl_rows(path, "MathVista annotations", "MathVista")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BenchError(f"cannot read MathVista annotations {path}: {first_line(exc)}") from None
        if isinstance(data, dict):
            rows = []
            for i, (pid, v) in enumerate(data.items()):
                row = DataRow(v, "MathVista", i, f"{path}, pid {pid}")
                rows.append(DataRow({**v, "pid": v.get("pid", pid)}, "MathVista", i, row.where))
            return rows
        if not isinstance(data, list):
            raise BenchError(f"MathVista annotations {path} must be a list or a dict keyed by pid")
        return indexed_rows(data, "MathVista", path)

    def _from_dataset(self, ds, where: str) -> list:
        cols = set(getattr(ds, "column_names", []) or [])
        if "decoded_image" not in cols:
            raise BenchError(f"{where} has no decoded_image column (not a MathVista dataset)")
        rows = ds.remove_columns(["decoded_image"]) if hasattr(ds, "remove_columns") else ds

        def loader(i: int):
            return lambda: [ds[i]["decoded_image"]]

        return [self._sample(row, loader(row.index)) for row in indexed_rows(rows, "MathVista", where)]

    def _from_rows(self, rows: list[DataRow], root: Path) -> list:
        def loader(rel: str):
            def load():
                from PIL import Image

                path = (root / rel) if not Path(rel).is_absolute() else Path(rel)
                try:
                    with Image.open(path) as im:
                        return [im.convert("RGB")]
                except OSError as exc:
                    raise BenchError(f"cannot open MathVista image {path}: {exc}") from None

            return load

        return [self._sample(row, loader(row.text("image"))) for row in rows]

    def _sample(self, row: DataRow, images):
        pid = row.scalar("pid", required=False) or str(row.index)
        qtype = row.text("question_type")
        atype = row.text("answer_type", required=False, empty=True) or "text"
        choices = row.strings("choices", required=False) or None
        precision = row.get("precision", int, float, str, required=False)
        if precision in ("", None):
            precision = None
        else:
            try:
                precision = int(float(precision))
            except ValueError:
                raise row.error(f"field 'precision' must be an integer, got {precision!r}") from None
        answer = row.scalar("answer")
        if qtype == "multi_choice":
            if not choices or answer not in choices:
                raise row.error("multi_choice answer is not one of the choices")
            gold = LETTERS[choices.index(answer)]
        else:
            gold = normalize(answer, atype, precision)
            if gold is None:
                raise row.error(f"cannot normalize answer {answer!r} as {atype}")
        query = row.text("query", required=False, empty=True) or build_query(row.text("question"), choices)
        key = f"mathvista:{pid}"
        meta = {
            "pid": pid,
            "question_type": qtype,
            "answer_type": atype,
            "precision": precision,
            "choices": choices,
            "answer": answer,
            "image": row.data.get("image"),
        }
        return VisualSample(
            id=f"mathvista-{pid}",
            query=query.strip(),
            gold=gold,
            meta=meta,
            visual=lambda: VisualContent("image", images(), key=key),
            visual_key=key,
        )

    def score(self, sample, output: str) -> tuple[str | None, bool]:
        meta = sample.meta
        span = final_answer(output)
        if meta["question_type"] == "multi_choice":
            pred = choice_letter(span, output, meta["choices"] or [])
        else:
            atype = meta["answer_type"]
            value = span
            if atype in ("integer", "float"):
                value = extract_number(span) or extract_number(output)
            elif atype == "list" and "[" not in span and "[" in output:
                value = output
            pred = normalize(value, atype, meta.get("precision"))
        return pred, self.judge(pred, sample.gold)
