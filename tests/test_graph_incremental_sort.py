"""Issue 17q: ``Graph`` keeps the C++ sort's integer arrays between sorts.

``Graph.incremental_sort`` (default on) keeps the input of the C++ Kahn sort
(``graph.native_kahn``: per node id its consumer entries as reader ids) from
one sort to the next, built the first time from the C++ index's edge arrays
(``Graph(gd, index=...)``), and re-reads only the consumer lists the edit
methods marked since.  Off, every sort maps every consumer entry through a
name -> index dict (the reference); ``Graph.native_sort = False`` is the
Python Kahn sort.  All three must give the same order (and the same cycle
flag) after any sequence of edits made through the ``Graph`` methods, on
real graphs (a TF1 training graph, the BERT-like builder, a v1 while loop,
Keras ResNet50 through grappler with the whole pipeline), with and without
the C++ index; a missing mark is caught.  The first arrays take each consumed
name's node index from the C++ index (``Graph.index_src_nodes``; off: a
lookup per name): the same arrays after any edits made before that sort."""
import random

import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from graph_passes import graph as graph_mod
from graph_passes.graph import Graph, parse_tensor
from test_graph_core import training_graph, v1_while_graph
from test_speed_paths import bert_like_training_graph

MODES = ((True, True), (False, True), (False, False))  # (incremental_sort, native_sort)


@pytest.fixture(autouse=True)
def _library():
    from npu_amp_tf import bridge

    bridge.register()
    assert graph_mod.native_kahn is bridge.kahn_order, "no C++ sort: nothing to compare"


def _orders(g):
    """The order and cycle flag of each mode, each sorted afresh."""
    out = []
    for inc, nat in MODES:
        g.incremental_sort, g.native_sort = inc, nat
        g._topo_cache = None
        out.append((g.topo_order(), g._has_cycle))
    del g.incremental_sort, g.native_sort  # (back to the class defaults)
    g._topo_cache = None
    return out


def _assert_same(g, what):
    got = _orders(g)
    assert got[1] == got[2], f"{what}: the rebuilt arrays' order is not the Python sort's"
    assert got[0] == got[2], f"{what}: the kept arrays' order is not the Python sort's"
    assert sorted(got[0][0]) == sorted(g.nodes)


def _random_edits(g, rng, steps, check_every):
    """Edits through the Graph methods, the order compared every few edits;
    returns how many comparisons saw patched arrays."""
    removed = []
    patched = 0
    for step in range(steps):
        names = list(g.nodes)
        kind = rng.randrange(9)
        if kind == 0 and names:  # a new node reading some tensors and a control input
            ins = [rng.choice(names) + rng.choice(["", ":1"]) for _ in range(rng.randrange(1, 4))]
            ins.append("^" + rng.choice(names))
            g.new_node("Identity", f"q17/new{step}", ins)
        elif kind == 1 and names:  # a node removed although read (force)
            node = g.nodes[rng.choice(names)]
            keep = node_def_pb2.NodeDef()
            keep.CopyFrom(node)
            removed.append(keep)
            g.remove_node(node.name, force=True)
        elif kind == 2 and len(names) > 8:  # a batch removed
            batch = rng.sample(names, 4)
            for name in batch:
                keep = node_def_pb2.NodeDef()
                keep.CopyFrom(g.nodes[name])
                removed.append(keep)
            g.remove_nodes(batch + batch[:1], force=True)
        elif kind == 3 and removed:  # a removed node back under its name: its old readers read it again
            node = removed.pop(rng.randrange(len(removed)))
            if node.name not in g.nodes:
                g.add_node(node)
        elif kind == 4 and names:  # a data or control input rewired
            name = rng.choice(names)
            node = g.nodes[name]
            if node.input:
                k = rng.randrange(len(node.input))
                src = rng.choice(names)
                g.set_input(name, k, ("^" + src) if node.input[k].startswith("^") else src)
        elif kind == 5 and names:
            a, b = rng.sample(names, 2) if len(names) > 1 else (names[0], names[0])
            if a != b:
                g.add_control_input(a, b)
        elif kind == 6 and names:  # a reader of a name that does not exist yet, then the node
            ghost = f"q17/ghost{step}"
            g.new_node("Identity", f"q17/reader{step}", [ghost, "^" + rng.choice(names)])
            g.new_node("NoOp", ghost, ["^" + rng.choice(names)])
        elif kind == 7 and names:  # the fusion pass's index repair: remove, re-add, append readers by hand
            name = rng.choice(names)
            readers = [c for c in g.consumers(name) if c[0] != name]
            node = node_def_pb2.NodeDef()
            node.CopyFrom(g.nodes[name])
            g.remove_node(name, force=True)
            g.add_node(node)
            for c in readers:
                if c[0] in g.nodes:
                    g._consumers[name].append(c)
        elif kind == 8 and names:  # an op type change (NextIteration: a loop back edge)
            g.set_op(rng.choice(names), rng.choice(["NextIteration", "Identity"]))
        if step % check_every == check_every - 1:
            patched += bool(g._kdirty or g._kdnames) and g._kbase is not None
            _assert_same(g, f"after step {step}")
    return patched


