"""Level-2 fusion rule ``batch_norm_moments``: a training batch norm written as
moments + arithmetic (Keras 3's ``BatchNormalization``, ``tf.nn.moments`` +
``tf.nn.batch_normalization`` in hand-written TF1 / TF-Slim-style scripts)
becomes ``FusedBatchNormV3(is_training=True)``, and its autodiff gradient region
one ``FusedBatchNormGradV3``.

Why: in BF16 the convs get 2-6x faster, but the ~10 Eigen elementwise and
reduction kernels of such a batch norm (forward Mean, SquaredDifference, Mean,
Mul, Sub, AddV2; backward Mul, Sum, Tile, RealDiv, Sub, AddN) get *slower* than
FP32's (Keras 3 ResNet-50 ``train_on_batch``, TF 2.21: BF16 Mul 2-3x FP32's
time, together about half of the BF16 step).  oneDNN runs the fused forward
and backward in BF16 in one pass each (``registry.BN_FUSED_FORMS``, measured).

Before / after (NHWC, statistics over N, H, W)::

    x ─┬─ Mean ─ Squeeze ─ mean ──────────────────┬─ Mul(1-m) ─ moving mean update
       ├─ SquaredDifference(x, StopGradient(Mean)) ─ Mean ─ Squeeze ─ var ─┬─ Mul(1-m) ─ ...
       │                                                     var + eps ─ Rsqrt ─ *gamma = inv
       └─ x*inv + (beta - mean*inv) ─ y
    dy ─ [Sum, Mul, Neg, RsqrtGrad, Tile, RealDiv, Sub, AddN ...] ─ dx, dgamma, dbeta

    x, gamma, beta ─ FusedBatchNormV3(training) ─ y
                              ├─ :1 batch mean ─────────────── Mul(1-m) ─ moving mean update
                              └─ :2 batch variance * (n-1)/n ─ Mul(1-m) ─ ...
    dy, x, gamma, :3, :4, :5 ─ FusedBatchNormGradV3 ─ dx, dgamma, dbeta

``FusedBatchNormV3``'s output 2 (batch variance) is Bessel-corrected
(``sum((x-mean)^2) / (n-1)``) while ``tf.nn.moments`` gives ``/ n``; measured on
TF 2.15.1 and 2.21.0, oneDNN on and off (``registry.BN_FUSED_FORMS``), so the
moving-variance update reads output 2 times ``(n-1)/n`` (one FP32 rounding of a
[C] vector).  The forward value and the gradient are the same functions (the
moments' StopGradient on the mean changes no value: the variance's derivative
with respect to the mean is ``-2 * mean(x - mean) = 0``); only the summation
order and where BF16 rounds differ.

Fires where it is measured to pay (``benchmarks/bn_forms.py``: the fused pair is
1.9-3.9x faster than the moments form in FP32 and BF16 with oneDNN on, 1.2-2.1x
with it off, TF 2.15.1 and 2.21.0): CPU, the batch norm running FP32 or BF16
(FP16 is not measured: refused, reason recorded).  Conditions (each refusal has
a reason in the report): rank-4 input with static H, W, C (a dynamic batch, as
``model.fit`` traces, is fine: the variance's (n-1)/n then comes from
``Size(x)`` at run time), statistics over axes (0, 1, 2) (NHWC; Keras'
``axis=-1`` or ``axis=3``), gamma and beta FP32 vectors of the channel size (or
absent), a constant epsilon; in a training graph the backward region must be
exactly the batch norm's gradient (``grad_region.find_grad_region``), and every
other reader of
the batch statistics (the moving averages) is re-emitted reading the fused op's.
"""
from __future__ import annotations

import numpy as np

from .. import registry
from ..graph import parse_tensor, tensor_name
from ..pattern import Pat
from .builtin import _precision_plan, _squeeze_lead, const_scalar, reemit_aggregator, with_add_readers
from .core import Skip, const_value

_ADDS = ("Add", "AddV2")


def _src(graph, ref):
    name, port, ctrl = parse_tensor(ref)
    return None if ctrl or port != 0 else graph.nodes.get(name)


