"""The precision pass's painting loops over integer arrays (issue 17).

``PrecisionPass._paint``, ``_demote`` and ``_follow_readers`` decide per
node, walking the graph in topological order and back; in Python that is
~36% of the grappler callback on a Keras ResNet-50 training graph.  This
module hands the same decisions to a native entry point (C++:
``custom_ops/precision_paint.cc``) over compact arrays and applies what it
returns.  The engine never loads a library: the caller puts the entry point
on the pass context (``ctx.native_paint``, see :func:`paint`; the pipeline
does, ``npu_amp_tf/pipeline.py``); without one the Python loops run, and
they stay the reference (``PrecisionPass.native_paint = False``;
tests/test_precision_native.py holds both byte-identical).

Preconditions: a ``PrecisionPass`` set up by ``run`` (fast paths on) in
``allow_mix_precision`` / ``allow_mix_precision_bf16``; ``order`` its
topological order of every node.
Postconditions (when :func:`paint` returns a count): the pass's nodes,
``decisions``, ``state``, ``touched``, ``_contested``, ``_painted`` and the
report's warnings are what the three Python loops leave, in the same order
(with ``PrecisionPass.bulk_apply``, issue 17t: ``state`` is not filled and
the painted nodes' ``decisions`` are kept as the result's rows,
:class:`_Entries`, written into the report when it is read).

What crosses (``ints``, int32, length-prefixed sections after a header
``[version 3, n nodes, k classes, low dtype]``; back: ``OUT_WIDTH`` ints per
node, the decision codes (see custom_ops/precision_paint.cc ``enum Out``),
then (format 2, issue 17n) whether a float data input has another float
dtype than the node wants after the loops (``_fix_edges`` visits only
those; format 3, issue 17t: which ones, bit k for input k < 30, bit 30 for
any from 30 on) and, per Const, the bit mask of the dtypes its output-0 readers want
or -1 (``_convert_consts``)):

* the topological order (node indices; nodes are numbered in graph order);
* per node its class (below) and flags: 1 fetched/preserved (and painted
  as such), 2 fetched/preserved, 4 keep_dtype, 8 low_precision_nodes,
  16 a low kernel exists, 32 an FP32 kernel exists;
* per class 5 ints: has changeable float attrs, fixed, current dtype, list
  (1 white, 2 black, 3 gray, 4 clear), kind (1 Const, 2 Cast, 3 variable
  op, 4 an op a constant passes through); then the class's float input
  indices (``_NodeInfo.fidx``) and its input and output dtypes as they are,
  re-typed to FP32 and re-typed to the low dtype (counts, -1 for unknown,
  then values).

A class is a set of nodes with equal facts: the C++ index's signature
class, or ``registry.signature_key`` for nodes edited since; lowered
Switch/Merge apart by whether they are loop plumbing; nodes of unregistered
ops one class each.  ``strings``: node names joined by ``\\x01``, ``\\x03``,
then per node its data inputs (as many as its class has input dtypes; all
for an op of unknown signature) joined by ``\\x01``, nodes joined by
``\\x02``.
"""
from __future__ import annotations

import functools
from array import array
from itertools import compress, repeat
from operator import attrgetter, contains, getitem, is_

import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2

from .. import graph as graph_mod
from .. import registry
from ..graph import packed_ints
from . import lists as _lists
from . import planner as _planner

VERSION = 3
OUT_WIDTH = 18
(O_DECIDED, O_TARGET, O_STATE, O_BASE, O_VOTER, O_REFUSE, O_REFUSE_CONST, O_F32FAIL, O_DEMOTED,
 O_DEMOTE_F32, O_DEMOTE_LOW, O_FOLLOWED, O_GO, O_STAY, O_CONTESTED, O_LST,
 O_MISMATCH, O_CONST_WANTS) = range(OUT_WIDTH)
F_PROT_PAINT, F_PROT, F_KEEP, F_FORCED, F_KLOW, F_KF32 = 1, 2, 4, 8, 16, 32
_LST_CODE = {"white": 1, "black": 2, "gray": 3, "clear": 4}
_LST_NAME = {1: "white", 2: "black", 3: "gray", 4: "clear", 5: "fixed", 6: "protected",
             7: "keep_dtype"}
_STATE = {1: "low", 2: "f32", 3: "hard", 4: "neutral", 5: "fixed"}
MIX_MODES = ("allow_mix_precision", "allow_mix_precision_bf16")

_op = attrgetter("op")
_input = attrgetter("input")
_device = attrgetter("device")
_attr = attrgetter("attr")


def _kind(op, amp):
    if op == "Const":
        return 1
    if op == "Cast":
        return 2
    if op in amp.VARIABLE_OPS:
        return 3
    if op in amp._CONST_THROUGH:
        return 4
    return 0


def _counts_vals(seqs):
    counts = array("i", [-1 if s is None else len(s) for s in seqs])
    vals = array("i")
    for s in seqs:
        if s:
            vals.extend(s)
    return counts, vals


