"""Python API of npu_amp_tf.tools on real small models built with TF.

The model builders here are shared with tests/test_cli.py.
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

FP16_MAX = 65504.0


# --------------------------------------------------------------------------
# model builders (real TF graphs, small shapes: FP16 kernels are slow here)
# --------------------------------------------------------------------------
def mlp_graph_def():
    """Frozen MLP: x[2,8] -> MatMul -> BiasAdd -> Relu -> MatMul -> Softmax (y)."""
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        w1 = tf.constant(rng.standard_normal((8, 16)).astype(np.float32), name="w1")
        b1 = tf.constant(np.full(16, 0.1, np.float32), name="b1")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1, name="fc1/MatMul"), b1, name="fc1/BiasAdd"),
                       name="fc1/Relu")
        w2 = tf.constant(rng.standard_normal((16, 4)).astype(np.float32), name="w2")
        logits = tf.matmul(h, w2, name="fc2/MatMul")
        tf.nn.softmax(logits, name="y")
    return g.as_graph_def()


def overflow_graph_def():
    """A graph with one op that overflows in FP16 only.

    ``big/MatMul`` sums 16 products of ~100 x ~100: ~1.6e5 in FP32, above the
    FP16 maximum 65504, so inf once the rewrite runs it in FP16.  Everything
    after it is scaled down (finite in FP32).  A second, benign white op
    (``small/BatchMatMul``) runs fine in FP16.
    """
    g = tf.Graph()
    rng = np.random.default_rng(1)
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 16], name="x")
        w = tf.constant(np.full((16, 8), 100.0, np.float32), name="w_big")
        h = tf.matmul(x, w, name="big/MatMul")
        s = tf.multiply(h, tf.constant(1e-3, tf.float32), name="scale")
        s3 = tf.reshape(s, [2, 1, 8], name="to3d")
        w2 = tf.constant(rng.uniform(0.05, 0.15, (1, 8, 4)).astype(np.float32), name="w_small")
        bm = tf.linalg.matmul(s3, w2, name="small/BatchMatMul")
        tf.reshape(bm, [2, 4], name="out")
    return g.as_graph_def()


def overflow_inputs():
    rng = np.random.default_rng(2)
    return {"x": rng.uniform(90.0, 110.0, (2, 16)).astype(np.float32)}


def write_pb(gd, path, text=False):
    if text:
        from google.protobuf import text_format
        with open(path, "w") as fh:
            fh.write(text_format.MessageToString(gd))
    else:
        with open(path, "wb") as fh:
            fh.write(gd.SerializeToString())
    return str(path)


def write_metagraph(path):
    """TF1 MetaGraph with variables, a signature and a train op."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.random.default_rng(3).standard_normal(
            (8, 4)).astype(np.float32))
        y = tf.nn.relu(tf.matmul(x, w, name="dense/MatMul"), name="y")
        loss = tf.reduce_mean(tf.square(y), name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf.compat.v1.add_to_collection("train_op", train)
        sig = tf.compat.v1.saved_model.signature_def_utils.predict_signature_def({"x": x}, {"y": y})
        mg = tf.compat.v1.train.export_meta_graph(graph=g)
        mg.signature_def["serving_default"].CopyFrom(sig)
    with open(path, "wb") as fh:
        fh.write(mg.SerializeToString())
    return str(path)


def write_saved_model(path):
    """TF2 SavedModel: a tf.Module with variables and a serving signature."""
    class M(tf.Module):
        def __init__(self):
            rng = np.random.default_rng(4)
            self.w = tf.Variable(rng.standard_normal((8, 16)).astype(np.float32))
            self.w2 = tf.Variable(rng.standard_normal((16, 4)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w)), self.w2)}

    m = M()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return str(path)


def run_gd(gd, feeds, fetches):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as s:
        return s.run(fetches, feeds)


# --------------------------------------------------------------------------
# tests of the Python API
# --------------------------------------------------------------------------
def test_tensor_stats_fp16_range():
    from npu_amp_tf.tools import tensor_stats

    ref = np.array([1e5, -7e4, 1.0, 1e-9, 0.0], np.float32)
    with np.errstate(over="ignore"):
        got = ref.astype(np.float16)
    s = tensor_stats(ref, got)
    assert s["fp16_overflow"] == pytest.approx(2 / 5)
    assert s["fp16_underflow"] == pytest.approx(1 / 5)
    assert s["mixed_nonfinite"] == 2 and s["max_abs_err"] == float("inf")
    s = tensor_stats(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.5], np.float16))
    assert s["max_abs_err"] == pytest.approx(0.5) and s["max_rel_err"] == pytest.approx(0.5 / 3)
    assert 0.99 < s["cosine"] < 1.0


