"""Static shapes for every pass: one module, one lookup, one "constant behind
an Identity" helper.

Where shapes come from, cheapest first:

1. ``_output_shapes`` attrs a node carries (:func:`static_shapes`);
2. a *shape source* handed to the pipeline with the graph: inside grappler,
   the bridge asks the C++ side to run ``GraphProperties::InferStatically`` on
   the ``GrapplerItem`` it already holds (``custom_ops/grappler_bridge.cc``);
   offline the pipeline asks the same C++ code for a serialized GraphDef;
3. otherwise grappler's C++ inference (``graph_passes._tf.grappler_op_properties``)
   (:func:`infer_shapes`), and only if that fails TF's Python importer.

Sources are *lazy*: nothing is inferred until a pass asks for a shape, and a
source's answer is decoded per node on first lookup.  Passes change dtypes and
replace nodes under their own names, never the shape of a named tensor, so
shapes inferred once for the graph a pipeline received stay true through every
pass (nodes a pass adds are aliased to their source, see
:meth:`ShapeTable.alias`).

Shapes are lists of ints with -1 for an unknown dim, or None for unknown rank.
"""
from __future__ import annotations

import logging
import math
import weakref

import numpy as np

from .graph import parse_tensor

log = logging.getLogger("npu_amp_tf")

#: attribute of a ``Graph`` holding its :class:`ShapeTable`
_TABLE_ATTR = "_shape_table"


def static_shapes(node) -> list[list[int] | None] | None:
    """Output shapes recorded in ``_output_shapes`` (dims of -1 are unknown)."""
    a = node.attr.get("_output_shapes")
    if a is None:
        return None
    out = []
    for sh in a.list.shape[:]:
        out.append(None if sh.unknown_rank else [d.size for d in sh.dim[:]])
    return out


# ---------------------------------------------------------------- sources
class _LazyShapes:
    """A read-only ``name -> [shape per output]`` mapping over raw per-node
    records, each decoded (:meth:`_decode`) on its first lookup."""

    def __init__(self, raw: dict):
        self._raw = raw
        self._done = {}

    def __len__(self):
        return len(self._raw)

    def __contains__(self, name):
        return name in self._raw

    def __getitem__(self, name):
        s = self.get(name)
        if s is None:
            raise KeyError(name)
        return s

    def get(self, name):
        s = self._done.get(name)
        if s is not None:
            return s
        raw = self._raw.get(name)
        if raw is None:
            return None
        s = self._done[name] = self._decode(raw)
        return s

    def _decode(self, raw):
        raise NotImplementedError


class LineShapes(_LazyShapes):
    """Shapes in the bridge's line format (``name\x01d,d|?|...``, nodes
    without outputs left out), decoded per node on first lookup."""

    def __init__(self, text: str):
        raw = {}
        for line in text.split("\n"):
            name, sep, rest = line.partition("\x01")
            if sep:
                raw[name] = rest
        super().__init__(raw)

    def _decode(self, raw):
        return [None if part == "?" else ([int(d) for d in part.split(",")] if part else [])
                for part in raw.split("|")]


class _PropertiesShapes(_LazyShapes):
    """``{name: [serialized OpInfo.TensorProperties]}`` from grappler's Item,
    decoded per node on first lookup."""

    def _decode(self, raw):
        from tensorflow.core.grappler.costs import op_performance_data_pb2

        tp = op_performance_data_pb2.OpInfo.TensorProperties
        s = []
        for b in raw:
            sh = tp.FromString(b).shape
            s.append(None if sh.unknown_rank else [max(d.size, -1) for d in sh.dim[:]])
        return s


