"""The fusion rule registry and the machinery that applies a rule.

A rule is a :class:`~graph_passes.pattern.Pat` plus a ``build`` function::

    @fusion_rule("my_op+relu", Pat("Relu", inputs=[Pat("MyOp", name="op",
                                                       inputs=[Pat.any("x")])]))
    def build(m, b):
        #  m: the Match (m["op"] is a NodeDef, m["x"] a tensor reference)
        #  b: the Builder; b.emit(...) declares the replacement nodes
        b.emit("MyOpRelu", m.anchor, [m["x"]], attrs={"T": b.attr_of("op", "T")})
        #  return None (or nothing) = the anchor's outputs become the outputs of
        #  the node emitted with the anchor's name; return False = do not fuse

The framework (:func:`apply_rule`) then

1. checks every emitted node's op against the kernel registry for its device
   type and type attrs (and, for rules marked ``follows_precision``, for the
   low dtype the precision pass will give it).  Any miss: the match is
   skipped, the reason goes to the report, the graph is untouched;
2. removes the matched nodes, adds the emitted ones (a node emitted under the
   anchor's name takes over the anchor's consumers), moves control inputs of
   removed nodes onto the replacement, and deletes producers that became dead
   (stateless ops only, never fetched/preserved ones).

A build function never edits a graph node in place (it emits replacements,
``Builder.replace`` re-emits a node under its own name): the fusion pass
declares ``tracks_edits`` (the OpDef guard checks only the nodes the passes
created or edited) and skips a rule while ``graph.version`` is unchanged, and
both rely on every change going through ``Graph`` methods.

Leaf captures whose name starts with ``@`` are *references*: ``Pat.any("@mean")``
must be the output 0 of the inner node captured as ``mean``.  That is how a
DAG (a tensor read twice inside the pattern) is written with a tree matcher.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, node_def_pb2

from .. import registry
from .. import shapes as _shapes
from ..errors import NpuAmpError
from ..graph import Graph, parse_tensor, tensor_name
from ..pattern import Match, Pat, find_matches


class FusionRuleError(NpuAmpError, ValueError):
    """A fusion rule was declared wrongly (name, pattern, build or level)."""


@dataclasses.dataclass
class FusionRule:
    name: str
    pattern: Pat
    build: Callable
    graph_level: int = 2
    #: the emitted op will be painted by the precision pass like the matrix op
    #: it replaces (white list): also check a kernel for the low dtype
    follows_precision: bool = False
    reason: str = ""
    builtin: bool = False
    #: the build handles inner tensors read outside the pattern (a training
    #: graph's gradient, see ``grad_region.py`` and :meth:`Builder.region`); the
    #: framework refuses the match if any such reader is left unhandled
    escapes: bool = False
    #: what the predicates and the build read of the graph's structure, beyond
    #: the matched nodes (their op, attrs, inputs and readers): None (not
    #: declared: the rule runs again after any change), or k >= 0: only nodes up
    #: to k input edges above the anchor.  Shapes, dtypes and constant values
    #: are not structure (a fusion keeps every surviving tensor's value).  A
    #: declaring rule is not run again in a later sweep when no change since its
    #: last run could reach a node it reads (:func:`quiet_at`)
    reads: int | None = None
    #: ``policy(ctx, graph) -> str | None``: a reason every match of the rule
    #: would be skipped for in this pipeline run whatever the anchor (the
    #: precision mode, e.g. a rule measured to pay in BF16 only under an FP16
    #: plan), or None.  With :data:`RULE_POLICY` the fusion pass then does not
    #: match the rule at all and reports it once, in its stats' ``rules_off``
    #: (the rule, the mode, the reason, the count of anchors of its op types)
    #: instead of one skip per matched anchor.  A policy must answer a reason
    #: only when the build would skip every match (the graph is the same
    #: either way); it may be asked again each sweep.
    policy: Callable | None = None
    #: the build searches a gradient region (``grad_region.find_grad_region``):
    #: when such a rule has anchor candidates, the fusion pass starts loading
    #: the search's C++ mirror of the graph as it begins (``grad_region.preload``;
    #: a rule that searches without saying so gets the mirror at its first search)
    searches_gradient: bool = False


#: (issue 17p) :attr:`FusionRule.policy`: a rule that cannot apply in this
#: pipeline run (its policy gives a reason) is not matched; the fusion pass's
#: stats list it once under ``rules_off``.  False: the reference, every rule is
#: matched and each match reports its own skip (the same graph either way;
#: tests/test_fusion_rule_policy.py)
RULE_POLICY = True

#: name -> FusionRule, applied in registration order
RULES: dict[str, FusionRule] = {}


def register_fusion_rule(name: str, pattern: Pat, build: Callable, graph_level: int = 2,
                         follows_precision: bool = False, reason: str = "",
                         replace: bool = False, _builtin: bool = False, escapes: bool = False,
                         reads: int | None = None, policy: Callable | None = None,
                         searches_gradient: bool = False) -> FusionRule:
    """Register a fusion rule (see the module docstring).  ``graph_level`` is the
    lowest level (1..3) at which it runs.  Re-registering a name raises unless
    ``replace=True``.  ``reads``: see :attr:`FusionRule.reads` (leave it None
    unless sure: a wrong declaration makes the pass miss a fusion).  ``policy``:
    see :attr:`FusionRule.policy` (same caution).  ``searches_gradient``: see
    :attr:`FusionRule.searches_gradient`."""
    if not isinstance(name, str) or not name:
        raise FusionRuleError(f"fusion rule name must be a non-empty string, got {name!r}")
    if not isinstance(pattern, Pat):
        raise FusionRuleError(f"fusion rule '{name}': pattern must be a graph_passes.pattern.Pat, "
                              f"got {type(pattern).__name__}")
    if pattern.leaf:
        raise FusionRuleError(f"fusion rule '{name}': the pattern root must be an op, not Pat.any()")
    if not callable(build):
        raise FusionRuleError(f"fusion rule '{name}': build must be callable, got {build!r}")
    if isinstance(graph_level, bool) or not isinstance(graph_level, int) or not 1 <= graph_level <= 3:
        raise FusionRuleError(f"fusion rule '{name}': graph_level={graph_level!r}; accepted: 1, 2 or 3")
    if reads is not None and (isinstance(reads, bool) or not isinstance(reads, int) or reads < 0):
        raise FusionRuleError(f"fusion rule '{name}': reads={reads!r}; accepted: None or an int >= 0 "
                              f"(how many input edges above the anchor the predicates and build read)")
    if policy is not None and not callable(policy):
        raise FusionRuleError(f"fusion rule '{name}': policy must be callable (ctx, graph) -> str | None, "
                              f"got {policy!r}")
    if not isinstance(searches_gradient, bool):
        raise FusionRuleError(f"fusion rule '{name}': searches_gradient={searches_gradient!r}; "
                              f"accepted: True or False")
    if name in RULES and not replace:
        raise FusionRuleError(f"a fusion rule named '{name}' is already registered; "
                              f"pass replace=True to override it")
    rule = FusionRule(name, pattern, build, graph_level, follows_precision, reason, _builtin, escapes,
                      reads, policy, searches_gradient)
    RULES[name] = rule
    return rule


def fusion_rule(name: str, pattern: Pat, graph_level: int = 2, **kw):
    """Decorator form of :func:`register_fusion_rule`; decorates ``build``."""
    def deco(build):
        register_fusion_rule(name, pattern, build, graph_level, **kw)
        return build
    return deco


def unregister_fusion_rule(name: str):
    if name not in RULES:
        raise FusionRuleError(f"no fusion rule named '{name}'; registered: {sorted(RULES)}")
    if RULES[name].builtin:
        raise FusionRuleError(f"fusion rule '{name}' is built in; lower graph_level to disable it")
    del RULES[name]


# ---------------------------------------------------------------- helpers
#: attribute of a Graph holding {id(Const node): (node, value)} while the fusion
#: pass runs (Const nodes are never edited in place there; a copy is returned)
CONST_MEMO_ATTR = "_fusion_const_memo"


def const_value(graph: Graph, ref: str):
    """numpy value of a Const (seen through Identity), or None."""
    memo = getattr(graph, CONST_MEMO_ATTR, None)
    if memo is None:
        return _shapes.const_value(graph, ref)
    node = _shapes.const_node(graph, ref)
    if node is None:
        return None
    hit = memo.get(id(node))
    if hit is None or hit[0] is not node:
        hit = memo[id(node)] = (node, _shapes.const_value(graph, node.name))
    return None if hit[1] is None else hit[1].copy()


def scalar_value(graph: Graph, ref: str):
    v = const_value(graph, ref)
    if v is None or v.size != 1:
        return None
    return float(v.reshape(()))


_PASS_THROUGH = ("Identity", "ReadVariableOp", "Cast", "StopGradient")


class ShapeOracle:
    """Static shapes: ``_output_shapes``, Const/Placeholder/Variable attrs,
    then a fully known shape from the producers' (:func:`graph_passes.shapes.local_shape`:
    no whole-graph inference inside the pipeline for the usual questions),
    then the graph's shared table (:func:`graph_passes.shapes.table`)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._local = {}
        #: (issue 17) the C++ producer walk (``grad_region.shape_asker``):
        #: False until first needed, then it or None
        self._ask = False

    def shape(self, ref: str, depth: int = 0):
        src, port, ctrl = parse_tensor(ref)
        node = self.graph.nodes.get(src)
        if node is None or ctrl or depth > 16:
            return None
        sh = _shapes.static_shapes(node)
        if sh is not None and port < len(sh) and sh[port] is not None:
            return list(sh[port])
        if node.op == "Const":
            return [d.size for d in node.attr["value"].tensor.tensor_shape.dim[:]]
        if node.op in ("Placeholder", "VarHandleOp") and "shape" in node.attr:
            s = node.attr["shape"].shape
            return None if s.unknown_rank else [d.size for d in s.dim[:]]
        if node.op == "ReadVariableOp" and node.input:
            # a function's resource _Arg records its variable's shape in _handle_shapes
            hsrc = self.graph.nodes.get(parse_tensor(node.input[0])[0])
            hs = hsrc.attr.get("_handle_shapes") if hsrc is not None else None
            if hs is not None and len(hs.list.shape) == 1 and not hs.list.shape[0].unknown_rank:
                dims = [d.size for d in hs.list.shape[0].dim[:]]
                if min(dims, default=0) >= 0:
                    return dims
        if node.op in _PASS_THROUGH and node.input:
            return self.shape(node.input[0], depth + 1)
        if node.op == "Reshape":
            v = const_value(self.graph, node.input[1])
            if v is not None and (v >= 0).all():
                return [int(d) for d in v.reshape(-1).tolist()]  # (see shapes._const_ints)
        if not _shapes.table(self.graph).inferred:  # once inferred, the table answers
            ask = self._ask
            if ask is False:
                from .grad_region import shape_asker

                ask = self._ask = shape_asker(self.graph)
            ref = tensor_name(src, port)
            sh = _shapes.local_shape(self.graph, ref, self._local, ask)
            if ask is not None and ask.reference is not None:
                ask.check(ref, sh)
            if sh is not None:
                return sh
        return self._infer(src, port)

    def _infer(self, src, port):
        # the graph's shared table: grappler's inference, once, lazily
        sh = _shapes.table(self.graph).node_shapes(src)
        if sh is None or port >= len(sh):
            return None
        return sh[port]


