"""Issue 17m: the OpDef guard's clean case in C++.

Before the pipeline hands a rewritten graph back it checks the nodes its
passes changed, and their edges, against their OpDefs
(graph_passes/opdef_check.py).  Inside grappler a C++ check of the same
rules (``OpdefPrecheck``, custom_ops/opdef_precheck.cc) runs first on the
patch the bridge hands back; only when it cannot say "clean" does the
Python guard run, to word the problems.

Checked here:
* every class of problem the Python guard finds, planted in a changed node
  (or at an edge from one into an unchanged reader), is flagged by the C++
  check, and each clean variant is passed: C++ says clean exactly when
  ``opdef_check.changed_problems`` is empty (attrs unknown to the OpDef,
  missing attrs, type attrs that hold no type or a refused type, list(type)
  entries and minimums, int minimums, known-broken kernels per device and
  fused op, arity, edge dtypes, output ports, edges into unchanged readers,
  function calls against the library's signatures, ref and resource edges);
* on real training graphs (Keras ResNet50, the BERT-like builder, TF-Slim
  resnet_v1_50 and the odd graphs of test_precision_core), FP16 and BF16, the
  rewritten graph is clean for both, and the pipeline then does not run the
  Python checks; a fault planted in a changed node is flagged by both;
* a flagged graph still gives the Python guard's warning and keeps the
  original graph, offline and through grappler, the same as without the
  C++ check; a C++ check that wrongly said "clean" would be seen.
"""
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, types_pb2
from tensorflow.python.grappler import tf_optimizer

import npu_amp_tf
from graph_passes import manager, opdef_check, registry
from graph_passes.fusion import core as fusion_core
from graph_passes.graph import Graph
from graph_passes.pattern import Pat
from npu_amp_tf import bridge, pipeline
from test_precision_core import GRAPHS, _build
from test_speed_paths import plugin_only_grappler

F32, F16, BF16 = types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16
I32, STR, BOOL = types_pb2.DT_INT32, types_pb2.DT_STRING, types_pb2.DT_BOOL

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpGraphOpdefPrecheck"), reason="library without the pre-check")


# ------------------------------------------------------------------ helpers
def _node(op, name, inputs=(), device="", **attrs):
    n = node_def_pb2.NodeDef(op=op, name=name, device=device)
    n.input.extend(inputs)
    for k, v in attrs.items():
        if isinstance(v, tuple) and v[0] == "types":
            n.attr[k].list.type.extend(v[1])
        elif isinstance(v, tuple) and v[0] == "s":
            n.attr[k].list.s.extend(v[1])
        elif isinstance(v, tuple) and v[0] == "type":
            n.attr[k].type = v[1]
        elif isinstance(v, tuple) and v[0] == "shape":
            n.attr[k].shape.CopyFrom(tf.TensorShape(v[1]).as_proto())
        elif isinstance(v, bytes):
            n.attr[k].s = v
        elif isinstance(v, int):
            n.attr[k].i = v
        elif isinstance(v, list):
            n.attr[k].list.i.extend(v)
    return n


def _ph(name, dt):
    return _node("Placeholder", name, dtype=("type", dt))


def _gd(*nodes, functions=()):
    gd = graph_pb2.GraphDef()
    gd.node.extend(nodes)
    for f in functions:
        gd.library.function.add().CopyFrom(f)
    return gd


def _check(before, edit, device="CPU"):
    """(C++ answer, Python's changed_problems) for ``before`` edited by
    ``edit(graph)`` through a Graph, as the pipeline has them: the C++ check
    on the patch the bridge would hand back (a created NoOp makes the node
    count differ, so that there is a patch)."""
    g = Graph(before)
    edit(g)
    g.new_node("NoOp", "pad_17m")
    patch = g.serialize_patch()
    assert patch is not None
    native = bridge.graph_opdef_precheck(before.SerializeToString(), patch, device)
    return native, opdef_check.changed_problems(g, g.changed_nodes(), device)


