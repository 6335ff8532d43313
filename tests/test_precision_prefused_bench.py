"""benchmarks/precision.py --prefused (issue 17): the bound of a layer-norm fusion done
before the callback's parse is only a bound of *this* pipeline when ours, run on the
graph our fusion pass leaves, gives the same output graph as ours on the graph itself.

A small BERT-like training graph (2 layers, tiny sizes): the pre-fused input must hold
every layer norm the builder made (one after the embeddings, two per layer: counted
from tests/real_models.py, not from the pass), and the two outputs must be identical
node for node; a changed node must be reported as a difference."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

LAYERS = 2


@pytest.fixture(scope="module")
def bench():
    import importlib

    saved = dict(os.environ)
    try:
        return importlib.import_module("precision")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _graph():
    from real_models import bert_training_graph

    return bert_training_graph(layers=LAYERS, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)


def test_prefused_run_is_the_same_pipeline(bench, capsys):
    g, fetches = _graph()
    res = bench.prefused_bound("tiny BERT", g, fetches, 1)
    out = capsys.readouterr().out
    assert res["norms"] == 1 + 2 * LAYERS, out
    assert res["identical"], out
    assert "the same output graph, node for node" in out
    # both callbacks ran and rewrote (their thread CPU was recorded)
    assert res["callback_s"] > 0 and res["prefused_callback_s"] > 0, res


def test_same_nodes_names_a_difference(bench):
    from tensorflow.core.framework import graph_pb2

    a = graph_pb2.GraphDef()
    a.node.add(name="x", op="Const")
    a.node.add(name="y", op="Identity", input=["x"])
    b = graph_pb2.GraphDef()
    b.CopyFrom(a)
    assert bench.same_nodes(a, b) == []
    # order aside: the same nodes reversed are the same graph
    c = graph_pb2.GraphDef()
    c.node.extend(reversed(a.node))
    assert bench.same_nodes(a, c) == []
    b.node[1].input[:] = ["x:1"]
    b.node.add(name="z", op="NoOp")
    assert bench.same_nodes(a, b) == ["y", "z"]
