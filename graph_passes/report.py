"""The report: one JSON-serialisable object gathering what every pass did."""
from __future__ import annotations

import json


class Report:
    """Decisions per node, stats per pass, warnings and summary totals.

    * ``decisions[node] = {"dtype": ..., "list": ..., "reason": ..., ...}``
    * ``passes = [{"name", "time_s", "stats"}]`` in run order
    * ``warnings = [{"pass", "node", "message"}]``
    * ``summary``: totals that passes publish (low-precision FLOP share,
      casts inserted, TransData counts, activation bytes...)
    """

    def __init__(self):
        self.decisions: dict[str, dict] = {}
        self.passes: list[dict] = []
        self.warnings: list[dict] = []
        self.summary: dict = {}
        self.graph_name: str | None = None
        self.options: dict = {}

    def decide(self, node: str, **fields):
        self.decisions.setdefault(node, {}).update(fields)

    def warn(self, message: str, node: str | None = None, pass_name: str | None = None):
        entry = {"pass": pass_name, "node": node, "message": message}
        if entry not in self.warnings:
            self.warnings.append(entry)

    def pass_stats(self, name: str) -> dict:
        for p in reversed(self.passes):
            if p["name"] == name:
                return p["stats"]
        return {}

    def to_json(self) -> dict:
        return {
            "graph": self.graph_name,
            "options": self.options,
            "summary": self.summary,
            "passes": self.passes,
            "warnings": self.warnings,
            "decisions": self.decisions,
        }

    def dumps(self, **kw) -> str:
        return json.dumps(self.to_json(), default=_default, **kw)

    @classmethod
    def from_json(cls, data: dict) -> "Report":
        r = cls()
        r.graph_name = data.get("graph")
        r.options = data.get("options", {})
        r.summary = data.get("summary", {})
        r.passes = data.get("passes", [])
        r.warnings = data.get("warnings", [])
        r.decisions = data.get("decisions", {})
        return r

    def __repr__(self):
        return (f"Report({len(self.decisions)} decisions, {len(self.passes)} passes, "
                f"{len(self.warnings)} warnings, summary={self.summary})")


def _default(o):
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)
