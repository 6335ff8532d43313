"""Issue 17: the OpDef pre-check's checks in two halves on two threads.

For a graph of 2,048 nodes or more (``bridge.set_precheck_split``; 0: never, the reference) the
C++ pre-check (custom_ops/opdef_precheck.cc) checks the first half of the output's nodes on the
callback's thread and the second half on one of the library's kept helper threads, each with
memos of its own. Its answer is the first half's when that is not clean, else the second half's:
the answer of one pass in node order. On BERT-12 (7.5k nodes) the pre-check's thread CPU went
from 4.2 to 3.0 ms min.

Checked, with the split forced on the small graphs (from 2 nodes) and at its default on the real
ones, against the reference (no split), on both of the pre-check's paths (every output name
indexed, and the item's index as inside grappler):
* every planted problem of test_opdef_precheck gives the same answer (clean, flagged, unable);
* a long chain with one problem planted in each half, in either order: the first in node order
  decides, as in one pass; a problem in the second half alone is found by the helper's half;
* real rewritten training graphs (Keras ResNet50, the BERT-like builder, TF-Slim resnet_v1_50)
  are clean both ways, and a fault planted in them is flagged both ways;
* through grappler, BERT-base-like: the same output and report both ways.
"""
import pytest
from tensorflow.core.framework import types_pb2

from graph_passes.graph import Graph
from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_opdef_precheck import CASES, _gd, _node, _ph, plant_fp32_feed, planted, rewritten
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler

F32, F16 = types_pb2.DT_FLOAT, types_pb2.DT_HALF

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpSetPrecheckSplit"), reason="library without the split pre-check")


@pytest.fixture
def split_at():
    """Sets the split's node count; the default (2048) is put back after the test."""
    before = bridge.set_precheck_split(2048)
    assert before == 2048  # (the default, and no test left it changed)
    yield bridge.set_precheck_split
    bridge.set_precheck_split(before)


def _answers(split_at, data, patch, min_nodes):
    """{(split, indexed): the C++ answer} for ``patch`` of the graph ``data``."""
    out = {}
    for split in (True, False):
        split_at(min_nodes if split else 0)
        for indexed in (False, True):
            out[(split, indexed)] = bridge.graph_opdef_precheck(data, patch, "CPU", indexed=indexed)
    return out


def _patch(before, edit):
    g = Graph(before)
    edit(g)
    g.new_node("NoOp", "pad_split")
    patch = g.serialize_patch()
    assert patch is not None
    return patch


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_planted_problems_give_the_same_answer_split(case, split_at, monkeypatch):
    build, edit, phrase = planted(case, monkeypatch)
    before = build()
    ans = _answers(split_at, before.SerializeToString(), _patch(before, edit), 2)
    want = True if phrase is None else False
    # (the indexed path may answer "cannot tell" where the reference indexes every name: both say so split or not)
    assert ans[(True, False)] == ans[(False, False)] == want, ans
    assert ans[(True, True)] == ans[(False, True)], ans


def _chain(n=64):
    """x -> r0 -> r1 -> ... -> r{n-1}: float Relus."""
    nodes = [_ph("x", F32)]
    for k in range(n):
        nodes.append(_node("Relu", f"r{k}", [f"r{k - 1}" if k else "x"], T=("type", F32)))
    return _gd(*nodes)


def _flag(name):
    """A flagged problem: Relu re-typed to float16 reading a float32 edge."""
    def edit(g):
        g.nodes[name].attr["T"].type = F16
        g.touch(name)
    return edit


def _unable(name):
    """A problem the C++ check cannot word: an input port in non-ASCII digits."""
    def edit(g):
        node = g.nodes[name]
        node.input[0] = node.input[0].split(":")[0] + ":\u0661"
        g.touch(name)
    return edit


def _both(*edits):
    def edit(g):
        for e in edits:
            e(g)
    return edit


@pytest.mark.parametrize("first,second,want", [
    ("flag", None, False), (None, "flag", False), (None, "unable", None),
    ("flag", "unable", False), ("unable", "flag", None), (None, None, True)])
def test_the_first_problem_in_node_order_decides(split_at, first, second, want):
    before = _chain()
    kinds = {"flag": _flag, "unable": _unable}
    edits = [kinds[k](f"r{at}") for k, at in ((first, 5), (second, 50)) if k is not None]
    ans = _answers(split_at, before.SerializeToString(), _patch(before, _both(*edits)), 2)
    assert ans[(True, False)] == ans[(False, False)] == want, ans
    assert ans[(True, True)] == ans[(False, True)] == want, ans


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "slim_resnet_v1_50"])
def test_real_rewrites_clean_and_a_planted_fault_flagged_split(k2, name, split_at):
    data, g = rewritten(name, k2)
    at = 2048 if len(g.nodes) >= 2048 else 2  # (the default where the graph is that large)
    ans = _answers(split_at, data, g.serialize_patch(), at)
    assert set(ans.values()) == {True}, ans
    plant_fp32_feed(g)
    ans = _answers(split_at, data, g.serialize_patch(), at)
    assert set(ans.values()) == {False}, ans


def test_the_same_output_through_grappler(split_at):
    bridge.register()
    g, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
    mg, cfg = plugin_only_grappler(g.as_graph_def(), fetches)
    outs = []
    for min_nodes in (2, 0):
        split_at(min_nodes)
        out, rep = optimize_rewritten(cfg, mg, b"test_precheck_split")
        outs.append((out, _strip_times(rep)))
    assert outs[0] == outs[1]
