"""`hpclb diagnose`'s output: the findings for a terminal (rich) or as JSON.

The JSON is GET /api/v1/diagnose's body: {"findings": [...], "time": float};
`from_json` reads it back, so the CLI renders what the API answered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hpclb.faces.diagnose import SEVERITIES, Finding

STYLES = {"ok": "green", "info": "cyan", "warning": "bold yellow", "critical": "bold red"}


def to_json(findings: Sequence[Finding], at: float) -> dict[str, Any]:
    return {"findings": [f.to_dict() for f in findings], "time": at}


def dumps(findings: Sequence[Finding], at: float) -> str:
    return json.dumps(to_json(findings, at), indent=1, default=str)


def from_json(body: Mapping[str, Any]) -> list[Finding]:
    """The findings of an API answer; a malformed entry raises ValueError."""
    out: list[Finding] = []
    for raw in body.get("findings", []):
        if not isinstance(raw, Mapping) or raw.get("severity") not in SEVERITIES:
            raise ValueError(f"not a finding: {raw!r}")
        out.append(Finding(severity=raw["severity"], area=str(raw.get("area", "")),
                           title=str(raw.get("title", "")), meaning=str(raw.get("meaning", "")),
                           next=str(raw.get("next", "")),
                           evidence=dict(raw.get("evidence") or {})))
    return out


def summary(findings: Sequence[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in SEVERITIES}
    return ", ".join(f"{counts[s]} {s}" for s in reversed(SEVERITIES))


def render(findings: Sequence[Finding], console: Console, *, verbose: bool = False) -> None:
    """One table: severity (coloured), area, title, and for each finding that is
    not ok what it likely means and what to check next; evidence with verbose."""
    table = Table(show_lines=True, title="hpclb diagnose", caption=summary(findings))
    table.add_column("severity", no_wrap=True)
    table.add_column("area", no_wrap=True)
    table.add_column("finding", ratio=1)
    for f in findings:
        body = Text(f.title, style="bold" if f.severity != "ok" else "")
        if f.meaning:
            body.append("\n" + f.meaning)
        if f.next:
            body.append("\nnext: ", style="italic")
            body.append(f.next)
        if verbose and f.evidence:
            body.append("\n" + json.dumps(f.evidence, default=str, sort_keys=True),
                        style="dim")
        table.add_row(Text(f.severity, style=STYLES[f.severity]), f.area, body)
    console.print(table)