def _touch(name, fn):
    def edit(g):
        fn(g.nodes[name])
        g.touch(name)
    return edit


def _add(*nodes):
    def edit(g):
        for n in nodes:
            g.add_node(n)
    return edit


def _list_min_op():
    """A registered op with a list(type) attr of minimum >= 1 and no other
    required attr, and that attr's name."""
    for op in ("IdentityN", "Unstage", "QueueDequeueV2", "StagePeek", "OrderedMapUnstage"):
        od = registry.op_def(op)
        if od is None:
            continue
        for a in od.attr:
            if a.type == "list(type)" and a.has_minimum and a.minimum >= 1:
                return op, a.name
    pytest.skip("no op with a list(type) minimum")


def _function(name="f17m", dt=F32):
    """f(x: dt) -> y: dt, an Identity body."""
    from tensorflow.core.framework import function_pb2

    f = function_pb2.FunctionDef()
    f.signature.name = name
    f.signature.input_arg.add(name="x", type=dt)
    f.signature.output_arg.add(name="y", type=dt)
    body = f.node_def.add(name="id", op="Identity", input=["x"])
    body.attr["T"].type = dt
    f.ret["y"] = "id:output:0"
    return f


def _add2():
    return _gd(_ph("x", F32), _ph("y", F32), _node("AddV2", "add", ["x", "y"], T=("type", F32)))


def _matmul(T=F32, inputs=("x", "y")):
    return _gd(_ph("x", F32), _ph("y", F32), _ph("i", I32), _node("NoOp", "dep"),
               _node("MatMul", "mm", list(inputs), T=("type", T)))


def _fused_conv(T=F16, device=""):
    return _gd(_ph("x", T), _ph("w", T), _ph("b", T),
               _node("_FusedConv2D", "conv", ["x", "w", "b"], device=device, T=("type", T),
                     TArgs=("types", [T]), num_args=1, strides=[1, 1, 1, 1], padding=b"SAME",
                     fused_ops=("s", [b"BiasAdd"])))


def _fused_matmul():
    return _gd(_ph("a", F32), _ph("b", F32), _ph("bias", F32),
               _node("_FusedMatMul", "fmm", ["a", "b", "bias"], T=("type", F32), num_args=1,
                     fused_ops=("s", [b"BiasAdd", b"Relu"])))


def _reader_graph():
    """A Cast read by MatMuls: one reading it in the right place, one after
    control inputs, one with three data inputs (the input's own arity
    problem)."""
    return _gd(_ph("x", F32), _ph("y", F32), _node("NoOp", "dep"),
               _node("Cast", "c", ["x"], SrcT=("type", F32), DstT=("type", F32)),
               _node("MatMul", "mm", ["c", "y"], T=("type", F32)),
               _node("MatMul", "mm_ctrl", ["^dep", "c", "y"], T=("type", F32)),
               _node("MatMul", "mm_arity", ["c", "y", "x"], T=("type", F32)))


def _set_type(attr, dt):
    def fn(n):
        n.attr[attr].type = dt
    return fn


