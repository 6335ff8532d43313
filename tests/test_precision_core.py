"""Issue 17f: per-node facts from the C++ index (signature classes).

The C++ library's graph index (``GraphIndexText`` in
custom_ops/grappler_bridge.cc: inside grappler from the item, offline from
the GraphDef's bytes) carries, per node, a signature class: nodes of one
class have the same op and the same values of the attrs its args name, i.e.
equal ``registry.signature_key``.  The precision pass keys its per-signature
memos (dtypes, node facts) on the class of every node no pass has edited,
instead of reading the node's attrs (``PrecisionPass._key``).

Checked here:
* the classes partition every node exactly like ``registry.signature_key``
  (graphs with type-list and number attrs, function calls, an unknown op),
  and nodes created or edited since the index are left out;
* rewriting with the classes, without them (Python keys), and with the
  reference (``fast_paths = False``) gives byte-identical GraphDefs and equal
  reports, offline and through grappler, on both TF lanes;
* a planted fault (two signatures given one class) is caught."""
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import npu_amp_tf
from graph_passes import registry
from graph_passes.graph import Graph
from graph_passes.precision import amp
from npu_amp_tf import bridge
from test_graph_core import ALL, _odd_graph
from test_precision_fast import (MODES, _memo_problems, _strip_times, control_dependencies_graph,
                                 keras_learning_phase_graph, slim_resnet_graph, v1_loop_graph)
from test_speed_paths import (_keras_resnet_training_graph, bert_like_training_graph, optimize_rewritten,
                              plugin_only_grappler)

tf1 = tf.compat.v1


# ------------------------------------------------------------------ graphs
def type_list_graph():
    """Type-list and number attrs (IdentityN, ShapeN, ConcatV2, AddN), a
    function call and an op no registry knows, next to float math."""
    @tf.function
    def scale(t):
        return t * 2.0

    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        i = tf1.placeholder(tf.int32, [4, 8], name="i")
        w = tf1.get_variable("w", [8, 8])
        a, b = tf.identity_n([tf.matmul(x, w), i])
        s1, s2 = tf.shape_n([a, x])
        c = tf.concat([a, x, scale(a)], axis=1)
        d = tf.add_n([a, x, tf.nn.relu(a)])
        loss = tf.reduce_mean(c, name="loss") + tf.reduce_mean(d) + tf.cast(tf.reduce_sum(s1 + s2), tf.float32)
        tf.identity(loss, name="out")
    gd = g.as_graph_def()
    # an op no registry knows, reading a float tensor (unknown_op_policy decides)
    n = gd.node.add(name="mystery", op="NpuTestUnknownOp")
    n.input.append("out")
    n.attr["T"].type = registry.DT_FLOAT
    return gd, ["loss", "out"]


def _graphs(k2):
    out = {
        "keras_resnet50_training": lambda: (_keras_resnet_training_graph(k2), ["loss", "train"]),
        "bert_like": lambda: (bert_like_training_graph(), ["loss", "train"]),
        "learning_phase_functions": lambda: keras_learning_phase_graph(k2),
        "control_inputs": control_dependencies_graph,
        "v1_loop": v1_loop_graph,
        "type_lists_unknown_op": type_list_graph,
    }
    return out


GRAPHS = ["keras_resnet50_training", "bert_like", "learning_phase_functions", "control_inputs",
          "v1_loop", "type_lists_unknown_op", "slim_resnet_v1_50"]


def _build(name, k2):
    if name == "slim_resnet_v1_50":
        pytest.importorskip("tf_slim", reason="tf_slim is not installed in this environment")
        return slim_resnet_graph()
    return _graphs(k2)[name]()


def _partition_problems(g, cls):
    """Where the classes do not partition g's nodes like signature_key."""
    out, k2c, c2k = [], {}, {}
    for name, node in g.nodes.items():
        c = cls.get(name)
        key = registry.signature_key(node)
        if c is None:
            continue
        if key is None:
            out.append(f"{name}: class {c} for an op Python does not know")
            continue
        if k2c.setdefault(key, c) != c or c2k.setdefault(c, key) != key:
            out.append(f"{name}: class {c}, key {key}")
    return out


