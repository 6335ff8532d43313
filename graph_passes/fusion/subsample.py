"""Level-2 fusion rule ``strided_subsample``: a spatial subsample ``x[:, ::sh, ::sw, :]``
written as ``StridedSlice`` becomes Reshape -> Slice -> Reshape, where H and W divide by
the strides.

Why: TF's CPU ``StridedSlice`` with strides on H and W is a generic per-element Eigen
kernel, measured 10-25x slower than the same selection as a Slice of a reshaped view (a
run of contiguous C-element copies), in FP32 and BF16, TF 2.15.1 and 2.21.0, oneDNN on and
off (``benchmarks/fused_forms.py --subsample``; table in :data:`MEASURED`).  The
``filter_grad_1x1`` rule emits exactly such a subsample for each stride-2 1x1 conv's weight
gradient: in Keras ResNet-50 (b16, 128x128, TF 2.21) three of them took 10.5 ms of a 525 ms
BF16 step (op time), more than the MatMuls they feed.

Before / after (NHWC, rank 4, H % sh == 0, W % sw == 0; the values are the same elements)::

    x [N,H,W,C] ── StridedSlice(begin 0, end 0, masks all, strides [1,sh,sw,1]) ── [N,H/sh,W/sw,C]

    x ── Reshape [N, H/sh, sh, W/sw, sw*C] ── Slice(begin 0, size [-1, H/sh, 1, W/sw, C])
      ── Reshape [N, H/sh, W/sw, C]   (same name as the StridedSlice)

Conditions (each refusal is reported): the slice takes every element of dims 0 and 3
(``begin_mask`` and ``end_mask`` cover them, or begin 0 / end 0 with the masks) and all of H
and W with a positive stride (masks, or begin 0 and end >= the size), no ellipsis, new-axis
or shrink masks; H, W, C static (N may be unknown); H and W divisible by their strides (an
odd size needs padding: left alone); dtype float32, bfloat16 or float16 (measured; others refused).
The rule changes no value (an exact selection), so it runs in any precision mode.
"""
from __future__ import annotations

from .. import registry

#: measured (``benchmarks/fused_forms.py --subsample``; ms, min over 5 rounds of 8 runs; StridedSlice /
#: Reshape+Slice) for x[:, ::2, ::2, :]: TF 2.21.0 oneDNN on (load 3.3): [16,32,32,256] BF16 9.30 / 0.40,
#: FP32 9.43 / 0.59; [16,16,16,512] BF16 8.00 / 0.26, FP32 4.70 / 0.52; [16,8,8,1024] BF16 2.44 / 0.11,
#: FP32 2.10 / 0.28.  TF 2.15.1 (load 3.3): BF16 8.70 / 0.37, 4.37 / 0.23, 2.24 / 0.10; FP32 8.93 /
#: 0.53, 4.14 / 0.32, 2.26 / 0.24.  TF 2.21.0 oneDNN off (load 3.8): BF16 9.12 / 0.37, 4.69 / 0.26,
#: 3.50 / 0.11; FP32 13.98 / 0.79, 7.44 / 0.37, 2.93 / 0.20.  (A 1x1 MaxPool / AvgPool with the stride,
#: oneDNN pooling, also exact: 0.2-1.5 ms; they would serve odd sizes, not done.)  FP16 (a second run,
#: load 3.9-4.2): TF 2.21 11.47 / 0.42, 4.55 / 0.28, 1.77 / 0.12; TF 2.15 9.65 / 0.33, 4.39 / 0.32, 1.19 / 0.14.
MEASURED = {"2.21": "Reshape+Slice 13-31x faster than StridedSlice (BF16), 9-16x (FP32); oneDNN off 19-33x / 18-20x",
            "2.15": "Reshape+Slice 19-23x faster (BF16), 9-17x (FP32)",
            "fp16": "Reshape+Slice 15-27x (2.21), 9-29x (2.15) faster"}

_DTYPES = (registry.DT_FLOAT, registry.DT_BFLOAT16, registry.DT_HALF)


def _predicate(node, graph):
    if node.op != "StridedSlice" or len(node.input) < 4:
        return False
    a = node.attr
    return all(a[k].i == 0 for k in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask") if k in a)


def _build(m, b):
    node = b.anchor
    x, beg, end, stp = b.graph.data_inputs(node)[:4]
    dt = node.attr["T"].type
    b.require(dt in _DTYPES, f"StridedSlice in {registry.dtype_name(dt)}: measured for float32 / bfloat16 / float16 only")
    xs = b.shape(x)
    b.require(xs is not None and len(xs) == 4, f"input shape {xs}: needs rank 4")
    vb, ve, vs = b.const(beg), b.const(end), b.const(stp)
    b.require(vb is not None and ve is not None and vs is not None and vb.size == ve.size == vs.size == 4,
              "begin / end / strides are not 4 constants")
    vb, ve, vs = [int(v) for v in vb.reshape(-1)], [int(v) for v in ve.reshape(-1)], [int(v) for v in vs.reshape(-1)]
    bm, em = node.attr["begin_mask"].i, node.attr["end_mask"].i
    full = []
    for d in range(4):
        starts = bool(bm >> d & 1) or vb[d] == 0
        ends = bool(em >> d & 1) or (xs[d] > 0 and ve[d] >= xs[d])
        full.append(starts and ends)
    b.require(all(full), f"not a whole-tensor strided view (begin {vb}, end {ve}, masks {bm}/{em})")
    b.require(vs[0] == 1 and vs[3] == 1 and vs[1] >= 1 and vs[2] >= 1 and (vs[1] > 1 or vs[2] > 1),
              f"strides {vs}: not a spatial subsample")
    H, W, C = xs[1], xs[2], xs[3]
    b.require(H > 0 and W > 0 and C > 0, f"input shape {xs}: H, W, C must be static")
    sh, sw = vs[1], vs[2]
    b.require(H % sh == 0 and W % sw == 0,
              f"{H}x{W} not divisible by the strides {sh}x{sw} (would need padding)")
    n = xs[0] if xs[0] > 0 else -1
    i32 = registry.types_pb2.DT_INT32
    name = node.name
    view = b.emit("Reshape", f"{name}/View", [x, b.const_node(f"{name}/View/shape", [n, H // sh, sh, W // sw, sw * C], i32)],
                  {"T": ("type", dt), "Tshape": ("type", i32)})
    sl = b.emit("Slice", f"{name}/Slice", [view, b.const_node(f"{name}/Slice/begin", [0, 0, 0, 0, 0], i32),
                                             b.const_node(f"{name}/Slice/size", [-1, H // sh, 1, W // sw, C], i32)],
                {"T": ("type", dt), "Index": ("type", i32)})
    b.emit("Reshape", name, [sl, b.const_node(f"{name}/shape", [n, H // sh, W // sw, C], i32)],
           {"T": ("type", dt), "Tshape": ("type", i32)})


def register(reg):
    """Called from ``builtin.register`` with its registering function."""
    from ..pattern import Pat

    reg("strided_subsample", Pat("StridedSlice", predicate=_predicate), _build, reads=0,
        reason="a spatial subsample x[:, ::s, ::s, :] as Reshape + Slice (contiguous copies): measured "
               "10-25x faster than the StridedSlice kernel, same values")


__all__ = ["register", "MEASURED"]