# (name, before graph, edit, a phrase of the Python problem, or None: clean)
CASES = [
    ("clean_touch", _add2, _touch("add", lambda n: None), None),
    ("attr_not_in_opdef", _add2, _touch("add", lambda n: n.attr["bogus"].CopyFrom(
        attr_value_pb2.AttrValue(i=3))), "has attr 'bogus', which its OpDef does not define"),
    ("private_attr_allowed", _add2, _touch("add", lambda n: n.attr["_private"].CopyFrom(
        attr_value_pb2.AttrValue(i=3))), None),
    ("attr_missing", _add2, _touch("add", lambda n: n.attr.__delitem__("T")), "lacks attr 'T' (no default)"),
    ("attr_with_default_missing", lambda: _matmul(), _touch("mm", lambda n: None), None),
    ("type_attr_not_a_type", _add2, _touch("add", lambda n: n.attr["T"].CopyFrom(
        attr_value_pb2.AttrValue(i=1))), "attr 'T' is not a type"),
    ("type_not_allowed", lambda: _matmul(), _touch("mm", _set_type("T", STR)),
     "attr T=string is not allowed by its OpDef"),
    ("list_type_not_allowed", lambda: _gd(_ph("s", STR), _ph("d", F32)),
     _add(_node("DecodeCSV", "csv", ["s", "d"], OUT_TYPE=("types", [BOOL]))),
     "attr OUT_TYPE holds ['bool'], not allowed by its OpDef"),
    ("list_type_allowed", lambda: _gd(_ph("s", STR), _ph("d", F32)),
     _add(_node("DecodeCSV", "csv", ["s", "d"], OUT_TYPE=("types", [F32]))), None),
    ("list_type_below_minimum", lambda: _gd(_ph("x", F32)), "list_min", "entries, minimum"),
    ("int_below_minimum", lambda: _gd(_ph("x", F32)),
     _add(_node("AddN", "addn", [], T=("type", F32), N=0)), "attr N=0 is below its minimum 1"),
    ("broken_kernel_cpu", lambda: _fused_conv(F16), _touch("conv", lambda n: None), "known-broken"),
    ("broken_kernel_full_device", lambda: _fused_conv(F16, "/job:localhost/replica:0/task:0/device:CPU:0"),
     _touch("conv", lambda n: None), "known-broken"),
    ("broken_kernel_short_device", lambda: _fused_conv(F16, "/cpu:0"), _touch("conv", lambda n: None),
     "known-broken"),
    ("not_broken_on_gpu", lambda: _fused_conv(F16, "/job:localhost/replica:0/task:0/device:GPU:0"),
     _touch("conv", lambda n: None), None),
    ("not_broken_in_float", lambda: _fused_conv(F32), _touch("conv", lambda n: None), None),
    ("broken_fused_op", _fused_matmul, _touch("fmm", lambda n: None), "known-broken"),
    ("arity", lambda: _matmul(inputs=("x",)), _touch("mm", lambda n: None),
     "has 1 data inputs, its signature wants 2"),
    ("edge_dtype", lambda: _matmul(), _touch("mm", _set_type("T", F16)),
     "'x' -> 'mm':0 carries float32 but MatMul expects float16"),
    ("edge_after_control_inputs", lambda: _matmul(inputs=("^dep", "x", "y")), _touch("mm", lambda n: None),
     None),
    ("bad_port", lambda: _gd(_ph("x", F32)), _add(_node("Relu", "r", ["x:1"], T=("type", F32))),
     "reads output 1 of 'x', which has 1"),
    ("dangling_input", lambda: _gd(_ph("x", F32)), _add(_node("Relu", "r", ["gone"], T=("type", F32))),
     None),
    ("reader_edge", _reader_graph, _touch("c", _set_type("DstT", F16)),
     "'c' -> 'mm':0 carries float16 but MatMul expects float32"),
    ("reader_edge_consistent", _reader_graph, _touch("c", lambda n: None), None),
    ("function_call_edge", lambda: _gd(_ph("x", F32), _ph("i", I32), _node("f17m", "call", ["x"]),
                                       functions=[_function()]),
     lambda g: g.set_input("call", 0, "i"), "carries int32 but f17m expects float32"),
    ("function_call_arity", lambda: _gd(_ph("x", F32), _ph("i", I32), _node("f17m", "call", ["x"]),
                                        functions=[_function()]),
     _touch("call", lambda n: n.input.append("x")), "has 2 data inputs, its signature wants 1"),
    ("function_call_clean", lambda: _gd(_ph("x", F32), _node("f17m", "call", ["x"]), functions=[_function()]),
     _touch("call", lambda n: None), None),
    ("ref_edge", lambda: _gd(_node("VariableV2", "v", dtype=("type", F32), shape=("shape", [2]))),
     _add(_node("Identity", "id", ["v"], T=("type", F32))), None),
    ("ref_edge_mismatch", lambda: _gd(_node("VariableV2", "v", dtype=("type", F32), shape=("shape", [2]))),
     _add(_node("Identity", "id", ["v"], T=("type", F16))), "carries float32 but Identity expects float16"),
    ("resource_edge", lambda: _gd(_node("VarHandleOp", "h", dtype=("type", F32), shape=("shape", [2]))),
     _add(_node("ReadVariableOp", "r", ["h"], dtype=("type", F16))), None),
    ("unknown_op", lambda: _gd(_ph("x", F32)), _add(_node("NpuTestUnknownOp17m", "u", ["x"], T=("type", F32))),
     None),
]


