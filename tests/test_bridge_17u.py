"""Issue 17u: the grappler callback outside the passes (index, OpDef pre-check,
serialisation, memo key).

Each fast path sits behind a switch whose False value is the reference:

* ``bridge.FAST_INDEX``: the C++ index (``GraphIndexText``) looks names
  up in an open-addressing ``NameTable`` instead of a ``std::unordered_map``,
  checks names and inputs for printable ASCII 8 bytes at a time, and keys
  the signature classes in binary.  Checked: the index bytes (signature
  classes included) are identical on real graphs and odd ones (duplicate
  names, a control or non-ASCII byte at every position of two 8-byte words
  refused by both, DEL and blanks accepted, dangling inputs, loops).
* ``bridge.PRECHECK_FROM_INDEX``: the OpDef pre-check reads the names and
  consumers the C++ index kept (``OpdefPrecheckIndexed``) and visits only
  the unchanged nodes that read a changed node.  Checked: the same answer as
  the reference check for every problem class of tests/test_opdef_precheck.py,
  for names the output holds twice, for a changed node named as a dangling
  input of an unchanged reader, for faults planted in real rewrites, and
  inside grappler's callback (both checks asked of the same patch).
* ``bridge.SHARED_FINGERPRINT``: :func:`bridge.handle`'s memo knows the bytes
  by the C++ fingerprint instead of their SHA-1.  Checked: a graph handed
  again is answered from the memo on both paths, with the same output.
* ``Graph.numpy_adopt``: ``_adopt_index`` maps the index's int32 sections
  through numpy object arrays.  Checked: equal indexes on real graphs.
* ``Graph.fast_patch``: ``serialize_patch`` takes the order from ``_seq``.
  Checked: equal patches after the real pipeline, after a node removed and
  added again, after ``reindex()``, and with a node put in by hand.

And through grappler: the output bytes and the reports are identical with
every 17u switch off and on (Keras ResNet50, the BERT-like builder, a Keras 3
transformer).
"""
import array

import pytest
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.python.grappler import tf_optimizer

import npu_amp_tf
from graph_passes import manager, opdef_check
from graph_passes.graph import Graph, GraphPatch, _EncodedNames
from npu_amp_tf import bridge, pipeline
from test_bridge_17r import _both_indexes
from test_opdef_precheck import CASES, _add, _gd, _node, _ph, _touch, plant_fp32_feed, planted, rewritten
from test_precision_core import GRAPHS, _build
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler

F32, F16, I32 = types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_INT32

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpGraphOpdefPrecheckFlags"), reason="library without issue 17u's paths")

SWITCHES = ((bridge, "FAST_INDEX"), (bridge, "PRECHECK_FROM_INDEX"), (bridge, "SHARED_FINGERPRINT"),
            (Graph, "numpy_adopt"), (Graph, "fast_patch"), (Graph, "joined_patch"))


@pytest.fixture
def switches(monkeypatch):
    def set_(on):
        for obj, name in SWITCHES:
            monkeypatch.setattr(obj, name, on)
    return set_


# ------------------------------------------------------------------ the C++ index's name table
def _n(op, name, inputs=(), **attrs):
    n = node_def_pb2.NodeDef(op=op, name=name)
    n.input.extend(inputs)
    for k, v in attrs.items():
        n.attr[k].type = v
    return n


@pytest.mark.parametrize("name", GRAPHS)
def test_name_table_index_equals_the_reference_on_real_graphs(k2, name, switches, monkeypatch):
    gd, _ = _build(name, k2)
    for from_bytes in (False, True):
        monkeypatch.setattr(bridge, "INDEX_FROM_BYTES", from_bytes)
        ref, fast = _both_indexes(gd.SerializeToString(deterministic=True), switches)
        assert ref is not None and fast == ref


