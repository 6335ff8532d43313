"""Issue 17: the precision pass's shortcuts (``PrecisionPass.fast_paths``:
per-node and per-op-signature memos of dtypes and node facts, the delayed
casts' acyclicity proven from the order at hand, the "before" snapshot
copied on write; issue 17d: a node's float inputs read by index without
walking its control inputs, the readers memo while painting, the kernel
check's per-op attr names and per-device-string device types, the inlined
voter, the report counts over the painted nodes, Consts and Casts from the
op index) change nothing.

Each real graph is rewritten twice, once with the shortcuts and once with the
reference (``fast_paths = False``: every dtype from the registry, every fact
computed, the full topological sort); the GraphDefs must be byte-identical
(deterministic serialisation) and the reports equal (timings aside).  After
every fast run the memos are checked against the registry node by node, so a
stale memo is found even where it happens not to change the graph."""
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes import registry
from graph_passes.precision import amp
from test_speed_paths import (_keras_resnet_training_graph, bert_like_training_graph, optimize_rewritten,
                              plugin_only_grappler)

tf1 = tf.compat.v1

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "bf16_l3": dict(precision_mode="allow_mix_precision_bf16", graph_level=3),
}


# ------------------------------------------------------------------ graphs
def keras_learning_phase_graph(k):
    """A Keras 2 CNN in a TF1 graph whose BatchNorm / Dropout follow a
    learning-phase placeholder (conditionals: ``If`` with function bodies,
    or ``Switch``/``Merge`` under control flow v1), + Momentum."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 16, 16, 3], name="images")
        y = tf1.placeholder(tf.int32, [2], name="labels")
        training = tf1.placeholder_with_default(True, [], name="learning_phase")
        h = k.layers.Conv2D(8, 3, padding="same")(x)
        h = k.layers.BatchNormalization()(h, training=training)
        h = k.layers.Activation("relu")(h)
        h = k.layers.Dropout(0.3)(h, training=training)
        h = k.layers.GlobalAveragePooling2D()(h)
        logits = k.layers.Dense(10)(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
    gd = g.as_graph_def()
    assert any(n.op in ("Switch", "If", "StatelessIf") for n in gd.node), "no learning-phase conditional"
    return gd, ["loss", "train"]


def keras_mobilenet_graph(k):
    g = tf.Graph()
    with g.as_default():
        k.backend.set_learning_phase(1) if hasattr(k.backend, "set_learning_phase") else None
        x = tf1.placeholder(tf.float32, [2, 32, 32, 3], name="images")
        y = tf1.placeholder(tf.int32, [2], name="labels")
        model = k.applications.MobileNetV2(weights=None, input_tensor=x, classes=10, alpha=0.35)
        logits = model.output.op.inputs[0] if model.output.op.type == "Softmax" else model.output
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, var_list=model.trainable_weights, name="train")
    return g.as_graph_def(), ["loss", "train"]


def slim_resnet_graph():
    from real_models import import_slim

    slim = import_slim()
    from tf_slim.nets import resnet_v1

    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 32, 32, 3], name="images")
        y = tf1.placeholder(tf.int32, [2], name="labels")
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            logits, _ = resnet_v1.resnet_v1_50(x, num_classes=10, is_training=True)
        logits = tf.reshape(logits, [2, 10])
        loss = tf.identity(tf1.losses.sparse_softmax_cross_entropy(y, logits), name="loss")
        train = slim.learning.create_train_op(loss, tf1.train.MomentumOptimizer(0.1, 0.9))
        tf.identity(train, name="train")
    return g.as_graph_def(), ["loss", "train"]


def v1_loop_graph():
    """``tf.compat.v1.while_loop`` (a ``While`` with function bodies under
    control flow v2, the default on both lanes)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 8], name="x")
        w = tf1.get_variable("w", [8, 8])

        def body(i, h):
            return i + 1, tf.nn.relu(tf.matmul(h, w))

        _, h = tf1.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x])
        loss = tf.reduce_mean(h, name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


# ---------------------------------------------------------------- checking
def _strip_times(obj):
    if isinstance(obj, dict):
        return {k: _strip_times(v) for k, v in obj.items()
                if not (k.endswith("_s") or k in ("shapes_inferred_in_pipeline", "precision_paint"))}
    if isinstance(obj, list):
        return [_strip_times(v) for v in obj]
    return obj


def _memo_problems(p):
    """Where the finished run's memos disagree with the registry / a fresh computation."""
    out = []
    for name, (node, ins, outs) in p._dts.items():
        if p.g.nodes.get(name) is not node:
            continue
        want_in, want_out = registry.input_dtypes(node, p.g.functions), registry.output_dtypes(node, p.g.functions)
        if ins != (None if want_in is None else tuple(want_in)) or \
                outs != (None if want_out is None else tuple(want_out)):
            out.append(f"dtypes of {name}: memo {ins} -> {outs}, registry {want_in} -> {want_out}")
    for name, (op, info) in p._info.items():
        node = p.g.nodes.get(name)
        if node is None or node.op != op or op in amp.COND_OPS:
            continue
        fresh = p._compute_info_of(node)
        if (info.attrs, info.in_attr, info.fixed) != (fresh.attrs, fresh.in_attr, fresh.fixed):
            out.append(f"facts of {name}: memo {info.attrs} {info.fixed}, fresh {fresh.attrs} {fresh.fixed}")
    # (issue 17f) the memos keyed by the C++ signature class, for every node
    # still unedited: facts, dtypes and current dtype of its class
    for name, c in (p._cls or {}).items():
        node = p.g.nodes.get(name)
        if node is None:
            continue
        info = p._sig_info.get(c)
        fresh = p._compute_info_of(node)
        if info is not None and node.op not in amp.COND_OPS and \
                (info.attrs, info.in_attr, info.fixed) != (fresh.attrs, fresh.in_attr, fresh.fixed):
            out.append(f"class facts of {name}: memo {info.attrs} {info.fixed}, fresh {fresh.attrs} {fresh.fixed}")
        dts = p._sig_dts.get(c)
        if dts is not None:
            want_in, want_out = registry.input_dtypes(node, p.g.functions), registry.output_dtypes(node, p.g.functions)
            if dts != (None if want_in is None else tuple(want_in), None if want_out is None else tuple(want_out)):
                out.append(f"class dtypes of {name}: memo {dts}, registry {want_in} -> {want_out}")
        cur = p._cls_cur.get(c)
        if cur is not None and fresh.attrs and cur != p._current_of(node, fresh):
            out.append(f"class dtype of {name}: memo {cur}, node {p._current_of(node, fresh)}")
    return out


def _helper_problems(p):
    """Where a fast helper disagrees with the reference's, node by node, on
    the finished run's graph (every node, every float tensor and reader)."""
    out = []
    g = p.g
    low = p.low
    for name, node in list(g.nodes.items()):
        info = p.info(node)
        p.fast_paths = True
        fast = p._float_inputs(node, info)
        dev = p.device_type(node)
        k_fast = p.kernel_ok(node, info, low) if info.attrs and registry.op_def(node.op) else None
        voters_fast = [p._voter(inp) for _, inp in fast]
        p.fast_paths = False
        ref = p._float_inputs(node, info)
        if fast != ref:
            out.append(f"float inputs of {name}: fast {fast[:3]}, reference {ref[:3]}")
        if dev != p.device_type(node):
            out.append(f"device type of {name}")
        if info.attrs and registry.op_def(node.op) and k_fast != p.kernel_ok(node, info, low):
            out.append(f"kernel check of {name}")
        if voters_fast != [p._voter(inp) for _, inp in ref]:
            out.append(f"votes into {name}")
    # the readers memo (edges and Casts as they are now), with and without an excluded reader
    p.fast_paths = True
    p._rmemo = {}
    for name, node in list(g.nodes.items())[:3000]:
        for port in range(len(p.out_dtypes(node) or ())):
            ref_t = f"{name}:{port}" if port else name
            plain = p._readers_of(ref_t)
            if p._readers(ref_t) != plain:
                out.append(f"readers of {ref_t}")
            for cname, _ in plain[:3]:
                if p._readers(ref_t, exclude=cname) != p._readers_of(ref_t, cname):
                    out.append(f"readers of {ref_t} but {cname}")
    p._rmemo = None
    return out


def _rewrite(monkeypatch, gd, fetches, fast, kw, runs):
    monkeypatch.setattr(amp.PrecisionPass, "fast_paths", fast)
    orig = amp.PrecisionPass.run

    def run(self, graph, ctx):
        res = orig(self, graph, ctx)
        runs.append(self)
        return res

    monkeypatch.setattr(amp.PrecisionPass, "run", run)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **kw)
    monkeypatch.setattr(amp.PrecisionPass, "run", orig)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json())