def _for_inference(graph_def, feed_op: str = "Placeholder"):
    """A copy TF accepts for shape inference: no devices or colocation, and a
    function body's ``_Arg``/``_Retval`` as Placeholder/Identity.  With
    ``feed_op="FakeParam"`` placeholders become FakeParam (same dtype/shape
    attrs and shape function): grappler's item builder turns every Placeholder
    into a feed whose shape it then refuses to trust."""
    from tensorflow.core.framework import graph_pb2

    stripped = graph_pb2.GraphDef()
    stripped.CopyFrom(graph_def)
    for node in stripped.node:
        node.device = ""
        for key in [k for k in node.attr if k == "_class" or k.startswith("_xla")]:
            del node.attr[key]
        if node.op == "_Arg":  # an argument is a placeholder of its recorded shape
            node.op = "Placeholder"
            node.attr["dtype"].type = node.attr["T"].type
            recorded = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else ()
            if recorded:
                node.attr["shape"].shape.CopyFrom(recorded[0])
            for key in ("T", "index", "_output_shapes"):
                if key in node.attr:
                    del node.attr[key]
        elif node.op == "_Retval":
            node.op = "Identity"
            del node.attr["index"]
        if node.op == "Placeholder" and feed_op != "Placeholder":
            node.op = feed_op
            if "shape" not in node.attr:
                node.attr["shape"].shape.unknown_rank = True
    return stripped


def grappler_shapes(graph_def):
    """Grappler's C++ static shape inference (``GraphProperties``) through
    ``graph_passes._tf.grappler_op_properties``: a lazy name -> shapes mapping.
    Raises whatever TF raises on a graph it refuses."""
    from tensorflow.core.protobuf import meta_graph_pb2

    from . import _tf

    mg = meta_graph_pb2.MetaGraphDef()
    mg.graph_def.CopyFrom(_for_inference(graph_def, "FakeParam"))
    if not mg.graph_def.node:
        return _PropertiesShapes({})
    # the item builder wants a fetch; pruning is off, so any node will do
    mg.collection_def["train_op"].node_list.value.append(mg.graph_def.node[-1].name)
    return _PropertiesShapes(_tf.grappler_op_properties(mg.SerializeToString()))


def import_shapes(graph_def) -> dict:
    """TF's Python importer (``import_graph_def`` into a throw-away ``tf.Graph``):
    the slow fallback when grappler refuses a graph."""
    import tensorflow as tf

    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(_for_inference(graph_def), name="")
    shapes = {}
    for op in g.get_operations():
        out = []
        for t in op.outputs:
            s = t.shape
            out.append(None if s.rank is None else [(-1 if d is None else d) for d in s.as_list()])
        shapes[op.name] = out
    return shapes


def infer_shapes(graph_def):
    """name -> [shape per output] for every node TF can infer: grappler's C++
    inference, else TF's importer, else the recorded ``_output_shapes``.
    The result supports ``.get(name)`` (it may decode lazily)."""
    import tensorflow as tf

    try:
        return grappler_shapes(graph_def)
    except (ValueError, TypeError, KeyError, RuntimeError, tf.errors.OpError) as exc:
        log.debug("npu_amp_tf: grappler shape inference refused the graph: %s", exc)
    try:
        return import_shapes(graph_def)
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as exc:
        recorded = _Recorded({n.name: s for n in graph_def.node
                              if (s := static_shapes(n)) is not None})
        recorded.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return recorded


class _Recorded(dict):
    """Only the recorded ``_output_shapes``: TF refused the graph.  ``error``
    says why, for the pass that reports the nodes left without shapes."""
    error = None


