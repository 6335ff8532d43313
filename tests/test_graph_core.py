"""graph_passes core: Graph, registry, function bodies, validate, topo order."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from graph_passes import registry
from graph_passes.errors import GraphError
from graph_passes.functions import function_graph
from graph_passes.graph import Graph, parse_tensor, tensor_name


# ----------------------------------------------------------------- builders
def keras_cnn_graph():
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, 3, activation="relu", input_shape=(8, 8, 3)),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.MaxPool2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(2),
    ])
    fn = tf.function(lambda x: model(x, training=False))
    return fn.get_concrete_function(tf.TensorSpec([1, 8, 8, 3])).graph.as_graph_def()


def transformer_block_graph():
    d = 8
    inp = tf.keras.Input((4, d))
    att = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    x = tf.keras.layers.LayerNormalization()(inp + att)
    x = tf.keras.layers.Dense(d, activation="gelu")(x)
    model = tf.keras.Model(inp, x)
    fn = tf.function(lambda t: model(t))
    return fn.get_concrete_function(tf.TensorSpec([1, 4, d])).graph.as_graph_def()


def training_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [4], name="y")
        w = tf.compat.v1.get_variable("w", [3, 2])
        logits = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def()


def v1_while_graph():
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.disable_control_flow_v2()
        try:
            x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
            tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), [0, x], name="loop")
        finally:
            tf.compat.v1.enable_control_flow_v2()
    return g.as_graph_def()


def nested_function_graph():
    @tf.function
    def inner(x):
        return tf.nn.relu(x) * 2.0

    @tf.function
    def outer(x):
        return inner(x) + 1.0

    return outer.get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()


ALL = [keras_cnn_graph, transformer_block_graph, training_graph, v1_while_graph, nested_function_graph]


# ------------------------------------------------------------------- tests
def test_parse_tensor_forms():
    assert parse_tensor("a") == ("a", 0, False)
    assert parse_tensor("scope/a:2") == ("scope/a", 2, False)
    assert parse_tensor("^ctrl") == ("ctrl", -1, True)
    assert parse_tensor("weird:name") == ("weird:name", 0, False)
    assert tensor_name("a", 0) == "a" and tensor_name("a", 3) == "a:3" and tensor_name("a", -1) == "^a"


@pytest.mark.parametrize("build", ALL, ids=lambda f: f.__name__)
def test_round_trip_unchanged_and_valid(build):
    gd = build()
    g = Graph(gd)
    assert g.validate() == []
    assert g.to_graph_def().SerializeToString(deterministic=True) == gd.SerializeToString(deterministic=True)
    order = g.topo_order(strict=True)
    assert sorted(order) == sorted(n.name for n in gd.node)
    pos = {n: i for i, n in enumerate(order)}
    for n in gd.node:
        for inp in n.input:
            src = parse_tensor(inp)[0]
            if g.nodes[src].op not in ("NextIteration", "RefNextIteration"):
                assert pos[src] < pos[n.name], (src, n.name)


def test_function_bodies_round_trip():
    gd = nested_function_graph()
    g = Graph(gd)
    assert g.functions, "tf.function nesting must produce a library function"
    for fname, fdef in g.functions.items():
        fg = function_graph(g, fname)
        assert fg.validate() == []
        assert [n.op for n in fg.nodes.values()].count("_Arg") == len(fdef.signature.input_arg)
        assert fg.to_function_def() == fdef


def test_consumers_index_and_mutations():
    g = Graph(training_graph())
    mm = next(n for n in g.nodes.values() if n.op == "MatMul" and n.name == "MatMul")
    cons = g.consumers("MatMul")
    assert cons and all(g.nodes[c].input[i].split(":")[0] == "MatMul" for c, i in cons if i >= 0)
    # insert a node on an edge and check both indexes
    cast = g.insert_on_edge(mm.name, 0, "Identity", "x/Probe", attrs={"T": _type(types_pb2.DT_FLOAT)})
    assert mm.input[0] == "x/Probe" and cast.input[0] == "x"
    assert ("x/Probe", 0) in g.consumers("x") and (mm.name, 0) in g.consumers("x/Probe")
    assert (mm.name, 0) not in g.consumers("x")
    assert g.validate() == []
    # replace all uses back and remove the probe
    assert g.replace_all_uses("x/Probe", "x") == 1
    g.remove_node("x/Probe")
    assert g.validate() == []
    with pytest.raises(GraphError, match="still read by"):
        g.remove_node("x")


def _type(dt):
    from tensorflow.core.framework import attr_value_pb2
    return attr_value_pb2.AttrValue(type=dt)


def test_validate_reports_problems():
    gd = training_graph()
    bad = graph_pb2.GraphDef()
    bad.CopyFrom(gd)
    dup = bad.node.add()
    dup.CopyFrom(bad.node[0])                     # duplicate name
    mm = next(n for n in bad.node if n.op == "MatMul")
    mm.input.append("does_not_exist")             # dangling (and arity)
    problems = Graph(bad).validate()
    text = "\n".join(problems)
    assert "duplicate node name 'x'" in text
    assert "reads 'does_not_exist', which does not exist" in text
    with pytest.raises(GraphError, match="invalid graph"):
        Graph(bad).validate(raise_error=True)


def test_validate_dtype_mismatch_and_cycle():
    gd = training_graph()
    g = Graph(gd)
    # feed an int32 tensor into a float MatMul input
    mm = g.nodes["MatMul"]
    g.set_input("MatMul", 0, "y")
    assert any("carries int32 but MatMul expects float32" in p for p in g.validate())
    g.set_input("MatMul", 0, "x")
    assert g.validate() == []
    # a cycle outside loops
    g2 = Graph(keras_cnn_graph())
    conv = next(n.name for n in g2.nodes.values() if n.op == "Conv2D")
    relu = next(n.name for n in g2.nodes.values() if n.op == "Relu")
    g2.add_control_input(conv, relu)  # relu depends on conv: now a cycle
    assert any("cycle outside loops" in p for p in g2.validate())
    with pytest.raises(GraphError, match="cycle"):
        g2.topo_order(strict=True)
    del mm


def test_v1_loop_topo_order_keeps_back_edges():
    g = Graph(v1_while_graph())
    ops = {n.op for n in g.nodes.values()}
    assert {"Enter", "Merge", "Switch", "NextIteration", "Exit"} <= ops
    assert len(g.topo_order(strict=True)) == len(g.nodes)


def test_registry_dtypes_kernels_shapes():
    gd = training_graph()
    g = Graph(gd)
    bn = [n for n in g.nodes.values() if n.op == "SparseSoftmaxCrossEntropyWithLogits"][0]
    assert registry.output_dtypes(bn) == [types_pb2.DT_FLOAT, types_pb2.DT_FLOAT]
    assert registry.has_kernel("MatMul", "CPU", {"T": types_pb2.DT_HALF})
    assert registry.has_kernel("MatMul", "CPU", {"T": types_pb2.DT_FLOAT})
    assert not registry.has_kernel("MatMul", "CPU", {"T": types_pb2.DT_STRING})
    assert not registry.has_kernel("NoSuchOp", "CPU", {})
    assert registry.device_type_of(bn) == "CPU"
    bn.device = "/job:worker/replica:0/task:0/device:GPU:0"
    assert registry.device_type_of(bn) == "GPU"
    shapes = registry.infer_shapes(gd)
    assert shapes["MatMul"] == [[4, 2]]


def test_static_shapes_from_output_shapes_attr():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        tf.identity(x, name="y")
    gd = g.as_graph_def(add_shapes=True)
    node = next(n for n in gd.node if n.name == "y")
    assert registry.static_shapes(node) == [[2, 3]]


def test_new_graph_runs_after_edit():
    """An edited graph imports and runs in TF with the expected numbers."""
    with tf.Graph().as_default() as tg:
        x = tf.compat.v1.placeholder(tf.float32, [2, 6, 6, 3], name="x")
        k = tf.constant(np.random.RandomState(1).normal(size=(3, 3, 3, 4)).astype(np.float32))
        h = tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME"), name="relu")
        tf.reduce_sum(h, axis=[1, 2], name="pooled")
    gd = tg.as_graph_def()
    g = Graph(gd)
    relu = next(n for n in g.nodes.values() if n.op == "Relu")
    # double the relu output through an inserted Mul with a Const
    c = g.new_node("Const", relu.name + "/Two", attrs={"dtype": _type(types_pb2.DT_FLOAT)})
    c.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.float32(2.0)))
    consumer, idx = g.consumers(relu.name, port=0)[0]
    g.insert_on_edge(consumer, idx, "Mul", relu.name + "/Scaled",
                     attrs={"T": _type(types_pb2.DT_FLOAT)}, extra_inputs=[c.name])
    assert g.validate() == []
    out = g.to_graph_def()
    assert len(out.node) == len(gd.node) + 2
    # run both graphs in TF: every consumer of the relu now sees twice its value
    feeds = [n for n in gd.node if n.op == "Placeholder"]
    assert len(feeds) == 1
    xv = np.random.RandomState(0).uniform(-1, 1, (2, 6, 6, 3)).astype(np.float32)

    def run(graph_def, fetch):
        with tf.Graph().as_default() as tg:
            tf.graph_util.import_graph_def(graph_def, name="")
            with tf.compat.v1.Session(graph=tg) as s:
                return s.run(fetch + ":0", {feeds[0].name + ":0": xv})

    relu_val = run(gd, relu.name)
    np.testing.assert_array_equal(run(out, relu.name + "/Scaled"), 2 * relu_val)
    assert np.abs(relu_val).sum() > 0   # a non-trivial check: the relu is not all zeros


def test_infer_shapes_survives_grappler_colocation_and_devices():
    """Grappler hands over graphs whose _class attrs name nodes it removed."""
    gd = training_graph()
    for n in gd.node:
        if n.op == "MatMul":
            n.attr["_class"].list.s.append(b"loc:@removed_by_grappler")
            n.device = "/job:localhost/replica:0/task:0/device:CPU:0"
    shapes = registry.infer_shapes(gd)
    assert shapes["MatMul"] == [[4, 2]]
    # the caller's graph is not modified
    assert any(n.attr["_class"].list.s for n in gd.node if n.op == "MatMul")


def test_out_of_sync_consumers_index_is_repaired_with_a_warning(caplog):
    """An input edited by hand (no reindex) leaves the consumers index stale;
    the next set_input on that edge must notice, warn and rebuild it."""
    g = Graph(training_graph())
    mm = g.nodes["MatMul"]
    old_src = parse_tensor(mm.input[0])[0]
    probe = g.new_node("Identity", "probe", [old_src], attrs={"T": _type(types_pb2.DT_FLOAT)})
    mm.input[0] = probe.name            # by hand: the index still says MatMul reads old_src
    assert ("MatMul", 0) in g.consumers(old_src)
    with caplog.at_level("WARNING", logger="npu_amp_tf"):
        g.set_input("MatMul", 0, old_src)   # the index has no ("MatMul", 0) under "probe"
    assert g.index_repairs == 1
    assert any("out of sync" in r.getMessage() for r in caplog.records)
    # the rebuilt index is true: exactly one entry for the edge, none for the probe
    assert g.consumers(old_src).count(("MatMul", 0)) == 1
    assert ("MatMul", 0) not in g.consumers("probe")
    assert g.validate() == []


def test_op_type_index_follows_every_mutation():
    """``nodes_of_type`` answers from an index kept by add/remove/set_op, in
    graph order; ``index_problems`` finds an op changed behind the graph's back."""
    g = Graph(training_graph())
    scan = lambda ops: [n for n, node in g.nodes.items() if node.op in ops]  # noqa: E731
    for ops in (("MatMul",), ("Identity", "Const"), ("NoSuchOp",)):
        assert g.nodes_of_type(ops) == scan(ops)
    assert g.nodes_of_type("MatMul") == scan(("MatMul",))
    assert g.nodes_of_type("MatMul")[0] == "MatMul" and len(g.nodes_of_type("MatMul")) == 3
    v0 = g.version
    g.new_node("Identity", "extra", ["MatMul"], {"T": g.nodes["MatMul"].attr["T"]})
    g.set_op("extra", "Snapshot")
    assert g.nodes_of_type(("Identity", "Snapshot")) == scan(("Identity", "Snapshot"))
    assert "extra" in g.nodes_of_type("Snapshot") and "extra" not in g.nodes_of_type("Identity")
    first_const = scan(("Const",))[0]
    g.set_op(first_const, "Identity")  # keeps its place in graph order
    assert g.nodes_of_type(("Identity", "Const")) == scan(("Identity", "Const"))
    g.set_op(first_const, "Const")
    g.remove_node("extra")
    assert g.nodes_of_type(("Snapshot",)) == [] and g.version > v0
    assert g.index_problems() == []
    assert g.changed_nodes() == {first_const}  # 'extra' was created and removed again
    g.nodes["MatMul"].op = "BatchMatMulV2"  # behind its back
    assert any("MatMul" in p for p in g.index_problems())
    g.reindex()
    assert g.index_problems() == [] and g.nodes_of_type("BatchMatMulV2") == ["MatMul"]
    assert "MatMul" not in g.nodes_of_type("MatMul")


