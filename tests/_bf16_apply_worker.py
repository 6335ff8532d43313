"""Subprocess worker for tests/test_fusion_bf16_apply.py (a custom kernel may abort TF, so every
run happens here, never in the pytest process).

Kinds (each prints ``RESULT {json}`` lines, then ``DONE``):

* ``kernels``: ``ResourceApplyMomentumMixed`` called directly, 3 updates from the same FP32 var and
  accum, next to TF's own ``Cast(bf16 -> f32) -> ResourceApplyMomentum`` /
  ``ResourceApplyKerasMomentum`` (plain and Nesterov; sizes below and above the kernel's sharding
  threshold; gradients with +-0, denormal and large values), and with a float32 gradient next to
  TF's op on it: whether var and accum are equal bit for bit; the InvalidArgument text of a
  gradient of another shape.
* ``models``: 3 Momentum steps per configuration, ``ours`` (``allow_mix_precision_bf16``,
  graph_level 2) and ``norule`` (ours with ``bf16_apply_momentum`` out of the registry), from the
  same weights, of a small TF-Slim ``resnet_v1`` (2 blocks of 2 units; as end_to_end.py's
  resnet_v1_50: conv + bias), the same under ``resnet_arg_scope()`` with Nesterov momentum, a
  small Keras-applications ResNet (``stack1`` blocks) with ``MomentumOptimizer`` and with Keras'
  legacy ``SGD(momentum, nesterov)`` (``ResourceApplyKerasMomentum``): executed op counts with
  dtypes, the widening Casts executed, the loss of every step, and whether every variable (the
  momentum slots included) is equal bit for bit after the steps; then the same Keras ResNet under
  ``train_on_batch`` (TF2 function graphs, ``enable()``) with the legacy ``SGD(momentum)``.
* ``offline``: rewrites of graphs the rule must refuse or leave alone: FP32 / FP16 / NC1HWC0 modes
  on the small Slim ResNet, and in the BF16 mode an update whose gradient is a gray op's
  (BiasAddGrad of an FP32 loss gradient), a float64 variable, and a ref-variable ``ApplyMomentum``:
  counts fused and the reported reasons.
"""
from __future__ import annotations

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
from _worker_util import executed_ops  # noqa: E402

tf1 = tf.compat.v1
RULE = "bf16_apply_momentum"
MODE = "allow_mix_precision_bf16"


def _emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def _grad_values(n, rng):
    g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-39, -1e-39, 3e38, -3e38, 1e-3, 7.0], np.float32)
    g[:min(n, specials.size)] = specials[:min(n, specials.size)]
    return g


def kernels():
    from npu_amp_tf import _loader

    mod = _loader.load()
    rng = np.random.default_rng(0)
    for keras in (False, True):
        for nesterov in (False, True):
            for shape in ((3, 3, 16, 32), (7,), (1000, 100)):
                n = int(np.prod(shape))
                v0 = rng.standard_normal(shape).astype(np.float32)
                a0 = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
                for gdt in (tf.bfloat16, tf.float32):
                    g = tf.constant(_grad_values(n, rng).reshape(shape), gdt)
                    lr, m = np.float32(0.0137), np.float32(0.9)
                    res = []
                    for fused in (False, True):
                        v, a = tf.Variable(v0), tf.Variable(a0)
                        for _ in range(3):
                            if fused:
                                mod.resource_apply_momentum_mixed(var=v.handle, accum=a.handle, lr=lr, grad=g,
                                                                  momentum=m, use_nesterov=nesterov, keras=keras)
                            else:
                                op = (tf.raw_ops.ResourceApplyKerasMomentum if keras
                                      else tf.raw_ops.ResourceApplyMomentum)
                                op(var=v.handle, accum=a.handle, lr=lr, grad=tf.cast(g, tf.float32), momentum=m,
                                   use_nesterov=nesterov)
                        res.append((v.numpy(), a.numpy()))
                    (rv, ra), (ov, oa) = res
                    _emit(kind="kernel", keras=keras, nesterov=nesterov, shape=list(shape), grad=gdt.name,
                          var_equal=bool(np.array_equal(rv.view(np.uint32), ov.view(np.uint32))),
                          accum_equal=bool(np.array_equal(ra.view(np.uint32), oa.view(np.uint32))),
                          changed=bool(not np.array_equal(ov, v0)))
    v, a = tf.Variable(np.zeros([4, 4], np.float32)), tf.Variable(np.zeros([4, 4], np.float32))
    try:
        mod.resource_apply_momentum_mixed(var=v.handle, accum=a.handle, lr=0.1, grad=tf.zeros([4, 5], tf.bfloat16),
                                          momentum=0.9)
        err = ""
    except tf.errors.InvalidArgumentError as exc:
        err = str(exc.message)
    _emit(kind="kernel_error", error=err)


