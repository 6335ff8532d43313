"""Issue 13 part 5 on a real Keras model: the offline path (``rewrite_graph``,
``npu-amp rewrite``, ``npu-amp report --html``) on a SavedModel of Keras
MobileNetV2 sees what a session sees.  The function calls are inlined first
(npu_amp_tf/inline.py), so the casts match the session path (``enable()`` +
``model.predict``, measured in the same test), the converted ops are drawn,
and the signature is unchanged.

Shapes are tiny (alpha 0.35, 32x32, batch 2): FP16 kernels on TF 2.15's CPU
are ~100x slower than FP32.  The BatchNorm statistics are set from a batch of
32 (momentum 0, one training-mode call) so activations stay O(1) through the
network; with Keras's fresh statistics (mean 0, variance 1) the logits of the
untrained net are ~1e-11 and FP16 flushes them to zero, and statistics of a
batch of 2 (variance over 2 values at the 1x1 end) amplify rounding ~100x.

FP16 tolerance against FP32: unit roundoff u = 2**-11 ~ 4.9e-4; a dot product
of K terms rounds to ~sqrt(K) u, and L layers add such errors up like a
random walk, sqrt(L).  With L = 53 layers and K = 1280 (the classifier's
dot product, the longest in the net), sqrt(L K) u ~ 12.7% of the logits'
scale: the bound checked.  Against the session path, which runs the same
FP16 ops, the offline result must agree to a few roundings (4 u of scale).
"""
import json
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import npu_amp_tf
from test_offline_inline import session_predict
from npu_amp_tf import cli
from conftest import keras2

CALLS = ("PartitionedCall", "StatefulPartitionedCall")
HW, BATCH, ALPHA = 32, 2, 0.35
U = 2.0 ** -11
TOL = (53 * 1280) ** 0.5 * U  # ~12.7%: see the module docstring


@pytest.fixture(scope="module")
def mnv2(tmp_path_factory):
    k = keras2()
    if k is None:
        pytest.skip("Keras 2 (tf_keras) not installed")
    tf.keras.utils.set_random_seed(13)
    model = k.applications.MobileNetV2(weights=None, alpha=ALPHA, input_shape=(HW, HW, 3), classes=10,
                                       classifier_activation=None)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((BATCH, HW, HW, 3)).astype(np.float32)
    bns = [layer for layer in model.layers if isinstance(layer, k.layers.BatchNormalization)]
    for bn in bns:
        bn.momentum = 0.0
    # moving statistics := those of a batch of 32 (as a trained net's would be)
    model(rng.standard_normal((32, HW, HW, 3)).astype(np.float32), training=True)
    for bn in bns:
        bn.momentum = 0.99
    # the Keras model's serving function saved as a SavedModel signature (a
    # wrapper calling a function whose body holds every layer); Keras's own
    # per-layer restore functions cost ~30 s of tracing and are not served
    serve = tf.function(lambda x: {"logits": model(x, training=False)}).get_concrete_function(
        tf.TensorSpec([None, HW, HW, 3], tf.float32, name="x"))
    module = tf.Module()
    module.variables_ = list(model.variables)
    path = tmp_path_factory.mktemp("mnv2") / "saved"
    tf.saved_model.save(module, str(path), signatures=serve)
    n_conv = sum(isinstance(layer, (k.layers.Conv2D, k.layers.DepthwiseConv2D)) for layer in model.layers)
    return {"model": model, "path": str(path), "x": x, "n_conv": n_conv,
            "ref": model(x, training=False).numpy()}


def _session_path(model, x):
    """The output of Keras's predict function under ``enable()`` and the casts
    the bridge inserted into it (grappler has inlined the layer functions, as
    in any session)."""
    return session_predict(model, x)


def _saved_model(path):
    sm = saved_model_pb2.SavedModel()
    with open(f"{path}/saved_model.pb", "rb") as fh:
        sm.ParseFromString(fh.read())
    return sm.meta_graphs[0]


def _node(t):
    return t.split(":")[0]


def _run_v1(graph_def, mg, variables, x):
    """Run the serving signature of ``graph_def`` as TF1's SavedModel loader
    does: restore through the saver, then feed / fetch the signature tensors."""
    sig = mg.signature_def["serving_default"]
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=g) as s:
        sd = mg.saver_def
        s.run(sd.restore_op_name, {sd.filename_tensor_name: variables})
        return s.run(sig.outputs["logits"].name, {sig.inputs["x"].name: x})


def _close_not_equal(got, ref):
    assert not np.array_equal(got, ref)  # FP16 rounding happened
    scale = np.abs(ref).max()
    assert scale > 0.1, scale  # the check means something (see the module docstring)
    assert np.abs(got - ref).max() <= TOL * scale, (np.abs(got - ref).max(), scale)