# ----------------------------------------------------------------- tables
class ShapeTable:
    """name -> [shape per output] for one graph: ``_output_shapes`` first, then
    the graph's shape source (see :func:`attach`), else TF's inference once,
    lazily, on the graph as it is at the first lookup that needs it."""

    #: per-table cache of :func:`graph_passes.precision.stats.input_dependent`
    #: (False: not computed yet; None: the graph has no input op)
    _dependent = False
    #: (issue 17) the ``ask`` of :func:`local_shape` the walks before any
    #: inference use, set by the pass that has one for a while (the
    #: precision pass: ``prefuse.Prefused.shape_asker``), else None
    ask = None

    def __init__(self, graph, source=None):
        # weakly: the graph holds its table (:func:`attach`), and a cycle
        # would keep every graph alive until a full garbage collection
        self._graph_ref = weakref.ref(graph)
        self._shapes = {}
        self._source = source
        self._inferred = None
        self._aliases = {}
        self._local_memo = {}
        self.error = None

    @property
    def _graph(self):
        return self._graph_ref()

    @property
    def inferred(self):
        return self._inferred is not None

    def node_shapes(self, name):
        s = self._shapes.get(name)
        if s is not None:
            return s
        ref = self._aliases.get(name)
        if ref is not None:
            s = self._shapes[name] = [self.get(ref)]
            return s
        node = self._graph.nodes.get(name)
        if node is not None:
            s = static_shapes(node)
        if s is None:
            s = self._infer().get(name)
            if s is not None and node is not None and node.op == "Transpose" and _partial(s):
                s = self._transpose(node) or s
        if s is not None:
            self._shapes[name] = s
        return s

    def _transpose(self, node):
        """A Transpose whose perm grappler could not evaluate (gradients read
        ``InvertPermutation(const)``): its shape from the input's and the perm."""
        if len(node.input) < 2:
            return None
        perm_node = self._graph.nodes.get(parse_tensor(node.input[1])[0])
        invert = perm_node is not None and perm_node.op == "InvertPermutation"
        perm = const_value(self._graph, perm_node.input[0] if invert else node.input[1])
        x = self.get(node.input[0])
        if perm is None or x is None or perm.ndim != 1 or len(perm) != len(x):
            return None
        perm = [int(p) for p in perm.tolist()]
        if sorted(perm) != list(range(len(x))):
            return None
        if invert:
            inv = [0] * len(perm)
            for i, p in enumerate(perm):
                inv[p] = i
            perm = inv
        return [[x[p] for p in perm]]

    def _infer(self):
        if self._inferred is None:
            self._inferred = {}
            try:
                src = self._source
                self._inferred = src() if callable(src) else (
                    src if src is not None else infer_shapes(self._graph.to_graph_def()))
                self.error = getattr(self._inferred, "error", None)
            except Exception as exc:  # noqa: BLE001 - reported, the figures then lack those nodes
                self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self._inferred = {}
        return self._inferred

    def get(self, ref):
        src, port, _ = parse_tensor(ref)
        if self._inferred is None and src not in self._shapes and src not in self._aliases:
            # before any whole-graph inference: a fully known shape from the
            # producers' when there is one (the same answer, see local_shape)
            node = self._graph.nodes.get(src)
            if node is not None and static_shapes(node) is None:
                sh = local_shape(self._graph, ref, self._local_memo, self.ask)
                if sh is not None:
                    return sh
        outs = self.node_shapes(src)
        if outs is None or port >= len(outs):
            return None
        return outs[port]

    def alias(self, new_name, ref):
        """Record that ``new_name`` (an inserted Cast) has the shape of ``ref``
        (looked up when ``new_name`` is: no inference for it now)."""
        self._shapes.pop(new_name, None)
        self._aliases[new_name] = ref

    def freeze_source(self, graph_def_fn):
        """Without a shape source, infer (when first needed) on the GraphDef
        ``graph_def_fn()`` returns (the graph as it is now) rather than on the
        graph as it will be at the first lookup."""
        if self._inferred is None and self._source is None:
            self._source = lambda: infer_shapes(graph_def_fn())

    def inferred_source(self):
        """A source for another table over a version of this graph: this
        table's inference, shared (run once)."""
        return self._infer

    def as_dict(self) -> dict:
        """Every node's shapes (for passes that walk the whole graph)."""
        out = {}
        for name in self._graph.nodes:
            s = self.node_shapes(name)
            if s is not None:
                out[name] = s
        return out


def _partial(shapes_list) -> bool:
    return any(s is not None and any(d < 0 for d in s) for s in shapes_list)


def attach(graph, source):
    """Give ``graph`` a shape source: a mapping with ``.get(name)``, or a
    zero-argument callable returning one (called at most once, when a pass
    first needs a shape that no ``_output_shapes`` attr records)."""
    setattr(graph, _TABLE_ATTR, ShapeTable(graph, source))


def table(graph) -> ShapeTable:
    """The shape table shared by every pass that runs on ``graph``."""
    t = getattr(graph, _TABLE_ATTR, None)
    if t is None:
        t = ShapeTable(graph)
        setattr(graph, _TABLE_ATTR, t)
    return t