# ------------------------------------------------------------- the classes
@pytest.mark.parametrize("build", ALL + [_odd_graph, lambda: type_list_graph()[0]],
                         ids=lambda f: getattr(f, "__name__", "type_list_graph"))
def test_signature_classes_partition_like_signature_keys(build):
    bridge.register()
    gd = build()
    g = Graph(gd, index=bridge.graph_index(gd))
    assert g.prebuilt_index
    cls = g.signature_classes()
    assert cls, "the C++ index carried no classes"
    assert not _partition_problems(g, cls)
    for name, node in g.nodes.items():
        # every node of an op the registries know has a class; none other
        assert (name in cls) == (registry.op_def(node.op) is not None), name
    # equal keys, equal classes, and the reverse (not just a finer partition)
    keys = {registry.signature_key(g.nodes[n]) for n in cls}
    assert len(keys) == len(set(cls.values()))
    assert Graph(gd).signature_classes() is None  # no C++ index, no classes


def test_signature_classes_leave_out_edited_nodes():
    bridge.register()
    gd, _ = type_list_graph()
    g = Graph(gd, index=bridge.graph_index(gd))
    first = g.signature_classes()
    assert "MatMul" in first and "Relu" in first and "x" in first
    g.set_op("Relu", "Relu6")
    g.nodes["MatMul"].attr["transpose_a"].b = True
    g.touch("MatMul")
    g.new_node("Identity", "late", ["x"], {"T": amp._type_attr(registry.DT_FLOAT)})
    g.set_input("out", 0, "late")
    cls = g.signature_classes()
    assert not {"Relu", "MatMul", "late", "out"} & set(cls)
    assert set(first) - set(cls) == {"Relu", "MatMul", "out"}
    assert not _partition_problems(g, cls)
    g.touch_all()
    assert g.signature_classes() is None


def _without_classes(blob, n):
    """The same index in the format before the classes (NPUIDX3): classes
    dropped and, from an NPUIDX5 blob (issue 17m), the shared (reader,
    position) pairs written out per edge again."""
    from array import array

    head, names_b, ops_b, srcs_b, binary = blob.split(b"\x03", 4)
    fields = head.split(b"\x02")
    src = 4 * int(fields[3]) if fields[0].endswith(b"+s") else 0  # (the consumed names' node indexes)
    if blob.startswith(b"NPUIDX4"):
        return blob[:-(4 * n + src)].replace(fields[0], b"NPUIDX3", 1)
    magic, count, cycle, nsrc, ntab = fields
    assert magic.split(b"+")[0] == b"NPUIDX5"
    ints = array("i")
    ints.frombytes(binary)
    no, ns, t = len(ops_b.split(b"\x01")), int(nsrc), int(ntab)
    e = sum(ints[no:no + ns])
    at = no + ns + n
    readers, positions, ids = ints[at:at + t], ints[at + t:at + 2 * t], ints[at + 2 * t:at + 2 * t + e]
    edges = array("i", [readers[i] for i in ids]) + array("i", [positions[i] for i in ids])
    body = ints[:at] + edges + ints[at + 2 * t + e:at + 2 * t + e + n]
    return b"\x03".join([b"\x02".join([b"NPUIDX3", count, cycle, nsrc]), names_b, ops_b, srcs_b,
                         body.tobytes()])


def test_the_index_without_classes_is_still_adopted():
    """An index in the previous format (no classes): adopted, no classes."""
    bridge.register()
    gd, _ = type_list_graph()
    blob = bridge.graph_index(gd)
    n = len(gd.node)
    old = _without_classes(blob, n)
    g = Graph(gd, index=old)
    assert g.prebuilt_index and g.signature_classes() is None
    assert g.topo_order() == Graph(gd).topo_order()