def test_rewrite_graph_on_saved_model_inlines_like_a_session(mnv2):
    mg = _saved_model(mnv2["path"])
    gd = mg.graph_def
    sig = mg.signature_def["serving_default"]
    fetches = [_node(t.name) for t in sig.outputs.values()]
    preserve = [_node(t.name) for t in sig.inputs.values()] + [
        _node(mg.saver_def.filename_tensor_name), _node(mg.saver_def.save_tensor_name),
        _node(mg.saver_def.restore_op_name)]
    assert any(n.op in CALLS for n in gd.node) and len(gd.library.function) > 2
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, preserve=preserve)
    # inlined: no call left (all are inlinable), the library is what remains called
    assert not [n.name for n in out.node if n.op in CALLS]
    assert not out.library.function
    # the converted ops are in the main graph
    half = [n for n in out.node if n.op in ("Conv2D", "DepthwiseConv2dNative")
            and n.attr["T"].type == tf.float16.as_datatype_enum]
    assert len(half) == mnv2["n_conv"], (len(half), mnv2["n_conv"])
    # casts within 10% of the session path on the same model
    offline = rep.summary["casts_inserted"] + rep.summary.get("functions_casts_inserted", 0)
    y_session, session = _session_path(mnv2["model"], mnv2["x"])
    assert abs(offline - session) <= 0.1 * session, (offline, session)
    # signature unchanged: input and output nodes keep name, dtype and shape
    before, after = {n.name: n for n in gd.node}, {n.name: n for n in out.node}
    for t in sig.inputs.values():
        n0, n1 = before[_node(t.name)], after[_node(t.name)]
        assert (n1.op, n1.attr["dtype"], n1.attr["shape"]) == (n0.op, n0.attr["dtype"], n0.attr["shape"])

    def out_specs(graph_def):
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        return [(t.name, g.get_tensor_by_name(t.name).dtype, g.get_tensor_by_name(t.name).shape.as_list())
                for t in sig.outputs.values()]
    assert out_specs(out) == out_specs(gd) == [(sig.outputs["logits"].name, tf.float32, [None, 10])]
    # numerically close to FP32 (the original graph, run the same way)
    variables = f"{mnv2['path']}/variables/variables"
    ref = _run_v1(gd, mg, variables, mnv2["x"])
    assert np.abs(ref - mnv2["ref"]).max() <= 1e-3 * np.abs(ref).max()  # graph vs eager FP32 kernels
    got = _run_v1(out, mg, variables, mnv2["x"])
    _close_not_equal(got, ref)
    assert np.abs(got - y_session).max() <= 4 * U * np.abs(ref).max(), np.abs(got - y_session).max()


def test_cli_rewrite_writes_a_saved_model_that_loads_and_runs(mnv2, tmp_path):
    out = tmp_path / "amp"
    assert cli.main(["rewrite", mnv2["path"], str(out)]) == 0
    mg0, mg1 = _saved_model(mnv2["path"]), _saved_model(out)
    assert mg1.signature_def == mg0.signature_def
    x, ref = mnv2["x"], mnv2["ref"]
    # TF2 loader: runs the signature *function*, whose body is now inlined and rewritten
    loaded = tf.saved_model.load(str(out))
    fn = loaded.signatures["serving_default"]
    assert fn.structured_input_signature == tf.saved_model.load(mnv2["path"]).signatures[
        "serving_default"].structured_input_signature
    body = fn.graph.as_graph_def()
    assert not [n.name for n in body.node if n.op in CALLS]
    assert sum(n.op in ("Conv2D", "DepthwiseConv2dNative") and n.attr["T"].type == tf.float16.as_datatype_enum
               for n in body.node) == mnv2["n_conv"]
    _close_not_equal(fn(x=tf.constant(x))["logits"].numpy(), ref)
    # TF1 loader: restores and runs the (inlined, rewritten) main graph
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.Session(graph=g) as s:
        meta = tf.compat.v1.saved_model.loader.load(s, ["serve"], str(out))
        sig = meta.signature_def["serving_default"]
        got = s.run(sig.outputs["logits"].name, {sig.inputs["x"].name: x})
    _close_not_equal(got, ref)


def test_report_html_map_draws_the_converted_ops(mnv2, tmp_path, capsys):
    html, js = tmp_path / "map.html", tmp_path / "rep.json"
    assert cli.main(["report", mnv2["path"], "--html", str(html), "--json", str(js)]) == 0
    page = html.read_text()
    fp16 = int(re.search(r"FP16 \((\d+)\)", page).group(1))
    # every convolution of the model is drawn as FP16 (and what lies between them)
    assert fp16 >= mnv2["n_conv"], (fp16, mnv2["n_conv"])
    s = json.loads(js.read_text())["summary"]
    assert s["lp_flop_share"] == 1.0 and not s.get("functions_casts_inserted")