def paint(pp, order, fn):
    """Run the three loops through ``fn`` (the native entry point:
    ``fn(strings, ints, n_out, check) -> array('i')`` of ``OUT_WIDTH`` ints
    per node, or None when it refuses; ``check(const indices)`` returns the
    indices of the constants unsafe in the low dtype) and apply the result
    to ``pp``.  Returns the count of changed nodes, or None (nothing was
    changed: the caller runs the Python loops)."""
    from . import amp

    g = pp.g
    batched = pp.native_batch
    names = list(g.nodes)
    nodes = list(g.nodes.values())
    n = len(names)
    if n == 0 or len(order) != n:
        return None
    idx = g.positions()
    # (CLASS_OPS: no per-node op list; a class has one op, read from its first node)
    ops = None if CLASS_OPS and batched else list(map(_op, nodes))
    cls = pp._cls
    keys = list(map(cls.get, names)) if cls else [None] * n
    cond = amp.COND_OPS
    numbered = None  # (first_seen, ids, cid) of `keys` when they need no rewrite
    if batched and ops is None and FIRST_BY_CLASS:
        # the classes numbered first (below); a class is odd when it has no
        # C++ class or is of a cond op (its first node's op); with none odd
        # (the usual case) that numbering is the final one
        numbered = _number(keys, n)
        first_seen, _, cid0 = numbered
        first0 = first_indices(cid0)
        odd = [c for c, (k, i) in enumerate(zip(first_seen, first0)) if k is None or nodes[i].op in cond]
        special = np.flatnonzero(np.isin(np.frombuffer(cid0, np.int32), odd)).tolist() if odd else ()
        if odd:
            numbered = None
    elif batched and ops is None:
        # the nodes without a C++ class, and those of a class of a cond op
        # (the op of the class's first node: C-level, the first index of
        # each key from a dict filled backwards)
        first_of = dict(zip(reversed(keys), range(n - 1, -1, -1)))
        odd = {k for k, i in first_of.items() if k is None or nodes[i].op in cond}
        special = list(compress(range(n), map(odd.__contains__, keys)))
    elif batched:  # (17n: a Python statement only per node without a class or of a cond op)
        special = sorted(set(compress(range(n), map(is_, keys, repeat(None))))
                         | set(compress(range(n), map(cond.__contains__, ops))))
    else:
        special = range(n)
    for i in special:  # (a Python statement per node; the rest is C-level)
        k = keys[i]
        op = nodes[i].op if ops is None else ops[i]
        if k is None or op in cond:
            node = nodes[i]
            k0 = k if k is not None else pp._key(node)
            if k0 is None:
                keys[i] = ("node", names[i])
            elif op in cond:
                keys[i] = ("cond", k0, pp.in_loop_plumbing(node))
            else:
                keys[i] = ("sig", k0)
    # classes numbered 0.. in order of first appearance
    _, ids, cid = numbered if numbered is not None else _number(keys, n)
    kcount = len(ids)
    # class -> its first node
    first = first0 if numbered is not None else first_indices(cid)
    cop = [nodes[i].op for i in first]  # class -> its op (equal keys: one op)
    low = pp.low
    rec = array("i", bytes(4 * 5 * kcount))
    fidx, dts = [None] * kcount, [[None] * kcount for _ in range(6)]
    infos, lsts = [None] * kcount, [None] * kcount
    paintable = bytearray(kcount)
    scratch = None
    for c in range(kcount):
        i = first[c]
        node = nodes[i]
        key = keys[i]
        if isinstance(key, tuple) and key[0] in ("cond", "node"):
            info = pp._compute_info_of(node)
        else:
            info = pp.info(node)
        infos[c] = info
        _, ins, outs = pp._memo_dts(node)
        has = bool(info.attrs)
        cur = pp.current(node, info) if has else 0
        kind = _kind(cop[c], amp)
        lst = 0
        if has and not info.fixed and kind != 1:
            paintable[c] = 1
            lsts[c] = pp.classify(node)
            lst = _LST_CODE.get(lsts[c][0], 3)
        base = 5 * c
        rec[base:base + 5] = array("i", (int(has), int(bool(info.fixed)), cur or 0, lst, kind))
        fidx[c] = info.fidx
        dts[0][c], dts[1][c] = ins, outs
        for v, dt in ((1, registry.DT_FLOAT), (2, low)):
            if paintable[c] and cur != dt:
                # (the dtypes follow from the op and attrs alone, see
                # registry._flat_dtypes: the name, inputs and device stay behind
                # with SCRATCH_ATTRS_ONLY; a Keras ShapeN has 108 inputs)
                if scratch is None:  # (the copies share one arena: see Graph.blank_node)
                    scratch = graph_pb2.GraphDef().node if graph_mod.SHARED_ARENA else None
                copy = scratch.add() if scratch is not None else node_def_pb2.NodeDef()
                if SCRATCH_ATTRS_ONLY:
                    copy.op = node.op
                    copy.attr.MergeFrom(node.attr)
                else:
                    copy.CopyFrom(node)
                registry.retype(copy, info.attrs, dt)
                ci, co = g.input_dtypes(copy), g.output_dtypes(copy)
                dts[2 * v][c] = None if ci is None else tuple(ci)
                dts[2 * v + 1][c] = None if co is None else tuple(co)
            else:
                dts[2 * v][c], dts[2 * v + 1][c] = ins, outs
    # per node flags: kernels (per class and device string, or per node for
    # fused ops and ops whose kernel check reads attrs outside the class),
    # keep_dtype, low_precision_nodes, fetched/preserved
    base = []  # (Graph.base_positions, computed once when first asked)

    def base_at():
        if not base:
            base.append(g.base_positions())
        return base[0]

    devs, one_dev = _devices(g, nodes, n, base_at)
    if batched:
        flags = _flags_batched(pp, n, nodes, names, cid, first, paintable, infos, rec, devs, low, one_dev)
    else:
        flags = _flags_per_node(pp, n, nodes, names, cid, paintable, infos, rec, devs, low)
    stateful = _lists.STATEFUL_PAINTABLE
    for name in pp.protected:
        i = idx.get(name)
        if i is not None:
            op = cop[cid[i]] if ops is None else ops[i]
            flags[i] |= F_PROT | (0 if op in stateful else F_PROT_PAINT)
    ints = array("i", (VERSION, n, kcount, low))
    ints.append(n)
    at = g.order_positions(order)  # (issue 17: the sort's ids; else each name looked up)
    if at is not None:
        oid = array("i")
        oid.frombytes(at.tobytes())
    else:
        oid = _i32(map(idx.__getitem__, order), len(order))
    ints.extend(oid)
    for sec in (cid, flags, rec):
        ints.append(len(sec))
        ints.extend(sec)
    for seqs in [fidx] + dts:
        counts, vals = _counts_vals(seqs)
        ints.append(len(counts))
        ints.extend(counts)
        ints.append(len(vals))
        ints.extend(vals)
    # (each node's data inputs only, as many as its class's input dtypes:
    # the control inputs after them, most of a Keras training graph's edges,
    # are never read, nor turned into Python strings)
    cut = [slice(None) if ins is None else slice(0, len(ins)) for ins in dts[0]]
    strings = _strings(g, names, nodes, cid, cut, dts[0], base_at) if pp.base_strings else None
    if strings is None:
        data_ins = map(getitem, map(_input, nodes), map(cut.__getitem__, cid))
        strings = ("\x01".join(names) + "\x03" + "\x02".join(map("\x01".join, data_ins))).encode()

    def check(candidates):
        return [c for c in candidates if _unsafe_const(pp, nodes[c], low)]

    out = fn(strings, ints, n * OUT_WIDTH, check)
    if out is None:
        return None
    if batched and pp.bulk_apply:
        # (issue 17) the painter behind the result, kept open for the casts' plan (fix_edges)
        painter = getattr(out, "painter", None)
        if painter is not None:
            pp._painted_with = (painter, out, names, nodes)
        return _apply_bulk(pp, out, oid, idx, names, nodes, cid, infos, lsts, rec, ops, cop)
    return _apply(pp, out, order, idx, names, nodes, cid, infos, lsts, rec)