# --------------------------------------------- rewrites: fast = reference
def _rewrite(monkeypatch, gd, fetches, kw, fast=True, classes=True, used=None, fault=None):
    monkeypatch.setattr(amp.PrecisionPass, "fast_paths", fast)
    real_usable = amp._usable_classes
    runs = []

    def usable(graph):
        cls = real_usable(graph) if classes else None
        if cls and fault is not None:
            fault(graph, cls)
        if used is not None:
            used.append(len(cls or ()))
        return cls

    orig = amp.PrecisionPass.run

    def run(self, graph, ctx):
        res = orig(self, graph, ctx)
        runs.append(self)
        return res

    monkeypatch.setattr(amp, "_usable_classes", usable)
    monkeypatch.setattr(amp.PrecisionPass, "run", run)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches], **kw)
    monkeypatch.setattr(amp.PrecisionPass, "run", orig)
    monkeypatch.setattr(amp, "_usable_classes", real_usable)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json()), runs


def assert_classes_equal_reference(monkeypatch, gd, fetches, modes):
    for mode in modes:
        kw = MODES[mode]
        used = []
        with_cls, rep_cls, runs = _rewrite(monkeypatch, gd, fetches, kw, used=used)
        assert used and used[0] > 0, "the main graph's pass got no classes"
        for p in runs:
            assert not _memo_problems(p), (mode, _memo_problems(p)[:5])
        without, rep_without, _ = _rewrite(monkeypatch, gd, fetches, kw, classes=False)
        ref, rep_ref, _ = _rewrite(monkeypatch, gd, fetches, kw, fast=False)
        assert rep_cls["summary"].get("failed_pass") is None, rep_cls["warnings"][:3]
        summ = rep_cls["summary"]
        assert summ["casts_inserted"] + summ.get("functions_casts_inserted", 0) > 0
        assert with_cls == without == ref, f"{mode}: the rewritten graphs differ"
        assert rep_cls == rep_without == rep_ref, f"{mode}: the reports differ"


@pytest.mark.parametrize("name", GRAPHS)
def test_classes_fast_path_equals_reference(k2, monkeypatch, name):
    gd, fetches = _build(name, k2)
    modes = ("fp16", "bf16") if name in ("keras_resnet50_training", "slim_resnet_v1_50") else tuple(MODES)
    assert_classes_equal_reference(monkeypatch, gd, fetches, modes)


def test_a_planted_fault_is_caught(monkeypatch):
    """The MatMul and Relu given the class of the int32 placeholder: the memo
    check (node by node against the registry) and the comparison catch it."""
    gd, fetches = type_list_graph()

    planted = []

    def fault(graph, cls):
        int_class = cls["i"]
        for name in graph.nodes_of_type(("MatMul", "Relu")):
            if name in cls:
                cls[name] = int_class
                planted.append(name)

    out, rep, runs = _rewrite(monkeypatch, gd, fetches, MODES["fp16"], fault=fault)
    assert planted
    assert any(_memo_problems(p) for p in runs), "the memo check missed the planted fault"
    ref, rep_ref, _ = _rewrite(monkeypatch, gd, fetches, MODES["fp16"], fast=False)
    assert (out, rep) != (ref, rep_ref), "the comparison missed the planted fault"


# ------------------------------------------------------ through grappler
@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_classes_through_grappler(k2, monkeypatch, name):
    """Inside grappler the classes come with the item's index (before the
    passes that run ahead of precision: fusion on the BERT-like graph edits
    nodes, which are left out): the same output graph and report with and
    without them."""

    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    real_usable = amp._usable_classes
    outs, reps = [], []
    for classes in (True, False):
        used = []

        def usable(graph, classes=classes, used=used):
            cls = real_usable(graph) if classes else None
            used.append(len(cls or ()))
            return cls

        monkeypatch.setattr(amp, "_usable_classes", usable)
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        outs.append(out)
        reps.append(_strip_times(rep))
        if classes:
            assert used and used[0] > 0, "no classes inside grappler"
    monkeypatch.setattr(amp, "_usable_classes", real_usable)
    assert outs[0] == outs[1]
    assert reps[0] == reps[1]
    assert any(n.op == "Cast" for n in graph_pb2.GraphDef.FromString(outs[0]).node)
