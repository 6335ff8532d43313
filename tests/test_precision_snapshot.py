"""Issue 17: the precision pass's "before" snapshot (``amp._Snapshot``), copied on write.

The deferred "before" figures (activation bytes, FLOP share) are computed
from a snapshot the pass fills lazily: a node is copied just before its
first in-place edit.  The snapshot must be exactly the graph the pass
received.  The expectation is taken from the input graph's own bytes before
the pass runs (not from the snapshot code), on real graphs in FP16 and
BF16, where the pass re-types, rewires and adds nodes.  And
``registry.retype`` (one map lookup per attr) sets a present and an absent attr.
"""
import pytest
from tensorflow.core.framework import node_def_pb2

from graph_passes import registry
from graph_passes.graph import Graph
from graph_passes.manager import PassContext
from graph_passes.precision import amp
from npu_amp_tf import bridge, pipeline
from npu_amp_tf.options import Options
from test_precision_native import _graph


@pytest.fixture(autouse=True)
def _library():
    bridge.register()


def _nodes_bytes(nodes):
    return {n.name: n.SerializeToString(deterministic=True) for n in nodes}


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_the_before_graph_is_the_input_graph(k2, name, mode):
    gd, fetches = _graph(name, k2)
    graph = Graph(gd)
    want = _nodes_bytes(graph.nodes.values())  # the input, before the pass touches it
    order = list(graph.nodes)
    ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
    ctx.native_paint = pipeline.native_paint_entry()
    pp = amp.PrecisionPass()
    pp.run(graph, ctx)
    edited = [n for n in order if n in graph.nodes
              and graph.nodes[n].SerializeToString(deterministic=True) != want[n]]
    assert len(edited) > 50, "the pass edited few of the input's nodes in place"
    assert pp.casts_inserted > 0
    before = pp._before.graph_def()
    assert [n.name for n in before.node] == order
    assert _nodes_bytes(before.node) == want


def test_retype_sets_a_present_and_an_absent_attr():
    n = node_def_pb2.NodeDef(name="n", op="Mul")
    n.attr["T"].type = registry.DT_FLOAT
    registry.retype(n, ("T", "U"), registry.DT_HALF)
    assert n.attr["T"].type == registry.DT_HALF and n.attr["U"].type == registry.DT_HALF
