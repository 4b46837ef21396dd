"""The paper's claims as data: ``claims.toml`` beside this module, loaded and checked.

Each claim names the experiment that measures it and a rule for
:func:`kvcmas_bench.reproduce.rules.evaluate`; nothing in the code knows any claim by its id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import BenchError
from ..results.figures import FIGURES
from .rules import RuleError, check_rule

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REQUIRED = ("id", "words", "source", "paper", "setting", "experiment", "rule")
#: figures the facts readers derive beyond the registered ones (:mod:`kvcmas_bench.reproduce.facts`)
DERIVED_FIGURES = ("accuracy_seed_std", "effective_rank", "coverage", "relative_coverage")


@dataclass
class Claim:
    id: str
    words: str
    source: str
    paper: str
    setting: dict
    experiment: str
    rule: dict
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def rule_text(self) -> str:
        """The rule in one line, as the docs and the report print it."""
        r = self.rule
        keys = [k for k in r if k != "form" and not (k == "experiment" and r[k] == self.experiment)]
        return f"{r['form']}: " + ", ".join(f"{k}={_show(r[k])}" for k in keys)


def _show(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}={_show(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return str(v)


def known_figure(name: str) -> bool:
    return name in FIGURES or name in DERIVED_FIGURES or (name.startswith("energy_r") and name[8:].isdigit())


def load_claims(path: str | Path | None = None, experiments: set[str] | None = None) -> list[Claim]:
    """The claims of ``path`` (default: the packaged ``claims.toml``), every field checked: one
    ``BenchError`` line naming the claim and what is wrong."""
    if path is None:
        text = resources.files(__package__).joinpath("claims.toml").read_text(encoding="utf-8")
        where = "claims.toml"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BenchError(f"cannot read claims file {path}: {exc}") from None
        where = str(path)
    try:
        raw = tomllib.loads(text).get("claim", [])
    except tomllib.TOMLDecodeError as exc:
        raise BenchError(f"{where} is not valid TOML ({exc})") from None
    claims, seen = [], set()
    for i, c in enumerate(raw, 1):
        cid = c.get("id", f"#{i}")
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            raise BenchError(f"{where}: claim {cid} lacks {', '.join(missing)}")
        if cid in seen:
            raise BenchError(f"{where}: claim id {cid} appears twice")
        seen.add(cid)
        if experiments is not None and c["experiment"] not in experiments:
            raise BenchError(f"{where}: claim {cid} names unknown experiment {c['experiment']!r}")
        rule = dict(c["rule"])
        rule.setdefault("experiment", c["experiment"])
        try:
            check_rule(rule)
        except RuleError as exc:
            raise BenchError(f"{where}: claim {cid}: {exc}") from None
        figs = [rule.get("figure")] + [o.get("figure") for o in (rule.get("a"), rule.get("b")) if isinstance(o, dict)]
        bad = [f for f in figs if f is not None and not known_figure(f)]
        if (
            bad
            or rule.get("figure") is None
            and not any(isinstance(o, dict) and "figure" in o for o in (rule.get("a"), rule.get("b")))
        ):
            raise BenchError(
                f"{where}: claim {cid}: unknown or missing figure {', '.join(map(str, bad)) or ''}".rstrip()
            )
        rest = {k: v for k, v in c.items() if k not in (*REQUIRED, "note")}
        claims.append(
            Claim(
                cid,
                c["words"],
                c["source"],
                str(c["paper"]),
                dict(c["setting"]),
                c["experiment"],
                rule,
                c.get("note", ""),
                rest,
            )
        )
    if not claims:
        raise BenchError(f"{where} lists no [[claim]]")
    return claims


def select_claims(claims: list[Claim], ids: list[str] | None) -> list[Claim]:
    """The claims named by ``--claims`` (all when None); an unknown id is one error line."""
    if not ids:
        return claims
    known = {c.id for c in claims}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise BenchError(f"unknown claim(s) {', '.join(unknown)}; see `kvcmas-bench reproduce --list`")
    return [c for c in claims if c.id in ids]


def markdown_table(claims: list[Claim]) -> str:
    """One Markdown row per claim (docs/claims.md carries this table)."""

    def esc(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    lines = ["| claim | source | paper | experiment | rule |", "|---|---|---|---|---|"]
    for c in claims:
        lines.append(f"| `{c.id}` | {esc(c.source)} | {esc(c.paper)} | {c.experiment} | `{esc(c.rule_text)}` |")
    return "\n".join(lines)