def _canon(ref):
    n, p, c = parse_tensor(ref)
    return ("^" + n) if c else (n if p == 0 else f"{n}:{p}")


def _stat(graph, ref):
    """``[Reshape] [Squeeze] Mean(t, axes, keep_dims=True)`` (Keras reshapes the statistics
    to [1, 1, 1, C] for an explicit ``axis=3``) -> (t, axes_ref, mean_node, chain), chain =
    the nodes from the Mean up to ``ref``'s producer."""
    node = _src(graph, ref)
    chain = []
    for op in ("Reshape", "Squeeze"):
        if node is not None and node.op == op:
            chain.append(node)
            node = _src(graph, graph.data_inputs(node)[0])
    if node is None or node.op != "Mean" or not node.attr["keep_dims"].b:
        return None
    t, axes = graph.data_inputs(node)
    return t, axes, node, [node] + chain[::-1]


def analyze_batch_norm(graph, anchor):
    """The structural match, or None::

        anchor = Add(xinv, shift)           (or, after grappler's AddOpsRewrite spread the
                                             adds of a residual unit over AddN trees: the
                                             anchor is xinv, and xinv and shift are summands
                                             of one sum: "split")
        xinv   = Mul(x, inv)
        shift  = Sub(beta, Mul(mean, inv)) | Neg(Mul(mean, inv)) | Mul(Neg(mean), inv)
        inv    = Mul(Rsqrt(Add(var, eps)), gamma) | Rsqrt(Add(var, eps))
        mean   = [Reshape] [Squeeze] Mean(x, axes, keep_dims)
        var    = [Reshape] [Squeeze] Mean(SquaredDifference(x, [StopGradient] Mean(x)), axes, keep_dims)
        gamma, beta: a [C] vector, or a Reshape of one to [1, 1, 1, C] (Keras, ``axis=3``)
    """
    if anchor.op in _ADDS:
        ins = graph.data_inputs(anchor)
        if len(ins) != 2:
            return None
        for t1, t2 in ((ins[0], ins[1]), (ins[1], ins[0])):
            xinv, shift = _src(graph, t1), _src(graph, t2)
            res = _core(graph, xinv, shift)
            if res is not None:
                res["inner"] = [anchor.name] + res["inner"]
                res["split"] = None
                return res
        return None
    if anchor.op != "Mul":
        return None
    # the split form: find shift through inv's other readers
    for inv_ref in graph.data_inputs(anchor):
        for cname, _ in graph.consumers(parse_tensor(inv_ref)[0]):
            minv = graph.nodes[cname]
            if cname == anchor.name or minv.op != "Mul":
                continue
            cands = [minv] + [graph.nodes[c] for c, i in graph.consumers(cname) if i >= 0]
            for shift in cands:
                res = _core(graph, anchor, shift)
                if res is None:
                    continue
                sx, ss = _sum_chain(graph, anchor.name), _sum_chain(graph, shift.name)
                if not sx or not ss:
                    return None
                if sx[0] == ss[0] and graph.nodes[sx[0]].op in _ADDS:
                    return None  # Add(xinv, shift): the Add is the anchor
                if not set(sx) & set(ss):
                    return None  # not summands of one sum
                res["split"] = shift.name
                return res
    return None


def _sum_chain(graph, name):
    """The Add/AddV2/AddN nodes ``name`` flows through as a plain summand, each the only
    reader of the one before; [] when ``name`` has another reader."""
    out, cur = [], name
    while len(out) < 64:
        cons = graph.consumers(cur)
        if len(cons) != 1 or cons[0][1] < 0:
            break
        c = graph.nodes[cons[0][0]]
        if c.op not in _ADDS + ("AddN",):
            break
        out.append(c.name)
        cur = c.name
    return out


