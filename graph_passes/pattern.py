"""Declarative op patterns and a matcher.

A pattern is a tree of :class:`Pat` anchored at its output node::

    Pat("BiasAdd", name="bias", inputs=[
        Pat(("Conv2D", "DepthwiseConv2dNative"), name="conv"),   # inner node
        Pat.any("b"),                                            # leaf tensor
    ])

* ``op``: one type, a tuple of alternatives, or None for a wildcard node;
* ``Pat.any(name)``: a leaf that matches any tensor and captures it; leaves
  are *outside* the match;
* ``commutative=True``: a 2-input op matches its inputs in either order;
* ``predicate(node, graph)``: extra condition on an inner node;
* ``Pat.one_of(p1, p2)``: alternatives for a whole subtree;
* ``Pat.any("@name")``: a back-reference, the output of the inner node
  captured as ``name`` (for patterns that read one tensor twice, such as
  LayerNorm's ``x - mean(x)``).

The matcher refuses a match whose inner tensors (outputs of any matched node
other than the anchor) are read outside the match, are fetched or preserved,
or carry control consumers; and it never returns overlapping matches.
"""
from __future__ import annotations

import dataclasses
from itertools import repeat
from typing import Callable

from .graph import Graph, parse_tensor


@dataclasses.dataclass
class Pat:
    op: str | tuple | None = None
    inputs: list | None = None
    name: str | None = None
    commutative: bool = False
    predicate: Callable | None = None
    #: the producer's output port this pattern position must read (inner nodes)
    port: int | None = 0
    #: True for Pat.any leaves
    leaf: bool = False
    alternatives: tuple = ()

    @staticmethod
    def any(name: str | None = None) -> "Pat":
        return Pat(name=name, leaf=True, port=None)

    @staticmethod
    def one_of(*alts: "Pat", name: str | None = None) -> "Pat":
        return Pat(name=name, alternatives=tuple(alts))

    def ops(self):
        if self.op is None:
            return None
        return (self.op,) if isinstance(self.op, str) else tuple(self.op)

    def _opset(self):
        """frozenset of ``ops()`` (cached; None for a wildcard)."""
        cached = self.__dict__.get("_opset_cache")
        if cached is None or cached[0] is not self.op:
            cached = (self.op, None if self.op is None else frozenset(self.ops()))
            self.__dict__["_opset_cache"] = cached
        return cached[1]

    def _as_root(self):
        """This pattern anchored at a node (any output port); cached."""
        if self.alternatives:
            return self
        if self.port is None:
            return self
        root = self.__dict__.get("_root_cache")
        if root is None:  # patterns are not edited once built
            root = self.__dict__["_root_cache"] = dataclasses.replace(self, port=None)
        return root


@dataclasses.dataclass
class Match:
    anchor: str
    nodes: dict          # capture name -> NodeDef (inner nodes)
    tensors: dict        # capture name -> tensor reference (leaves)
    matched: list        # all inner node names, anchor first

    def __getitem__(self, key):
        if key in self.nodes:
            return self.nodes[key]
        return self.tensors[key]


def _match(graph: Graph, pat: Pat, ref: str, state) -> bool:
    """Try to match ``pat`` at tensor ``ref``; extends ``state`` (nodes, tensors, matched)."""
    if pat.alternatives:
        for alt in pat.alternatives:
            if _rejects(graph, alt, ref):
                continue  # (what _match would answer before touching the state)
            snap = _snapshot(state)
            if _match(graph, alt, ref, state):
                if pat.name:
                    src = parse_tensor(ref)[0]
                    state[0][pat.name] = graph.nodes[src]
                return True
            _restore(state, snap)
        return False
    if pat.leaf:
        state[3].append(ref)
        if pat.name:
            if pat.name in state[1] and state[1][pat.name] != ref:
                return False
            state[1][pat.name] = ref
        return True
    node = _candidate(graph, pat, ref)
    if node is None:
        return False
    src = node.name
    if src in state[2]:
        return False
    if pat.predicate is not None and not pat.predicate(node, graph):
        return False
    state[2].append(src)
    if pat.name:
        state[0][pat.name] = node
    if pat.inputs is None:
        return True
    data = graph.data_inputs(node)
    if len(data) != len(pat.inputs):
        return False
    if not (pat.commutative and len(data) == 2):
        # one order: on failure the caller that tries alternatives restores
        for p, r in zip(pat.inputs, data):
            if not _match(graph, p, r, state):
                return False
        return True
    for order in (data, [data[1], data[0]]):
        if _rejects(graph, pat.inputs[0], order[0]) or _rejects(graph, pat.inputs[1], order[1]):
            continue
        snap = _snapshot(state)
        if all(_match(graph, p, r, state) for p, r in zip(pat.inputs, order)):
            return True
        _restore(state, snap)
    return False