def assert_fast_equals_reference(monkeypatch, gd, fetches, modes=tuple(MODES)):
    for mode in modes:
        runs = []
        fast_gd, fast_rep = _rewrite(monkeypatch, gd, fetches, True, MODES[mode], runs)
        assert runs, "the precision pass did not run"
        for p in runs:
            assert not _memo_problems(p), (mode, _memo_problems(p)[:5])
            assert not _helper_problems(p), (mode, _helper_problems(p)[:5])
        ref_runs = []
        ref_gd, ref_rep = _rewrite(monkeypatch, gd, fetches, False, MODES[mode], ref_runs)
        assert fast_rep["summary"].get("failed_pass") is None, fast_rep["warnings"][:3]
        # the "before" snapshot (copied on write in the fast path, whole in the reference)
        assert len(runs) == len(ref_runs)
        for p, q in zip(runs, ref_runs):
            a, b = p._before.graph_def(), q._before.graph_def()
            assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True), \
                f"{mode}: the 'before' snapshot differs"
            assert len(a.node) > 0
        summ = fast_rep["summary"]
        assert summ["casts_inserted"] + summ.get("functions_casts_inserted", 0) > 0
        assert fast_gd == ref_gd, f"{mode}: the fast path rewrote the graph differently"
        assert fast_rep == ref_rep, f"{mode}: the fast path's report differs"


