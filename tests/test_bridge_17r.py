"""Issue 17r: the grappler bridge's C++ steps around the Python callback.

Two fast paths, each behind a switch whose False value is the reference:

* ``bridge.INDEX_FROM_BYTES``: the C++ graph index (``GraphIndexText``) reads
  node names, ops and inputs from the item's serialized bytes
  (``ViewsOfBytes``, a wire-format scan) instead of from the parsed GraphDef.
  Checked: the index bytes are identical to the reference's on real training
  graphs and on odd graphs (control and dangling inputs, loops, unknown ops);
  on hand-written wire bytes the scan follows the parser's rules (a name
  given twice keeps the last, inputs split around other fields append,
  unknown fields are skipped); graphs the index refuses (duplicate names,
  non-ASCII names) are refused on both paths.
* ``pipeline.OWN_PARSE``: given bytes (the bridge now hands them over), the
  pipeline rewrites its own parse in place instead of a copy, and parses the
  input again only when a failure or an OpDef problem needs it.  Checked
  with the two below: grappler's output and the report are identical.
* ``bridge.MOVE_ITEM_NODES``: grappler's output is assembled from the patch
  by moving the item's unchanged nodes instead of copying them.  Checked:
  grappler's output is byte-identical with both switches on and off (Keras
  ResNet50 training graph, the BERT-like builder); a patch that does not fit
  the item gives the reference's result (nothing moved before the check).

Also: ``bridge.step_times()`` reports each C++ step of the last call.
"""
import pytest
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.python.grappler import tf_optimizer

from graph_passes.graph import GraphPatch, _varint
from npu_amp_tf import bridge, pipeline
from test_precision_core import GRAPHS, _build
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler

F32 = types_pb2.DT_FLOAT

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpGraphIndexFlags"), reason="library without issue 17r's paths")


@pytest.fixture
def switches(monkeypatch):
    def set_(on):
        monkeypatch.setattr(bridge, "INDEX_FROM_BYTES", on)
        monkeypatch.setattr(bridge, "MOVE_ITEM_NODES", on)
        monkeypatch.setattr(pipeline, "OWN_PARSE", on)
    return set_


def _both_indexes(data, switches):
    out = []
    for on in (False, True):
        switches(on)
        out.append(bridge.graph_index(None, data))
    return out


# ------------------------------------------------------------------ the index from bytes
@pytest.mark.parametrize("name", GRAPHS)
def test_index_from_bytes_equals_the_reference_on_real_graphs(k2, name, switches):
    gd, _ = _build(name, k2)
    for det in (True, False):
        data = gd.SerializeToString(deterministic=det)
        ref, fast = _both_indexes(data, switches)
        assert ref is not None and fast == ref


def _n(op, name, inputs=(), **attrs):
    n = node_def_pb2.NodeDef(op=op, name=name)
    n.input.extend(inputs)
    for k, v in attrs.items():
        n.attr[k].type = v
    return n


def _gd(*nodes):
    gd = graph_pb2.GraphDef()
    gd.node.extend(nodes)
    gd.versions.producer = 1234
    return gd


def _field(num, payload: bytes) -> bytes:
    """A length-delimited wire field."""
    return _varint((num << 3) | 2) + _varint(len(payload)) + payload


def test_index_from_bytes_follows_the_parsers_rules_on_unusual_wire_bytes(switches):
    """Fields out of order, a name given twice (the parser keeps the last),
    inputs split around other fields, unknown and varint fields, versions
    before the nodes: the parsed graph and the scan agree, so do the
    indexes."""
    x = _n("Placeholder", "x", dtype=F32)
    y = _n("Placeholder", "y", dtype=F32)
    add = _n("AddV2", "add", ["x", "y:0", "^x"], T=F32)
    attr_t = add.attr["T"].SerializeToString()
    attr_entry = _field(1, b"T") + _field(2, attr_t)
    odd_add = (_field(2, b"AddV2") + _field(3, b"x") + _field(1, b"stale_name") + _field(5, attr_entry)
               + _field(3, b"y:0") + b"\x30\x01"  # field 6 as a varint: unknown to NodeDef
               + _field(4, b"") + _field(1, b"add") + _field(3, b"^x") + _field(99, b"future"))
    versions = graph_pb2.GraphDef(versions={"producer": 7}).versions.SerializeToString()
    data = (_field(4, versions) + _field(1, x.SerializeToString()) + _field(1, y.SerializeToString())
            + _field(1, odd_add) + b"\x18\x05")  # GraphDef field 3 (version), a varint
    parsed = graph_pb2.GraphDef.FromString(data)
    assert [n.name for n in parsed.node] == ["x", "y", "add"]
    assert list(parsed.node[2].input) == ["x", "y:0", "^x"]
    ref, fast = _both_indexes(data, switches)
    assert ref is not None and fast == ref
    # the same index as the graph serialized plainly
    assert bridge.graph_index(None, parsed.SerializeToString()) == ref


