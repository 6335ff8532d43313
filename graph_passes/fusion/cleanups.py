"""graph_level 1: cleanups that cut Cast and Identity nodes without changing a value.

* ``identity_chain``  Identity(Identity(x))              -> Identity(x)
* ``cast_chain``      Cast(Cast(x, A->B), B->C), A->B exact widening
                                                          -> Cast(x, A->C), or Identity(x) when A == C
* ``cast_sink``       Cast(M(Cast(x, A->B)), B->A), A->B exact widening, M data movement
                                                          -> M(x) in A (the cast is sunk through M
                                                             until it meets its inverse; both vanish)
* duplicate Casts of one tensor to one dtype are merged (:func:`merge_duplicate_casts`).

A narrowing pair (fp32 -> fp16 -> fp32) is never removed: it rounds on purpose.
"""
from __future__ import annotations

from .. import registry
from ..pattern import Pat
from .core import register_fusion_rule

#: (SrcT, DstT) casts that lose nothing
EXACT_WIDENING = frozenset({
    (registry.DT_HALF, registry.DT_FLOAT), (registry.DT_BFLOAT16, registry.DT_FLOAT),
    (registry.DT_HALF, registry.DT_DOUBLE), (registry.DT_BFLOAT16, registry.DT_DOUBLE),
    (registry.DT_FLOAT, registry.DT_DOUBLE),
})

#: single-data-input ops that move data without computing on it (input 0, type attr T)
DATA_MOVEMENT = ("Reshape", "Transpose", "ExpandDims", "Squeeze", "Identity", "StridedSlice",
                 "Slice", "Tile", "Pad", "GatherV2", "SpaceToDepth", "DepthToSpace")


def _no_truncate(node, graph):
    return not node.attr["Truncate"].b if "Truncate" in node.attr else True


def _build_identity_chain(m, b):
    b.emit("Identity", m.anchor, [m["x"]], {"T": b.anchor.attr["T"]})


def _build_cast_chain(m, b):
    inner, outer = m["inner"], b.anchor
    a, mid, c = inner.attr["SrcT"].type, inner.attr["DstT"].type, outer.attr["DstT"].type
    b.require((a, mid) in EXACT_WIDENING, f"first cast {registry.dtype_name(a)}->"
              f"{registry.dtype_name(mid)} is not an exact widening")
    if a == c:
        b.emit("Identity", m.anchor, [m["x"]], {"T": ("type", a)})
    else:
        b.emit("Cast", m.anchor, [m["x"]], {"SrcT": ("type", a), "DstT": ("type", c),
                                            "Truncate": False})


def _build_cast_sink(m, b):
    inner, mover, outer = m["inner"], m["mover"], b.anchor
    a, mid = inner.attr["SrcT"].type, inner.attr["DstT"].type
    b.require((a, mid) in EXACT_WIDENING and outer.attr["DstT"].type == a
              and outer.attr["SrcT"].type == mid,
              "the casts around the data-movement op are not an exact widening and its inverse")
    b.require("T" in mover.attr and mover.attr["T"].type == mid,
              f"{mover.op} has no type attr T carrying the cast dtype")
    attrs = {k: v for k, v in mover.attr.items() if k != "_output_shapes"}
    attrs["T"] = ("type", a)
    rest = b.graph.data_inputs(mover)[1:]
    b.emit(mover.op, m.anchor, [m["x"], *rest], attrs)


def _mover_pat():
    # data-movement op whose first input is the inner cast; other inputs are leaves
    def pat(n_extra):
        return Pat(DATA_MOVEMENT, name="mover",
                   inputs=[Pat("Cast", name="inner", predicate=_no_truncate, inputs=[Pat.any("x")]),
                           *[Pat.any(f"arg{i}") for i in range(n_extra)]])
    return Pat.one_of(*(pat(k) for k in range(0, 4)))


def register():
    register_fusion_rule(
        "identity_chain",
        Pat("Identity", inputs=[Pat("Identity", name="inner", inputs=[Pat.any("x")])]),
        _build_identity_chain, graph_level=1, reason="two Identity ops in a row do nothing",
        _builtin=True, reads=0)
    register_fusion_rule(
        "cast_chain",
        Pat("Cast", predicate=_no_truncate,
            inputs=[Pat("Cast", name="inner", predicate=_no_truncate, inputs=[Pat.any("x")])]),
        _build_cast_chain, graph_level=1, reason="an exact widening followed by another cast is one cast",
        _builtin=True, reads=0)
    register_fusion_rule(
        "cast_sink", Pat("Cast", predicate=_no_truncate, inputs=[_mover_pat()]),
        _build_cast_sink, graph_level=1,
        reason="a widening cast sunk through data movement meets its inverse", _builtin=True, reads=0)


def merge_duplicate_casts(graph, ctx, trail=None) -> int:
    """Several Casts of one tensor to the same dtype become one (the first in
    graph order).  Fetched/preserved casts and casts with control edges stay.
    ``trail`` (``core.Trail``) records the removals for the fusion pass."""
    protected = ctx.protected if ctx is not None else frozenset()
    groups: dict[tuple, list] = {}
    nodes = graph.nodes
    for name in graph.nodes_of_type("Cast"):  # graph order
        n = nodes[name]
        if not n.input or n.input[0].startswith("^"):
            continue
        key = (n.input[0], n.attr["DstT"].type, n.attr["Truncate"].b if "Truncate" in n.attr else False,
               n.device)
        groups.setdefault(key, []).append(n.name)
    merged = 0
    for names in groups.values():
        if len(names) < 2:
            continue
        keep = names[0]
        for dup in names[1:]:
            node = graph.nodes[dup]
            if dup in protected or len(node.input) != 1 or any(
                    idx < 0 for _, idx in graph.consumers(dup)):
                continue
            graph.replace_all_uses(dup, keep)
            if trail is not None:
                trail.note_removal(graph, dup)
            graph.remove_node(dup)
            merged += 1
            if ctx is not None:
                ctx.report.decide(dup, fusion="merge_duplicate_casts", merged_into=keep)
    return merged
