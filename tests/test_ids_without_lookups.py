"""Issue 17: ``Graph.order_positions``, ``Graph.ids_of`` and ``Graph.sort_by_topo``
(``Graph.ids_without_lookups``).

The precision pass's painting numbers the nodes of the topological order by their position in
the graph, and its delayed-casts plan numbers the painted nodes and the new casts by their node
ids; both looked every name up in a dict (~7.5k lookups each on BERT-12).  The graph already
holds those numbers: the native sort's order is a list of node ids, and while no node was
removed the ids are the positions.  The fusion pass sorted its few anchors by a dict of every
node's topological position; the sort's ranks per node id give the same order.  Checked on real graphs (Keras ResNet50, the BERT-base-like
training graph of ``benchmarks/precision.py``) against the lookups, derived here from
``list(g.nodes)`` and ``_seq``; the fallbacks (a node removed, an order not the cached one);
and through grappler, the same output and report with the lookups and without."""
import functools

import numpy as np
import pytest
from tensorflow.core.framework import node_def_pb2

from graph_passes.graph import Graph
from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, optimize_rewritten, plugin_only_grappler


def _graph_def(name, k2):
    if name == "bert_like":
        g, _ = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
        return g.as_graph_def(), ["loss", "train"]
    return _keras_resnet_training_graph(k2), ["loss", "train"]


def _indexed(gd):
    bridge.register()
    data = gd.SerializeToString()
    g = Graph(gd, index=functools.partial(bridge.graph_index, gd, data))
    assert g._topo_ids is not None  # noqa: SLF001 - the C++ index was adopted (its sort's ids)
    return g


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_the_positions_and_ids_are_the_lookups(k2, name):
    gd, _ = _graph_def(name, k2)
    g = _indexed(gd)
    names = list(g.nodes)
    pos = {n: i for i, n in enumerate(names)}
    order = g.topo_order()
    at = g.order_positions(order)
    assert at is not None and at.dtype == np.int32
    assert at.tolist() == [pos[n] for n in order]
    assert g.ids_of(names).tolist() == [g._seq[n] for n in names] == list(range(len(names)))  # noqa: SLF001
    # a node added: still dense; its id follows
    new = node_def_pb2.NodeDef(name="extra/Identity", op="Identity", input=[order[0]])
    g.add_node(new)
    assert g.ids_of(names + ["extra/Identity"]).tolist() == list(range(len(names) + 1))
    # an order that is not the cached one (here: reversed) is not answered
    order = g.topo_order()
    assert g.order_positions(list(reversed(order))) is None
    pos = {n: i for i, n in enumerate(g.nodes)}
    assert g.order_positions(order).tolist() == [pos[n] for n in order]


def test_after_a_removal_the_names_are_looked_up(k2):
    gd, _ = _graph_def("bert_like", k2)
    g = _indexed(gd)
    order = g.topo_order()
    victim = next(n for n in order if not g.consumers(n))  # (a node nobody reads)
    g.remove_node(victim, force=True)
    names = list(g.nodes)
    assert g.order_positions(g.topo_order()) is None  # ids are no longer positions
    ids = g.ids_of(names)
    assert ids.tolist() == [g._seq[n] for n in names]  # noqa: SLF001
    assert ids.tolist() != list(range(len(names)))
    with pytest.raises(KeyError):
        g.ids_of(names[:-1] + [victim])


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_the_same_output_with_the_lookups_and_without(k2, name, monkeypatch):
    gd, fetches = _graph_def(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    bridge.register()
    calls = []
    real = Graph.order_positions

    def spy(self, order):
        got = real(self, order)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(Graph, "order_positions", spy)
    monkeypatch.setattr(Graph, "ids_without_lookups", True)
    fast, fast_rep = optimize_rewritten(cfg, mg, b"test_ids_without_lookups")
    assert calls and all(calls)  # the painting took the sort's ids
    calls.clear()
    monkeypatch.setattr(Graph, "ids_without_lookups", False)
    ref, ref_rep = optimize_rewritten(cfg, mg, b"test_ids_without_lookups")
    assert calls and not any(calls)
    assert fast == ref
    assert _strip_times(fast_rep) == _strip_times(ref_rep)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_sort_by_topo_is_the_positions_sort(k2, name, monkeypatch):
    """``Graph.sort_by_topo`` (the fusion pass's anchors, sorted from the native sort's ranks)
    orders any subset of nodes as a sort by ``topo_positions`` does; the same after an edit
    (the cache rebuilt) and with the lookups (the reference)."""
    import random

    gd, _ = _graph_def(name, k2)
    g = _indexed(gd)
    names = list(g.nodes)
    rng = random.Random(17)
    subsets = [rng.sample(names, k) for k in (2, 3, 50, 500)]
    got = []
    for sub in subsets:
        mine = list(sub)
        g.sort_by_topo(mine)
        got.append(mine)
    assert len(g._topo_cache) < 3  # noqa: SLF001 - no dict of every node's position was built
    pos = {n: i for i, n in enumerate(g.topo_order())}
    for sub, mine in zip(subsets, got):
        assert mine == sorted(sub, key=pos.__getitem__)
    # after an edit, and with the lookups
    g.add_node(node_def_pb2.NodeDef(name="extra/Identity", op="Identity", input=[names[0]]))
    for lookups in (False, True):
        monkeypatch.setattr(Graph, "ids_without_lookups", not lookups)
        sub = subsets[2] + ["extra/Identity"]
        mine = list(sub)
        g.sort_by_topo(mine)
        pos = {n: i for i, n in enumerate(g.topo_order())}
        assert mine == sorted(sub, key=pos.__getitem__)
    with pytest.raises(KeyError):
        g.sort_by_topo([names[0], "no/such/node"])