def _candidate(graph: Graph, pat: Pat, ref: str):
    """The node an inner position ``pat`` (not a leaf, not ``one_of``) may
    match at tensor ``ref``, by the first checks (a data edge from a node of
    the graph, the position's port and op type), or None."""
    src, port, ctrl = parse_tensor(ref)
    node = graph.nodes.get(src)
    if node is None or ctrl or (pat.port is not None and port != pat.port):
        return None
    ops = pat._opset()
    if ops is not None and node.op not in ops:
        return None
    return node


def _rejects(graph: Graph, pat: Pat, ref: str) -> bool:
    """True when ``_match(graph, pat, ref, ...)`` fails on its first checks
    (:func:`_candidate`), before it would change the match state: the
    caller can skip the snapshot/restore of that try."""
    if pat.leaf or pat.alternatives:
        return False
    return _candidate(graph, pat, ref) is None


def _snapshot(state):
    return dict(state[0]), dict(state[1]), len(state[2]), len(state[3])


def _restore(state, snap):
    state[0].clear(); state[0].update(snap[0])
    state[1].clear(); state[1].update(snap[1])
    del state[2][snap[2]:]
    del state[3][snap[3]:]


def match_at(graph: Graph, pat: Pat, anchor: str, protected=frozenset(),
             escapes_ok: bool = False) -> Match | None:
    """Match ``pat`` with its root at node ``anchor``, or None.  With
    ``escapes_ok`` an inner tensor may be read outside the match (a training
    graph's gradient reads them); the caller must then handle every such reader
    (the fusion framework refuses the match otherwise)."""
    state = ({}, {}, [], [])  # captured nodes, captured tensors, inner names, leaf refs
    if not _match(graph, pat._as_root(), anchor, state):
        return None
    matched = state[2]
    inner = set(matched)
    backrefs = {ref for key, ref in state[1].items() if key.startswith("@")}
    for ref in state[3]:  # a leaf that reads an inner node would need it kept
        if parse_tensor(ref)[0] in inner and ref not in backrefs:
            return None
    for key, ref in state[1].items():  # "@name" must read exactly the captured node
        if key.startswith("@"):
            node = state[0].get(key[1:])
            if node is None or ref != node.name:
                return None
    for name in matched[1:]:
        if name in protected:
            return None
        if escapes_ok:
            continue
        for cname, idx in graph._consumers.get(name, ()):  # noqa: SLF001 - read only
            if cname not in inner:  # inner tensor escapes, or a control edge leaves it
                return None
    return Match(anchor=anchor, nodes=state[0], tensors=state[1], matched=list(matched))


def _anchor_ops(pat: Pat):
    """The op types a node must have to anchor ``pat`` (the union over
    ``one_of`` alternatives), or None when any op may."""
    if pat.leaf:
        return None
    if pat.alternatives:
        ops = set()
        for alt in pat.alternatives:
            a = _anchor_ops(alt)
            if a is None:
                return None
            ops.update(a)
        return frozenset(ops)
    return pat._opset()


def find_matches(graph: Graph, pat: Pat, protected=frozenset(), order=None,
                 escapes_ok: bool = False, dropped: list | None = None) -> list[Match]:
    """All non-overlapping matches, anchors visited in topological order.
    ``dropped``: a list that gets every anchor passed over because it lies in,
    or its match overlaps, an earlier match (:func:`affected_anchors` relies
    on a run that dropped none)."""
    used: set[str] = set()
    out = []
    first_ops = _anchor_ops(pat)
    if order is None and first_ops is not None:
        anchors = anchor_candidates(graph, pat, protected, escapes_ok)
        if not anchors:
            return out
        if len(anchors) > 1:
            graph.sort_by_topo(anchors)
    else:
        anchors = order if order is not None else graph.topo_order()
    nodes = graph.nodes
    for name in anchors:
        if name not in nodes:
            continue
        if first_ops is not None and nodes[name].op not in first_ops:
            continue
        if name in used:
            if dropped is not None:
                dropped.append(name)
            continue
        m = match_at(graph, pat, name, protected, escapes_ok)
        if m is None:
            continue
        if used.intersection(m.matched):
            if dropped is not None:
                dropped.append(name)
            continue
        used.update(m.matched)
        out.append(m)
    return out


