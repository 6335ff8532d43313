"""Cleanup: remove dead nodes that passes inserted.

Preconditions: the graph object is the one the passes of this pipeline run
edited (``Graph.created`` names the nodes they added).

Postconditions: no node added by this run's passes (``Graph.created``) is
left without consumers unless it is fetched, preserved or stateful.  Nodes
that were in the graph before the run are never removed, even when nothing
reads them and whatever their name (a user's ``.../Fused...`` or
``.../CastTo...`` node may be run by name).

    x -> a/CastToFp16 (added by the precision pass, no consumers)      =>      x
"""
from __future__ import annotations

from . import registry
from .manager import Pass, register_pass


@register_pass("cleanup")
class Cleanup(Pass):
    keeps_deferred = True  # resolves them before its first removal
    tracks_edits = True  # removes nodes only

    def run(self, graph, ctx):
        removed = 0
        changed = True
        while changed:
            changed = False
            for name in graph.created_in_order():
                if name in ctx.protected or graph.consumers(name):
                    continue
                od = registry.op_def(graph.nodes[name].op)
                if od is not None and od.is_stateful:
                    continue
                if ctx.report.pending:
                    ctx.report.resolve()
                graph.remove_node(name)
                removed += 1
                changed = True
        return {"removed": removed}
