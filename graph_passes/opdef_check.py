"""The OpDef guard: does every node of a rewritten graph satisfy its OpDef?

TensorFlow validates a graph a custom optimizer returns far less strictly
than ``import_graph_def`` does: a node whose type attrs disagree with the
dtypes it is fed can reach a kernel, and the kernel then ``CHECK``-fails and
**aborts the process** (seen: ``_FusedConv2D`` with ``T=bfloat16`` and a float
``TArgs`` bias, ``tensor.cc:844 Check failed: dtype() == expected_dtype``).
So before the pipeline hands a graph back, every node is checked here, and a
graph with a problem the input did not have is not returned.

Checks per node (registered ops; function calls get the arity check only):

* every OpDef attr without a default is set; no attr the OpDef lacks (names
  starting with ``_`` are TF's private attrs and are allowed);
* each ``type`` / ``list(type)`` attr value is in the OpDef's allowed set,
  ``int`` and ``list`` attrs respect their ``minimum``;
* the number of data inputs equals what the signature wants;
* each data input carries the dtype the signature wants at that slot (the
  producer's output dtype, resolved from the producer's own attrs);
* (op, device type, T) is not in :data:`registry.BROKEN_KERNELS`, nor (with its
  ``fused_ops``) in :data:`registry.BROKEN_FUSED_OPS`.

Preconditions
    none: any GraphDef / :class:`Graph`.
Only what changed is checked
    The pipeline checks the nodes its passes created or edited and their
    readers (:func:`nodes_to_check`, from :meth:`Graph.changed_nodes`): any
    other node is the input's, with the input's problems.  Passes edit nodes
    through ``Graph`` methods or declare in-place edits (``Graph.touch``); a
    pass that does not (``Pass.tracks_edits = False``) makes the manager
    mark every node changed, and ``validate_graph=True`` checks every node.

The clean case in C++ (issue 17m)
    Inside grappler the pipeline first asks a C++ check of the same rules
    over the graph it hands back (``precheck`` of :func:`new_problems`,
    injected by the caller): only when that check cannot say "clean" do the
    Python checks here run, to word the problems and drop the input's.

Postconditions
    the graph is not modified.  :func:`new_problems` returns only the
    problems of the rewritten graph that the original graph did not have
    (a user graph that TF accepts despite an odd attr is not our business).
"""
from __future__ import annotations

import functools

from . import registry
from .graph import Graph


def _attr_kind(av) -> str | None:
    return av.WhichOneof("value")


@functools.lru_cache(maxsize=None)
def _attr_specs(op_type: str):
    """The OpDef's attrs as plain tuples, read once per op type (reading
    them from the OpDef proto per node cost ~10 us a node):
    (names, ((name, type, has default, has minimum, minimum), ...)); None for
    an op that is not registered."""
    od = registry.op_def(op_type)
    if od is None:
        return None
    specs = tuple((a.name, a.type, a.HasField("default_value"), a.has_minimum, a.minimum)
                  for a in od.attr)
    return frozenset(a[0] for a in specs), specs


def node_problems(node, library=None, default_device: str = "CPU") -> list[str]:
    """OpDef problems of one node, each a sentence naming the node."""
    spec = _attr_specs(node.op)
    if spec is None:
        # a function call (arity is checked with the edges), or an op from a
        # library not loaded here: TF will say so itself
        return []
    known, specs = spec
    where = f"node '{node.name}' ({node.op})"
    out = []
    attrs = node.attr
    for name in attrs:
        if name not in known and not name.startswith("_"):
            out.append(f"{where} has attr '{name}', which its OpDef does not define")
    for a_name, a_type, has_default, has_minimum, minimum in specs:
        av = attrs.get(a_name)
        if av is None:
            if not has_default:
                out.append(f"{where} lacks attr '{a_name}' (no default)")
            continue
        if a_type == "type":
            if _attr_kind(av) != "type":
                out.append(f"{where} attr '{a_name}' is not a type")
                continue
            allowed = registry.allowed_types(node.op).get(a_name)
            if allowed is not None and av.type not in allowed:
                out.append(f"{where} attr {a_name}={registry.dtype_name(av.type)} is not allowed by "
                           f"its OpDef (allowed: {sorted(registry.dtype_name(t) for t in allowed)})")
        elif a_type == "list(type)":
            types = av.list.type[:]
            allowed = registry.allowed_types(node.op).get(a_name)
            bad = [t for t in types if allowed is not None and t not in allowed]
            if bad:
                out.append(f"{where} attr {a_name} holds {[registry.dtype_name(t) for t in bad]}, "
                           f"not allowed by its OpDef")
            if has_minimum and len(types) < minimum:
                out.append(f"{where} attr {a_name} has {len(types)} entries, minimum {minimum}")
        elif a_type == "int" and has_minimum and _attr_kind(av) == "i" and av.i < minimum:
            out.append(f"{where} attr {a_name}={av.i} is below its minimum {minimum}")
    dev = registry.device_type_of(node, default_device)
    t = attrs.get("T")
    if t is not None and _attr_kind(t) == "type":
        why = registry.BROKEN_KERNELS.get((node.op, dev, t.type))
        if why:
            out.append(f"{where} with T={registry.dtype_name(t.type)} on {dev} is a known-broken "
                       f"combination: {why}")
        elif "fused_ops" in attrs:
            why = registry.fused_ops_broken(node.op, dev, t.type, attrs["fused_ops"].list.s)
            if why:
                out.append(f"{where} with T={registry.dtype_name(t.type)} on {dev} is a known-broken "
                           f"combination: {why}")
    return out


