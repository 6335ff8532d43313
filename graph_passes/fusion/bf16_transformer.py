"""Level-2 fusion rule for BF16 transformer training graphs (issue 18, helper 18g): the exact
(erf) GELU of a feed-forward block and its autodiff gradient become ``GeluErf`` /
``GeluErfGrad`` (``custom_ops/gelu.cc``), one pass each, instead of TF's op chains.

Why (measured, ``benchmarks/end_to_end.py --models bert --op-profile 3``, 2-layer BERT-like,
b8 s128, Adam, TF 2.15.1, AMD EPYC with avx512_bf16 and no AMX): with the matmuls in BF16
(1.8x faster than FP32 here) the rest of the step barely shrinks (non-matmul op time 460 ms
FP32 vs 434 ms ours).  The GELU is 5 forward ops over [tokens, ffn] (RealDiv, Erf, AddV2, Mul,
Mul: ~18 ms per layer in BF16, Erf alone 8 ms) and ~12 backward ops (Mul, Square, Exp, Mul,
RealDiv, AddN, ... with FP32 islands and 6 casts around the Exp chain: ~33 ms per layer),
each a full memory pass in TF's BF16 Eigen kernels, which convert element by element.  The
kernels here read BF16, compute in FP32 (vectorised erf / exp) and round once.

Rule (before => after; the forward keeps the anchor's name, so its readers are untouched)::

    bf16_gelu   y = 0.5*x*(1+erf(x/sqrt2))   (tf.nn.gelu <= TF 2.15, BERT's x*(0.5*(1+erf(..))),
                    or 0.5*x*erfc(-x/sqrt2)   (tf.nn.gelu >= TF 2.16))     => y = GeluErf(x)
                dx = <autodiff's gradient subgraph of the above, found by grad_region>
                                                                          => dx = GeluErfGrad(dy, x)

Values: GeluErf / GeluErfGrad compute the formula in FP32 and round once to BF16: against a
float64 reference their error is at most half a BF16 ulp of the result plus the FP32 erf/exp
error (~1e-7 |x|), below TF's BF16 op chain's (which rounds after every op: erf(x/sqrt2) rounded
to BF16 is -1 for x < -3.4, so TF's BF16 GELU is exactly 0 there).  Checked in
tests/test_fusion_bf16_transformer.py.

Conditions (each refusal is reported): CPU; format_mode not NC1HWC0; a precision plan that lowers
to BF16 (``allow_mix_precision_bf16`` and the other BF16 modes; FP32 and FP16 modes: refused,
measured for BF16 only); the GELU in float32 (the precision pass paints the emitted ops: they are
gray, like the ops they replace) or bfloat16; constants 0.5, 1 and 1/sqrt(2) (or sqrt(2) as a
divisor); in a training graph x of a fully known static shape and every tensor leaving the
gradient region a term of dx (else refused with grad_region's reason).  In an inference graph
``bias_gelu_exact`` (MatMul + BiasAdd + GELU as one oneDNN kernel) is tried first; this rule
takes the GELUs it leaves.
"""
from __future__ import annotations

import math

from ..graph import parse_tensor, tensor_name
from ..pattern import Pat

