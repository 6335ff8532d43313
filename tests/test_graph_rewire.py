"""Issue 17: ``Graph.add_and_rewire`` with ``add_node`` / ``set_input``'s
bookkeeping in its own loop (``Graph.inline_rewire``) against the reference
(the two methods called per step): the same nodes, inputs, indexes, logs,
marks and version, on the precision pass's real batches (Keras ResNet50 and
the BERT-like graph, FP16 and BF16) and on the paths the methods take
themselves (an index out of sync, a name already taken)."""
import pytest
from tensorflow.core.framework import graph_pb2, node_def_pb2

from graph_passes.graph import Graph, GraphError
from graph_passes.manager import PassContext
from graph_passes.precision import amp
from npu_amp_tf import bridge, pipeline
from npu_amp_tf.options import Options
from test_precision_native import _graph


def _state(g):
    return dict(
        nodes=[(k, v.SerializeToString(deterministic=True)) for k, v in g.nodes.items()],
        consumers={k: list(v) for k, v in g._consumers.items() if v},
        by_op={k: list(v) for k, v in g._by_op.items()},
        seq=list(g._seq.items()), next_seq=g._next_seq, created=sorted(g.created),
        modified=sorted(g.modified), edit_log=list(g._edit_log), kdirty=sorted(g._kdirty),
        kdnames=sorted(g._kdnames), id_name=list(g._id_name), id_dead=bytes(g._id_dead),
        version=g.version, dirty=g._dirty, topo=g._topo_cache is None, repairs=g.index_repairs)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_the_precision_pass_batches(k2, monkeypatch, name, mode):
    bridge.register()
    gd, fetches = _graph(name, k2)
    calls, states, given = [], [], []
    orig = Graph.add_and_rewire

    def counting(self, steps, only_inputs=None):
        calls.append(len(steps))
        if only_inputs is not None:  # (the new casts' roots, from the C++ plan)
            given.append(sum(i is not None for i in only_inputs))
        return orig(self, steps, only_inputs=only_inputs)

    monkeypatch.setattr(Graph, "add_and_rewire", counting)
    # (issue 17) the casts' inputs given (known_inputs) or read back; the
    # reference: the two methods per step
    for on, known in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(Graph, "inline_rewire", on)
        monkeypatch.setattr(Graph, "known_inputs", known)
        g = Graph(gd)
        ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
        ctx.native_paint = pipeline.native_paint_entry()
        amp.PrecisionPass().run(g, ctx)
        states.append(_state(g))
    assert calls and max(calls) > 20, calls
    assert given and max(given) > 10, given
    for st in states[:2]:
        for key in st:
            assert st[key] == states[2][key], key


def _small():
    gd = graph_pb2.GraphDef()
    gd.node.add(name="a", op="Placeholder")
    gd.node.add(name="b", op="Placeholder")
    gd.node.add(name="c", op="AddV2", input=["a", "b", "^a"])
    gd.node.add(name="d", op="Identity", input=["c"])
    return gd


def _steps():
    cast = node_def_pb2.NodeDef(name="a/cast", op="Cast", input=["a"])
    return [(cast, "c", 0, "a/cast"), (None, "c", 1, "b"), (None, "d", 0, "a/cast"),
            (node_def_pb2.NodeDef(name="e", op="Identity", input=["d", "^b"]), "c", 1, "e")]


def _both(monkeypatch, prepare, steps_fn, raises=None):
    out = []
    for on in (True, False):
        monkeypatch.setattr(Graph, "inline_rewire", on)
        g = Graph(_small())
        prepare(g)
        if raises:
            with pytest.raises(raises):
                g.add_and_rewire(steps_fn())
        else:
            g.add_and_rewire(steps_fn())
        out.append(_state(g))
    for key in out[0]:
        assert out[0][key] == out[1][key], key
    return out[0]


def test_plain_steps(monkeypatch):
    st = _both(monkeypatch, lambda g: None, _steps)
    assert st["version"] > 1 and "a/cast" in st["created"] and st["repairs"] == 0


def test_an_index_out_of_sync_is_repaired_the_same(monkeypatch):
    def edit_by_hand(g):
        g.nodes["d"].input[0] = "b"  # (no reindex: the consumers index is stale)

    st = _both(monkeypatch, edit_by_hand, _steps)
    assert st["repairs"] == 1


def test_a_name_taken_raises_with_the_same_state(monkeypatch):
    def taken():
        steps = _steps()
        return steps[:2] + [(node_def_pb2.NodeDef(name="b", op="Identity"), "d", 0, "b")] + steps[2:]

    _both(monkeypatch, lambda g: None, taken, raises=GraphError)