def test_to_graph_def_after_edits():
    """After removals, a node re-added under its own name, additions and
    in-place edits, ``to_graph_def`` gives the nodes in graph order (the
    surviving originals, then the additions), library and versions, and drops
    only the colocation entries naming a node that is gone."""
    gd = training_graph()
    g = Graph(gd)
    mm = g.nodes["MatMul"]
    g.remove_node("MatMul", force=True)
    new = node_def_pb2.NodeDef()
    new.CopyFrom(mm)
    new.attr["transpose_a"].b = False
    g.add_node(new)  # re-added: now last in graph order
    g.new_node("NoOp", "late")
    g.nodes["x"].attr["_touched"].b = True  # an in-place edit of a surviving node
    g.touch("x")
    # (a name that is no UTF-8 and a non-ASCII one name no node either)
    g.nodes["w"].attr["_class"].list.s.extend([b"loc:@x", b"loc:@gone", b"other", b"loc:@\xff", "loc:@xé".encode()])
    fast = g.to_graph_def()
    assert list(fast.node[[n.name for n in fast.node].index("w")].attr["_class"].list.s) == [b"loc:@w", b"loc:@x", b"other"]
    for gone in (b"loc:@gone", b"loc:@\xff", "loc:@xé".encode()):
        g.nodes["w"].attr["_class"].list.s.remove(gone)
    slow = graph_pb2.GraphDef()
    slow.node.extend(g.nodes.values())
    slow.library.CopyFrom(g.library)
    slow.versions.CopyFrom(g.versions)
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)
    assert [n.name for n in fast.node][-2:] == ["MatMul", "late"]
    assert gd.node[0].attr.get("_touched") is None  # the input is not touched


