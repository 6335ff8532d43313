"""The offline path sees what a Session sees (issue 13, part 5): `npu-amp
report` on a Keras SavedModel (one function per layer) inlines the calls
first, so casts are not put at every layer boundary and the converted ops are
in the drawn graph.  Compared with the session path (enable() + predict) on
the same model, in the same test."""
import json

import numpy as np

import npu_amp_tf
from npu_amp_tf import cli


def _keras_saved_model(k2, path):
    L = k2.layers
    m = k2.Sequential([L.Input((8, 8, 3)), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(),
                       L.ReLU(), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
                       L.MaxPooling2D(), L.Flatten(), L.Dense(4)])
    m.save(str(path))
    return m


def session_predict(m, x):
    """``enable()`` + ``model.predict(x)``: the output and the casts the
    session path inserted into the predict function (body casts included)."""
    npu_amp_tf.bridge.clear_reports()
    npu_amp_tf.enable()
    try:
        y = m.predict(x, verbose=0)
    finally:
        npu_amp_tf.disable()
    reps = [r for r in npu_amp_tf.bridge.last_reports()
            if "predict_function" in r["graph"] and r["status"] == "rewritten"]
    assert reps
    s = reps[0]["report"]["summary"]
    return y, s["casts_inserted"] + s.get("functions_casts_inserted", 0)


def _session_casts(m):
    return session_predict(m, np.zeros((2, 8, 8, 3), np.float32))[1]


def test_report_on_keras_saved_model_inlines_like_a_session(k2, tmp_path, capsys):
    m = _keras_saved_model(k2, tmp_path / "sm")
    out = tmp_path / "rep.json"
    html = tmp_path / "map.html"
    assert cli.main(["report", str(tmp_path / "sm"), "--json", str(out), "--html", str(html)]) == 0
    rep = json.loads(out.read_text())
    s = rep["summary"]
    offline = s["casts_inserted"] + s.get("functions_casts_inserted", 0)
    session = _session_casts(m)
    # the offline report and the session agree within 10% (+1 for tiny counts)
    assert abs(offline - session) <= max(1, 0.1 * session), (offline, session)
    # the converted ops are in the main graph (drawn), not hidden in functions
    assert s["low_precision_nodes"] >= 4 and s["lp_flop_share"] == 1.0
    assert "float16" in html.read_text()


def test_rewrite_graph_inlines_nested_tf_function_calls():
    """``rewrite_graph`` inlines what a session inlines: the inner function's
    MatMul lands in the main graph (FP16), no call is left, the output keeps
    its name and dtype, and the result matches FP32 to FP16 rounding."""
    import tensorflow as tf

    @tf.function
    def inner(x, w):
        return tf.nn.relu(tf.matmul(x, w, name="inner_mm"))

    @tf.function
    def outer(x, w):
        return tf.matmul(inner(x, w), w, name="outer_mm")

    spec = tf.TensorSpec([4, 4], tf.float32)
    cf = outer.get_concrete_function(spec, spec)
    gd = cf.graph.as_graph_def()
    calls = [n.name for n in gd.node if n.op.endswith("PartitionedCall")]
    assert calls
    out_name = cf.outputs[0].name
    # nothing fetched: inlined all the same, the graph's sink keeps its name
    out, _ = npu_amp_tf.rewrite_graph(gd)
    assert not [n.name for n in out.node if n.op.endswith("PartitionedCall")]
    assert out_name.split(":")[0] in {n.name for n in out.node}
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[out_name.split(":")[0]])
    assert not [n.name for n in out.node if n.op.endswith("PartitionedCall")]
    assert not out.library.function
    mms = [n for n in out.node if n.op == "MatMul"]
    assert len(mms) == 2 and all(n.attr["T"].type == tf.float16.as_datatype_enum for n in mms)
    # x and w cast in (w's one cast shared by both MatMuls), the result back to FP32
    assert sum(n.op == "Cast" for n in out.node) == 3
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2))
    ins = [t.name for t in cf.inputs]

    def run(graph_def):
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        assert g.get_tensor_by_name(out_name).dtype == tf.float32
        with tf.compat.v1.Session(graph=g) as s:
            return s.run(out_name, {ins[0]: x, ins[1]: w})

    ref, got = run(gd), run(out)
    # two FP16 roundings of K=4 dot products: ~2 * 2**-11 relative, x4 margin
    np.testing.assert_allclose(got, ref, rtol=8 * 2.0 ** -11, atol=8 * 2.0 ** -11 * np.abs(ref).max())