def graph_shapes(graph) -> dict:
    """name -> [shape per output] of the graph *as it is now* (a fresh inference
    when some node lacks ``_output_shapes``)."""
    return ShapeTable(graph).as_dict()


def tensor_shape(shapes, ref):
    """Shape of tensor ``ref`` in a name -> [shapes] mapping, or None."""
    node, port, ctrl = parse_tensor(ref)
    s = shapes.get(node)
    if ctrl or s is None or port >= len(s):
        return None
    return s[port]


# ----------------------------------------------------------- local shapes
#: one output, the shape of input 0
_SAME_SHAPE = frozenset({
    "Identity", "Snapshot", "StopGradient", "Cast", "BiasAdd",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus", "Softsign",
    "Rsqrt", "Sqrt", "Exp", "Expm1", "Log", "Log1p", "Neg", "Square", "Abs", "Reciprocal",
    "Inv", "Erf", "Erfc", "Sin", "Cos", "Atan", "Sinh", "Cosh", "Softmax", "LogSoftmax",
    "ZerosLike", "OnesLike", "Sign", "Floor", "Ceil", "Round", "Rint", "IsFinite", "IsNan",
    "IsInf", "LogicalNot",
    # gradients of elementwise ops: (y or features, dy), both of the output's shape
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad",
    "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "SoftplusGrad", "SoftsignGrad", "ReciprocalGrad",
    # this project's ops whose output 0 has input 0's shape (their C++ shape functions)
    "LayerNorm", "RMSNorm", "ScaleMaskSoftmax", "AddRelu", "AddNReluGrad", "BatchNormGradNHWC",
    "GeluErf", "GeluErfGrad"})
#: elementwise with NumPy broadcasting of inputs 0 and 1
_BROADCAST = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "SquaredDifference", "Pow", "FloorDiv", "FloorMod", "MulNoNan"})
_REDUCE = frozenset({"Mean", "Sum", "Max", "Min", "Prod"})
#: (a, b) -> [rows of a, cols of b], transposes by attr
_MATMUL = frozenset({"MatMul", "_FusedMatMul", "_MklNativeFusedMatMul", "_MklFusedMatMul"})
_BATCH_MATMUL = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


#: what an ``ask`` of :func:`local_shape` returns for a tensor it leaves to
#: the Python walk
UNANSWERED = object()


def local_shape(graph, ref, memo=None, ask=None):
    """The *fully known* shape of tensor ``ref`` from its producers, walking
    back through common ops (elementwise, broadcasting binary ops, MatMul /
    BatchMatMul, Reshape / Transpose with constant operands, reductions with
    constant axes) down to ``_output_shapes``, constants, placeholders and
    variables; None when any dim on the way is unknown or an op is not
    covered (the caller then asks the whole-graph inference, which gives the
    same answer where this one gives one: the same shape functions).
    ``memo``: a dict shared between calls on the same graph.

    The walk keeps its own stack (each tensor's computation is a generator
    that yields the tensors it needs, one at a time, in the order it needs
    them), so a chain of any length (the gradient of a deep network's first
    layer sits behind every later layer's backward) is walked once, with no
    limit from Python's recursion.  (:data:`FAST_WALK`: a tensor whose shape
    needs no input's, or is its input 0's, takes no generator.)

    ``ask`` (with :data:`FAST_WALK`): a function giving a tensor's shape
    before the walk computes it (its answer is memoised like the walk's),
    or :data:`UNANSWERED` (then the walk computes it); the fusion pass's
    C++ walk (``grad_region.shape_asker``), which answers as this walk would."""
    if memo is None:
        memo = {}
    if ref in memo:
        return memo[ref]
    if FAST_WALK:
        return _walk_fast(graph, ref, memo, ask)
    memo[ref] = None  # (a tensor in progress: a cycle through it answers None)
    stack = [(ref, _compute(graph, ref))]
    value = None
    try:
        while True:
            r, gen = stack[-1]
            try:
                need = gen.send(value)
            except StopIteration as done:
                sh = done.value
                sh = _known(sh)
                memo[r] = sh
                stack.pop()
                if not stack:
                    return sh
                value = sh
                continue
            if need in memo:
                value = memo[need]
                continue
            memo[need] = None
            stack.append((need, _compute(graph, need)))
            value = None
    except BaseException:
        for r, _ in stack:  # nothing in progress stays memoised
            del memo[r]
        raise