def _core(graph, xinv, shift):
    """The batch norm whose x*inv is ``xinv`` and whose shift is ``shift``, or None."""
    if xinv is None or xinv.op != "Mul" or shift is None or shift.op not in ("Sub", "Neg", "Mul"):
        return None
    sins = graph.data_inputs(shift)
    # beta - mean*inv | -(mean*inv) | (-mean)*inv (tf.nn.batch_normalization without offset)
    beta, minv_ref = (sins[0], sins[1]) if shift.op == "Sub" else (None, sins[0])
    minv = shift if shift.op == "Mul" else _src(graph, minv_ref)
    if minv is None or minv.op != "Mul" or minv is xinv:
        return None
    xi, mi = graph.data_inputs(xinv), graph.data_inputs(minv)
    for k in (0, 1):
        inv_ref, x = xi[k], xi[1 - k]
        if inv_ref not in mi or inv_ref == x:
            continue
        mean_ref = mi[1 - mi.index(inv_ref)]
        neg = []
        if shift.op == "Mul":
            nn_ = _src(graph, mean_ref)
            if nn_ is None or nn_.op != "Neg":
                continue
            neg, mean_ref = [nn_.name], graph.data_inputs(nn_)[0]
        res = _inv(graph, inv_ref)
        if res is None:
            continue
        var_ref, eps, gamma, inv_inner = res
        m = _stat(graph, mean_ref)
        v = _stat(graph, var_ref)
        if m is None or v is None or m[0] != x:
            continue
        sqd = _src(graph, v[0])
        if sqd is None or sqd.op != "SquaredDifference":
            continue
        # SquaredDifference(x, StopGradient(mean)); grappler's arithmetic optimizer drops
        # the StopGradient and may swap the (symmetric) operands
        a, c = graph.data_inputs(sqd)
        if c == x:
            a, c = c, a
        sg = _src(graph, c)
        inner_sg = []
        if sg is not None and sg.op == "StopGradient":
            inner_sg.append(sg.name)
            c = graph.data_inputs(sg)[0]
        if a != x or _src(graph, c) is not m[2]:
            continue
        inner = [xinv.name, shift.name, minv.name] + neg + inv_inner + inner_sg + [
            sqd.name] + [s.name for s in m[3] + v[3]]
        return {"x": x, "gamma": gamma, "beta": beta, "eps": eps, "axes": (m[1], v[1]),
                "stats": {"mean": [s.name for s in m[3]], "var": [s.name for s in v[3]]},
                "inner": list(dict.fromkeys(inner))}
    return None


def _inv(graph, ref):
    """``Mul(Rsqrt(Add(var, eps)), gamma)`` or ``Rsqrt(Add(var, eps))`` -> (var, eps, gamma, inner)."""
    node = _src(graph, ref)
    gamma, inner = None, []
    if node is not None and node.op == "Mul":
        a, c = graph.data_inputs(node)
        for r, g in ((a, c), (c, a)):
            if (s := _src(graph, r)) is not None and s.op == "Rsqrt":
                inner.append(node.name)
                node, gamma = s, g
                break
        else:
            return None
    if node is None or node.op != "Rsqrt":
        return None
    add = _src(graph, graph.data_inputs(node)[0])
    if add is None or add.op not in _ADDS:
        return None
    inner += [node.name, add.name]
    a, c = graph.data_inputs(add)
    for v, e in ((a, c), (c, a)):
        if _stat(graph, v) is not None:
            return v, e, gamma, inner
    return None


def _predicate(node, graph):
    from .grad_region import is_autodiff_name

    if is_autodiff_name(node.name):
        return False
    res = analyze_batch_norm(graph, node)
    if res is None:
        return False
    # per-channel statistics over (0, 1, 2): a layer norm (last axes) is not this rule's
    # match (and its own rule's skip reason stays the one the report shows)
    for ax in res["axes"]:
        v = const_value(graph, ax)
        if v is None or v.size != 3 or sorted({int(a) % 4 for a in v.reshape(-1)}) != [0, 1, 2]:
            return False
    return True