GRAPHS = {"training": training_graph, "bert_like": bert_like_training_graph, "v1_while": v1_while_graph}


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_orders_equal_after_random_edits(name, indexed):
    """The three sorts agree before any edit, after the first edits (the
    arrays from the C++ index) and after every few of 120 random edits (the
    arrays patched), seeded; with the C++ index and without."""
    from npu_amp_tf import bridge

    gd = GRAPHS[name]()
    for seed in range(3):
        g = Graph(gd, index=bridge.graph_index(gd) if indexed else None)
        assert g.prebuilt_index == indexed
        _assert_same(g, "unedited")
        rng = random.Random(seed)
        patched = _random_edits(g, rng, 120, rng.choice([1, 3, 7]))
        assert patched > 3, "the kept arrays were never patched: the test tests nothing"


def test_first_sort_after_edits_uses_the_index_arrays():
    """Edits before the first sort: the arrays come from the C++ index with
    the edited ids re-read (no sort in between), and the order is the
    reference's; the ids marked are exactly the edited lists' sources."""
    from npu_amp_tf import bridge

    gd = bert_like_training_graph()
    g = Graph(gd, index=bridge.graph_index(gd))
    assert g._kblob is not None and g._kbase is None
    names = list(g.nodes)
    reader = next(n for n in names if len([i for i in g.nodes[n].input if not i.startswith("^")]) >= 2)
    old = parse_tensor(g.nodes[reader].input[0])[0]
    new = names[-1]
    g.set_input(reader, 0, new)
    assert g._kdnames == {old, new} and not g._kdirty  # (by name; ids at the sort)
    g.remove_node(names[3], force=True)
    g.new_node("Identity", "q17/x", [names[5], "^" + names[7]])
    _assert_same(g, "edited before the first sort")
    assert g._kblob is None and g._kbase is not None and not g._kdirty and not g._kdnames


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_index_src_nodes_give_the_same_first_arrays(name):
    """Edits before the first sort (removals, a removed node back under its name, the
    fusion pass's index repair, rewiring, new nodes reading names that do not exist
    yet): the sort's first arrays from the index's node indexes equal those from a
    lookup of every consumed name, and the orders equal the Python sort's."""
    from npu_amp_tf import bridge

    gd = GRAPHS[name]()
    blob = bridge.graph_index(gd)
    assert blob.split(b"\x02", 1)[0].endswith(b"+s")
    compared = 0
    for seed in range(4):
        got = []
        for on in (True, False):
            g = Graph(gd, index=blob)
            g.index_src_nodes = on
            rng = random.Random(seed)
            _random_edits(g, rng, 30, 31)  # (no sort in between: check_every past the steps)
            assert g._kblob is not None and any(g._id_dead)
            counts, readers, _ = g._kahn_arrays()
            got.append((list(counts), list(readers)))
            _assert_same(g, f"seed {seed}")
        assert got[0] == got[1], f"seed {seed}: the first arrays differ"
        compared += 1
    assert compared == 4


def test_a_missing_mark_is_caught():
    """Planted fault: an edge added while the marks are dropped leaves the
    kept arrays stale, and the comparison sees a different order (so the
    random-edit test above would catch an edit method that forgets to mark)."""
    from npu_amp_tf import bridge

    gd = training_graph()
    g = Graph(gd, index=bridge.graph_index(gd))
    order = g.topo_order()
    g._topo_cache = None
    g.topo_order()  # (arrays built)
    first, last = order[0], order[-1]
    g.add_control_input(first, last)  # the first node now waits for the last: a cycle
    g._kdirty.clear()  # the fault
    g._kdnames.clear()
    got = _orders(g)
    assert got[1] == got[2] and got[0] != got[2]
    assert got[2][1] and not got[0][1]  # (only the stale arrays miss the cycle)


def test_whole_pipeline_through_grappler_every_sort(k2, monkeypatch):
    """Keras ResNet50's training graph through grappler (the item's C++
    index, fusion, precision with its delayed casts, cleanup): every sort
    the pipeline makes is the reference's, and the output graph is the one
    the reference arrays give."""

    from test_speed_paths import _keras_resnet_training_graph, optimize_rewritten, plugin_only_grappler

    mg, cfg = plugin_only_grappler(_keras_resnet_training_graph(k2), ["loss", "train"])
    orig = Graph._compute_topo_order
    seen = []

    def checked(self, strict):
        out = orig(self, strict)
        cyc = self._has_cycle
        if self.incremental_sort:
            self.incremental_sort = False
            ref = orig(self, False)
            del self.incremental_sort
            self._has_cycle = cyc
            assert out == ref, "a sort in the pipeline differs from the reference"
            seen.append(len(out))
        return out

    outs = []
    for inc in (True, False):
        monkeypatch.setattr(Graph, "incremental_sort", inc)
        monkeypatch.setattr(Graph, "_compute_topo_order", checked)
        out, _ = optimize_rewritten(cfg, mg, b"q17")
        outs.append(out)
    assert seen, "the pipeline never sorted after an edit"
    assert outs[0] == outs[1]