def planted(case, monkeypatch):
    """``(build, edit, phrase)`` of a CASES entry, with what it needs set up:
    the list-minimum op found in this TF's registry, a broken fused
    activation planted in ``registry.BROKEN_FUSED_OPS`` (the real ones need
    TF >= 2.16)."""
    name, build, edit, phrase = case
    if edit == "list_min":
        op, attr = _list_min_op()
        edit = _add(_node(op, "lst", [], **{attr: ("types", [])}))
    if name == "broken_fused_op":
        monkeypatch.setitem(registry.BROKEN_FUSED_OPS, ("_FusedMatMul", "CPU", F32, "Relu"),
                            ((2, 0), "planted for the test"))
    return build, edit, phrase


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpp_check_flags_exactly_what_the_python_guard_finds(case, monkeypatch):
    """Each class of problem in a changed node (or at an edge from one): the
    C++ answer is "clean" exactly when the Python check finds nothing, and
    the Python check finds the problem planted (the phrase, derived from the
    graph's construction)."""
    name = case[0]
    build, edit, phrase = planted(case, monkeypatch)
    if name.startswith(("broken_kernel", "not_broken")):
        assert ("_FusedConv2D", "CPU", F16) in registry.BROKEN_KERNELS
        assert registry.opdef_allows("_FusedConv2D", {"T": F16})
    native, problems = _check(build(), edit)
    if phrase is None:
        assert problems == [] and native is True, (problems, native)
    else:
        assert any(phrase in p for p in problems), problems
        assert native is False, problems


def test_broken_fused_op_unplanted_is_clean():
    """The same _FusedMatMul without the planted entry: clean for both."""
    native, problems = _check(_fused_matmul(), _touch("fmm", lambda n: None))
    assert problems == [] and native is True


def test_default_device_decides_for_unplaced_nodes():
    """An unplaced FP16 _FusedConv2D is broken on the default device CPU, not on GPU."""
    assert _check(_fused_conv(F16), _touch("conv", lambda n: None), "GPU") == (True, [])
    native, problems = _check(_fused_conv(F16), _touch("conv", lambda n: None), "CPU")
    assert native is False and problems


def test_a_patch_that_does_not_fit_is_not_called_clean():
    g = Graph(_add2())
    g.new_node("NoOp", "pad_17m")
    patch = g.serialize_patch()
    bad = patch._replace(order=patch.order[:-1])  # one node short: the payload holds more
    assert bridge.graph_opdef_precheck(_add2().SerializeToString(), bad, "CPU") is None


# ------------------------------------------------------------ real graphs
MODES = {"fp16": dict(precision_mode="allow_mix_precision"),
         "bf16-level3": dict(precision_mode="allow_mix_precision_bf16", graph_level=3)}