@pytest.mark.parametrize("case", ["duplicate", "non_ascii", "dangling_and_loop", "many_similar_names"])
def test_name_table_refuses_and_accepts_what_the_reference_does(case, switches):
    gd = graph_pb2.GraphDef()
    if case == "duplicate":
        gd.node.extend([_n("Placeholder", "x", dtype=F32), _n("Identity", "x", ["x"], T=F32)])
    elif case == "non_ascii":
        gd.node.extend([_n("Placeholder", "x\u00e9", dtype=F32), _n("Identity", "i", ["x\u00e9"], T=F32)])
    elif case == "dangling_and_loop":
        gd.node.extend([_n("Placeholder", "x", dtype=F32), _n("Enter", "e", ["x"], T=F32),
                        _n("Merge", "m", ["e", "ni"], T=F32), _n("NextIteration", "ni", ["m"], T=F32),
                        _n("Identity", "d", ["nowhere:1", "^gone"], T=F32), _n("Unknown17u", "u", ["m:0"])])
    else:  # names sharing long prefixes and 8-byte blocks (the table's hash), one duplicate at the end
        names = [f"{'scope/' * 3}{'a' * (k % 9)}{k}" for k in range(300)] + ["", "a" * 8, "a" * 16]
        gd.node.extend(_n("Placeholder", s, dtype=F32) for s in names)
        gd.node.extend(_n("Identity", f"id{k}", [names[k], f"^{names[-k]}", "a" * 8 + ":1"], T=F32)
                       for k in range(1, 300, 7))
        ok = gd.SerializeToString()
        ref, fast = _both_indexes(ok, switches)
        assert ref is not None and fast == ref
        gd.node.extend([_n("Placeholder", names[150], dtype=F32)])
    ref, fast = _both_indexes(gd.SerializeToString(), switches)
    assert fast == ref
    assert (ref is None) == (case != "dangling_and_loop")


@pytest.mark.parametrize("where", ["name", "input"])
def test_fast_ascii_check_refuses_and_accepts_what_the_reference_does(where, switches):
    for ch in ("\x1f", "\x01", "\t", "\x7f", " ", "~", "\u00e9", "\u20ac"):
        for pos in range(17):
            odd = "a" * pos + ch + "b" * (16 - pos)
            gd = graph_pb2.GraphDef()
            if where == "name":
                gd.node.extend([_n("Placeholder", odd, dtype=F32), _n("Identity", "i", [odd], T=F32)])
            else:
                gd.node.extend([_n("Placeholder", "x", dtype=F32), _n("Identity", "i", ["x", "^" + odd], T=F32)])
            ref, fast = _both_indexes(gd.SerializeToString(), switches)
            assert fast == ref, (ch, pos)
            assert (ref is None) == (ch not in ("\x7f", " ", "~")), (ch, pos)


# ------------------------------------------------------------------ the pre-check from the index
def _prechecks(before, edit, device="CPU"):
    """The reference and the indexed C++ answers for ``before`` edited by
    ``edit`` (a created NoOp makes a patch), and Python's problems."""
    g = Graph(before)
    edit(g)
    g.new_node("NoOp", "pad_17u")
    patch = g.serialize_patch()
    assert patch is not None
    data = before.SerializeToString()
    return (bridge.graph_opdef_precheck(data, patch, device),
            bridge.graph_opdef_precheck(data, patch, device, indexed=True),
            opdef_check.changed_problems(g, g.changed_nodes(), device))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_indexed_precheck_answers_as_the_reference_for_every_problem_class(case, monkeypatch):
    name = case[0]
    build, edit, phrase = planted(case, monkeypatch)
    for fast_names in (False, True):
        monkeypatch.setattr(bridge, "FAST_INDEX", fast_names)
        ref, indexed, problems = _prechecks(build(), edit)
        assert indexed == ref, (name, ref, indexed)
        assert ref is (phrase is None) and (problems == []) is (phrase is None), (ref, problems)


def _dangling_reader():
    # 'd' reads "nowhere", which is no node of the input
    return _gd(_ph("x", F32), _node("Identity", "d", ["nowhere"], T=("type", F32)),
               _node("Identity", "e", ["x"], T=("type", F32)))