# ------------------------------------------------------------------ graphs
def _slim_logits(x, bn):
    import contextlib

    from real_models import import_slim

    import_slim()
    import tf_slim as slim
    from tf_slim.nets import resnet_v1

    blocks = [resnet_v1.resnet_v1_block("block1", base_depth=16, num_units=2, stride=2),
              resnet_v1.resnet_v1_block("block2", base_depth=32, num_units=2, stride=1)]
    with (slim.arg_scope(resnet_v1.resnet_arg_scope()) if bn else contextlib.nullcontext()):
        logits, _ = resnet_v1.resnet_v1(x, blocks, num_classes=10, is_training=True, global_pool=True,
                                        scope="resnet_small")
    return tf.reshape(logits, [-1, 10])


def build_slim(bn=False, nesterov=False):
    """TF-Slim ``resnet_v1`` (the code ``resnet_v1_50`` calls), 2 blocks of 2 bottleneck units at
    64x64, batch 2, ``MomentumOptimizer`` (``ResourceApplyMomentum``)."""
    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [2, 64, 64, 3], name="images")
    y = tf1.placeholder(tf.int32, [2], name="labels")
    logits = _slim_logits(x, bn)
    loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
        train = tf1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=nesterov).minimize(loss)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(0, 1, [2, 64, 64, 3]).astype(np.float32), y: np.arange(2)}
    return feeds, loss, train


def build_keras(keras_opt=False):
    """Keras applications' ResNet code (2 stacks of 2 ``stack1`` bottleneck blocks, batch None) in a
    TF1 graph; ``MomentumOptimizer`` or (``keras_opt``) Keras' legacy ``SGD(momentum=0.9,
    nesterov=True)``, whose updates are ``ResourceApplyKerasMomentum``."""
    from _bf16_elementwise_worker import _keras2, keras_small_resnet

    K = _keras2()
    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [None, 64, 64, 3], name="images")
    y = tf1.placeholder(tf.int32, [None], name="labels")
    K.backend.set_learning_phase(1)
    model = keras_small_resnet(x)
    loss = tf.reduce_mean(K.losses.sparse_categorical_crossentropy(y, model.output))
    with tf.control_dependencies(model.updates):
        if keras_opt:
            opt = K.optimizers.legacy.SGD(0.05, momentum=0.9, nesterov=True)
            train = tf.group(*opt.get_updates(loss, model.trainable_weights))
        else:
            train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, var_list=model.trainable_weights)
    rng = np.random.RandomState(0)
    feeds = {x: rng.uniform(0, 1, [4, 64, 64, 3]).astype(np.float32), y: np.arange(4) % 10}
    return feeds, loss, train


def _casts(md):
    """{"Cast:src->dst": count} executed (partition graphs)."""
    c = Counter()
    for pg in md.partition_graphs:
        for n in pg.node:
            if n.op == "Cast":
                c[f"Cast:{tf.dtypes.as_dtype(n.attr['SrcT'].type).name}->"
                  f"{tf.dtypes.as_dtype(n.attr['DstT'].type).name}"] += 1
    return dict(c)