def _type_attrs(node) -> dict:
    return {k: v.type for k, v in node.attr.items() if v.WhichOneof("value") == "type"}


def _black_ops(ctx) -> dict:
    """The black list the precision pass will use (defaults + user edits),
    from the precision planner (resolved once per pipeline run)."""
    from ..precision.planner import plan_for

    return plan_for(ctx).lists["black"]


def planned_dtype(ctx, op_type: str, node_name: str, dtype: int) -> int:
    """The dtype a white-list matrix op of type ``op_type`` will run in once the
    precision pass (which runs after fusion) has painted the graph: asked of
    the precision planner (``precision/planner.py``), the one place that rule lives."""
    from ..manager import PASS_REGISTRY

    if dtype != registry.DT_FLOAT or ctx is None or "precision" not in PASS_REGISTRY:
        return dtype
    if ctx.option("precision") is None and ctx.option("precision_mode") is None:
        return dtype
    from ..precision.planner import plan_for

    return plan_for(ctx).matrix_dtype(op_type, node_name, dtype)[0]


class Skip(Exception):
    """Raised by a build function (or :meth:`Builder.require`) to skip a match with a reason."""


#: (issue 17o) :meth:`Builder.stop_if_kernel_missing`: a build that required a
#: kernel (``require_kernel``) may stop before it emits when that kernel is
#: missing, with the skip and report warning the framework's kernel check gives
#: after the emission (on BERT-12 in FP16 every ``bias`` / ``bias_add`` match:
#: no FP16 CPU ``_FusedMatMul``).  False: the reference, the build always runs
#: to the end.  The graph is the same either way (the match is skipped); the
#: reason differs only when an emitted node would have had a problem of its
#: own as well (the reference lists that first): tests/test_fusion_early_kernel.py
EARLY_KERNEL_MISS = True


