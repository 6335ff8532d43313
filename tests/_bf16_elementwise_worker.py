"""Subprocess worker for tests/test_fusion_bf16_elementwise.py (custom kernels and BF16
training graphs may abort TF, so every run happens here, never in the pytest process).

Kinds (each prints ``RESULT {json}`` lines, then ``DONE``):

* ``kernels``: the ops of ``custom_ops/bf16_elementwise.cc`` called directly on BF16 data
  (random values plus +-0, +-inf, denormals, huge and tiny values; element counts that are
  and are not multiples of 16) next to TF's own BF16 ops on the same data: for AddRelu /
  AddNReluGrad whether the bits are equal and a digest of ours; for BatchNormGradNHWC the
  max error of ours and of TF's BF16 FusedBatchNormGradV3 against a float64 reference
  computed here with NumPy, dscale / doffset errors, and a digest; AddRelu with a broadcast
  leading dim of 1 against TF's BF16 AddV2 -> Relu, JoinGradSum against float64, and the
  InvalidArgument texts of shapes the ops refuse.  Run it with
  ``NPU_AMP_TF_BF16_PORTABLE=1`` too: the digests must agree (AVX-512 vs portable loop).
* ``models`` (one process for every graph check): ``offline`` (below), then one Momentum step
  per configuration, fp32 / ours (``allow_mix_precision_bf16``, graph_level 2) / ``norule`` (ours
  with this project's bf16_* rules removed), from the same weights, of: a small Keras ResNet
  (Keras applications' ResNet code, 2 stacks of 2 bottleneck blocks, images of batch None;
  ``keras``), a small TF-Slim ``resnet_v1`` (2 blocks of 2 units) without and with
  ``resnet_arg_scope()`` (``slim`` / ``slim_bn``), a batch-None join fed equal batches and 1
  against 3 (``join`` / ``join_bcast``): executed op types with dtypes (partition graphs), the
  loss and every variable's update; then the small Keras ResNet under ``train_on_batch``
  (``keras_fit``, ours and norule): executed ops of the function graphs and the loss.
* ``offline``: the Keras ResNet50 graph (static batch 4) rewritten offline in FP32
  (must_keep_origin_dtype), FP16 (allow_mix_precision) and BF16 modes, a small graph of cases the
  rules refuse (a broadcasting add, an AddN of 3, a small plain batch norm, NCHW) and a
  batch-None join: fusion counts and reasons.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402
from _worker_util import executed_ops as _ops  # noqa: E402

tf1 = tf.compat.v1
RULES = ("bf16_add_relu", "bf16_addn_relu_grad", "bf16_relu_bn_grad", "bf16_bn_grad", "bf16_join_grad_sum")
MODE = "allow_mix_precision_bf16"


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def _bf16_bits(shape, rng):
    """BF16 bit patterns: normal values of several scales plus special ones (no NaN)."""
    n = int(np.prod(shape))
    v = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    bits = (v.view(np.uint32) >> 16).astype(np.uint16)
    special = np.array([0x0000, 0x8000, 0x7f80, 0xff80, 0x0001, 0x8001, 0x007f, 0x807f, 0x7f7f, 0xff7f,
                        0x3f80, 0xbf80], np.uint16)
    k = min(n, 3 * len(special))
    idx = rng.choice(n, k, replace=False)
    bits[idx] = np.resize(special, k)
    return bits.reshape(shape)


def _to_tf(bits):
    return tf.bitcast(tf.constant(bits.view(np.int16)), tf.bfloat16)


def _from_tf(t):
    return np.asarray(t).view(np.uint16)


def _mismatches(ours, ref):
    """BF16 elements whose bits differ, where TF's result is not NaN, plus the elements where one
    is NaN and the other not (NaN bits are not compared: TF's own BF16 kernels round a NaN to
    0x7fc0 in their vectorised body and keep its sign in their scalar tail)."""
    on, rn = np.isnan(_widen(ours)), np.isnan(_widen(ref))
    return int(np.sum((ours != ref) & ~rn) + np.sum(on != rn))


def _digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _widen(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def kernels():
    from npu_amp_tf import _loader

    lib = _loader.load()
    rng = np.random.default_rng(0)
    shapes = [(1,), (15,), (16,), (17,), (33,), (1000,), (3, 5, 7, 11), (2, 8, 8, 64), (4, 9, 9, 256)]
    for shp in shapes:
        a, b, f = (_bf16_bits(shp, rng) for _ in range(3))
        # no NaN input: inf + -inf = NaN -> use a + a there (NaN from inf * 0 in ReluGrad stays)
        with np.errstate(invalid="ignore"):
            nan = np.isnan(_widen(a) + _widen(b))
        b[nan] = a[nan]
        ta, tb, tfeat = _to_tf(a), _to_tf(b), _to_tf(f)
        ours_ar = _from_tf(lib.add_relu(ta, tb))
        tf_ar = _from_tf(tf.nn.relu(tf.add(ta, tb)))
        ours_rg = _from_tf(lib.add_n_relu_grad(ta, tb, tfeat))
        tf_rg = _from_tf(tf.raw_ops.ReluGrad(gradients=tf.add_n([ta, tb]), features=tfeat))
        # float kernels against TF's float ops on the widened values
        fa, fb, ff = (_widen(t) for t in (a, b, f))
        fa[np.isinf(fa)], fb[np.isinf(fb)] = 1.0, 1.0
        f_ar = np.asarray(lib.add_relu(tf.constant(fa), tf.constant(fb)))
        f_rg = np.asarray(lib.add_n_relu_grad(tf.constant(fa), tf.constant(fb), tf.constant(ff)))
        _emit(kind="elementwise", shape=list(shp),
              add_relu_mismatches=_mismatches(ours_ar, tf_ar),
              addn_relu_grad_mismatches=_mismatches(ours_rg, tf_rg),
              addn_relu_grad_nans=int(np.isnan(_widen(tf_rg)).sum()),
              # the float kernels: equal values up to denormals (|v| < 2^-126: TF's float kernels may
              # run with denormals-are-zero, a thread's MXCSR setting, and then keep a negative
              # denormal through Relu; +0 == -0 here)
              float_add_relu_equal=bool(np.allclose(f_ar, np.asarray(tf.nn.relu(fa + fb)), rtol=0, atol=2.0 ** -126)),
              float_addn_relu_grad_equal=bool(np.allclose(
                  f_rg, np.asarray(tf.raw_ops.ReluGrad(gradients=tf.add_n([fa, fb]), features=ff)),
                  rtol=0, atol=2.0 ** -126)),
              digest=_digest(ours_ar, ours_rg))
    # AddRelu with a leading dim of 1 on one side (what AddV2 broadcasts where the rule lets a
    # batch-None join through): bit-equal to TF's BF16 AddV2 -> Relu; any other mismatch refused
    for sa, sb in [((1, 17), (5, 17)), ((6, 3, 5, 16), (1, 3, 5, 16)), ((1, 1), (33, 1)), ((3, 2, 9), (1, 2, 9))]:
        a, b = _bf16_bits(sa, rng), _bf16_bits(sb, rng)
        for t in (a, b):  # no inf here (inf + -inf would need pairing across the broadcast)
            t[(t & 0x7fff) == 0x7f80] = 0x3f80
        ta, tb = _to_tf(a), _to_tf(b)
        ours, ref = lib.add_relu(ta, tb), tf.nn.relu(tf.add(ta, tb))
        _emit(kind="broadcast", shapes=[list(sa), list(sb)], out_shape=list(ours.shape),
              ref_shape=list(ref.shape), mismatches=_mismatches(_from_tf(ours), _from_tf(ref)),
              float_equal=bool(np.array_equal(np.asarray(lib.add_relu(tf.cast(ta, tf.float32), tf.cast(tb, tf.float32))),
                                              np.asarray(tf.nn.relu(tf.cast(ta, tf.float32) + tf.cast(tb, tf.float32))))),
              digest=_digest(_from_tf(ours)))
    errors = {}
    for key, call in (("add_relu_2_vs_3", lambda: lib.add_relu(tf.zeros([2, 17], tf.bfloat16), tf.zeros([3, 17], tf.bfloat16))),
                      ("add_relu_inner", lambda: lib.add_relu(tf.zeros([4, 1], tf.bfloat16), tf.zeros([4, 17], tf.bfloat16))),
                      ("addn_relu_grad_lead", lambda: lib.add_n_relu_grad(*(tf.zeros(s, tf.bfloat16) for s in
                                                                             ([1, 17], [5, 17], [5, 17]))))):
        try:
            call()
            errors[key] = None
        except tf.errors.InvalidArgumentError as exc:
            errors[key] = exc.message
    # JoinGradSum: the gradient itself where the shape matches (same bits), its FP32 sum over the
    # leading dim where the target's is 1 (against float64, rounded once: <= half a BF16 ulp
    # + FP32 noise), InvalidArgument otherwise
    for gs in [(5, 17), (3, 2, 9), (7, 1, 33)]:
        g = rng.standard_normal(gs).astype(np.float32)
        gb = (g.view(np.uint32) >> 16).astype(np.uint16)
        same = _from_tf(lib.join_grad_sum(_to_tf(gb), tf.constant(list(gs), tf.int32)))
        summed = lib.join_grad_sum(_to_tf(gb), tf.constant([1] + list(gs[1:]), tf.int64))
        ref = _widen(gb).astype(np.float64).sum(0, keepdims=True)
        err = np.abs(_widen(_from_tf(summed)) - ref) / np.maximum(np.abs(ref), 1e-30)
        _emit(kind="join_grad_sum", shape=list(gs), same_equal=bool(np.array_equal(same, gb)),
              sum_shape=list(summed.shape), sum_rel_err=float(err.max()), dtype=summed.dtype.name,
              digest=_digest(_from_tf(summed)))
    try:
        lib.join_grad_sum(tf.zeros([4, 3], tf.bfloat16), tf.constant([2, 3]))
        errors["join_grad_sum_2"] = None
    except tf.errors.InvalidArgumentError as exc:
        errors["join_grad_sum_2"] = exc.message
    _emit(kind="broadcast_errors", errors=errors)
    eps = 1e-3
    for shp in [(2, 8, 8, 64), (4, 5, 7, 24), (16, 4, 4, 512), (3, 3, 3, 17)]:
        C = shp[-1]
        x = rng.standard_normal(shp).astype(np.float32) * 3 + 1
        dy = rng.standard_normal(shp).astype(np.float32)
        ry = rng.standard_normal(shp).astype(np.float32)
        x, dy, ry = (((t.view(np.uint32) >> 16).astype(np.uint16)) for t in (x, dy, ry))
        x64, dy64, ry64 = (_widen(t).astype(np.float64) for t in (x, dy, ry))
        mean = x64.mean((0, 1, 2)).astype(np.float32)
        var = x64.var((0, 1, 2)).astype(np.float32)
        scale = rng.uniform(0.5, 1.5, C).astype(np.float32)
        res = {"kind": "bn_grad", "shape": list(shp)}
        digests = []
        for relu in (False, True):
            g64 = dy64 * (ry64 > 0) if relu else dy64
            r = 1.0 / np.sqrt(var.astype(np.float64) + eps)
            xh = (x64 - mean.astype(np.float64)) * r
            n = float(np.prod(shp[:3]))
            db = g64.sum((0, 1, 2))
            ds = (g64 * xh).sum((0, 1, 2))
            dx = scale * r * (g64 - db / n - xh * ds / n)
            tdy, tx = _to_tf(dy), _to_tf(x)
            tg = tf.raw_ops.ReluGrad(gradients=tdy, features=_to_tf(ry)) if relu else tdy
            ref_tf = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=tg, x=tx, scale=scale, reserve_space_1=mean, reserve_space_2=var,
                reserve_space_3=tf.zeros([0]), epsilon=eps, data_format="NHWC", is_training=True)
            ours = lib.batch_norm_grad_nhwc(tdy, tx, scale, mean, var, [_to_tf(ry)] if relu else [], epsilon=eps)
            scl = max(float(np.abs(dx).max()), 1e-30)
            key = "relu" if relu else "plain"
            res[key] = {
                "dx_err_ours": float(np.abs(_widen(_from_tf(ours[0])) - dx).max() / scl),
                "dx_err_tf": float(np.abs(_widen(_from_tf(ref_tf[0])) - dx).max() / scl),
                "dscale_err": float(np.abs(np.asarray(ours[1], np.float64) - ds).max()
                                    / max(np.abs(ds).max(), 1e-30)),
                "doffset_err": float(np.abs(np.asarray(ours[2], np.float64) - db).max()
                                     / max(np.abs(db).max(), 1e-30)),
                "dx_dtype": ours[0].dtype.name, "dscale_dtype": ours[1].dtype.name}
            digests += [_from_tf(ours[0]), np.asarray(ours[1]), np.asarray(ours[2])]
        res["digest"] = _digest(*digests)
        _emit(**res)


# ------------------------------------------------------------------ training graphs
def _keras2():
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras
        return tf_keras
    return tf.keras


def _keras_resnet_module():
    """The module of ``keras.applications.ResNet50`` (Keras 2: tf.keras on 2.15, tf_keras later):
    its ``ResNet`` builder and ``stack1`` (the bottleneck blocks ResNet50 is made of)."""
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        from tf_keras.src.applications import resnet
    else:
        from keras.src.applications import resnet
    return resnet


def keras_small_resnet(x, full=False):
    """Keras applications' ResNet code (``resnet.ResNet`` + ``stack1``, as ``ResNet50`` calls them)
    with 2 stacks of 2 bottleneck blocks (``full``: ResNet50 itself, 4 stacks of 3/4/6/3): the stem
    conv -> BN -> Relu -> max pool, then per block conv -> BN -> Relu twice, conv -> BN, a conv -> BN
    projection shortcut in each stack's first block, and relu(shortcut + residual).  At 64x64 the
    first stack runs at 16x16, the second at 8x8."""
    K = _keras2()
    resnet = _keras_resnet_module()
    if full:
        return K.applications.ResNet50(weights=None, input_tensor=x, classes=10)

    def stack_fn(t):
        t = resnet.stack1(t, 16, 2, stride1=1, name="conv2")
        return resnet.stack1(t, 32, 2, name="conv3")

    return resnet.ResNet(stack_fn, False, True, "resnet_small", weights=None, input_tensor=x, classes=10)


def build_keras(full=False, batch=4, batch_none=True):
    """The Keras net in a TF1 graph, one Momentum step; ``batch_none``: the images placeholder has
    batch None (as Keras' own Input and TF2 function graphs: the residual adds have an unknown
    leading dim), else ``batch``."""
    K = _keras2()
    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [None if batch_none else batch, 64, 64, 3], name="images")
    y = tf1.placeholder(tf.int32, [None if batch_none else batch], name="labels")
    K.backend.set_learning_phase(1)
    model = keras_small_resnet(x, full)
    loss = tf.reduce_mean(K.losses.sparse_categorical_crossentropy(y, model.output))
    with tf.control_dependencies(model.updates):
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, var_list=model.trainable_weights)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(0, 1, [batch, 64, 64, 3]).astype(np.float32), y: np.arange(batch) % 10}
    return feeds, loss, train


def build_slim(bn=False):
    """TF-Slim's ``resnet_v1`` (the code ``resnet_v1_50`` calls) with 2 blocks of 2 bottleneck units
    (``resnet_v1_block``; base depths 16 and 32, the first block strided in its last unit) at 64x64,
    batch 2: as benchmarks/end_to_end.py builds resnet_v1_50 (no arg scope: conv + bias, the
    residual add and Relu fused into the conv by ``bias_add_act``), or (``bn``) under
    ``resnet_arg_scope()`` (conv -> fused batch norm -> Relu, as TF-Slim's training scripts)."""
    import contextlib

    from real_models import import_slim

    import_slim()
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [2, 64, 64, 3], name="images")
    y = tf1.placeholder(tf.int32, [2], name="labels")
    blocks = [resnet_v1.resnet_v1_block("block1", base_depth=16, num_units=2, stride=2),
              resnet_v1.resnet_v1_block("block2", base_depth=32, num_units=2, stride=1)]
    with (slim.arg_scope(resnet_v1.resnet_arg_scope()) if bn else contextlib.nullcontext()):
        logits, _ = resnet_v1.resnet_v1(x, blocks, num_classes=10, is_training=True, global_pool=True,
                                        scope="resnet_small")
    logits = tf.reshape(logits, [2, 10])
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(0, 1, [2, 64, 64, 3]).astype(np.float32), y: np.arange(2)}
    return feeds, loss, train