def _counting(monkeypatch):
    """Count the Python guard's per-node checks and the C++ answers."""
    calls = {"python": 0, "native": []}
    real_changed, real_native = opdef_check.changed_problems, bridge.graph_opdef_precheck

    def changed(*a, **k):
        calls["python"] += 1
        return real_changed(*a, **k)

    def native(*a, **k):
        out = real_native(*a, **k)
        calls["native"].append(out)
        return out

    monkeypatch.setattr(opdef_check, "changed_problems", changed)
    monkeypatch.setattr(bridge, "graph_opdef_precheck", native)
    return calls


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", GRAPHS)
def test_real_graphs_are_clean_for_both_and_skip_the_python_checks(k2, name, mode, monkeypatch):
    """The pipeline on real graphs, the output as a patch: the C++ check says
    clean, the Python check finds nothing either, the pipeline ran no Python
    check, and its output is byte-identical to the one without the C++
    check."""
    gd, fetches = _build(name, k2)
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(**MODES[mode])
    g = Graph(data)
    manager.PassManager(pipeline.pass_names(opts)).run(g, manager.PassContext(opts, fetches))
    patch = g.serialize_patch()
    if patch is None:
        pytest.skip("the pipeline leaves the node count as it was: no patch")
    assert bridge.graph_opdef_precheck(data, patch, "CPU") is True
    assert opdef_check.changed_problems(g, g.changed_nodes(), "CPU") == []
    ref, rep_ref, _ = pipeline.optimize_serialized(data, opts, fetches=fetches, patch=True,
                                                   opdef_precheck=None)
    calls = _counting(monkeypatch)
    out, rep, _ = pipeline.optimize_serialized(data, opts, fetches=fetches, patch=True)
    assert calls == {"python": 0, "native": [True]}, calls
    assert out == ref and "failed_pass" not in rep.summary


def _fp32_root(g, n):
    src = g.nodes[n].input[0].split(":")[0]
    while g.nodes[src].op == "Cast":
        src = g.nodes[src].input[0].split(":")[0]
    return src if g.tensor_dtype(src) == registry.DT_FLOAT else None


def rewritten(name, k2):
    """(the real graph ``name``'s bytes, its Graph after the plugin's passes in
    allow_mix_precision)."""
    gd, fetches = _build(name, k2)
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision")
    g = Graph(data)
    manager.PassManager(pipeline.pass_names(opts)).run(g, manager.PassContext(opts, fetches))
    return data, g


def plant_fp32_feed(g):
    """The planted fault: a low-precision MatMul / Conv2D the rewrite changed,
    fed straight from its FP32 source, past its Cast.  Returns its name."""
    node = next(n for n in sorted(g.changed_nodes()) if g.nodes[n].op in ("MatMul", "Conv2D")
                and g.nodes[n].attr["T"].type in registry.LOW_TYPES and _fp32_root(g, n))
    g.set_input(node, 0, _fp32_root(g, node))
    return node


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "slim_resnet_v1_50"])
def test_a_fault_planted_in_a_real_rewrite_is_flagged(k2, name):
    """A low-precision MatMul/Conv2D of the rewritten graph fed straight from
    its FP32 source (past its Cast): both checks find it."""
    data, g = rewritten(name, k2)
    node = plant_fp32_feed(g)
    patch = g.serialize_patch()
    problems = opdef_check.changed_problems(g, g.changed_nodes(), "CPU")
    assert any(f"-> '{node}':0 carries float32" in p for p in problems), problems
    assert bridge.graph_opdef_precheck(data, patch, "CPU") is False


# ------------------------------------------- a flagged graph: warning, original kept
def _bad_rule_graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        tf.identity(tf.nn.relu(tf.matmul(x, tf.ones([3, 3])), name="act"), name="out")
    return g.as_graph_def()


def register_bad_rule():
    """A user fusion rule whose Relu is valid alone but mistyped for its input
    edge (float64 fed float32), plus a created node so the output is a patch;
    returns the call that unregisters it."""
    def build(m, b):
        b.emit("Relu", m.anchor, [m["x"]], {"T": ("type", types_pb2.DT_DOUBLE)})

    fusion_core.register_fusion_rule("test_17m_bad", Pat("Relu", inputs=[Pat.any("x")]), build,
                                     graph_level=2)
    return lambda: fusion_core.unregister_fusion_rule("test_17m_bad")


@pytest.fixture
def bad_rule():
    """:func:`register_bad_rule` for the test."""
    unregister = register_bad_rule()
    try:
        yield
    finally:
        unregister()