class KernelMissing(Skip):
    """A required kernel is missing (:meth:`Builder.stop_if_kernel_missing`):
    reported like :func:`_kernel_problems`' refusal, with its warning."""

    def __init__(self, problems):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class Builder:
    """What a build function may do: read the match and graph, declare new nodes."""

    def __init__(self, graph: Graph, match: Match, rule: FusionRule, ctx, shapes: ShapeOracle):
        self.graph = graph
        self.match = match
        self.rule = rule
        self.ctx = ctx
        self.shapes = shapes
        self.anchor = graph.nodes[match.anchor]
        self.device = self.anchor.device
        self.emitted: list[node_def_pb2.NodeDef] = []
        #: extra (op, type_attrs, why) kernel requirements
        self.requirements: list[tuple[str, dict, str]] = []
        self.fused_ops_note: str | None = None
        #: inner nodes found by a build function's own matcher (see :meth:`absorb`)
        self.absorbed: list[str] = []
        #: nodes re-emitted under their own name (see :meth:`replace`)
        self.replaced: list[str] = []
        #: a backward region removed with the match (see :meth:`region`)
        self.region_nodes: list[str] = []
        self.rewired: dict[str, str] = {}
        self.region_target: str | None = None

    # reading --------------------------------------------------------------
    def node(self, capture: str):
        return self.match.nodes[capture]

    def tensor(self, capture: str) -> str:
        return self.match.tensors[capture]

    def attr_of(self, capture: str, attr: str):
        return self.match.nodes[capture].attr[attr]

    def const(self, ref: str):
        return const_value(self.graph, ref)

    def scalar(self, ref: str):
        return scalar_value(self.graph, ref)

    def shape(self, ref: str):
        return self.shapes.shape(ref)

    def dtype(self, ref: str):
        return self.graph.tensor_dtype(ref)

    def device_type(self) -> str:
        return registry.device_type_of(self.anchor, self.ctx.default_device_type() if self.ctx else "CPU")

    def require(self, cond: bool, reason: str):
        if not cond:
            raise Skip(reason)

    def require_kernel(self, op: str, type_attrs: dict, why: str = ""):
        self.requirements.append((op, dict(type_attrs), why))

    def stop_if_kernel_missing(self):
        """Before the build's first emission: raise :class:`KernelMissing` when a
        kernel required so far is missing (in the form :func:`_select_forms`
        would choose), with the text :func:`_kernel_problems` gives it.  Call it
        only where nothing the framework checks before the kernels (emitted
        names, the anchor's ports, readers of removed nodes) can refuse the
        match, so that skipping the emission changes no outcome.  A no-op with
        :data:`EARLY_KERNEL_MISS` False, once something was emitted, or when the
        kernels are there."""
        if not EARLY_KERNEL_MISS or self.emitted or not self.requirements:
            return
        dev = self.device_type()
        problems = []
        for op, ta, why in self.requirements:
            dt = ta.get("T")
            form = registry.fused_form(op, dev, dt) if dt is not None else None
            p = _requirement_problem(form[0] if form is not None else op, ta, why, dev)
            if p is not None:
                problems.append(p)
        if problems:
            raise KernelMissing(problems)

    def absorb(self, names, escapes_ok: bool = False):
        """Add nodes that a build function matched by itself (beyond the Pat
        tree) to the match: they are removed with it.  Each must be read only
        by matched nodes, carry no control consumers and not be fetched or
        preserved; otherwise the match is skipped with the reason
        ("not fused: 'x' is fetched", "... is also read by 'y'").
        ``escapes_ok``: readers outside the match are allowed here; the build
        must then remove them with :meth:`region` (else the match is refused)."""
        self.check_absorb(names, escapes_ok)
        for name in names:
            if name not in self.absorbed and name not in self.match.matched:
                self.absorbed.append(name)

    def check_absorb(self, names, escapes_ok: bool = False):
        """:meth:`absorb`'s refusal (Skip with the reason), without absorbing."""
        inner = set(self.match.matched) | set(self.absorbed) | set(names)
        protected = self.ctx.protected if self.ctx is not None else frozenset()
        for name in names:
            if name == self.match.anchor:
                continue
            if name in protected:
                raise Skip(f"not fused: '{name}' is fetched or preserved")
            if escapes_ok:
                continue
            for cname, idx in self.graph.consumers(name):
                if idx < 0:
                    raise Skip(f"not fused: '{name}' has a control consumer '{cname}'")
                if cname not in inner:
                    raise Skip(f"not fused: '{name}' is also read by '{cname}'")

    def replace(self, name: str, control_ok: bool = False):
        """Declare that the build re-emits node ``name`` (outside the pattern,
        e.g. the FusedBatchNorm under a Relu) under its own name, with the same
        outputs on the same ports: its other consumers (the gradient, the
        moving-average updates) keep reading it.  Refused (Skip) when it is
        fetched or preserved or has control edges, as grappler's remapper refuses.
        ``control_ok``: control edges are allowed (the build re-emits the node's
        control inputs; its control consumers keep waiting on it by name)."""
        protected = self.ctx.protected if self.ctx is not None else frozenset()
        node = self.graph.nodes.get(name)
        if node is None:
            raise Skip(f"'{name}' is not in the graph")
        if name in protected:
            raise Skip(f"not fused: '{name}' is fetched or preserved")
        if not control_ok and any(i.startswith("^") for i in node.input[:]):
            raise Skip(f"not fused: '{name}' has control inputs")
        if not control_ok and any(idx < 0 for _, idx in self.graph.consumers(name)):
            raise Skip(f"not fused: '{name}' has a control consumer")
        if name not in self.replaced:
            self.replaced.append(name)

    def escaping_readers(self, inner=None) -> list[tuple[str, str]]:
        """(inner node, reader) pairs: readers outside the match (absorbed
        nodes included) of the match's inner nodes (the anchor excluded).
        ``inner``: those nodes given (a build deciding before it absorbs)."""
        inner = set(self.match.matched) | set(self.absorbed) if inner is None else inner
        out = []
        for name in inner:
            if name == self.match.anchor:
                continue
            for cname, _ in self.graph.consumers(name):
                if cname not in inner:
                    out.append((name, cname))
        return out

    def region(self, names, rewire: dict, target: str):
        """Declare a region outside the match (a gradient subgraph, see
        ``grad_region.py``) removed with it: every data reader outside it of a
        tensor in ``rewire`` (``{old ref: new ref}``) reads the new tensor; its
        control edges (in and out) move onto node ``target`` (an emitted node).
        The framework refuses the match if a region tensor read outside is not
        in ``rewire`` (or read by a node re-emitted with :meth:`replace`)."""
        protected = self.ctx.protected if self.ctx is not None else frozenset()
        for name in names:
            if name in protected:
                raise Skip(f"not fused: '{name}' is fetched or preserved")
            if name not in self.region_nodes:
                self.region_nodes.append(name)
        self.rewired.update(rewire)
        self.region_target = target

    # writing --------------------------------------------------------------
    def emit(self, op: str, name: str, inputs, attrs: dict | None = None) -> str:
        """Declare a replacement node; returns its name.  ``attrs`` values may be
        AttrValue protos, bool/int/float/str, lists of str/int/float, or
        ``("type", DataType)`` / ``("tensor", ndarray)`` pairs."""
        node = self.graph.blank_node(op, name, self.device)  # (the graph's arena)
        node.input.extend(inputs)
        for k, v in (attrs or {}).items():
            av = node.attr[k]
            if isinstance(v, attr_value_pb2.AttrValue):
                av.CopyFrom(v)
            elif isinstance(v, tuple) and len(v) == 2 and v[0] == "type":
                av.type = v[1]
            elif isinstance(v, tuple) and len(v) == 2 and v[0] == "types":
                av.list.type.extend(v[1])
            elif isinstance(v, tuple) and len(v) == 2 and v[0] == "tensor":
                av.tensor.CopyFrom(tf.make_tensor_proto(v[1]))
            elif isinstance(v, bool):
                av.b = v
            elif isinstance(v, int):
                av.i = v
            elif isinstance(v, float):
                av.f = v
            elif isinstance(v, str):
                av.s = v.encode()
            elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
                av.list.s.extend(x.encode() for x in v)
            elif isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
                av.list.i.extend(v)
            else:
                raise FusionRuleError(f"fusion rule '{self.rule.name}': attr '{k}' of emitted node "
                                      f"'{name}' has an unsupported value {v!r}")
        self.emitted.append(node)
        return name

    def const_node(self, name: str, value, dtype: int) -> str:
        import numpy as np
        arr = np.asarray(value, dtype=tf.as_dtype(dtype).as_numpy_dtype)
        return self.emit("Const", name, [], {"dtype": ("type", dtype), "value": ("tensor", arr)})