# ------------------------------------------------------------------- tests
def test_keras_learning_phase_graph(k2, monkeypatch):
    gd, fetches = keras_learning_phase_graph(k2)
    assert_fast_equals_reference(monkeypatch, gd, fetches)


def test_keras_applications_mobilenet(k2, monkeypatch):
    gd, fetches = keras_mobilenet_graph(k2)
    assert_fast_equals_reference(monkeypatch, gd, fetches, ("fp16", "bf16"))


def test_bert_like_training_graph_with_delayed_casts(monkeypatch):
    gd = bert_like_training_graph()
    runs = []
    _rewrite(monkeypatch, gd, ["loss", "train"], True, MODES["fp16"], runs)
    assert any(p.casts_delayed for p in runs), "no delayed cast: the acyclicity shortcut is not exercised"
    assert_fast_equals_reference(monkeypatch, gd, ["loss", "train"])


@pytest.mark.parametrize("mode", ["fp16", "bf16_l3"])
def test_slim_resnet_v1_50_modes(monkeypatch, mode):
    pytest.importorskip("tf_slim", reason="tf_slim is not installed in this environment")
    gd, fetches = slim_resnet_graph()
    assert_fast_equals_reference(monkeypatch, gd, fetches, (mode,))


def control_dependencies_graph():
    """A tf.compat.v1 MLP whose float math waits on control inputs (the way
    Keras' ``model.updates`` hang a hundred of them on its ZerosLike and
    ShapeN): the fast path reads float inputs by index, never walking them."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 16], name="x")
        y = tf1.placeholder(tf.int32, [4], name="labels")
        w1 = tf1.get_variable("w1", [16, 32])
        w2 = tf1.get_variable("w2", [32, 10])
        step = tf1.train.get_or_create_global_step()
        ticks = [tf1.assign_add(tf1.get_variable(f"tick{i}", [], trainable=False), 1.0) for i in range(12)]
        with tf.control_dependencies(ticks):
            h = tf.nn.relu(tf.matmul(x, w1) + 1.0)
            z = tf.zeros_like(h)
        with tf.control_dependencies([step] + ticks[:4]):
            h = tf.add(h, z) * 0.5
        logits = tf.matmul(h, w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


def test_float_math_with_control_inputs(monkeypatch):
    gd, fetches = control_dependencies_graph()
    waiting = [n.op for n in gd.node if "T" in n.attr and n.attr["T"].type == tf.float32.as_datatype_enum
               and any(i.startswith("^") for i in n.input)]
    # (TF hangs the control inputs on the first ops of each block: the weights' reads, a gray AddV2)
    assert "AddV2" in waiting and len(waiting) >= 3, waiting
    assert_fast_equals_reference(monkeypatch, gd, fetches, ("fp16", "bf16"))


def test_v1_while_loop(monkeypatch):
    gd, fetches = v1_loop_graph()
    assert_fast_equals_reference(monkeypatch, gd, fetches, ("fp16", "bf16"))


def test_through_grappler_keras_resnet50(k2, monkeypatch):
    """The same through the grappler callback (grappler's item, its own
    fetch list and shapes)."""

    gd = _keras_resnet_training_graph(k2)
    mg, cfg = plugin_only_grappler(gd)
    results = []
    for fast in (True, False):
        monkeypatch.setattr(amp.PrecisionPass, "fast_paths", fast)
        out, rep = optimize_rewritten(cfg, mg, b"fast")
        results.append((out, _strip_times(rep)))
    assert results[0][1]["summary"]["casts_inserted"] > 0
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1]


def test_stale_memo_is_caught(monkeypatch):
    """The check has teeth: a re-typing that forgets to drop the node's
    memo entry is found (by the graph comparison or the memo check)."""
    monkeypatch.setattr(amp.PrecisionPass, "_retype",
                        lambda self, node, attrs, dt: registry.retype(node, attrs, dt))
    monkeypatch.setattr(amp.PrecisionPass, "_retype_all",  # (the per-class batch of _retype)
                        lambda self, nodes, names, op, attrs, path:
                        [registry.retype_all(nodes, op, attrs, dt) for dt in path])
    gd = bert_like_training_graph()
    runs = []
    fast_gd, fast_rep = _rewrite(monkeypatch, gd, ["loss", "train"], True, MODES["fp16"], runs)
    ref_gd, ref_rep = _rewrite(monkeypatch, gd, ["loss", "train"], False, MODES["fp16"], [])
    assert fast_gd != ref_gd or any(_memo_problems(p) for p in runs)


@pytest.mark.parametrize("fault", ["float_inputs", "readers_memo"])
def test_planted_helper_fault_is_caught(monkeypatch, fault):
    """The node-by-node helper check has teeth: a fast helper that drops an
    input (or, with the memo on, a reader) is found."""
    if fault == "float_inputs":
        orig = amp.PrecisionPass._float_inputs

        def bad(self, node, info):
            res = orig(self, node, info)
            return res[:-1] if self.fast_paths and len(res) > 1 else res
        monkeypatch.setattr(amp.PrecisionPass, "_float_inputs", bad)
    else:
        orig = amp.PrecisionPass._readers

        def bad(self, ref, exclude=None):
            res = orig(self, ref, exclude)
            return res[1:] if self._rmemo is not None and exclude is not None else res
        monkeypatch.setattr(amp.PrecisionPass, "_readers", bad)
    gd, fetches = control_dependencies_graph()
    with pytest.raises(AssertionError):
        assert_fast_equals_reference(monkeypatch, gd, fetches, ("fp16",))