def _model(gd, tmp_path, name="m.pb"):
    from npu_amp_tf.tools import load_model
    return load_model(write_pb(gd, tmp_path / name))


def test_dump_compare_api_and_negative_control(tmp_path):
    from npu_amp_tf.options import Options
    from npu_amp_tf.tools import compare, dump, load_inputs, runnable

    np.savez(tmp_path / "in.npz", **overflow_inputs())
    run = runnable(_model(overflow_graph_def(), tmp_path))
    feeds = load_inputs(str(tmp_path / "in.npz"), run)
    dump(run, feeds, str(tmp_path / "mixed"), progress=False)
    assert compare(str(tmp_path / "mixed")).overflow["node"] == "big/MatMul"
    # same graph, no precision change: nothing overflows, nothing diverges
    keep = Options.from_kwargs(_groups=("rewrite",), precision_mode="must_keep_origin_dtype")
    dump(run, feeds, str(tmp_path / "keep"), keep, progress=False)
    res = compare(str(tmp_path / "keep"))
    assert res.overflow is None
    assert all(r["max_abs_err"] == 0 for r in res.rows)


def test_model_io_inputs_and_roundtrip(tmp_path):
    from npu_amp_tf.tools import ToolError, load_inputs, load_model, runnable, save_model

    m = load_model(write_pb(mlp_graph_def(), tmp_path / "m.pbtxt", text=True))
    assert m.kind == "graphdef" and not m.binary and m.inputs == {"x": "x:0"} and m.outputs == {"y": "y:0"}
    save_model(m, m.graph_def, str(tmp_path / "copy.pbtxt"))
    assert load_model(str(tmp_path / "copy.pbtxt")).graph_def == m.graph_def
    run = runnable(m)
    for key in ("x", "x:0"):
        np.savez(tmp_path / "in.npz", **{key: np.zeros((2, 8), np.float32)})
        assert list(load_inputs(str(tmp_path / "in.npz"), run)) == ["x:0"]
    np.savez(tmp_path / "none.npz")
    with pytest.raises(ToolError, match="no value for placeholder"):
        load_inputs(str(tmp_path / "none.npz"), run)


def test_metagraph_runnable_uses_same_weights(tmp_path):
    from npu_amp_tf.tools import load_model, run_graph, runnable

    m = load_model(write_metagraph(tmp_path / "m.meta"))
    assert m.kind == "metagraph" and m.signature == "serving_default"
    run = runnable(m)
    # the variable stays a variable (as in the job); its value, read once from the initializer, is loaded
    assert [n.name for n in run.graph_def.node if n.op in ("VariableV2", "VarHandleOp")] == ["w"]
    x = np.ones((2, 8), np.float32)
    w = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    np.testing.assert_array_equal(run.variables["w"], w)
    (y,) = run_graph(run.graph_def, {"x:0": x}, [run.outputs["y"]], variables=run.variables)
    np.testing.assert_allclose(y, np.maximum(x @ w, 0), rtol=1e-5)


def test_profile_shares_against_fp32_control(tmp_path):
    from npu_amp_tf.options import Options
    from npu_amp_tf.tools import profile_graph, runnable
    from npu_amp_tf.tools.model_io import rewrite_runnable

    run = runnable(_model(mlp_graph_def(), tmp_path))
    feeds = {"x:0": np.ones((2, 8), np.float32)}
    for mode, low in (("must_keep_origin_dtype", False), ("allow_mix_precision", True)):
        gd, _ = rewrite_runnable(run, Options.from_kwargs(_groups=("rewrite",), precision_mode=mode))
        s = profile_graph(gd, feeds, ["y:0"], 2, str(tmp_path / mode), progress=False)
        assert (s["lp_compute_share"] > 0) is low
        assert (s["cast_transdata_share"] > 0) is low
        assert json.load(open(tmp_path / mode / "timeline.json"))["traceEvents"]