def _known(sh):
    """``sh`` when it is fully known (no dim below 0), else None: what the
    walks memoise."""
    return None if sh is None or (sh and min(sh) < 0) else sh


#: (issue 17) :func:`local_shape` without a generator for the tensors whose
#: shape :func:`_head` gives (constants, variables, placeholders, recorded
#: shapes, no input) or that have their input 0's (``_SAME_SHAPE``): about
#: half of a BERT training graph's walk; False: the reference, a generator
#: per tensor (the same shapes and the same memo)
FAST_WALK = True


def _walk_fast(graph, ref, memo, ask=None):
    """:func:`local_shape`'s walk for a ``ref`` not in ``memo``.  The stack
    holds (tensor, generator), or (tensor, None) for a tensor whose shape is
    that of the tensor above it (its input 0).  ``ask``: see :func:`local_shape`."""
    if ask is not None:
        got = ask(ref)
        if got is not UNANSWERED:
            memo[ref] = got
            return got
    stack = []
    cur = ref  # a tensor to start (memo: None, in progress), or None
    value = None
    memo[ref] = None
    try:
        while True:
            if cur is not None:
                kind, val = _head(graph, cur)
                if kind is _SAME:
                    stack.append((cur, None))
                    if val in memo:
                        value = memo[val]
                        cur = None
                    elif ask is not None and (got := ask(val)) is not UNANSWERED:
                        value = memo[val] = got
                        cur = None
                    else:
                        memo[val] = None
                        cur = val
                    continue
                if kind is _DONE:
                    val = _known(val)
                    memo[cur] = val
                    if not stack:
                        return val
                    value = val
                    cur = None
                    continue
                stack.append((cur, _op_shape(graph, *val)))
                cur = None
                value = None
            r, gen = stack[-1]
            if gen is None:
                sh = _known(value)  # (its input 0's shape)
            else:
                try:
                    need = gen.send(value)
                except StopIteration as done:
                    sh = _known(done.value)
                else:
                    if need in memo:
                        value = memo[need]
                    elif ask is not None and (got := ask(need)) is not UNANSWERED:
                        value = memo[need] = got
                    else:
                        memo[need] = None
                        cur = need
                    continue
            memo[r] = sh
            stack.pop()
            if not stack:
                return sh
            value = sh
    except BaseException:
        if cur is not None:
            del memo[cur]
        for r, _ in stack:  # nothing in progress stays memoised
            del memo[r]
        raise


def _const_ints(graph, ref):
    """The int values of a constant operand (a Const behind Identities)."""
    v = const_value(graph, ref)
    if v is None or v.dtype.kind not in "iu":
        return None
    return [int(x) for x in v.reshape(-1).tolist()]  # (a list: iterating an array ends in a formatted IndexError)


def _const_ints_walk(graph, ref):
    """:func:`_const_ints`, or the fully known shape of the tensor a ``Shape``
    operand reads (yielded to the walk): a generator."""
    src, port, ctrl = parse_tensor(ref)
    node = graph.nodes.get(src)
    if node is not None and node.op == "Shape" and port == 0 and not ctrl and node.input:
        return (yield node.input[0])  # (a Shape is no constant: const_value gives None)
    return _const_ints(graph, ref)


#: :func:`_head`'s kinds: the shape is known / is input 0's / needs :func:`_op_shape`
_DONE, _SAME, _OP = object(), object(), object()