#: measured 2026-12-02 on an AMD EPYC with avx512_bf16, no AMX, shared machine (load 7-9); kernels: ms per
#: call, min over 5 rounds of 8, on the BERT-like shapes ([1024, 3072] GELU, [8, 12, 128, 128] scores,
#: [1024, 768] LayerNorm), wall / CPU; A/B: ``benchmarks/end_to_end.py --models bert --configs
#: fp32,ours,ours_no18g --op-profile 3`` (ours_no18g: these rules removed), 2-layer BERT-like b8 s128, Adam.
#: TF 2.15.1: GeluErf 3.24 / 2.75 vs TF's BF16 chain (RealDiv, Erf, AddV2, Mul, Mul) 8.24 / 8.23 and its FP32
#: chain 9.75 / 6.18; GeluErfGrad 6.07 / 3.69 (TF's backward: ~12 ops, FP32 island, ~33 ms op time per layer
#: in the step).  ScaleMaskSoftmaxGrad BF16 (AVX-512 rows) 9.50 / 3.96 (portable rows 12.02 / 4.93);
#: ScaleMaskSoftmax BF16 5.51 / 3.73 vs TF's BF16 Mul + Softmax 5.15 / 2.55 (the forward does not pay; the
#: backward's FP32 island and its casts do).  LayerNorm BF16 (layer_norm.cc AVX-512 rows, 18g) 0.68 vs 1.54
#: (generic rows), LayerNormGrad 0.74 vs 3.01 (CPU = wall, one thread).  TF 2.21.0: GeluErf 2.33 vs TF's BF16
#: chain 9.28, FP32 chain 6.29; GeluErfGrad 3.26.  Step (TF 2.15.1, load 7, 3 rounds): CPU ms ours 540 /
#: without the rules 588 / FP32 1019 (1.88x vs 1.75x FP32), op time 1536 / 1586 / 2697 ms; with the AVX-512
#: softmax rows 545 / 577 / 1110 (1.97x vs 1.85x, load 9).
MEASURED = {
    ("2.15", "gelu"): "GeluErf 3.0x faster than TF's BF16 GELU chain (2.75 vs 8.23 ms CPU), 2.2x its FP32 chain",
    ("2.21", "gelu"): "GeluErf 4.0x faster than TF's BF16 GELU chain (2.33 vs 9.28 ms), 2.7x its FP32 chain",
    ("2.15", "gelu_grad"): "GeluErfGrad 3.7 ms CPU for the ~12-op BF16/FP32 backward with 6 casts (~33 ms op time "
                           "per layer in the step)",
    ("2.15", "softmax_grad"): "ScaleMaskSoftmaxGrad BF16 4.0 ms CPU in place of an FP32 Mul/Sum/Sub/Mul island "
                              "with 4 casts (~15-35 ms op time per step)",
    ("2.15", "step"): "BERT-like b8 s128 2 layers: CPU per step 1.88-1.97x FP32 with the rules, 1.75-1.85x without",
}


def _x_leaf(name):
    return Pat.any(name)


def _pattern():
    """tf_style 0.5*x*(1+erf(x/c)), bert_style x*(0.5*(1+erf(x/c))), erfc_style 0.5*x*erfc(-x*c)."""
    erf_arg = Pat.one_of(Pat("RealDiv", name="div", inputs=[_x_leaf("x1"), Pat.any("c")]),
                         Pat("Mul", name="div", commutative=True, inputs=[_x_leaf("x1"), Pat.any("c")]))
    one_plus = Pat(("AddV2", "Add"), commutative=True, name="onep",
                   inputs=[Pat.any("one"), Pat("Erf", name="erf", inputs=[erf_arg])])
    tf_style = Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), _x_leaf("x0")]), one_plus])
    bert_style = Pat("Mul", commutative=True, inputs=[
        _x_leaf("x0"), Pat("Mul", name="cdf", commutative=True, inputs=[Pat.any("half"), one_plus])])
    erfc_arg = Pat("Mul", name="div", commutative=True, inputs=[
        Pat("Neg", name="neg", inputs=[_x_leaf("x1")]), Pat.any("c")])
    erfc_style = Pat("Mul", commutative=True, inputs=[
        Pat("Mul", name="halfx", commutative=True, inputs=[Pat.any("half"), _x_leaf("x0")]),
        Pat("Erfc", name="erfc", inputs=[erfc_arg])])
    return Pat.one_of(tf_style, bert_style, erfc_style)


def _canon(ref):
    n, p, c = parse_tensor(ref)
    return None if c else tensor_name(n, p)


def _resolve(b, m):
    """(x, half, c) tensor refs, whichever way the commutative Muls matched: x is the tensor
    fed both to the erf argument and to the outer product."""
    from .builtin import const_scalar

    x1 = _canon(m.tensors["x1"])
    c = m.tensors["c"]
    if m["div"].op == "Mul" and const_scalar(b, x1) is not None and const_scalar(b, c) is None:
        x1, c = _canon(c), x1
    a, h = _canon(m.tensors["x0"]), m.tensors["half"]
    if a != x1 and _canon(h) == x1:
        a, h = _canon(h), a
    b.require(a == x1, "the erf argument and the product read different tensors (not a GELU)")
    return x1, h, c