def test_edits_since_lists_every_tracked_edit_in_order():
    """``edits_since(mark)``: the nodes created or edited after ``mark``, in
    order, a node again for each edit (the region search re-checks a node
    edited twice); the same names as ``changed_nodes`` from mark 0; None
    after ``touch_all``."""
    g = Graph(training_graph())
    names, mark = g.edits_since(0)
    assert names == [] and mark == 0
    g.new_node("Identity", "extra", ["MatMul"], {"T": g.nodes["MatMul"].attr["T"]})
    reader, idx = next((c, i) for c, i in g.consumers("MatMul") if i >= 0 and c != "extra")
    g.set_input(reader, idx, "extra")
    names, mark1 = g.edits_since(mark)
    assert names == ["extra", reader]
    g.set_input(reader, idx, "MatMul")  # the same node edited again
    g.add_control_input("extra", "MatMul")
    g.touch("MatMul")
    names, mark2 = g.edits_since(mark1)
    assert names == [reader, "extra", "MatMul"]
    assert set(g.edits_since(0)[0]) == g.changed_nodes() | set()
    assert g.edits_since(mark2) == ([], mark2)
    g.touch_all()
    assert g.edits_since(mark2)[0] is None and g.changed_nodes() is None


# ------------------------------------------- indexes from C++ (issue 17c)
def _indexes(g):
    return (list(g.nodes), list(g._consumers.items()),  # noqa: SLF001
            [(op, list(names)) for op, names in g._by_op.items()],  # noqa: SLF001
            g._seq, g._next_seq, g.version, g.topo_order(), g._has_cycle)  # noqa: SLF001


