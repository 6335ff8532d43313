"""Keras 3 graphs (tf.keras on TF >= 2.16): precision on real keras.layers (Dense writes its
bias as BiasAdd/Add of a reshaped bias, LayerNormalization as moments + Neg), a quiet FP16
overflow check on an attention-mask constant, and a KerasHub-style transformer trained under
enable() with AMP_Optimizer(AdamW), compared with FP32 and with Keras 3's own mixed_float16 +
LossScaleOptimizer in the same test."""
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

import npu_amp_tf
from npu_amp_tf import bridge

keras = pytest.importorskip("keras")
if int(keras.__version__.split(".")[0]) < 3:
    pytest.skip(f"Keras 3 is not installed for TensorFlow {tf.__version__} (it ships Keras 2)",
                allow_module_level=True)

HALF, FLOAT = types_pb2.DT_HALF, types_pb2.DT_FLOAT


def frozen(model, shape):
    f = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec(shape, tf.float32, name="x"))
    gd = convert_variables_to_constants_v2(f).graph.as_graph_def()
    out = [n.name for n in gd.node if n.op == "Identity" and n.name.startswith("Identity")][0]
    return gd, out


def run(gd, fetches, feeds):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as s:
        return s.run(fetches, feeds)


def test_keras3_dense_and_layer_norm_precision():
    """Real Keras 3 layers: the matmuls go FP16, LayerNormalization's moments (Mean, the
    variance's SquaredDifference) and its Rsqrt stay FP32, and the result matches FP32."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 16))
    h = keras.layers.Dense(16, activation="gelu", name="d1")(inp)
    h = keras.layers.LayerNormalization(name="ln")(h)
    y = keras.layers.Dense(4, name="d2")(keras.layers.Flatten()(h))
    gd, out = frozen(keras.Model(inp, y), [2, 8, 16])
    ops = {n.op for n in gd.node}
    # what Keras 3 writes (the reason for this test): moments + Neg, a reshaped scale/offset
    assert {"Mean", "SquaredDifference", "Rsqrt", "Neg"} <= ops, ops
    gd2, rep = npu_amp_tf.rewrite_graph(gd, fetches=[out], precision_mode="allow_mix_precision",
                                        graph_level=0, fail_on_error=True)
    by = {n.name: n for n in gd2.node}
    mm = [n for n in gd2.node if n.op == "MatMul"]
    assert len(mm) == 2 and all(n.attr["T"].type == HALF for n in mm)
    stats = [n for n in gd2.node if n.op in ("Mean", "SquaredDifference", "Rsqrt")]
    assert len(stats) == 4 and all(n.attr["T"].type == FLOAT for n in stats), \
        [(n.name, n.attr["T"].type) for n in stats]
    assert by[out].attr["T"].type == FLOAT  # the fetch keeps its dtype
    x = np.random.RandomState(0).randn(2, 8, 16).astype(np.float32)
    (a,), (b,) = run(gd, [out + ":0"], {"x:0": x}), run(gd2, [out + ":0"], {"x:0": x})
    # FP16 inputs to two matmuls of K<=128: ~1e-3 relative per product, LayerNorm in FP32
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max())
    assert rep.summary["casts_inserted"] > 0


def test_fp16_overflow_constant_check_is_quiet():
    """KerasHub BERT adds (1 - mask) * -1e9 style constants to attention scores: the
    constant check must say 'overflows' in the report, not print numpy's RuntimeWarning."""
    g = tf.Graph()
    with g.as_default():
        q = tf.compat.v1.placeholder(tf.float32, [2, 4, 8], name="q")
        scores = tf.matmul(q, q, transpose_b=True)
        mask = tf.constant(np.triu(np.ones((4, 4), np.float32), 1) * -1e9, name="mask")
        tf.nn.softmax(tf.matmul(tf.nn.softmax(scores + mask), q), name="out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gd2, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=["out"],
                                            precision_mode="allow_mix_precision",
                                            fail_on_error=True)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], \
        [str(w.message) for w in caught]
    assert "overflows to inf in float16" in str(rep.decisions)