def build_join(batch_a=3, batch_b=3):
    """Two convs of batch-None inputs joined by relu(a + b) (the rule fires: one rank, equal known
    dims but the leading one); fed with batches ``batch_a`` / ``batch_b`` (1 and 3: AddV2
    broadcasts the leading dim, and so must AddRelu)."""
    tf1.set_random_seed(3)
    xa = tf1.placeholder(tf.float32, [None, 6, 6, 16], name="xa")
    xb = tf1.placeholder(tf.float32, [None, 6, 6, 16], name="xb")
    w = tf1.get_variable("w", [3, 3, 16, 16])
    out = tf.nn.relu(tf.add(tf.nn.conv2d(xa, w, 1, "SAME"), tf.nn.conv2d(xb, w, 1, "SAME")), name="join_relu")
    w2 = tf1.get_variable("w2", [3, 3, 16, 8])
    loss = tf.reduce_mean(tf.square(tf.nn.conv2d(out, w2, 1, "SAME")))  # the join stays inside the graph
    train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
    rng = np.random.RandomState(1)
    feeds = {xa: rng.standard_normal([batch_a, 6, 6, 16]).astype(np.float32),
             xb: rng.standard_normal([batch_b, 6, 6, 16]).astype(np.float32)}
    return feeds, loss, train