def _build_gelu(m, b):
    from .bf16_elementwise import _require_bf16_cpu
    from .builtin import _close, const_scalar, reemit_aggregator

    x, half, c = _resolve(b, m)
    dt = _require_bf16_cpu(b, b.anchor, "GeluErf")
    b.require(b.dtype(x) == dt, "the GELU's input dtype differs from its output's")
    b.require(_close(const_scalar(b, half), 0.5), "GELU constant is not 0.5")
    cv = const_scalar(b, c)
    if "erfc" in m.nodes:
        b.require(cv is not None and _close(abs(cv), 1 / math.sqrt(2.0)),
                  f"erfc argument scale {cv} is not 1/sqrt(2)")
    else:
        b.require(_close(const_scalar(b, m.tensors["one"]), 1.0), "GELU constant is not 1")
        div = m["div"].op == "RealDiv"
        b.require(cv is not None and (_close(cv, math.sqrt(2.0)) if div else _close(cv, 1 / math.sqrt(2.0))),
                  f"erf argument scale {cv} is not 1/sqrt(2)")
    if b.escaping_readers():
        _gelu_backward(m, b, x, dt, reemit_aggregator)
    b.emit("GeluErf", b.anchor.name, [x], {"T": ("type", dt)})


def _gelu_backward(m, b, x, dt, reemit_aggregator):
    """Training graph: the backward reads the GELU's inner tensors: replace autodiff's gradient
    region by one ``GeluErfGrad(dy, x)`` (every tensor leaving it must be a term of dx)."""
    from .core import Skip
    from .grad_region import GradRegionRefused, assign_outputs, find_grad_region

    g = b.graph
    xs = b.shape(x)
    b.require(xs is not None and len(xs) >= 1 and min(xs) > 0,
              f"not fused: the backward reads the GELU's inner tensors and x's shape {xs} is not static")
    inner = set(b.match.matched) | set(b.absorbed)
    protected = b.ctx.protected if b.ctx is not None else frozenset()
    try:
        region = find_grad_region(g, inner, [tensor_name(m.anchor, 0)], [x], shapes=b.shapes,
                                  protected=protected, dy_shape=list(xs))

        def classify(ref):
            if b.dtype(ref) != dt or not region.depends_on_dy(ref):
                return None
            sh = b.shape(ref)
            if sh is None or list(sh) != list(xs) or not region.depends_on_forward(ref):
                return None
            return "dx"

        terms = assign_outputs(region, g, classify, summed=("dx",))
    except GradRegionRefused as exc:
        raise Skip(str(exc)) from None
    b.require("dx" in terms, "not fused: the backward reads the GELU's inner tensors, but no gradient "
                             "with respect to x leaves it")
    b.require(b.dtype(region.dy) == dt, "the incoming gradient's dtype differs from the input's")
    gname = f"{m.anchor}/GeluErfGrad"
    b.emit("GeluErfGrad", gname, [region.dy, x], {"T": ("type", dt)})
    rewire = {}
    term = terms["dx"]
    if term.aggregator is not None:
        reemit_aggregator(b, g, term, gname, dt)
    else:
        for ref in term.refs:
            rewire[ref] = gname
    b.region(region.nodes, rewire, gname)


def _build_attention_train_bf16(m, b):
    """``attention_train`` (builtin.py, graph_level 3) at level 2 where the plan is BF16: the level-3
    reason (rounding changes) does not hold against a BF16 plan, whose TF ops round every step to
    BF16 while the fused kernels compute in FP32 and round once."""
    from .bf16_elementwise import _require_bf16_cpu
    from .builtin import _build_attention_train

    _require_bf16_cpu(b, b.anchor, "ScaleMaskSoftmax")
    return _build_attention_train(m, b)


def register(reg):
    """Called from ``builtin.register`` with its registering function (after ``bias_gelu_exact``)."""
    from .bf16_elementwise import bf16_policy
    from .builtin import _softmax_grad_signature

    reg("bf16_gelu", _pattern(), _build_gelu, follows_precision=True, escapes=True, searches_gradient=True,
        policy=bf16_policy("GeluErf"),
        reason="BF16 exact GELU and its gradient as one vectorised pass each (TF: 5 forward and ~12 "
               "backward BF16/FP32 ops with casts); FP32 arithmetic, one rounding")
    reg("bf16_attention_train", Pat("Softmax", predicate=_softmax_grad_signature), _build_attention_train_bf16,
        follows_precision=True, escapes=True, searches_gradient=True, policy=bf16_policy("ScaleMaskSoftmax"),
        reason="BF16 training graph: scale + mask + softmax and their backward region (an FP32 island with "
               "casts on TF 2.15) become ScaleMaskSoftmax / ScaleMaskSoftmaxGrad in BF16 I/O, FP32 inside")


__all__ = ["register", "MEASURED"]
