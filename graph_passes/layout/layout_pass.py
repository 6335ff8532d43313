"""The ``layout`` pass: GE's NC1HWC0 ("5HD") layout, emulated on a TF graph.

Preconditions: 4-D activations are NHWC with static shapes (``_output_shapes``
or TensorFlow's shape inference); ``TransData`` need not be registered for the
rewrite, only for running the result (``import npu_amp_tf.ops``).

Postconditions:

* heavy ops (``op_lists.HEAVY``: conv and its backprops, depthwise conv,
  pooling, FusedBatchNorm*) are in 5HD; the format spreads forward and
  backward through format-agnostic ops; BiasAdd and per-channel operands
  become per-channel 5HD operands;
* one ``TransData`` at each boundary between a 5HD region and the original
  layout (named after its source: ``<src>/TransData_NHWC_to_NC1HWC0``,
  ``<op>/TransData_NC1HWC0_to_NHWC``), one ``<w>/TransData_HWCN_to_FRACTAL_Z``
  per filter tensor read, and ``<g>/TransData_FRACTAL_Z_to_HWCN`` for each
  filter gradient (so the FP32 master update sees HWCN);
* zero padding lanes never reach an op for which 0 is not neutral
  (``op_lists.PADDING_UNSAFE``: Log, division, channel reductions, softmax);
* the graph runs on CPU and computes what it computed before: a heavy op is
  *lowered* (it keeps its name and runs in NHWC between internal TransData
  marked ``_npu_lowering``); elementwise ops run natively on 5-D tensors;
  BiasAdd becomes AddV2 with a per-channel 5HD bias; Pad gets 5-D paddings.

Algorithm: colour ops (seed heavy ops, spread to a fixpoint), put a TransData
on *every* edge into and out of every 5HD op, then remove inverse pairs
(symmetry elimination) and merge sibling TransData reading the same tensor
(breadth fusion).  Running it again on its own output changes nothing.

    x ─ Conv2D ─ BiasAdd ─ Relu ─ Mean            (origin)

    x ─ TD(NHWC→5HD) ─ Conv2D* ─ AddV2(b: TD(C→5HD)) ─ Relu ─ TD(5HD→NHWC) ─ Mean
    w ─ TD(HWCN→FRACTAL_Z) ─┘                 (* lowered: TD in, Conv2D, TD out)
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, tensor_pb2

from .. import registry
from .. import shapes as _shapes
from ..graph import parse_tensor, tensor_name
from ..manager import Pass, register_pass
from . import align, formats, op_lists

FMT_5HD = "NC1HWC0"
LOWERING_ATTR = "_npu_lowering"


def td_name(src_ref: str, s: str, d: str) -> str:
    node, port, _ = parse_tensor(src_ref)
    return f"{node}/TransData_{s}_to_{d}" + (f"_{port}" if port else "")


def classify_transdata(node) -> str:
    """'activation' | 'filter' | 'per_channel' | 'lowering' for a TransData node."""
    if LOWERING_ATTR in node.attr and node.attr[LOWERING_ATTR].b:
        return "lowering"
    s, d = node.attr["src_format"].s.decode(), node.attr["dst_format"].s.decode()
    if "FRACTAL_Z" in (s, d):
        return "filter"
    if "C" in (s, d):
        return "per_channel"
    return "activation"


def transdata_counts(graph) -> dict:
    counts = {"activation": 0, "filter": 0, "per_channel": 0, "lowering": 0}
    for n in graph.nodes.values():
        if n.op == "TransData":
            counts[classify_transdata(n)] += 1
    return counts


def graph_shapes(graph, warn=None) -> dict:
    """name -> [shape per output] of the graph as it is now (``_output_shapes``,
    else grappler's inference through :class:`graph_passes.shapes.ShapeTable`).

    Nodes whose shapes stay unknown (TF refused the graph: unknown ops, broken
    function bodies) keep their original layout; ``warn(message)`` is told
    which, and why, so the report says it instead of a silent no-op.
    """
    table = _shapes.ShapeTable(graph)
    shapes = table.as_dict()
    if warn is not None:
        unknown = sorted(k for k, n in graph.nodes.items()
                         if k not in shapes and graph.output_dtypes(n) != [])
        if unknown:
            warn(f"shape inference left {len(unknown)} node(s) without shapes (e.g. "
                 f"{', '.join(unknown[:3])})" + (f": {table.error}" if table.error else
                                                  ": TensorFlow could not infer them") +
                 "; those nodes and the heavy ops they feed keep their original layout")
    return shapes


class _Ctx:
    def __init__(self, graph, shapes):
        self.g = graph
        self.shapes = shapes

    def shape(self, ref):
        return _shapes.tensor_shape(self.shapes, ref)

    def dtype_name(self, ref):
        dt = self.g.tensor_dtype(ref)
        if dt is None:
            return None
        return registry.dtype_name(registry.base_dtype(dt))


def _is_act(shape) -> bool:
    return shape is not None and len(shape) == 4 and shape[3] is not None and shape[3] > 0


def _same_act(a, b) -> bool:
    return (_is_act(a) and _is_act(b) and
            all(x == y or x < 0 or y < 0 for x, y in zip(a, b)) and a[3] == b[3])


def _per_channel(shape, c) -> bool:
    return (shape is not None and len(shape) >= 1 and shape[-1] == c and
            all(d == 1 for d in shape[:-1]) and len(shape) <= 4)


def _scalar_like(shape) -> bool:
    return shape is not None and all(d == 1 for d in shape) and len(shape) <= 4


_const_value = _shapes.const_value


@register_pass("layout")
class LayoutPass(Pass):
    """See the module docstring."""

    def run(self, graph, ctx):
        mode = ctx.option("format_mode", "origin")
        if mode != FMT_5HD:
            return {"skipped": f"format_mode={mode!r}"}
        if any(n.op == "TransData" for n in graph.nodes.values()):
            # already rewritten (grappler calls us again): idempotent no-op
            stats = self._publish(graph, ctx, None)
            stats["already_converted"] = True
            return stats
        self.g = graph
        self.ctx = ctx
        self.c = _Ctx(graph, graph_shapes(graph, warn=ctx.warn))
        self.plan: dict[str, tuple[dict, dict]] = {}   # node -> (input roles, output roles)
        self.origin_reason: dict[str, str] = {}
        waste = align.analyze_graph(graph, self.c.shapes)
        self._colour()
        if not self.plan:
            stats = self._publish(graph, ctx, waste)
            stats["ops_nc1hwc0"] = 0
            return stats
        naive = self._insert_everywhere()
        eliminated = self._symmetry_elimination()
        merged = self._breadth_fusion()
        var_fz = self._variable_format() if ctx.option("variable_format_optimize", False) else 0
        self._lower()
        stats = self._publish(graph, ctx, waste)
        stats.update({"transdata_naive": naive, "transdata_eliminated": eliminated,
                      "transdata_merged": merged, "variables_fractal_z": var_fz})
        ctx.report.summary.update({"transdata_before_elimination": naive,
                                   "transdata_eliminated": eliminated,
                                   "transdata_merged": merged,
                                   "variables_fractal_z": var_fz})
        return stats

    # ------------------------------------------------------------ colouring
    def _act_ok(self, ref):
        s = self.c.shape(ref)
        if not _is_act(s):
            return False, f"input '{ref}' is not a 4-D tensor with a known channel dim (shape {s})"
        dt = self.c.dtype_name(ref)
        if dt not in op_lists.TRANSDATA_DTYPES:
            return False, f"dtype {dt} of '{ref}' has no NC1HWC0 layout"
        return True, ""

    def _heavy_plan(self, node):
        spec = op_lists.HEAVY[node.op]
        fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
        if fmt != "NHWC":
            return None, f"data_format {fmt}: only NHWC graphs are rewritten"
        data = [i for i in node.input[:] if not i.startswith("^")]
        ins, outs = {}, {}
        for i in spec.act_in:
            if i >= len(data):
                return None, "unexpected arity"
            ok, why = self._act_ok(data[i])
            if not ok:
                return None, why
            ins[i] = "act"
        for i in spec.filter_in:
            s = self.c.shape(data[i])
            if s is None or len(s) != 4 or min(s) < 1 or self.c.dtype_name(data[i]) not in op_lists.TRANSDATA_DTYPES:
                return None, f"filter '{data[i]}' needs a fully known 4-D shape (got {s})"
            ins[i] = "filter"
        own = self.c.shapes.get(node.name) or []
        for p in spec.act_out:
            if p >= len(own) or not _is_act(own[p]):
                return None, f"output {p} has no known 4-D shape"
            outs[p] = "act"
        for p in spec.filter_out:
            if p >= len(own) or own[p] is None or len(own[p]) != 4 or min(own[p]) < 1:
                return None, f"filter gradient {p} has no fully known shape"
            outs[p] = "filter"
        return (ins, outs), spec.reason

    def _agnostic_plan(self, node):
        """(input roles, output roles) when the op can run in 5HD, else (None, reason)."""
        op = node.op
        if node.name in self.ctx.protected:
            return None, "fetched/preserved: keeps its original layout"
        if op in op_lists.PADDING_UNSAFE:
            return None, "padding hazard: " + op_lists.PADDING_UNSAFE[op]
        known = (op in op_lists.UNARY or op in op_lists.SAME_SHAPE or op in op_lists.BROADCAST or
                 op in op_lists.DIVISION or op in op_lists.PAD)
        if not known:
            return None, op_lists.LAYOUT_BOUND.get(op, "not format-agnostic (not in the layout lists)")
        own = self.c.shapes.get(node.name)
        if not own or not _is_act(own[0]):
            return None, "output is not a 4-D activation with a known channel dim"
        out_shape = own[0]
        out_dt = registry.dtype_name(registry.base_dtype((self.g.output_dtypes(node) or [0])[0] or 0)) \
            if self.g.output_dtypes(node) else None
        if out_dt not in op_lists.TRANSDATA_DTYPES:
            return None, f"dtype {out_dt} has no NC1HWC0 layout"
        c0 = formats.c0_for(out_dt)
        data = [i for i in node.input[:] if not i.startswith("^")]
        ins = {}
        if op == "BiasAdd":
            if node.attr["data_format"].s.decode() not in ("", "NHWC"):
                return None, "BiasAdd in NCHW"
        for k, ref in enumerate(data):
            s = self.c.shape(ref)
            if op in op_lists.PAD and k > 0:
                if k == 1:
                    pads = _const_value(self.g, ref)
                    if pads is None or pads.shape != (4, 2) or pads[3].any():
                        return None, "paddings not constant or the channel dim is padded"
                elif not _scalar_like(s):
                    return None, "constant_values not a scalar"
                continue
            if op in op_lists.PAD and k == 0:
                if not (_is_act(s) and s[3] == out_shape[3]):
                    return None, "input is not a 4-D activation"
                ins[k] = "act"
                continue
            if op in op_lists.DIVISION and k == 1:
                if not _scalar_like(s):
                    return None, "padding hazard: division by a non-scalar (x/0 on padding lanes)"
                continue
            if _same_act(s, out_shape):
                dt = self.c.dtype_name(ref)
                if dt not in op_lists.TRANSDATA_DTYPES or formats.c0_for(dt) != c0:
                    return None, f"input dtype {dt} has another C0"
                ins[k] = "act"
            elif op in op_lists.BROADCAST and _per_channel(s, out_shape[3]):
                ins[k] = "chan"
            elif _scalar_like(s) and (op in op_lists.BROADCAST or op in op_lists.DIVISION):
                continue
            else:
                return None, f"operand '{ref}' of shape {s} is neither same-shape, per-channel nor scalar"
        if not ins or all(r != "act" for r in ins.values()):
            return None, "no activation operand"
        reason = (op_lists.UNARY.get(op) or op_lists.SAME_SHAPE.get(op) or op_lists.BROADCAST.get(op)
                  or op_lists.PAD.get(op) or "division by a scalar")
        return (ins, {0: "act"}), "format-agnostic: " + reason

    def _colour(self):
        g = self.g
        order = g.topo_order()
        cand = {}
        for name in order:
            node = g.nodes[name]
            if node.op in op_lists.HEAVY:
                plan, why = self._heavy_plan(node)
                if plan is None:
                    self.origin_reason[name] = why
                    self.ctx.report.decide(name, format="origin", layout_reason=why)
                else:
                    self.plan[name] = plan
                    self.ctx.report.decide(name, format=FMT_5HD, layout_reason=why)
            elif node.op in op_lists.UNARY or node.op in op_lists.SAME_SHAPE or node.op in op_lists.BROADCAST \
                    or node.op in op_lists.DIVISION or node.op in op_lists.PAD:
                plan, why = self._agnostic_plan(node)
                if plan is None:
                    self.origin_reason[name] = why
                else:
                    cand[name] = (plan, why)
        changed = True
        while changed:
            changed = False
            for name in order:                      # forward
                if name in cand and name not in self.plan and self._feeds_from_5hd(name, cand[name][0][0]):
                    self._adopt(name, cand[name], "spreads forward")
                    changed = True
            for name in reversed(order):            # backward
                if name in cand and name not in self.plan and self._feeds_5hd(name, cand[name][0][0]):
                    self._adopt(name, cand[name], "spreads backward")
                    changed = True
        for name in cand:
            if name not in self.plan:
                self.ctx.report.decide(name, format="origin",
                                       layout_reason="format-agnostic but no 5HD neighbour")
        for name, node in self.g.nodes.items():      # boundaries: say why the format stops
            if name in self.plan or name in cand or not self._touches_5hd(name):
                continue
            why = self.origin_reason.get(name) or (
                "padding hazard: " + op_lists.PADDING_UNSAFE[node.op] if node.op in op_lists.PADDING_UNSAFE
                else op_lists.LAYOUT_BOUND.get(node.op, "needs its original layout (not format-agnostic)"))
            self.ctx.report.decide(name, format="origin", layout_reason=why)

    def _adopt(self, name, cand, how):
        plan, why = cand
        self.plan[name] = plan
        self.ctx.report.decide(name, format=FMT_5HD, layout_reason=f"{why} ({how})")

    def _producer_5hd(self, ref, role="act"):
        src, port, _ = parse_tensor(ref)
        p = self.plan.get(src)
        return p is not None and p[1].get(port) == role

    def _feeds_from_5hd(self, name, ins):
        node = self.g.nodes[name]
        return any(r == "act" and self._producer_5hd(node.input[k]) for k, r in ins.items())

    def _feeds_5hd(self, name, ins):
        node = self.g.nodes[name]
        outside = sum(1 for k, r in ins.items() if r == "act" and not self._producer_5hd(node.input[k]))
        if outside > 1:
            return False
        cons = self.g.consumers(name, port=0)
        if not cons:
            return False
        for cname, idx in cons:
            p = self.plan.get(cname)
            if p is None or p[0].get(idx) != "act":
                return False
        return True

    def _touches_5hd(self, name):
        node = self.g.nodes[name]
        if any(self._producer_5hd(i) for i in node.input[:] if not i.startswith("^")):
            return True
        return any(c in self.plan for c, i in self.g.consumers(name, control=False))

    # ------------------------------------------------------------ insertion
    def _td_attrs(self, dtype_ref, s, d, orig=(), dtype=None):
        dt = dtype if dtype is not None else self.g.tensor_dtype(dtype_ref)
        attrs = {"T": attr_value_pb2.AttrValue(type=registry.base_dtype(dt)),
                 "src_format": s, "dst_format": d,
                 "orig_shape": attr_value_pb2.AttrValue(
                     list=attr_value_pb2.AttrValue.ListValue(i=[int(x) for x in orig]))}
        return attrs

    def _orig_of(self, ref, role):
        s = self.c.shape(ref)
        if role == "chan":
            return list(s)
        if role == "filter":
            return list(s)
        return [d if d is not None and d >= 0 else -1 for d in s]

    def _insert_everywhere(self):
        """One TransData on every edge out of and into every 5HD op."""
        g = self.g
        made = 0
        order = [n for n in g.topo_order() if n in self.plan]
        self._orig_in = {}    # (node, input index) -> (original ref, shape, dtype)
        for name in order:
            node = g.nodes[name]
            for idx in self.plan[name][0]:
                ref = node.input[idx]
                self._orig_in[(name, idx)] = (ref, self.c.shape(ref), g.tensor_dtype(ref))
        # outputs first: every consumer edge of a 5HD output reads a TransData back
        for name in order:
            _, outs = self.plan[name]
            for port, role in sorted(outs.items()):
                ref = tensor_name(name, port)
                s, d = (FMT_5HD, "NHWC") if role == "act" else ("FRACTAL_Z", "HWCN")
                orig = self._orig_of(ref, "act" if role == "act" else "filter")
                for k, (cname, idx) in enumerate(sorted(g.consumers(name, port=port))):
                    tmp = g.unique_name(f"{td_name(ref, s, d)}/edge{k}")
                    g.insert_on_edge(cname, idx, "TransData", tmp, self._td_attrs(ref, s, d, orig))
                    made += 1
        # inputs: every 5HD input edge converts from the original layout
        for name in order:
            ins, _ = self.plan[name]
            node = g.nodes[name]
            for idx, role in sorted(ins.items()):
                oref, oshape, odt = self._orig_in[(name, idx)]
                s, d = {"act": ("NHWC", FMT_5HD), "chan": ("C", FMT_5HD),
                        "filter": ("HWCN", "FRACTAL_Z")}[role]
                orig = list(oshape) if role != "act" else [x if x is not None and x >= 0 else -1 for x in oshape]
                tmp = g.unique_name(f"{name}/in{idx}/TransData_{s}_to_{d}")
                g.insert_on_edge(name, idx, "TransData", tmp, self._td_attrs(oref, s, d, orig, odt))
                made += 1
        return made

    def _symmetry_elimination(self):
        """TD(a->b) reading TD(b->a): the consumer reads the first TD's input."""
        g = self.g
        removed = 0
        for name in list(g.nodes):
            t2 = g.nodes.get(name)
            if t2 is None or t2.op != "TransData":
                continue
            t1 = g.nodes.get(parse_tensor(t2.input[0])[0])
            if t1 is None or t1.op != "TransData":
                continue
            pair = (t1.attr["src_format"].s, t1.attr["dst_format"].s)
            if pair != (t2.attr["dst_format"].s, t2.attr["src_format"].s):
                continue
            if t1.attr["T"].type != t2.attr["T"].type:
                continue
            g.replace_all_uses(name, t1.input[0])
            g.remove_node(name)
            removed += 1
            if not g.consumers(t1.name):
                g.remove_node(t1.name)
                removed += 1
        return removed

    def _breadth_fusion(self):
        """Sibling TransData with the same input and attrs become one, named after the source."""
        g = self.g
        groups = defaultdict(list)
        for name, n in g.nodes.items():
            if n.op == "TransData":
                key = (n.input[0], n.attr["src_format"].s, n.attr["dst_format"].s, n.attr["T"].type,
                       tuple(n.attr["orig_shape"].list.i[:]))
                groups[key].append(name)
        merged = 0
        for key, names in sorted(groups.items(), key=lambda kv: sorted(kv[1])[0]):
            names.sort()
            keep = names[0]
            for other in names[1:]:
                g.replace_all_uses(other, keep)
                g.remove_node(other)
                merged += 1
            ref, s, d = key[0], key[1].decode(), key[2].decode()
            final = g.unique_name(td_name(ref, s, d)) if td_name(ref, s, d) != keep else keep
            if final != keep:
                old = g.nodes[keep]
                new = g.new_node("TransData", final, old.input[:], dict(old.attr.items()),
                                 device=old.device)
                g.replace_all_uses(keep, new.name)
                g.remove_node(keep)
        return merged

    # ------------------------------------------------------------ variables
    def _variable_format(self):
        """CANN's variable format optimisation: a VarHandleOp read only as a conv
        filter and updated by plain SGD is stored in FRACTAL_Z (its initializer
        converts once; reads and updates need no TransData)."""
        g = self.g
        done = 0
        for name, var in list(g.nodes.items()):
            if var.op != "VarHandleOp":
                continue
            reads, assigns, applies, other = [], [], [], []
            for cname, idx in g.consumers(name, control=False):
                cop = g.nodes[cname].op
                if cop == "VarIsInitializedOp":
                    continue
                (reads if cop == "ReadVariableOp" else assigns if cop == "AssignVariableOp"
                 else applies if cop == "ResourceApplyGradientDescent" and idx == 0 else other).append(cname)
            if other or not reads or not applies:
                continue
            read_tds, plain_reads = [], []
            ok = True
            for r in reads:
                for cname, cidx in g.consumers(r, port=0):
                    cn = g.nodes[cname]
                    if cn.op == "TransData" and cn.attr["dst_format"].s == b"FRACTAL_Z":
                        read_tds.append(cname)
                    else:
                        plain_reads.append((r, cname, cidx))
            grads = []
            for a in applies:
                gsrc = g.nodes.get(parse_tensor(g.nodes[a].input[2])[0])
                while gsrc is not None and gsrc.op == "Identity" and len(g.consumers(gsrc.name, control=False)) == 1:
                    gsrc = g.nodes.get(parse_tensor(gsrc.input[0])[0])
                if gsrc is None or gsrc.op != "TransData" or gsrc.attr["src_format"].s != b"FRACTAL_Z" \
                        or len(g.consumers(gsrc.name, control=False)) != 1:
                    ok = False
                else:
                    grads.append((a, gsrc))
            if not ok or not read_tds:
                continue
            shape = [d.size for d in var.attr["shape"].shape.dim[:]]
            dt = registry.dtype_name(var.attr["dtype"].type)
            if len(shape) != 4 or min(shape) < 1 or dt not in op_lists.TRANSDATA_DTYPES:
                continue
            fz = formats.fractal_z_shape(shape, dt)
            del var.attr["shape"].shape.dim[:]
            for d in fz:
                var.attr["shape"].shape.dim.add().size = d
            if "_output_shapes" in var.attr:
                del var.attr["_output_shapes"]
            for t in read_tds:
                g.replace_all_uses(t, g.nodes[t].input[0])
                if not g.consumers(t):
                    g.remove_node(t)
            for a, gsrc in grads:
                g.replace_all_uses(gsrc.name, gsrc.input[0])
                if not g.consumers(gsrc.name):
                    g.remove_node(gsrc.name)
            back = {}
            for r, cname, cidx in plain_reads:   # other readers (savers, user fetches) still see HWCN
                if r not in back:
                    back[r] = g.new_node(
                        "TransData", g.unique_name(td_name(r, "FRACTAL_Z", "HWCN")), [r],
                        self._td_attrs(r, "FRACTAL_Z", "HWCN", shape, var.attr["dtype"].type),
                        device=g.nodes[r].device).name
                g.set_input(cname, cidx, back[r])
            for a in assigns:   # initializers: convert the HWCN initial value once
                vref = g.nodes[a].input[1]
                tname = g.unique_name(td_name(vref, "HWCN", "FRACTAL_Z"))
                g.insert_on_edge(a, 1, "TransData", tname,
                                 self._td_attrs(vref, "HWCN", "FRACTAL_Z", shape))
            self.ctx.report.decide(name, format="FRACTAL_Z",
                                   layout_reason="variable_format_optimize: stored in FRACTAL_Z, "
                                                 "read by conv only, updated by SGD")
            done += 1
        return done

    # ------------------------------------------------------------- lowering
    def _lowering_td(self, name, ref, s, d, orig, dtype):
        attrs = self._td_attrs(ref, s, d, orig, dtype)
        attrs[LOWERING_ATTR] = attr_value_pb2.AttrValue(b=True)
        return self.g.new_node("TransData", self.g.unique_name(name), [ref], attrs,
                               device=self.g.nodes[parse_tensor(ref)[0]].device)

    def _lower(self):
        g = self.g
        for name in [n for n in g.topo_order() if n in self.plan]:
            node = g.nodes[name]
            ins, outs = self.plan[name]
            if node.op in op_lists.HEAVY:
                orig_node_shapes = self.c.shapes.get(name)
                out_dts = g.output_dtypes(node)
                for idx, role in sorted(ins.items()):
                    ref = node.input[idx]
                    _, oshape, odt = self._orig_in[(name, idx)]
                    if role == "act":
                        orig = [x if x is not None and x >= 0 else -1 for x in oshape]
                        t = self._lowering_td(f"{name}/Lowered/in{idx}/TransData_NC1HWC0_to_NHWC",
                                              ref, FMT_5HD, "NHWC", orig, odt)
                    else:
                        t = self._lowering_td(f"{name}/Lowered/in{idx}/TransData_FRACTAL_Z_to_HWCN",
                                              ref, "FRACTAL_Z", "HWCN", list(oshape), odt)
                    g.set_input(name, idx, t.name)
                for port, role in sorted(outs.items()):
                    ref = tensor_name(name, port)
                    cons = g.consumers(name, port=port)
                    if not cons:
                        continue
                    if role == "act":
                        t = self._lowering_td(f"{name}/Lowered/out{port}/TransData_NHWC_to_NC1HWC0",
                                              ref, "NHWC", FMT_5HD, [], out_dts[port])
                    else:
                        t = self._lowering_td(f"{name}/Lowered/out{port}/TransData_HWCN_to_FRACTAL_Z",
                                              ref, "HWCN", "FRACTAL_Z", orig_node_shapes[port], out_dts[port])
                    for cname, idx in cons:
                        if cname != t.name:
                            g.set_input(cname, idx, t.name)
            elif node.op == "BiasAdd":
                g.set_op(name, "AddV2")
                if "data_format" in node.attr:
                    del node.attr["data_format"]
            elif node.op in op_lists.PAD:
                pads = _const_value(g, node.input[1])
                p5 = np.zeros((5, 2), dtype=pads.dtype)
                p5[0], p5[2], p5[3] = pads[0], pads[1], pads[2]
                tp = tensor_pb2.TensorProto()
                tp.CopyFrom(tf.make_tensor_proto(p5))
                cname = g.unique_name(f"{name}/paddings_NC1HWC0")
                g.new_node("Const", cname, [], {"dtype": attr_value_pb2.AttrValue(type=tp.dtype),
                                                "value": attr_value_pb2.AttrValue(tensor=tp)},
                           device=node.device)
                g.set_input(name, 1, cname)
            if "_output_shapes" in node.attr and node.op not in op_lists.HEAVY:
                del node.attr["_output_shapes"]   # now 5-D; let TF infer

    # ------------------------------------------------------------- report
    def _publish(self, graph, ctx, waste):
        counts = transdata_counts(graph)
        by_op = defaultdict(lambda: defaultdict(int))
        n5 = 0
        plan = getattr(self, "plan", {})
        for name, n in graph.nodes.items():
            if n.op == "TransData":
                continue
            in5 = name in plan
            n5 += in5
            if in5 or n.op in op_lists.HEAVY:
                by_op[n.op][FMT_5HD if in5 else "origin"] += 1
        summary = {
            "transdata_activation": counts["activation"],
            "transdata_filter": counts["filter"],
            "transdata_per_channel": counts["per_channel"],
            "transdata_lowering": counts["lowering"],
            "formats_by_op": {k: dict(v) for k, v in sorted(by_op.items())},
        }
        if waste is not None:
            summary["padding_waste_flops"] = waste["total_padding_waste_flops"]
            summary["padded_flops"] = waste["total_padded_flops"]
            summary["unaligned_items"] = len(waste["items"])
        ctx.report.summary.update(summary)
        stats = {k: v for k, v in summary.items() if k != "formats_by_op"}
        stats["ops_nc1hwc0"] = n5
        return stats