def _odd_graph():
    """Dangling inputs, ports, a name with a non-numeric ':' suffix, control
    edges, a node reading the same source twice, and a cycle outside loops."""
    gd = graph_pb2.GraphDef()
    for name, op, inputs in [
            ("a", "Placeholder", []), ("b:x", "Identity", ["a"]),
            ("c", "AddV2", ["a", "a", "^b:x"]), ("d", "IdentityN", ["c", "gone:1", "^gone", "b:x"]),
            ("e", "AddV2", ["f", "c:0"]), ("f", "Identity", ["e"]), ("g", "NoOp", ["^f", "^c", "^c"])]:
        n = gd.node.add(name=name, op=op)
        n.input.extend(inputs)
    return gd


def _repeated_inputs_graph():
    """Consecutive nodes reading the same sources at the same input positions
    (the C++ index reuses the previous lookup at a position when the name is
    the same): TF1 gradient NoOps waiting on the same update ops, with a
    dangling source, ports, a name that is a prefix of another, a source of
    the same length as the one before, and a node with fewer inputs between."""
    gd = graph_pb2.GraphDef()
    updates = [f"bn{k}/AssignMovingAvg" for k in range(12)] + ["bn1/AssignMovingAvg_1", "gone"]
    for u in updates[:-1]:
        gd.node.add(name=u, op="NoOp")
    gd.node.add(name="x", op="Placeholder")
    gd.node.add(name="y", op="Placeholder")
    for k in range(6):
        n = gd.node.add(name=f"grad{k}/tuple/group_deps", op="NoOp")
        n.input.extend("^" + u for u in updates)
        s = gd.node.add(name=f"grad{k}/ShapeN", op="ShapeN")
        s.input.extend(["x" if k % 2 else "y", "y:0" if k % 3 else "gone:2", *("^" + u for u in reversed(updates))])
        if k == 3:
            gd.node.add(name="short", op="Identity").input.extend(["bn1/AssignMovingAvg"])
    return gd