def _opdef_warnings(rep):
    warnings = rep["warnings"] if isinstance(rep, dict) else rep.warnings
    return [(w["message"], w["node"]) for w in warnings if w["pass"] == "opdef_check"]


def test_flagged_graph_keeps_the_original_with_the_same_warning_offline(bad_rule, monkeypatch):
    gd = _bad_rule_graph()
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision_bf16", graph_level=2)
    ref, rep_ref, _ = pipeline.optimize_serialized(data, opts, fetches=["out"], patch=True,
                                                   opdef_precheck=None)
    calls = _counting(monkeypatch)
    out, rep, _ = pipeline.optimize_serialized(data, opts, fetches=["out"], patch=True)
    assert calls["native"] == [False] and calls["python"] == 1, calls
    assert out == ref == data  # the original graph's bytes
    warn = _opdef_warnings(rep)
    assert warn and warn == _opdef_warnings(rep_ref)
    # (the MatMul feeding the mistyped Relu runs in BF16 by then)
    assert "-> 'act':0 carries bfloat16 but Relu expects float64" in warn[0][0]
    assert "left unchanged" in warn[0][0]
    assert rep.summary["failed_pass"] == "opdef_check"


def test_a_cpp_check_that_wrongly_says_clean_would_be_seen(bad_rule, monkeypatch):
    """Planted fault: the C++ answer forced to "clean" lets the broken graph
    through (so the test above would fail)."""
    gd = _bad_rule_graph()
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision_bf16", graph_level=2)
    monkeypatch.setattr(bridge, "graph_opdef_precheck", lambda *a: True)
    out, rep, _ = pipeline.optimize_serialized(data, opts, fetches=["out"], patch=True)
    assert out != data and not _opdef_warnings(rep)


def _grappler(gd, fetches):
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["graph_level"].i = 2
    bridge.clear_reports()
    out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17m")
    return out, bridge.last_reports()


def _counting_item(monkeypatch):
    answers = []
    real = bridge.item_opdef_precheck

    def item(*a, **k):
        answers.append(real(*a, **k))
        return answers[-1]

    monkeypatch.setattr(bridge, "item_opdef_precheck", item)
    return answers


def test_flagged_graph_through_grappler_keeps_the_original(bad_rule, monkeypatch):
    bridge.register()
    gd = _bad_rule_graph()
    answers = _counting_item(monkeypatch)
    out, recs = _grappler(gd, ["out"])
    assert answers == [False]
    rec = recs[-1]
    assert rec["status"] == "pass_failed_kept", rec
    warn = _opdef_warnings(rec["report"])
    monkeypatch.setattr(bridge, "item_opdef_precheck", lambda *a: None)  # the Python guard alone
    out_ref, recs_ref = _grappler(gd, ["out"])
    assert warn and warn == _opdef_warnings(recs_ref[-1]["report"])
    assert out.SerializeToString(deterministic=True) == out_ref.SerializeToString(deterministic=True)
    assert sorted(n.op for n in out.node) == sorted(n.op for n in gd.node)  # nothing of the rewrite


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_through_grappler_the_clean_case_skips_python_and_output_is_unchanged(k2, name, monkeypatch):
    """Inside grappler: the C++ check on the item says clean, the Python
    checks do not run, and grappler's output is byte-identical to the one
    with the Python guard alone (the patch the check parsed is the one
    assembled)."""
    bridge.register()
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    answers = _counting_item(monkeypatch)
    calls = {"python": 0}
    real_changed = opdef_check.changed_problems

    def changed(*a, **k):
        calls["python"] += 1
        return real_changed(*a, **k)

    monkeypatch.setattr(opdef_check, "changed_problems", changed)
    bridge.clear_reports()
    out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17m")
    assert answers == [True] and calls["python"] == 0, (answers, calls)
    monkeypatch.setattr(bridge, "item_opdef_precheck", lambda *a: None)
    bridge.clear_reports()
    ref = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17m")
    assert calls["python"] == 1
    assert out.SerializeToString(deterministic=True) == ref.SerializeToString(deterministic=True)
