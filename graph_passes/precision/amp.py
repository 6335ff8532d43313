"""The ``precision`` pass: list painting and the fewest casts (CANN / grappler AMP).

Preconditions
-------------
* A graph (main graph or a function body with ``_Arg``/``_Retval`` nodes)
  whose edges carry consistent dtypes.
* ``ctx.options`` exposes ``precision`` (canonical CANN mode), ``low_dtype``
  and the list / override options of ``npu_amp_tf.options`` (read by
  attribute; missing attributes take their defaults).

Postconditions
--------------
* Every float node runs in FP32 or in the low dtype (FP16/BF16) as decided
  below, and every edge carries the dtype its consumer expects: a Cast is
  inserted only where producer and consumer disagree.
* At most one Cast per (tensor, dtype); an existing Cast that fits is reused;
  a Cast is never fed by another float Cast (chains are collapsed to their
  root tensor).
* No node gets a dtype for which no kernel is registered on its device type
  (CPU when unset); a fallback is a warning in the report.
* Fetched/preserved nodes, ``_Arg``/``_Retval``, variables and their reads,
  stateful ops (optimizer updates), v1 loop plumbing, TensorList/variant ops
  and function calls keep their dtypes (casts go around them).  ``Switch`` /
  ``Merge`` of a lowered conditional (not fed by ``LoopCond``, ``Enter`` or
  ``NextIteration``) are clear ops: both branches of a Merge carry one dtype.
* Running the pass twice gives the graph of running it once.
* Inserted nodes are named ``<src>/CastToFp16``, ``<src>/CastToBf16``,
  ``<src>/CastToFp32`` (``_<port>`` appended for output ports > 0).

Painting (``allow_mix_precision`` / ``allow_mix_precision_bf16``), one walk in
topological order (v1 loop back edges cut):

1. white ops go low precision; black ops and unknown ops (policy ``black``)
   stay FP32 and are *hard* FP32;
2. gray and clear ops follow their producers: each float data input votes
   with the dtype of its root tensor (looking through float Casts); constants,
   variable reads and nodes that had no vote themselves do not vote.  Low
   wins a majority, and a tie when no voter is hard FP32; a node that stays
   FP32 because of a hard voter is hard itself (black propagates downstream
   through gray/clear);
3. a low decision is refused (FP32, warning) when a constant input would
   underflow to 0 or overflow to inf in the low dtype, or when no kernel
   exists; ``keep_dtype`` (node attr ``_keep_dtype`` or ``keep_dtype_nodes``)
   keeps a node's dtype; ``low_precision_nodes`` forces low where a kernel
   exists;
4. walking back from the outputs, a gray/clear node painted low returns to
   FP32 when that needs fewer casts (``_demote``): never a cast that buys
   nothing;
5. walking back again, a clear node left FP32 whose readers want the low
   dtype goes low when that needs fewer casts (``_follow_readers``): one cast
   before a fan-out, not one per reader.

The mode, low dtype, lists and name overrides come from the precision
planner (``planner.py``), which the passes before this one also ask.

Then FP32 constants whose consumers all want the low dtype are converted in
place, Casts from int/bool retarget their ``DstT``, and the remaining
mismatching edges get one Cast each.

Before / after (MLP training step)::

    x ──► MatMul ──► BiasAdd ──► Relu ──► MatMul ──► SoftmaxXent ──► loss
           ▲ w1 (Read)   ▲ b1 (Read)         ▲ w2

    x ─► x/CastToFp16 ─► MatMul16 ─► BiasAdd16 ─► Relu16 ─► MatMul16 ─► MatMul/CastToFp32 ─► SoftmaxXent ─► loss
    w1 ─► w1/read/CastToFp16 ─┘  b1 ─► b1/read/CastToFp16 ─┘     w2 ─► w2/read/CastToFp16 ─┘
    (backward MatMuls likewise in FP16; gradients are cast to FP32 before ApplyGradientDescent)
"""
from __future__ import annotations

import functools
from collections import deque
from itertools import repeat

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.node_def_pb2 import NodeDef as _NodeDef

from .. import registry
from ..errors import GraphError
from ..graph import LOOP_BACK_OPS, parse_tensor, tensor_name
from ..manager import Pass, register_pass
from ..report import Report
from . import lists as _lists
from . import native as _native
from . import stats as _stats
from .planner import MODES, canonical_mode, plan_for  # noqa: F401  (re-exported)

FP32 = registry.DT_FLOAT
FLOATS = registry.FLOAT_TYPES

FIXED_OPS = {
    "Placeholder": "graph input", "PlaceholderWithDefault": "graph input",
    "_Arg": "function argument", "_Retval": "function result",
    "Cast": "casts adapt their source dtype instead",
    "Enter": "v1 loop plumbing", "RefEnter": "v1 loop plumbing",
    "Exit": "v1 loop plumbing", "RefExit": "v1 loop plumbing",
    "Merge": "v1 loop plumbing", "RefMerge": "v1 loop plumbing",
    "Switch": "v1 loop plumbing", "RefSwitch": "v1 loop plumbing",  # (cond ones: see COND_OPS)
    "NextIteration": "v1 loop plumbing", "RefNextIteration": "v1 loop plumbing",
    "LoopCond": "v1 loop plumbing",
    "PartitionedCall": "function call", "StatefulPartitionedCall": "function call",
    "While": "function call", "StatelessWhile": "function call",
    "If": "function call", "StatelessIf": "function call",
    "Case": "function call", "StatelessCase": "function call",
    "SymbolicGradient": "function call",
    "TransData": "layout conversion placed after the precision pass: keeps its dtype",
    "Bitcast": "reinterprets its input's bits: another input dtype changes the values and "
               "the shape (Keras 3 argmax/accuracy bitcast float32 logits)",
}
# Switch/Merge of a lowered conditional (tf.cond, smart_cond, a lowered If):
# not loop plumbing, they move data like clear ops (lists.CLEAR); a Merge's
# inputs (both branches) share one attr T, so the branches vote and the edge
# fix casts the branch that disagrees.  Loop Switch/Merge stay fixed.
COND_OPS = frozenset({"Switch", "Merge"})
_LOOP_MARKERS = frozenset({"LoopCond", "NextIteration", "RefNextIteration", "Enter", "RefEnter"})
# ops that hold the FP32 master weights: their reads neither vote nor change
VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp", "ReadVariableOp",
                          "ResourceGather", "_ReadVariablesOp"})
# where only the T attr follows the activations (U keeps FP32 statistics)
T_ONLY_OPS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
                        "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3",
                        "_FusedBatchNormEx"})
# single-input pass-throughs through which a constant reaches its consumer
_CONST_THROUGH = frozenset({"Identity", "Snapshot", "Reshape", "ExpandDims", "Squeeze",
                            "StopGradient", "Enter", "RefEnter"})

_CAST_SUFFIX = {registry.DT_HALF: "CastToFp16", registry.DT_BFLOAT16: "CastToBf16",
                registry.DT_FLOAT: "CastToFp32"}


def _np_dtype(dt):
    return tf.as_dtype(dt).as_numpy_dtype


def _why_unsafe(arr, dt):
    """Why the float32 values ``arr`` cannot be held in ``dt`` (or None)."""
    # the overflow is what we are testing for: not a warning for the user's console
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        low = arr.astype(_np_dtype(dt))
    under = (arr != 0) & (low.astype(np.float32) == 0)
    over = np.isfinite(arr) & ~np.isfinite(low.astype(np.float32))
    if under.any():
        v = float(arr[under].flat[0])
        return f"underflows to 0 in {registry.dtype_name(dt)} (value {v:g})"
    if over.any():
        v = float(arr[over].flat[0])
        return f"overflows to inf in {registry.dtype_name(dt)} (value {v:g})"
    return None


class _NodeInfo:
    __slots__ = ("attrs", "in_attr", "fixed", "fidx")

    def __init__(self, attrs, in_attr, fixed):
        self.attrs = attrs      # changeable float type attrs
        self.in_attr = in_attr  # per data input index: its type attr name or ""
        self.fixed = fixed      # reason it is never re-typed, or None
        # the data input indices whose type attr is in attrs (ascending)
        self.fidx = tuple(k for k, a in enumerate(in_attr) if a)