def _number(keys, n):
    """(first_seen, ids, cid): the distinct ``keys`` in order of first
    appearance (a dict), key -> its number, and each key's number (int32
    array; C-level: dict.fromkeys, then a lookup per key)."""
    first_seen = dict.fromkeys(keys)
    ids = dict(zip(first_seen, range(len(first_seen))))
    return first_seen, ids, _i32(map(ids.__getitem__, keys), n)


def _devices(g, nodes, n, base_at):
    """(every node's device string, True when all are ""): "" for the nodes
    no pass created or edited when the graph's source has none
    (``Graph.source_has_device``, :data:`SOURCE_DEVICES`), the node's own
    for the others.  ``base_at()``: ``g.base_positions()``."""
    fn = g.source_has_device if SOURCE_DEVICES else None
    if fn is not None and fn() is False:
        base = base_at()
        if base is not None and len(base) == n:
            devs = [""] * n
            for i in np.flatnonzero(base < 0).tolist():
                devs[i] = nodes[i].device
            return devs, not any(devs)
    return list(map(_device, nodes)), False


def _strings(g, names, nodes, cid, cut, ins_dts, base_at):
    """The ``strings`` argument from ``g.base_inputs`` (issue 17: the graph's
    builder reads the inputs of the nodes no pass created or edited from the
    graph it was built from, ``Graph.base_positions``; only the other nodes'
    inputs are joined here), or None (then every node's are)."""
    fn = g.base_inputs
    if fn is None:
        return None
    base = base_at()
    if base is None or len(base) != len(names):
        return None
    counts = np.array([-1 if ins is None else len(ins) for ins in ins_dts], np.int32)
    per_node = array("i")
    per_node.frombytes(counts[np.frombuffer(cid, np.int32)].tobytes())
    edited = np.flatnonzero(base < 0).tolist()
    extra = "\x02".join(["\x01".join(nodes[i].input[cut[cid[i]]]) for i in edited])
    at = array("i")
    at.frombytes(base.tobytes())
    return fn("\x01".join(names).encode(), at, per_node, extra.encode())


def _flags_per_node(pp, n, nodes, names, cid, paintable, infos, rec, devs, low):
    """Per node flags, one Python statement per paintable node (17l; the
    reference of :func:`_flags_batched`)."""
    flags = array("i", bytes(4 * n))
    plan = pp.plan
    forced = bool(plan.low_names)
    kern = {}
    per_node_kernel = {}
    for i in range(n):
        c = cid[i]
        if not paintable[c]:
            continue
        node = nodes[i]
        info = infos[c]
        f = _plan_flags(plan, node, names[i], forced)
        pn = per_node_kernel.get(c)
        if pn is None:
            pn = per_node_kernel[c] = _per_node_kernel(pp, node, info, low)
        kk = None if pn else (c, devs[i])
        bits = kern.get(kk) if kk is not None else None
        if bits is None:
            bits = _kernel_bits(pp, node, info, low, rec[5 * c + 2])
            if kk is not None:
                kern[kk] = bits
        flags[i] = f | bits
    return flags


def _as_list(idx):
    """``idx`` (a list, or a numpy array of node indices) as a list."""
    return idx.tolist() if isinstance(idx, np.ndarray) else idx


def _plan_flags(plan, node, name, forced):
    """F_KEEP / F_FORCED of one paintable node from the plan (``forced``:
    the plan names nodes to force low)."""
    f = F_KEEP if plan.is_keep(node) else 0
    if forced and plan.is_forced_low(name):
        f |= F_FORCED
    return f


#: (issue 17) ask ``Graph.source_has_attr`` before reading every paintable
#: node's attr map for ``_keep_dtype``; False: always read them (the reference)
SOURCE_ATTRS = True


def _attr_absent(g, name) -> bool:
    """True when ``g``'s source says none of its nodes carries the attr
    ``name`` (``Graph.source_has_attr``); only for attrs no pass writes."""
    fn = getattr(g, "source_has_attr", None) if SOURCE_ATTRS else None
    return fn is not None and fn(name) is False


#: (issue 17) ``Graph.source_has_device`` before reading every node's device
#: string; False: always read them (the reference)
SOURCE_DEVICES = True

#: (issue 17) with every device string "" (``_devices``), the kernel flags
#: per class through numpy instead of per (class, device) pair through
#: Python maps; False: the pairs (the reference)
ONE_DEVICE = True

#: (issue 17) :func:`_apply_bulk` fills the memos ``_retype`` dropped per
#: re-typing batch (one registry question, C-level dict updates) right after
#: the batch, not per node after every batch (:func:`_refill_memos`); False:
#: per node (the reference; the same memo entries)
GROUP_MEMOS = True

#: (issue 17) the painting numbers the classes first and finds the odd ones
#: (no C++ class, or a cond op) from each class's first node, renumbering only
#: when there are some; False: the odd keys from a dict of every key's first
#: node, then the numbering (the reference; the same classes and numbers)
FIRST_BY_CLASS = True

