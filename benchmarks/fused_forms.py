"""Which fused op forms run in BF16 on this TF, and how fast?  (issue 18)

For conv (16x56x56x64, 3x3, SAME) and matmul (512x1024 @ 1024x1024), each
with bias and Relu, in FP32 and BF16:

  plain      Conv2D/MatMul + BiasAdd + Relu as separate nodes (grappler's
             remapper OFF; oneDNN's own layout pass may still merge conv+bias)
  generic    _FusedConv2D / _FusedMatMul [BiasAdd, Relu]
  onednn     _MklNativeFusedConv2D [BiasAdd, Relu] with _kernel=MklNameChangeOp
             (the form registry.FUSED_FORMS emits for BF16 under oneDNN)

Every form runs in its own subprocess (a form may abort TF) that imports the
graph with ``import_graph_def`` (TF's OpDef validation), runs it, and reports
the median step time and the ops TF actually executed.  The results back the
``FUSED_FORMS`` / ``BROKEN_KERNELS`` entries in graph_passes/registry.py.
Set TF_ENABLE_ONEDNN_OPTS=0 to measure TF's Eigen kernels.  Never asserts a time.

``--filter-grad``: the weight gradient of ResNet-50's convs (batch 16, 128x128 input) as
Conv2DBackpropFilter vs the forms the ``filter_grad_1x1`` / ``filter_grad_im2col`` fusion
rules emit (a 1x1 conv: Reshape -> MatMul(transpose_a); a kxk conv: ExtractImagePatches ->
the same), in BF16 and FP32, each timed as the minimum over 5 rounds of 4 runs, in one
subprocess (the numbers behind the rules' limits in graph_passes/fusion/builtin.py).

``--bias-grad``: the bias gradient (BiasAddGrad) of ResNet-50's conv outputs (batch 16,
128x128 input), BF16 gradient in, FP32 [C] out (the bias variable is FP32), as TF's BF16
BiasAddGrad (Eigen) vs the candidate forms the ``bias_grad`` fusion rule may emit: the
same in FP32 after a Cast, a BF16 / FP32 ``Sum`` over (N, H, W), and a BF16 MatMul of a
ones row with the flattened gradient (oneDNN accumulates in FP32); each timed as the
minimum over 5 rounds of 4 runs, in one subprocess (the numbers behind
graph_passes/fusion/bias_grad.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FORMS = [(k, f, d) for k in ("conv", "matmul") for f in ("plain", "generic", "onednn")
         for d in ("float32", "bfloat16") if not (k == "matmul" and f == "onednn")]


def _child(kind, form, dtn, reps=15):

    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    tf1 = tf.compat.v1
    dt = getattr(tf, dtn)
    g = tf.Graph()
    with g.as_default():
        if kind == "conv":
            shape, C = [16, 56, 56, 64], 64
            x = tf1.placeholder(tf.float32, shape, name="x")
            w = tf.constant(np.random.RandomState(1).normal(0, 0.05, [3, 3, C, C]).astype(np.float32))
            core = tf.nn.conv2d(tf.cast(x, dt), tf.cast(w, dt), 1, "SAME", name="core")
        else:
            shape, C = [512, 1024], 1024
            x = tf1.placeholder(tf.float32, shape, name="x")
            w = tf.constant(np.random.RandomState(1).normal(0, 0.05, [1024, C]).astype(np.float32))
            core = tf.matmul(tf.cast(x, dt), tf.cast(w, dt), name="core")
        b = tf.cast(tf.constant(np.linspace(-1, 1, C).astype(np.float32)), dt)
        tf.nn.relu(tf.nn.bias_add(core, b, name="ba"), name="relu")
        tf.reduce_sum(tf.cast(g.get_tensor_by_name("relu:0"), tf.float32), name="out")
    gd = g.as_graph_def()
    if form != "plain":
        byname = {n.name: n for n in gd.node}
        c, ba, relu = byname["core"], byname["ba"], byname["relu"]
        relu.op = {"conv": "_FusedConv2D", "matmul": "_FusedMatMul"}[kind] if form == "generic" \
            else "_MklNativeFusedConv2D"
        del relu.input[:]
        relu.input.extend([c.input[0], c.input[1], ba.input[1]])
        for k, v in c.attr.items():
            if k not in ("_output_shapes", "use_cudnn_on_gpu", "grad_a", "grad_b"):
                relu.attr[k].CopyFrom(v)
        if kind == "conv":
            relu.attr["TArgs"].list.type.append(dt.as_datatype_enum)
        relu.attr["num_args"].i = 1
        relu.attr["fused_ops"].list.s.extend([b"BiasAdd", b"Relu"])
        if form == "onednn":
            relu.attr["_kernel"].s = b"MklNameChangeOp"
        keep = [n for n in gd.node if n.name not in ("core", "ba")]
        del gd.node[:]
        gd.node.extend(keep)
    cfg = config_pb2.ConfigProto()
    cfg.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    g2 = tf.Graph()
    with g2.as_default():
        try:
            tf.graph_util.import_graph_def(gd, name="")
        except (ValueError, tf.errors.OpError) as exc:
            return {"status": "refused", "why": str(exc).splitlines()[0][:120]}
        feed = {"x:0": np.random.RandomState(0).uniform(-1, 1, shape).astype(np.float32)}
        with tf1.Session(graph=g2, config=cfg) as s:
            md = tf1.RunMetadata()
            try:
                val = s.run("out:0", feed, options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
            except tf.errors.OpError as exc:
                return {"status": "fails", "why": str(exc).splitlines()[0][:120]}
            ops = sorted({n.op for pg in md.partition_graphs for n in pg.node
                          if n.op not in ("Const", "_Arg", "_Retval", "Placeholder", "Cast", "Sum", "_Recv", "_Send")})
            for _ in range(3):
                s.run("out:0", feed)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                s.run("out:0", feed)
                ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"status": "runs", "ms": 1e3 * ts[len(ts) // 2], "min_ms": 1e3 * ts[0], "value": float(val), "ops": ops}


#: (N, H, W, Ci, Co, k, stride) of the gradient's conv input; SAME (1x1, stride 1 kxk) or VALID
FILTER_GRAD_SHAPES = [
    (16, 32, 32, 64, 256, 1, 1), (16, 32, 32, 256, 64, 1, 1), (16, 16, 16, 512, 128, 1, 1),
    (16, 8, 8, 256, 1024, 1, 1), (16, 4, 4, 512, 2048, 1, 1), (16, 4, 4, 2048, 512, 1, 1),
    (16, 8, 8, 1024, 2048, 1, 2),
    (16, 16, 16, 128, 128, 3, 1), (16, 8, 8, 256, 256, 3, 1), (16, 7, 7, 512, 512, 3, 1),
    (16, 4, 4, 512, 512, 3, 1), (16, 4, 4, 256, 256, 3, 1), (16, 10, 10, 256, 256, 3, 2),
]


def _timed(sess, op, rounds=5, runs=4):
    """(wall ms, CPU ms) per ``sess.run(op)``: each the minimum over ``rounds`` rounds of ``runs``
    runs, after 3 warm-up runs."""
    for _ in range(3):
        sess.run(op)
    wall = cpu = float("inf")
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(runs):
            sess.run(op)
        wall = min(wall, (time.perf_counter() - t0) / runs)
        cpu = min(cpu, (time.process_time() - c0) / runs)
    return wall * 1e3, cpu * 1e3


def _session_ms(sess, fetch, rounds=5, runs=4):
    """Wall ms per ``sess.run(fetch)`` (see :func:`_timed`)."""
    return _timed(sess, fetch, rounds, runs)[0]


def _filter_grad_child():

    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    g = tf.Graph()
    cases = []
    with g.as_default():
        for (N, H, W, Ci, Co, k, st) in FILTER_GRAD_SHAPES:
            pad = "SAME" if k == 1 or st == 1 else "VALID"
            Ho = -(-H // st) if pad == "SAME" else (H - k) // st + 1
            row = {}
            for dtn in ("bfloat16", "float32"):
                dt = getattr(tf, dtn)
                x = tf.Variable(tf.cast(tf.random.normal([N, H, W, Ci]), dt))
                dy = tf.Variable(tf.cast(tf.random.normal([N, Ho, Ho, Co]), dt))
                conv = tf1.nn.conv2d_backprop_filter(x, [k, k, Ci, Co], dy, [1, st, st, 1], pad)
                if k == 1:
                    cols = x[:, ::st, ::st, :] if st > 1 else x
                else:
                    cols = tf.image.extract_patches(x, [1, k, k, 1], [1, st, st, 1], [1, 1, 1, 1], pad)
                mm = tf.reshape(tf.matmul(tf.reshape(cols, [-1, k * k * Ci]), tf.reshape(dy, [-1, Co]),
                                          transpose_a=True), [k, k, Ci, Co])
                row[dtn] = (conv, mm)
            cases.append(((N, H, W, Ci, Co, k, st), row))
        init = tf1.global_variables_initializer()

    out = []
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        for shp, row in cases:
            r = {"shape": shp}
            for dtn, (conv, mm) in row.items():
                a, b = sess.run([conv, mm])
                a, b = a.astype(np.float64), b.astype(np.float64)
                r[dtn] = {"conv_ms": _session_ms(sess, conv.op), "matmul_ms": _session_ms(sess, mm.op),
                          "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))}
            out.append(r)
    return out


def _child_result(flag):
    """Run this file with ``flag`` in a fresh process (a form may abort TF) and return
    its decoded RESULT line, printing the TF version and load first; None (and why)
    when the child died."""
    import tensorflow as tf

    p = subprocess.run([sys.executable, os.path.abspath(__file__), flag],
                       capture_output=True, text=True, timeout=1800)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        print(f"died rc={p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:200]}")
        return None
    print(f"TF {tf.__version__}, TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')}; "
          f"load average {os.getloadavg()[0]:.2f}")
    return json.loads(line[0][7:])


def filter_grad_main():
    rows = _child_result("--filter-grad-child")
    if rows is None:
        return
    print(f"{'N,H,W,Ci,Co,k,stride':28s} {'BF16 conv':>9s} {'BF16 mm':>8s} {'ratio':>6s} "
          f"{'FP32 conv':>9s} {'FP32 mm':>8s} {'ratio':>6s}  (ms; ratio = conv / MatMul form)")
    for r in rows:
        b, f = r["bfloat16"], r["float32"]
        print(f"{str(tuple(r['shape'])):28s} {b['conv_ms']:9.2f} {b['matmul_ms']:8.2f} "
              f"{b['conv_ms'] / b['matmul_ms']:6.2f} {f['conv_ms']:9.2f} {f['matmul_ms']:8.2f} "
              f"{f['conv_ms'] / f['matmul_ms']:6.2f}")


#: (N, H, W, C) of the conv outputs whose bias gradient Keras 2 ResNet-50 computes (b16, 128x128)
BIAS_GRAD_SHAPES = [(16, 64, 64, 64), (16, 32, 32, 64), (16, 32, 32, 256), (16, 16, 16, 128),
                    (16, 16, 16, 512), (16, 8, 8, 256), (16, 8, 8, 1024), (16, 4, 4, 512),
                    (16, 4, 4, 2048),
                    # rank 2 ([N, C]; a Dense layer's bias): BERT-like b8 s128 (1024 tokens), ResNet's head
                    (1024, 768), (1024, 3072), (16, 100)]
BIAS_GRAD_FORMS = ("fp32_ref", "bag_bf16", "bag_fp32", "sum_bf16", "sum_fp32", "mm_ones", "mm_ones_t")


def _bias_grad_child(rounds=5, runs=4):

    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    g = tf.Graph()
    cases = []
    with g.as_default():
        for shp in BIAS_GRAD_SHAPES:
            M, C = int(np.prod(shp[:-1])), shp[-1]
            axes = list(range(len(shp) - 1))
            d32 = tf.Variable(tf.random.normal(list(shp)))
            d16 = tf.Variable(tf.cast(tf.random.normal(list(shp)), tf.bfloat16))
            f32 = lambda t: tf.cast(t, tf.float32)  # noqa: E731
            flat = tf.reshape(d16, [M, C])
            forms = {
                "fp32_ref": tf1.nn.bias_add_grad(d32) if hasattr(tf1.nn, "bias_add_grad")
                else tf.raw_ops.BiasAddGrad(out_backprop=d32),
                "bag_bf16": f32(tf.raw_ops.BiasAddGrad(out_backprop=d16)),
                "bag_fp32": tf.raw_ops.BiasAddGrad(out_backprop=f32(d16)),
                "sum_bf16": f32(tf.reduce_sum(d16, axes)),
                "sum_fp32": tf.reduce_sum(f32(d16), axes),
                "mm_ones": f32(tf.reshape(tf.matmul(tf.ones([1, M], tf.bfloat16), flat), [C])),
                "mm_ones_t": f32(tf.reshape(tf.matmul(flat, tf.ones([M, 1], tf.bfloat16),
                                                      transpose_a=True), [C])),
            }
            exact = tf.reduce_sum(tf.cast(d16, tf.float64), axes)
            cases.append((shp, forms, exact))
        init = tf1.global_variables_initializer()

    out = []
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        for shp, forms, exact in cases:
            ex = sess.run(exact)
            r = {"shape": shp}
            for name, t in forms.items():
                v = sess.run(t).astype(np.float64)
                err = float(np.linalg.norm(v - ex) / max(np.linalg.norm(ex), 1e-30))
                r[name] = {"ms": _session_ms(sess, t.op, rounds, runs),
                           "rel_l2": err if name != "fp32_ref" else float("nan")}
            out.append(r)
    return out


def bias_grad_main():
    rows = _child_result("--bias-grad-child")
    if rows is None:
        return
    print("ms (min over rounds); fp32_ref = FP32 BiasAddGrad on an FP32 gradient; the others read a BF16 "
          "gradient; [rel. L2 error vs the exact sum of the BF16 values]")
    print(f"{'shape':20s} " + " ".join(f"{f:>17s}" for f in BIAS_GRAD_FORMS))
    tot = {f: 0.0 for f in BIAS_GRAD_FORMS}
    for r in rows:
        cells = []
        for f in BIAS_GRAD_FORMS:
            tot[f] += r[f]["ms"]
            e = r[f]["rel_l2"]
            cells.append(f"{r[f]['ms']:7.3f}" + (f" [{e:7.1e}]" if e == e else " " * 10))
        print(f"{str(tuple(r['shape'])):20s} " + " ".join(cells))
    print(f"{'sum':20s} " + " ".join(f"{tot[f]:7.2f}" + " " * 10 for f in BIAS_GRAD_FORMS))


#: (N, H, W, C) of the inputs of ResNet-50's stride-2 1x1 convs (b16, 128x128), and an odd size
SUBSAMPLE_SHAPES = [(16, 32, 32, 256), (16, 16, 16, 512), (16, 8, 8, 1024), (16, 15, 15, 64)]
SUBSAMPLE_FORMS = ("strided_slice", "maxpool_1x1", "avgpool_1x1", "reshape_slice")


def _subsample_child(rounds=5, runs=8):
    """x[:, ::2, ::2, :] (the ``filter_grad_1x1`` rule's subsample of a stride-2 1x1 conv's
    input) as StridedSlice vs a 1x1 MaxPool / AvgPool with stride 2 (oneDNN pooling) vs
    Reshape [N, H/2, 2, W/2, 2C] + Slice (even sizes only), BF16, FP32 and FP16."""

    import numpy as np
    import tensorflow as tf

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    g = tf.Graph()
    cases = []
    with g.as_default():
        for (N, H, W, C) in SUBSAMPLE_SHAPES:
            row = {}
            for dtn in ("bfloat16", "float32", "float16"):
                x = tf.Variable(tf.cast(tf.random.normal([N, H, W, C]), getattr(tf, dtn)))
                forms = {"strided_slice": x[:, ::2, ::2, :],
                         "maxpool_1x1": tf.nn.max_pool2d(x, 1, 2, "SAME"),
                         "avgpool_1x1": tf.nn.avg_pool2d(x, 1, 2, "SAME")}
                if H % 2 == 0 and W % 2 == 0:
                    r = tf.reshape(x, [N, H // 2, 2, W // 2, 2 * C])
                    forms["reshape_slice"] = tf.reshape(tf.slice(r, [0, 0, 0, 0, 0], [N, H // 2, 1, W // 2, C]),
                                                        [N, H // 2, W // 2, C])
                # a consumer that reads the result (a subsample nobody reads is pruned)
                row[dtn] = {k: tf.reduce_sum(tf.reshape(v, [-1])[:1]) for k, v in forms.items()}
                row[dtn + "_vals"] = forms
            cases.append(((N, H, W, C), row))
        init = tf1.global_variables_initializer()

    out = []
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        for shp, row in cases:
            r = {"shape": shp}
            for dtn in ("bfloat16", "float32", "float16"):
                vals = sess.run(row[dtn + "_vals"])
                ref = vals["strided_slice"]
                r[dtn] = {k: {"ms": _session_ms(sess, row[dtn][k], rounds, runs),
                              "equal": bool(np.array_equal(np.asarray(vals[k], np.float32),
                                                           np.asarray(ref, np.float32)))}
                          for k in row[dtn]}
            out.append(r)
    return out


def subsample_main():
    rows = _child_result("--subsample-child")
    if rows is None:
        return
    print("x[:, ::2, ::2, :], ms (min over rounds; includes reading one element of the result); "
          "* = not bit-equal to StridedSlice's result")
    print(f"{'shape':20s} {'dtype':9s} " + " ".join(f"{f:>14s}" for f in SUBSAMPLE_FORMS))
    for r in rows:
        for dtn in ("bfloat16", "float32", "float16"):
            cells = [(f"{r[dtn][f]['ms']:13.3f}" + (" " if r[dtn][f]["equal"] else "*")) if f in r[dtn]
                     else f"{'-':>14s}" for f in SUBSAMPLE_FORMS]
            print(f"{str(tuple(r['shape'])):20s} {dtn:9s} " + " ".join(cells))


#: ResNet-50's (b16, 128x128) residual joins (Add + Relu forward, AddN + ReluGrad backward) and
#: batch-norm shapes (every BN's [N, H, W, C]), for ``--bf16-elementwise``
RESIDUAL_SHAPES = [(16, 32, 32, 256), (16, 16, 16, 512), (16, 8, 8, 1024), (16, 4, 4, 2048)]
BN_SHAPES = [(16, 64, 64, 64), (16, 32, 32, 64), (16, 32, 32, 256), (16, 16, 16, 128), (16, 16, 16, 512),
             (16, 8, 8, 256), (16, 8, 8, 1024), (16, 4, 4, 512), (16, 4, 4, 2048)]
ELEMENTWISE_FORMS = ("tf_bf16", "ours_bf16", "tf_fp32")


def _bf16_elementwise_child(rounds=5, runs=8):
    """TF's BF16 form vs this project's kernel (``custom_ops/bf16_elementwise.cc``) vs TF's FP32
    form, per ResNet-50 shape, for the rules in graph_passes/fusion/bf16_elementwise.py:
    add_relu (AddV2 -> Relu), addn_relugrad (AddN -> ReluGrad), bn_grad
    (FusedBatchNormGradV3 training NHWC) and relu_bn_grad (ReluGrad -> FusedBatchNormGradV3).
    Elementwise forms also report whether ours equals TF's BF16 result bit for bit; the
    batch-norm forms their max |dx error| relative to max |dx| against a float64 reference."""

    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from npu_amp_tf import _loader

    lib = _loader.load()
    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    bf, f32 = tf.bfloat16, tf.float32
    g = tf.Graph()
    cases = []
    with g.as_default():
        tf1.set_random_seed(0)

        def init(shp, seed):  # the same values at every call (graph and op seeds fixed)
            return tf.cast(tf.cast(tf.random.normal(list(shp), seed=seed), bf), f32)

        def var(shp, dt, seed):
            return tf.Variable(tf.cast(init(shp, seed), dt))

        for shp in RESIDUAL_SHAPES:
            a, b, f = var(shp, bf, 1), var(shp, bf, 2), var(shp, bf, 3)
            a32, b32, f32v = var(shp, f32, 1), var(shp, f32, 2), var(shp, f32, 3)
            cases.append(("add_relu", shp, {
                "tf_bf16": tf.nn.relu(a + b), "ours_bf16": lib.add_relu(a, b),
                "tf_fp32": tf.nn.relu(a32 + b32)}, None))
            cases.append(("addn_relugrad", shp, {
                "tf_bf16": tf.raw_ops.ReluGrad(gradients=tf.add_n([a, b]), features=f),
                "ours_bf16": lib.add_n_relu_grad(a, b, f),
                "tf_fp32": tf.raw_ops.ReluGrad(gradients=tf.add_n([a32, b32]), features=f32v)}, None))
        for shp in BN_SHAPES:
            C = shp[-1]
            x, dy, ry = var(shp, bf, 4), var(shp, bf, 5), var(shp, bf, 6)
            x32, dy32, ry32 = var(shp, f32, 4), var(shp, f32, 5), var(shp, f32, 6)
            m, v = tf.nn.moments(init(shp, 4), [0, 1, 2])
            mean, variance = tf.Variable(m), tf.Variable(v)
            scale = tf.Variable(tf.random.uniform([C], 0.5, 1.5, seed=7))
            eps = 1e-3

            def tf_grad(d, xx):
                return tf.raw_ops.FusedBatchNormGradV3(
                    y_backprop=d, x=xx, scale=scale, reserve_space_1=mean, reserve_space_2=variance,
                    reserve_space_3=tf.zeros([0]), epsilon=eps, data_format="NHWC", is_training=True)[0]

            def ref(d):  # float64 reference from the BF16 values
                d64, x64 = tf.cast(d, tf.float64), tf.cast(x, tf.float64)
                m64, v64 = tf.cast(mean, tf.float64), tf.cast(variance, tf.float64)
                r = tf.math.rsqrt(v64 + eps)
                xh = (x64 - m64) * r
                n = float(np.prod(shp[:-1]))
                return tf.cast(scale, tf.float64) * r * (d64 - tf.reduce_sum(d64, [0, 1, 2]) / n
                                                        - xh * tf.reduce_sum(d64 * xh, [0, 1, 2]) / n)

            relu_dy = tf.raw_ops.ReluGrad(gradients=dy, features=ry)
            cases.append(("bn_grad", shp, {
                "tf_bf16": tf_grad(dy, x),
                "ours_bf16": lib.batch_norm_grad_nhwc(dy, x, scale, mean, variance, [], epsilon=eps)[0],
                "tf_fp32": tf_grad(dy32, x32)}, ref(dy)))
            cases.append(("relu_bn_grad", shp, {
                "tf_bf16": tf_grad(relu_dy, x),
                "ours_bf16": lib.batch_norm_grad_nhwc(dy, x, scale, mean, variance, [ry], epsilon=eps)[0],
                "tf_fp32": tf_grad(tf.raw_ops.ReluGrad(gradients=dy32, features=ry32), x32)}, ref(relu_dy)))
        init = tf1.global_variables_initializer()

    out = []
    with tf1.Session(graph=g) as sess:
        sess.run(init)
        for kind, shp, forms, ref in cases:
            r = {"kind": kind, "shape": shp}
            vals = {k: sess.run(t) for k, t in forms.items()}
            if ref is None:
                r["bit_equal"] = bool(np.array_equal(vals["tf_bf16"].view(np.uint16),
                                                     vals["ours_bf16"].view(np.uint16)))
            else:
                rv = sess.run(ref)
                scl = max(float(np.abs(rv).max()), 1e-30)
                r["err"] = {k: float(np.abs(vals[k].astype(np.float64) - rv).max() / scl)
                            for k in ("tf_bf16", "ours_bf16")}
            for k, t in forms.items():
                r[k] = _timed(sess, t.op, rounds, runs)
            out.append(r)
    return out


def bf16_elementwise_main():
    rows = _child_result("--bf16-elementwise-child")
    if rows is None:
        return
    print("ms per run (min over rounds): wall / CPU; tf_bf16 = TF's BF16 ops, ours_bf16 = "
          "custom_ops/bf16_elementwise.cc, tf_fp32 = TF's ops on FP32 data")
    print(f"{'form':14s} {'shape':20s} " + " ".join(f"{f:>15s}" for f in ELEMENTWISE_FORMS) + "  check")
    tot = {}
    for r in rows:
        t = tot.setdefault(r["kind"], {f: [0.0, 0.0] for f in ELEMENTWISE_FORMS})
        for f in ELEMENTWISE_FORMS:
            t[f][0] += r[f][0]
            t[f][1] += r[f][1]
        chk = ("bit-equal" if r["bit_equal"] else "DIFFERS") if "bit_equal" in r else \
            f"max err tf {r['err']['tf_bf16']:.1e} ours {r['err']['ours_bf16']:.1e}"
        print(f"{r['kind']:14s} {str(tuple(r['shape'])):20s} "
              + " ".join(f"{r[f][0]:7.3f}/{r[f][1]:7.3f}" for f in ELEMENTWISE_FORMS) + "  " + chk)
    for kind, t in tot.items():
        print(f"{kind:14s} {'sum':20s} " + " ".join(f"{t[f][0]:7.2f}/{t[f][1]:7.2f}" for f in ELEMENTWISE_FORMS))


def main():
    if sys.argv[1:] == ["--filter-grad-child"]:
        print("RESULT " + json.dumps(_filter_grad_child()), flush=True)
        return
    if sys.argv[1:] == ["--subsample-child"]:
        print("RESULT " + json.dumps(_subsample_child()), flush=True)
        return
    if sys.argv[1:] == ["--subsample"]:
        subsample_main()
        return
    if sys.argv[1:] == ["--bias-grad-child"]:
        print("RESULT " + json.dumps(_bias_grad_child()), flush=True)
        return
    if sys.argv[1:] == ["--bias-grad"]:
        bias_grad_main()
        return
    if sys.argv[1:] == ["--bf16-elementwise-child"]:
        print("RESULT " + json.dumps(_bf16_elementwise_child()), flush=True)
        return
    if sys.argv[1:] == ["--bf16-elementwise"]:
        bf16_elementwise_main()
        return
    if sys.argv[1:] == ["--filter-grad"]:
        filter_grad_main()
        return
    if len(sys.argv) == 4:
        print("RESULT " + json.dumps(_child(*sys.argv[1:])), flush=True)
        return
    import tensorflow as tf

    print(f"TF {tf.__version__}, TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')}")
    print(f"{'kind':7s} {'form':8s} {'dtype':9s} {'status':8s} {'median ms':>9s} {'min ms':>7s}  executed ops / why")
    for kind, form, dtn in FORMS:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), kind, form, dtn],
                           capture_output=True, text=True, timeout=600)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[0][7:]) if line else {"status": f"died rc={p.returncode}",
                                                   "why": (p.stderr.strip().splitlines() or [""])[-1][:120]}
        if r["status"] == "runs":
            print(f"{kind:7s} {form:8s} {dtn:9s} {'runs':8s} {r['ms']:9.1f} {r['min_ms']:7.1f}  {', '.join(r['ops'])}")
        else:
            print(f"{kind:7s} {form:8s} {dtn:9s} {r['status']:8s} {'-':>9s} {'-':>7s}  {r.get('why', '')}")


if __name__ == "__main__":
    main()