@dataclasses.dataclass
class Outcome:
    fused: bool
    reason: str = ""
    #: the gradient region removed with the match (Builder.region), for the report
    region: tuple = ()
    #: a report warning for the skip (kernel problems), or ""
    warning: str = ""


class Trail:
    """What the fusion pass needs to know about the changes made by the rules
    (besides ``Graph.edits_since``, which lists created and edited nodes): the
    nodes whose readers a removal changed, whether the last ``apply_rule``
    dropped an overlapping match, and whether the graph changed in a way not
    accounted for (a build or predicate editing it: then no rule is skipped)."""

    def __init__(self):
        self.removed_inputs: list[str] = []
        self.dropped = False
        self.unknown = False

    def note_removal(self, graph: Graph, name: str):
        node = graph.nodes.get(name)
        if node is not None:
            self.removed_inputs.extend(parse_tensor(i)[0] for i in node.input[:])


def _select_forms(b: Builder):
    """Swap an emitted generic fused op for the form the registry measured to
    run (and run fast) in the dtype the precision pass will give it
    (:data:`registry.FUSED_FORMS`, e.g. ``_FusedConv2D`` -> ``_MklNativeFusedConv2D``
    in BF16 under oneDNN, whose OpDef allows bfloat16).  The emitted node
    carries the kernel label; its attrs stay those of the generic op (a subset
    of the form's OpDef is checked by the OpDef guard)."""
    dev = b.device_type()
    for i, (op, ta, why) in enumerate(b.requirements):
        dt = ta.get("T")
        form = registry.fused_form(op, dev, dt) if dt is not None else None
        if form is None:
            continue
        new_op, label = form
        for n in b.emitted:
            if n.op == op:
                n.op = new_op
                if label:
                    n.attr["_kernel"].s = label.encode()
        b.requirements[i] = (new_op, ta, why)