@pytest.mark.parametrize("build", ALL + [_odd_graph, _repeated_inputs_graph], ids=lambda f: f.__name__)
def test_cpp_index_equals_the_python_index(build):
    """The indexes the C++ library computes (bridge.graph_index: the format
    the grappler bridge hands over with grappler's item) give a Graph whose
    names, consumers, op-type index, sequence numbers, version and
    topological order (cycle flag included) equal the Python-built ones, key
    order included; edits after it behave the same."""
    from npu_amp_tf import bridge

    bridge.register()
    gd = build()
    blob = bridge.graph_index(gd)
    assert blob is not None
    slow, fast = Graph(gd), Graph(gd, index=blob)
    assert fast.prebuilt_index and not slow.prebuilt_index
    assert _indexes(fast) == _indexes(slow)
    assert fast.to_graph_def().SerializeToString(deterministic=True) == \
        slow.to_graph_def().SerializeToString(deterministic=True)
    # the same edits on both: the indexes stay equal
    for g in (slow, fast):
        first = next(iter(g.nodes))
        g.new_node("NoOp", "npu_test/extra", [f"^{first}"])
        g.remove_node("npu_test/extra")
        g.new_node("Identity", "npu_test/id", [first], {"T": g.output_dtypes(g.nodes[first])[0]
                                                         if g.output_dtypes(g.nodes[first]) else 1})
    assert _indexes(fast) == _indexes(slow)
    assert fast.index_problems() == []