#: (issue 17) a class's dtypes re-typed to FP32 / the low dtype are read
#: from a scratch NodeDef holding only the class's op and attrs (what
#: ``registry.retype`` and the dtype questions read); False: a copy of the
#: whole first node (the reference; the same dtypes)
SCRATCH_ATTRS_ONLY = True

#: (issue 17) the painting takes a node's op from its class (equal keys, one
#: op: the C++ signature class or ``registry.signature_key``), read once per
#: class, instead of reading every node's; False: every node's (the reference)
CLASS_OPS = True


def first_indices(cid) -> list:
    """Per class, the index of its first node, for ``cid`` (int32 items)
    numbering classes 0.. in order of first appearance: class ``c`` first
    appears where the running maximum of the ids steps up to ``c`` (one
    linear scan; ``np.unique(..., return_index=True)`` sorts the ids)."""
    ids = np.frombuffer(cid, np.int32)
    if not len(ids):
        return []
    return np.flatnonzero(np.diff(np.maximum.accumulate(ids), prepend=-1)).tolist()


def _i32(values, count):
    """``array('i', values)`` (``count`` ints) through ``struct.pack``:
    ``array`` built from an iterable converts each item with ``PyArg_Parse``
    (~300 instructions an int), ``struct`` with one C call
    (:func:`graph_passes.graph.packed_ints`)."""
    out = array("i")
    out.frombytes(packed_ints(values, count, np.int32).tobytes())
    return out


#: (issue 17t) op type -> its OpDef has a ``fused_ops`` attr (registered ops only; process-wide)
_HAS_FUSED_OPS = {}


def _per_node_kernel(pp, node, info, low):
    """True when the kernel check of ``node``'s class depends on more than
    the class and the device string (fused ops; ops whose check reads type
    attrs the class does not fix)."""
    pn = _HAS_FUSED_OPS.get(node.op)
    if pn is None:
        od = registry.op_def(node.op)
        pn = od is None or any(a.name == "fused_ops" for a in od.attr)
        if od is not None:  # (a registered OpDef does not change; an unknown op may be registered later)
            _HAS_FUSED_OPS[node.op] = pn
    if not pn:
        pp.kernel_ok(node, info, low)  # fills _other_types
        ent = pp._other_types.get((node.op, info.attrs))
        pn = ent is None or not ent[1]
    return pn


def _kernel_bits(pp, node, info, low, cur):
    bits = F_KLOW if pp.kernel_ok(node, info, low) else 0
    if cur == registry.DT_FLOAT or pp.kernel_ok(node, info, registry.DT_FLOAT):
        bits |= F_KF32
    return bits


def _flags_batched(pp, n, nodes, names, cid, first, paintable, infos, rec, devs, low, one_dev=False):
    """The flags of :func:`_flags_per_node` (issue 17n) with a Python
    statement per paintable class, per distinct (class, device string) and
    per node that needs one (fused ops, a ``_keep_dtype`` attr, name
    overrides); the per-node work is C-level maps."""
    plan = pp.plan
    per_node = set()
    for c in compress(range(len(paintable)), paintable):
        if _per_node_kernel(pp, nodes[first[c]], infos[c], low):
            per_node.add(c)
    # one node per distinct (class, device string): every node of a class
    # that is not per_node gets the same answers (the class fixes the
    # attrs the check reads, and the device type follows the string); the
    # last such node, in order of the pairs' first appearance
    if one_dev and ONE_DEVICE:
        # (every device string ""; a pair is its class, numbered in order of
        # first appearance: numpy per node, a Python statement per class)
        cls_arr = np.frombuffer(cid, np.int32)
        paint_idx = np.flatnonzero(np.frombuffer(paintable, np.uint8)[cls_arr])
        rev = paint_idx[::-1]
        classes, at = np.unique(cls_arr[rev], return_index=True)
        bits = np.zeros(len(paintable), np.int32)
        for c, i in zip(classes.tolist(), rev[at].tolist()):
            if c not in per_node:
                bits[c] = _kernel_bits(pp, nodes[i], infos[c], low, rec[5 * c + 2])
        flags = array("i")
        flags.frombytes(bits[cls_arr].tobytes())
        psel = paint_idx  # (a list only when read below)
    else:
        pmask = list(map(paintable.__getitem__, cid))
        pairs = list(zip(cid, devs))
        bits_of = {}
        reps = dict(zip(compress(pairs, pmask), compress(range(n), pmask)))
        for pair, i in reps.items():
            c = pair[0]
            if c not in per_node:
                bits_of[pair] = _kernel_bits(pp, nodes[i], infos[c], low, rec[5 * c + 2])
        flags = _i32(map(bits_of.get, pairs, repeat(0)), n)
        psel = list(compress(range(n), pmask))
    fix = set()
    if per_node:
        fix.update(compress(range(n), map(per_node.__contains__, cid)))
    if plan.keep_names or plan.low_names:
        fix.update(_as_list(psel))
    elif _attr_absent(pp.g, _planner.KEEP_DTYPE_ATTR):
        pass  # (no node of the input carries it, and no pass writes it)
    else:
        sel = _as_list(psel)  # (the attr read of the paintable nodes only)
        fix.update(compress(sel, map(contains, map(_attr, map(nodes.__getitem__, sel)),
                                     repeat(_planner.KEEP_DTYPE_ATTR))))
    forced = bool(plan.low_names)
    for i in sorted(fix):
        node = nodes[i]
        c = cid[i]
        f = _plan_flags(plan, node, names[i], forced)
        if c in per_node:
            f |= _kernel_bits(pp, node, infos[c], low, rec[5 * c + 2])
        else:
            f |= flags[i]
        flags[i] = f
    return flags


#: (float32 value, dtype) -> amp._why_unsafe of that one value (process-wide)
_SPLAT_WHY = {}


