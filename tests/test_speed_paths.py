"""The fast paths of issue 17: shapes from grappler's C++ inference (lazy, at
most once per graph), work the C++ bridge skips without calling Python, and
the loud failures that came with them (a pass module that does not import, a
corrupt cached library)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes import shapes as shapes_mod
from graph_passes.functions import function_graph
from graph_passes.graph import Graph
from npu_amp_tf import bridge, pipeline
from real_models import bert_training_graph

tf1 = tf.compat.v1


def cnn_graph(add_shapes=False):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        y = tf1.placeholder(tf.int32, [2], name="y")
        k = tf1.get_variable("k", [3, 3, 3, 5])
        h = tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME"))
        h = tf.reduce_mean(h, axis=[1, 2])
        w = tf1.get_variable("w", [5, 3])
        logits = tf.matmul(h, w, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(add_shapes=add_shapes)


def test_grappler_and_cpp_shapes_equal_tf_importer():
    """Every source gives the shapes TF's own Python importer gives, node by node
    (the importer is the independent reference)."""
    gd = cnn_graph()
    ref = shapes_mod.import_shapes(gd)
    via_item = shapes_mod.grappler_shapes(gd)
    via_cpp = bridge.graph_shape_source(gd)()
    assert ref["logits"] == [[2, 3]] and ref["Conv2D"] == [[2, 8, 8, 5]]
    for node in gd.node:
        assert via_item.get(node.name) == ref[node.name], node.name
        want = ref[node.name] or None  # the C++ lines leave out nodes without outputs
        assert via_cpp.get(node.name) == want, node.name


def test_shape_table_resolves_gradient_transposes():
    """Grappler leaves a Transpose whose perm is InvertPermutation(const) (every
    transpose gradient) with unknown dims; the table resolves it like TF's importer."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 3, 4], name="x")
        w = tf1.get_variable("w", [3, 4, 2])
        y = tf.transpose(x * 2.0, [1, 2, 0], name="t") * w
        tf.gradients(tf.reduce_sum(y), [x], name="grad")
    gd = g.as_graph_def()
    ref = shapes_mod.import_shapes(gd)
    graph = Graph(gd)
    shapes_mod.attach(graph, bridge.graph_shape_source(gd))
    table = shapes_mod.table(graph)
    grads = [n.name for n in gd.node if n.op == "Transpose" and n.name.startswith("grad")]
    assert grads and ref[grads[0]] == [[2, 3, 4]]
    for name in grads:
        assert table.node_shapes(name) == ref[name], name
    # elsewhere grappler's dims agree with the importer's or are unknown (-1)
    for node in gd.node:
        got, want = table.node_shapes(node.name) or [], ref[node.name]
        assert len(got) == len(want), node.name
        for a, b in zip(got, want):
            assert a == b or (a is not None and b is not None and len(a) == len(b)
                              and all(x in (y, -1) for x, y in zip(a, b))), node.name


def test_function_body_shapes_from_grappler():
    @tf.function
    def f(a):
        return tf.matmul(a, tf.ones([3, 4])) * 2.0

    gd = f.get_concrete_function(tf.TensorSpec([2, 3], tf.float32)).graph.as_graph_def()
    outer = Graph(gd)
    fname = next(n for n in outer.functions) if outer.functions else None
    body = function_graph(outer, fname) if fname else outer
    table = shapes_mod.table(body)
    mm = next(n for n in body.nodes.values() if n.op == "MatMul")
    assert table.get(mm.name) in ([2, 4], [-1, 4])
    assert table.error is None


def _counting_shape_source(gd):
    """grappler's C++ shape source for ``gd`` and a list that grows by one per inference."""
    calls = []
    cpp = bridge.graph_shape_source(gd)

    def counting():
        calls.append(1)
        return cpp()

    return calls, counting


