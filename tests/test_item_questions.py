"""Issue 17: the grappler callback's questions about the item, answered with
less walking over its NodeDefs.

* ``bridge.ATTR_BY_BYTES``: whether a node carries the user's ``_keep_dtype``
  mark was one attr-map lookup per NodeDef (~1 ms on BERT-12).  The item's
  bytes are searched first for the attr's map key (``NpuAmpItemMayHaveAttr``:
  a map entry writes ``"\\x0a", len, key`` first); where they lack it the
  answer is no, else the walk answers.
* ``bridge.DEVICE_ASKED_ONCE``: whether a node has a device string was walked
  for three times per graph; it is asked once per callback.

Checked through grappler on the BERT-base-like and Keras ResNet50 training
graphs: plain, with a node marked ``_keep_dtype`` (the walk says yes and the
node keeps FP32 in the output), and with a node *named* ``_keep_dtype`` (the
bytes hold the run, the walk says no): the same answers, output and report
with the shortcuts and without."""
import pytest
from tensorflow.core.framework import types_pb2

from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, optimize_rewritten, plugin_only_grappler


def _graph_def(name, k2, variant):
    if name == "bert_like":
        g, _ = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
        gd = g.as_graph_def()
    else:
        gd = _keras_resnet_training_graph(k2)
    marked = None
    fetches = ["loss", "train"]
    if variant == "marked":  # the user's mark on the first matrix op
        node = next(n for n in gd.node if n.op in ("MatMul", "BatchMatMulV2", "Conv2D"))
        node.attr["_keep_dtype"].b = True
        marked = node.name
    elif variant == "named":  # the key's run of bytes in a node's name (fetched), no such attr
        node = gd.node.add(name="_keep_dtype", op="Identity", input=["loss"])
        node.attr["T"].type = types_pb2.DT_FLOAT
        fetches.append(node.name)
    return gd, fetches, marked


def _run(monkeypatch, gd, fetches, gid):
    asked = []
    real = bridge._item_has

    def spy(fn_name, sink, *what):
        got = real(fn_name, sink, *what)
        asked.append((fn_name, what, got))
        return got

    mp = pytest.MonkeyPatch()
    mp.setattr(bridge, "_item_has", spy)
    try:
        mg, cfg = plugin_only_grappler(gd, fetches)
        out, rep = optimize_rewritten(cfg, mg, gid)
    finally:
        mp.undo()
    return out, rep, asked


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
@pytest.mark.parametrize("variant", ["plain", "marked", "named"])
def test_the_same_answers_and_output_by_the_bytes_and_by_the_walk(k2, monkeypatch, name, variant):
    bridge.register()
    gd, fetches, marked = _graph_def(name, k2, variant)
    res = {}
    for by_bytes in (True, False):
        monkeypatch.setattr(bridge, "ATTR_BY_BYTES", by_bytes)
        out, rep, asked = _run(monkeypatch, gd, fetches, f"test_item_questions_{name}_{variant}".encode())
        res[by_bytes] = (out, _strip_times(rep), asked)
    out, rep, asked = res[True]
    ref_out, ref_rep, ref_asked = res[False]
    assert out == ref_out
    assert rep == ref_rep
    # the final answer of each attr question: the walk's (the reference)
    walk = [a for a in ref_asked if a[0] == "NpuAmpItemHasAttr"]
    assert walk and all(a[1] == ("_keep_dtype",) for a in walk)
    want = variant == "marked"
    assert [a[2] for a in walk] == [want] * len(walk)
    may = [a for a in asked if a[0] == "NpuAmpItemMayHaveAttr"]
    walked = [a for a in asked if a[0] == "NpuAmpItemHasAttr"]
    assert len(may) == len(walk)
    if variant == "plain":  # the bytes lack the key: no walk
        assert [a[2] for a in may] == [False] * len(may) and not walked
    else:  # the bytes hold the run (a mark, or a name): the walk answers
        assert [a[2] for a in may] == [True] * len(may)
        assert [a[2] for a in walked] == [want] * len(walk)
    if marked is not None:  # the mark was read: the node keeps its float32
        from tensorflow.core.framework import graph_pb2

        g = graph_pb2.GraphDef.FromString(out)
        node = next(n for n in g.node if n.name == marked)
        assert node.attr["T"].type == types_pb2.DT_FLOAT
        assert rep["decisions"][marked]["list"] == "keep_dtype"


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_the_device_question_is_asked_once(k2, monkeypatch, name):
    bridge.register()
    gd, fetches, _ = _graph_def(name, k2, "plain")
    res = {}
    for once in (True, False):
        monkeypatch.setattr(bridge, "DEVICE_ASKED_ONCE", once)
        out, rep, asked = _run(monkeypatch, gd, fetches, f"test_item_questions_dev_{name}".encode())
        res[once] = (out, _strip_times(rep), [a for a in asked if a[0] == "NpuAmpItemHasDevice"])
    assert res[True][0] == res[False][0]
    assert res[True][1] == res[False][1]
    assert len(res[True][2]) == 1  # (asked once per callback)
    assert len(res[False][2]) > 1  # (the passes ask it more than once)
    assert {a[2] for a in res[True][2] + res[False][2]} == {False}  # (no device before placement)


def test_a_device_string_is_seen(k2, monkeypatch):
    """A node with a device string: the one answer is yes, and the output
    equals the per-question walk's."""
    bridge.register()
    gd, fetches, _ = _graph_def("bert_like", k2, "plain")
    for n in gd.node:
        if n.op == "MatMul":
            n.device = "/device:CPU:0"
            break
    res = {}
    for once in (True, False):
        monkeypatch.setattr(bridge, "DEVICE_ASKED_ONCE", once)
        out, rep, asked = _run(monkeypatch, gd, fetches, b"test_item_questions_device")
        res[once] = (out, _strip_times(rep), [a[2] for a in asked if a[0] == "NpuAmpItemHasDevice"])
    assert res[True][2] == [True]
    assert set(res[False][2]) == {True}
    assert res[True][:2] == res[False][:2]