def _kernel_problems(b: Builder) -> list[str]:
    dev = b.device_type()
    out = []
    checks = [(n.op, _type_attrs(n), f"emitted node '{n.name}'") for n in b.emitted if n.op != "Const"]
    checks += [(op, ta, why) for op, ta, why in b.requirements]
    from ..opdef_check import node_problems

    for n in b.emitted:  # every attr against the OpDef: list(type) (TArgs), required attrs...
        if n.op != "Const" and registry.op_def(n.op) is not None:
            out.extend(node_problems(n, b.graph.functions, dev))
        if "fused_ops" in n.attr:  # a registered kernel that lacks this activation in this dtype
            for v in _type_attrs(n).values():
                why = registry.fused_ops_broken(n.op, dev, v, n.attr["fused_ops"].list.s)
                if why:
                    out.append(f"emitted node '{n.name}': {why}")
    for op, ta, why in checks:
        p = _requirement_problem(op, ta, why, dev)
        if p is not None:
            out.append(p)
    return out


def _requirement_problem(op: str, ta: dict, why: str, dev: str) -> str | None:
    """Why op ``op`` with type attrs ``ta`` cannot run on ``dev``, or None."""
    if registry.op_def(op) is None:
        return f"{why}: op {op} is not registered (custom-op library not loaded?)"
    if registry.has_kernel(op, dev, ta):
        return None
    shown = {k: registry.dtype_name(v) for k, v in ta.items()}
    broken = [registry.BROKEN_KERNELS[(op, dev, v)] for v in ta.values()
              if (op, dev, v) in registry.BROKEN_KERNELS]
    if broken:
        return f"{why}: {op} with {shown} on {dev} is known-broken ({broken[0]})"
    if not registry.opdef_allows(op, ta):
        return f"{why}: the OpDef of {op} does not allow {shown}"
    return f"{why}: no {dev} kernel for {op} with {shown}"


_KEEP_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "_Arg", "_Retval", "NoOp",
                       "VarHandleOp", "VariableV2", "Variable"})


def _removable(node) -> bool:
    if node.op == "ReadVariableOp":  # a read has no side effect
        return True
    if node.op in _KEEP_OPS:
        return False
    od = registry.op_def(node.op)
    return od is not None and not od.is_stateful