@register_pass("precision")
class PrecisionPass(Pass):
    __doc__ = __doc__
    tracks_edits = True  # in-place re-typing is declared (self.touched -> graph.touch)
    #: the run's shortcuts (issue 17): node dtypes and facts memoised per node
    #: and per op signature, the delayed casts' acyclicity proven from the
    #: order at hand.  False runs the reference (every dtype from the
    #: registry, every fact computed, the full sort); both give the same
    #: graph and report (tests/test_precision_fast.py)
    fast_paths = True
    #: (issue 17l) run ``_paint``, ``_demote`` and ``_follow_readers`` through
    #: the native entry point the caller puts on the pass context
    #: (``ctx.native_paint``: custom_ops/precision_paint.cc, injected by
    #: npu_amp_tf.pipeline) in the mixed-precision modes, with the fast
    #: paths on.  False, or no entry point, runs the Python loops (the
    #: reference; the same graph and report, tests/test_precision_native.py).
    #: The report's ``precision_paint`` says which ran ("native" / "python")
    native_paint = True
    #: (issue 17n) the native path's Python work batched: the arrays built
    #: with a Python statement per class, per distinct (class, device) and
    #: per node that needs one instead of per node, the dtype/fact memos of
    #: the re-typed nodes filled per (class, re-typings) instead of asked of
    #: the registry per node.  False runs 17l's per-node build (the A/B
    #: reference; both give the Python loops' graph and report)
    native_batch = True
    #: (issue 17t) with ``native_batch``: the native result applied from its
    #: columns (numpy selections, a Python statement per re-typed node and
    #: per warning), and the painted nodes' report entries written from its
    #: rows when the report's decisions are first read
    #: (``Report.defer_decisions``) instead of built as dicts in every run.
    #: False runs 17n's ``native._apply`` (the A/B reference; the same graph
    #: and, once read, the same report: tests/test_precision_bulk.py)
    bulk_apply = True
    #: (issue 17) the native painting's strings with the inputs of the nodes
    #: no pass created or edited read by the graph's builder from the graph it
    #: was built from (``Graph.base_inputs``: the grappler bridge, from the
    #: item it holds) instead of joined from every NodeDef here; False, or no
    #: source, joins them all (the reference; the same bytes,
    #: tests/test_paint_strings.py)
    base_strings = True
    #: (issue 17t) ``_fix_edges`` decides every cast first (a Cast NodeDef
    #: copied from a template per (SrcT, DstT, device), the existing-Cast
    #: search only for sources an existing Cast reads) and the graph adds
    #: them and re-wires the edges in one call (``Graph.add_and_rewire``),
    #: in the order of the reference; False: ``cast_to`` per edge (the
    #: reference; the same graph and report, tests/test_precision_bulk.py)
    bulk_casts = True
    #: (issue 17) ``_delay_widening_casts`` first tries to prove, without a
    #: topological sort of the whole graph, that no new FP32 copy waits for
    #: anything (:meth:`_none_can_wait`: Kahn's FIFO order ranks nodes by
    #: their longest path from a source, so a producer of smaller depth than
    #: the copy's source comes before it); then the pass ends without the
    #: sort.  False: always sort (the reference; the same graph and report,
    #: tests/test_precision_delay.py)
    delay_depth_proof = True
    #: (issue 17) :meth:`_retype_all` saves its nodes' snapshots and drops
    #: their memos for the whole batch (``_Snapshot.save_all``, C-level pops)
    #: instead of two method calls per node; False: per node (the reference;
    #: the same snapshot and memos)
    batch_saves = True
    #: (issue 17) ``_fix_edges_bulk`` looks for ``keep_fp16_copies``' FP16
    #: working copies once per run, and asks ``_fp16_copy_read`` about each
    #: new cast only when there are some; False: asks every time (the
    #: reference; the same graph)
    copy_probe = True
    #: (issue 17, the C++ core's milestone 2) with ``bulk_casts`` and the
    #: native painting, the casts on mismatched edges are decided in C++ by
    #: the painter that painted (``native.fix_edges``, custom_ops/
    #: precision_paint.cc ``CastPlan``): the same casts, names, reuse and edge
    #: order as ``_fix_edges_bulk``, which stays the reference (False; the
    #: same graph and report, tests/test_precision_bulk.py)
    native_casts = True

    # ------------------------------------------------------------ set-up
    def run(self, graph, ctx):
        self.g = graph
        self.ctx = ctx
        self.plan = plan = plan_for(ctx)
        self.mode, self.low, self.low_name = plan.mode, plan.low, plan.low_name
        self.default_dev = ctx.default_device_type()
        self.lists, self.op_list = plan.lists, plan.op_list
        self.unknown_policy = plan.unknown_policy
        self.protected = ctx.protected
        self._info = {}
        self._painted = None  # (fast path) names _paint decided: float, not fixed, not Const
        self._rmemo = None  # (fast path) tensor -> its readers, while edges and Casts stay
        self._dts = {}  # name -> (node, input dtypes, output dtypes) memo (see in_dtypes)
        self._sig_dts = {}  # signature key (see _key) -> (input dtypes, output dtypes)
        self._sig_info = {}  # signature key -> _NodeInfo (ops outside COND_OPS)
        self._keys = {}  # (fast path) name -> (node, registry.signature_key), while unedited
        # (fast path, issue 17f) name -> the C++ index's signature class (an
        # int: equal classes, equal signature keys) of the nodes no pass has
        # edited yet; this pass drops a node's entry before editing it
        self._cls = _usable_classes(graph) if self.fast_paths else None
        self._cls_cur = {}  # signature class -> current() of its nodes
        self._kernel_cls = {}  # (class, device string, dtype) -> (kernel_ok before fused_ops, device type)
        self._other_types = {}  # (op, changeable attrs) -> (the op's other type attrs, sorted;
        #                         all of them fixed by a signature class)
        self._dev_types = {}  # device string -> device type
        self._kernel_cache = {}
        self._unsafe_cache = {}
        #: (issue 17n, native painting with native_batch) the nodes with a
        #: float input of another float dtype than they want after painting
        #: (custom_ops/precision_paint.cc): the only ones _fix_edges visits
        self._mismatch = None
        #: (issue 17t, bulk_apply) name -> which of its inputs mismatch (bit k:
        #: input k < 30; bit 30: any from 30 on), for _fix_edges_bulk
        self._mismatch_inputs = None
        #: (issue 17t, bulk_apply) the Consts _convert_consts would pass over
        #: whatever their attrs (from the native Const wants and their classes'
        #: dtypes: no reader, readers wanting two dtypes, or the one they want
        #: not float or their own), or None
        self._const_skip = None
        #: (the same) (name -> node index, per node index the bit mask of the
        #: dtypes a Const's readers want, -1: unknown) for _convert_consts
        self._const_wants = None
        #: (the same) the painted nodes in the low dtype after painting (_finish)
        self._painted_low = None
        #: (issue 17t, bulk_apply) the painted nodes' report entries, as the
        #: native result's rows (native._Entries), written when read
        self._entries = None
        #: (issue 17, native painting with bulk_apply) (the C++ painter kept
        #: open, its result record, the painted names and nodes), for
        #: native.fix_edges; dropped after _fix_edges
        self._painted_with = None
        #: (issue 17) (the C++ painter, the painted names, the new casts' names)
        #: after native.fix_edges, for native.delay_plan
        self._cast_plan = None
        #: the nodes _adapt_casts and _convert_consts re-typed, in order
        self._late = []
        # (issue 17) the native result's re-typings as (names, ((attr, AttrValue bytes), ...))
        # per batch (precision/native.py _apply_bulk), declared to the graph as records
        self._retyped = []
        self.casts_inserted = 0
        self.copy_reads = 0
        self._contested = set()  # painted low although an FP32 producer voted against
        self.touched = set()  # nodes whose dtypes changed: only their edges can mismatch
        self.state = {}   # node -> "low" | "f32" | "hard" | "neutral" | "fixed"
        self.decisions = {}

        shapes = _stats.ShapeTable(graph)
        # (issue 17) the shapes the layer-norm run before the parse walked, for this run's lookups
        pre = getattr(ctx, "prefused", None)
        shapes.ask = pre.shape_asker(graph) if pre is not None else None
        # the shape-based figures are deferred (computed when the report is
        # read): keep the graph as it is now for their "before" half
        order = self.g.topo_order()
        #: the graph had no cycle outside loops when the pass began (its
        #: edits, casts on existing edges, cannot close one)
        self._acyclic_at_start = not (self.g._topo_cache and self.g._topo_cache[1])
        self._before = before = _Snapshot(graph, list(order), copy_on_write=self.fast_paths)
        shapes.freeze_source(before.graph_def)
        self.new_casts = []
        self.casts_delayed = 0

        changed = 0
        self.paint_path = "python"
        if self.mode != "must_keep_origin_dtype":
            native = self._native_entry()
            res = _native.paint(self, order, native) if native is not None else None
            if res is not None:  # (issue 17l) _paint, _demote, _follow_readers in C++
                changed = res
                self.paint_path = "native"
            else:
                changed = self._paint(order)
            if res is None and self.mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
                if self.fast_paths:
                    self._rmemo = {}  # edges and Casts stay as they are until _adapt_casts
                changed += self._demote(order)
                changed += self._follow_readers(order)
                self._rmemo = None
            self._adapt_casts()
            self._convert_consts()
            self._fix_edges(shapes)
            self._painted_with = None
            if self.ctx.option("delay_fp32_copies", True):
                self._delay_widening_casts(shapes)
            self._cast_plan = None  # (the C++ painter closes)
        else:
            for name, node in graph.nodes.items():
                if self.info(node).attrs:
                    self._record(node, "keep", "precision_mode=must_keep_origin_dtype: no change")
        shapes.ask = None  # (the run's lookups only: later passes and the report walk in Python)
        touched = self.touched
        if self._retyped:
            # (issue 17) the batches' nodes no step re-typed since (``_late``)
            # declared as re-typed by their records (Graph.note_retyped)
            late = set(self._late)
            groups = self._retyped if not late else [
                ([n for n in names if n not in late], items) for names, items in self._retyped]
            graph.note_retyped(groups)
            touched = touched.difference(*(names for names, _ in groups))
            self._retyped = []
        graph.touch(*touched)  # re-typed in place: the OpDef guard checks them
        return self._finish(shapes, before, changed)

    def _native_entry(self):
        """The native painting entry point the caller put on the pass
        context (``ctx.native_paint``; see :mod:`.native`), when this run
        may use it: the switch on, fast paths on, a mixed-precision mode;
        else None (the Python loops run)."""
        if not (self.native_paint and self.fast_paths and self.mode in _native.MIX_MODES):
            return None
        return getattr(self.ctx, "native_paint", None)

    # ------------------------------------------------------- node facts
    def info(self, node) -> _NodeInfo:
        cls = self._cls
        if cls is not None:  # (fast path: per signature class, for unedited nodes outside COND_OPS)
            c = cls.get(node.name)
            if c is not None:
                res = self._sig_info.get(c)
                if res is not None:
                    return res
        inf = self._info.get(node.name)
        if inf is not None and inf[0] == node.op:
            return inf[1]
        res = self._compute_info(node)
        self._info[node.name] = (node.op, res)
        return res

    # dtypes of a node follow from its attrs alone; this pass edits attrs in
    # place, and every such edit goes through _retype / _set_type (which drop
    # the node's memo entry), so the memo below stays true for the whole run
    def _memo_dts(self, node):
        if not self.fast_paths:
            ins, outs = self.g.input_dtypes(node), self.g.output_dtypes(node)
            return node, None if ins is None else tuple(ins), None if outs is None else tuple(outs)
        hit = self._dts.get(node.name)
        if hit is None or hit[0] is not node:
            hit = self._fill_dts(node, self._key(node))
        return hit

    def _key(self, node):
        """The node's signature key for the per-signature memos (fast path):
        its C++ signature class (an int) while the node is as the index saw
        it, else ``registry.signature_key`` (a tuple or None), computed once
        per node while the node is unedited."""
        name = node.name
        cls = self._cls
        if cls is not None:
            c = cls.get(name)
            if c is not None:
                return c
        hit = self._keys.get(name)
        if hit is not None and hit[0] is node:
            return hit[1]
        key = registry.signature_key(node)
        self._keys[name] = (node, key)
        return key

    def _edited(self, name):
        """Drop ``name``'s per-node memos before its attrs change."""
        self._edited_all((name,))

    def _edited_all(self, names):
        """:meth:`_edited` of each of ``names`` (C-level pops)."""
        drop = repeat(None)
        for memo in (self._dts, self._keys) if self._cls is None else (self._dts, self._keys, self._cls):
            deque(map(memo.pop, names, drop), maxlen=0)

    def _fill_dts(self, node, key):
        facts = self._sig_dts.get(key) if key is not None else None
        if facts is None:
            ins = self.g.input_dtypes(node)
            outs = self.g.output_dtypes(node)
            facts = (None if ins is None else tuple(ins), None if outs is None else tuple(outs))
            if key is not None:
                self._sig_dts[key] = facts
        hit = self._dts[node.name] = (node, facts[0], facts[1])
        return hit

    def in_dtypes(self, node):
        """``Graph.input_dtypes`` (a tuple), memoised for this run."""
        return self._memo_dts(node)[1]

    def out_dtypes(self, node):
        """``Graph.output_dtypes`` (a tuple), memoised for this run."""
        return self._memo_dts(node)[2]

    def tensor_dtype(self, ref):
        """``Graph.tensor_dtype``, from the memo."""
        src, port, ctrl = parse_tensor(ref)
        node = None if ctrl else self.g.nodes.get(src)
        if node is None:
            return None
        dts = self._memo_dts(node)[2]
        if dts is None or port >= len(dts):
            return None
        return dts[port]

    def _retype(self, node, attrs, dt):
        self._before.save(node.name)
        self._edited(node.name)
        registry.retype(node, attrs, dt)  # fused args (TArgs) follow

    def _retype_all(self, nodes, names, op, attrs, path):
        """:meth:`_retype` of each node of ``nodes`` (named ``names``, all of
        op type ``op``) by each dtype of ``path`` in turn: the same saves,
        dropped memos and attrs (``registry.retype_all``), without the calls
        per node."""
        if self.batch_saves:
            self._before.save_all(names)
            self._edited_all(names)
        else:
            save, edited = self._before.save, self._edited
            for name in names:
                save(name)
                edited(name)
        for dt in path:
            registry.retype_all(nodes, op, attrs, dt)

    def _set_type(self, node, attr, dt):
        self._before.save(node.name)
        self._edited(node.name)
        node.attr[attr].type = dt

    def _float_inputs(self, node, info):
        """[(index, input)] of the data inputs typed by a changeable attr of
        ``node`` (``info.in_attr``).  The fast path visits only those
        indices: a node's control inputs (Keras' ZerosLike and ShapeN carry
        a hundred each) are never read."""
        ins = node.input
        if not self.fast_paths:
            in_attr = info.in_attr
            return [(k, inp) for k, inp in enumerate(ins)
                    if not (inp.startswith("^") or k >= len(in_attr) or not in_attr[k])]
        n = len(ins)
        # (one read of each input: a protobuf container's item is a new str each time)
        return [(k, inp) for k in info.fidx if k < n for inp in (ins[k],) if inp[:1] != "^"]

    def in_loop_plumbing(self, node):
        """A Switch fed a ``LoopCond`` predicate (or a loop-carried value
        straight from an ``Enter``), or a Merge fed by ``NextIteration`` or
        ``Enter``: part of a v1 while loop, where one loop-carried value keeps
        one dtype on every edge.  Switch/Merge of a conditional are not."""
        for inp in node.input[:]:
            if inp.startswith("^"):
                continue
            src = self.g.nodes.get(parse_tensor(inp)[0])
            if src is not None and src.op in _LOOP_MARKERS:
                return True
        return False

    def _compute_info(self, node):
        # a registered op's facts follow from the attrs its args name (the
        # signature key); Switch/Merge also from their producers
        if node.op in COND_OPS or not self.fast_paths:
            return self._compute_info_of(node)
        key = self._key(node)
        if key is None:
            return self._compute_info_of(node)
        res = self._sig_info.get(key)
        if res is None:
            res = self._sig_info[key] = self._compute_info_of(node)
        return res

    def _compute_info_of(self, node):
        meta = _op_meta(node.op)
        if meta is None:
            return _NodeInfo((), [], "function call" if node.op in self.g.functions else "unknown op")
        fixed, used, defaults, in_args = meta
        if node.op in COND_OPS and not self.in_loop_plumbing(node):
            fixed = None
        attrs = []
        nattr = node.attr
        for a in used:
            av = nattr[a] if a in nattr else defaults.get(a)
            if av is not None and av.type in FLOATS:
                attrs.append(a)
        if node.op in T_ONLY_OPS:
            attrs = [a for a in attrs if a == "T"]
        in_attr = []
        for type_attr, list_attr, number_attr in in_args:
            if list_attr:
                n = len(nattr[list_attr].list.type) if list_attr in nattr else 0
                in_attr.extend([""] * n)
            else:
                n = nattr[number_attr].i if number_attr and number_attr in nattr else 1
                in_attr.extend([type_attr if type_attr in attrs else ""] * n)
        return _NodeInfo(tuple(attrs), in_attr, fixed)

    def current(self, node, info):
        """The dtype ``node`` runs in now (its first changeable attr's).
        Fast path: per signature class for a node no pass has edited (the
        attr is one its class fixes)."""
        cls = self._cls
        if cls is not None:
            c = cls.get(node.name)
            if c is not None:
                cur = self._cls_cur.get(c)
                if cur is None:
                    cur = self._cls_cur[c] = self._current_of(node, info)
                return cur
        return self._current_of(node, info)

    def _current_of(self, node, info):
        a = info.attrs[0]
        if a in node.attr:
            return node.attr[a].type
        return registry.op_def(node.op) and next(
            x.default_value.type for x in registry.op_def(node.op).attr if x.name == a)

    def device_type(self, node):
        if not self.fast_paths:
            return registry.device_type_of(node, default=self.default_dev)
        dev = node.device
        t = self._dev_types.get(dev)
        if t is None:
            t = self._dev_types[dev] = registry.device_type_of(node, default=self.default_dev)
        return t

    def kernel_ok(self, node, info, dt):
        ckey = None
        if self.fast_paths:
            # (issue 17f) per signature class, device string and dtype when the
            # class fixes every type attr the check reads
            c = self._cls.get(node.name) if self._cls is not None else None
            if c is not None:
                ckey = (c, node.device, dt)
                hit = self._kernel_cls.get(ckey)
                if hit is not None:
                    ok, dev_type = hit
                    if ok and "fused_ops" in node.attr and registry.fused_ops_broken(
                            node.op, dev_type, dt, node.attr["fused_ops"].list.s):
                        return False
                    return ok
            entry = self._other_types.get((node.op, info.attrs))
            if entry is None:
                entry = self._other_types[(node.op, info.attrs)] = _other_type_attrs(node.op, info.attrs)
            names, covered = entry
            if not covered:
                ckey = None
            nattr = node.attr
            others = dict((a, nattr[a].type) for a in names if a in nattr)
            key = (node.op, self.device_type(node), dt, tuple(others.items()))
        else:
            others = {}
            od = registry.op_def(node.op)
            for a in od.attr:
                if a.type == "type" and a.name not in info.attrs and a.name in node.attr:
                    others[a.name] = node.attr[a.name].type
            key = (node.op, self.device_type(node), dt, tuple(sorted(others.items())))
        ok = self._kernel_cache.get(key)
        if ok is None:
            want = dict(others)
            for a in info.attrs:
                want[a] = dt
            ok = self._kernel_cache[key] = registry.has_kernel(node.op, key[1], want)
        if ckey is not None:
            self._kernel_cls[ckey] = (ok, key[1])
        if ok and "fused_ops" in node.attr and registry.fused_ops_broken(
                node.op, key[1], dt, node.attr["fused_ops"].list.s):
            return False
        return ok

    def is_keep(self, node):
        return self.plan.is_keep(node)

    def is_forced_low(self, node):
        return self.plan.is_forced_low(node.name)

    def classify(self, node):
        entry = self.op_list.get(node.op)
        if entry is not None:
            return entry
        dts = self.out_dtypes(node) or []
        if not any(registry.base_dtype(d) in FLOATS for d in dts):
            return "gray", "reads floats, writes none: follows its producers (no cast buys anything)"
        if self.unknown_policy == "gray":
            return "gray", "in no list; unknown_op_policy='gray'"
        return "black", "in no list; unknown_op_policy='black'"

    # ---------------------------------------------------- tensor roots
    def root(self, ref):
        """Walk back through float->float Casts to the tensor they copy."""
        seen = 0
        while seen < 64:
            src, port, _ = parse_tensor(ref)
            node = self.g.nodes.get(src)
            if node is None or node.op != "Cast" or not node.input:
                return ref
            if node.attr["SrcT"].type not in FLOATS or node.attr["DstT"].type not in FLOATS:
                return ref
            ref = node.input[0]
            seen += 1
        return ref

    def _voter(self, ref):
        """(dtype, hard, producer) of a voting input, or None when it does not vote."""
        if self.fast_paths:
            return self._voter_fast(ref)
        r = self.root(ref)
        src, port, _ = parse_tensor(r)
        node = self.g.nodes.get(src)
        if node is None:
            return None
        if node.op == "Const" or node.op in VARIABLE_OPS or node.op == "Cast":
            return None  # adapts (Const, int->float Cast) or is a variable read
        st = self.state.get(src)
        if st == "neutral":
            return None
        dt = self.tensor_dtype(r)
        if dt is None or registry.base_dtype(dt) not in FLOATS:
            return None
        dt = registry.base_dtype(dt)
        return dt, (st == "hard" and dt == FP32), src

    def _voter_fast(self, ref):
        # _voter with root / tensor_dtype inlined (the same steps)
        nodes = self.g.nodes
        r = ref
        for _ in range(64):
            src, port, _c = parse_tensor(r)
            node = nodes.get(src)
            if node is None:
                return None
            if node.op != "Cast" or not node.input:
                break
            na = node.attr
            if na["SrcT"].type not in FLOATS or na["DstT"].type not in FLOATS:
                break
            r = node.input[0]
        else:
            src, port, _c = parse_tensor(r)
            node = nodes.get(src)
            if node is None:
                return None
        op = node.op
        if op == "Const" or op in VARIABLE_OPS or op == "Cast":
            return None
        st = self.state.get(src)
        if st == "neutral" or _c:
            return None
        hit = self._dts.get(src)
        dts = hit[2] if hit is not None and hit[0] is node else self._memo_dts(node)[2]
        if dts is None or port >= len(dts):
            return None
        dt = registry.base_dtype(dts[port])
        if dt not in FLOATS:
            return None
        return dt, (st == "hard" and dt == FP32), src

    def _const_of(self, ref):
        """A Const reaching this input through casts / identities, or None."""
        for _ in range(16):
            r = self.root(ref)
            node = self.g.nodes.get(parse_tensor(r)[0])
            if node is None:
                return None
            if node.op == "Const":
                return node
            if node.op in _CONST_THROUGH and node.input:
                ref = node.input[0]
                continue
            return None
        return None

    def unsafe_const(self, node, dt):
        """Why a float Const cannot hold its values in ``dt`` (or None)."""
        key = (node.name, dt)
        if key in self._unsafe_cache:
            return self._unsafe_cache[key]
        why = None
        if node.attr["dtype"].type == FP32 and dt != FP32:
            why = _why_unsafe(tf.make_ndarray(node.attr["value"].tensor), dt)
        self._unsafe_cache[key] = why
        return why

    # --------------------------------------------------------- painting
    def _record(self, node, state, reason, lst=None, dtype=None, **extra):
        dt = dtype if dtype is not None else None
        fields = {"reason": reason, "state": state}
        if lst is not None:
            fields["list"] = lst
        if dt is not None:
            fields["dtype"] = registry.dtype_name(dt)
        fields.update(extra)
        self.decisions[node.name] = fields

    def _paint(self, order):
        g = self.g
        changed = 0
        painted = set() if self.fast_paths and len(order) == len(g.nodes) else None
        cls_get = self._cls.get if self._cls is not None else None
        sig_info = self._sig_info
        for name in order:
            if cls_get is not None:  # (fast path: a node whose class has no float attr is
                c = cls_get(name)    # skipped without reading its NodeDef)
                if c is not None:
                    info = sig_info.get(c)
                    if info is not None and not info.attrs:
                        continue
            node = g.nodes[name]
            if node.op == "Const":
                continue
            info = self.info(node)
            if not info.attrs:
                continue
            cur = self.current(node, info)
            if info.fixed:
                self.state[name] = "fixed"
                self._record(node, "fixed", f"fixed: {info.fixed}", lst="fixed", dtype=cur)
                continue
            if painted is not None:
                painted.add(name)
            target, state, reason, lst = self._decide(node, info, cur)
            if target != cur:
                self._retype(node, info.attrs, target)
                changed += 1
                self.touched.add(name)
            self.state[name] = state
            self._record(node, state, reason, lst=lst, dtype=target, was=registry.dtype_name(cur))
        self._painted = painted
        return changed

    # ------------------------------------------------------------ demotion
    def _readers(self, ref, exclude=None):
        """[(consumer, index)] reading tensor ``ref``, looking through float Casts."""
        memo = self._rmemo
        if memo is not None:  # (fast path, while no edge and no Cast changes)
            hit = memo.get(ref)
            if hit is None:
                hit = memo[ref] = self._readers_of(ref)
            if exclude is None:
                return hit
            ex = self.g.nodes.get(exclude)
            if ex is None or ex.op != "Cast":  # (a Cast excluded hides its own readers)
                return [r for r in hit if r[0] != exclude]
        return self._readers_of(ref, exclude)

    def _readers_of(self, ref, exclude=None):
        src, port, _ = parse_tensor(ref)
        out = []
        for cname, idx in self.g.consumers(src, port=port):
            if cname == exclude:
                continue
            c = self.g.nodes[cname]
            if c.op == "Cast" and c.attr["SrcT"].type in FLOATS and c.attr["DstT"].type in FLOATS:
                out.extend(self._readers_of(cname, exclude))
            else:
                out.append((cname, idx))
        return out

    def _wanted(self, ref, exclude=None):
        """Base dtypes the readers of ``ref`` (other than ``exclude``) expect."""
        wants = set()
        nodes = self.g.nodes
        if self.fast_paths:  # (issue 17j: in_dtypes' memo read inline)
            memo = self._dts
            for cname, idx in self._readers(ref, exclude):
                node = nodes[cname]
                hit = memo.get(cname)
                if hit is None or hit[0] is not node:
                    hit = self._memo_dts(node)
                want = hit[1]
                if want is not None and idx < len(want):
                    dt = want[idx]
                    wants.add(dt - registry.REF_OFFSET if dt > registry.REF_OFFSET else dt)
            return wants
        for cname, idx in self._readers(ref, exclude):
            want = self.in_dtypes(nodes[cname])
            if want is not None and idx < len(want):
                wants.add(registry.base_dtype(want[idx]))
        return wants

    def _movable_producers(self, node, info):
        """True when every low producer of ``node`` is a gray/clear node (its
        own demotion may absorb a cast moved onto its output)."""
        seen = False
        for k, inp in self._float_inputs(node, info):
            r = self.root(inp)
            rdt = self.tensor_dtype(r)
            if rdt is None or registry.base_dtype(rdt) != self.low:
                continue
            d = self.decisions.get(parse_tensor(r)[0])
            if d is None or d.get("list") not in ("gray", "clear"):
                return False
            seen = True
        return seen

    def _demote(self, order):
        """Gray/clear nodes painted low whose casts would outnumber the ones
        FP32 needs go back to FP32 (reverse topological order, so consumers
        are final).  Example: ``MatMul16 -> BiasAdd -> AddV2(FP32)`` costs two
        casts with a low BiasAdd (bias read, output) and one with an FP32
        BiasAdd (the MatMul output): "never add a cast that buys nothing"."""
        g = self.g
        changed = 0
        for name in reversed(order):
            d = self.decisions.get(name)
            if d is None or d.get("state") != "low" or d.get("list") not in ("gray", "clear"):
                continue
            node = g.nodes[name]
            if self.is_forced_low(node):
                continue
            info = self.info(node)
            cost_low = cost_f32 = 0
            for k, inp in self._float_inputs(node, info):
                r = self.root(inp)
                rnode = g.nodes.get(parse_tensor(r)[0])
                if rnode is None or rnode.op == "Const":
                    continue
                rdt = self.tensor_dtype(r)
                rdt = registry.base_dtype(rdt) if rdt is not None else None
                if rdt == FP32 and self.low not in self._wanted(r, exclude=name):
                    cost_low += 1
                elif rdt == self.low and FP32 not in self._wanted(r, exclude=name):
                    cost_f32 += 1
            outs = set()
            for port in range(len(self.out_dtypes(node) or ())):
                outs |= self._wanted(tensor_name(name, port))
            cost_low += FP32 in outs
            cost_f32 += self.low in outs
            # a node whose readers all want FP32 goes FP32 on a tie: the cast
            # then sits on the low producer, not in front of an FP32 island
            # (residual add -> LayerNorm stats).
            # Likewise a clear op (data movement: no arithmetic is lost) on a
            # tie whose readers all want FP32, e.g. conv16 -> BiasAdd ->
            # Reshape -> loss: the cast moves up to the producer, whose own
            # decision (reverse order: next) can then absorb it.
            # (only when a gray/clear producer could take the cast: after a
            # white op the cast costs the same on either side and stays low).
            edge_tie = (cost_f32 == cost_low and outs == {FP32}
                        and (name in self._contested
                             or (d.get("list") == "clear" and self._movable_producers(node, info))))
            if cost_f32 < cost_low or edge_tie:
                self._retype(node, info.attrs, FP32)
                self.touched.add(name)
                self.state[name] = "f32"
                if d.get("was") == "float32":
                    changed -= 1  # painting counted it as changed
                d.update(state="f32", dtype="float32",
                         reason=d["reason"] + f"; kept FP32: {cost_f32} cast(s) instead of {cost_low}")
        return changed

    def _direct_wants(self, ref):
        """Base dtypes the direct readers of tensor ``ref`` expect (a Cast
        reader expects its SrcT: it adapts, no cast is inserted for it)."""
        src, port, _ = parse_tensor(ref)
        wants = set()
        for cname, idx in self.g.consumers(src, port=port):
            want = self.in_dtypes(self.g.nodes[cname])
            if want is not None and idx < len(want):
                wants.add(registry.base_dtype(want[idx]))
        return wants

    def _follow_readers(self, order):
        """Cast once before a fan-out: a clear node left FP32 (no low
        producer: a graph input, a constant, an FP32 op) whose readers want
        the low dtype goes low when that needs fewer casts::

            x ─► Split ─► 3 x Conv2D16   (3 casts: one per Split output)
            x ─► x/CastToFp16 ─► Split16 ─► 3 x Conv2D16   (1 cast)

        Cost of staying: one cast per output tensor a direct reader wants
        low.  Cost of going low: one cast per float input whose root no
        other reader wants low already and that is not already read through
        a Cast to low (grappler's arithmetic optimizer moves a Cast in front
        of a Reshape in its second iteration: Cast16 -> Reshape -> MatMul16
        must stay as it is), constants aside (converted in place), and one
        per output tensor a reader wants in FP32.  Reverse topological
        order, so a chain of clear nodes resolves from its readers back.
        Clear ops only move data, so going low is exact where the readers
        would have cast anyway.  Nodes fed by a variable read are left alone
        (the FP32 master; ``keep_fp16_copies`` must not read the copy to
        initialise the copy)."""
        g = self.g
        changed = 0
        for name in reversed(order):
            d = self.decisions.get(name)
            if d is None or d.get("list") != "clear" or d.get("state") not in ("neutral", "f32", "hard"):
                continue
            node = g.nodes[name]
            if self.is_keep(node) or name in self.protected:
                continue
            info = self.info(node)
            cur = self.current(node, info)
            if cur != FP32:
                continue
            stay = go = 0
            for port in range(len(self.out_dtypes(node) or ())):
                w = self._direct_wants(tensor_name(name, port))
                stay += self.low in w
                go += FP32 in w
            if not stay:
                continue
            blocked = False
            for k, inp in self._float_inputs(node, info):
                r = self.root(inp)
                rnode = g.nodes.get(parse_tensor(r)[0])
                if rnode is None or rnode.op in VARIABLE_OPS:
                    blocked = True
                    break
                if self._const_of(inp) is not None:
                    continue
                prod = g.nodes.get(parse_tensor(inp)[0])
                if (prod is not None and prod.op == "Cast" and prod.attr["DstT"].type == self.low
                        and prod.attr["SrcT"].type in FLOATS):
                    continue  # the low copy exists already (a Cast grappler moved in front)
                rdt = self.tensor_dtype(r)
                if rdt is not None and registry.base_dtype(rdt) == FP32 \
                        and self.low not in self._wanted(r, exclude=name):
                    go += 1
            if blocked or go >= stay or self._refuse_low(node, info, cur, warn=False):
                continue
            self._retype(node, info.attrs, self.low)
            self.touched.add(name)
            self.state[name] = "low"
            changed += 1
            d.update(state="low", dtype=self.low_name,
                     reason=d["reason"] + f"; low before its fan-out: {go} cast(s) instead of {stay}")
        return changed

    def _refuse_low(self, node, info, cur, warn=True):
        """Reason a node may not go low precision (unsafe const, no kernel), or None."""
        for k, inp in self._float_inputs(node, info):
            c = self._const_of(inp)
            if c is not None and c.attr["dtype"].type in FLOATS:
                why = self.unsafe_const(c, self.low)
                if why:
                    msg = f"const underflow: input '{c.name}' {why}; '{node.name}' stays FP32"
                    if warn:
                        self.ctx.warn(msg, node=node.name)
                    return msg
        if not self.kernel_ok(node, info, self.low):
            msg = (f"no kernel: {node.op} has no {self.low_name} kernel on "
                   f"{self.device_type(node)}; stays {registry.dtype_name(cur)}")
            if warn:
                self.ctx.warn(msg, node=node.name)
            return msg
        return None

    def _to_fp32(self, node, info, cur, reason, state="hard", lst=None):
        if cur == FP32:
            return FP32, state, reason, lst
        if self.kernel_ok(node, info, FP32):
            return FP32, state, reason, lst
        msg = f"no kernel: {node.op} has no float32 kernel on {self.device_type(node)}; keeps {registry.dtype_name(cur)}"
        self.ctx.warn(msg, node=node.name)
        return cur, "fixed", msg, lst

    def _want_low(self, node, info, cur, reason, lst, refuse_state="hard"):
        why = self._refuse_low(node, info, cur) if cur != self.low else None
        if why:
            return self._to_fp32(node, info, cur, why, state=refuse_state, lst=lst)
        return self.low, "low", reason, lst

    def _decide(self, node, info, cur):
        name = node.name
        if name in self.protected and node.op not in _lists.STATEFUL_PAINTABLE:  # (those have no outputs: 18j)
            return cur, ("low" if cur in registry.LOW_TYPES else "f32"), "fetched/preserved: keeps its dtype", "protected"
        if self.is_keep(node):
            return cur, ("low" if cur in registry.LOW_TYPES else "hard"), "keep_dtype: never converted", "keep_dtype"
        lst, why = self.classify(node)
        if self.is_forced_low(node):
            return self._want_low(node, info, cur, "low_precision_nodes: forced low precision", lst)
        mode = self.mode
        if mode == "force_fp32":
            if cur == FP32:
                return cur, "f32", "force_fp32: already FP32", lst
            return self._to_fp32(node, info, cur, "force_fp32: raised to FP32", state="f32", lst=lst)
        if mode == "allow_fp32_to_fp16":
            if cur == FP32 and self.kernel_ok(node, info, FP32):
                return cur, "f32", "allow_fp32_to_fp16: FP32 kernel exists", lst
            if cur != FP32 and self.kernel_ok(node, info, FP32):
                return FP32, "f32", "allow_fp32_to_fp16: FP32 kernel exists", lst
            if self.kernel_ok(node, info, self.low):
                return self.low, "low", "allow_fp32_to_fp16: no FP32 kernel, low precision has one", lst
            return cur, "f32", "allow_fp32_to_fp16: no other kernel; unchanged", lst
        if mode == "force_fp16":
            if cur == self.low:
                return cur, "low", "force_fp16: already low precision", lst
            return self._want_low(node, info, cur, "force_fp16: every op with a kernel", lst, "f32")
        if mode == "cube_fp16in_fp32out":
            if lst == "white":
                return self._want_low(node, info, cur, f"cube_fp16in_fp32out: white list ({why})", lst, "f32")
            return cur, ("low" if cur in registry.LOW_TYPES else "f32"), "cube_fp16in_fp32out: not a cube op; unchanged", lst
        # allow_mix_precision / allow_mix_precision_bf16: the lists decide
        if lst == "white":
            return self._want_low(node, info, cur, f"white list: {why}", lst)
        if lst == "black":
            return self._to_fp32(node, info, cur, f"black list: {why}", state="hard", lst=lst)
        n_low = n_f32 = 0
        hard = False
        first_low = first_f32 = None
        for k, inp in self._float_inputs(node, info):
            v = self._voter(inp)
            if v is None:
                continue
            dt, h, src = v
            if dt in registry.LOW_TYPES:
                n_low += 1
                first_low = first_low or src
            else:
                n_f32 += 1
                hard = hard or h
                first_f32 = first_f32 or src
        if n_low == 0 and n_f32 == 0:
            return cur, "neutral", f"{lst}: no voting producer (constants/variables only); keeps its dtype", lst
        if n_low > n_f32 or (n_low == n_f32 and not hard):
            if n_f32:
                self._contested.add(name)
            return self._want_low(node, info, cur, f"{lst}: followed producer '{first_low}' ({self.low_name})", lst)
        state = "hard" if hard else "f32"
        return self._to_fp32(node, info, cur, f"{lst}: followed producer '{first_f32}' (float32)", state=state, lst=lst)

    # ------------------------------------------------- casts and consts
    def _consumer_wants(self, name):
        """Set of base dtypes the data consumers of ``name``:0 expect (None if unknown)."""
        wants = set()
        for cname, idx in self.g.consumers(name, port=0):
            want = self.in_dtypes(self.g.nodes[cname])
            if want is None or idx >= len(want):
                return None
            wants.add(registry.base_dtype(want[idx]))
        return wants

    def _adapt_casts(self):
        """User Casts: a float source follows its producer; an int/bool source's
        float destination follows its consumers (no Cast->Cast chains)."""
        g = self.g
        names = g.nodes_of_type("Cast") if self.fast_paths else list(g.nodes)
        for name in names:
            node = g.nodes[name]
            if node.op != "Cast" or self.is_keep(node) or not node.input:
                continue
            src_t = node.attr["SrcT"].type
            if src_t in FLOATS:  # output dtype unchanged: fine for fetched casts too
                have = self.tensor_dtype(node.input[0])
                if have is not None and registry.base_dtype(have) in FLOATS and have != src_t:
                    self._set_type(node, "SrcT", registry.base_dtype(have))
                    self.touched.add(name)
                    self._late.append(name)
            elif node.attr["DstT"].type in FLOATS and name not in self.protected:
                wants = self._consumer_wants(name)
                if wants and len(wants) == 1:
                    w = wants.pop()
                    if w in FLOATS and w != node.attr["DstT"].type:
                        self._set_type(node, "DstT", w)
                        self.touched.add(name)
                        self._late.append(name)
                        self._record(node, "cast", f"int->float Cast retargeted to {registry.dtype_name(w)} "
                                                   "(its consumers all want it)", dtype=w)

    def _convert_consts(self):
        g = self.g
        fast = self.fast_paths
        cls = self._cls
        float_cls = {}  # (fast path) signature class of Consts -> holds a float
        cw = self._const_wants
        names = g.nodes_of_type("Const") if fast else list(g.nodes)
        skip = self._const_skip
        if skip is not None:  # (issue 17t: the constants the loop below passes over, known)
            names = [n for n in names if n not in skip]
        for name in names:
            node = g.nodes[name]
            if fast:  # (the same tests, the cheap one first: most constants are ints)
                c = cls.get(name) if cls is not None else None
                if c is not None:  # (its class fixes its dtype attr: Const's output type)
                    fl = float_cls.get(c)
                    if fl is None:
                        outs = self.out_dtypes(node)
                        fl = float_cls[c] = bool(outs) and outs[0] in FLOATS
                    if not fl:
                        continue
                a = node.attr.get("dtype")
                if a is None or a.type not in FLOATS or name in self.protected or self.is_keep(node):
                    continue
            elif node.op != "Const" or name in self.protected or self.is_keep(node):
                continue
            cur = node.attr["dtype"].type
            if cur not in FLOATS:
                continue
            m = -1
            if cw is not None:  # (issue 17n: from the native painting, where it could tell)
                i = cw[0].get(name)
                if i is not None:
                    m = cw[1][i]
            if m >= 0:
                if not m or m & (m - 1):  # (no reader, or readers wanting two dtypes)
                    continue
                w = m.bit_length() - 1
            else:
                wants = self._consumer_wants(name)
                if not wants or len(wants) != 1:
                    continue
                w = wants.pop()
            if w not in FLOATS or w == cur:
                continue
            if w != FP32 and self.unsafe_const(node, w):
                continue
            self._before.save(name)
            self._edited(name)
            _convert_const(node, w)
            self.touched.add(name)
            self._late.append(name)
            self._record(node, "const", f"constant converted in place to {registry.dtype_name(w)}",
                         lst="const", dtype=w, was=registry.dtype_name(cur))

    def _fix_edges(self, shapes):
        g = self.g
        self._cast_cache = {}
        mism = self._mismatch
        touched = self.touched
        if mism is not None and self.bulk_casts:
            if self.native_casts and self._painted_with is not None and _native.fix_edges(self, shapes):
                return None
            return self._fix_edges_bulk(shapes, mism)
        if mism is not None:
            # (issue 17n: the native painting listed the nodes with a float input of
            # another float dtype; the steps since only remove such mismatches.  Of
            # those, the ones checked below: touched, or reading a touched node)
            nodes = g.nodes
            visit = [n for n in sorted(mism, key=g._seq.__getitem__)
                     if n in touched or any(parse_tensor(i)[0] in touched
                                            for i in nodes[n].input[:] if i[:1] != "^")]
        else:
            check = set(touched)
            for name in touched:
                check.update(c for c, idx in g.consumers(name) if idx >= 0)
            visit = [n for n in g.nodes if n in check]
        for name in visit:  # graph order: deterministic
            node = g.nodes[name]
            want = self.in_dtypes(node)
            if want is None:
                continue
            ins = node.input
            # (fast path: indices past the node's data inputs are control inputs)
            for k in range(min(len(want), len(ins)) if self.fast_paths else len(ins)):
                inp = ins[k]
                if inp.startswith("^") or k >= len(want):
                    continue
                w = registry.base_dtype(want[k])
                if w not in FLOATS:
                    continue
                have = self.tensor_dtype(inp)
                if have is None or registry.base_dtype(have) not in FLOATS or registry.base_dtype(have) == w:
                    continue
                new_ref = self.cast_to(inp, w, shapes)
                self._before.save(name)
                g.set_input(name, k, new_ref)

    def _fix_edges_bulk(self, shapes, mism):
        """``_fix_edges`` (native painting's mismatch list at hand) with the
        casts decided first and inserted in one batch (issue 17t): the same
        edges, the same reuse of a root, a cached or an existing Cast (or a
        ``keep_fp16_copies`` read), the same new Cast NodeDefs and names, and
        the graph edits in the reference's order (``Graph.add_and_rewire``)."""
        g = self.g
        nodes = g.nodes
        touched = self.touched
        visit = [n for n in sorted(mism, key=g._seq.__getitem__)
                 if n in touched or any(parse_tensor(i)[0] in touched
                                        for i in nodes[n].input[:] if i[:1] != "^")]
        # the sources an existing Cast reads at input 0 (only there can
        # cast_to's search find one; a Cast made below is found in the cache)
        cast_srcs = set()
        for c in g.nodes_of_type("Cast"):
            cin = nodes[c].input
            if cin:
                cast_srcs.add(parse_tensor(cin[0])[0])
        cache = self._cast_cache
        base_dtype = registry.base_dtype
        in_dtypes, tensor_dtype, root_of = self.in_dtypes, self.tensor_dtype, self.root
        # (keep_fp16_copies) a read can only become a copy's read when some
        # FP16 working copy (a VarHandleOp ``<v>/Fp16Copy``) exists: looked for
        # once here, not per new cast (with none, _fp16_copy_read answers None
        # and _copy_read_possible's early flush only splits the batch)
        copies = not self.copy_probe or any(
            n.endswith("/Fp16Copy") for n in g.nodes_of_type("VarHandleOp"))
        save = self._before.save
        steps = []
        taken = set()  # names given to casts not added yet
        templates = {}
        masks = self._mismatch_inputs
        for name in visit:
            node = nodes[name]
            want = in_dtypes(node)
            if want is None:
                continue
            ins = node.input
            m = min(len(want), len(ins))
            if masks is not None:  # (only the inputs the native painting listed)
                bits = masks[name]
                ks = [k for k in range(min(m, 30)) if bits >> k & 1]
                if bits >> 30 & 1:
                    ks.extend(range(30, m))
            else:
                ks = range(m)
            for k in ks:
                inp = ins[k]
                if inp[:1] == "^":
                    continue
                w = base_dtype(want[k])
                if w not in FLOATS:
                    continue
                have = tensor_dtype(inp)
                if have is None:
                    continue
                hb = base_dtype(have)
                if hb not in FLOATS or hb == w:
                    continue
                # cast_to(inp, w, shapes), its node creation queued
                root = root_of(inp)
                rdt = have if root == inp else tensor_dtype(root)  # (no Cast behind: the same tensor)
                new = None
                if rdt is not None and base_dtype(rdt) == w:
                    ref = root
                else:
                    key = (root, w)
                    ref = cache.get(key)
                    if ref is None:
                        src, port, _ = parse_tensor(root)
                        if copies and steps and self._copy_read_possible(src, port, w):
                            g.add_and_rewire(steps)  # (it adds a node now: keep the order)
                            steps = []
                        copy_read = self._fp16_copy_read(src, port, w) if copies else None
                        if copy_read is not None:
                            ref = cache[key] = copy_read
                            if shapes is not None:
                                shapes.alias(copy_read, root)
                        elif src in cast_srcs:
                            for cname, idx in sorted(g.consumers(src, port=port)):
                                c = nodes[cname]
                                if (c.op == "Cast" and idx == 0 and c.attr["DstT"].type == w
                                        and c.attr["SrcT"].type == base_dtype(rdt)
                                        and not any(i.startswith("^") for i in c.input[:])):
                                    ref = cache[key] = cname
                                    break
                        if ref is None:
                            base = f"{src}/{_CAST_SUFFIX[w]}" + (f"_{port}" if port else "")
                            cname = base
                            if cname in nodes or cname in taken:
                                j = 1
                                while f"{base}_{j}" in nodes or f"{base}_{j}" in taken:
                                    j += 1
                                cname = f"{base}_{j}"
                            taken.add(cname)
                            new = _native.cast_node(templates, base_dtype(rdt), w, nodes[src].device, cname, root,
                                                    g.blank_node)
                            self.casts_inserted += 1
                            self.new_casts.append(cname)
                            if shapes is not None:
                                shapes.alias(cname, root)
                            ref = cache[key] = cname
                save(name)
                if new is not None or ref != inp:
                    steps.append((new, name, k, ref))
        if steps:
            g.add_and_rewire(steps)

    def _copy_read_possible(self, src, port, dt):
        """Whether ``_fp16_copy_read(src, port, dt)`` may add a node (cheap
        tests first: a ReadVariableOp of a handle with an FP16 copy)."""
        node = self.g.nodes[src]
        if dt != registry.DT_HALF or port != 0 or node.op != "ReadVariableOp" or not node.input:
            return False
        return parse_tensor(node.input[0])[0] + "/Fp16Copy" in self.g.nodes

    def cast_to(self, ref, dt, shapes=None):
        """A tensor holding ``ref`` in ``dt``: the root itself, a cached or
        existing Cast, or a new ``<src>/CastToXx`` node."""
        g = self.g
        root = self.root(ref)
        rdt = self.tensor_dtype(root)
        if rdt is not None and registry.base_dtype(rdt) == dt:
            return root
        key = (root, dt)
        hit = self._cast_cache.get(key)
        if hit is not None:
            return hit
        src, port, _ = parse_tensor(root)
        copy_read = self._fp16_copy_read(src, port, dt)
        if copy_read is not None:
            self._cast_cache[key] = copy_read
            if shapes is not None:
                shapes.alias(copy_read, root)
            return copy_read
        for cname, idx in sorted(g.consumers(src, port=port)):
            c = g.nodes[cname]
            if (c.op == "Cast" and idx == 0 and c.attr["DstT"].type == dt
                    and c.attr["SrcT"].type == registry.base_dtype(rdt)
                    and not any(i.startswith("^") for i in c.input[:])):
                self._cast_cache[key] = cname
                return cname
        base = f"{src}/{_CAST_SUFFIX[dt]}" + (f"_{port}" if port else "")
        cname = g.unique_name(base)
        g.new_node("Cast", cname, [root], {
            "SrcT": _type_attr(registry.base_dtype(rdt)), "DstT": _type_attr(dt),
            "Truncate": False}, device=g.nodes[src].device)
        self.casts_inserted += 1
        self.new_casts.append(cname)
        if shapes is not None:
            shapes.alias(cname, root)
        self._cast_cache[key] = cname
        return cname

    #: the smallest delayed copies that together hold at most this share of
    #: the delayed copies' bytes are not delayed (see _delay_widening_casts)
    DELAY_SMALL_SHARE = 0.01

    def _delay_widening_casts(self, shapes=None):
        """A Cast low -> FP32 inserted by this run waits for the other inputs
        of its readers: it gets a control edge from each producer that is
        later in the graph than the Cast's source and does not depend on the
        Cast.  TF runs a node as soon as its inputs are ready, so without the
        edge an FP32 copy of a forward activation read only by the backward
        pass is made in the forward pass and held (at twice the low tensor's
        bytes) until the backward pass; with it the low tensor is what waits
        and the FP32 copy lives only while its readers run::

            softmax16 ─► Cast32 ──────────────► Mul32 (backward)
                                       grad ──┘
            =>
            softmax16 ─► Cast32 ─► Mul32         (Cast32 has ^grad: made when grad is)
                grad ─^──┘   grad ─┘

        Only copies whose bytes matter wait: an edge costs TF scheduling
        freedom, so the smallest copies that together hold at most
        ``DELAY_SMALL_SHARE`` (1%) of the would-be delayed copies' bytes run
        as soon as their input is ready (e.g. the FP32 copies of a layer
        norm's [tokens, 1] mean and rsqrt next to its [tokens, hidden] ones).
        Shapes are looked up only when some copy would wait; a copy of
        unknown size counts as large.

        Not done in graphs with v1 loops (a control edge may not cross a
        frame) nor for casts of constants; no edge that would close a cycle."""
        g = self.g
        if not self.new_casts or g.nodes_of_type(("Enter", "RefEnter")):
            return
        if self.fast_paths and self.delay_depth_proof and self._none_can_wait():
            return
        # A Cast that nothing waits on depends only on its source and feeds only its readers, so
        # placing it just before its first reader keeps a topological order valid; a producer placed
        # before that point cannot depend on the Cast (no cycle), and one placed after the source is
        # worth waiting for.  Delayed casts take their new place in `pos`, so the order stays valid
        # for the casts that follow; a Cast another one waits on is not moved, and a moved Cast is
        # not waited on (two casts feeding one reader would otherwise wait on each other).
        # Leaving out some of the edges found this way (the small copies) keeps the graph acyclic.
        got = None
        if self._cast_plan is not None and self.native_casts:
            got = _native.delay_plan(self)  # (issue 17: the loop below in C++; None: it runs here)
            self._cast_plan = None
        if got is not None:
            plan, forward = got
            pos, cyclic = None, False
        else:
            pos, cyclic, plan = self._delay_plan()
            forward = None
        small = self._small_copies([c for c, _ in plan], shapes)
        for cname, waits in plan:
            if cname in small:
                self.decisions.setdefault(cname, {})["not_delayed"] = (
                    f"FP32 copy of {small[cname]} bytes: with the other small ones at most "
                    f"{self.DELAY_SMALL_SHARE:.0%} of the delayed copies' bytes")
                continue
            for other in waits:
                g.add_control_input(cname, other)
            self.casts_delayed += 1
            self.decisions.setdefault(cname, {})["waits_for"] = waits
        delayed = {c for c, _ in plan if c not in small}
        if forward is None and delayed and self.fast_paths and not cyclic:
            forward = self._forward_at(pos, [c for c, _ in plan])
        # never cyclic, by the order argument above: a safety net (its proof, when
        # it holds, is the order itself; else the full topological sort decides)
        if delayed and not (self.fast_paths and not cyclic and forward) and not self._acyclic():
            for cname in delayed:
                node = g.nodes[cname]
                keep = [i for i in node.input[:] if not i.startswith("^")]
                del node.input[:]
                node.input.extend(keep)
                self.decisions.get(cname, {}).pop("waits_for", None)
            g.reindex()
            self.casts_delayed = 0
            self.ctx.report.warn("delayed casts undone: they closed a cycle", pass_name="precision")

    def _delay_plan(self):
        """(positions, cyclic, plan) of :meth:`_delay_widening_casts`: the
        reference's loop (the C++ painter's ``CastPlan::Delay`` makes the same
        plan, ``native.delay_plan``)."""
        g = self.g
        pos = dict(g.topo_positions())
        cyclic = bool(g._topo_cache and g._topo_cache[1])  # (the order tops up a cycle's nodes last)
        awaited, delayed = set(), set()
        plan = []  # (cast, producers it waits for), in the order found
        for cname in self.new_casts:
            cast = g.nodes.get(cname)
            if (cast is None or cname in awaited or cast.attr["DstT"].type != FP32
                    or cast.attr["SrcT"].type not in registry.LOW_TYPES):
                continue
            src = parse_tensor(cast.input[0])[0]
            readers = g.consumers(cname, control=False)
            if g.nodes[src].op == "Const" or src not in pos or not readers:
                continue
            first = min(pos.get(r, -1) for r, _ in readers)
            waits = []
            for reader, idx in readers:
                for k, inp in enumerate(g.nodes[reader].input[:]):
                    if k == idx or inp.startswith("^"):
                        continue
                    other = parse_tensor(inp)[0]
                    if (other not in waits and other not in delayed and pos[src] < pos.get(other, -1) < first
                            and g.nodes[other].op != "Const"):
                        waits.append(other)
            if waits:
                pos[cname] = first - 0.5
                delayed.add(cname)
                awaited.update(waits)
                plan.append((cname, waits))
        return pos, cyclic, plan

    #: the most nodes :meth:`_none_can_wait` visits for one producer's depth
    DEPTH_PROOF_BUDGET = 64

    def _none_can_wait(self):
        """True when no Cast of :meth:`_delay_widening_casts` can wait for a
        producer, proved without sorting the graph; False when that is not
        proved (the caller sorts and decides).

        A copy of ``src`` waits only for a producer ``other`` (an input of
        one of its readers, not a Const) later than ``src`` in the Kahn
        order.  In an acyclic graph, Kahn's FIFO order pops nodes by
        non-decreasing depth (the longest path from a node without inputs,
        over data and control edges): the nodes without inputs are queued
        first, and a node is queued when the last of its producers is
        popped, the deepest one by induction.  So ``depth(other) <
        depth(src)`` puts ``other`` first, and that holds when ``src`` has
        a chain of more than ``depth(other)`` producers above it.  The
        depth of ``other`` is computed exactly over at most
        :data:`DEPTH_PROOF_BUDGET` of its ancestors (variable handles and
        their reads: depth 0 and 1); the chain above ``src`` is walked
        through first inputs for just that many steps."""
        g = self.g
        if not getattr(self, "_acyclic_at_start", False) or g.nodes_of_type(LOOP_BACK_OPS):
            return False
        nodes = g.nodes
        depth = {}
        budget = self.DEPTH_PROOF_BUDGET

        def parents(name):
            return [p for p in map(_src_name, nodes[name].input[:]) if p in nodes]

        def depth_of(name):
            """Exact depth of ``name`` (None: more than ``budget`` ancestors
            not known yet); an iterative post-order over its ancestors."""
            stack, expanded = [(name, False)], 0
            while stack:
                x, done = stack.pop()
                if x in depth:
                    continue
                if done:  # (its producers were popped, and their depths known, before it)
                    depth[x] = max((depth[p] + 1 for p in parents(x)), default=0)
                    continue
                expanded += 1
                if expanded > budget:
                    return None
                stack.append((x, True))
                stack.extend((p, False) for p in parents(x) if p not in depth)
            return depth[name]

        chain = {}  # name -> the longest chain of producers above it found so far

        def chain_longer(name, steps):
            """True when ``name`` has a chain of more than ``steps`` producers above it."""
            if chain.get(name, -1) > steps:
                return True
            x = name
            for _ in range(steps + 1):
                x = next((p for p in map(_src_name, nodes[x].input[:]) if p in nodes), None)
                if x is None:
                    return False
            chain[name] = steps + 1
            return True

        for cname in self.new_casts:
            cast = nodes.get(cname)
            if (cast is None or cast.attr["DstT"].type != FP32
                    or cast.attr["SrcT"].type not in registry.LOW_TYPES):
                continue
            src = parse_tensor(cast.input[0])[0]
            if src not in nodes or nodes[src].op == "Const":
                continue
            for reader, idx in g.consumers(cname, control=False):
                for k, inp in enumerate(nodes[reader].input[:]):
                    if k == idx or inp.startswith("^"):
                        continue
                    other = parse_tensor(inp)[0]
                    on = nodes.get(other)
                    if on is None or on.op == "Const" or other == src:
                        continue
                    d = depth.get(other)
                    if d is None:
                        d = depth_of(other) if on.input else 0  # (a variable handle: depth 0)
                    if d is None or not chain_longer(src, d):
                        return False
        return True

    def _small_copies(self, cnames, shapes):
        """{cast: FP32 bytes} for the smallest of ``cnames`` whose copies
        together hold at most ``DELAY_SMALL_SHARE`` of their known bytes
        (copies of unknown size are never small)."""
        if len(cnames) < 2 or shapes is None:
            return {}
        sized = []
        for cname in cnames:
            shape = shapes.get(self.g.nodes[cname].input[0])
            if shape is not None and all(d >= 0 for d in shape):
                sized.append((4 * int(np.prod(shape, dtype=np.int64)), cname))
        total = sum(b for b, _ in sized)
        small, acc = {}, 0
        for b, cname in sorted(sized):
            acc += b
            if acc > self.DELAY_SMALL_SHARE * total:
                break
            small[cname] = b
        return small

    def _forward_at(self, pos, moved):
        """True when every edge into or out of a node of ``moved`` goes
        forward in ``pos`` (a topological order of the rest of the graph,
        where only the nodes of ``moved`` changed place or edges): then
        ``pos`` is a topological order of the whole graph, which is acyclic."""
        g = self.g
        for name in moved:
            p = pos[name]
            for inp in g.nodes[name].input[:]:
                q = pos.get(parse_tensor(inp)[0])
                if q is None or q >= p:
                    return False
            for cname, _ in g.consumers(name):
                q = pos.get(cname)
                if q is None or q <= p:
                    return False
        return True

    def _acyclic(self):
        try:
            self.g.topo_order(strict=True)
        except GraphError:
            return False
        return True

    def _fp16_copy_read(self, src, port, dt):
        """``keep_fp16_copies``: instead of casting a read of master variable
        ``v``, read its FP16 working copy ``v/Fp16Copy`` (kept in sync by
        AMP_Optimizer after each applied update)::

            v ─► v/Read ─► Cast(fp16) ─► MatMul   =>   v/Fp16Copy ─► v/Read/ReadFp16Copy ─► MatMul
        """
        g = self.g
        node = g.nodes[src]
        if dt != registry.DT_HALF or port != 0 or node.op != "ReadVariableOp" or not node.input:
            return None
        handle = parse_tensor(node.input[0])[0]
        copy = g.nodes.get(handle + "/Fp16Copy")
        if copy is None or copy.op != "VarHandleOp" or copy.attr["dtype"].type != registry.DT_HALF:
            return None
        name = f"{src}/ReadFp16Copy"
        if name not in g.nodes:
            g.new_node("ReadVariableOp", name, [copy.name], {"dtype": _type_attr(registry.DT_HALF)},
                       device=copy.device)
            self.copy_reads += 1
            self.ctx.report.decide(name, dtype="float16", state="hard", list="variable",
                                   reason=f"FP16 working copy of '{handle}' (keep_fp16_copies)")
        return name

    # ------------------------------------------------------------ report
    def _finish(self, shapes, before, changed):
        g, rep = self.g, self.ctx.report
        float_nodes = low_nodes = 0
        matrix = []  # (node, runs in the low dtype)
        # (fast path: the nodes _paint decided are those counted here; the
        # nodes added since are Casts and variable reads, fixed)
        painted = self._painted
        lows = self._painted_low
        if painted is not None and lows is not None:
            # (issue 17n: the native painting kept which painted nodes it left low;
            # nothing re-types a painted node between it and here)
            float_nodes, low_nodes = len(painted), len(lows)
            matrix = [(g.nodes[n], n in lows) for n in g.nodes_of_type(_stats.MATRIX_OPS) if n in painted]
        for name, node in (() if lows is not None and painted is not None else g.nodes.items()):
            if painted is not None:
                if name not in painted:
                    continue
            elif node.op in ("Const", "Cast"):
                continue
            info = self.info(node)
            if not info.attrs or info.fixed:
                continue
            float_nodes += 1
            low = self.current(node, info) in registry.LOW_TYPES
            if low:
                low_nodes += 1
            if node.op in _stats.MATRIX_OPS:
                matrix.append((node, low))
        redo = [n for n in self.touched if n in g.nodes] + list(self.new_casts)
        entries = self._entries
        if entries is not None:
            # (issue 17t) the painted nodes' entries from the native rows, before
            # the others (the order _apply's dict gives), when the report is read
            write = functools.partial(_write_entries, entries, self.decisions)
            if type(rep).decide is Report.decide:
                rep.defer_decisions(write)
            else:
                tmp = {}
                write(tmp)
                for n, fields in tmp.items():
                    rep.decide(n, **fields)
        elif self.fast_paths and type(rep).decide is Report.decide:
            # (issue 17j) Report.decide inline: no call and no keyword dict per decision
            get = rep.decisions.setdefault
            for n, fields in self.decisions.items():
                get(n, {}).update(fields)
        else:
            for n, fields in self.decisions.items():
                rep.decide(n, **fields)
        summary = {
            "precision_mode": self.mode,
            "low_dtype": self.low_name,
            "low_precision_nodes": low_nodes,
            "float_nodes": float_nodes,
            "casts_inserted": self.casts_inserted,
            "casts_delayed": self.casts_delayed,
            "fp16_copy_reads": self.copy_reads,
            "precision_paint": self.paint_path,
        }
        for k, v in summary.items():
            rep.raw_summary[k] = v
        stats = dict(summary, nodes_changed=changed)
        rep.defer(functools.partial(_shape_figures, g, shapes, before, matrix, redo, stats))
        return stats