def _head(graph, ref):
    """What :func:`_compute` does first: (_DONE, shape or None) when no
    input's shape is needed, (_SAME, input 0) for an op whose output has its
    input 0's shape, else (_OP, the arguments of :func:`_op_shape`)."""
    src, port, ctrl = parse_tensor(ref)
    node = graph.nodes.get(src)
    if node is None or ctrl:
        return _DONE, None
    recorded = static_shapes(node)
    if recorded is not None and port < len(recorded) and recorded[port] is not None:
        return _DONE, list(recorded[port])
    op = node.op
    if port != 0:
        return _DONE, None
    if op == "Const":
        return _DONE, [d.size for d in node.attr["value"].tensor.tensor_shape.dim[:]]
    if op in ("Placeholder", "VariableV2"):
        return _DONE, _shape_attr(node)
    if op == "VarHandleOp":
        return _DONE, []  # a resource handle is a scalar
    inputs = node.input
    first = inputs[0] if inputs else "^"
    if first.startswith("^"):  # (control inputs come last: then no data input, in a valid graph)
        data = [i for i in inputs[:] if not i.startswith("^")]
        if not data:
            return _DONE, None
        first = data[0]
    else:
        data = None  # (built below only for the ops that read past input 0)
    if op == "ReadVariableOp":
        handle = graph.nodes.get(parse_tensor(first)[0])
        return _DONE, (_shape_attr(handle) if handle is not None and handle.op == "VarHandleOp" else None)
    if op in _SAME_SHAPE:
        return _SAME, first
    if data is None:
        data = [i for i in inputs[:] if not i.startswith("^")]
    return _OP, (node, op, data)


def _compute(graph, ref):
    """The shape of ``ref`` from its producer's op: a generator that yields
    each input tensor whose shape it needs and receives that shape (or None)."""
    kind, val = _head(graph, ref)
    if kind is _DONE:
        return val
    if kind is _SAME:
        return (yield val)
    return (yield from _op_shape(graph, *val))