def apply_rule(graph: Graph, rule: FusionRule, ctx, shapes: ShapeOracle, stats: dict,
               trail: Trail | None = None) -> int:
    """Apply one rule everywhere it matches.  Returns the number of fusions.
    ``trail``: records what the fusion pass needs to skip rules later."""
    protected = ctx.protected if ctx is not None else frozenset()
    done = 0
    from ..pattern import match_at

    changed = False
    dropped = [] if trail is not None else None
    v = graph.version
    matches = find_matches(graph, rule.pattern, protected, escapes_ok=rule.escapes, dropped=dropped)
    if trail is not None:
        trail.dropped = bool(dropped)
        if graph.version != v:  # a predicate edited the graph
            trail.unknown = True
    for m in matches:
        if changed:  # an earlier fusion (and its gradient region) may have removed or rewired it
            if m.anchor not in graph.nodes:
                continue
            m = match_at(graph, rule.pattern, m.anchor, protected, rule.escapes)
            if m is None:
                continue
        outcome = _apply_one(graph, rule, m, ctx, shapes, trail)
        changed = changed or outcome.fused
        key = "fused" if outcome.fused else "skipped"
        seen = stats.setdefault("_skips_seen", set())  # a skip repeats every sweep: count it once
        if not outcome.fused:
            if (rule.name, m.anchor) in seen:
                continue
            seen.add((rule.name, m.anchor))
        stats.setdefault(key, {}).setdefault(rule.name, 0)
        stats[key][rule.name] += 1
        if ctx is not None:
            if outcome.fused:
                ctx.report.decide(m.anchor, fusion=rule.name, fused_nodes=list(m.matched))
                if outcome.region:  # the backward replaced by one gradient op
                    ctx.report.decide(m.anchor, fused_gradient_nodes=list(outcome.region))
            else:
                ctx.report.decide(m.anchor, fusion_skipped=rule.name, fusion_reason=outcome.reason)
        done += outcome.fused
    if (ctx is not None and ctx.protected and (rule.pattern.inputs or rule.pattern.alternatives)
            and _may_hold_inner(graph, rule.pattern, ctx.protected)):
        _report_fetched_refusals(graph, rule, ctx, stats)  # root-only patterns: the build reports
    return done


def policy_reason(graph: Graph, rule: FusionRule, ctx) -> str | None:
    """The reason ``rule`` is off for this run by its :attr:`FusionRule.policy`
    (:data:`RULE_POLICY`), or None (no policy, no context, or it may fuse);
    nothing recorded (see :func:`rule_off`)."""
    if not RULE_POLICY or rule.policy is None or ctx is None:
        return None
    return rule.policy(ctx, graph) or None


def rule_off(graph: Graph, rule: FusionRule, ctx, stats: dict) -> bool:
    """Whether ``rule`` is off for this run by its :attr:`FusionRule.policy`
    (:data:`RULE_POLICY`): then the first time, ``stats["rules_off"][name]``
    gets ``{"mode", "reason", "anchors"}`` (the precision mode, the policy's
    reason, the number of nodes of the rule's anchor op types, None when any
    op may anchor it).  False (the rule runs) without a policy or a context."""
    why = policy_reason(graph, rule, ctx)
    if not why:
        return False
    off = stats.setdefault("rules_off", {})
    if rule.name not in off:
        from ..pattern import _anchor_ops, _count

        ops = _anchor_ops(rule.pattern)
        off[rule.name] = {"mode": precision_mode_of(ctx), "reason": why,
                          "anchors": _count(graph, ops) if ops is not None else None}
    return True


def precision_mode_of(ctx) -> str:
    """The canonical precision mode the precision pass will run in, or
    ``"none"`` when no precision pass follows (see ``planned_dtype``)."""
    from ..manager import PASS_REGISTRY

    if ctx is None or "precision" not in PASS_REGISTRY:
        return "none"
    if ctx.option("precision") is None and ctx.option("precision_mode") is None:
        return "none"
    from ..precision.planner import plan_for

    return plan_for(ctx).mode


def _inner_ops(pat: Pat, root: bool = True):
    """The op types a node matched *inside* ``pat`` (not at its root) may
    have, or None when a wildcard position accepts any op."""
    ops = set()
    if pat.leaf:
        return ops
    if pat.alternatives:
        for alt in pat.alternatives:
            sub = _inner_ops(alt, root)
            if sub is None:
                return None
            ops |= sub
        return ops
    if not root:
        if pat.op is None:
            return None
        ops |= set(pat.ops())
    for p in pat.inputs or ():
        sub = _inner_ops(p, False)
        if sub is None:
            return None
        ops |= sub
    return ops


def _may_hold_inner(graph: Graph, pat: Pat, protected) -> bool:
    """Could a match of ``pat`` hold a protected node as an inner node?  Only
    when one has an op type an inner position accepts (else matching without
    protection finds nothing more to report)."""
    ops = pat.__dict__.get("_inner_ops_cache", False)
    if ops is False:  # patterns are not edited once built
        ops = _inner_ops(pat)
        ops = pat.__dict__["_inner_ops_cache"] = None if ops is None else frozenset(ops)
    if ops is None:
        return True
    nodes = graph.nodes
    return any((n := nodes.get(name)) is not None and n.op in ops for name in protected)


def _report_fetched_refusals(graph: Graph, rule: FusionRule, ctx, stats: dict):
    """The matcher silently refuses a match whose inner tensor is fetched or
    preserved.  Match again without protection and say so in the report
    ("not fused: 'x' is fetched"), so a user knows why the pattern stayed."""
    protected = ctx.protected
    seen = stats.setdefault("_skips_seen", set())
    for m in find_matches(graph, rule.pattern, frozenset()):
        hit = [n for n in m.matched[1:] if n in protected]
        if not hit or (rule.name, m.anchor) in seen:
            continue
        seen.add((rule.name, m.anchor))
        what = "fetched" if hit[0] in ctx.fetches else "preserved"
        reason = f"not fused: '{hit[0]}' is {what}"
        stats.setdefault("skipped", {}).setdefault(rule.name, 0)
        stats["skipped"][rule.name] += 1
        ctx.report.decide(m.anchor, fusion_skipped=rule.name, fusion_reason=reason)