def _candidates(graph):
    """Every node at which :func:`_predicate` can be true (a superset), without
    running it at each Add/AddV2/Mul of the graph (≈ 580 in a 12-layer BERT
    training graph).  ``analyze_batch_norm`` needs ``xinv = Mul(x, inv)`` with
    ``inv`` an Rsqrt or a Mul reading one (:func:`_inv`), read directly; the
    anchor is ``xinv`` (the split form) or an Add/AddV2 reading it."""
    from ..pattern import _of_type

    nodes = graph.nodes
    xinv, level = set(), _of_type(graph, ("Rsqrt",))
    for _ in range(2):  # readers of the Rsqrt, then of an inv = Mul(Rsqrt, gamma)
        nxt = set()
        for name in level:
            for c, idx in graph.consumers(name):
                if idx >= 0 and nodes[c].op == "Mul":
                    nxt.add(c)
        xinv |= nxt
        level = nxt
    return with_add_readers(graph, xinv)


_predicate.candidates = _candidates


def _build(m, b):
    res = analyze_batch_norm(b.graph, b.anchor)
    b.require(res is not None, "the batch norm subgraph changed")
    g = b.graph
    dev = b.device_type()
    b.require(dev == "CPU", f"device {dev}: the fused forms are measured on CPU only (registry.BN_FUSED_FORMS)")
    plan = _precision_plan(b.ctx)
    b.require(plan is None or not plan.lowers_matrix_ops or plan.low != registry.DT_HALF,
              f"not fused: in {plan.mode if plan else ''} the batch norm would follow FP16 producers, and "
              "the fused forms are measured in FP32 and BF16 only (registry.BN_FUSED_FORMS)")
    x = res["x"]
    dt = b.dtype(x)
    b.require(dt == registry.DT_FLOAT, f"input dtype {registry.dtype_name(dt)} (the rule rewrites FP32 graphs)")
    xs = b.shape(x)
    b.require(xs is not None and len(xs) == 4 and min(xs[1:]) > 0 and xs[0] != 0,
              f"x's shape {xs} is not a rank-4 shape with static H, W, C")
    dynamic = xs[0] < 0  # a dynamic batch (model.fit): n from Size(x) at run time
    for ax in res["axes"]:
        v = b.const(ax)
        b.require(v is not None and sorted({int(a) % 4 for a in v.reshape(-1)}) == [0, 1, 2],
                  f"statistics over axes {None if v is None else v.reshape(-1).tolist()}: not NHWC "
                  "(0, 1, 2) (FusedBatchNormV3 normalises per channel of the last or the second axis)")
    c = xs[3]
    n = xs[0] * xs[1] * xs[2]
    b.require(dynamic or n > 1, "one value per channel: the batch variance is undefined")
    eps = const_scalar(b, res["eps"])
    b.require(eps is not None and eps > 0, "the variance epsilon is not a constant > 0")
    f32 = registry.DT_FLOAT
    name = b.anchor.name

    inner = list(res["inner"])
    from .grad_region import is_autodiff_name

    def param(ref, what, fill):
        if ref is None:
            return b.const_node(f"{name}/{what}", np.full([c], fill, np.float32), f32)
        b.require(b.dtype(ref) == f32, f"{what} is not float32")
        sh = b.shape(ref)
        rs = _src(g, ref)
        if sh is not None and len(sh) == 4 and _squeeze_lead(sh) == [c] and rs is not None \
                and rs.op == "Reshape" and all(cn in inner or is_autodiff_name(cn) for cn, _ in g.consumers(rs.name)):
            inner.append(rs.name)  # Keras' Reshape of gamma / beta to [1, 1, 1, C]: absorbed
            ref = g.data_inputs(rs)[0]
            sh = b.shape(ref)
        b.require(sh is not None and list(sh) == [c],
                  f"{what} of shape {sh}: not a vector of the {c} channels")
        return ref

    gamma = param(res["gamma"], "scale", 1.0)
    beta = param(res["beta"], "offset", 0.0)
    res = dict(res, gamma=None if res["gamma"] is None else gamma, beta=None if res["beta"] is None else beta)
    for k, chain in res["stats"].items():
        for nm in chain:
            sh = b.shape(nm)
            b.require(sh is not None and _squeeze_lead(sh) == [c] and len(sh) in (1, 4),
                      f"the batch {k} '{nm}' has shape {sh}")
    b.absorb(inner, escapes_ok=True)
    res["inner"] = inner
    empty = b.const_node(f"{name}/Empty", np.zeros([0], np.float32), f32)
    b.emit("FusedBatchNormV3", name, [x, gamma, beta, empty, empty],
           {"T": ("type", dt), "U": ("type", f32), "epsilon": float(eps), "exponential_avg_factor": 1.0,
            "data_format": "NHWC", "is_training": True})
    i32 = registry.types_pb2.DT_INT32
    # the statistics the forward computed, for their other readers (the moving averages):
    # the batch mean, and the batch variance without Bessel's correction, in each shape
    # the moments chain had ([1, 1, 1, C] Mean, [C] Squeeze, [1, 1, 1, C] Reshape)
    vec = {"mean": tensor_name(name, 1), "var": f"{name}/BiasedVariance"}
    made = set()
    stat_refs = {}
    for k, chain in res["stats"].items():
        for nm in chain:
            stat_refs[nm] = (k, list(b.shape(nm)))
    if res["split"] is not None:
        # the shift's sum reader adds zeros instead: the fused op's output, which
        # replaces x*inv in the same sum, already holds the shift
        sh = b.shape(res["split"])
        b.require(sh is not None and min(sh, default=0) > 0, f"the shift's shape {sh} is not static")
        stat_refs[res["split"]] = ("zero", list(sh))

    def stat_tensor(nm):
        k, sh = stat_refs[nm]
        if k == "zero":
            out = f"{name}/ZeroShift"
            if out not in made:
                made.add(out)
                b.const_node(out, np.zeros(sh, np.float32), f32)
            return out
        if k == "var" and "var" not in made:
            made.add("var")
            fac = f"{name}/BiasedVariance/factor"
            if not dynamic:
                b.const_node(fac, np.float32((n - 1) / n), f32)
            else:  # (n - 1) / n with n = Size(x) / C
                size = b.emit("Size", f"{fac}/Size", [x], {"T": ("type", dt), "out_type": ("type", i32)})
                nf = b.emit("Cast", f"{fac}/N", [size], {"SrcT": ("type", i32), "DstT": ("type", f32),
                                                          "Truncate": False})
                nf = b.emit("RealDiv", f"{fac}/PerChannel", [nf, b.const_node(
                    f"{fac}/C", np.float32(c), f32)], {"T": ("type", f32)})
                nm1 = b.emit("Sub", f"{fac}/NMinus1", [nf, b.const_node(f"{fac}/One", np.float32(1), f32)],
                             {"T": ("type", f32)})
                b.emit("RealDiv", fac, [nm1, nf], {"T": ("type", f32)})
            b.emit("Mul", vec["var"], [tensor_name(name, 2), fac], {"T": ("type", f32)})
        if len(sh) == 1:
            return vec[k]
        out = f"{name}/Batch_{k}_{''.join(str(d) for d in sh[:3])}"
        if out not in made:
            made.add(out)
            b.emit("Reshape", out, [vec[k], b.const_node(f"{out}/shape", np.asarray(sh, np.int32), i32)],
                   {"T": ("type", f32), "Tshape": ("type", i32)})
        return out

    _backward(m, b, res, x, xs, gamma, beta, stat_refs, dt)
    # every remaining reader outside the match and the region reads a statistic
    gone = set(b.match.matched) | set(b.absorbed) | set(b.region_nodes)
    readers = {}
    for nm in inner:
        if nm == name:
            continue
        for cname, idx in g.consumers(nm):
            if cname in gone:
                continue
            ref = _canon(g.nodes[cname].input[idx]) if idx >= 0 else None
            b.require(ref in stat_refs, f"not fused: '{nm}' is also read by '{cname}'")
            readers.setdefault(cname, []).append(idx)
    for cname, idxs in readers.items():
        node = g.nodes[cname]
        b.replace(cname, control_ok=True)
        inputs = node.input[:]
        for i in idxs:
            inputs[i] = stat_tensor(_canon(inputs[i]))
        b.emit(node.op, cname, inputs, dict(node.attr))
        b.emitted[-1].device = node.device


