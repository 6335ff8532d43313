"""Find the gradient subgraph TF's autodiff built for a matched forward region.

A fusion rule that replaces a forward subgraph ``F`` (LayerNorm, RMSNorm,
attention's scale+mask+softmax...) by one op cannot do so in a training graph
unless the backward ops that read ``F``'s inner tensors are replaced too, by
one gradient op (``LayerNormGrad``...).  This module finds that backward
region ``G`` and says, for every tensor leaving it, what it is; the rule then
emits its gradient op and rewires (``Builder.region``).  It never edits the
graph.

API (stable; used by the LayerNorm/RMSNorm rules and the attention rule)::

    region = find_grad_region(graph, forward, outputs, inputs,
                              shapes=None, protected=frozenset(), dy_shape=None,
                              grad_reads_output=False, partial_shapes=False,
                              side_outputs=(), owner_scopes=())
        # forward:  names of the forward nodes the rule replaces (anchor included)
        # outputs:  the forward tensors the fused op keeps producing (y = "anchor:0");
        #           G may not read them (a reader of y is not part of F's gradient)
        # inputs:   the forward region's input tensors (x, gamma, beta): G may read them
        # dy_shape: dy's static shape when outputs[0]'s is unknown (e.g. [B, S, E])
        # grad_reads_output: the gradient reads y (softmax); G's readers of y must
        #           also read dy (or a tensor derived from it)
        # partial_shapes: dy's shape may be partial, identical to y's ([-1, H, S, T])
        # side_outputs: inner tensors the fused op also produces (batch statistics):
        #           readers outside F and G allowed, the rule rewires them
        # owner_scopes: scopes of F's forward ops grappler removed (their gradients count as F's)
        # -> GradRegion, or raises GradRegionRefused(reason)

    region.nodes          # G, topological order
    region.dy             # the ONE external float tensor G reads: the incoming gradient
    region.outputs        # {G tensor read outside G: [(consumer, input index), ...]}
    region.ctrl_inputs    # nodes outside G that G nodes wait on (control edges)
    region.ctrl_consumers # nodes outside G that wait on G nodes (control edges)
    region.depends_on_forward(ref)  # data-depends on a forward inner tensor's value
    region.depends_on_dy(ref)
    GradRegionRefused(msg).why_not  # {node: why the search left it out} (debugging)

    Wiring it into a rule: register it with ``escapes=True`` (or call
    ``b.absorb(inner, escapes_ok=True)``), emit the gradient op, re-emit an
    aggregator with ``b.replace(name, control_ok=True)``, and hand the region to
    ``b.region(region.nodes, {old ref: new ref}, grad_op_name)``; the framework
    refuses the match if any reader of a removed node is left unhandled.  See
    ``builtin._norm_backward``.

    terms = assign_outputs(region, graph, classify, summed=("dx",))
        # classify(ref) -> role name or None, for every tensor in region.outputs;
        # any None -> GradRegionRefused.  Roles in ``summed`` may come as several
        # partial terms that ONE aggregator outside G (AddN / Add / AddV2) sums
        # together with other, external terms; other roles are one tensor
        # (several Identity/Reshape aliases of it allowed).
        # -> {role: Term(role, refs, aggregator)}

What G is (all conditions, checked per node; the closure is grown from the
readers of F's inner tensors, then from the readers of ``dy``):

* not in F, not fetched/preserved, op in :data:`GRAD_OPS` (the ops TF's
  gradient functions of elementwise/reduction/reshape/batch-norm ops emit:
  Mul, Sum, Reshape, Tile, RsqrtGrad, FusedBatchNormGradV3, AddN,
  BroadcastGradientArgs, Shape..., Identity, NoOp);
* every data input comes from G, F's inner tensors, the region ``inputs``,
  *static* tensors (Const, Shape/Size/Rank and int arithmetic on them: values
  that do not depend on data) or ``dy``; never from ``outputs``;
* ``dy`` is one tensor: the first external, non-static float tensor with the
  shape of ``outputs[0]`` that a grown node reads; a second such tensor refuses;
* a node that reads ``dy`` reads no other dy-dependent tensor (``AddN(dy, dx)``
  sums a residual path's gradient with F's: it is outside G), and an
  aggregation (AddN/Add/AddV2) reading ``dy`` is never in G;
* names: only autodiff's ops (a ``gradients[_N]/`` or ``gradient_tape/`` scope,
  also under a grappler prefix) join G, and sums (AddN/Add/AddV2) of G tensors
  only (TF2 names its aggregations ``AddN_3``): an optimizer's ``Neg(grad)`` or
  a user's ``Mul(grad, clip)`` never does (it would be taken for dgamma);
  autodiff names its ops after the forward op (TF1
  ``gradients[_N]/<fwd>_grad/...``, TF2 ``gradient_tape/<fwd>/...``).  A node
  whose name attributes it to an existing forward node *outside* F (the
  gradient of the op that produced x, or of a sibling) is never in G; a node
  reached only through ``dy`` (not through F's inner tensors) must be
  attributed to a node *in* F.  Names that attribute to nothing (TF2 scopes,
  aggregations such as ``AddN_3``, grappler's ``ArithmeticOptimizer/...``) are
  judged by the structural rules alone;
* an autodiff op whose name attributes to NO node must lie under F's common
  name scope (when F has one): in a Keras 2 transformer block grappler had
  renamed the attention output's bias add, and its gradient (gamma-shaped,
  computed from the complete dx) would otherwise have joined G;
* control-only nodes (``tuple/group_deps`` NoOps, Consts anchored by a control
  edge) whose inputs are all in G (or ``dy``'s producer) join G.

Then: every reader (data or control) of an F inner tensor must be in F or G
(else GradRegionRefused "'m' is also read by 'n'"); a control input of G from a
node that depends on G refuses (moving it would make a cycle).

Where it runs (issue 17, stop 44): the two growth passes (``try_add`` and its
helpers) run in C++ (``custom_ops/grad_region.cc``, :data:`NATIVE_SEARCH`)
over a mirror of the graph kept in step with its edit and removal logs; the
Python passes (``_python_growth``) are the reference, and with
:data:`CHECK_NATIVE` (the test suite) every search runs both and compares
them.  The checks after the growth (``_finish``) are shared.

Residual assumption: a gradient op of the op *upstream* of x that keeps x's
shape, depends only on the complete dx and constants, is in an autodiff scope
but whose name attributes to no forward node (the forward node renamed by
something other than the fusion pass) and is in GRAD_OPS, would be taken for a
part of dx.  TF's own names attribute such ops to their forward op, and the
names the graph had when the fusion pass began are remembered.

Before/after (LayerNorm; the rule's part)::

    x,gamma,beta -> [F: mean, sub, rsqrt, mul, add] -> y -> ...      x,gamma,beta -> LayerNorm -> y
    dy -> [G: Mul, Sum, Reshape, RsqrtGrad, Tile, ...] -> dx1 ─┐       dy -> LayerNormGrad -> dx ─┐
                                                   dx2 ─┼─ AddN                 dgamma, dbeta  ├─ AddN
                                       d_residual ───────┘                   d_residual ────┘
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import weakref
from itertools import repeat
from operator import and_
from typing import Callable, Iterable

import numpy as np

from .. import registry
from .. import shapes as _shapes
from ..graph import Graph, parse_tensor

#: op types TF's gradient functions emit for the forward ops these rules fuse
#: (and the plumbing TF1/TF2 autodiff and grappler put between them)
GRAD_OPS = frozenset({
    # arithmetic
    "Mul", "RealDiv", "Div", "DivNoNan", "Neg", "Sub", "Add", "AddV2", "AddN", "Square", "Sqrt",
    "Rsqrt", "Reciprocal", "Pow", "Maximum", "Minimum", "FloorDiv", "SquaredDifference",
    "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "SoftmaxGrad", "Exp", "Log",
    # grappler's arithmetic optimizer chains unary ops (Erf's gradient: Neg -> Exp) into one
    "_UnaryOpsComposition",
    # reductions and broadcasting
    "Sum", "Mean", "Prod", "Tile", "BroadcastTo", "BroadcastGradientArgs",
    # shape plumbing
    "Reshape", "ExpandDims", "Squeeze", "Shape", "ShapeN", "Size", "Rank", "Fill", "ZerosLike",
    "OnesLike", "StridedSlice", "Pack", "ConcatV2", "Range", "DynamicStitch", "Gather", "GatherV2",
    "Transpose", "Cast", "Select", "SelectV2", "Where",
    # batch norm (Keras 2 LayerNormalization)
    "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3",
    # tuples, grouping
    "Identity", "IdentityN", "Snapshot", "NoOp", "Const", "StopGradient", "PreventGradient",
})

#: ops whose output is a sum of their inputs (gradient aggregation)
AGGREGATIONS = frozenset({"AddN", "Add", "AddV2"})

#: ops whose value depends only on input *shapes*
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
VALUE_STATIC_OPS = SHAPE_OPS | {"ZerosLike", "OnesLike", "Const"}

#: ops that keep a value static when every data input is static
_STATIC_ARITH = frozenset({
    "Identity", "StridedSlice", "Pack", "ConcatV2", "Prod", "Sum", "BroadcastGradientArgs",
    "Range", "FloorDiv", "FloorMod", "Maximum", "Minimum", "Cast", "Reshape", "Fill", "Gather",
    "GatherV2", "DynamicStitch", "ExpandDims", "Squeeze", "Mul", "Sub", "Add", "AddV2", "RealDiv",
    "Div", "Neg", "Sqrt", "Rsqrt", "Reciprocal", "Size", "Shape", "Slice", "Tile", "Unpack",
    "Snapshot", "ZerosLike", "OnesLike", "Square", "Pow", "Equal", "Less", "Greater",
})

_TF1_RX = re.compile(r"^(.*/)?gradients(?:_\d+)?/(.+?)_grad(?:/|$)")
_TF2_RX = re.compile(r"^(.*/)?gradient_tape/(.+)$")

#: (issue 17) :class:`_ScopeMatch` finds the scope word's occurrences from the
#: last one instead of running the regex, whose greedy ``(.*/)?`` backtracks
#: over every '/' of the name (1.3 µs per BERT gradient name); False: the
#: regexes (the reference; the same groups)
FAST_SCOPES = True


class _Groups(tuple):
    """The two groups of a scope match, read as ``m.group(1)``, ``m.group(2)``."""

    def group(self, i):
        return self[i - 1]


class _ScopeMatch:
    """``rx.match(name)`` for ``rx = ^(.*/)?<word><tail>``: the greedy optional
    prefix makes the regex take the last occurrence of ``word`` that starts
    the name or follows a '/' and at which the tail matches; this tries
    those occurrences from the last with ``tail(name, at)`` (the tail's
    group, or None), string scans instead of the regex's backtracking and
    lazy ``(.+?)``.  The same groups (prefix or None, the tail's group);
    names holding a newline ('.' stops there) go to the regex."""

    def __init__(self, rx, word, tail):
        self.rx, self._word, self._tail = rx, word, tail

    def match(self, name):
        if not FAST_SCOPES or "\n" in name:
            m = self.rx.match(name)
            return None if m is None else _Groups(m.groups())
        word, tail = self._word, self._tail
        end = len(name)
        while True:
            p = name.rfind(word, 0, end)
            if p < 0:
                return None
            if p == 0 or name[p - 1] == "/":
                g = tail(name, p)
                if g is not None:
                    return _Groups((name[:p] if p else None, g))
            end = p + len(word) - 1  # (the next occurrence starts before p)


def _tf1_tail(name, p):
    """``gradients(?:_\\d+)?/(.+?)_grad(?:/|$)`` matched at ``p`` (a name
    without a newline): its group, or None."""
    j = p + 9  # past "gradients"
    if name[j:j + 1] == "_":  # a numbered scope: _ and decimal digits, then '/'
        k = j + 1
        while k < len(name) and name[k].isdecimal():  # (\d: Unicode category Nd)
            k += 1
        if k == j + 1:
            return None
        j = k
    if name[j:j + 1] != "/":
        return None
    q = j + 1
    k = name.find("_grad", q + 1)  # (.+? takes at least one character)
    while k >= 0:
        e = k + 5
        if e == len(name) or name[e] == "/":
            return name[q:k]
        k = name.find("_grad", k + 1)
    return None


def _tf2_tail(name, p):
    """``gradient_tape/(.+)$`` matched at ``p`` (a name without a newline)."""
    return name[p + 14:] or None


_TF1 = _ScopeMatch(_TF1_RX, "gradients", _tf1_tail)
_TF2 = _ScopeMatch(_TF2_RX, "gradient_tape/", _tf2_tail)
#: a name autodiff gave (TF1 tf.gradients, TF2 GradientTape), also under a
#: grappler prefix ("ConstantFolding/gradients/...")
_AUTODIFF = re.compile(r"(?:^|/)(?:gradients(?:_\d+)?|gradient_tape)/")
_GRAPPLER = re.compile(r"^(?:ArithmeticOptimizer|ConstantFolding|DependencyOptimizer|LayoutOptimizer|"
                       r"LoopOptimizer|Remapper|MemoryOptimizer|PinToHostOptimizer)/")

#: pure elementwise ops a gradient may apply to the region's inputs themselves
#: (Pow's gradient takes log(x) where x > 0, RealDiv's -x / y**2): such a value
#: is computed from x, gamma, beta and constants alone, so it is never the incoming gradient
_FROM_INPUT_OPS = frozenset({"Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "Log",
                             "ZerosLike", "OnesLike", "Select", "SelectV2", "Cast", "Identity", "Abs",
                             "Sign", "Neg", "Mul", "RealDiv", "Div", "Sub", "Add", "AddV2", "Square",
                             "Sqrt", "Rsqrt", "Reciprocal", "Pow", "Exp", "Maximum", "Minimum"})

#: safety bound on the region's size
MAX_NODES = 4000

#: the search's first pass (which only finds dy) stops at the node that finds
#: it (issue 17, helper 17i: on a 12-layer BERT training graph 146 of its 421
#: tries per run come before dy, the rest only grew a region pass B grows
#: again).  False: the reference, pass A grows to the end.  The outcome is the
#: same, except where pass A would have grown beyond MAX_NODES after finding
#: dy: the reference refuses there ("grew beyond"), this path leaves the
#: decision to pass B (the same bound on the region pass B finds)
STOP_AT_DY = True


class GradRegionRefused(Exception):
    """The backward region could not be delimited or classified; the message is
    the reason the fusion report records.  ``why_not``: {node: why it is not
    in the region} for the nodes the search looked at (for debugging)."""

    def __init__(self, msg, why_not=None):
        super().__init__(msg)
        self.why_not = dict(why_not or {})


@dataclasses.dataclass
class GradRegion:
    forward: frozenset
    nodes: list
    dy: str
    outputs: dict
    ctrl_inputs: list
    ctrl_consumers: list
    _fwd_dep: dict
    _dy_dep: dict
    graph: Graph = dataclasses.field(repr=False, default=None)

    def depends_on_forward(self, ref: str) -> bool:
        """Whether tensor ``ref`` of G depends (through G's data edges) on the
        *value* of a forward inner tensor (not only on its shape)."""
        return self._fwd_dep.get(parse_tensor(ref)[0], False)

    def depends_on_dy(self, ref: str) -> bool:
        return self._dy_dep.get(parse_tensor(ref)[0], False)


@dataclasses.dataclass
class Term:
    role: str
    #: the output tensors of G that carry this role (partial terms, or aliases)
    refs: list
    #: the node outside G summing the partial terms (``summed`` roles with >1 ref)
    aggregator: str | None = None


# ------------------------------------------------------------------ helpers
def attributed_forward(graph: Graph, name: str) -> str | None:
    """The forward node autodiff named ``name`` after, when that node exists:
    TF1 ``gradients/<fwd>_grad/...`` -> ``<fwd>``; TF2
    ``gradient_tape/<a>/<b>/<op>`` -> the longest existing ``<a>/<b>``...;
    else None (aggregations, TF2 scope names, grappler-made names)."""
    if _GRAPPLER.match(name):
        return None
    # nodes an earlier fusion removed (the tensordot Reshape a bias fusion moved)
    # still name their gradient's ops: look them up among the names the graph had
    # when the fusion pass started (see fusion_pass.py), too
    before = getattr(graph, ORIGINAL_NAMES_ATTR, None) or ()

    def known(n):
        return n in graph.nodes or n in before

    # the scope before "gradients/" (an inlined call: "StatefulPartitionedCall/")
    # prefixes the forward ops' names too
    m = _TF1.match(name)
    if m is not None:
        for fwd in ((m.group(1) or "") + m.group(2), m.group(2)):
            if known(fwd):
                return fwd
        return None
    m = _TF2.match(name)
    if m is not None:
        parts = m.group(2).split("/")
        for k in range(len(parts) - 1, 0, -1):
            for cand in ((m.group(1) or "") + "/".join(parts[:k]), "/".join(parts[:k])):
                if known(cand):
                    return cand
    return None


def _tf2_scope_owner(name: str, fwd) -> str | None:
    """A TF2 tape gradient ``gradient_tape/<scope>/<op>`` whose scope is an F
    node's own scope (``.../softmax/mul`` for ``.../softmax/Softmax``) or name
    (``.../softmax/add/Shape``): that F node, else None."""
    m = _TF2.match(name)
    if m is None:
        return None
    for rest in ((m.group(1) or "") + m.group(2), m.group(2)):  # under an inlined call's scope, or not
        scope = rest.rsplit("/", 1)[0] if "/" in rest else ""
        for f in sorted(fwd):
            if rest.startswith(f + "/") or (scope and f.rsplit("/", 1)[0] == scope):
                return f
    return None


#: attribute of a Graph holding the node names it had when the fusion pass began
ORIGINAL_NAMES_ATTR = "_names_before_fusion"
#: attribute of a Graph holding (that set, ``Graph.removed_since``'s mark then)
ORIGINAL_MARK_ATTR = "_removal_mark_before_fusion"


def mark_original_names(graph, removed=()):
    """Record the names ``graph`` has now (:data:`ORIGINAL_NAMES_ATTR`) and
    the removal log's mark (:data:`ORIGINAL_MARK_ATTR`): the names of both
    gone since are the removed ones among them (:meth:`_Mirror.sync`).
    ``removed``: names of the graph as the fusion pass would have received
    it that are gone already (``prefuse.Prefused.removed``: the layer-norm
    fusions made before the parse)."""
    names = frozenset(graph.nodes).union(removed) if removed else frozenset(graph.nodes)
    setattr(graph, ORIGINAL_NAMES_ATTR, names)
    marks = graph.edit_marks()
    setattr(graph, ORIGINAL_MARK_ATTR, (names, marks[1]) if marks is not None else None)


@functools.lru_cache(maxsize=1 << 16)
def is_autodiff_name(name: str) -> bool:
    """Whether ``name`` is in an autodiff scope (``gradients[_N]/``, ``gradient_tape/``).
    (A function of the string: memoised, the region searches and the norm
    predicates ask it of the same names again and again.)"""
    return _AUTODIFF.search(name) is not None


class _Static:
    """Memoised "does this tensor's value depend on data?" (False = static)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.memo: dict[str, bool] = {}

    def __call__(self, name: str, depth: int = 0) -> bool:
        if name in self.memo:
            return self.memo[name]
        node = self.graph.nodes.get(name)
        if node is None or depth > 32:
            return False
        if node.op == "Const" or node.op in SHAPE_OPS:
            res = True
        elif node.op in _STATIC_ARITH:
            data = self.graph.data_inputs(node)
            res = bool(data) and all(self(parse_tensor(i)[0], depth + 1) for i in data)
        else:
            res = False
        self.memo[name] = res
        return res


def _shape_eq(a, b, partial: bool = False) -> bool:
    """Equal static shapes; with ``partial``, unknown dims (-1) count when both
    shapes have them at the same places (``[-1, 12, 128, 128]``: a dynamic batch)."""
    if a is None or b is None or list(a) != list(b):
        return False
    return min(a, default=0) >= 0 or (partial and max(a, default=0) > 0)



#: attribute of a Graph caching (positions, consumers index, edit mark, the
#: full sort's order list while the positions are that sort's unpatched, else
#: None) for :func:`_positions`
_POS_ATTR = "_grad_region_positions"
#: gap between a node created after the cached order and its latest input
_EPS = 1e-6


def _positions(graph: Graph) -> dict:
    """A topological position for every node (name -> number, inputs before
    readers), cheap across the fusions of one pass.

    ``Graph.topo_positions()`` is recomputed from scratch after every mutation
    (a whole-graph Kahn sort: ~40 ms on a 12-layer BERT training graph, once
    per region search).  Here the positions computed before are kept and
    patched: a node created since (``graph.created``: new nodes, and nodes
    re-emitted under their name) gets ``max(its inputs' positions) + eps``
    (created nodes in dependency order among themselves), then every node
    created or edited since the last call (``Graph.edits_since``; those
    before were checked then, and no kept position moves) is checked: each
    input before it, each reader after it.  Edges only change at
    such nodes (a node's inputs are its own), so the patched map is a valid
    topological order of the current graph; any violation, an untracked edit
    (``reindex()`` after a hand edit, ``touch_all``) or a loop (NextIteration
    back edges are outside the order) falls back to the full sort.  The search
    only needs *a* topological order: it tries a node after all of its inputs
    that may join the region.  The returned dict must not be mutated."""
    if graph.nodes_of_type(("NextIteration", "RefNextIteration")):
        return graph.topo_positions()
    fresh = graph._topo_cache is not None  # noqa: SLF001 - the sort is cached: free
    cached = getattr(graph, _POS_ATTR, None)
    changed, mark = graph.edits_since(cached[2] if cached is not None else 0)
    if fresh or cached is None or changed is None or cached[1] is not graph._consumers:  # noqa: SLF001
        pos = dict(graph.topo_positions())
        setattr(graph, _POS_ATTR, (pos, graph._consumers, mark, graph._topo_cache[0]))  # noqa: SLF001
        return pos
    # only the nodes edited since the last call: the ones before were checked
    # then, against positions that have not moved since (only new nodes get one)
    pos, full = cached[0], cached[3]
    nodes = graph.nodes
    changed = [n for n in dict.fromkeys(changed) if n in nodes]
    new = [n for n in changed if n not in pos]
    if new:
        # created nodes: a DFS over their created inputs, so each is placed after them
        pending, opened = set(new), set()
        stack = [(n, False) for n in sorted(new, reverse=True)]
        while stack:
            name, expanded = stack.pop()
            if name not in pending or (not expanded and name in opened):
                continue  # placed, or on a cycle (the check below sends it to the full sort)
            srcs = [parse_tensor(i)[0] for i in nodes[name].input[:]]
            if not expanded:
                opened.add(name)
                stack.append((name, True))
                stack.extend((s, False) for s in srcs if s in pending)
                continue
            pending.discard(name)
            pos[name] = max((pos[s] for s in srcs if s in pos), default=-1.0) + _EPS
        full = None  # (patched: no longer the sort's order)
    for name in changed:
        p = pos[name]
        for inp in nodes[name].input[:]:
            q = pos.get(parse_tensor(inp)[0])
            if q is not None and q >= p:
                break
        else:
            if all(pos.get(c, p + 1) > p for c, _ in graph._consumers.get(name, ())):
                continue
        pos = dict(graph.topo_positions())
        full = graph._topo_cache[0]  # noqa: SLF001
        break
    setattr(graph, _POS_ATTR, (pos, graph._consumers, mark, full))  # noqa: SLF001
    return pos


# ------------------------------------------------------------------ the search
def find_grad_region(graph: Graph, forward: Iterable[str], outputs: Iterable[str], inputs: Iterable[str],
                     shapes=None, protected=frozenset(), max_nodes: int = MAX_NODES,
                     dy_shape=None, grad_reads_output: bool = False,
                     partial_shapes: bool = False, side_outputs: Iterable[str] = (),
                     owner_scopes: Iterable[str] = ()) -> GradRegion:
    """See the module docstring.  ``shapes``: an object with ``shape(ref)``
    (:class:`graph_passes.fusion.core.ShapeOracle`); built when None.
    ``dy_shape``: the incoming gradient's static shape when the shape of
    ``outputs[0]`` is not known statically (a norm's output has x's shape).
    ``grad_reads_output``: the fused op's gradient is a function of its output
    (softmax: ``(dy - sum(dy * y)) * y``), so a node of G may read ``outputs``
    when it also reads ``dy`` or a tensor derived from it (a forward reader of y,
    such as a dropout, never does), and a non-aggregating node may combine ``dy``
    with a term derived from it (``Sub(dy, sum(dy * y))``).
    ``partial_shapes``: ``dy`` may have a partially known shape identical to
    ``outputs[0]``'s (unknown dims at the same places: a dynamic batch).
    ``side_outputs``: inner tensors of F that the fused op keeps producing under
    other outputs (a batch norm's batch mean and variance, which the moving
    averages read): G reads them like any inner tensor, and readers outside F
    and G are allowed (the rule rewires them onto the fused op's outputs).
    ``owner_scopes``: name scopes ('a/batchnorm/') holding only F's forward ops, some of
    which grappler removed before the pass (its AddOpsRewrite dissolves a batch norm's
    final Add into the residual unit's sums): an autodiff op under one, attributed to no
    existing node, counts as attributed to F."""
    if shapes is None:
        from .core import ShapeOracle
        shapes = ShapeOracle(graph)
    fwd = frozenset(forward)
    outs = [parse_tensor(o)[:2] for o in outputs]
    out_nodes_ports = {(n, p) for n, p in outs}
    ins = {_canon(i) for i in inputs}
    side = {_canon(o) for o in side_outputs}
    fscope = _common_scope(fwd)
    pos = _positions(graph)
    # with a topological order a path only goes to higher positions: searches may
    # stop there (not with loops: their back edges are outside the order)
    ordered = not graph.nodes_of_type(("NextIteration", "RefNextIteration"))
    y_shape = shapes.shape(next(iter(outputs)))
    if y_shape is None or (min(y_shape, default=0) < 0 and (dy_shape is not None or not partial_shapes)):
        y_shape = dy_shape

    def dy_candidate(ref) -> bool:
        """An external tensor that may be the incoming gradient: a float
        tensor shaped like the output (after_forward is asked after this)."""
        dt = graph.tensor_dtype(ref)
        return dt in registry.FLOAT_TYPES and _shape_eq(shapes.shape(ref), y_shape, partial_shapes)

    growth = None
    if native is not None and NATIVE_SEARCH and ordered:
        try:
            growth = _native_growth(graph, pos, fwd, outs, ins, side, fscope, owner_scopes, protected,
                                    max_nodes, grad_reads_output, dy_candidate)
        except GradRegionRefused as e:
            growth = e
    hints = growth[6] if isinstance(growth, tuple) and len(growth) > 6 and NATIVE_FINISH else None
    if growth is None or CHECK_NATIVE:
        try:
            reference = _python_growth(graph, pos, fwd, outs, ins, side, fscope, owner_scopes, protected,
                                       max_nodes, grad_reads_output, dy_candidate, ordered)
        except GradRegionRefused as e:
            reference = e
        if growth is not None:
            _check_same(growth, reference, fwd)
        growth = reference
    if isinstance(growth, GradRegionRefused):
        raise growth
    region, fwd_dep, dy_dep, val_static, why_not, dy0 = growth[:6]
    args = (graph, fwd, out_nodes_ports, side, pos, ordered, region, fwd_dep, dy_dep, val_static, why_not, dy0)
    if hints is None:
        return _finish(*args)
    if not CHECK_NATIVE:
        return _finish(*args, hints=hints)
    return _check_same_finish(args, hints)


def _python_growth(graph, pos, fwd, outs, ins, side, fscope, owner_scopes, protected, max_nodes,
                   grad_reads_output, dy_candidate, ordered):
    """Passes A and B in Python (the reference of :func:`_native_growth`):
    (region, fwd_dep, dy_dep, val_static, why_not, dy), or GradRegionRefused."""
    out_nodes_ports = {(n, p) for n, p in outs}
    is_static = _Static(graph)
    nodes = graph.nodes

    region: dict[str, None] = {}  # insertion-ordered set
    val_static: dict[str, bool] = {}
    fwd_dep: dict[str, bool] = {}
    dy_dep: dict[str, bool] = {}
    dy = [None]
    why_not: dict[str, str] = {}

    def fwd_inner_ref(ref):
        n, p, _ = parse_tensor(ref)
        return n in fwd and (n, p) not in out_nodes_ports

    roots: dict[str, str] = {}  # _identity_root per tensor (the graph does not change)

    def classify_input(ref):
        """'g' (region), 'f' (forward inner), 'in', 'static', 'dy', 'out', or 'ext'."""
        n, p, ctrl = parse_tensor(ref)
        if n in region:
            return "g"
        if (n, p) in out_nodes_ports:
            return "out"
        if n in fwd:
            return "f"
        if _canon(ref) in ins or from_inputs(n):
            return "in"
        if dy[0] is not None:
            root = roots.get(ref)
            if root is None:
                root = roots[ref] = _identity_root(graph, ref)
            if root == dy[0]:
                return "dy"
        if is_static(n):
            return "static"
        return "ext"

    in_memo: dict[str, bool] = {}

    def from_inputs(name, depth=0) -> bool:
        """A value computed only from the region's inputs and constants by a
        pure elementwise op (Pow's gradient takes log(x) where x > 0)."""
        if name in in_memo:
            return in_memo[name]
        node = nodes.get(name)
        res = False
        if node is not None and node.op in _FROM_INPUT_OPS and depth < 8 and name not in fwd:
            data = graph.data_inputs(node)
            res = bool(data) and all(_canon(d) in ins or is_static(parse_tensor(d)[0])
                                     or from_inputs(parse_tensor(d)[0], depth + 1) for d in data)
        in_memo[name] = res
        return res

    anc_memo: dict[str, bool] = {}

    def after_forward(ref) -> bool:
        """Whether ``ref`` depends on F's inner tensors (then it is not the
        incoming gradient: that comes from downstream, through y at most).
        Searched downstream from the inner nodes, never through the anchor
        (``outputs``' producer), only among nodes placed before ``ref``'s
        producer in the topological order (upstream from ``ref`` with no
        order: a training graph's whole forward pass lies above dy)."""
        start = parse_tensor(ref)[0]
        if start in anc_memo:
            return anc_memo[start]
        # side outputs, like the outputs, are values the fused op keeps producing
        side_nodes = {parse_tensor(o)[0] for o in side}
        inner = fwd - {n for n, _ in out_nodes_ports} - side_nodes
        anchors = {n for n, _ in out_nodes_ports} | side_nodes
        if ordered and start in pos:
            limit = pos[start]
            seen = set(inner)
            stack = [n for n in inner]
            hit = False
            while stack and not hit:
                for cname, _ in graph._consumers.get(stack.pop(), ()):
                    if cname == start:
                        hit = True
                        break
                    if cname in seen or cname in anchors or pos.get(cname, limit) >= limit:
                        continue
                    seen.add(cname)
                    stack.append(cname)
            anc_memo[start] = hit
            return hit
        seen, stack, hit = {start}, [start], False
        while stack and not hit:
            node = nodes.get(stack.pop())
            if node is None:
                continue
            for inp in node.input[:]:
                src = parse_tensor(inp)[0]
                if src in inner:
                    hit = True
                    break
                if src in seen or (src, 0) in out_nodes_ports:
                    continue
                seen.add(src)
                stack.append(src)
        anc_memo[start] = hit
        return hit

    owners: dict[str, str | None] = {}  # attributed_forward per name

    def try_add(name) -> bool:
        if name in region or name in fwd:
            return False
        node = nodes.get(name)
        if node is None:
            return False
        if node.op not in GRAD_OPS:
            why_not[name] = f"op {node.op} is not a gradient op"
            return False
        if name in protected:
            why_not[name] = "it is fetched or preserved"
            return False
        autodiff = is_autodiff_name(name)
        if not autodiff and node.op not in AGGREGATIONS:
            # an optimizer's Neg(grad) or Mul(grad, lr), a user's clip: not autodiff's
            why_not[name] = "its name is not in an autodiff scope (gradients/, gradient_tape/)"
            return False
        # (the graph does not change during a search: one answer per name)
        owner = owners.get(name, owners)
        if owner is owners:
            owner = owners[name] = attributed_forward(graph, name)
        if owner is not None and owner not in fwd:
            why_not[name] = f"its name makes it part of the gradient of '{owner}'"
            return False
        # an autodiff op attributed to no node (TF2 names ops after the forward op's
        # scope; grappler may have renamed the forward op) must lie under F's own
        # scope: the gradient of a renamed op upstream of x does not
        outside_scope = (owner is None and fscope and autodiff and not _under_scope(name, fscope))
        if owner is None:
            owner = _tf2_scope_owner(name, fwd)
        if owner is None and autodiff and any(_under_scope(name, sc) for sc in owner_scopes):
            owner = next(iter(sorted(fwd)))
        kinds = []  # (kind, input ref, source node) per input (ctrl_ext for outside control inputs)
        new_dy = None
        ctrl_in_region = False  # a control input from G (not in kinds)
        for inp in node.input[:]:
            src, _, ctrl = parse_tensor(inp)
            if ctrl:
                if src in region:
                    ctrl_in_region = True
                    continue
                if src in fwd or (dy[0] is not None and src == parse_tensor(dy[0])[0]):
                    continue
                if is_static(src):
                    continue
                kinds.append(("ctrl_ext", inp, src))
                continue
            k = classify_input(inp)
            if k == "ext":
                if dy[0] is None and new_dy is None and dy_candidate(inp) and not after_forward(inp):
                    new_dy = _identity_root(graph, inp)
                    k = "dy"
                else:
                    why_not[name] = f"it reads '{inp}', which is neither the gradient nor the fused region's"
                    return False
            if k == "out" and not grad_reads_output:
                why_not[name] = f"it reads the fused op's output '{inp}'"
                return False
            kinds.append((k, inp, src))
        data_kinds = [k for k, _, _ in kinds if k != "ctrl_ext"]
        reads_dy = "dy" in data_kinds
        # a data input from G that depends on dy (one lookup for the checks below)
        g_dy = any(k == "g" and dy_dep.get(src) for k, _, src in kinds)
        op = node.op
        if outside_scope and not (op in AGGREGATIONS and data_kinds and all(k == "g" for k in data_kinds)) \
                and not (op in VALUE_STATIC_OPS and data_kinds and all(k in ("f", "static") for k in data_kinds)) \
                and op not in ("NoOp", "Const"):
            why_not[name] = f"its name is outside the fused ops' scope '{fscope}'"
            return False
        if not autodiff and any(k != "g" for k in data_kinds):
            why_not[name] = "a sum outside an autodiff scope that reads more than the region"
            return False
        if op in AGGREGATIONS and reads_dy:
            why_not[name] = "it sums the incoming gradient with another gradient (a residual path)"
            return False
        if "out" in data_kinds and not (reads_dy or new_dy is not None or g_dy):
            why_not[name] = "it reads the fused op's output but no gradient (a forward reader)"
            return False
        if reads_dy and not grad_reads_output and g_dy:
            why_not[name] = "it combines the incoming gradient with a gradient already derived from it"
            return False
        if not node.input:
            return False
        # an input (data or control) from G
        from_g = ctrl_in_region or "g" in data_kinds
        if not from_g and "f" not in data_kinds and not reads_dy:
            return False
        via_dy = not from_g and "f" not in data_kinds
        if via_dy and (owner is None or op in AGGREGATIONS):
            why_not[name] = "it reads only the incoming gradient and its name ties it to no fused op"
            return False
        if new_dy is not None:
            dy[0] = new_dy
        region[name] = None
        fwd_dep[name] = any((k == "f" and op not in VALUE_STATIC_OPS) or (k == "g" and fwd_dep.get(src))
                            for k, _, src in kinds)
        dy_dep[name] = reads_dy or g_dy
        # the value depends on no data (only shapes): Shape(inner), ZerosLike(inner), int math on them
        val_static[name] = op in VALUE_STATIC_OPS or (
            op in _STATIC_ARITH and all(k == "static" or (k == "g" and val_static.get(src))
                                        for k, _, src in kinds if k != "ctrl_ext"))
        if len(region) > max_nodes:
            raise GradRegionRefused(f"the gradient region grew beyond {max_nodes} nodes")
        return True

    # ---- pass A finds dy (the first external tensor shaped like the output that a
    #      would-be gradient node reads, in topological order); pass B grows G
    #      from the readers of F's inner tensors and of dy, in topological order,
    #      so every input a node may take from G is decided before the node is
    seeds = []
    for f in fwd:
        for cname, _ in graph._consumers.get(f, ()):
            if cname not in fwd:
                seeds.append(cname)
    # pass A's only product is dy, set once by the try that finds it (never
    # changed after): stop there (STOP_AT_DY; see its comment for the one case
    # where the reference differs)
    _grow(graph, seeds, try_add, pos, region, stop=(lambda: dy[0] is not None) if STOP_AT_DY else None)
    found = dy[0]
    if found is None:
        raise _no_dy_refusal(graph, fwd, why_not)
    region.clear(); fwd_dep.clear(); dy_dep.clear(); why_not.clear(); val_static.clear()
    dsrc, dport, _ = parse_tensor(found)
    dy_readers = [c for c, _ in graph.consumers(dsrc, port=dport)] + \
                 [c for c, i in graph._consumers.get(dsrc, ()) if i < 0]
    # and the readers of its Identity aliases (TF1 tuples: Identity(dy, ^group_deps))
    stack = [c for c in dy_readers if nodes[c].op in ("Identity", "Snapshot")]
    seen_alias = set()
    while stack:
        a = stack.pop()
        if a in seen_alias or _identity_root(graph, a) != found:
            continue
        seen_alias.add(a)
        for c, i in graph._consumers.get(a, ()):
            dy_readers.append(c)
            if i >= 0 and nodes[c].op in ("Identity", "Snapshot"):
                stack.append(c)
    _grow(graph, seeds + dy_readers, try_add, pos, region)
    if dy[0] != found:
        raise GradRegionRefused("not fused: the incoming gradient is not one tensor")
    return region, fwd_dep, dy_dep, val_static, why_not, dy[0]


# ------------------------------------------------------------------ the C++ search
#: (issue 17) passes A and B in C++ (custom_ops/grad_region.cc): an object
#: with the library's mirror and search calls (``npu_amp_tf.bridge``
#: installs it when the library is loaded; graph_passes never imports
#: npu_amp_tf); None: Python grows every region
native = None
#: False: Python grows the regions (the reference; the same regions, dy,
#: flags and refusal texts)
NATIVE_SEARCH = True
#: run both searches and compare them (AssertionError on a difference); the
#: test suite sets NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION=1
CHECK_NATIVE = os.environ.get("NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION") == "1"
#: attribute of a Graph holding its :class:`_Mirror`
_MIRROR_ATTR = "_grad_region_mirror"


def _op_sets() -> bytes:
    """The op sets the C++ side reads (``NpuAmpGrMirrorOps``): the search's,
    then the shape walk's (``graph_passes.shapes``)."""
    return "\x03".join("\x01".join(sorted(ops)) for ops in (
        GRAD_OPS, _STATIC_ARITH, _FROM_INPUT_OPS, AGGREGATIONS, SHAPE_OPS, VALUE_STATIC_OPS,
        _shapes._SAME_SHAPE, _shapes._BROADCAST, _shapes._MATMUL, _shapes._BATCH_MATMUL,
        _shapes._REDUCE)).encode()


def _lean_nodes(nodes) -> bytes:
    """A serialized GraphDef of ``nodes`` with only their names, ops and inputs."""
    from tensorflow.core.framework import graph_pb2

    gd = graph_pb2.GraphDef()
    for n in nodes:
        gd.node.add(name=n.name, op=n.op, input=n.input[:])
    return gd.SerializeToString()


#: (issue 17) a sync sends the nodes edited since the last one as text
#: (:func:`_lean_text`, ``NpuAmpGrMirrorUpsertText``); False: the reference,
#: a GraphDef of them (:func:`_lean_nodes`), built, serialized and parsed
LEAN_TEXT = True


def _lean_text(nodes) -> bytes | None:
    """``nodes``' names, ops and inputs as the C++ mirror's text: records
    joined by \\x02, fields by \\x01; None when a field holds a separator or
    a non-ASCII character (then :func:`_lean_nodes`: the mirror refuses such
    names itself)."""
    records, fields = [], 0
    for n in nodes:
        ins = n.input[:]
        records.append("\x01".join((n.name, n.op, *ins)))
        fields += 1 + len(ins)
    try:
        data = "\x02".join(records).encode("ascii")
    except UnicodeEncodeError:
        return None
    if data.count(b"\x01") != fields or data.count(b"\x02") != len(records) - 1:
        return None
    return data


#: (issue 17) a full order's positions (:func:`_positions` after a sort) go
#: to the mirror by the loaded graph's node indexes, from the sort's node ids
#: (``Graph.topo_ranks``; ``NpuAmpGrMirrorPositionsBase``), with only the
#: nodes created since by name; False: the reference, every node's name and
#: position (BERT-12: 9k names joined, encoded and looked up, ~1.3 ms).
#: CHECK_NATIVE reads the positions back and compares them
POSITIONS_BY_INDEX = True
#: how many full orders went by index (for tests); (CHECK_NATIVE) how many were read back
POSITIONS_SENT_BY_INDEX = [0, 0]


class _Mirror:
    """The C++ copy of a graph's names, ops and inputs (and the search's
    positions), kept in step through ``Graph.edits_since`` /
    ``removed_since``: the same bookkeeping ``_positions`` and
    ``serialize_patch`` rely on (edits go through Graph's methods or
    ``touch``)."""

    def __init__(self, lib, graph, background: bool = False):
        """``background``: load the graph as created on a C++ helper thread
        (:func:`preload`); the first :meth:`sync` waits for it."""
        self.lib = lib
        self.h = lib.new()
        self.ok = bool(self.h) and lib.ops(self.h, _op_sets()) == 0
        self.mark = self.rmark = 0
        self.cons = graph._consumers  # noqa: SLF001 - replaced by reindex(): build again
        self.pos = None
        self.before = None
        #: the bytes the helper thread reads (kept alive until it is joined), or None
        self.pending = None
        #: (issue 17) loaded from the graph's own bytes: the C++ shape walk
        #: reads their attrs (a mirror of names, ops and inputs only: False)
        self.attrs = False
        #: live nodes synced without positions (a names-only sync, for the shape walk)
        self.unpos = []
        if not self.ok:
            return
        src = graph.source_bytes
        if callable(src):
            src = src()
        if src is not None and not graph.duplicates:
            # the graph as created, then every edit since
            if background and lib.load_async(self.h, src) == 0:
                self.pending = src
            else:
                self.ok = lib.load(self.h, src, True) == 0
            self.attrs = True
        else:
            self.ok = lib.load(self.h, _lean_nodes(graph.nodes.values()), True) == 0
            self.mark, self.rmark = graph.edit_marks()

    def __del__(self):
        h, self.h = getattr(self, "h", None), None
        if h:
            try:
                self.lib.free(h)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
                pass

    def _upsert(self, nodes) -> int:
        """Send ``nodes`` (edited or created since the last sync): 0 ok."""
        data = _lean_text(nodes) if LEAN_TEXT else None
        rc = self.lib.upsert_text(self.h, data) if data is not None else None
        return self.lib.load(self.h, _lean_nodes(nodes), False) if rc is None else rc

    def _positions_by_index(self, graph, pos) -> bool:
        """Send ``pos``, a full order's positions, by index (see
        :data:`POSITIONS_BY_INDEX`); False (nothing sent) when it cannot."""
        cached = getattr(graph, _POS_ATTR, None)
        if (not POSITIONS_BY_INDEX or cached is None or cached[0] is not pos or cached[3] is None or not self.attrs
                or not getattr(self.lib, "can_positions_base", False) or graph.duplicates
                or not graph._seq_is_base or graph._base_names is None):  # noqa: SLF001
            return False
        ranks = graph.topo_ranks(cached[3])
        if ranks is None:
            return False
        nb = len(graph._base_names)  # noqa: SLF001 - ids below it: the input's nodes, in order
        extra = (np.flatnonzero(ranks[nb:] >= 0) + nb).tolist()
        id_name = graph._id_name  # noqa: SLF001
        names = [id_name[k] for k in extra]
        if self.lib.positions_base(self.h, np.ascontiguousarray(ranks[:nb]), names,
                                   ranks[extra].astype(np.float64).tolist()) != 0:
            return False
        POSITIONS_SENT_BY_INDEX[0] += 1
        if CHECK_NATIVE:
            POSITIONS_SENT_BY_INDEX[1] += 1
            got = self.lib.positions_of(self.h, list(pos))
            if got != [float(v) for v in pos.values()]:
                diff = [n for n, a, b in zip(pos, got or [], pos.values()) if a != b][:5]
                CHECKED[1].append((["positions"], diff, None))
                raise AssertionError(f"the positions sent by index differ from the order's at {diff}")
        return True

    def sync(self, graph, pos) -> bool:
        """Bring the mirror up to ``graph`` and ``pos``; False when it cannot.
        ``pos`` None: the nodes only (the shape walk's); their positions go
        with the next sync that has them."""
        lib, h = self.lib, self.h
        if (pos is None and self.pending is None and graph.edit_marks() == (self.mark, self.rmark)
                and getattr(graph, ORIGINAL_NAMES_ATTR, None) is self.before):
            return True  # (nothing to send)
        if self.pending is not None:
            rc = lib.wait(h)
            self.pending = None
            if rc != 0:
                return False
        changed, mark = graph.edits_since(self.mark)
        if changed is None:
            return False
        removed, rmark = graph.removed_since(self.rmark)
        nodes = graph.nodes
        names = list(dict.fromkeys(changed + removed))
        live = [n for n in names if n in nodes]
        gone = [n for n in names if n not in nodes]
        if live and self._upsert([nodes[n] for n in live]) != 0:
            return False
        if gone:
            lib.remove(h, "\x01".join(gone).encode())
        self.mark, self.rmark = mark, rmark
        # attributed_forward's known names: the live nodes', and those of the
        # names the graph had when the fusion pass began that are gone since
        before = getattr(graph, ORIGINAL_NAMES_ATTR, None)
        if before is not self.before:
            lib.before(h, "\x01".join(_gone_before(graph, before)).encode(), True)
            self.before = before
        elif before and removed:
            gone_before = [n for n in removed if n in before]
            if gone_before:
                lib.before(h, "\x01".join(gone_before).encode(), False)
        if pos is None:
            self.unpos.extend(live)
            return True
        if pos is not self.pos:
            if not self._positions_by_index(graph, pos) and lib.positions(h, list(pos), list(pos.values()),
                                                                          True) != 0:
                return False
            self.pos = pos
            self.unpos = []
        elif live or self.unpos:
            nan = float("nan")
            live, self.unpos = self.unpos + live, []
            if lib.positions(h, live, [pos.get(k, nan) for k in live], False) != 0:
                return False
        return True


#: (issue 17) :func:`_gone_before` reads the removal log since the fusion
#: pass began (the nodes removed since) instead of testing every name the
#: graph had then (BERT-12: 9k names; BERT-48: 35k, ~5 ms); False: the
#: reference.  The C++ side keeps the names as a set: the same set either way
GONE_FROM_LOG = True


def _gone_before(graph, before) -> list:
    """The names in ``before`` (:data:`ORIGINAL_NAMES_ATTR`) that are no
    longer nodes of ``graph``: those the graph removed since it recorded them
    (:func:`mark_original_names`), which are in ``before`` and not back."""
    if not before:
        return []
    nodes = graph.nodes
    start = getattr(graph, ORIGINAL_MARK_ATTR, None) if GONE_FROM_LOG else None
    if start is not None and start[0] is before and graph.edit_marks() is not None:
        removed, _ = graph.removed_since(start[1])
        return [n for n in dict.fromkeys(removed) if n in before and n not in nodes]
    return [n for n in before if n not in nodes]


#: (issue 17) :func:`preload`: the fusion pass has the mirror's first load
#: (the graph as created, ~3 ms on a 12-layer BERT training graph) run on a
#: C++ helper thread from when it begins, overlapping the rules before the
#: first search.  False: the reference, loaded by the first search
PRELOAD = True


def preload(graph) -> bool:
    """Start loading ``graph``'s :class:`_Mirror` on a C++ helper thread
    (:data:`PRELOAD`) and keep it for :func:`_mirror`, which syncs it with
    every edit made since the graph was created.  True when the load started;
    False (nothing kept: the first search loads it) when the C++ search is off
    or cannot run on this graph, a mirror exists, or no thread was had."""
    if (not PRELOAD or native is None or not NATIVE_SEARCH or graph.duplicates
            or getattr(graph, _MIRROR_ATTR, None) is not None or graph.edit_marks() is None
            or graph.nodes_of_type(("NextIteration", "RefNextIteration"))):
        return False
    m = _Mirror(native, graph, background=True)
    if not m.ok or m.pending is None:
        return False
    setattr(graph, _MIRROR_ATTR, m)
    return True


def _mirror(graph, pos):
    """The graph's synced :class:`_Mirror`, or None (then Python searches).
    ``pos`` None: synced without positions (see :meth:`_Mirror.sync`)."""
    m = getattr(graph, _MIRROR_ATTR, None)
    if m is False:
        return None  # (refused once: names the C++ search does not take)
    if graph.edit_marks() is None:
        return None  # (touch_all: the edits are not known)
    if m is None or m.cons is not graph._consumers:  # noqa: SLF001 - reindex() made a new index
        m = _Mirror(native, graph)
        if not m.ok:
            setattr(graph, _MIRROR_ATTR, False)
            return None
        setattr(graph, _MIRROR_ATTR, m)
    if not m.sync(graph, pos):
        setattr(graph, _MIRROR_ATTR, False)
        return None
    return m


#: (issue 17) the fusion pass's ``ShapeOracle`` has its producer walks
#: (``shapes.local_shape``) done in C++ over the mirror (``NpuAmpGrShape``),
#: which answers as the Python walk does or leaves the tensor to it; BERT-12:
#: the first incoming-gradient candidate's shape walks ~760 nodes of the
#: forward pass (4.5 ms in Python).  False: the reference, Python walks all.
#: CHECK_NATIVE walks both ways and compares every answer
NATIVE_SHAPES = True
#: (CHECK_NATIVE) the shape answers compared
CHECKED_SHAPES = [0]
#: (CHECK_NATIVE) the layer-norm analyses compared (builtin._native_norms)
CHECKED_NORMS = [0]


class _ShapeAsk:
    """``ask`` of :func:`graph_passes.shapes.local_shape`: the C++ walk over
    the graph's mirror (synced first, names only), with a memo of its own
    for one ``ShapeOracle``.  ``reference`` (CHECK_NATIVE): the Python
    walk's memo, kept beside to compare each answer (:meth:`check`)."""

    def __init__(self, graph):
        self.graph = graph
        self.memo = native.shape_memo()
        self.buf = native.shape_buffer()
        self.reference = {} if CHECK_NATIVE else None
        weakref.finalize(self, native.free_shape_memo, self.memo)

    def __call__(self, ref):
        m = _mirror(self.graph, None)
        if m is None or not m.attrs or not self.memo:
            return _shapes.UNANSWERED
        ok, sh = native.shape(m.h, self.memo, ref, self.buf)
        return sh if ok else _shapes.UNANSWERED

    def check(self, ref, got):
        want = _shapes.local_shape(self.graph, ref, self.reference)
        CHECKED_SHAPES[0] += 1
        if want != got:
            CHECKED[1].append((["shape", ref], got, want))
            raise AssertionError(f"the C++ shape walk differs from the Python one for {ref!r}: "
                                 f"C++ {got!r}, Python {want!r}")


def shape_asker(graph):
    """A :class:`_ShapeAsk` for a ``ShapeOracle`` of ``graph`` when the C++
    walk can run (:data:`NATIVE_SHAPES`, the library has it, and the graph
    has a mirror, made by the fusion pass when it may search); else None."""
    if not NATIVE_SHAPES or native is None or not getattr(native, "can_shape", False):
        return None
    m = getattr(graph, _MIRROR_ATTR, None)
    if not isinstance(m, _Mirror) or not m.attrs:
        return None
    return _ShapeAsk(graph)


def _native_growth(graph, pos, fwd, outs, ins, side, fscope, owner_scopes, protected, max_nodes,
                   grad_reads_output, dy_candidate):
    """:func:`_python_growth` in C++: the same result, or None when the C++
    search cannot run here (then Python searches)."""
    m = _mirror(graph, pos)
    if m is None:
        return None
    request = "\x03".join((
        "\x02".join(fwd),
        "\x02".join(f"{n}\x01{p}" for n, p in outs),
        "\x02".join(ins),
        "\x02".join(side),
        fscope,
        "\x02".join(owner_scopes),
        "\x02".join(protected),
        str(int(max_nodes)),
        f"{int(bool(grad_reads_output))}\x02{int(bool(STOP_AT_DY))}",
    ))
    try:
        data = request.encode("ascii")
    except UnicodeEncodeError:
        return None
    status, text = native.search(m.h, data, dy_candidate)
    if status == 3:
        return None
    _, refusal, dy, region_s, why_s, *hints_s = text.split("\x03")
    why_not = dict(w.split("\x01", 1) for w in why_s.split("\x02")) if why_s else {}
    if status == 1:
        raise GradRegionRefused(refusal, why_not)
    if status == 2:
        raise _no_dy_refusal(graph, fwd, why_not)
    # (issue 17) "name\x01flags" items: the four maps built with C-level maps
    parts = region_s.replace("\x02", "\x01").split("\x01") if region_s else []
    names, flags = parts[0::2], list(map(int, parts[1::2]))
    region = dict.fromkeys(names)
    fwd_dep, dy_dep, val_static = (dict(zip(names, map(bool, map(and_, flags, repeat(bit)))))
                                   for bit in (1, 2, 4))
    return region, fwd_dep, dy_dep, val_static, why_not, dy, _hints(hints_s, len(region))


def _hints(parts, n):
    """The C++ search's hints for :func:`_finish` (``FinishHints`` in
    custom_ops/grad_region.cc): (ok1, ok2, cycle, order, boundary), or None."""
    if len(parts) != 1:
        return None
    ok1, ok2, cycle, order, boundary = parts[0].split("\x02")
    order = [int(i) for i in order.split(",")] if order else []
    if len(order) != n:
        return None
    return ok1 == "1", ok2 == "1", int(cycle), order, [int(i) for i in boundary.split(",")] if boundary else []


def _outcome(growth):
    if isinstance(growth, GradRegionRefused):
        return ("refused", str(growth), list(growth.why_not.items()))
    region, fwd_dep, dy_dep, val_static, why_not, dy = growth[:6]
    return ("grown", list(region), [(n, bool(fwd_dep.get(n)), bool(dy_dep.get(n)), bool(val_static.get(n)))
                                    for n in region], list(why_not.items()), dy)


#: (CHECK_NATIVE) [searches compared, the differences found (searches' and
#: finishes')]; [finishes compared, with and without the hints]
CHECKED = [0, []]
CHECKED_FINISH = [0]


def _check_same(native_growth, reference, fwd):
    a, b = _outcome(native_growth), _outcome(reference)
    CHECKED[0] += 1
    if a != b:
        CHECKED[1].append((sorted(fwd), a, b))
        raise AssertionError(f"the C++ gradient-region search differs from the Python one for "
                             f"{sorted(fwd)[:3]}...:\n  C++:    {a!r}\n  Python: {b!r}")


def _no_dy_refusal(graph, fwd, why_not):
    f, c = next(((f, c) for f in sorted(fwd) for c, _ in graph._consumers.get(f, ()) if c not in fwd), ("?", "?"))
    return GradRegionRefused(f"not fused: '{f}' is also read by '{c}', and no incoming gradient (a float "
                             f"tensor shaped like the output) was found", why_not)


#: (issue 17) :func:`_finish` takes the C++ search's hints (``FinishHints``:
#: its two checks' verdicts, the region's order, the nodes on its boundary,
#: the control-cycle check) and walks only the boundary's nodes; a check the
#: hints fail (or a cycle they cannot exclude) is run in Python for its
#: message.  False: the reference, every node walked in Python.  CHECK_NATIVE
#: runs both and compares them
NATIVE_FINISH = True


def _finish(graph, fwd, out_nodes_ports, side, pos, ordered, region, fwd_dep, dy_dep, val_static, why_not, dy0,
            hints=None):
    """The checks after the growth (both searches), and the GradRegion.
    ``hints``: the C++ search's (:data:`NATIVE_FINISH`), or None."""
    if hints is None:
        _check_readers(graph, fwd, out_nodes_ports, side, region, why_not)
        _check_forward_leaks(graph, region, fwd_dep, dy_dep, val_static, why_not)
        order = sorted(region, key=lambda n: pos.get(n, 0))
        boundary, cycle = order, None
    else:
        ok1, ok2, cycle, order_idx, boundary_idx = hints
        if not ok1:
            _check_readers(graph, fwd, out_nodes_ports, side, region, why_not)
        if not ok2:
            _check_forward_leaks(graph, region, fwd_dep, dy_dep, val_static, why_not)
        names = list(region)
        order = [names[i] for i in order_idx]
        boundary = [order[k] for k in boundary_idx]
    outputs_map, ctrl_in, ctrl_out = _boundary(graph, boundary, region, fwd)
    if ctrl_in and cycle != 1:
        _check_no_cycle(graph, region, ctrl_in, pos if ordered else None)
    return GradRegion(fwd, order, dy0, outputs_map, ctrl_in, ctrl_out, fwd_dep, dy_dep, graph)


def _check_readers(graph, fwd, out_nodes_ports, side, region, why_not):
    """Every reader of an inner tensor is in F or G."""
    nodes = graph.nodes
    for f in sorted(fwd):
        for cname, idx in graph._consumers.get(f, ()):
            if cname in fwd or cname in region:
                continue
            if (f, parse_tensor(nodes[cname].input[idx])[1] if idx >= 0 else -1) in out_nodes_ports:
                continue  # reads the fused op's output: stays valid
            if idx < 0 and (f, 0) in out_nodes_ports:
                continue  # control edge on the anchor: the fused op keeps its name
            if idx >= 0 and _canon(nodes[cname].input[idx]) in side:
                continue  # reads a statistic the fused op keeps producing: the rule rewires it
            extra = f" ({why_not[cname]})" if cname in why_not else ""
            raise GradRegionRefused(f"not fused: '{f}' is also read by '{cname}'{extra}", why_not)


def _check_forward_leaks(graph, region, fwd_dep, dy_dep, val_static, why_not):
    """A gradient is linear in dy: a tensor leaving G that is computed from
    F's values without dy is forward code (the gradient's own forward-only
    helpers, such as Square's 2*x, stay inside G)."""
    nodes = graph.nodes
    for name in region:
        if nodes[name].op == "NoOp" or dy_dep.get(name) or val_static.get(name) or not fwd_dep.get(name):
            continue
        if any(c not in region and i >= 0 for c, i in graph._consumers.get(name, ())):
            raise GradRegionRefused(f"not fused: '{name}' reads the fused region's inner tensors and does not "
                                    f"depend on the incoming gradient (it is not part of the gradient)", why_not)


def _boundary(graph, names, region, fwd):
    """(outputs map, control inputs, control consumers) of G from its nodes
    ``names`` (in G's order; a node with no input from outside F and G and no
    reader outside G adds nothing)."""
    nodes = graph.nodes
    outputs_map: dict[str, list] = {}
    ctrl_in, ctrl_out = [], []
    for name in names:
        node = nodes[name]
        for inp in node.input[:]:
            src, _, ctrl = parse_tensor(inp)
            if ctrl and src not in region and src not in fwd and src not in ctrl_in:
                ctrl_in.append(src)
        for cname, idx in graph._consumers.get(name, ()):
            if cname in region:
                continue
            if idx < 0:
                if cname not in ctrl_out:
                    ctrl_out.append(cname)
                continue
            ref = _canon(nodes[cname].input[idx])
            outputs_map.setdefault(ref, []).append((cname, idx))
    return outputs_map, ctrl_in, ctrl_out


def _finish_outcome(args, hints):
    try:
        r = _finish(*args, hints=hints)
    except GradRegionRefused as e:
        return ("refused", str(e), list(e.why_not.items())), e
    return ("found", r.nodes, r.dy, list(r.outputs.items()), r.ctrl_inputs, r.ctrl_consumers), r


def _check_same_finish(args, hints):
    """(CHECK_NATIVE) :func:`_finish` with the hints and without: the same
    GradRegion, or the same refusal; returns (or raises) it."""
    a, got = _finish_outcome(args, hints)
    b, _ = _finish_outcome(args, None)
    CHECKED_FINISH[0] += 1
    if a != b:  # (with the searches' differences: the test session fails on any)
        CHECKED[1].append((sorted(args[1]), a, b))
        raise AssertionError(f"_finish with the C++ search's hints differs from the reference for "
                             f"{sorted(args[1])[:3]}...:\n  hinted:    {a!r}\n  reference: {b!r}")
    if isinstance(got, GradRegionRefused):
        raise got
    return got


def _common_scope(names) -> str:
    """The longest common name scope ('a/b/') of the forward nodes, '' if none."""
    parts = [n.split("/")[:-1] for n in names]
    if not parts:
        return ""
    common = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    return "/".join(common) + "/" if common else ""


def _under_scope(name: str, scope: str) -> bool:
    """Whether autodiff op ``name``'s forward path (``gradient_tape/<path>``,
    ``gradients/<path>_grad``, after any call scope) starts with ``scope``."""
    for rx in (_TF2, _TF1):
        m = rx.match(name)
        if m is not None:
            return ((m.group(1) or "") + m.group(2)).startswith(scope) or m.group(2).startswith(scope)
    return True


def _identity_root(graph: Graph, ref: str) -> str:
    """The tensor an Identity/Snapshot chain copies (TF1's gradient tuples make
    several ``Identity(dy, ^group_deps)`` aliases of one incoming gradient)."""
    for _ in range(32):
        n, p, c = parse_tensor(ref)
        node = graph.nodes.get(n)
        if node is None or c or p != 0 or node.op not in ("Identity", "Snapshot"):
            break
        data = graph.data_inputs(node)
        if not data:
            break
        ref = data[0]
    return _canon(ref)


def _canon(ref: str) -> str:
    n, p, c = parse_tensor(ref)
    return ("^" + n) if c else (n if p == 0 else f"{n}:{p}")


def _grow(graph, seeds, try_add, pos, region, stop=None):
    """Try nodes in topological order (a heap on the position), each once;
    the readers of every node that joins are queued.  ``stop``: called after
    every node that joins; True ends the growth there."""
    import heapq

    heap = [(pos.get(n, 0), n) for n in set(seeds)]
    heapq.heapify(heap)
    done = set()
    while heap:
        _, name = heapq.heappop(heap)
        if name in done:
            continue
        done.add(name)
        if try_add(name):
            if stop is not None and stop():
                return
            for cname, _ in graph._consumers.get(name, ()):
                if cname not in region and cname not in done:
                    heapq.heappush(heap, (pos.get(cname, 0), cname))


def _check_no_cycle(graph: Graph, region, ctrl_in, pos=None):
    """G's external control inputs move onto the replacement: none may depend on G.
    ``pos``: topological positions; a node placed after every target reaches none."""
    targets = set(ctrl_in)
    last = max((pos.get(t, float("inf")) for t in targets), default=0) if pos is not None else None
    seen = set(region)
    stack = list(region)
    steps = 0
    while stack:
        name = stack.pop()
        for cname, _ in graph._consumers.get(name, ()):
            if cname in seen:
                continue
            if cname in targets:
                raise GradRegionRefused(f"the gradient region waits on '{cname}', which depends on it")
            seen.add(cname)
            if last is not None and pos.get(cname, last) > last:
                continue
            stack.append(cname)
            steps += 1
            if steps > 200000:
                raise GradRegionRefused("control-dependency check too large")


# ------------------------------------------------------------------ outputs
def _alias_root(graph: Graph, region: GradRegion, ref: str) -> str:
    """Follow Identity/Snapshot/Reshape-by-static-shape inside G to the tensor
    this one is a copy (or reshape) of."""
    members = set(region.nodes)
    seen = 0
    while seen < 16:
        n, p, _ = parse_tensor(ref)
        node = graph.nodes.get(n)
        if node is None or n not in members or p != 0:
            return ref
        if node.op in ("Identity", "Snapshot", "Reshape", "StopGradient"):
            src = graph.data_inputs(node)[0]
            if parse_tensor(src)[0] not in members:
                return ref
            ref = _canon(src)
            seen += 1
            continue
        return ref
    return ref


def assign_outputs(region: GradRegion, graph: Graph, classify: Callable[[str], str | None],
                   summed=("dx",)) -> dict:
    """Give every tensor leaving G a role (see the module docstring)."""
    roles: dict[str, list] = {}
    for ref in region.outputs:
        role = classify(ref)
        if role is None:
            from .. import registry
            dt = graph.tensor_dtype(ref)
            raise GradRegionRefused(
                f"not fused: the gradient tensor '{ref}' ({registry.dtype_name(dt) if dt is not None else '?'}) "
                f"read by '{region.outputs[ref][0][0]}' is none of the fused gradient's outputs")
        roles.setdefault(role, []).append(ref)
    terms = {}
    for role, refs in roles.items():
        if role in summed and len(refs) > 1:
            aggs = {c for r in refs for c, _ in region.outputs[r]}
            if len(aggs) != 1:
                raise GradRegionRefused(f"not fused: the partial {role} terms {refs} are read by "
                                        f"{sorted(aggs)}, not summed by one node")
            agg = aggs.pop()
            node = graph.nodes[agg]
            if node.op not in AGGREGATIONS:
                raise GradRegionRefused(f"not fused: the partial {role} terms meet in '{agg}' ({node.op}), "
                                        f"not in a sum")
            ins = [_canon(i) for i in graph.data_inputs(node)]
            for r in refs:
                if ins.count(r) != 1:
                    raise GradRegionRefused(f"not fused: '{agg}' reads the {role} term '{r}' "
                                            f"{ins.count(r)} times")
            terms[role] = Term(role, refs, agg)
            continue
        if len(refs) > 1:
            roots = {_alias_root(graph, region, r) for r in refs}
            if len(roots) != 1:
                raise GradRegionRefused(f"not fused: {len(refs)} different tensors {refs} look like {role}")
        terms[role] = Term(role, refs, None)
    return terms


__all__ = ["find_grad_region", "assign_outputs", "attributed_forward", "is_autodiff_name", "GradRegion", "Term",
           "GradRegionRefused", "GRAD_OPS", "AGGREGATIONS", "SHAPE_OPS"]