def quiet_at(graph: Graph, rule: FusionRule, ctx, shapes: ShapeOracle, stats: dict, anchors,
             trail: Trail | None = None) -> bool:
    """True when :func:`apply_rule` would change nothing and report nothing new,
    given that the rule's previous run changed nothing and dropped no
    overlapping match, and that only at ``anchors`` can matching (and the
    build) read anything changed since (``pattern.affected_anchors`` and
    :attr:`FusionRule.reads`).  Pure: matches and builds at those anchors,
    without editing the graph; any match there that would fuse, or be reported
    (a skip not reported before, a new warning), answers False."""
    from ..pattern import match_at

    protected = ctx.protected if ctx is not None else frozenset()
    if (ctx is not None and ctx.protected and (rule.pattern.inputs or rule.pattern.alternatives)
            and _may_hold_inner(graph, rule.pattern, ctx.protected)):
        return False  # the refusal report re-matches everywhere: run the rule
    seen = stats.get("_skips_seen", ())
    warnings = ctx.report.warnings if ctx is not None else []
    v = graph.version
    for a in anchors:
        m = match_at(graph, rule.pattern, a, protected, rule.escapes)
        if m is None:
            continue
        if (rule.name, a) not in seen:
            return False
        outcome, _ = _plan_one(graph, rule, m, ctx, shapes)
        if graph.version != v:  # a build edited the graph
            if trail is not None:
                trail.unknown = True
            return False
        if outcome.fused or (outcome.warning and
                             {"pass": None, "node": a, "message": outcome.warning} not in warnings):
            return False
    return True


def _apply_one(graph: Graph, rule: FusionRule, m: Match, ctx, shapes: ShapeOracle,
               trail: Trail | None = None) -> Outcome:
    v = graph.version
    outcome, plan = _plan_one(graph, rule, m, ctx, shapes)
    if trail is not None and graph.version != v:  # a build edited the graph
        trail.unknown = True
    if outcome.warning and ctx is not None:
        ctx.report.warn(outcome.warning, node=m.anchor)
    if plan is None:
        return outcome
    return _commit(graph, m, plan, ctx, trail)


def _plan_one(graph: Graph, rule: FusionRule, m: Match, ctx, shapes: ShapeOracle):
    """The checks and the build, without editing the graph: (Outcome, None)
    for a skip, (Outcome(True), plan for :func:`_commit`) for a fusion."""
    keep_name = False
    if m.anchor in (ctx.protected if ctx is not None else ()):
        what = "fetched" if m.anchor in ctx.fetches else "preserved"
        od = registry.op_def(graph.nodes[m.anchor].op)
        if od is None or od.output_arg:
            return Outcome(False, f"not fused: '{m.anchor}' is {what} (the anchor's outputs must keep their form)"), None
        # an anchor without outputs (a variable update a function lists as a control output, a run
        # target): a node emitted under its name keeps it runnable by that name (18j)
        keep_name = True
    b = Builder(graph, m, rule, ctx, shapes)
    try:
        result = rule.build(m, b)
    except KernelMissing as exc:  # (Builder.stop_if_kernel_missing: as the kernel check below)
        reason = "; ".join(exc.problems)
        return Outcome(False, reason, warning=f"fusion rule '{rule.name}' skipped: " + reason), None
    except Skip as exc:
        return Outcome(False, str(exc)), None
    if result is False:
        return Outcome(False, "the build function declined this match"), None
    if not b.emitted:
        return Outcome(False, "the build function emitted no node"), None
    if keep_name and not any(n.name == m.anchor for n in b.emitted):
        return Outcome(False, f"not fused: '{m.anchor}' is fetched or preserved and no node replaces it "
                              "under its name"), None
    out_map = result if isinstance(result, dict) else {0: tensor_name(m.anchor, 0)}
    emitted_names = {n.name for n in b.emitted}
    if b.absorbed:  # nodes the build function matched itself (Builder.absorb)
        m.matched.extend(n for n in b.absorbed if n not in m.matched)
    matched = set(m.matched)
    for n in b.emitted:
        if n.name in graph.nodes and n.name not in matched and n.name not in b.replaced:
            return Outcome(False, f"emitted node name '{n.name}' is already taken"), None
    missing = [r for r in b.replaced if r not in emitted_names]
    if missing:
        return Outcome(False, f"node '{missing[0]}' was declared replaced but not re-emitted"), None
    # consumers of anchor ports the replacement does not provide
    anchor_cons = list(graph.consumers(m.anchor))
    for cname, idx in anchor_cons:
        if idx < 0:
            continue
        port = parse_tensor(graph.nodes[cname].input[idx])[1]
        if port not in out_map:
            return Outcome(False, f"output {port} of '{m.anchor}' is read by '{cname}', and the "
                                  f"fused op does not produce it"), None
    problem = _unhandled_readers(graph, b, m, matched)
    if problem:
        return Outcome(False, problem), None
    _select_forms(b)
    problems = _kernel_problems(b)
    if problems:
        return Outcome(False, "; ".join(problems),
                       warning=f"fusion rule '{rule.name}' skipped: " + "; ".join(problems)), None
    return Outcome(True), (b, out_map, emitted_names, matched, anchor_cons)