def _backward(m, b, res, x, xs, gamma, beta, stat_refs, dt):
    """Training graphs: the autodiff region reading the forward's inner tensors
    becomes one ``FusedBatchNormGradV3(dy, x, gamma, rs1, rs2, rs3)``; every
    tensor leaving it must be dx (partial terms one sum adds), dgamma or dbeta."""
    from .grad_region import GradRegionRefused, assign_outputs, find_grad_region, is_autodiff_name

    g = b.graph
    inner = set(res["inner"])
    if all(c in inner or _canon(g.nodes[c].input[i]) in stat_refs
           for nm in inner if nm != b.anchor.name for c, i in g.consumers(nm) if i >= 0) and not any(
            i < 0 for nm in inner if nm != b.anchor.name for _, i in g.consumers(nm)):
        return  # no gradient reads the inner tensors (forward only)
    c = xs[3]
    has_gamma, has_beta = res["gamma"] is not None, res["beta"] is not None
    inputs = [x] + [t for t, real in ((res["gamma"], has_gamma), (res["beta"], has_beta)) if real]
    protected = b.ctx.protected if b.ctx is not None else frozenset()
    scopes = []
    if res["split"] is not None and b.anchor.name.rsplit("/", 1)[0].endswith("batchnorm"):
        # tf.nn.batch_normalization's scope holds only F's ops; grappler removed its final
        # Add (AddOpsRewrite), whose gradient (Sum(dy): dbeta) is named after it
        scopes.append(b.anchor.name.rsplit("/", 1)[0] + "/")
    try:
        region = find_grad_region(g, inner, [tensor_name(b.anchor.name, 0)], inputs, shapes=b.shapes,
                                  protected=protected, dy_shape=list(xs), side_outputs=list(stat_refs),
                                  owner_scopes=scopes, partial_shapes=min(xs) < 0)

        def classify(ref):
            if b.dtype(ref) != dt or not region.depends_on_dy(ref):
                return None
            sh = b.shape(ref)
            if sh is None or (min(sh, default=0) < 0 and list(sh) != list(xs)):
                return None
            fwd = region.depends_on_forward(ref)
            if list(sh) == list(xs) and fwd:
                return "dx"
            if list(sh) == [c]:
                if fwd and has_gamma:
                    return "dgamma"
                if not fwd and has_beta:
                    return "dbeta"
            if not fwd and all(is_autodiff_name(r) for r, _ in region.outputs[ref]):
                # a function of dy alone that another gradient reads: grappler's CSE merged
                # the identical Sum(dy) -> Reshape -> Neg of two batch norms fed the same dy
                # (a residual unit's two branches); it stays, for that other gradient
                return f"keep:{ref}"
            return None

        terms = assign_outputs(region, g, classify, summed=("dx",))
    except GradRegionRefused as exc:
        raise Skip(str(exc)) from None
    b.require("dx" in terms, "not fused: the backward pass reads the batch norm's inner tensors, but no "
                             "gradient with respect to x leaves it")
    b.require(b.dtype(region.dy) == dt, "the incoming gradient's dtype differs from the input's")
    name = b.anchor.name
    gname = f"{name}/FusedBatchNormGradV3"
    b.emit("FusedBatchNormGradV3", gname,
           [region.dy, x, gamma, tensor_name(name, 3), tensor_name(name, 4), tensor_name(name, 5)],
           {"T": ("type", dt), "U": ("type", registry.DT_FLOAT), "epsilon": float(
               const_scalar(b, res["eps"])), "data_format": "NHWC", "is_training": True})
    ports = {"dx": 0, "dgamma": 1, "dbeta": 2}
    rewire = {}
    shared = [t.refs[0] for r, t in terms.items() if r.startswith("keep:")]
    keep = _clone_shared(b, region, shared, inner) if shared else set()
    for role, term in terms.items():
        if role.startswith("keep:"):
            rewire[term.refs[0]] = term.refs[0]  # its readers are re-emitted (or it is kept)
            continue
        src = tensor_name(gname, ports[role])
        if term.aggregator is not None:
            reemit_aggregator(b, g, term, src, dt)
            continue
        for ref in term.refs:
            rewire[ref] = src
    b.region([nm for nm in region.nodes if nm not in keep], rewire, gname)