def _write_entries(entries, extra, decisions):
    """(issue 17t) Write the precision pass's decisions into a report's
    ``decisions`` as ``_finish`` does with the dict ``native._apply`` starts:
    the native rows (``entries``, topological order), an entry the later
    steps replaced (``extra``: ``_record`` of a re-targeted Cast) in its
    place, then ``extra``'s other entries in their order."""
    get = decisions.setdefault
    seen = set()
    add = seen.add
    xget = extra.get
    for name, fields in entries.items():
        add(name)
        ov = xget(name)
        get(name, {}).update(fields if ov is None else ov)
    for n, fields in extra.items():
        if n not in seen:
            get(n, {}).update(fields)


def _src_name(ref: str) -> str:
    """The node a tensor or control reference names."""
    return parse_tensor(ref)[0]


class _Snapshot:
    """The graph as the precision pass received it (NodeDef copies and its
    topological order), for the deferred "before" figures.

    With ``copy_on_write`` the copies are made lazily: the pass calls
    :meth:`save` before each in-place edit of a node (every one goes
    through ``_retype`` / ``_set_type`` / the const conversion / the edge
    fix), and :meth:`graph_def` assembles the saved copies and the untouched
    nodes (later passes that edit nodes have the deferred figures computed
    first: ``Pass.keeps_deferred``).  Without it every node is copied now.

    (issue 17, :attr:`from_source`) A node no pass created or edited since
    the graph was built (not in ``created`` / ``modified``: what
    ``Graph.serialize_patch`` takes from the input too) is not copied: its
    index in the bytes the graph was built from (``Graph.source_bytes``) is
    kept, and :meth:`graph_def` parses those bytes once, when the figures
    are first read."""

    #: False: copy every saved node (the reference; the same snapshot,
    #: tests/test_precision_snapshot.py)
    from_source = True
    #: (issue 17) with :attr:`from_source`, a node the graph's source holds
    #: and no pass had created or edited when this one began is taken from
    #: the source when the figures are read, whatever this pass did to it
    #: since: :meth:`save_all` visits only the other nodes (on BERT-12 none
    #: of the ~7.7k it is given).  False: each saved node's source index
    #: recorded as it is saved (the reference; the same snapshot)
    pristine_from_source = True

    def __init__(self, graph, order, copy_on_write=False):
        from tensorflow.core.framework import graph_pb2

        self._gd = graph_pb2.GraphDef()
        self._source = None
        self._dirty = self._base = None  # (pristine_from_source: the nodes not the source's)
        if copy_on_write:
            self._graph, self._names, self._saved = graph, list(graph.nodes), {}
            src = graph.source_bytes
            base = graph._base_names
            if (self.from_source and isinstance(src, (bytes, bytearray)) and base is not None
                    and graph._seq_is_base and not graph.duplicates and not graph._all_modified):
                self._source = (src, len(base))
                if self.pristine_from_source:
                    # the nodes no pass created or edited before this one
                    # are their source's: saving them records nothing
                    self._dirty = graph.modified | graph.created
                    self._base = base
        else:
            self._graph = self._names = self._saved = None
            self._gd.node.extend(graph.nodes.values())
        self._library = graph.library
        self._versions = graph.versions
        self._full = False
        self.order = order
        self.has_cycle = bool(graph._topo_cache and graph._topo_cache[1])

    def save(self, name):
        """Copy node ``name`` as it is now, unless it was saved before (call
        this before editing a node in place); a node as the source has it:
        its index there."""
        self.save_all((name,))

    def save_all(self, names):
        """:meth:`save` of each of ``names`` in turn."""
        saved = self._saved
        if saved is None:
            return
        if self._dirty is not None:
            # (pristine_from_source) only the nodes edited or created before
            # this pass are copied; the others are the source's
            dirty = self._dirty
            if not dirty:
                return
            names = list(filter(dirty.__contains__, names))
            if not names:
                return
        g = self._graph
        # (the source's node count while it can answer for unedited nodes, else -1)
        limit = (self._source[1] if self._source is not None and g._seq_is_base and not g._all_modified
                 else -1)
        seq, modified, created, nodes = g._seq, g.modified, g.created, g.nodes
        for name in names:
            if name in saved:
                continue
            if limit >= 0 and name not in modified and name not in created:
                k = seq.get(name)
                if k is not None and k < limit:
                    saved[name] = k
                    continue
            node = nodes.get(name)
            if node is not None:
                copy = saved[name] = _NodeDef()
                copy.CopyFrom(node)

    def graph_def(self):
        if not self._full:  # what Graph.to_graph_def() gave: nodes, library, versions
            self._full = True
            if self._names is not None:
                nodes, saved = self._graph.nodes, self._saved
                if self._dirty is not None:
                    # (pristine_from_source) every node not in _dirty: its
                    # index in the source, as save_all would have recorded it
                    dirty = self._dirty
                    saved.update((n, k) for k, n in enumerate(self._base)
                                 if n not in saved and n not in dirty)
                if self._source is not None and any(type(v) is int for v in saved.values()):
                    from tensorflow.core.framework import graph_pb2

                    src = graph_pb2.GraphDef()
                    src.ParseFromString(bytes(self._source[0]))
                    snodes = src.node
                    for n, v in saved.items():
                        if type(v) is int:
                            if v >= len(snodes) or snodes[v].name != n:
                                raise GraphError(f"the precision pass's snapshot: node '{n}' is not "
                                                 f"at index {v} of the graph's source bytes")
                            saved[n] = snodes[v]
                self._gd.node.extend([saved[n] if n in saved else nodes[n] for n in self._names])
                self._graph = self._names = self._saved = self._source = None
                self._dirty = self._base = None
            self._gd.library.CopyFrom(self._library)
            self._gd.versions.CopyFrom(self._versions)
        return self._gd

    def graph(self):
        from ..graph import Graph

        g = Graph(self.graph_def(), copy=False)
        g._topo_cache = (self.order, self.has_cycle)
        return g


