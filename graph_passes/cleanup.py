"""Cleanup: remove dead nodes that passes inserted.

Preconditions: none.  Postconditions: no node named with a pass suffix
(``/CastTo*``, ``/TransData_*``, ``/Unfused*``, ``/Fused*``) is left without
consumers unless it is fetched or preserved.  Nodes the user built are never
removed, even when nothing reads them (they may be run by name).

    x -> a/CastToFp16 (no consumers)      =>      x
"""
from __future__ import annotations

from .manager import Pass, register_pass

INSERTED_MARKERS = ("/CastTo", "/TransData_", "/Unfused", "/Fused", "/Folded", "/ReadFp16Copy")


def is_inserted(name: str) -> bool:
    return any(m in name for m in INSERTED_MARKERS)


@register_pass("cleanup")
class Cleanup(Pass):
    def run(self, graph, ctx):
        removed = 0
        changed = True
        while changed:
            changed = False
            for name in list(graph.nodes):
                if name in ctx.protected or not is_inserted(name):
                    continue
                if not graph.consumers(name):
                    graph.remove_node(name)
                    removed += 1
                    changed = True
        return {"removed": removed}