def graph_problems(graph, default_device: str = "CPU", names=None, edge_names=None) -> list[str]:
    """Every OpDef / arity / edge-dtype problem in ``graph`` (a Graph or
    GraphDef); with ``names`` (a set), the OpDef problems of those nodes only
    and the arity / edge problems of those in ``edge_names`` (default: ``names``)."""
    if not isinstance(graph, Graph):
        graph = Graph(graph, copy=False)
    lib = graph.functions
    out = []
    if names is None:
        for node in graph.nodes.values():
            out.extend(node_problems(node, lib, default_device))
    else:
        nodes = graph.nodes
        for name in graph._in_graph_order(names):  # noqa: SLF001
            out.extend(node_problems(nodes[name], lib, default_device))
    # arity and producer dtypes, through the graph's own signature resolution
    out.extend(graph._dtype_problems(names if edge_names is None else edge_names))  # noqa: SLF001
    return out


#: check the unchanged readers of changed nodes only at the edges from those
#: nodes (:func:`changed_problems`); False: every edge of every reader (the
#: reference, :func:`nodes_to_check`), which tests compare it with
FAST_READERS = True


def changed_problems(after: Graph, changed, default_device: str = "CPU") -> list[str]:
    """The problems of ``after`` at the nodes in ``changed`` (created or
    edited) and at the data edges from them into other nodes: in the order
    :func:`graph_problems` gives them and, once the input's problems are
    dropped, the same list as ``graph_problems(after, ..., *nodes_to_check(after,
    changed))``.  A reader outside ``changed`` is the input's NodeDef: its
    arity and its edges from unchanged producers are the input's, so only its
    edges from changed producers can hold a new problem (reported, as by the
    full check, only when its arity is right)."""
    nodes = after.nodes
    names = {n for n in changed if n in nodes}
    partial = {}
    cons = after._consumers  # noqa: SLF001
    for p in names:
        for c, idx in cons.get(p, ()):
            if idx >= 0 and c not in names:
                lst = partial.get(c)
                if lst is None:
                    partial[c] = [idx]
                else:
                    lst.append(idx)
    out = []
    lib = after.functions
    for name in after._in_graph_order(names):  # noqa: SLF001
        out.extend(node_problems(nodes[name], lib, default_device))
    out.extend(after._dtype_problems(names, {c: v for c, v in partial.items() if c in nodes}))  # noqa: SLF001
    return out


def nodes_to_check(after: Graph, changed) -> tuple[set[str], set[str]]:
    """The nodes whose problems may differ from the input graph's:
    (``changed`` ones: created or edited, :meth:`Graph.changed_nodes`, whose
    own attrs need checking; those and their data readers, whose input edges
    need checking: an edge's dtype depends on its producer).  Every other
    node is the input's NodeDef, fed by the input's producers, so it has
    exactly the input's problems, which :func:`new_problems` drops."""
    names = {n for n in changed if n in after.nodes}
    edges = set(names)
    for n in names:
        edges.update(c for c, idx in after.consumers(n) if idx >= 0)
    return names, edges


def _given(graph):
    """``graph``, or what it gives when it is a callable (new_problems's ``before``)."""
    return graph() if callable(graph) else graph


def new_problems(before, after, default_device: str = "CPU", changed=None,
                 precheck=None) -> list[str]:
    """Problems of ``after`` that ``before`` did not have (both Graph or GraphDef;
    ``before`` may also be a callable giving it, called only when ``after``
    has problems: issue 17r, the input graph parsed again only then).

    ``changed``: the names of the nodes of ``after`` that may differ from
    ``before`` (``after.changed_nodes()``, ``after`` a Graph built from
    ``before``); only they and their readers are checked, with the same
    result as the full check.  None (the default): every node.

    ``precheck`` (with ``changed``): a callable, ``precheck() is True`` only
    when :func:`changed_problems` ``(after, changed, default_device)`` is
    empty (then so is this function's answer, which is a subset of it: the
    problems at the changed nodes and their edges, minus the input's); any
    other answer (False: maybe a problem; None: cannot tell) runs the checks
    here.  The caller injects it (graph_passes loads no library): inside
    grappler, the C++ check over the patch the bridge hands back
    (``OpdefPrecheck`` in custom_ops/opdef_precheck.cc), so that the clean
    case costs no Python per node and a flagged one still gets these
    messages."""
    if changed is not None and precheck is not None and precheck() is True:
        return []
    names = edges = None
    if changed is not None:
        if not isinstance(after, Graph):
            after = Graph(after, copy=False)
        if FAST_READERS and not after.duplicates:
            if not any(n in after.nodes for n in changed):
                return []
            now = changed_problems(after, changed, default_device)
            if not now:
                return []
            names, edges = nodes_to_check(after, changed)
            old = set(graph_problems(_given(before), default_device, names, edges))
            return [p for p in now if p not in old]
        names, edges = nodes_to_check(after, changed)
        if not edges:
            return []
    now = graph_problems(after, default_device, names, edges)
    if not now:
        return []
    old = set(graph_problems(_given(before), default_device, names, edges))
    return [p for p in now if p not in old]


__all__ = ["node_problems", "graph_problems", "new_problems", "nodes_to_check", "changed_problems"]