def train_runs(build, kind, steps=3):
    from graph_passes.fusion import RULES as REG

    start = None
    after = {}
    for name in ("ours", "norule"):
        cfg = npu_amp_tf.session_config(precision_mode=MODE, graph_level=2, fail_on_error=True,
                                        keep_dtype_nodes=["__norule__"] if name == "norule" else [])
        saved = {RULE: REG.pop(RULE)} if name == "norule" else {}
        try:
            g = tf.Graph()
            with g.as_default():
                feeds, loss, train = build()
                gvars = {v.op.name: v for v in tf1.global_variables()}
                tvars = tf1.trainable_variables()
                init = tf1.global_variables_initializer()
            with tf1.Session(graph=g, config=cfg) as s:
                s.run(init)
                if start is None:
                    start = s.run(gvars)
                else:
                    for k, v in gvars.items():
                        v.load(start[k], s)
                losses = []
                for i in range(steps):
                    md = tf1.RunMetadata()
                    lv, _ = s.run([loss, train], feeds, options=tf1.RunOptions(output_partition_graphs=True),
                                  run_metadata=md)
                    losses.append(float(lv))
                    if i == 0:
                        ops, casts = executed_ops(md), _casts(md)
                after[name] = s.run(gvars)
        finally:
            REG.update(saved)
        _emit(kind=kind, config=name, losses=losses, ops=ops, casts=casts,
              trainable=len(tvars),
              kernels=sum(1 for v in tvars if v.shape.rank >= 2))
    diff = [k for k in sorted(after["ours"])
            if np.asarray(after["ours"][k]).tobytes() != np.asarray(after["norule"][k]).tobytes()]
    moved = sum(1 for k in after["ours"] if not np.array_equal(after["ours"][k], start[k]))
    _emit(kind=kind, config="compare", n_vars=len(after["ours"]), differ=diff[:10], n_differ=len(diff),
          moved=moved)


def keras_fit(steps=2):
    """The small Keras ResNet trained by ``train_on_batch`` (TF2: the train function's graph is rewritten
    when it is instantiated, ``enable()``) with Keras' legacy ``SGD(momentum=0.9)``
    (``ResourceApplyKerasMomentum``), ours and norule from the same weights: executed ops of the
    function graphs (first step), the losses, and whether every weight and slot is equal bit for bit."""
    from tensorflow.python.eager import context

    from _bf16_elementwise_worker import _keras2, _keras_resnet_module
    from graph_passes.fusion import RULES as REG

    K = _keras2()
    resnet = _keras_resnet_module()

    def stack_fn(t):
        t = resnet.stack1(t, 16, 2, stride1=1, name="conv2")
        return resnet.stack1(t, 32, 2, name="conv3")

    rng = np.random.RandomState(0)
    x, y = rng.uniform(0, 1, [4, 64, 64, 3]).astype(np.float32), np.arange(4)
    w0, after = None, {}
    for name in ("ours", "norule"):
        K.backend.clear_session()
        tf.random.set_seed(1)
        model = resnet.ResNet(stack_fn, False, True, "resnet_small", weights=None, input_shape=(64, 64, 3),
                              classes=10)
        w0 = model.get_weights() if w0 is None else w0
        saved = {RULE: REG.pop(RULE)} if name == "norule" else {}
        npu_amp_tf.enable(precision_mode=MODE, graph_level=2,
                          keep_dtype_nodes=["__norule__"] if name == "norule" else [])
        ctx = context.context()
        losses = []
        try:
            model.set_weights(w0)
            opt = K.optimizers.legacy.SGD(0.05, momentum=0.9)
            model.compile(opt, "sparse_categorical_crossentropy")
            for i in range(steps):
                if i == 0:
                    ctx.enable_run_metadata()
                losses.append(float(model.train_on_batch(x, y)))
                if i == 0:
                    md = ctx.export_run_metadata()
                    ctx.disable_run_metadata()
        finally:
            ctx.disable_run_metadata()
            npu_amp_tf.disable()
            REG.update(saved)
        ops = Counter()
        for fg in md.function_graphs:
            for pg in fg.partition_graphs or [fg.post_optimization_graph]:
                for n in pg.node:
                    ops[f"{n.op}:{tf.dtypes.as_dtype(n.attr['T'].type).name if 'T' in n.attr else ''}"] += 1
        after[name] = [np.asarray(w).tobytes() for w in model.get_weights() + opt.get_weights()]
        _emit(kind="keras_fit", config=name, losses=losses, ops=dict(ops),
              kernels=sum(1 for w in model.trainable_weights if len(w.shape) >= 2))
    _emit(kind="keras_fit", config="compare", n_vars=len(after["ours"]),
          n_differ=sum(a != b for a, b in zip(after["ours"], after["norule"])),
          moved=sum(a != np.asarray(b).tobytes() for a, b in zip(after["ours"], w0)))