def _unsafe_const(pp, node, dt):
    """``pp.unsafe_const(node, dt)`` (the same answer, in its memo), without
    building the array for a splat constant (one value repeated: the same
    first unsafe value, the same reason) whose value was seen before."""
    key = (node.name, dt)
    cache = pp._unsafe_cache
    if key in cache:
        return cache[key]
    va = node.attr["value"]
    t = va.tensor
    if (t.dtype == registry.DT_FLOAT and not t.tensor_content and len(t.float_val) == 1
            and node.attr["dtype"].type == registry.DT_FLOAT):
        n = 1
        for d in t.tensor_shape.dim[:]:
            n *= d.size
        v = t.float_val[0]
        if n >= 1 and v == v:  # (NaN: the reference path)
            from . import amp

            vk = (v, dt)
            why = _SPLAT_WHY.get(vk, _SPLAT_WHY)
            if why is _SPLAT_WHY:  # (not seen: computed once; grappler may call from several threads)
                why = amp._why_unsafe(np.array([v], np.float32), dt)
                if len(_SPLAT_WHY) > 4096:
                    _SPLAT_WHY.clear()
                _SPLAT_WHY[vk] = why
            cache[key] = why
            return why
    return pp.unsafe_const(node, dt)


def _base_reason(base, lst, why, names, voter, low_name):
    """The report's reason for a node the native loops painted, from its base
    code (1-8: the result's ``O_BASE`` column); ``lst``: its list's name,
    ``why``: its class's list reason, ``names[voter]``: the producer it
    followed (codes 7, 8).  None for any other code."""
    if base == 1:
        return "fetched/preserved: keeps its dtype"
    if base == 2:
        return "keep_dtype: never converted"
    if base == 3:
        return "low_precision_nodes: forced low precision"
    if base == 4:
        return f"white list: {why}"
    if base == 5:
        return f"black list: {why}"
    if base == 6:
        return f"{lst}: no voting producer (constants/variables only); keeps its dtype"
    if base == 7:
        return f"{lst}: followed producer '{names[voter]}' ({low_name})"
    if base == 8:
        return f"{lst}: followed producer '{names[voter]}' (float32)"
    return None


def _apply(pp, out, order, idx, names, nodes, cid, infos, lsts, rec):
    """Write the native result into ``pp`` the way the Python loops do."""
    W = OUT_WIDTH
    dname = registry.dtype_name
    low_name = pp.low_name
    decisions, state, touched = pp.decisions, pp.state, pp.touched
    painted = set() if len(order) == len(pp.g.nodes) else None
    changed = 0
    demoted, followed = [], []
    warn = pp.ctx.warn
    paths = {} if pp.native_batch else None  # node -> the dtypes it was re-typed to, in order
    low_now = set() if paths is not None else None
    low_types = registry.LOW_TYPES
    for name in order:
        i = idx[name]
        b = i * W
        dec = out[b + O_DECIDED]
        if not dec:
            continue
        node = nodes[i]
        c = cid[i]
        info = infos[c]
        if dec == 1:
            state[name] = "fixed"
            decisions[name] = {"reason": f"fixed: {info.fixed}", "state": "fixed", "list": "fixed",
                               "dtype": dname(out[b + O_TARGET])}
            continue
        if painted is not None:
            painted.add(name)
        target = out[b + O_TARGET]
        st = _STATE[out[b + O_STATE]]
        lst = _LST_NAME[out[b + O_LST]]
        cur = rec[5 * c + 2]  # (the class's current dtype: the node is unedited so far)
        base = out[b + O_BASE]
        why = lsts[c][1] if lsts[c] is not None else None
        reason = _base_reason(base, lst, why, names, out[b + O_VOTER], low_name)
        if reason is None:  # (not reached: every painted node has a reason)
            return _fail(name)
        refuse = out[b + O_REFUSE]
        if refuse:
            if refuse == 1:
                cnode = nodes[out[b + O_REFUSE_CONST]]
                reason = (f"const underflow: input '{cnode.name}' {pp.unsafe_const(cnode, pp.low)}; "
                          f"'{name}' stays FP32")
            else:
                reason = (f"no kernel: {node.op} has no {low_name} kernel on "
                          f"{pp.device_type(node)}; stays {dname(cur)}")
            warn(reason, node=name)
        if out[b + O_F32FAIL]:
            reason = (f"no kernel: {node.op} has no float32 kernel on {pp.device_type(node)}; "
                      f"keeps {dname(cur)}")
            warn(reason, node=name)
        if out[b + O_CONTESTED]:
            pp._contested.add(name)
        if low_now is not None and target in low_types:
            low_now.add(name)
        if target != cur:
            pp._retype(node, info.attrs, target)
            changed += 1
            touched.add(name)
            if paths is not None:
                paths[i] = (target,)
        state[name] = st
        decisions[name] = {"reason": reason, "state": st, "list": lst, "dtype": dname(target),
                           "was": dname(cur)}
        if out[b + O_DEMOTED]:
            demoted.append(i)
        if out[b + O_FOLLOWED]:
            followed.append(i)
    pp._painted = painted
    for i in reversed(demoted):  # (reverse topological order, as _demote)
        b = i * W
        name, node = names[i], nodes[i]
        pp._retype(node, infos[cid[i]].attrs, registry.DT_FLOAT)
        touched.add(name)
        if paths is not None:
            paths[i] = paths.get(i, ()) + (registry.DT_FLOAT,)
            low_now.discard(name)
        state[name] = "f32"
        d = decisions[name]
        if d.get("was") == "float32":
            changed -= 1
        d.update(state="f32", dtype="float32",
                 reason=d["reason"] + f"; kept FP32: {out[b + O_DEMOTE_F32]} cast(s) instead of "
                                      f"{out[b + O_DEMOTE_LOW]}")
    for i in reversed(followed):
        b = i * W
        name, node = names[i], nodes[i]
        pp._retype(node, infos[cid[i]].attrs, pp.low)
        touched.add(name)
        if paths is not None:
            paths[i] = paths.get(i, ()) + (pp.low,)
            low_now.add(name)
        state[name] = "low"
        changed += 1
        d = decisions[name]
        d.update(state="low", dtype=low_name,
                 reason=d["reason"] + f"; low before its fan-out: {out[b + O_GO]} cast(s) instead of "
                                      f"{out[b + O_STAY]}")
    if paths:
        _refill_memos(pp, paths, names, nodes, cid, infos)
    if paths is not None:
        # (issue 17n) the nodes with a float input of another float dtype than
        # they want, after the loops: the only ones _fix_edges need visit
        col = np.frombuffer(out, dtype=np.int32)[O_MISMATCH::W]
        pp._mismatch = set(map(names.__getitem__, np.flatnonzero(col).tolist()))
        # per Const the dtypes its readers want (a bit mask; -1: ask Python)
        pp._const_wants = (idx, np.frombuffer(out, dtype=np.int32)[O_CONST_WANTS::W].tolist())
        if painted is not None:  # (what _finish counts: the painted nodes now in the low dtype)
            pp._painted_low = low_now
    return changed