def _op_shape(graph, node, op, data):
    """:func:`_compute` past :func:`_head`: a generator, as that one."""
    attr = node.attr
    if op in _BROADCAST and len(data) == 2:
        a = (yield data[0])
        b = (yield data[1]) if a is not None else None
        return None if b is None else _broadcast(a, b)
    if op in ("LayerNormGrad", "RMSNormGrad") and len(data) >= 2:  # dx: x's shape (input 1)
        return (yield data[1])
    if op == "AddN":  # every input has the output's shape
        for d in data:
            sh = (yield d)
            if sh is not None:
                return sh
        return None
    if op in _MATMUL and len(data) >= 2:
        a = (yield data[0])
        b = (yield data[1]) if a is not None else None
        if b is None or len(a) != 2 or len(b) != 2:
            return None
        ta = attr["transpose_a"].b if "transpose_a" in attr else False
        tb = attr["transpose_b"].b if "transpose_b" in attr else False
        if (a[0] if ta else a[1]) != (b[1] if tb else b[0]):
            return None
        return [a[1] if ta else a[0], b[0] if tb else b[1]]
    if op in _BATCH_MATMUL and len(data) == 2:
        a = (yield data[0])
        b = (yield data[1]) if a is not None else None
        if b is None or len(a) < 2 or len(b) < 2:
            return None
        adj_a = attr["adj_x"].b if "adj_x" in attr else False
        adj_b = attr["adj_y"].b if "adj_y" in attr else False
        m, ka = (a[-1], a[-2]) if adj_a else (a[-2], a[-1])
        kb, n = (b[-1], b[-2]) if adj_b else (b[-2], b[-1])
        if ka != kb:
            return None
        if op == "BatchMatMul":  # no broadcasting: equal batch dims
            if a[:-2] != b[:-2]:
                return None
            batch = list(a[:-2])
        else:
            batch = _broadcast(a[:-2], b[:-2])
            if batch is None:
                return None
        return batch + [m, n]
    if op in ("Fill", "BroadcastTo") and len(data) == 2:
        dims = (yield from _const_ints_walk(graph, data[0 if op == "Fill" else 1]))
        return None if dims is None or any(d < 0 for d in dims) else dims
    if op == "Tile" and len(data) == 2:
        mult = (yield from _const_ints_walk(graph, data[1]))
        x = (yield data[0]) if mult is not None else None
        if x is None or len(mult) != len(x):
            return None
        return [a * b for a, b in zip(x, mult)]
    if op == "Reshape" and len(data) == 2:
        target = (yield from _const_ints_walk(graph, data[1]))
        if target is None or any(d < -1 for d in target) or target.count(-1) > 1:
            return None
        if -1 not in target:
            return target
        x = (yield data[0])
        if x is None:
            return None
        total = 1
        for d in x:
            total *= d
        rest = 1
        for d in target:
            if d != -1:
                rest *= d
        if rest == 0 or total % rest:
            return None
        return [total // rest if d == -1 else d for d in target]
    if op == "Transpose" and len(data) == 2:
        perm = _const_ints(graph, data[1])
        x = (yield data[0]) if perm is not None else None
        if x is None or sorted(perm) != list(range(len(x))):
            return None
        return [x[p] for p in perm]
    if op in _REDUCE and len(data) == 2:
        axes = _const_ints(graph, data[1])
        x = (yield data[0]) if axes is not None else None
        if x is None:
            return None
        r = len(x)
        if any(not -r <= a < r for a in axes):
            return None
        axes = {a % r for a in axes} if r else set()
        keep = attr["keep_dims"].b if "keep_dims" in attr else False
        return [1 if i in axes else d for i, d in enumerate(x)] if keep else \
            [d for i, d in enumerate(x) if i not in axes]
    return None


def _shape_attr(node):
    s = node.attr["shape"].shape if "shape" in node.attr else None
    return None if s is None or s.unknown_rank else [d.size for d in s.dim[:]]


def _broadcast(a, b):
    """NumPy broadcasting of two fully known shapes, or None if incompatible."""
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + list(a)
    b = [1] * (n - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return out


# --------------------------------------------------------------- constants
def const_node(graph, ref, through=("Identity",), max_depth: int = 8):
    """The Const node behind ``ref`` seen through single-input pass-through ops
    (``through``, at most ``max_depth`` of them), or None."""
    node = graph.nodes.get(parse_tensor(ref)[0])
    depth = 0
    while node is not None and node.op in through and node.input and depth < max_depth:
        node = graph.nodes.get(parse_tensor(node.input[0])[0])
        depth += 1
    if node is None or node.op != "Const":
        return None
    return node


def const_value(graph, ref, through=("Identity",), max_depth: int = 8):
    """numpy value of the Const behind ``ref`` (see :func:`const_node`), or None
    (also for a malformed constant)."""
    node = const_node(graph, ref, through, max_depth)
    if node is None:
        return None
    try:
        return tensor_value(node.attr["value"].tensor)
    except Exception:  # noqa: BLE001 - malformed constant: not a constant for us
        return None


#: decode the common TensorProtos here (:func:`tensor_value`); False: the
#: reference, ``tf.make_ndarray`` for every one (issue 17, 17i)
FAST_TENSOR_DECODE = True

#: DataType -> (numpy dtype, the TensorProto field of its values), the types
#: decoded without ``tf.make_ndarray``
_DECODE = {1: (np.float32, "float_val"), 2: (np.float64, "double_val"), 3: (np.int32, "int_val"),
           9: (np.int64, "int64_val"), 10: (np.bool_, "bool_val")}


def tensor_value(tensor):
    """``tf.make_ndarray(tensor)``, the same array (dtype, shape, values),
    without its per-call overhead for float32/64, int32/64 and bool tensors
    whose values are packed (``tensor_content``) or listed in full (one value
    per element); every other tensor goes to ``tf.make_ndarray``."""
    spec = _DECODE.get(tensor.dtype) if FAST_TENSOR_DECODE else None
    if spec is not None:
        shape = [d.size for d in tensor.tensor_shape.dim[:]]
        if min(shape, default=0) >= 0:
            content = tensor.tensor_content
            if content:
                if len(content) == math.prod(shape) * np.dtype(spec[0]).itemsize:
                    return np.frombuffer(content, dtype=spec[0]).copy().reshape(shape)
            else:
                vals = getattr(tensor, spec[1])
                if len(vals) == math.prod(shape) and len(vals):
                    return np.fromiter(vals, dtype=spec[0], count=len(vals)).reshape(shape)
    import tensorflow as tf

    return tf.make_ndarray(tensor)