def models():
    train_runs(build_slim, "slim")
    train_runs(lambda: build_slim(bn=True, nesterov=True), "slim_bn_nesterov")
    train_runs(build_keras, "keras")
    train_runs(lambda: build_keras(keras_opt=True), "keras_sgd")
    keras_fit()


def _fused(rep):
    return rep.pass_stats("fusion").get("fused", {}).get(RULE, 0)


def _reasons(rep):
    return {name: d.get("fusion_reason", "") for name, d in rep.decisions.items()
            if d.get("fusion_skipped") == RULE}


def offline():
    g = tf.Graph()
    with g.as_default():
        _, loss, train = build_slim()
    gd = g.as_graph_def()
    n_apply = sum(1 for n in gd.node if n.op == "ResourceApplyMomentum")
    for mode in (MODE, "must_keep_origin_dtype", "allow_mix_precision", MODE + ":NC1HWC0"):
        extra = {"format_mode": "NC1HWC0"} if mode.endswith(":NC1HWC0") else {}
        rgd, rep = npu_amp_tf.rewrite_graph(gd, fetches=[loss.op.name, train.name],
                                            precision_mode=mode.split(":")[0], graph_level=2, **extra)
        _emit(kind="offline_slim", mode=mode, n_apply=n_apply, fused=_fused(rep),
              reasons=sorted(set(_reasons(rep).values())),
              off=rep.pass_stats("fusion").get("rules_off", {}).get(RULE),
              ops={k: v for k, v in Counter(n.op for n in rgd.node).items() if "Apply" in k})
    # refusals in the BF16 mode
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        x = tf1.placeholder(tf.float32, [8, 16], name="x")
        y = tf1.placeholder(tf.int32, [8], name="y")
        w = tf1.get_variable("w", [16, 10])
        bias = tf1.get_variable("bias", [10])  # its gradient: BiasAddGrad of the FP32 loss gradient
        logits = tf.nn.bias_add(tf.matmul(x, w), bias)
        loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        w64 = tf1.get_variable("w64", [4], dtype=tf.float64)
        loss64 = tf.reduce_sum(tf.square(w64))
        with tf1.variable_scope("ref"):
            wref = tf1.get_variable("wref", [16, 10], use_resource=False)
        lossref = tf.reduce_sum(tf.matmul(x, wref))
        opt = tf1.train.MomentumOptimizer(0.1, 0.9)
        train = tf.group(opt.minimize(loss, var_list=[w, bias], name="main"),
                         opt.minimize(loss64, var_list=[w64], name="f64"),
                         opt.minimize(lossref, var_list=[wref], name="reftrain"))
    rgd, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=[loss.op.name, train.name], precision_mode=MODE,
                                        graph_level=2)
    ops = {n.name: [n.op, tf.dtypes.as_dtype(n.attr["T"].type).name if "T" in n.attr else ""]
           for n in rgd.node if "Apply" in n.op}
    _emit(kind="offline_refusals", fused=_fused(rep), reasons=_reasons(rep), ops=ops)


if __name__ == "__main__":
    kind = sys.argv[1]
    {"kernels": kernels, "models": models, "offline": offline}[kind]()
    print("DONE", flush=True)
