"""Issue 17m: the C++ graph index (NPUIDX5) lists each distinct (reader,
input position) pair once, and every edge names its pair: a data input is
one edge, but a reader's control inputs from many sources share one pair
(the Keras ResNet-50 training graph: 63k edges, 8.7k pairs).
``Graph(index=...)`` then builds one tuple per pair, shared by the
consumers lists, instead of one per edge.

Checked: the adopted consumers index equals the one Python builds
(``Graph.reindex``), entry for entry and in order, on real training graphs
and the odd graphs; the tuples of one pair are one object; editing the
graph afterwards keeps the indexes true."""
import pytest

from graph_passes.graph import Graph
from npu_amp_tf import bridge
from test_precision_core import GRAPHS, _build


def _consumers(g):
    return {k: list(v) for k, v in g._consumers.items() if v}  # noqa: SLF001


@pytest.mark.parametrize("name", GRAPHS)
def test_shared_pairs_index_equals_python(k2, name):
    bridge.register()
    gd, _ = _build(name, k2)
    blob = bridge.graph_index(gd)
    # (shared pairs only where they pay: a quarter of the edges or more share one)
    assert blob is not None and blob[:7] in (b"NPUIDX4", b"NPUIDX5")
    if name == "keras_resnet50_training":
        assert blob.startswith(b"NPUIDX5")
    fast, ref = Graph(gd, index=blob), Graph(gd)
    assert fast.prebuilt_index and not ref.prebuilt_index
    assert _consumers(fast) == _consumers(ref)
    assert fast.topo_order() == ref.topo_order()
    # one object per distinct pair, as many as the index's table says
    entries = [p for v in fast._consumers.values() for p in v]  # noqa: SLF001
    distinct = {p for p in entries}
    if blob.startswith(b"NPUIDX5"):
        assert len({id(p) for p in entries}) == len(distinct)
        assert int(blob.split(b"\x03", 1)[0].split(b"\x02")[4]) == len(distinct)
        assert 4 * len(distinct) <= 3 * len(entries)
    else:
        assert 4 * len(distinct) > 3 * len(entries)
    # (a reader's control inputs from several sources: one shared tuple)
    ctrl = [p for p in entries if p[1] == -1]
    if blob.startswith(b"NPUIDX5") and len(ctrl) > len({p for p in ctrl}):
        assert len({id(p) for p in ctrl}) < len(ctrl)


def test_edits_after_adopting_shared_pairs_keep_the_indexes_true(k2):
    """A reader's control edge re-pointed at another source: the shared
    (reader, -1) entry leaves the old source's list only, and the indexes
    agree with the nodes (``Graph.index_problems``)."""
    bridge.register()
    gd, _ = _build("keras_resnet50_training", k2)
    g = Graph(gd, index=bridge.graph_index(gd))
    reader = next(n for n, node in g.nodes.items()
                  if len({i for i in node.input if i.startswith("^")}) >= 2)
    ctrl = [i[1:] for i in g.nodes[reader].input if i.startswith("^")]
    a, b = ctrl[0], ctrl[1]
    other = next(n for n in g.nodes if n not in ctrl and n != reader and g.nodes[n].op == "NoOp"
                 or n not in ctrl and n != reader and g.nodes[n].op == "Const")
    k = list(g.nodes[reader].input).index("^" + a)
    g.set_input(reader, k, "^" + other)
    assert g.index_problems() == []
    assert (reader, -1) in g.consumers(b) and (reader, -1) in g.consumers(other)
    assert (reader, -1) not in g.consumers(a) or ctrl.count(a) > 1