def test_pipeline_infers_shapes_once_and_lazily():
    gd = cnn_graph()
    calls, counting = _counting_shape_source(gd)

    _, rep = pipeline.optimize(gd, npu_amp_tf.Options.from_kwargs(), fetches=["loss", "train"],
                               shapes=counting)
    assert calls == []  # the report's shape figures wait for a read
    assert rep.summary["lp_flop_share"] == 1.0 and rep.summary["matrix_flops"] > 0
    assert calls == [1]  # read: inferred exactly once
    # with every shape recorded in _output_shapes, the source is never called
    calls.clear()
    _, rep2 = pipeline.optimize(cnn_graph(add_shapes=True), npu_amp_tf.Options.from_kwargs(),
                                fetches=["loss", "train"], shapes=counting)
    assert calls == []
    assert rep2.summary["matrix_flops"] == rep.summary["matrix_flops"]


def _session_run(graph_def, fetch, feed):
    cfg = tf1.ConfigProto()
    co = cfg.graph_options.rewrite_options.custom_optimizers.add()
    co.name = "NpuAmpOptimizer"
    g = tf.Graph()
    with g.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=g, config=cfg) as s:
        return s.run(fetch, feed)


def test_bridge_skips_integer_graphs_and_its_own_output_without_python():
    bridge.clear_reports()
    g = tf.Graph()
    with g.as_default():
        a = tf1.placeholder(tf.int32, [3], name="a")
        tf.identity(a * 3 + 1, name="out")
    out = _session_run(g.as_graph_def(), "out:0", {"a:0": np.array([1, 2, 3], np.int32)})
    np.testing.assert_array_equal(out, [4, 7, 10])
    st = bridge.stats()
    assert st.get("skipped_no_float", 0) >= 1, st
    assert st.get("calls", 0) == 0, st  # Python was never called

    bridge.clear_reports()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 10.0)
        tf.nn.softmax(tf.matmul(x, w), name="y")
    y = _session_run(g.as_graph_def(), "y:0", {"x:0": np.ones([2, 3], np.float32)})
    st = bridge.stats()
    assert st.get("rewritten", 0) >= 1, st
    # grappler's second meta-optimizer iteration hands our output back: answered in C++
    assert st.get("skipped_seen", 0) >= 1, st
    logits = np.ones([2, 3], np.float32) @ (np.arange(12, dtype=np.float32).reshape(3, 4) / 10.0)
    ref = np.exp(logits - logits.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(y, ref, atol=2e-3)  # FP16 matmul, probabilities <= 1


def test_pass_module_that_fails_to_import_is_a_report_warning(tmp_path, monkeypatch):
    (tmp_path / "npu_amp_broken_pass_mod.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pipeline, "_PASS_MODULES", pipeline._PASS_MODULES + ("npu_amp_broken_pass_mod",))
    monkeypatch.setattr(pipeline, "_import_failures", {})
    _, rep = npu_amp_tf.rewrite_graph(cnn_graph(), fetches=["loss", "train"])
    msgs = [w["message"] for w in rep.warnings]
    assert any("npu_amp_broken_pass_mod" in m and "broken on purpose" in m for m in msgs), msgs
    assert "precision" in rep.summary["pipeline"]  # the other passes still ran
    assert "npu_amp_broken_pass_mod" in pipeline.import_problems()


def test_corrupt_cached_library_is_rebuilt_with_a_warning(tmp_path):
    """A truncated .so in the cache must not make ``import npu_amp_tf`` fail.
    The "compiler" here copies the library this process already built (a real
    compile takes minutes on CI); detection, warning, removal and reload are real."""
    from npu_amp_tf import _loader

    good = str(_loader.library_path())
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import shutil, sys
        out = sys.argv[sys.argv.index("-o") + 1]
        if "-shared" in sys.argv:
            shutil.copy({good!r}, out)
        else:
            open(out, "wb").close()
        """))
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    key = _loader.build_key(str(cxx))
    (cache / key).mkdir(parents=True)
    corrupt = cache / key / _loader.LIB_NAME
    corrupt.write_bytes(b"\x7fELF truncated")
    env = dict(os.environ, NPU_AMP_TF_CACHE_DIR=str(cache), CXX=str(cxx),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("NPU_AMP_TF_LIBRARY", None)
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import npu_amp_tf\nfrom npu_amp_tf import bridge\n"
            "assert bridge.is_registered()\nprint('OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert "does not load" in proc.stderr and "rebuilding it" in proc.stderr, proc.stderr[-3000:]
    assert corrupt.read_bytes() == open(good, "rb").read()


# ------------------------------------------------ report figures on demand
_SHAPE_KEYS = ("lp_flops", "matrix_flops", "lp_flop_share", "matrix_ops_without_shape",
               "activation_bytes_before", "activation_bytes_after",
               "activation_bytes_sum_before", "activation_bytes_sum_after")


def test_report_shape_figures_are_computed_when_read_not_in_the_pass():
    """The precision pass leaves the FLOP share and activation figures (the
    only reason it needs shapes) to the first read of the report: no shape
    inference while grappler waits, exactly one when the report is read."""
    gd = cnn_graph()
    calls, counting = _counting_shape_source(gd)

    out, rep = pipeline.optimize(gd, npu_amp_tf.Options.from_kwargs(graph_level=0),
                                 fetches=["loss", "train"], shapes=counting)
    assert calls == [] and rep.pending
    assert "lp_flop_share" not in rep.raw_summary and rep.raw_summary["casts_inserted"] > 0
    assert rep.summary["lp_flop_share"] == 1.0  # read: computed now, once
    assert calls == [1] and not rep.pending
    # the precision pass's own stats carry them too
    assert rep.pass_stats("precision")["matrix_flops"] == rep.summary["matrix_flops"] > 0


def plugin_only_grappler(gd, fetches=("loss", "train")):
    """``(MetaGraphDef, ConfigProto)`` for ``tf_optimizer.OptimizeGraph`` with
    our plugin the only optimizer, one meta-optimizer iteration."""
    from tensorflow.core.protobuf import meta_graph_pb2

    mg = meta_graph_pb2.MetaGraphDef()
    mg.graph_def.CopyFrom(gd)
    mg.collection_def["train_op"].node_list.value.extend(fetches)
    cfg = tf1.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    ro.min_graph_nodes = -1
    ro.meta_optimizer_iterations = ro.ONE
    ro.custom_optimizers.add().name = "NpuAmpOptimizer"
    return mg, cfg


def optimize_rewritten(cfg, mg, graph_id):
    """One ``OptimizeGraph`` call with the plugin: ``(the output's
    deterministic bytes, the last rewritten graph's report)``; fails when the
    plugin rewrote nothing."""
    from tensorflow.python.grappler import tf_optimizer

    bridge.clear_reports()
    out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=graph_id)
    recs = [r for r in bridge.last_reports() if r["status"] == "rewritten"]
    assert recs, bridge.last_reports()
    return out.SerializeToString(deterministic=True), recs[-1]["report"]


def rewritten_counting(cfg, mg, graph_id, counts, **switches):
    """:func:`optimize_rewritten` with the ``bridge`` switches ``switches``
    set (and left set), and how a counter pair of the library moved over the
    call: ``(bytes, report without its times, (d0, d1))``; ``counts`` is a
    ``bridge`` function giving the pair (``early_index_counts``, ...)."""
    from test_precision_fast import _strip_times

    for name, value in switches.items():
        setattr(bridge, name, value)
    before = counts()
    out, rep = optimize_rewritten(cfg, mg, graph_id)
    after = counts()
    return out, _strip_times(rep), (after[0] - before[0], after[1] - before[1])


def _keras_resnet_training_graph(k, batch=2, size=32):
    g = tf.Graph()
    with g.as_default():
        k.backend.set_learning_phase(1) if hasattr(k.backend, "set_learning_phase") else None
        x = tf1.placeholder(tf.float32, [batch, size, size, 3], name="images")
        y = tf1.placeholder(tf.int32, [batch], name="labels")
        model = k.applications.ResNet50(weights=None, input_tensor=x, classes=10)
        logits = model.output.op.inputs[0] if model.output.op.type == "Softmax" else model.output
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        with tf.control_dependencies(model.updates if hasattr(model, "updates") else []):
            tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, var_list=model.trainable_weights,
                                                            name="train")
    return g.as_graph_def()


def test_deferred_figures_equal_eager_ones_on_keras_resnet50(k2, tmp_path):
    """Keras ResNet50 training graph (32x32): the figures computed when the
    report is read equal those computed inside the pass (``Report.eager``),
    offline and through grappler (``last_reports()`` after the callback, on the
    GraphDef, vs the ``report_path`` file written inside it, on grappler's item)."""
    from graph_passes import manager
    from graph_passes.report import Report

    gd = _keras_resnet_training_graph(k2)
    opts = npu_amp_tf.Options.from_kwargs()
    names = pipeline.pass_names(opts)
    results = []
    for eager in (True, False):
        g = Graph(gd)
        shapes_mod.attach(g, bridge.graph_shape_source(gd))
        rep = Report()
        rep.eager = eager
        manager.PassManager(names).run(g, manager.PassContext(opts, ["loss", "train"], (), (), rep))
        assert rep.pending is not eager
        results.append((g.to_graph_def(), rep))
    (g_eager, r_eager), (g_lazy, r_lazy) = results
    assert g_eager == g_lazy
    s_eager, s_lazy = r_eager.summary, r_lazy.summary
    for key in _SHAPE_KEYS:
        assert s_lazy[key] == s_eager[key], key
    assert s_lazy["matrix_flops"] > 0 and s_lazy["matrix_ops_without_shape"] == 0
    assert s_lazy["activation_bytes_after"] > 0 and s_lazy["activation_bytes_sum_before"] > 0

    # through grappler: the record read after the callback (shapes of the
    # GraphDef) vs the report_path file written inside it (grappler's item)
    import json

    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    mg = meta_graph_pb2.MetaGraphDef()
    mg.graph_def.CopyFrom(gd)
    mg.collection_def["train_op"].node_list.value.extend(["loss", "train"])
    figures = []
    for path in (None, tmp_path):
        bridge.clear_reports()
        cfg = tf1.ConfigProto()
        ro = cfg.graph_options.rewrite_options
        ro.min_graph_nodes = -1
        ro.meta_optimizer_iterations = ro.ONE
        co = ro.custom_optimizers.add()
        co.name = "NpuAmpOptimizer"
        if path is not None:
            co.parameter_map["report_path"].s = str(path).encode()
        tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"resnet")
        if path is None:
            with bridge._lock:
                rec = [r for r in bridge._reports if r["status"] == "rewritten"][-1]
            assert rec["report"].pending  # nobody read it inside grappler
            figures.append(bridge.last_reports()[-1]["report"]["summary"])
        else:
            files = list(tmp_path.glob("*.json"))
            assert len(files) == 1
            figures.append(json.loads(files[0].read_text())["summary"])
    for key in _SHAPE_KEYS:
        assert figures[0][key] == figures[1][key], key
    assert figures[0]["matrix_flops"] > 0


# ------------------------------------------------------- issue 17, step 3
def bert_like_training_graph(layers=2, hidden=16, heads=2, seq=8, batch=2, vocab=50, ffn=32):
    """A small BERT-style encoder from raw ops + Adam (``real_models.bert_training_graph``,
    no pooler): the residual adds the fusion pass asks shapes about, and a
    backward pass full of ``Shape``/``Reshape``."""
    g, _ = bert_training_graph(layers, hidden, heads, seq, batch, vocab, ffn, pooler=False)
    return g.as_graph_def()


def test_local_shapes_agree_with_grappler_and_spare_the_inference():
    """``shapes.local_shape`` (a tensor's shape from its producers') answers
    only with fully known shapes, and each equals grappler's whole-graph
    inference; it answers the fusion pass's questions on a BERT-style
    training graph (residual adds, gradient AddNs), so the pipeline runs
    without the whole-graph inference (its source is not called)."""
    gd = bert_like_training_graph()
    g = Graph(gd)
    inferred = shapes_mod.infer_shapes(gd)
    memo, answered = {}, 0
    for name, node in g.nodes.items():
        sh = shapes_mod.local_shape(g, name, memo)
        if sh is None:
            continue
        answered += 1
        assert all(d >= 0 for d in sh), name
        assert inferred.get(name)[0] == sh, (name, node.op, sh, inferred.get(name)[0])
    assert answered > len(g.nodes) // 2
    for name in ("layer_1/add", "layer_1/add_1"):  # the residual adds bias_add asks about
        assert shapes_mod.local_shape(g, name) == [16, 16]
    addn = [n for n, node in g.nodes.items() if node.op == "AddN" and n.startswith("gradients/")]
    assert addn and all(shapes_mod.local_shape(g, n) is not None for n in addn)

    from graph_passes.fusion.core import ShapeOracle

    calls, counting = _counting_shape_source(gd)
    g2 = Graph(gd)
    shapes_mod.attach(g2, counting)
    assert ShapeOracle(g2).shape("layer_1/add_1") == [16, 16] and calls == []
    _, rep = pipeline.optimize(gd, npu_amp_tf.Options.from_kwargs(), fetches=["loss", "train"],
                               shapes=counting)
    assert calls == [] and rep.raw_summary["shapes_inferred_in_pipeline"] is False
    assert rep.summary["lp_flop_share"] == 1.0 and calls == [1]  # the report's figures, when read


def test_local_shape_walks_past_its_depth_limit_on_a_deep_training_graph():
    """The gradient of a deep network's first layer sits behind every later
    layer's backward: its producers' chain is long (past 256, the depth a
    recursive walk once stopped at and restarted from).  The walk (its own
    stack) is equal to grappler's shape on every tensor it answers for, and the fusion pass,
    which fuses every LayerNorm with its gradient region here, asks grappler's
    whole-graph inference for nothing (it used to, for the first layer's
    gradient AddN: ~0.5 s on the 12-layer BERT-base-like benchmark graph)."""
    layers = 12
    gd = bert_like_training_graph(layers=layers)
    g = Graph(gd)
    inferred = shapes_mod.infer_shapes(gd)
    addn = [n for n, node in g.nodes.items() if node.op == "AddN" and n.startswith("gradients/")]
    chain = _longest_chains(g)
    deep = [n for n in addn if chain[n] > 256]
    assert deep, max(chain[n] for n in addn)
    for name in deep:  # each from scratch (no memo)
        assert shapes_mod.local_shape(g, name) == inferred.get(name)[0], name
    memo, answered = {}, 0
    for name in reversed(list(g.nodes)):  # readers first: every walk starts deep
        sh = shapes_mod.local_shape(g, name, memo)
        if sh is None:
            continue
        answered += 1
        assert inferred.get(name)[0] == sh, (name, g.nodes[name].op, sh, inferred.get(name)[0])
    assert answered > len(g.nodes) // 2

    calls, counting = _counting_shape_source(gd)
    _, rep = pipeline.optimize(gd, npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision"),
                               fetches=["loss", "train"], shapes=counting)
    fusion = next(p for p in rep.passes if p["name"] == "fusion")["stats"]
    assert fusion["fused"].get("layer_norm") == 1 + 2 * layers, fusion["fused"]
    assert calls == [] and rep.raw_summary["shapes_inferred_in_pipeline"] is False


def test_local_shape_walks_a_chain_deeper_than_python_recursion():
    """A chain of 3x Python's recursion limit (elementwise ops and adds of a
    constant, then a Reshape, a MatMul and a Fill whose dims are a Shape):
    every tensor's shape, from scratch and walked readers first, equals the
    one NumPy broadcasting gives by hand; a cycle among such ops (a malformed
    graph) answers None and leaves nothing half-done in the memo."""
    import sys

    from tensorflow.core.framework import graph_pb2

    n = 3 * sys.getrecursionlimit()
    gd = graph_pb2.GraphDef()

    def add(name, op, inputs=(), **attrs):
        node = gd.node.add(name=name, op=op)
        node.input.extend(inputs)
        for k, v in attrs.items():
            node.attr[k].CopyFrom(v)
        return node

    f32 = tf.float32.as_datatype_enum
    dt = tf.compat.v1.AttrValue(type=f32)
    x = add("x", "Placeholder", dtype=dt,
            shape=tf.compat.v1.AttrValue(shape=tf.TensorShape([4, 1, 3]).as_proto()))
    add("b", "Const", dtype=dt, value=tf.compat.v1.AttrValue(
        tensor=tf.make_tensor_proto(np.zeros([5, 1], np.float32))))
    prev = x.name
    for i in range(n):
        prev = add(f"c{i}", "Relu" if i % 2 else "AddV2", [prev] if i % 2 else [prev, "b"], T=dt).name
    add("w", "Const", dtype=dt, value=tf.compat.v1.AttrValue(
        tensor=tf.make_tensor_proto(np.zeros([3, 7], np.float32))))
    add("flat_shape", "Const", dtype=tf.compat.v1.AttrValue(type=tf.int32.as_datatype_enum),
        value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(np.array([-1, 3], np.int32))))
    add("flat", "Reshape", [prev, "flat_shape"], T=dt)
    add("mm", "MatMul", ["flat", "w"], T=dt)
    add("mm_shape", "Shape", ["mm"], T=dt)
    add("zero", "Const", dtype=dt, value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(np.float32(0))))
    add("filled", "Fill", ["mm_shape", "zero"], T=dt)
    g = Graph(gd)
    expected = {"x": [4, 1, 3], "flat": [20, 3], "mm": [20, 7], "filled": [20, 7]}
    expected.update({f"c{i}": [4, 5, 3] for i in range(n)})  # (4,1,3) + (5,1) -> (4,5,3)
    for name in ("filled", "mm", "flat", f"c{n - 1}"):  # each from scratch
        assert shapes_mod.local_shape(g, name) == expected[name], name
    memo = {}
    for name in reversed(list(g.nodes)):
        if name in expected:
            assert shapes_mod.local_shape(g, name, memo) == expected[name], name
    # a cycle of covered ops (not a valid TF graph): None, and the memo holds only answers
    gd.node[2].input[0] = f"c{n - 1}"
    cyc = Graph(gd)
    memo = {}
    assert shapes_mod.local_shape(cyc, "c10", memo) is None
    assert all(v is None for v in memo.values()) and "c10" in memo


def _longest_chains(g):
    """name -> the longest path (in data edges) from it back to a source."""
    from graph_passes.graph import parse_tensor

    depth = {}
    for n in g.topo_order():
        ins = [depth.get(parse_tensor(i)[0], 0) for i in g.nodes[n].input if not i.startswith("^")]
        depth[n] = 1 + max(ins, default=0)
    return depth


def test_local_shape_declines_unknown_dims_and_unsupported_ops():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.placeholder(tf.float32, [4, 3], name="w")
        tf.matmul(x, w, name="mm")
        tf.reshape(w, [-1], name="flat")
        tf.reshape(x, [-1], name="flat_x")
        tf.reduce_sum(w, axis=0, keepdims=True, name="sum")
        tf.transpose(w, name="wt")
        tf.nn.top_k(w, 2, name="topk")
    gr = Graph(g.as_graph_def())
    assert shapes_mod.local_shape(gr, "mm") is None  # batch dim unknown
    assert shapes_mod.local_shape(gr, "flat") == [12]
    assert shapes_mod.local_shape(gr, "flat_x") is None
    assert shapes_mod.local_shape(gr, "sum") == [1, 3]
    assert shapes_mod.local_shape(gr, "wt") == [3, 4]
    assert shapes_mod.local_shape(gr, "topk") is None  # not covered: the inference answers


def _changed_by_content(gd, g):
    orig = {n.name: n for n in gd.node}
    return {name for name, n in g.nodes.items() if orig.get(name) != n}


@pytest.mark.parametrize("params", [dict(precision_mode="allow_mix_precision"),
                                    dict(precision_mode="allow_mix_precision_bf16", graph_level=3)],
                         ids=["fp16", "bf16-level3"])
def test_opdef_guard_checks_what_the_passes_changed(k2, params):
    """The pipeline's OpDef guard checks the nodes the passes created or
    edited (``Graph.changed_nodes``) and their readers: on real training
    graphs every node whose NodeDef differs from the input's is in that set,
    and the restricted check finds what the full check finds, also for a
    fault planted in a changed node."""
    from graph_passes import manager, opdef_check, registry

    opts = npu_amp_tf.Options.from_kwargs(**params)
    for gd in (_keras_resnet_training_graph(k2), bert_like_training_graph()):
        g = Graph(gd)
        ctx = manager.PassContext(opts, ["loss", "train"])
        manager.PassManager(pipeline.pass_names(opts)).run(g, ctx)
        changed = g.changed_nodes()
        by_content = _changed_by_content(gd, g)
        assert by_content and by_content <= changed, sorted(by_content - changed)[:5]
        assert opdef_check.new_problems(gd, g, "CPU", changed) == opdef_check.new_problems(gd, g, "CPU") == []
        # a fault in a node the passes edited: a low-precision MatMul fed FP32
        # (its input read past the Casts; a MatMul whose input is low without
        # a Cast, e.g. issue 18's filter-gradient MatMul on a BF16 Reshape,
        # cannot be faulted this way)
        def fp32_root(n):
            src = g.nodes[n].input[0].split(":")[0]
            while g.nodes[src].op == "Cast":
                src = g.nodes[src].input[0].split(":")[0]
            return src if g.tensor_dtype(src) == registry.DT_FLOAT else None

        mm = next(n for n in sorted(changed) if g.nodes[n].op == "MatMul"
                  and g.nodes[n].attr["T"].type in registry.LOW_TYPES and fp32_root(n))
        g.set_input(mm, 0, fp32_root(mm))
        full = opdef_check.new_problems(gd, g, "CPU")
        assert full and any(mm in p for p in full)
        assert opdef_check.new_problems(gd, g, "CPU", g.changed_nodes()) == full


def test_untracked_pass_makes_the_guard_check_everything():
    from graph_passes import cleanup, manager  # noqa: F401  (cleanup registers itself)

    class _Edits(manager.Pass):  # edits in place without telling the graph
        def run(self, graph, ctx):
            graph.nodes["logits"].attr["transpose_a"].b = False
            return {}

    manager.register_pass("_test_untracked")(_Edits)
    try:
        g = Graph(cnn_graph())
        manager.PassManager(["_test_untracked"]).run(g, manager.PassContext())
        assert g.changed_nodes() is None
    finally:
        del manager.PASS_REGISTRY["_test_untracked"]
    g = Graph(cnn_graph())
    manager.PassManager(["cleanup"]).run(g, manager.PassContext())
    assert g.changed_nodes() == set()


def test_validate_names_a_pass_that_changes_an_op_behind_the_graph():
    """``validate_graph``'s per-pass check also finds an op type changed in
    place (``node.op = ...`` instead of ``Graph.set_op``) by a pass that
    declares ``tracks_edits``: the op-type index that ``nodes_of_type`` and
    the fusion matcher use would be stale.  After a pass that does not
    declare it, the manager rebuilds the index."""
    from graph_passes import manager
    from graph_passes.errors import PassError

    class _Renames(manager.Pass):
        tracks_edits = True

        def run(self, graph, ctx):
            graph.nodes["logits"].op = "BatchMatMulV2"
            return {}

    class _RenamesRight(_Renames):
        def run(self, graph, ctx):
            graph.set_op("logits", "BatchMatMulV2")
            return {}

    class _RenamesUntracked(_Renames):
        tracks_edits = False  # the manager rebuilds the op index after it

    manager.register_pass("_test_op_in_place")(_Renames)
    manager.register_pass("_test_set_op")(_RenamesRight)
    manager.register_pass("_test_op_untracked")(_RenamesUntracked)
    try:
        g = Graph(cnn_graph())
        manager.PassManager(["_test_op_untracked"], validate=True).run(g, manager.PassContext())
        assert g.nodes_of_type("BatchMatMulV2") == ["logits"] and g.changed_nodes() is None
        with pytest.raises(PassError, match="set_op"):
            manager.PassManager(["_test_op_in_place"], validate=True).run(Graph(cnn_graph()), manager.PassContext())
        g = Graph(cnn_graph())
        manager.PassManager(["_test_set_op"], validate=True).run(g, manager.PassContext())
        assert g.nodes_of_type("BatchMatMulV2") == ["logits"] and g.changed_nodes() == {"logits"}
    finally:
        for name in ("_test_op_in_place", "_test_set_op", "_test_op_untracked"):
            del manager.PASS_REGISTRY[name]


# ------------------------------------------------------- issue 17c
def test_bridge_hands_over_cpp_indexes_and_serializes_the_same_graph(monkeypatch):
    """Inside grappler the pipeline's Graph takes its indexes (and the first
    topological order) from the C++ item; the graph it hands back is byte for
    byte the one the same callback gives with Python-built indexes and
    through pipeline.optimize's GraphDef (bert-like training graph: fusion
    and precision both edit it)."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    calls, adopted = [], []
    real_handle, real_adopt = bridge.handle, Graph._adopt_index

    def handle(*args, **kw):
        blob = kw["index"]()
        calls.append((args, kw, blob))
        kw["index"] = blob
        return real_handle(*args, **kw)

    def adopt(self, gd, blob, late=None):
        ok = real_adopt(self, gd, blob, late)
        adopted.append(ok)
        return ok

    monkeypatch.setattr(bridge, "handle", handle)
    monkeypatch.setattr(Graph, "_adopt_index", adopt)
    gd = bert_like_training_graph()
    mg, cfg = plugin_only_grappler(gd)
    bridge.clear_reports()
    tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"bert")
    assert calls and adopted == [True]
    args, kw, blob = calls[0]
    assert blob is not None
    assert kw.get("patch") is True  # (the callback takes a patch: tests/test_stage_fast.py)
    bridge.clear_reports()
    code, fast = real_handle(*args, **dict(kw, index=blob, shapes=None, patch=False))
    bridge.clear_reports()
    code2, slow = real_handle(*args, **dict(kw, index=None, shapes=None, patch=False))
    assert adopted == [True, True]  # (index=None: built in Python, nothing to adopt)
    assert code == code2 == bridge.RC_OK and fast == slow
    in_gd = graph_pb2.GraphDef.FromString(args[0])
    opts = bridge.parse_options(args[1])
    out, _ = pipeline.optimize(in_gd, opts, fetches=args[2], preserve=args[3], devices=args[4],
                               graph_name=args[5])
    assert out.SerializeToString(deterministic=True) == fast
    fused = {n.op for n in graph_pb2.GraphDef.FromString(fast).node}
    assert "Cast" in fused


def test_pipeline_leaves_no_reference_cycles_and_restores_the_collector(k2):
    """A rewrite's objects are freed by reference counting alone: with the
    cyclic collector off, a run on a Keras ResNet50 training graph (report
    read or not, deferred figures pending or computed) leaves nothing for
    ``gc.collect()``.  Before, ``Graph`` <-> its ``ShapeTable`` and graph ->
    shape source -> report -> deferred figures -> graph were cycles: ~75k
    objects per run that only a full collection freed.  The pipeline pauses
    the collector for its run and restores its state, on or off."""
    import gc

    gd = _keras_resnet_training_graph(k2)
    opts = npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision")
    pipeline.optimize(gd, opts, fetches=["loss", "train"])  # warm caches
    gc.collect()
    gc.disable()
    try:
        for read in (False, True):
            out, rep = pipeline.optimize(gd, opts, fetches=["loss", "train"])
            assert rep.pending  # the shape figures are deferred
            if read:
                assert rep.summary["lp_flop_share"] > 0.5
            del out, rep
            data, rep, n = pipeline.optimize_serialized(gd.SerializeToString(), opts,
                                                         fetches=["loss", "train"])
            assert n > len(gd.node) // 2 and data
            del data, rep
            assert gc.collect() == 0, f"reference cycles left (report read: {read})"
        assert not gc.isenabled()  # a disabled collector stays disabled
    finally:
        gc.enable()
    pipeline.optimize(gd, opts, fetches=["loss", "train"])
    assert gc.isenabled()  # and an enabled one is enabled again