@pytest.mark.parametrize("case", ["dangling_now_a_changed_node", "dangling_now_consistent",
                                  "name_of_a_kept_node", "two_changed_nodes_one_name",
                                  "reader_of_a_removed_node", "control_reader_only"])
def test_indexed_precheck_on_names_and_readers(case):
    """Names the output resolves differently from the input: a changed node
    named as an unchanged reader's dangling input (its edge is checked), a
    changed node named as a kept node or as another changed node (the
    output holds a name twice: neither check can tell), a reader of a node
    the pipeline removed (no edge to check), a control-only reader."""
    if case.startswith("dangling"):
        dt = I32 if case == "dangling_now_a_changed_node" else F32
        ref, indexed, problems = _prechecks(_dangling_reader(), _add(_ph("nowhere", dt)))
        assert indexed == ref
        assert ref is (dt == F32) and (problems == []) is (dt == F32)
        return
    if case in ("name_of_a_kept_node", "two_changed_nodes_one_name"):
        before = _dangling_reader()  # x, d, e
        payload = _gd(_node("NoOp", "pad_17u"), _node("NoOp", "e" if case == "name_of_a_kept_node" else "pad_17u"))
        order = array.array("i", [0, 1, 2, -1, -1])
        bad = GraphPatch(order, payload.SerializeToString(), len(order))
        data = before.SerializeToString()
        ref = bridge.graph_opdef_precheck(data, bad, "CPU")
        assert ref is None  # a name twice: neither can tell
        assert bridge.graph_opdef_precheck(data, bad, "CPU", indexed=True) is None
        return
    if case == "reader_of_a_removed_node":
        def edit(g):
            g.remove_node("x", force=True)
            g.add_node(_node("Const", "c", dtype=("type", I32)))
        ref, indexed, problems = _prechecks(_dangling_reader(), edit)
    else:  # 'x' changed to int32: its only reader waits on it (a control edge): clean
        before = _gd(_ph("x", F32), _ph("y", F32), _node("NoOp", "n", ["^x"]),
                     _node("Identity", "i", ["y", "^x"], T=("type", F32)))
        ref, indexed, problems = _prechecks(before, _touch("x", lambda n: n.attr["dtype"].__setattr__("type", I32)))
        assert ref is True and problems == []
    assert indexed == ref


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "slim_resnet_v1_50"])
def test_indexed_precheck_on_real_rewrites_clean_and_with_a_planted_fault(k2, name):
    data, g = rewritten(name, k2)
    patch = g.serialize_patch()
    assert bridge.graph_opdef_precheck(data, patch, "CPU") is True
    assert bridge.graph_opdef_precheck(data, patch, "CPU", indexed=True) is True
    node = plant_fp32_feed(g)  # (test_opdef_precheck's planted fault)
    patch = g.serialize_patch()
    problems = opdef_check.changed_problems(g, g.changed_nodes(), "CPU")
    assert any(f"-> '{node}':0 carries float32" in p for p in problems), problems
    assert bridge.graph_opdef_precheck(data, patch, "CPU") is False
    assert bridge.graph_opdef_precheck(data, patch, "CPU", indexed=True) is False


# ------------------------------------------------------------------ Python: adopt, patch
@pytest.mark.parametrize("name", GRAPHS)
def test_numpy_adopt_gives_the_reference_indexes(k2, name, monkeypatch):
    gd, _ = _build(name, k2)
    data = gd.SerializeToString(deterministic=True)
    blob = bridge.graph_index(None, data)
    graphs = []
    for on in (False, True):
        monkeypatch.setattr(Graph, "numpy_adopt", on)
        g = Graph(data, index=blob)
        assert g.prebuilt_index
        graphs.append(g)
    ref, fast = graphs
    assert list(fast.nodes) == list(ref.nodes)
    assert dict(fast._consumers) == dict(ref._consumers)
    assert fast._by_op == ref._by_op and fast._seq == ref._seq and fast._topo_cache == ref._topo_cache
    assert fast.topo_order() == ref.topo_order()