def _apply_bulk(pp, out, oid, idx, names, nodes, cid, infos, lsts, rec, ops, cop):
    """:func:`_apply` from the result's columns (issue 17t): the decided,
    re-typed, demoted and followed nodes selected with numpy, a Python
    statement only per re-typed node and per warning; the report's entries
    (``pp.decisions`` of the painted nodes: reasons, states, lists, dtypes)
    are not built here but handed to :meth:`PrecisionPass._finish` as a
    writer (:class:`_Entries`) the report runs the first time its decisions
    are read (``Report.defer_decisions``).  ``pp.state`` is not filled (no
    step after the native loops reads it).  The same graph, warnings,
    ``touched``, ``_contested``, ``_painted``, memos and, once written, the
    same decisions in the same order as :func:`_apply`."""
    W = OUT_WIDTH
    n = len(names)
    a = np.frombuffer(out, dtype=np.int32).reshape(n, W)
    o = np.frombuffer(oid, dtype=np.int32)
    dec = a[o, O_DECIDED]
    sel = o[dec != 0]  # the decided nodes, in topological order
    pnt = o[dec == 2]  # the painted ones
    cls_arr = np.frombuffer(cid, dtype=np.int32)
    cur_c = np.frombuffer(rec, dtype=np.int32)[2::5]
    cur = cur_c[cls_arr[pnt]]
    target = a[pnt, O_TARGET]
    nget = names.__getitem__
    pp._painted = set(map(nget, pnt.tolist()))
    warn = pp.ctx.warn
    dname = registry.dtype_name
    low_name = pp.low_name
    special = {}  # node index -> the reason a refusal / missing FP32 kernel gave (warned now)
    rare = pnt[(a[pnt, O_REFUSE] != 0) | (a[pnt, O_F32FAIL] != 0)]
    for i in rare.tolist():
        node, name = nodes[i], names[i]
        c = cid[i]
        ci = rec[5 * c + 2]
        reason = None
        refuse = a[i, O_REFUSE]
        if refuse:
            if refuse == 1:
                cnode = nodes[a[i, O_REFUSE_CONST]]
                reason = (f"const underflow: input '{cnode.name}' {pp.unsafe_const(cnode, pp.low)}; "
                          f"'{name}' stays FP32")
            else:
                reason = (f"no kernel: {node.op} has no {low_name} kernel on "
                          f"{pp.device_type(node)}; stays {dname(ci)}")
            warn(reason, node=name)
        if a[i, O_F32FAIL]:
            reason = (f"no kernel: {node.op} has no float32 kernel on {pp.device_type(node)}; "
                      f"keeps {dname(ci)}")
            warn(reason, node=name)
        special[i] = reason
    pp._contested.update(map(nget, pnt[a[pnt, O_CONTESTED] != 0].tolist()))
    # re-typings, in _apply's order: painted (topological), demoted, followed (reverse)
    moved = target != cur
    first = pnt[moved]
    dem = pnt[a[pnt, O_DEMOTED] != 0][::-1]
    fol = pnt[a[pnt, O_FOLLOWED] != 0][::-1]
    changed = int(moved.sum()) - int((cur[a[pnt, O_DEMOTED] != 0] == registry.DT_FLOAT).sum()) + len(fol)
    paths = {}
    f32, low = registry.DT_FLOAT, pp.low
    for i, dt in zip(first.tolist(), target[moved].tolist()):
        paths[i] = (dt,)
    for i in dem.tolist():
        paths[i] = paths.get(i, ()) + (f32,)
    for i in fol.tolist():
        paths[i] = paths.get(i, ()) + (low,)
    # each node's re-typings in order, batched by (class, re-typings, op): the
    # nodes of a batch share their type attrs and op (``PrecisionPass._retype_all``)
    groups = {}
    for i, path in paths.items():
        c = cid[i]
        groups.setdefault((c, path, cop[c] if ops is None else ops[i]), []).append(i)
    g = pp.g
    dts, info_memo = pp._dts, pp._info
    follow = registry.LIST_ATTRS_FOLLOW
    for (c, path, op), members in groups.items():
        gnodes, gnames = list(map(nodes.__getitem__, members)), list(map(names.__getitem__, members))
        pp._retype_all(gnodes, gnames, op, infos[c].attrs, path)
        if op not in follow:
            # (issue 17) each attr now holds exactly the path's last dtype
            # (registry.retype_all sets its type): the batch's patch record
            pp._retyped.append((gnames, _type_attrs(tuple(infos[c].attrs), path[-1])))
        if GROUP_MEMOS:
            # (_refill_memos per batch: its nodes end with equal signatures)
            ins, outs = g.input_dtypes(gnodes[0]), g.output_dtypes(gnodes[0])
            f = (None if ins is None else tuple(ins), None if outs is None else tuple(outs))
            dts.update(zip(gnames, zip(gnodes, repeat(f[0]), repeat(f[1]))))
            info_memo.update(zip(gnames, repeat((op, infos[c]))))
    pp.touched.update(map(nget, paths))
    if not GROUP_MEMOS:
        _refill_memos(pp, paths, names, nodes, cid, infos)
    final = target.copy()
    final[a[pnt, O_DEMOTED] != 0] = f32
    final[a[pnt, O_FOLLOWED] != 0] = low
    low_types = np.array(sorted(registry.LOW_TYPES), dtype=np.int32)
    pp._painted_low = set(map(nget, pnt[np.isin(final, low_types)].tolist()))
    col = a[:, O_MISMATCH]
    hit = np.flatnonzero(col)
    pp._mismatch = set(map(nget, hit.tolist()))
    # (format 3) which inputs: bit k for input k < 30, bit 30 for any from 30 on
    pp._mismatch_inputs = dict(zip(map(nget, hit.tolist()), col[hit].tolist()))
    cw = a[:, O_CONST_WANTS]
    pp._const_wants = (idx, cw.tolist())
    # the Consts whose wants _convert_consts would pass over: no reader or
    # readers wanting two dtypes, or the one wanted not float or their dtype
    # (a Const's dtype is its class's: the loops never re-type a Const)
    kind_c = np.frombuffer(rec, dtype=np.int32)[4::5]
    consts = np.flatnonzero(kind_c[cls_arr] == 1)
    m = cw[consts].astype(np.int64)
    single = (m > 0) & ((m & (m - 1)) == 0)
    w = np.zeros_like(m)
    w[single] = np.log2(m[single]).astype(np.int64)
    floats = np.array(sorted(registry.FLOAT_TYPES), dtype=np.int64)
    convert = single & np.isin(w, floats) & (w != cur_c[cls_arr[consts]])
    pp._const_skip = set(map(nget, consts[(m >= 0) & ~convert].tolist()))
    pp._entries = _Entries(names, sel, a[sel].copy(), cls_arr[sel].copy(),
                           [None if inf is None else inf.fixed for inf in infos],
                           [None if x is None else x[1] for x in lsts], cur_c.copy(), low_name, special)
    return changed


