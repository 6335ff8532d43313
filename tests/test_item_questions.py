"""Issue 17: the grappler callback's questions about the item answered from
the read of its bytes that its index makes anyway (``bridge.ATTRS_BY_INDEX``,
``NpuAmpItemAttrByIndex``; custom_ops/graph_views.h ``want_attrs``).

Whether a node carries the user's ``_keep_dtype`` mark was one attr-map
lookup per NodeDef (~1 ms on BERT-12: a cold map per node), and whether a
node has a device string a walk over every NodeDef, asked three times per
graph.  The index's thread reads each NodeDef's bytes already; it now also
keeps the distinct attr names beginning with '_' and whether a device string
is there.

Checked through grappler on the BERT-base-like and Keras ResNet50 training
graphs (the BERT one with its layer norms fused before the parse, whose
bytes the index then reads): plain; with a node marked ``_keep_dtype`` (yes,
and the node keeps FP32 in the output); with a node *named* ``_keep_dtype``
(no such attr); with a device string; and with more distinct '_' attr names
than the index keeps (it does not answer; the walk does).  The answers are
the walks' (the reference), and the output and report are the same."""
import pytest
from tensorflow.core.framework import graph_pb2, types_pb2

from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, optimize_rewritten, plugin_only_grappler

ANSWERED = "NpuAmpItemAttrByIndex"


def _graph_def(name, k2, variant):
    if name == "bert_like":
        g, _ = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
        gd = g.as_graph_def()
    else:
        gd = _keras_resnet_training_graph(k2)
    marked = None
    fetches = ["loss", "train"]
    matrix = next(n for n in gd.node if n.op in ("MatMul", "BatchMatMulV2", "Conv2D"))
    if variant == "marked":  # the user's mark on the first matrix op
        matrix.attr["_keep_dtype"].b = True
        marked = matrix.name
    elif variant == "named":  # the key's bytes in a node's name (fetched), no such attr
        node = gd.node.add(name="_keep_dtype", op="Identity", input=["loss"])
        node.attr["T"].type = types_pb2.DT_FLOAT
        fetches.append(node.name)
    elif variant == "device":
        matrix.device = "/device:CPU:0"
    elif variant == "many":  # more distinct '_' attr names than the index keeps, and the mark
        for k in range(40):
            matrix.attr[f"_user_note_{k}"].b = True
        matrix.attr["_keep_dtype"].b = True
        marked = matrix.name
    return gd, fetches, marked


def _run(gd, fetches, gid):
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
@pytest.mark.parametrize("variant", ["plain", "marked", "named", "device", "many"])
def test_the_index_answers_as_the_walks_do(k2, monkeypatch, name, variant):
    bridge.register()
    gd, fetches, marked = _graph_def(name, k2, variant)
    res = {}
    for by_index in (True, False):
        monkeypatch.setattr(bridge, "ATTRS_BY_INDEX", by_index)
        out, rep, asked = _run(gd, fetches, f"test_item_questions_{name}_{variant}".encode())
        res[by_index] = (out, _strip_times(rep), asked)
    out, rep, asked = res[True]
    ref_out, ref_rep, ref_asked = res[False]
    assert out == ref_out
    assert rep == ref_rep
    # the reference: the walks' answers
    attr_walk = [a[2] for a in ref_asked if a[0] == "NpuAmpItemHasAttr"]
    dev_walk = [a[2] for a in ref_asked if a[0] == "NpuAmpItemHasDevice"]
    assert attr_walk and dev_walk and not any(a[0] == ANSWERED for a in ref_asked)
    assert attr_walk == [variant in ("marked", "many")] * len(attr_walk)
    assert dev_walk == [variant == "device"] * len(dev_walk)
    # by the index: the same answers, and no walk where it knows
    attr_idx = [a[2] for a in asked if a[0] == ANSWERED and a[1] == ("_keep_dtype",)]
    dev_idx = [a[2] for a in asked if a[0] == ANSWERED and a[1] == ("",)]
    walked = [a for a in asked if a[0] in ("NpuAmpItemHasAttr", "NpuAmpItemHasDevice")]
    assert dev_idx == dev_walk
    if variant == "many":  # (it does not know: the walk answers)
        assert attr_idx == [None] * len(attr_walk)
        assert [a[2] for a in walked if a[0] == "NpuAmpItemHasAttr"] == attr_walk
    else:
        assert attr_idx == attr_walk and not walked
    if marked is not None:  # the mark was read: the node keeps its float32
        g = graph_pb2.GraphDef.FromString(out)
        node = next(n for n in g.node if n.name == marked)
        assert node.attr["T"].type == types_pb2.DT_FLOAT
        assert rep["decisions"][marked]["list"] == "keep_dtype"
    else:
        assert "keep_dtype" not in {d.get("list") for d in rep["decisions"].values()}


def test_outside_a_callback_nothing_is_answered():
    bridge.register()
    assert bridge._item_has(ANSWERED, None, "_keep_dtype") is None
    assert bridge.item_has_attr(None, "_keep_dtype") is None
    assert bridge.item_has_device(None) is None
