"""Record nodes taken out of the item, not copied (issue 17,
``bridge.STEAL_RECORDS``): inside grappler the OpDef pre-check builds the
patch's record nodes (``Graph.patch_records``) by swapping each out of the
item and editing it there (``ParsePatch`` with ``steal``,
custom_ops/opdef_precheck.cc); every path that does not assemble that
very patch puts them back as they were (``Sink::RestoreStolen``,
custom_ops/grappler_bridge.cc).

Checked here against the copying reference (``STEAL_RECORDS`` False), on
the library's own counts of nodes taken and put back:

* real training graphs: the output is byte-identical, nodes were taken and
  none put back;
* a graph the pre-check flags (a mistyped user fusion): grappler keeps its
  graph, every node taken was put back, and each output node equals the
  reference's (the NodeDef, not only its bytes);
* a patch written that differs from the one checked: the nodes are put back
  before the bytes are assembled again, and the output is the reference's.
"""
import pytest
from tensorflow.core.framework import graph_pb2

from graph_passes.graph import Graph
from npu_amp_tf import bridge
from test_opdef_precheck import _bad_rule_graph, _grappler, register_bad_rule
from test_precision_core import _build
from test_speed_paths import optimize_rewritten, plugin_only_grappler

pytestmark = pytest.mark.skipif(bridge.steal_counts() is None
                                or bridge.patch_records_version() != Graph.RECORDS_VERSION,
                                reason="the library does not take record nodes out of the item")


def _delta(before):
    now = bridge.steal_counts()
    return now[0] - before[0], now[1] - before[1]


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_taken_records_assemble_like_copied_ones(k2, monkeypatch, name):
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs, counts = {}, {}
    for on in (True, False):
        monkeypatch.setattr(bridge, "STEAL_RECORDS", on)
        before = bridge.steal_counts()
        outs[on] = optimize_rewritten(cfg, mg, f"{name}-steal-{on}".encode())[0]
        counts[on] = _delta(before)
    assert counts[True][0] > 100 and counts[True][1] == 0, counts  # (taken; none put back)
    assert counts[False] == (0, 0)
    assert outs[True] == outs[False]


def _node_map(gd):
    return {n.name: n for n in gd.node}


@pytest.fixture
def flagged_rule():
    unregister = register_bad_rule()
    try:
        yield
    finally:
        unregister()


def test_flagged_graph_puts_every_taken_node_back(flagged_rule, monkeypatch):
    bridge.register()
    gd = _bad_rule_graph()
    monkeypatch.setattr(bridge, "STEAL_RECORDS", False)
    ref, _ = _grappler(gd, ["out"])
    monkeypatch.setattr(bridge, "STEAL_RECORDS", True)
    before = bridge.steal_counts()
    out, recs = _grappler(gd, ["out"])
    taken, back = _delta(before)
    assert recs[-1]["status"] == "pass_failed_kept", recs[-1]
    assert taken > 0 and back == taken, (taken, back)  # (the MatMul re-typed to BF16, at least)
    got, want = _node_map(out), _node_map(ref)
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]
    # the item as it came: the MatMul in float32 again
    mm = next(n for n in out.node if n.op == "MatMul")
    assert mm.attr["T"] == next(n for n in gd.node if n.op == "MatMul").attr["T"]


def test_a_patch_other_than_the_checked_one_puts_taken_nodes_back(k2, monkeypatch):
    """The pre-check is given the patch with an empty field appended (it
    parses to the same nodes, its bytes differ): the patch written is then not
    the one checked, the nodes taken are put back and the bytes assembled
    again from the item."""
    gd, fetches = _build("bert_like", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    monkeypatch.setattr(bridge, "STEAL_RECORDS", False)
    ref = optimize_rewritten(cfg, mg, b"steal-ref")[0]
    monkeypatch.setattr(bridge, "STEAL_RECORDS", True)
    real = bridge.item_opdef_precheck

    def other(sink, patch, device="CPU"):
        return real(sink, patch._replace(payload=patch.payload + b"\x22\x00"), device)  # versions {}

    monkeypatch.setattr(bridge, "item_opdef_precheck", other)
    before = bridge.steal_counts()
    out = optimize_rewritten(cfg, mg, b"steal-other")[0]
    taken, back = _delta(before)
    assert taken > 100 and back == taken, (taken, back)
    assert out == ref
    assert len(graph_pb2.GraphDef.FromString(out).node) == len(graph_pb2.GraphDef.FromString(ref).node)


def test_an_item_reader_after_the_check_puts_taken_nodes_back(k2, monkeypatch):
    """A C++ entry that reads the item (here ``item_has_op``) called after the
    pre-check took the record nodes: it puts them back first and answers
    from the whole item; the patch is then assembled again from the item."""
    gd, fetches = _build("bert_like", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    monkeypatch.setattr(bridge, "STEAL_RECORDS", False)
    ref = optimize_rewritten(cfg, mg, b"steal-ref-2")[0]
    monkeypatch.setattr(bridge, "STEAL_RECORDS", True)
    real, seen = bridge.item_opdef_precheck, []

    def then_read(sink, patch, device="CPU"):
        answer = real(sink, patch, device)
        seen.append(bridge.item_has_op(sink, "MatMul"))
        return answer

    monkeypatch.setattr(bridge, "item_opdef_precheck", then_read)
    before = bridge.steal_counts()
    out = optimize_rewritten(cfg, mg, b"steal-read")[0]
    taken, back = _delta(before)
    assert seen == [True]
    assert taken > 100 and back == taken, (taken, back)
    assert out == ref