# ------------------------------------------------------------ anchor candidates
def anchor_candidates(graph: Graph, pat: Pat, protected=frozenset(), escapes_ok: bool = False) -> list:
    """The nodes :func:`find_matches` tries as anchors of ``pat`` (a pattern
    whose root has op types), unordered: indexed by the anchor's op type (most
    rules find no anchor at all, and then no topological order is needed),
    narrowed by a rarer inner position where the pattern has one (only anchors
    ``match_at`` refuses go)."""
    narrowed = _candidates(graph, pat, _inner_filter(graph, pat, protected, escapes_ok),
                           {} if RAREST_MEMO else None)
    return graph.nodes_of_type(_anchor_ops(pat)) if narrowed is None else list(narrowed)


def _of_type(graph: Graph, ops) -> set:
    """Names of the nodes whose op is in ``ops``, unordered.  (From the op
    index; ``Graph`` has no unordered accessor: ``nodes_of_type`` sorts.)"""
    by_op = getattr(graph, "_by_op", None)
    if by_op is None:
        return set(graph.nodes_of_type(ops))
    out = set()
    for op in ops:
        names = by_op.get(op)
        if names:
            out.update(names)
    return out


def _count(graph: Graph, ops) -> int:
    by_op = getattr(graph, "_by_op", None)
    if by_op is None:
        return len(graph.nodes_of_type(ops))
    return sum(map(len, map(by_op.get, ops, repeat(()))))


def _sum_alternatives(graph: Graph, pat: Pat, count, *memo):
    """``count`` summed over a ``one_of``'s alternatives (None if one is None)."""
    total = 0
    for alt in pat.alternatives:
        n = count(graph, alt, *memo)
        if n is None:
            return None
        total += n
    return total


def _bound(graph: Graph, pat: Pat):
    """An upper bound on how many nodes can sit at position ``pat`` (None: any)."""
    if pat.alternatives:
        return _sum_alternatives(graph, pat, _bound)
    ops = pat._opset()
    return None if ops is None else _count(graph, ops)


def _rarest(graph: Graph, pat: Pat, memo=None):
    """The fewest nodes any position in ``pat``'s subtree accepts (a sum over
    ``one_of`` alternatives; None: no bound).  ``memo``: a dict kept while
    the graph is not edited (:func:`_candidates` asks again for the subtrees
    of every position it visits): id(position) -> (position, answer)."""
    if pat.leaf:
        return None
    if memo is not None:
        hit = memo.get(id(pat))
        if hit is not None:
            return hit[1]
    if pat.alternatives:
        best = _sum_alternatives(graph, pat, _rarest, memo)
    else:
        ops = pat._opset()
        best = None if ops is None else _count(graph, ops)
        for child in pat.inputs or ():
            r = _rarest(graph, child, memo)
            if r is not None and (best is None or r < best):
                best = r
    if memo is not None:
        memo[id(pat)] = (pat, best)  # (the position kept alive: its id is not reused)
    return best


#: (issue 17) :func:`_candidates` keeps :func:`_rarest`'s answers for the
#: subtrees it visits (one find_matches call: no edit in between); False:
#: each asked again (the reference; the same candidates)
RAREST_MEMO = True

#: INNER_FILTER: candidates of inner positions leave out the nodes match_at
#: refuses as inner nodes whatever the match (fetched or preserved ones, and,
#: when inner tensors may not escape, nodes with a control consumer of an op
#: no position of the pattern accepts: it cannot be in the match); issue 17,
#: 17i: the Identity chains of TF1 gradient tuples (every inner Identity waits
#: on a group_deps NoOp).  False: the reference
INNER_FILTER = True