def _shape_figures(g, shapes, before, matrix, redo, stats, report):
    """The precision pass's shape-based figures (deferred, see
    :meth:`Report.defer`): low-precision share of matrix/conv FLOPs, the
    step's activation bytes and estimated peak, before and after."""
    from .. import shapes as _shp

    bg = before.graph()
    bshapes = _shp.ShapeTable(bg, source=shapes.inferred_source())
    act_nodes = {}
    act_before = _stats.activation_bytes(bg, bshapes, per_node=act_nodes)
    peak_before = _stats.peak_step_bytes(bg, bshapes, set(bshapes._dependent or ()) or None)
    shapes._dependent = bshapes._dependent
    lp_flops = total_flops = 0
    unknown_flops = 0
    for node, low in matrix:
        f = _stats.matmul_flops(node, shapes)
        if f is None:
            unknown_flops += 1
            continue
        total_flops += f
        if low:
            lp_flops += f
    act_after = act_before - sum(act_nodes.get(n, 0) for n in redo) + \
        _stats.activation_bytes(g, shapes, names=redo)
    summary = {
        "lp_flops": lp_flops,
        "matrix_flops": total_flops,
        "lp_flop_share": (lp_flops / total_flops) if total_flops else None,
        "matrix_ops_without_shape": unknown_flops,
        # the step's estimated peak (what `npu-amp profile` measures); the sums over every step tensor
        # (an upper bound, frees ignored) stay under *_sum
        "activation_bytes_before": peak_before,
        "activation_bytes_after": _stats.peak_step_bytes(g, shapes, shapes._dependent),
        "activation_bytes_sum_before": act_before,
        "activation_bytes_sum_after": act_after,
    }
    error = shapes.error or bshapes.error
    if error:
        summary["shape_inference_error"] = error
    report.raw_summary.update(summary)
    stats.update(summary)