@functools.lru_cache(maxsize=1024)
def _type_attrs(attrs: tuple, dt: int) -> tuple:
    """((attr, the serialized AttrValue ``type: dt``), ...) of ``attrs`` (one
    tuple per (attrs, dt): the graph's records share it)."""
    v = attr_value_pb2.AttrValue(type=dt).SerializeToString()
    return tuple((a, v) for a in attrs)


class _Entries:
    """(issue 17t) The precision pass's report entries of the nodes the
    native loops decided, kept as the result's rows until the report is read
    (see :func:`_apply_bulk`): :meth:`items` yields ``(name, fields)`` in
    topological order, the fields (and their key order) those
    :func:`_apply` builds, demotion and follow-up reasons appended."""

    __slots__ = ("names", "sel", "rows", "cls", "fixed", "why", "cur", "low_name", "special")

    def __init__(self, names, sel, rows, cls, fixed, why, cur, low_name, special):
        self.names, self.sel, self.rows, self.cls = names, sel, rows, cls
        self.fixed, self.why, self.cur, self.low_name, self.special = fixed, why, cur, low_name, special

    def names_set(self):
        return set(map(self.names.__getitem__, self.sel.tolist()))

    def items(self):
        dname = registry.dtype_name
        names, low_name, special = self.names, self.low_name, self.special
        fixed, why, curs = self.fixed, self.why, self.cur
        st_name, lst_name = _STATE, _LST_NAME
        for i, r, c in zip(self.sel.tolist(), self.rows.tolist(), self.cls.tolist()):
            name = names[i]
            if r[O_DECIDED] == 1:
                yield name, {"reason": f"fixed: {fixed[c]}", "state": "fixed", "list": "fixed",
                             "dtype": dname(r[O_TARGET])}
                continue
            lst = lst_name[r[O_LST]]
            base = r[O_BASE]
            reason = special.get(i)
            if reason is None:
                reason = _base_reason(base, lst, why[c], names, r[O_VOTER], low_name)
            st = st_name[r[O_STATE]]
            dt = dname(r[O_TARGET])
            if r[O_DEMOTED]:
                st, dt = "f32", "float32"
                reason += f"; kept FP32: {r[O_DEMOTE_F32]} cast(s) instead of {r[O_DEMOTE_LOW]}"
            if r[O_FOLLOWED]:
                st, dt = "low", low_name
                reason += f"; low before its fan-out: {r[O_GO]} cast(s) instead of {r[O_STAY]}"
            yield name, {"reason": reason, "state": st, "list": lst, "dtype": dt, "was": dname(curs[c])}


def _refill_memos(pp, paths, names, nodes, cid, infos):
    """(issue 17n) The per-node memos ``_retype`` dropped, filled again:
    nodes of one signature class re-typed by the same sequence of dtypes
    end with equal signatures, so their dtypes are asked of the registry
    once per (class, sequence) instead of once per node (``_memo_dts``
    after its ``signature_key``), and their facts (``info``: a float attr
    stays float) are the class's."""
    g = pp.g
    dts, info_memo = pp._dts, pp._info
    facts = {}
    for i, path in paths.items():
        node = nodes[i]
        c = cid[i]
        key = (c, path)
        f = facts.get(key)
        if f is None:
            ins, outs = g.input_dtypes(node), g.output_dtypes(node)
            f = facts[key] = (None if ins is None else tuple(ins), None if outs is None else tuple(outs))
        name = names[i]
        dts[name] = (node, f[0], f[1])
        info_memo[name] = (node.op, infos[c])


def cast_node(templates, src_t, dst_t, device, name, root, blank=node_def_pb2.NodeDef):
    """A new ``Cast`` NodeDef ``name`` reading ``root``: a copy of the
    template for (``src_t``, ``dst_t``, ``device``) in ``templates`` (made
    once), then its name and input: a third of the instructions of a new
    NodeDef whose attr map merges the template's."""
    tk = (src_t, dst_t, device)
    tmpl = templates.get(tk)
    if tmpl is None:
        tmpl = templates[tk] = node_def_pb2.NodeDef(op="Cast", device=device)
        tmpl.attr["SrcT"].type = src_t
        tmpl.attr["DstT"].type = dst_t
        tmpl.attr["Truncate"].b = False
    new = blank()
    new.CopyFrom(tmpl)
    new.name = name
    new.input.append(root)
    return new