def _commit(graph: Graph, m: Match, plan, ctx, trail: Trail | None) -> Outcome:
    """Edit the graph for a planned fusion (:func:`_plan_one`)."""
    b, out_map, emitted_names, matched, anchor_cons = plan
    ctrl = []
    upstream = []
    nodes = graph.nodes
    read = {}  # name -> its inputs, read once here (Graph.remove_nodes takes them)
    for name in m.matched:
        ins = read[name] = nodes[name].input[:]
        for inp in ins:
            src, _, is_ctrl = parse_tensor(inp)
            if is_ctrl:
                if src not in matched and src not in ctrl and src not in b.region_nodes:
                    ctrl.append(src)
            elif src not in matched:
                upstream.append(src)
    keep_name = m.anchor in emitted_names
    # consumers of replaced nodes outside the match keep reading them by name
    kept = {r: [(c, i) for c, i in graph.consumers(r) if c not in matched] for r in b.replaced}
    region = set(b.region_nodes)
    rewires, ctrl_moves, region_ctrl_in = [], [], []
    gone = matched | region | set(b.replaced)
    cons = graph._consumers  # noqa: SLF001 - read only until the removal below
    for name in b.region_nodes:
        ins = read[name] = nodes[name].input[:]
        for inp in ins:
            src, _, is_ctrl = parse_tensor(inp)
            if is_ctrl and src not in gone and src not in region_ctrl_in:
                region_ctrl_in.append(src)
            elif not is_ctrl and src not in gone:
                upstream.append(src)
        for cname, idx in cons.get(name, ()):
            if cname in gone:
                continue
            if idx < 0:
                ctrl_moves.append((cname, name))
            else:
                rewires.append((cname, idx, b.rewired[_canon_ref(graph.nodes[cname].input[idx])]))
    # one batch (Graph.remove_nodes: as remove_node per name, in this order);
    # it returns what the removed nodes read (the trail's removed inputs)
    read = graph.remove_nodes((*b.region_nodes, *m.matched, *b.replaced), force=True, inputs=read)
    if trail is not None:
        trail.removed_inputs.extend(read)
    for n in b.emitted:
        graph.add_node(n)
    for r, cons in kept.items():
        index = graph._consumers.setdefault(r, [])  # noqa: SLF001 - index repair
        index.extend(c for c in cons if c[0] in graph.nodes and c not in index)
    # the replacement named like the anchor inherits its consumers; others are rewired
    if keep_name:
        for cname, idx in anchor_cons:
            if cname in graph.nodes:
                graph._consumers[m.anchor].append((cname, idx))  # noqa: SLF001 - index repair
    for cname, idx in anchor_cons:
        if cname not in graph.nodes:
            continue
        if idx < 0:
            if not keep_name:
                inputs = graph.nodes[cname].input[:]
                if "^" + m.anchor in inputs:
                    graph.set_input(cname, inputs.index("^" + m.anchor),
                                    "^" + parse_tensor(out_map[0])[0])
            continue
        port = parse_tensor(graph.nodes[cname].input[idx])[1]
        new_ref = out_map[port]
        if graph.nodes[cname].input[idx] != new_ref:
            graph.set_input(cname, idx, new_ref)
    target = parse_tensor(out_map[0])[0]
    for c in ctrl:
        if c in graph.nodes and c != target:
            graph.add_control_input(target, c)
    for cname, idx, new_ref in rewires:
        if cname in graph.nodes:
            graph.set_input(cname, idx, new_ref)
    rt = b.region_target
    for cname, old in ctrl_moves:
        if cname in graph.nodes:
            _move_control_input(graph, cname, old, rt)
    for c in region_ctrl_in:
        if c in graph.nodes and c != rt:
            graph.add_control_input(rt, c)
    _remove_dead(graph, upstream, ctx, trail)
    return Outcome(True, region=tuple(b.region_nodes))


def _canon_ref(ref: str) -> str:
    n, p, c = parse_tensor(ref)
    return ("^" + n) if c else (n if p == 0 else f"{n}:{p}")


def _move_control_input(graph: Graph, cname: str, old: str, new: str):
    """``^old`` on node ``cname`` becomes ``^new`` (dropped if already there)."""
    node = graph.nodes[cname]
    inputs = node.input[:]
    i = inputs.index("^" + old) if "^" + old in inputs else -1
    if i < 0:
        return
    if "^" + new in inputs or new == cname:
        del node.input[i]  # control inputs come last: no data index shifts
        graph.touch(cname)  # edited in place (the OpDef guard's changed set)
        graph.reindex()
        return
    graph.set_input(cname, i, "^" + new)


def _unhandled_readers(graph: Graph, b: "Builder", m: Match, matched: set) -> str | None:
    """A reader of a removed node (not the anchor) that nothing rewires."""
    region = set(b.region_nodes)
    gone = matched | region
    replaced = set(b.replaced)
    cons = graph._consumers  # noqa: SLF001 - read only
    for name in list(m.matched) + b.region_nodes:
        if name == m.anchor:
            continue
        for cname, idx in cons.get(name, ()):
            if cname in gone or cname in replaced:
                continue
            if name in region:
                if idx < 0 and b.region_target:
                    continue
                if idx >= 0 and _canon_ref(graph.nodes[cname].input[idx]) in b.rewired:
                    continue
            return f"not fused: '{name}' is also read by '{cname}'"
    if region and b.region_target not in {n.name for n in b.emitted}:
        return "the region's control target is not an emitted node"
    return None


def _remove_dead(graph: Graph, names, ctx, trail: Trail | None = None):
    protected = ctx.protected if ctx is not None else frozenset()
    stack = list(dict.fromkeys(names))
    while stack:
        name = stack.pop()
        node = graph.nodes.get(name)
        if node is None or name in protected or graph.consumers(name) or not _removable(node):
            continue
        inputs = [parse_tensor(i)[0] for i in node.input[:]]
        if trail is not None:
            trail.removed_inputs.extend(inputs)
        graph.remove_node(name)
        stack.extend(inputs)