def train_runs(build, kind):
    """One step per configuration from the same start; emits (tagged ``kind``) the executed ops and
    loss per configuration, then (``config="updates"``) the relative L2 distances between the three
    configurations' updates of all variables (the moving statistics included), concatenated in
    name order (not printed themselves)."""
    from graph_passes.fusion import RULES as REG

    start = None
    upd = {}
    for name in ("fp32", "ours", "norule"):
        cfg = tf1.ConfigProto() if name == "fp32" else npu_amp_tf.session_config(
            precision_mode=MODE, graph_level=2, fail_on_error=True,
            keep_dtype_nodes=["__norule__"] if name == "norule" else [])
        saved = {k: REG.pop(k) for k in RULES} if name == "norule" else {}
        try:
            g = tf.Graph()
            with g.as_default():
                feeds, loss, train = build()
                gvars = {v.op.name: v for v in tf1.global_variables() if "momentum" not in v.op.name.lower()}
                init = tf1.global_variables_initializer()
            with tf1.Session(graph=g, config=cfg) as s:
                s.run(init)
                if start is None:
                    start = s.run(gvars)
                else:
                    for k, v in gvars.items():
                        v.load(start[k], s)
                md = tf1.RunMetadata()
                lv, _ = s.run([loss, train], feeds, options=tf1.RunOptions(output_partition_graphs=True),
                              run_metadata=md)
                after = s.run(gvars)
                upd[name] = np.concatenate([(after[k] - start[k]).astype(np.float64).ravel() for k in sorted(gvars)])
        finally:
            REG.update(saved)
        _emit(kind=kind, config=name, loss=float(np.sum(lv, dtype=np.float64)), loss_digest=_digest(lv), ops=_ops(md))

    def rl(a, b):
        return float(np.linalg.norm(upd[a] - upd[b]) / max(np.linalg.norm(upd[b]), 1e-30))

    _emit(kind=kind, config="updates", ours_fp32=rl("ours", "fp32"), norule_fp32=rl("norule", "fp32"),
          ours_norule=rl("ours", "norule"), finite=bool(np.all(np.isfinite(upd["ours"]))), size=int(upd["ours"].size))