def _pattern_ops(pat: Pat):
    """The op types any position of ``pat`` accepts (a frozenset), or None
    when one accepts any op.  Cached on the pattern."""
    cached = pat.__dict__.get("_all_ops_cache", False)
    if cached is not False:
        return cached
    ops: set | None = set()

    def walk(p: Pat):
        nonlocal ops
        if ops is None or p.leaf:
            return
        for alt in p.alternatives:
            walk(alt)
        if not p.alternatives:
            o = p._opset()
            if o is None:
                ops = None
                return
            ops |= o
        for child in p.inputs or ():
            walk(child)

    walk(pat)
    res = None if ops is None else frozenset(ops)
    pat.__dict__["_all_ops_cache"] = res
    return res


def _inner_filter(graph: Graph, pat: Pat, protected, escapes_ok: bool):
    """A test a node must pass to sit at an inner position of any match of
    ``pat`` that :func:`match_at` returns (with these ``protected`` and
    ``escapes_ok``), or None when it would pass every node."""
    ops = None if escapes_ok else _pattern_ops(pat)
    if not INNER_FILTER or (ops is None and not protected):
        return None
    cons, nodes = graph._consumers, graph.nodes  # noqa: SLF001 - read only

    def inner_ok(name) -> bool:
        if name in protected:
            return False
        if ops is not None:
            for c, idx in cons.get(name, ()):
                if idx < 0 and nodes[c].op not in ops:  # a reader outside any match
                    return False
        return True

    return inner_ok


def _candidates(graph: Graph, pat: Pat, inner_ok=None, memo=None):
    """A set of nodes holding every node a match can put at position ``pat``
    (inner or root; a superset: each is a reader, with an op the position
    accepts, of a candidate of its rarest inner input position, and within
    what the position's predicate narrows to, see :func:`_predicate_candidates`),
    or None when that narrows nothing below the nodes of the position's op
    types.  ``inner_ok``: a test every node at an inner position of a match
    passes (:func:`_inner_filter`): the nodes failing it are not read
    through.  Exact filter for :func:`find_matches`: an anchor outside it has
    no match."""
    if pat.leaf:
        return None
    if pat.alternatives:
        out = set()
        for alt in pat.alternatives:
            sub = _candidates(graph, alt, inner_ok, memo)
            if sub is None:
                ops = _anchor_ops(alt)
                if ops is None:
                    return None
                sub = _of_type(graph, ops)
            out |= sub
        return out
    ops = pat._opset()
    hooked = _predicate_candidates(graph, pat)
    if ops is None or not pat.inputs:
        return hooked
    n0 = _count(graph, ops)
    best = None
    for child in pat.inputs:
        if child.leaf:
            continue
        rare = _rarest(graph, child, memo)
        if rare is None or rare > n0 or (best is not None and rare >= len(best)):
            continue  # nothing below is rarer than this position: no narrowing to expect
        sub = _candidates(graph, child, inner_ok, memo)  # (narrowed by a rarer position below it)
        if sub is None:
            bound = _bound(graph, child)
            if bound is None or bound > n0 or (best is not None and bound >= len(best)):
                continue
            sub = _of_type(graph, _anchor_ops(child))
        elif len(sub) > n0:
            continue
        if best is None or len(sub) < len(best):
            best = sub
    if best is None:
        return hooked
    nodes, cons = graph.nodes, graph._consumers  # noqa: SLF001 - read only
    out = set()
    for name in best:
        if inner_ok is not None and not inner_ok(name):
            continue  # (best holds candidates of an inner position)
        for r, idx in cons.get(name, ()):
            if idx >= 0 and nodes[r].op in ops:
                out.add(r)
    return out if hooked is None else out & hooked


#: PREDICATE_CANDIDATES: use a predicate's ``candidates`` hook (False: the reference)
PREDICATE_CANDIDATES = True


def _predicate_candidates(graph: Graph, pat: Pat):
    """The set a position's predicate narrows its nodes to, or None.

    A predicate may carry a ``candidates(graph)`` attribute: a function
    returning a set holding every node at which the predicate can be true
    (a superset, computed from a rare op the predicate requires nearby, as
    the LayerNorm rule's needs an Rsqrt or Sqrt a few products upstream),
    or None when it cannot narrow."""
    pred = pat.predicate
    if pred is None or not PREDICATE_CANDIDATES:
        return None  # (no getattr on None: a missed lookup formats an AttributeError)
    hook = getattr(pred, "candidates", None)
    return None if hook is None else hook(graph)