#: how many casts' plans the C++ painter made (:func:`fix_edges`; for tests)
CAST_PLANS = [0]


def fix_edges(pp, shapes) -> bool:
    """(issue 17, the C++ core's milestone 2) ``PrecisionPass._fix_edges_bulk``
    with its decisions made by the C++ painter that painted
    (``pp._painted_with``; custom_ops/precision_paint.cc ``CastPlan``): which
    edges get which tensor (the root behind float Casts, an existing Cast, or
    a new ``<src>/CastToXx`` Cast, named as the reference names it), in the
    reference's order.  Python makes the new Casts' NodeDefs (a copy of a
    template per (SrcT, DstT, device)), saves the nodes it re-wires and has
    the graph add and re-wire in one call (``Graph.add_and_rewire``).

    The painter reads the dtypes from the result record as
    :func:`_apply_bulk` applied it, and is told the nodes ``_adapt_casts`` and
    ``_convert_consts`` re-typed since (their dtypes now) and the Casts with
    a control input (never reused).  False (nothing done: the caller runs
    the reference) when ``keep_fp16_copies``' working copies may be read
    instead of a cast, the graph's nodes are not those painted, or the
    painter leaves the plan to Python."""
    painter, out, names, nodes = pp._painted_with
    g = pp.g
    masks, cw = pp._mismatch_inputs, pp._const_wants
    if masks is None or cw is None or len(g.nodes) != len(names):
        return False
    if not pp.copy_probe or any(n.endswith("/Fp16Copy") for n in g.nodes_of_type("VarHandleOp")):
        return False  # (a copy's read may replace a cast: the reference decides)
    idx = cw[0]  # (name -> the painted node index)
    ints = array("i", [len(pp._late)])
    for name in pp._late:
        node = nodes[idx[name]]
        _, ins, outs = pp._memo_dts(node)
        ints.append(idx[name])
        for dts in (ins, outs):
            if dts is None:
                ints.append(-1)
            else:
                ints.append(len(dts))
                ints.extend(dts)
    ctrl = [idx[c] for c in g.nodes_of_type("Cast") if any(i[:1] == "^" for i in nodes[idx[c]].input[:])]
    ints.append(len(ctrl))
    ints.extend(ctrl)
    blob = painter.fix_edges(out, ints)
    if blob is None:
        return False
    CAST_PLANS[0] += 1
    n_new, n_steps, n_saves = np.frombuffer(blob, np.int32, 3).tolist()
    a = 3 + 3 * n_new
    b = a + 3 * n_steps
    cnt = b + n_saves
    head = np.frombuffer(blob, np.int32, cnt)
    new_names, new_roots, refs = blob[4 * cnt:].decode().split("\x02")
    new_names = new_names.split("\x01") if n_new else []
    new_roots = new_roots.split("\x01") if n_new else []
    refs = refs.split("\x01") if n_steps else []
    templates = {}
    made = [cast_node(templates, src_t, dst_t, nodes[si].device, cname, root, g.blank_node)
            for (si, src_t, dst_t), cname, root in zip(head[3:a].reshape(-1, 3).tolist(), new_names, new_roots)]
    pp.casts_inserted += len(made)
    pp.new_casts.extend(new_names)
    pp._cast_plan = (painter, names, new_names)
    if shapes is not None:
        for cname, root in zip(new_names, new_roots):
            shapes.alias(cname, root)
    nget = names.__getitem__
    pp._before.save_all(list(map(nget, head[b:cnt].tolist())))
    if n_steps:
        st = head[a:b].reshape(-1, 3)
        made.append(None)  # (index -1: no new node)
        new_roots.append(None)
        at = st[:, 0].tolist()
        g.add_and_rewire(list(zip(map(made.__getitem__, at), map(nget, st[:, 1].tolist()),
                                  st[:, 2].tolist(), refs)),
                         only_inputs=list(map(new_roots.__getitem__, at)))  # (a cast reads its root)
    return True


def delay_plan(pp):
    """(issue 17, the C++ core's milestone 2) ``_delay_widening_casts``' loop
    by the C++ painter whose plan inserted the casts (``pp._cast_plan``, see
    :func:`fix_edges`; custom_ops/precision_paint.cc ``CastPlan::Delay``):
    ``(plan, forward)``, ``plan`` the ``(cast, producers it waits for)``
    pairs in the reference's order and ``forward`` whether every edge into
    and out of those casts goes forward in the Kahn order so updated
    (``PrecisionPass._forward_at``); or None (the caller runs the
    reference): no such plan, a graph edited since other than by it, a cycle.
    The positions are the graph's Kahn order (``Graph.kahn_positions``) by
    node id, mapped to the painted nodes and the new casts."""
    painter, names, new_names = pp._cast_plan
    g = pp.g
    if len(g.nodes) != len(names) + len(new_names):
        return None
    by_id = g.kahn_positions()
    if by_id is None:
        return None
    try:
        ids = g.ids_of(names + new_names)  # (the ids the sort numbers nodes by)
    except KeyError:
        return None
    pos = by_id[ids]
    if (pos < 0).any():
        return None
    blob = painter.delay_plan(np.ascontiguousarray(pos, np.int32))
    if blob is None:
        return None
    a = np.frombuffer(blob, np.int32).tolist()
    n = len(names)
    plan, at = [], 1
    while at < len(a):
        j, k = a[at], a[at + 1]
        plan.append((new_names[j], [names[w] if w < n else new_names[w - n] for w in a[at + 2:at + 2 + k]]))
        at += 2 + k
    DELAY_PLANS[0] += 1
    return plan, bool(a[0])


#: how many delay plans the C++ painter made (:func:`delay_plan`; for tests)
DELAY_PLANS = [0]


def _fail(name):
    from ..errors import GraphError

    raise GraphError(f"native painting returned no reason for '{name}'")


__all__ = ["paint", "fix_edges", "delay_plan", "MIX_MODES", "OUT_WIDTH"]