def _count_fused(rep):
    st = rep.pass_stats("fusion")
    return {k: st.get("fused", {}).get(k, 0) for k in RULES}


def offline():
    g = tf.Graph()
    with g.as_default():
        _, loss, train = build_keras(full=True, batch_none=False)
    gd = g.as_graph_def()
    orig = Counter(n.op for n in gd.node)
    for mode in (MODE, "must_keep_origin_dtype", "allow_mix_precision", MODE + ":NC1HWC0"):
        extra = {"format_mode": "NC1HWC0"} if mode.endswith(":NC1HWC0") else {}
        rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=[loss.op.name, train.name], precision_mode=mode.split(":")[0],
                                            graph_level=2, **extra)
        reasons = sorted({d.get("fusion_reason", "") for d in rep.decisions.values()
                          if d.get("fusion_skipped") in RULES})
        off = rep.pass_stats("fusion").get("rules_off", {})
        _emit(kind="offline_keras", mode=mode, fused=_count_fused(rep), reasons=reasons,
              off={k: off.get(k) for k in RULES},
              orig={k: orig[k] for k in ("Relu", "FusedBatchNormGradV3", "AddN", "ReluGrad")},
              ops=dict(Counter(n.op for n in rgd.node)))
    # cases the rules refuse, in the BF16 mode
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        x = tf1.placeholder(tf.float32, [2, 4, 4, 16], name="x")
        w = tf1.get_variable("w", [1, 1, 16, 16])
        c = tf.nn.conv2d(x, w, 1, "SAME")
        # a broadcasting join: [2,4,4,16] + [2,1,1,16] (not a bias: a per-sample mean)
        r1 = tf.nn.relu(tf.add(c, tf.reduce_mean(c, [1, 2], keepdims=True), name="bcast_add"), name="bcast_relu")
        # a relu read three times: its gradient is an AddN of 3
        r2 = tf.nn.relu(tf.nn.conv2d(r1, w, 1, "SAME"), name="tri_relu")
        h = tf.nn.conv2d(r2, w, 1, "SAME") + tf.nn.conv2d(r2, w, 1, "SAME") + tf.nn.conv2d(r2, w, 1, "SAME")
        # a small training batch norm (32 rows) without a Relu after it, NHWC, and one NCHW
        gam, bet = tf1.get_variable("g", [16]), tf1.get_variable("b", [16])
        bn = tf1.nn.fused_batch_norm(h, gam, bet, is_training=True)[0]
        bn2 = tf1.nn.fused_batch_norm(tf.transpose(bn, [0, 3, 1, 2]), gam, bet, is_training=True,
                                      data_format="NCHW")[0]
        loss = tf.reduce_sum(bn2 * bn2)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    gd = g.as_graph_def()
    rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=[loss.op.name, train.name], precision_mode=MODE, graph_level=2)
    reasons = {}
    for name, d in rep.decisions.items():
        if d.get("fusion_skipped") in RULES:
            reasons[name] = [d["fusion_skipped"], d.get("fusion_reason", "")]
    _emit(kind="offline_refusals", fused=_count_fused(rep), reasons=reasons,
          ops=dict(Counter(n.op for n in rgd.node)))
    # batch-None joins: equal known dims but the leading one (fires), a per-sample mean (refused)
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        x = tf1.placeholder(tf.float32, [None, 4, 4, 16], name="x")
        w = tf1.get_variable("w", [1, 1, 16, 16])
        c1, c2 = tf.nn.conv2d(x, w, 1, "SAME"), tf.nn.conv2d(tf.nn.relu(x), w, 1, "SAME")
        j = tf.nn.relu(tf.add(c1, c2), name="none_relu")
        k = tf.nn.relu(tf.add(j, tf.reduce_mean(j, [1, 2], keepdims=True)), name="none_bcast_relu")
        loss = tf.reduce_sum(k)
    rgd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[loss.op.name], precision_mode=MODE, graph_level=2)
    reasons = {name: [d["fusion_skipped"], d.get("fusion_reason", "")] for name, d in rep.decisions.items()
               if d.get("fusion_skipped") in RULES}
    _emit(kind="offline_batch_none", fused=_count_fused(rep), reasons=reasons,
          ops={n.name: n.op for n in rgd.node if n.name in ("none_relu", "none_bcast_relu")})