def _usable_classes(graph):
    """``graph.signature_classes()`` without the nodes of ops Python's
    registry does not know (their facts are computed per node), or None."""
    get = getattr(graph, "signature_classes", None)
    cls = get() if get is not None else None
    if not cls:
        return None
    for op in graph._by_op:
        if registry.op_def(op) is None:
            for name in graph.nodes_of_type(op):
                cls.pop(name, None)
    return cls


@functools.lru_cache(maxsize=None)
def _other_type_attrs(op, attrs):
    """(the type attrs of ``op``'s OpDef other than ``attrs``, sorted; whether
    a signature class fixes all of them) for :meth:`PrecisionPass.kernel_ok`:
    the OpDef's, the same for every graph (issue 17: asked once per process,
    not once per op and graph)."""
    names = tuple(sorted(a.name for a in registry.op_def(op).attr
                         if a.type == "type" and a.name not in attrs))
    sig = {n for n, _ in registry._signature_attrs(op) or ()}
    return names, set(names) <= sig


@functools.lru_cache(maxsize=None)
def _op_meta(op):
    """Per op type: (fixed reason, type attrs used by args, attr defaults,
    [(type_attr, type_list_attr, number_attr)] per input arg); None if unregistered."""
    od = registry.op_def(op)
    if od is None:
        return None
    fixed = FIXED_OPS.get(op)
    if op in _lists.STATEFUL_PAINTABLE:  # (18j: a gradient-dtype attr only; its variables stay FP32)
        fixed = ""
    if fixed is None and op in VARIABLE_OPS:
        fixed = "variable: FP32 master weights"
    if fixed is None and od.is_stateful:
        fixed = "stateful op (variable update / optimizer / random)"
    if fixed is None:
        for arg in od.input_arg[:] + od.output_arg[:]:
            if arg.is_ref or arg.type in (registry.DT_RESOURCE, registry.DT_VARIANT):
                fixed = ("TensorList/variant op" if arg.type == registry.DT_VARIANT
                         else "reads or writes a variable")
                break
    fixed = fixed or None
    type_attrs = {a.name for a in od.attr if a.type == "type"}
    used = []
    for arg in od.input_arg[:] + od.output_arg[:]:
        if arg.type_attr and arg.type_attr in type_attrs and arg.type_attr not in used:
            used.append(arg.type_attr)
    defaults = {a.name: a.default_value for a in od.attr if a.HasField("default_value")}
    in_args = tuple((a.type_attr, a.type_list_attr, a.number_attr) for a in od.input_arg[:])
    return fixed, tuple(used), defaults, in_args


