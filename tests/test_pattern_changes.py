"""Issue 17 (stop 55): ``pattern.Changes`` picks the dirty nodes and their
readers by op type from the graph's op index (``Changes.of_type``) instead
of reading every dirty node's op once up front.

Checked against the definitions, computed here from the NodeDefs: on real
training graphs (BERT-like, Keras ResNet50), for random dirty sets (with
names of removed nodes among them), ``of_type`` returns exactly the dirty
nodes (or their data readers) whose op is in the asked set, ``None`` asking
for every op; and ``affected_anchors`` of every registered rule equals the
climb written out from its docstring over those definitions.  The fusion
pass's own outputs with and without its skips are compared in
tests/test_fusion_skip.py."""
import random

import pytest

from conftest import keras2
from graph_passes import pattern
from graph_passes.fusion import RULES
from graph_passes.graph import Graph
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph


@pytest.fixture(scope="module", params=["bert2", "keras_resnet"])
def graph(request):
    if request.param == "bert2":
        return Graph(bert_like_training_graph(layers=2))
    k = keras2()
    if k is None:
        pytest.skip("Keras 2 (tf_keras) not installed")
    return Graph(_keras_resnet_training_graph(k))


def _readers(graph, names):
    out = set()
    for n in names:
        for c, idx in graph.consumers(n):
            if idx >= 0:
                out.add(c)
    return out


def _reference_anchors(graph, pat, dirty, readers, reach):
    """``affected_anchors`` from its docstring, every op read from the NodeDefs."""
    root_ops, union, parents = pattern._climb_info(pat)
    nodes = graph.nodes

    def pick(names, ops):
        return {n for n in names if ops is None or nodes[n].op in ops}

    out = set(pick(dirty, root_ops))
    for c in (pick(readers, union) if union is None or union else ()):
        for ops, chain in parents:
            if ops is not None and nodes[c].op not in ops:
                continue
            frontier = {c}
            for up in chain:
                frontier = {r for f in frontier for r, idx in graph.consumers(f)
                            if idx >= 0 and (up is None or nodes[r].op in up)}
                if not frontier:
                    break
            out |= frontier
    if reach >= 1:
        out |= pick(readers, root_ops)
    level = readers
    for _ in range(2, reach + 1):
        level = _readers(graph, level)
        out |= pick(level, root_ops)
    return {a for a in out if root_ops is None or nodes[a].op in root_ops}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_of_type_and_affected_anchors_match_their_definitions(graph, seed):
    rnd = random.Random(seed)
    names = sorted(graph.nodes)
    dirty = set(rnd.sample(names, min(len(names), 40 + 200 * seed)))
    changes = pattern.Changes(graph, dirty | {"no/such/node"})  # (a removed node's name: dropped)
    assert changes.dirty == dirty
    readers = _readers(graph, dirty)
    assert changes.readers == readers
    nodes = graph.nodes
    op_sets = [None, frozenset(), frozenset({"MatMul"}), frozenset({"Add", "AddV2", "Mul", "Relu"}),
               frozenset({"NoSuchOp", "Conv2D", "Identity"})]
    for ops in op_sets:
        for names_, got in ((dirty, changes.of_type(changes.dirty, ops)),
                            (readers, changes.of_type(changes.readers, ops))):
            assert len(got) == len(set(got))
            assert set(got) == {n for n in names_ if ops is None or nodes[n].op in ops}
    compared = 0
    for rule in RULES.values():
        reach = rule.reads if rule.reads is not None else 2
        want = _reference_anchors(graph, rule.pattern, dirty, readers, reach)
        assert pattern.affected_anchors(graph, rule.pattern, changes, reach) == want, rule.name
        compared += bool(want)
    assert compared >= 3  # (not vacuous: several rules had affected anchors)