def keras_fit():
    """The small Keras ResNet trained by ``train_on_batch`` (the ``fit`` train function, TF2: its
    graph is rewritten when the function is instantiated) under ours and ``norule``, from the same
    weights: executed ops with dtypes (run metadata of the function graphs) and the loss."""
    from tensorflow.python.eager import context

    from graph_passes.fusion import RULES as REG

    K = _keras2()
    resnet = _keras_resnet_module()

    def stack_fn(t):
        t = resnet.stack1(t, 16, 2, stride1=1, name="conv2")
        return resnet.stack1(t, 32, 2, name="conv3")

    rng = np.random.RandomState(0)
    x, y = rng.uniform(0, 1, [4, 64, 64, 3]).astype(np.float32), np.arange(4)
    w0 = None
    for name in ("ours", "norule"):
        # a model per configuration (its own variables: another function graph, rewritten anew)
        K.backend.clear_session()
        tf.random.set_seed(1)
        model = resnet.ResNet(stack_fn, False, True, "resnet_small", weights=None, input_shape=(64, 64, 3),
                              classes=10)
        w0 = model.get_weights() if w0 is None else w0
        saved = {k: REG.pop(k) for k in RULES} if name == "norule" else {}
        # (another option for norule: the plugin caches rewrites per graph and options)
        npu_amp_tf.enable(precision_mode=MODE, graph_level=2, keep_dtype_nodes=["__norule__"] if name == "norule" else [])
        ctx = context.context()
        try:
            model.set_weights(w0)
            model.compile(K.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy")
            ctx.enable_run_metadata()
            lv = model.train_on_batch(x, y)
            md = ctx.export_run_metadata()
        finally:
            ctx.disable_run_metadata()
            npu_amp_tf.disable()
            REG.update(saved)
        ops = Counter()
        for fg in md.function_graphs:
            for pg in fg.partition_graphs or [fg.post_optimization_graph]:
                for n in pg.node:
                    ops[f"{n.op}:{tf.dtypes.as_dtype(n.attr['T'].type).name if 'T' in n.attr else ''}"] += 1
        _emit(kind="keras_fit", config=name, loss=float(lv), ops=dict(ops))


def models():
    """Every graph check in one process (one TF start): the offline rewrites, then the training
    steps of the small Keras and TF-Slim ResNets and of the batch-None join (equal batches, and a
    batch of 1 broadcast against 3)."""
    offline()
    train_runs(build_keras, "keras")
    train_runs(build_slim, "slim")
    train_runs(lambda: build_slim(bn=True), "slim_bn")
    train_runs(build_join, "join")
    train_runs(lambda: build_join(1, 3), "join_bcast")
    keras_fit()


if __name__ == "__main__":
    kind = sys.argv[1]
    {"kernels": kernels, "models": models, "offline": offline}[kind]()
    print("DONE", flush=True)
