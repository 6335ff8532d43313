"""The report: one JSON-serialisable object gathering what every pass did."""
from __future__ import annotations

import json
import threading

#: (issue 17t) serialises the resolution of deferred decisions (a report
#: read from another thread while it is being resolved)
_DECISIONS_LOCK = threading.Lock()


class Report:
    """Decisions per node, stats per pass, warnings and summary totals.

    * ``decisions[node] = {"dtype": ..., "list": ..., "reason": ..., ...}``
    * ``passes = [{"name", "time_s", "cpu_s", "stats"}]`` in run order (``time_s`` wall,
      ``cpu_s`` the running thread's CPU time)
    * ``warnings = [{"pass", "node", "message"}]``
    * ``summary``: totals that passes publish (low-precision FLOP share,
      casts inserted, TransData counts, activation bytes...)

    Figures that cost a graph walk over static shapes (the precision pass's
    FLOP share and activation/peak estimates) may be *deferred*
    (:meth:`defer`): they are computed the first time ``summary`` is read
    (``to_json``, ``dumps``, ``pass_stats``, a test, the CLI), not inside
    grappler when nobody reads them.  Writers that must not trigger them use
    :attr:`raw_summary`.

    Decisions may be deferred too (:meth:`defer_decisions`, issue 17t: the
    precision pass's per-node entries, written from its arrays): they are
    written the first time :attr:`decisions` is read; a :meth:`decide` made
    while some are deferred is queued behind them, so the entries, their
    fields and their order are those of writing everything at once.
    """

    def __init__(self):
        self._decisions: dict[str, dict] = {}
        self._dec_pending: list = []
        self.passes: list[dict] = []
        self.warnings: list[dict] = []
        self._summary: dict = {}
        self._pending: list = []
        #: compute deferred figures at once (the behaviour before deferral)
        self.eager = False
        self.graph_name: str | None = None
        self.options: dict = {}

    # ------------------------------------------------------ deferred figures
    @property
    def summary(self) -> dict:
        """The summary, with every deferred figure computed."""
        if self._pending:
            self.resolve()
        return self._summary

    @summary.setter
    def summary(self, value: dict):
        self._summary = value

    @property
    def raw_summary(self) -> dict:
        """The summary as it is now, without computing deferred figures."""
        return self._summary

    @property
    def pending(self) -> bool:
        """Whether some figures are still deferred."""
        return bool(self._pending)

    def defer(self, fn):
        """Register ``fn(report)``, run (once, in registration order) the first
        time the summary is read; it writes its figures into ``raw_summary``."""
        if self.eager:
            fn(self)
        else:
            self._pending.append(fn)

    def discard_pending(self, why: str):
        """Forget the deferred figures (and the graphs they hold), noting ``why``."""
        if self._pending:
            self._pending.clear()
            self._summary["deferred_figures_dropped"] = why

    def resolve(self):
        """Compute every deferred figure now."""
        while self._pending:
            self._pending.pop(0)(self)

    # ------------------------------------------------------------ decisions
    @property
    def decisions(self) -> dict:
        """``{node: {field: value}}``, with every deferred decision written."""
        if self._dec_pending:
            self._resolve_decisions()
        return self._decisions

    @decisions.setter
    def decisions(self, value: dict):
        self._dec_pending = []
        self._decisions = value

    def defer_decisions(self, fn):
        """Register ``fn(decisions)``, run (once, in registration order with
        the :meth:`decide` calls queued after it) the first time
        :attr:`decisions` is read; it writes entries as ``decide`` would
        (``decisions.setdefault(node, {}).update(fields)``)."""
        if self.eager:
            fn(self._decisions)
        else:
            self._dec_pending.append(fn)

    def _resolve_decisions(self):
        with _DECISIONS_LOCK:
            pending = self._dec_pending
            while pending:
                pending[0](self._decisions)
                pending.pop(0)  # (after it ran: a reader in another thread waits on the lock)

    def decide(self, node: str, **fields):
        if self._dec_pending:  # (behind the deferred ones: the same order)
            self._dec_pending.append(lambda d: d.setdefault(node, {}).update(fields))
        else:
            self._decisions.setdefault(node, {}).update(fields)

    def warn(self, message: str, node: str | None = None, pass_name: str | None = None):
        entry = {"pass": pass_name, "node": node, "message": message}
        if entry not in self.warnings:
            self.warnings.append(entry)

    def pass_stats(self, name: str) -> dict:
        if self._pending:
            self.resolve()
        for p in reversed(self.passes):
            if p["name"] == name:
                return p["stats"]
        return {}

    def to_json(self) -> dict:
        if self._pending:
            self.resolve()
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
        if self._pending:
            self.resolve()
        return (f"Report({len(self.decisions)} decisions, {len(self.passes)} passes, "
                f"{len(self.warnings)} warnings, summary={self.summary})")


def _default(o):
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)