def _type_attr(dt):
    from tensorflow.core.framework import attr_value_pb2
    return attr_value_pb2.AttrValue(type=dt)


#: (issue 17) a one-value Const (a scalar, or shape [1], [1, 1]...) is
#: re-typed as a splat one is, its value written in the field
#: ``tf.make_tensor_proto`` writes it in (``float_val``, or ``half_val`` with
#: the FP16/BF16 bits); False: through ``tf.make_ndarray`` and
#: ``tf.make_tensor_proto`` (the reference, ~80 us a constant; the same
#: bytes: tests/test_precision_consts.py)
SCALAR_CONSTS = True


def _convert_const(node, dt):
    """Re-type a float Const in place (splat constants stay splat)."""
    from tensorflow.core.framework import tensor_pb2

    t = node.attr["value"].tensor
    np_dt = _np_dtype(dt)
    vals = None
    if not t.tensor_content:
        if t.dtype == FP32 and len(t.float_val) == 1:
            vals = np.array(t.float_val, dtype=np.float32)
        elif t.dtype in registry.LOW_TYPES and len(t.half_val) == 1:
            vals = np.array(t.half_val, dtype=np.uint16).view(_np_dtype(t.dtype)).astype(np.float32)
    if vals is not None:
        n = 1
        for d in t.tensor_shape.dim[:]:
            n *= max(d.size, 0)
    if vals is not None and (n != 1 or SCALAR_CONSTS):
        new = tensor_pb2.TensorProto(dtype=dt)
        new.tensor_shape.CopyFrom(t.tensor_shape)
        v = vals.astype(np_dt)
        if dt == FP32:
            new.float_val.append(float(v[0]))
        else:
            new.half_val.append(int(v.view(np.uint16)[0]))
    else:
        arr = tf.make_ndarray(t)
        new = tf.make_tensor_proto(arr.astype(np_dt), dtype=dt, shape=arr.shape)
    node.attr["value"].tensor.CopyFrom(new)
    node.attr["dtype"].type = dt


__all__ = ["PrecisionPass", "canonical_mode", "MODES", "FIXED_OPS"]
