"""Issue 17: ``_delay_widening_casts`` without a topological sort when a
depth argument proves that no FP32 copy waits (``PrecisionPass.delay_depth_proof``).

The argument: in an acyclic graph, Kahn's FIFO order pops nodes by
non-decreasing depth (the longest path from a node without inputs), so a
reader's other producer of smaller depth than the copy's source comes before
the source and is not waited for.  The tests check the argument itself on the
orders :meth:`Graph.topo_order` gives for real training graphs (depths
computed here, independently), and that the pass gives byte-identical graphs
and equal reports with the proof on and off: on graphs where it proves
(Keras ResNet50: every copy feeds a momentum update whose other producers are
variable handles and constants) and where it must not (BERT-like and the
softmax backward of test_precision_liveness: copies do wait)."""
import json

import pytest
from tensorflow.core.framework import graph_pb2

import npu_amp_tf
from graph_passes.graph import Graph, parse_tensor
from graph_passes.precision import amp
from npu_amp_tf import bridge
from test_precision_bulk import MODES, _first_difference, assert_grappler_on_equals_off
from test_precision_fast import _strip_times
from test_precision_liveness import BF16_SUM_BLACK, FETCHES, attention_step
from test_precision_native import _graph

from conftest import assert_same

REAL = ["keras_resnet50_training", "keras_transformer_training", "slim_resnet_v1_50", "bert_like"]


@pytest.fixture(autouse=True)
def _library():
    bridge.register()


class _Spy:
    """Counts what ``_none_can_wait`` answered."""

    def __init__(self, monkeypatch):
        self.answers = []
        orig = amp.PrecisionPass._none_can_wait

        def spy(pp):
            got = orig(pp)
            self.answers.append(got)
            return got

        monkeypatch.setattr(amp.PrecisionPass, "_none_can_wait", spy)


def _rewrite(monkeypatch, gd, fetches, kw, on):
    monkeypatch.setattr(amp.PrecisionPass, "delay_depth_proof", on)
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(gd)
    out, rep = npu_amp_tf.rewrite_graph(copy, fetches=[f.split(":")[0] for f in fetches], **kw)
    return out.SerializeToString(deterministic=True), rep


def assert_proof_equals_reference(monkeypatch, gd, fetches, kw):
    out_p, rep_p = _rewrite(monkeypatch, gd, fetches, kw, True)
    out_r, rep_r = _rewrite(monkeypatch, gd, fetches, kw, False)
    a, b = _strip_times(rep_p.to_json()), _strip_times(rep_r.to_json())
    assert a["summary"].get("failed_pass") is None, a["warnings"][:3]
    assert_same(out_p, out_r, "the graphs with the depth proof and without")
    assert a["decisions"] == b["decisions"], _first_difference(a["decisions"], b["decisions"])
    assert json.dumps(a, default=str) == json.dumps(b, default=str)
    return a


def _depths(gd):
    """Longest path from a node without inputs, over data and control edges
    from nodes of the graph (written here: a memoised walk, not the pass's)."""
    nodes = {n.name: n for n in gd.node}
    depth = {}
    for start in nodes:
        stack = [start]
        while stack:
            x = stack[-1]
            if x in depth:
                stack.pop()
                continue
            ps = [parse_tensor(i)[0] for i in nodes[x].input]
            ps = [p for p in ps if p in nodes]
            todo = [p for p in ps if p not in depth]
            if todo:
                stack.extend(todo)
                continue
            depth[x] = max((depth[p] + 1 for p in ps), default=0)
            stack.pop()
    return depth


@pytest.mark.parametrize("name", REAL)
def test_kahn_order_is_sorted_by_depth(k2, name):
    """The argument the proof rests on, on the orders the graph gives for
    real training graphs, before and after the precision pass."""
    gd, fetches = _graph(name, k2)
    out, _ = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="allow_mix_precision")
    for g in (gd, out):
        order = Graph(g).topo_order(strict=True)
        depth = _depths(g)
        ds = [depth[n] for n in order]
        bad = [(order[i], ds[i], order[i + 1], ds[i + 1]) for i in range(len(ds) - 1) if ds[i] > ds[i + 1]]
        assert not bad, bad[:3]
        assert max(ds) > 20  # (deep graphs: the claim is not vacuous)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("name", REAL)
def test_real_graphs_proof_equals_reference(k2, monkeypatch, name, mode):
    gd, fetches = _graph(name, k2)
    spy = _Spy(monkeypatch)
    rep = assert_proof_equals_reference(monkeypatch, gd, fetches, MODES[mode])
    proved = [a for a in spy.answers if a]
    if name == "keras_resnet50_training":
        # every FP32 copy feeds a momentum update: the proof holds, no sort
        assert proved, spy.answers
        assert rep["summary"].get("casts_delayed", 0) == 0
    if name == "bert_like" and mode == "fp16":
        # copies of forward activations wait for the gradients: no proof
        assert spy.answers and not any(spy.answers), spy.answers
        assert rep["summary"]["casts_delayed"] > 0


def test_a_copy_that_waits_is_not_proved_away(monkeypatch):
    """The softmax backward reads an FP32 copy of the BF16 softmax and the
    incoming gradient: the copy waits, so the proof must fail."""
    gd = attention_step()
    spy = _Spy(monkeypatch)
    rep = assert_proof_equals_reference(monkeypatch, gd, FETCHES, BF16_SUM_BLACK)
    assert rep["summary"]["casts_delayed"] >= 1
    assert spy.answers == [False]  # (asked once: with the switch off the pass sorts at once)


def test_a_wrong_proof_changes_the_graph(monkeypatch):
    """Planted: a proof that always holds drops the delay, and the
    comparison above sees it."""
    gd = attention_step()
    out_r, _ = _rewrite(monkeypatch, gd, FETCHES, BF16_SUM_BLACK, False)
    monkeypatch.setattr(amp.PrecisionPass, "_none_can_wait", lambda pp: True)
    out_w, rep_w = _rewrite(monkeypatch, gd, FETCHES, BF16_SUM_BLACK, True)
    assert out_w != out_r
    assert rep_w.summary.get("casts_delayed", 0) == 0


def test_budget_exhausted_sorts_instead(k2, monkeypatch):
    """A producer with more ancestors than the budget: no proof, the sort
    decides, the same graph."""
    gd, fetches = _graph("keras_resnet50_training", k2)
    monkeypatch.setattr(amp.PrecisionPass, "DEPTH_PROOF_BUDGET", 0)
    spy = _Spy(monkeypatch)
    assert_proof_equals_reference(monkeypatch, gd, fetches, MODES["fp16"])
    assert spy.answers and not any(spy.answers)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_through_grappler(k2, monkeypatch, name):
    assert_grappler_on_equals_off(
        k2, name, lambda on: monkeypatch.setattr(amp.PrecisionPass, "delay_depth_proof", on))