@pytest.mark.parametrize("case", ["duplicate", "non_ascii", "dangling_and_loop"])
def test_index_from_bytes_refuses_and_accepts_what_the_reference_does(case, switches):
    if case == "duplicate":
        gd = _gd(_n("Placeholder", "x", dtype=F32), _n("Identity", "x", ["x"], T=F32))
    elif case == "non_ascii":
        gd = _gd(_n("Placeholder", "x\u00e9", dtype=F32), _n("Identity", "i", ["x\u00e9"], T=F32))
    else:
        gd = _gd(_n("Placeholder", "x", dtype=F32), _n("Enter", "e", ["x"], T=F32),
                 _n("Merge", "m", ["e", "ni"], T=F32), _n("NextIteration", "ni", ["m"], T=F32),
                 _n("Identity", "d", ["nowhere:1", "^gone"], T=F32), _n("Unknown17r", "u", ["m:0"]))
    ref, fast = _both_indexes(gd.SerializeToString(), switches)
    assert fast == ref
    assert (ref is None) == (case != "dangling_and_loop")


# ------------------------------------------------------------------ through grappler
@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_grappler_output_is_identical_with_and_without_the_17r_paths(k2, name, switches):
    bridge.register()
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, steps, reps = [], [], []
    for on in (False, True, False):
        switches(on)
        out, rep = optimize_rewritten(cfg, mg, b"test_17r")
        outs.append(out)
        steps.append(bridge.step_times())
        reps.append(_strip_times(rep))  # (its deferred shape figures computed now)
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert reps[1] == reps[0] and reps[2] == reps[0]
    assert len(graph_pb2.GraphDef.FromString(outs[0]).node) != len(gd.node)  # a patch was assembled
    for st in steps:
        assert set(st) == set(bridge.STEPS)
        assert st["total"] >= st["callback"] > 0 and st["index"] > 0
        assert st["callback"] >= st["index"]


@pytest.mark.parametrize("bad", ["out_of_range", "too_many", "twice"])
def test_a_patch_that_does_not_fit_gives_the_reference_result(k2, bad, switches, monkeypatch):
    """The moving assembly checks the whole patch before it moves a node: a
    patch naming a node the item lacks, or with more new entries than the
    payload has nodes, is refused with the item's graph left whole (grappler
    keeps it: the same output as the copying reference, every node with its
    name); a patch naming an item node twice is assembled by copying, as the
    reference does."""
    bridge.register()
    gd, fetches = _build("keras_resnet50_training", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    real = pipeline.optimize_serialized

    def planted(*a, **k):
        out, rep, nodes = real(*a, **k)
        assert isinstance(out, GraphPatch)
        order = out.order[:]
        kept = [i for i, v in enumerate(order) if v >= 0]
        if bad == "out_of_range":
            order[kept[0]] = len(gd.node) + 5
        elif bad == "twice":
            order[kept[1]] = order[kept[0]]
        else:
            order.append(-1)  # one more new node than the payload holds
        return GraphPatch(order, out.payload, len(order)), rep, len(order)

    monkeypatch.setattr(pipeline, "optimize_serialized", planted)
    results = []
    for on in (False, True):
        switches(on)
        bridge.clear_reports()
        try:
            out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_17r_bad")
            results.append(out.SerializeToString(deterministic=True))
        except Exception as exc:  # noqa: BLE001 - the same failure on both paths
            results.append(f"{type(exc).__name__}: {exc}")
    assert results[0] == results[1]
    if bad != "twice":
        out = graph_pb2.GraphDef.FromString(results[1])
        names = [n.name for n in out.node]
        assert all(names) and {"loss", "train"} <= set(names)
        assert not any(n.op == "Cast" for n in out.node)  # not our rewrite: grappler kept its graph
