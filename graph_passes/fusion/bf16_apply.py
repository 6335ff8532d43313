"""Level-2 fusion rule for the momentum updates of BF16 training graphs (issue 18j): the
optimizer reads the BF16 gradient directly instead of a widening Cast of it.

Why: under a BF16 plan every conv / matmul weight gradient is BF16, and the FP32 master
update (``ResourceApplyMomentum``, FP32 by TF's OpDef: the variable is FP32) needs it FP32, so
the precision pass puts ``Cast(bf16 -> f32)`` in front of every update: a pass over the
gradient writing 4 bytes per weight, which TF's Eigen kernel then reads back (and it reads the
accumulator twice).  ``ResourceApplyMomentumMixed`` (``custom_ops/bf16_apply.cc``) reads the
2-byte gradient, widens it exactly and updates var and accum in one pass.  It is gray in its
``T`` (the gradient's dtype only; ``precision/lists.py`` ``STATEFUL_PAINTABLE``), so the precision
pass paints it BF16 exactly where the gradient's producer is BF16, and the Cast is never
inserted; where the producer stays FP32 it runs ``T=float``.  Measured per ResNet-50 variable
set (:data:`MEASURED`).

Rule (before => after; the emitted node keeps the anchor's name, so its control readers, the
train op's NoOp, are untouched)::

    bf16_apply_momentum
        ResourceApplyMomentum(var, accum, lr, grad, momentum; T=float, use_locking, use_nesterov)
            => ResourceApplyMomentumMixed(var, accum, lr, grad, momentum; T=float, keras=False, ...)
        ResourceApplyKerasMomentum(...)   (Keras 2 optimizer v2 SGD(momentum>0))
            => ResourceApplyMomentumMixed(...; keras=True)

    after the precision pass (T painted BF16):
        dW(bf16) -> Cast(f32) -> ResourceApplyMomentum(T=float)   becomes
        dW(bf16) -> ResourceApplyMomentumMixed(T=bfloat16)

In TF2 function graphs (``enable()``, Keras ``fit``) the updates are the function's control outputs,
so grappler preserves them: the fusion core lets a rule replace an anchor that has no outputs under
its own name (``core._plan_one``), and the precision pass paints a preserved ``STATEFUL_PAINTABLE``
op (it has no outputs whose dtype could matter).

Values: ``float(bf16)`` is exact, and the kernel computes TF's CPU formula in the same order with
the same roundings (no FMA), so var and accum are bit-identical to ``Cast -> ResourceApplyMomentum``
(tested, both lanes, plain / Nesterov / Keras forms and real ResNets).

Conditions (each refusal is reported): CPU; format_mode not NC1HWC0; a precision plan that lowers
to BF16 (FP32 and FP16 modes: refused; FP16 is never measured, and the op takes BF16 or FP32
only); ``T`` float32 (the variable's dtype: the kernel updates FP32 masters only); resource
variables (the ref-variable ``ApplyMomentum`` is not matched: TF2 graphs, TF1 graphs under TF2
behaviour and Keras all use resource variables); ``lr`` and ``momentum`` float32 scalars by the
OpDef; the gradient (input 3) the output 0 of a white-list (matrix) op that the plan puts in BF16
(``Conv2DBackpropFilter``, ``MatMul``, filter_grad_1x1's MatMul), reached through Identity / Reshape /
Snapshot only.  Any other producer (``BiasAddGrad`` of an FP32 loss gradient, an ``AddN`` of
shared-weight gradients, a batch norm's FP32 dscale) is refused: it is gray, and a gray update
would change the precision pass's choice for it (the pass keeps a gray op FP32 on a tie when its
readers want FP32), so the update would no longer equal Cast + FP32 update of the same graph.
"""
from __future__ import annotations

from .. import registry
from ..graph import parse_tensor
from ..pattern import Pat