def _bn_layer(name):
    """'a/b_bn/' for an op of tf.nn.batch_normalization ('[gradient_tape/]a/b_bn/batchnorm/...'), else None."""
    from .grad_region import _TF1, _TF2

    for rx in (_TF2, _TF1):
        mm = rx.match(name)
        if mm is not None:
            name = (mm.group(1) or "") + mm.group(2)
            break
    i = name.find("/batchnorm/")
    return name[:i + 1] if i > 0 else None


def _clone_shared(b, region, refs, inner):
    """dy-only gradient tensors another batch norm's gradient reads (grappler's CSE merged
    the two norms' identical ``Sum(dy) -> Reshape -> Neg``): each reader gets a copy of the
    chain named in its own norm's scope (so that norm's rule later finds it as its own
    gradient), and the chain goes with this region.  Where the names do not tell the scope,
    the chain is kept instead (and the other norm's rule will refuse its region)."""
    g = b.graph
    chain = _kept_nodes(g, region, refs, inner)
    mine = _bn_layer(b.anchor.name)
    readers = {}
    for ref in refs:
        for cname, idx in region.outputs[ref]:
            readers.setdefault(cname, []).append(idx)
    layers = {c: _bn_layer(c) for c in readers}
    if mine is None or any(lay is None or lay == mine for lay in layers.values()):
        return chain
    order = [nm for nm in region.nodes if nm in chain]
    clones = {}
    for lay in sorted(set(layers.values())):
        for nm in order:
            new = nm.replace(mine, lay, 1)
            if new == nm or new in g.nodes or any(e.name == new for e in b.emitted):
                return chain
            node = g.nodes[nm]
            ins = []
            for i in node.input[:]:
                src, port, ctrl = parse_tensor(i)
                if src in chain:
                    ins.append(("^" if ctrl else "") + (clones[(lay, src)] if port == 0 or ctrl
                                                         else f"{clones[(lay, src)]}:{port}"))
                elif ctrl and src in set(region.nodes):
                    continue  # a control edge on a node removed with the region
                else:
                    ins.append(i)
            b.emit(node.op, new, ins, dict(node.attr))
            b.emitted[-1].device = node.device
            clones[(lay, nm)] = new
    for cname, idxs in readers.items():
        node = g.nodes[cname]
        b.replace(cname, control_ok=True)
        ins = node.input[:]
        for i in idxs:
            src, port, _ = parse_tensor(ins[i])
            c = clones[(layers[cname], src)]
            ins[i] = c if port == 0 else f"{c}:{port}"
        b.emit(node.op, cname, ins, dict(node.attr))
        b.emitted[-1].device = node.device
    return set()


def _kept_nodes(g, region, refs, inner):
    """The region nodes a kept tensor needs (its producer and their ancestors in the
    region); each must read only kept nodes, dy, and tensors outside F and the region."""
    members = set(region.nodes)
    keep, stack = set(), [parse_tensor(r)[0] for r in refs]
    while stack:
        nm = stack.pop()
        if nm in keep:
            continue
        keep.add(nm)
        for i in g.nodes[nm].input[:]:
            src = parse_tensor(i)[0]
            if src in inner:
                raise Skip(f"not fused: '{nm}', a gradient another batch norm shares, reads the "
                           f"fused region's '{src}'")
            if src in members:
                stack.append(src)
    return keep


def register(reg):
    """Called from ``builtin.register`` with its registering function."""
    reg("batch_norm_moments", Pat(_ADDS + ("Mul",), predicate=_predicate), _build, follows_precision=True,
        escapes=True, searches_gradient=True,
        reason="training batch norm written as moments + arithmetic (Keras 3, tf.nn.moments) becomes "
               "FusedBatchNormV3 / FusedBatchNormGradV3, one BF16 oneDNN pass each instead of ~10 "
               "Eigen elementwise kernels measured slower in BF16 than in FP32")


__all__ = ["register", "analyze_batch_norm"]