def test_cpp_index_refused_when_it_cannot_describe_the_graph():
    """Duplicate names or a name outside printable ASCII: the library gives
    no index (the Graph builds its own); an index of another graph, or a
    damaged one, is not adopted."""
    from npu_amp_tf import bridge

    bridge.register()
    dup = _odd_graph()
    dup.node.add(name="a", op="NoOp")
    assert bridge.graph_index(dup) is None
    uni = _odd_graph()
    uni.node.add(name="caf\u00e9", op="NoOp")
    assert bridge.graph_index(uni) is None
    # a dangling input outside printable ASCII, where the node before read an
    # ASCII source of the same length at that position
    dangling = _repeated_inputs_graph()
    dangling.node.add(name="z1", op="NoOp").input.extend(["^bn1/AssignMovingAvg", "^gone"])
    dangling.node.add(name="z2", op="NoOp").input.extend(["^bn1/AssignMovingAvg", "^g\u00e9n"])
    assert bridge.graph_index(dangling) is None
    assert Graph(dangling, index=lambda: bridge.graph_index(dangling)).prebuilt_index is False
    gd = training_graph()
    blob = bridge.graph_index(gd)
    other = bridge.graph_index(_odd_graph())
    for bad in (other, blob[:-4], b"NPUIDX9" + blob[7:], b"", b"\x03\x03"):
        g = Graph(gd, index=bad)
        assert not g.prebuilt_index
        assert _indexes(g) == _indexes(Graph(gd))
    assert Graph(gd, index=lambda: None).prebuilt_index is False
    assert Graph(gd, index=lambda: blob).prebuilt_index is True


def test_serialize_equals_to_graph_def_bytes():
    """Graph.serialize (the bridge's output) is byte for byte the
    deterministic serialization of to_graph_def(): unchanged, after removals,
    re-adds, additions, in-place edits and a dangling colocation entry, with
    a function library."""
    for gd in (training_graph(), nested_function_graph(), v1_while_graph()):
        g = Graph(gd)
        assert g.serialize() == g.to_graph_def().SerializeToString(deterministic=True)
    gd = training_graph()
    gd.versions.producer = 1234
    g = Graph(gd)
    mm = g.nodes["MatMul"]
    g.remove_node("MatMul", force=True)
    new = node_def_pb2.NodeDef()
    new.CopyFrom(mm)
    g.add_node(new)
    g.new_node("NoOp", "late")
    g.nodes["x"].attr["_touched"].b = True
    g.touch("x")
    g.nodes["w"].attr["_class"].list.s.extend([b"loc:@x", b"loc:@gone", b"other"])
    g.nodes["y"].attr["_class"].list.s.extend([b"loc:@gone"])
    data = g.serialize()
    assert data == g.to_graph_def().SerializeToString(deterministic=True)
    out = graph_pb2.GraphDef.FromString(data)
    assert [n.name for n in out.node][-2:] == ["MatMul", "late"]
    assert "_class" not in {n.name: n for n in out.node}["y"].attr
    # the graph itself keeps its colocation entries (only the output drops them)
    assert b"loc:@gone" in list(g.nodes["w"].attr["_class"].list.s)