#: measured (``benchmarks/bf16_apply.py``: the 54 kernels of a 100-class ResNet-50, 23.66M parameters,
#: one update op each, incl. the gradient's producer Cast to BF16; CPU ms per step, min of 7 rounds of 3;
#: TF's Cast + ResourceApplyMomentum / ResourceApplyMomentumMixed(bf16) / TF's FP32 update / Mixed(float)):
#: TF 2.21.0 (load 10.5): 27.1 / 17.4 / 14.7 / 12.6; TF 2.15.1 (load 10.1): 25.0 / 17.1 / 15.0 / 12.4.
#: end_to_end.py ours vs ours_no18j: CPU per step 0.2-5% lower (load 3-14; within the run-to-run noise)
MEASURED = {
    ("2.21", "apply_momentum"): "1.56x less CPU than Cast + ResourceApplyMomentum (17.4 vs 27.1 ms over ResNet-50's "
                                "kernels): ~10 ms per step",
    ("2.15", "apply_momentum"): "1.46x less CPU than Cast + ResourceApplyMomentum (17.1 vs 25.0 ms): ~8 ms per step",
}

_APPLY_OPS = ("ResourceApplyMomentum", "ResourceApplyKerasMomentum")


#: single-input data movement between a gradient's matrix op and its update (TF1 gradient tuples'
#: Identity, filter_grad_1x1's Reshape): the precision pass keeps them in the matrix op's BF16
PASS_THROUGH = frozenset({"Identity", "Reshape", "Snapshot"})


def _grad_producer(b, ref, depth=8):
    """The node producing ``ref`` (output 0) through :data:`PASS_THROUGH` ops, or None."""
    for _ in range(depth):
        src, port, ctrl = parse_tensor(ref)
        node = b.graph.nodes.get(src)
        if node is None or ctrl or port != 0:
            return None
        if node.op not in PASS_THROUGH:
            return node
        data = b.graph.data_inputs(node)
        if not data:
            return None
        ref = data[0]
    return None


def _build_apply_momentum(m, b):
    from .bf16_elementwise import _require_bf16_cpu
    from .builtin import _precision_plan

    node = b.anchor
    what = "ResourceApplyMomentumMixed"
    dt = _require_bf16_cpu(b, node, what)
    b.require(dt == registry.DT_FLOAT,
              f"{what}: {node.op} updates a {registry.dtype_name(dt)} variable; the kernel updates FP32 "
              "master weights only")
    data = b.graph.data_inputs(node)
    b.require(len(data) == 5, f"{what}: {node.op} with {len(data)} data inputs (expects 5)")
    prod = _grad_producer(b, data[3])
    plan = _precision_plan(b.ctx)
    b.require(prod is not None, f"{what}: the gradient '{data[3]}' is not the output 0 of an op reached through "
                                f"{'/'.join(sorted(PASS_THROUGH))} only")
    entry = plan.list_of(prod.op)
    b.require(entry is not None and entry[0] == "white" and "T" in prod.attr
              and plan.matrix_dtype(prod.op, prod.name, prod.attr["T"].type, prod)[0] == registry.DT_BFLOAT16,
              f"{what}: the gradient's producer '{prod.name}' ({prod.op}) is not a matrix op planned BF16: the "
              "precision pass chooses its dtype, and a gray update could pull it into BF16 where TF's "
              "Cast + FP32 update keeps it FP32")
    a = node.attr
    attrs = {"T": ("type", dt),
             "use_locking": bool(a["use_locking"].b) if "use_locking" in a else False,
             "use_nesterov": bool(a["use_nesterov"].b) if "use_nesterov" in a else False,
             "keras": node.op == "ResourceApplyKerasMomentum"}
    b.emit("ResourceApplyMomentumMixed", node.name, list(data), attrs)
    for key in ("_class",):  # colocation with the variable, as the original update had
        if key in a:
            b.emitted[-1].attr[key].CopyFrom(a[key])


def register(reg):
    """Called from ``builtin.register`` with its registering function."""
    from .bf16_elementwise import bf16_policy

    reg("bf16_apply_momentum", Pat(_APPLY_OPS), _build_apply_momentum, follows_precision=True,
        policy=bf16_policy("ResourceApplyMomentumMixed"),
        reason="momentum update reading the BF16 gradient (no widening Cast; one pass over var, accum, "
               "grad); bit-identical to Cast + TF's FP32 update")


__all__ = ["register", "MEASURED"]