def _patches(g_factory, monkeypatch):
    out = []
    for on in (False, True):
        monkeypatch.setattr(Graph, "fast_patch", on)
        out.append(g_factory().serialize_patch())
    return out


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "control_inputs", "v1_loop"])
def test_fast_patch_equals_the_reference_after_the_pipeline(k2, name, monkeypatch):
    gd, fetches = _build(name, k2)
    data = gd.SerializeToString(deterministic=True)
    opts = npu_amp_tf.Options.from_kwargs(precision_mode="allow_mix_precision_bf16", graph_level=3)

    def run():
        g = Graph(data, index=bridge.graph_index(None, data))
        manager.PassManager(pipeline.pass_names(opts)).run(g, manager.PassContext(opts, fetches))
        return g
    ref, fast = _patches(run, monkeypatch)
    if ref is None:
        pytest.skip("no patch: the node count is the input's")
    assert fast.order == ref.order and fast.payload == ref.payload and fast.nodes == ref.nodes


def test_joined_entries_write_each_colocated_node_as_the_reference_does():
    """Several changed nodes, some holding "_class" (one naming a node that is gone, one
    naming live nodes, one only in a name): each entry equals _node_bytes' (the reference),
    and only the entry naming a gone node changes."""
    nodes = [_node("Identity", "a", ["x"], T=("type", F32)), _node("Identity", "b_class", ["x"], T=("type", F32)),
             _node("Identity", "c", ["x"], T=("type", F32)), _node("Identity", "d", ["x"], T=("type", F32)),
             _node("Identity", "e", ["x"], T=("type", F32))]
    nodes[0].attr["_class"].list.s.extend([b"loc:@x", b"loc:@gone"])
    nodes[2].attr["_class"].list.s.extend([b"loc:@x"])
    nodes[4].attr["_class"].list.s.extend([b"loc:@gone", b"loc:@x", b"other"])
    names = _EncodedNames({"x", "a", "b_class", "c", "d", "e"})
    g = Graph()
    want = b"".join(g._node_bytes(n, names) for n in nodes)
    plain = b"".join(graph_pb2.GraphDef(node=nodes).SerializeToString(deterministic=True) for _ in [0])
    assert Graph._joined_entries(nodes, names) == [want]
    assert want != plain  # (the entries of 'a' and 'e' lost loc:@gone)
    out = graph_pb2.GraphDef.FromString(want)
    assert [list(n.attr["_class"].list.s) for n in out.node] == [[b"loc:@x"], [], [b"loc:@x"], [], [b"loc:@x", b"other"]]
    assert Graph._joined_entries(nodes, _EncodedNames({"x", "gone"})) == [plain]


@pytest.mark.parametrize("case", ["removed_and_added_again", "reindexed", "put_in_by_hand", "colocation",
                                  "colocation_on_a_changed_node"])