# ------------------------------------------- the C++ Kahn sort (issue 17f)
def _kahn_cases():
    """Real graphs, the odd one (a cycle outside loops, dangling inputs,
    duplicate reads), a v1 loop (NextIteration back edges), an empty one,
    and the same graphs after edits (new nodes, removed nodes, rewired
    edges) so the graph order is not the original one."""
    from test_speed_paths import bert_like_training_graph

    cases = [(b.__name__, b()) for b in ALL] + [("odd", _odd_graph()), ("empty", graph_pb2.GraphDef()),
                                                ("bert_like", bert_like_training_graph())]
    out = []
    for name, gd in cases:
        out.append((name, Graph(gd)))
        g = Graph(gd)
        names = list(g.nodes)
        if len(names) > 3:
            g.remove_node(names[0], force=True)  # its readers now read a dangling name
            g.new_node("NoOp", "npu_test/after", [f"^{names[-1]}", f"^{names[1]}"])
            node = g.nodes[names[2]]
            if node.input:
                g.set_input(names[2], 0, names[-1]) if not node.input[0].startswith("^") else None
            out.append((name + "_edited", g))
    return out


def test_native_kahn_order_equals_the_python_sort():
    """bridge.kahn_order (C++, installed as graph.native_kahn when the
    library loads) gives Graph.topo_order the same order, cycle flag and
    strict error as the Python sort, on real, odd and edited graphs."""
    from graph_passes import graph as graph_mod
    from npu_amp_tf import bridge

    bridge.register()
    assert graph_mod.native_kahn is bridge.kahn_order
    cycles = 0
    for name, g in _kahn_cases():
        g.native_sort = True
        fast, fast_cycle = g._compute_topo_order(False), g._has_cycle
        g.native_sort = False
        slow, slow_cycle = g._compute_topo_order(False), g._has_cycle
        assert fast == slow and fast_cycle == slow_cycle, name
        assert sorted(fast) == sorted(g.nodes), name
        cycles += slow_cycle
        for native in (True, False):
            g.native_sort = native
            g._topo_cache = None
            if slow_cycle:
                with pytest.raises(GraphError, match="cycle"):
                    g.topo_order(strict=True)
            else:
                assert g.topo_order(strict=True) == slow
    assert cycles, "no cycle among the cases"


def test_native_kahn_planted_fault_and_refusal(monkeypatch):
    """A C++ sort that breaks ties the other way is caught by the comparison
    above; one that refuses (None) leaves the Python sort's answer."""
    from graph_passes import graph as graph_mod
    from npu_amp_tf import bridge

    bridge.register()
    gd = training_graph()

    def lifo(n, counts, readers, back):  # a valid topological order, not Kahn's FIFO one
        from array import array
        start = [0]
        for c in counts:
            start.append(start[-1] + c)
        indeg = [0] * n
        for u in range(n):
            if not back[u]:
                for e in range(start[u], start[u + 1]):
                    if readers[e] >= 0:
                        indeg[readers[e]] += 1
        stack = [u for u in range(n) if indeg[u] == 0][::-1]
        out = array("i")
        while stack:
            u = stack.pop()
            out.append(u)
            if back[u]:
                continue
            for e in range(start[u], start[u + 1]):
                r = readers[e]
                if r >= 0:
                    indeg[r] -= 1
                    if indeg[r] == 0:
                        stack.append(r)
        return out

    ref = Graph(gd)
    ref.native_sort = False
    want = ref.topo_order()
    monkeypatch.setattr(graph_mod, "native_kahn", lifo)
    bad = Graph(gd).topo_order()
    assert sorted(bad) == sorted(want) and bad != want  # caught: not the reference order
    monkeypatch.setattr(graph_mod, "native_kahn", lambda *a: None)
    assert Graph(gd).topo_order() == want


def test_split_bytes_is_bytes_split():
    """``_split_bytes`` (the C++ index's sections, split with ``bytes.find``)
    gives ``bytes.split(sep, maxsplit)``'s parts on every short string of
    separators and other bytes, for every maxsplit up to past the count."""
    import itertools

    from graph_passes.graph import _split_bytes

    for size in range(7):
        for chars in itertools.product(b"a\x03\x00", repeat=size):
            data = bytes(chars)
            for maxsplit in range(size + 2):
                assert _split_bytes(data, b"\x03", maxsplit) == data.split(b"\x03", maxsplit)