def test_keras3_accuracy_metric_bitcast_keeps_float32():
    """Keras 3's argmax (the accuracy metrics) bitcasts float32 logits to int32 to find -0.0:
    painting that Bitcast's input FP16 would pack two halves per int32 and change the shape
    ([32, 2] -> [32]); the rewritten graph must import and give FP32's accuracy."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [32, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [32], name="y")
        logits = tf.matmul(x, tf.constant(np.random.RandomState(1).randn(4, 2), tf.float32))
        tf.identity(keras.metrics.sparse_categorical_accuracy(y, logits), name="acc")
    gd = g.as_graph_def()
    assert any(n.op == "Bitcast" for n in gd.node)
    gd2, rep = npu_amp_tf.rewrite_graph(gd, fetches=["acc"], precision_mode="allow_mix_precision",
                                        fail_on_error=True)
    assert [n.attr["T"].type for n in gd2.node if n.op == "MatMul"] == [HALF]
    assert all(n.attr["T"].type == FLOAT for n in gd2.node if n.op == "Bitcast")
    feeds = {"x:0": np.random.RandomState(0).randn(32, 4).astype(np.float32),
             "y:0": np.arange(32) % 2}
    np.testing.assert_array_equal(run(gd2, "acc:0", feeds), run(gd, "acc:0", feeds))


# ------------------------------------------------------------- KerasHub-style
def _transformer(seed=0, T=8, D=16, heads=2, classes=3):
    keras.utils.set_random_seed(seed)
    x = keras.Input((T, D), name="tokens")
    att = keras.layers.MultiHeadAttention(heads, D // heads, name="mha")(x, x)
    h = keras.layers.LayerNormalization(epsilon=1e-6, name="ln1")(x + att)
    ff = keras.layers.EinsumDense("btd,df->btf", output_shape=(T, 2 * D), bias_axes="f",
                                  activation="gelu", name="ff1")(h)
    ff = keras.layers.EinsumDense("btf,fd->btd", output_shape=(T, D), bias_axes="d",
                                  name="ff2")(ff)
    h = keras.layers.LayerNormalization(epsilon=1e-6, name="ln2")(h + ff)
    out = keras.layers.Dense(classes, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    # the classifier head's logits in FP32, as KerasHub does under mixed precision
    out = keras.layers.Activation("linear", dtype="float32", name="logits")(out)
    return keras.Model(x, out)


def _fit(model, opt, x, y, steps):
    model.compile(optimizer=opt, jit_compile=False,  # XLA-compiled functions bypass grappler
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # drop function graphs an earlier test left in the context's buffer
    try:
        hist = model.fit(x, y, batch_size=len(x), epochs=steps, verbose=0, shuffle=False)
        md = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    nodes = [n for fg in md.function_graphs for pg in fg.partition_graphs for n in pg.node]
    return hist.history["loss"], nodes


def _types(nodes, ops):
    out = {}
    for n in nodes:
        if n.op in ops:
            out[n.name] = n.attr["T"].type
    return out


MATRIX = {"MatMul", "_MklMatMul", "_FusedMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
          "_MklBatchMatMulV2", "_MklEinsum"}


def test_keras_hub_style_transformer_amp_vs_fp32_vs_keras_mixed_float16():
    rng = np.random.RandomState(0)
    x = rng.randn(8, 8, 16).astype(np.float32)
    y = (x.mean((1, 2)) > 0).astype(np.int32) + (x[:, 0, 0] > 1).astype(np.int32)
    steps = 6

    fp32_loss, fp32_nodes = _fit(_transformer(), keras.optimizers.AdamW(1e-2), x, y, steps)
    assert set(_types(fp32_nodes, MATRIX).values()) == {FLOAT}

    # Keras 3's own mixed precision: mixed_float16 policy, compile wraps a LossScaleOptimizer
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        km = _transformer()
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    keras_loss, _ = _fit(km, keras.optimizers.AdamW(1e-2), x, y, steps)
    assert type(km.optimizer) is keras.optimizers.LossScaleOptimizer

    # the plugin: enable() rewrites the FP32 model's train function, AMP_Optimizer scales
    npu_amp_tf.enable(precision_mode="allow_mix_precision")
    bridge.clear_reports()
    try:
        model = _transformer()
        opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.AdamW(1e-2))
        amp_loss, nodes = _fit(model, opt, x, y, steps)
    finally:
        npu_amp_tf.disable()
    mm = _types(nodes, MATRIX)
    # forward + backward of the attention projections, scores, FFN and head ran in FP16
    assert len([t for t in mm.values() if t == HALF]) >= 10, mm
    ln_stats = _types(nodes, {"Mean", "Rsqrt"})
    assert ln_stats and set(ln_stats.values()) == {FLOAT}, ln_stats
    assert all(v.dtype == "float32" for v in model.trainable_variables)  # FP32 masters
    st = opt.loss_scale_manager.state()
    assert st["steps"] == steps and st["overflow_count"] == 0 and int(opt.iterations) == steps

    # all three learn, and the plugin's AMP tracks FP32 as closely as Keras's own: after
    # 6 AdamW steps on identical weights, each loss within 2% of FP32 (FP16 rounding of
    # ~1e-3 per matmul input, LayerNorm/softmax in FP32)
    for losses in (fp32_loss, keras_loss, amp_loss):
        assert losses[-1] < losses[0], losses
    np.testing.assert_allclose(amp_loss, fp32_loss, rtol=2e-2)
    np.testing.assert_allclose(keras_loss, fp32_loss, rtol=2e-2)
    amp_err = np.abs(np.array(amp_loss) - fp32_loss).max()
    keras_err = np.abs(np.array(keras_loss) - fp32_loss).max()
    assert amp_err <= 3 * keras_err + 1e-3, (amp_err, keras_err)