def test_fast_patch_equals_the_reference_on_edits(case, monkeypatch):
    before = _gd(_ph("x", F32), _ph("y", F32), _node("AddV2", "add", ["x", "y"], T=("type", F32)),
                 _node("Identity", "i", ["add"], T=("type", F32)))
    before.node[3].attr["_class"].list.s.extend([b"loc:@y", b"loc:@add"])

    def build():
        g = Graph(before)
        if case == "removed_and_added_again":
            node = g.nodes["add"]
            g.remove_node("add", force=True)
            g.add_node(node)
            g.new_node("NoOp", "pad")
        elif case == "reindexed":
            g.new_node("NoOp", "pad")
            g.nodes["i"].input.append("^pad")
            g.reindex()
        elif case == "put_in_by_hand":
            g.new_node("NoOp", "pad")
            g.nodes["by_hand"] = _node("NoOp", "by_hand")
        elif case == "colocation_on_a_changed_node":  # 'i' edited: its entry written here
            g.set_input("i", 0, "x")
            g.remove_node("add", force=True)
            g.new_node("NoOp", "pad")
            g.new_node("NoOp", "pad2")
        else:
            g.remove_node("y", force=True)
            g.new_node("Const", "y2", attrs={"dtype": F32})
            g.set_input("add", 1, "y2")
            g.new_node("NoOp", "pad")
        return g
    ref, fast = _patches(build, monkeypatch)
    assert ref is not None
    assert fast.order == ref.order and fast.payload == ref.payload and fast.nodes == ref.nodes
    if case == "colocation_on_a_changed_node":
        # the joined entries hold "_class": 'i''s entry written again with 'add' (gone) dropped,
        # an entry whose colocation names live nodes left as serialised
        g = build()
        names, with_add = _EncodedNames(set(g.nodes)), _EncodedNames(set(g.nodes) | {"add"})
        fixed = Graph._joined_entries([g.nodes["i"]], names)[0]
        assert fixed == g._node_bytes(g.nodes["i"], names) != Graph._joined_entries([g.nodes["i"]], with_add)[0]
        assert Graph._joined_entries([g.nodes["i"]], with_add)[0] == g._node_bytes(g.nodes["i"], with_add)
        patched = graph_pb2.GraphDef.FromString(fast.payload)
        assert list(next(n for n in patched.node if n.name == "i").attr["_class"].list.s) == [b"loc:@y"]
    if case == "colocation":  # 'i' is unchanged: its entry is dropped by the assembly, not here
        out = graph_pb2.GraphDef.FromString(bridge.assemble_patch(before.SerializeToString(), fast))
        assert list(next(n for n in out.node if n.name == "i").attr["_class"].list.s) == [b"loc:@add"]


# ------------------------------------------------------------------ through grappler
def _grappler_runs(gd, fetches, switches, modes=(False, True, False)):
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, reps = [], []
    for on in modes:
        switches(on)
        out, rep = optimize_rewritten(cfg, mg, b"test_17u")
        outs.append(out)
        reps.append(_strip_times(rep))
    return outs, reps


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras3_transformer"])
def test_grappler_output_is_identical_with_and_without_the_17u_paths(k2, name, switches, monkeypatch):
    if name == "keras3_transformer":
        from test_fusion_skip import keras3_transformer_training_graph

        gd, fetches = keras3_transformer_training_graph()
    else:
        gd, fetches = _build(name, k2)
    # inside the callback, both pre-checks asked of the same patch (the index kept)
    answers = []
    real = bridge.item_opdef_precheck

    def both(sink, patch, device="CPU"):
        got = []
        for flag in (0, 8):  # kFlagPrecheckFromIndex off, on (the index kept by NpuAmpItemIndex)
            bridge._lib.NpuAmpSinkFlags(sink, (bridge._sink_flags() & ~8) | flag)
            got.append(real(sink, patch, device))
        answers.append(tuple(got))
        return got[1]

    outs, reps = _grappler_runs(gd, fetches, switches)
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert reps[1] == reps[0] and reps[2] == reps[0]
    monkeypatch.setattr(bridge, "item_opdef_precheck", both)
    switches(True)
    bridge.clear_reports()
    mg, cfg = plugin_only_grappler(gd, fetches)
    out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17u")
    assert out.SerializeToString(deterministic=True) == outs[0]
    assert answers and all(a == (True, True) for a in answers), answers


def test_the_memo_answers_a_graph_handed_again_on_both_paths(k2, switches):
    gd, fetches = _build("bert_like", k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    for on in (False, True):
        switches(on)
        bridge.clear_reports()
        first = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17u_memo")
        again = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17u_memo")
        statuses = [r["status"] for r in bridge.last_reports()]
        assert statuses.count("rewritten") == 1 and "cached" in statuses, statuses
        assert again.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True)