# ------------------------------------------------------- what a change can reach
def _climb_info(pat: Pat):
    """(root ops, ops of the positions that have an inner child, [(ops of such
    a position, op sets of its ancestors up to the root)]); op sets are
    frozensets, None for a wildcard.  Cached on the pattern."""
    info = pat.__dict__.get("_climb_cache")
    if info is not None:
        return info
    parents = []  # (position ops, ancestors' ops nearest first)

    def walk(p: Pat, chain: tuple):
        if p.leaf:
            return False
        if p.alternatives:  # an alternative's root sits on the same node
            inner = False
            for alt in p.alternatives:
                inner = walk(alt, chain) or inner
            return inner
        ops = p._opset()
        kids = False
        for child in p.inputs or ():
            kids = walk(child, (ops,) + chain) or kids
        if kids:
            parents.append((ops, chain))
        return True

    walk(pat, ())
    union = set()
    for ops, _ in parents:
        if ops is None:
            union = None
            break
        union |= ops
    info = (_anchor_ops(pat), None if union is None else frozenset(union), tuple(parents))
    pat.__dict__["_climb_cache"] = info
    return info


class Changes:
    """Nodes a change may have altered, for :func:`affected_anchors`: ``dirty``
    (names of nodes created or edited, or whose readers changed) and their
    data readers, each picked by op type from the graph's op index when a
    rule asks (:meth:`of_type`), so that a rule asking for two op types reads
    no other node's op."""

    def __init__(self, graph: Graph, dirty):
        nodes = graph.nodes
        self.graph = graph
        self.dirty = {n for n in dirty if n in nodes}
        self._readers = None
        self._below = [self.dirty]  # nodes k data edges below a dirty node

    @property
    def readers(self) -> set:
        """The data readers of the dirty nodes."""
        if self._readers is None:
            readers = set()
            cons = self.graph._consumers  # noqa: SLF001 - read only
            for name in self.dirty:
                for cname, idx in cons.get(name, ()):
                    if idx >= 0:
                        readers.add(cname)
            self._readers = readers
        return self._readers

    def of_type(self, names: set, ops) -> set:
        """The nodes of ``names`` (``dirty`` or ``readers``) whose op is in
        ``ops`` (None: any op), as a new set."""
        return set(names) if ops is None else names & _of_type(self.graph, ops)

    def below(self, k: int) -> set:
        if len(self._below) == 1:
            self._below.append(self.readers)
        while len(self._below) <= k:
            nxt = set()
            cons = self.graph._consumers  # noqa: SLF001 - read only
            for f in self._below[-1]:
                for r, idx in cons.get(f, ()):
                    if idx >= 0:
                        nxt.add(r)
            self._below.append(nxt)
        return self._below[k]


def affected_anchors(graph: Graph, pat: Pat, changes: Changes, reach: int = 0) -> set:
    """The anchors at which matching ``pat`` may read a node of
    ``changes.dirty`` (:class:`Changes`).

    The matcher at an anchor reads the nodes at the pattern's inner positions
    (their op, attrs, inputs and readers), each a data input of the node at its
    parent position: so a dirty node (whatever its op: the node it replaced
    may have matched) can only change the match at an anchor reached by
    climbing from one of its readers (at a position with an inner child) up the
    positions' chain to the root, every node on the way with an op its
    position accepts.  ``reach``: the rule's predicates and build also read
    nodes up to that many input edges above the anchor (any op).  A superset:
    callers match at the anchors returned."""
    root_ops, union, parents = _climb_info(pat)
    nodes = graph.nodes
    out = changes.of_type(changes.dirty, root_ops)
    for c in (changes.of_type(changes.readers, union) if union is None or union else ()):
        op = nodes[c].op
        for ops, chain in parents:
            if ops is not None and op not in ops:
                continue
            frontier = {c}
            for up in chain:
                nxt = set()
                for f in frontier:
                    for r, idx in graph._consumers.get(f, ()):  # noqa: SLF001 - read only
                        if idx >= 0 and (up is None or nodes[r].op in up):
                            nxt.add(r)
                frontier = nxt
                if not frontier:
                    break
            out |= frontier
    if reach >= 1:
        out.update(changes.of_type(changes.readers, root_ops))
    for k in range(2, reach + 1):  # any node up to `reach` data edges below a dirty node
        out.update(r for r in changes.below(k) if root_ops is None or nodes[r].op in root_ops)
    if root_ops is not None:
        out = {a for a in out if nodes[a].op in root_ops}
    return out
