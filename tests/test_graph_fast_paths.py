"""Issue 17 (helper 17j): exact shortcuts of ``Graph``, each against its
reference switch on the real test graphs, each with a planted fault the
comparison catches.

* ``Graph.remove_nodes`` (``Graph.batch_remove = False``: one
  ``remove_node`` per name) leaves the same nodes, consumers and op-type
  indexes, ``created`` set, ranks and ``version``; the fusion pass's commits
  use it;
* ``Graph.consumers(name, port)`` compares each input with the canonical
  reference before parsing it (``Graph.fast_consumers = False``: parse each);
* ``Graph.created_in_order`` sorts the created nodes by rank
  (``Graph.ranked_created = False``: scans every node), the cleanup pass's
  list;
* ``pipeline.PROMOTE_SURVIVORS``: after a run the objects it leaves alive
  are moved to the oldest GC generation (no young collection traverses
  them), nothing stays frozen and garbage cycles are still collected;
* the whole pipeline (fusion, precision, cleanup) gives byte-identical
  GraphDefs and equal reports with the switches on and off, on Keras
  ResNet-50, TF-Slim ResNet-v1-50, the BERT-like builder and a Keras
  transformer block, in FP16 and BF16 (level 3: attention with its region).

The precision pass's own shortcuts of this session (``_wanted``,
``_float_inputs``, ``_finish``) sit under ``PrecisionPass.fast_paths`` and
are compared with its reference in ``test_precision_fast.py``.
"""
import gc
import random
import weakref

import pytest
from tensorflow.core.framework import graph_pb2

import npu_amp_tf
from npu_amp_tf import pipeline
from graph_passes.graph import Graph
from test_fusion_skip import MODES, keras_transformer_block_training_graph
from test_precision_fast import _strip_times, slim_resnet_graph
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

SWITCHES = ("batch_remove", "fast_consumers", "ranked_created")


def _real_graphs(k2):
    yield "bert", bert_like_training_graph(), ["loss", "train"]
    yield "keras_resnet50", _keras_resnet_training_graph(k2), ["loss", "train"]
    yield "keras_transformer_block", keras_transformer_block_training_graph(k2), ["loss", "train"]
    try:
        gd, fetches = slim_resnet_graph()
    except ImportError:
        return
    yield "slim_resnet_v1_50", gd, fetches


def _state(g):
    """Everything remove_node / remove_nodes may touch, comparable with ==
    (dict orders included: the consumers index's and the nodes')."""
    return (list(g.nodes), [(k, list(v)) for k, v in g._consumers.items()],
            [(k, list(v)) for k, v in g._by_op.items()], list(g._seq.items()),
            sorted(g.created), g.version, g.topo_order())


def _batches(gd, seed):
    """Batches of names to remove: producer/reader chains both ways round,
    repeats, names that are no node, one node and a big random sample."""
    rng = random.Random(seed)
    names = [n.name for n in gd.node]
    g = Graph(gd)
    chains = []
    for n in rng.sample(names, min(40, len(names))):
        chain = [n]
        while len(chain) < 6:
            readers = [c for c, i in g.consumers(chain[-1])]
            if not readers:
                break
            chain.append(rng.choice(readers))
        chains.append(chain)
    yield [c for ch in chains for c in ch]                    # producers before readers
    yield [c for ch in chains for c in reversed(ch)]          # readers before producers
    yield [names[0], names[0], "no/such/node", names[-1]]     # repeats and strangers
    yield [rng.choice(names)]
    yield rng.sample(names, len(names) // 3)


def _remove_both_ways(gd, batch, add_first=()):
    out = []
    for batched in (True, False):
        g = Graph(gd)
        for node in add_first:  # created nodes: remove_nodes drops them from `created`
            g.new_node("Identity", node, [gd.node[0].name])
        g.batch_remove = batched
        g.remove_nodes(batch, force=True)
        out.append(_state(g))
    return out


def test_remove_nodes_equals_one_by_one(real_graphs):
    checked = 0
    for label, gd, _ in real_graphs:
        for seed, batch in enumerate(_batches(gd, 17)):
            fast, ref = _remove_both_ways(gd, batch, add_first=("made/a", "made/b"))
            assert fast == ref, f"{label}: batch {seed} of {len(batch)} names"
            checked += 1
        # created nodes removed in the batch, and one reading another
        fast, ref = _remove_both_ways(gd, ["made/a", gd.node[0].name, "made/b"],
                                      add_first=("made/a", "made/b"))
        assert fast == ref
    assert checked >= 4 * 5


def test_remove_nodes_without_force_is_remove_node(real_graphs):
    """Without force a node still read refuses, as remove_node does, after the
    names before it went."""
    label, gd, _ = real_graphs[0]
    g = Graph(gd)
    leaf = next(n for n in g.nodes if not g.consumers(n))
    producer = next(n for n in g.nodes if g.consumers(n))
    with pytest.raises(Exception, match="still read"):
        g.remove_nodes([leaf, producer])
    assert leaf not in g.nodes and producer in g.nodes


def test_a_batch_that_forgets_a_reader_is_caught(real_graphs, monkeypatch):
    """Planted fault: the batch drops the removed nodes but filters no
    consumer list; the comparison sees it."""
    label, gd, _ = real_graphs[0]
    orig = Graph.remove_nodes

    def faulty(self, names, force=False, inputs=None):
        if not self.batch_remove:
            return orig(self, names, force)
        gone = [n for n in dict.fromkeys(names) if n in self.nodes]
        for n in gone:
            node = self.nodes.pop(n)
            self.created.discard(n)
            self._consumers.pop(n, None)
            self._by_op.get(node.op, {}).pop(n, None)
            self._seq.pop(n, None)
        self._topo_cache = None
        self.version += len(gone)

    monkeypatch.setattr(Graph, "remove_nodes", faulty)
    fast, ref = _remove_both_ways(gd, next(_batches(gd, 17)))
    assert fast != ref


def _port_queries(g):
    for name, node in g.nodes.items():
        outs = g.output_dtypes(node) or ()
        for port in range(len(outs) + 1):  # (one port past the last: no reader)
            yield name, port


def _consumers_both(g, name, port):
    out = []
    for fast in (True, False):
        g.fast_consumers = fast
        out.append(g.consumers(name, port=port))
    g.fast_consumers = True
    return out


def test_consumers_by_port_equal_parsing_every_input(real_graphs):
    checked = 0
    for label, gd, _ in real_graphs:
        g = Graph(gd)
        for name, port in _port_queries(g):
            fast, ref = _consumers_both(g, name, port)
            assert fast == ref, (label, name, port)
            checked += bool(ref)
        for name in g.nodes:
            for control in (True, False):
                g.fast_consumers = True
                fast = g.consumers(name, control=control)
                g.fast_consumers = False
                assert fast == g.consumers(name, control=control), (label, name, control)
        g.fast_consumers = True
    assert checked > 1000


def test_consumers_by_port_with_uncanonical_references():
    """``x:0`` (port 0 written out), ``x:1``, ``^x`` and ``x`` read by one node."""
    gd = graph_pb2.GraphDef()
    x = gd.node.add(name="x", op="Unpack")
    x.attr["num"].i = 2
    r = gd.node.add(name="r", op="AddN")
    r.input.extend(["x:0", "x:1", "x", "x:1", "^x"])
    g = Graph(gd)
    for port, want in ((0, [("r", 0), ("r", 2)]), (1, [("r", 1), ("r", 3)]), (2, [])):
        fast, ref = _consumers_both(g, "x", port)
        assert fast == ref == want


def test_a_fast_consumers_without_the_parse_is_caught(monkeypatch):
    """Planted fault: matching only the canonical reference misses ``x:0``."""
    gd = graph_pb2.GraphDef()
    gd.node.add(name="x", op="Const")
    gd.node.add(name="r", op="Identity").input.append("x:0")
    g = Graph(gd)
    orig = Graph.consumers

    def canonical_only(self, name, port=None, control=True):
        if port is None or not self.fast_consumers:
            return orig(self, name, port, control)
        ref = name if port == 0 else f"{name}:{port}"
        return [(c, i) for c, i in self._consumers.get(name, ())
                if i >= 0 and self.nodes[c].input[i] == ref]

    monkeypatch.setattr(Graph, "consumers", canonical_only)
    fast, ref = _consumers_both(g, "x", 0)
    assert fast != ref and ref == [("r", 0)]


def test_created_in_order_is_the_graph_order(monkeypatch):
    """Created nodes in graph order: one added after others, one removed and added again (it
    moves last), one removed for good; a node put in by hand (no rank) sends it to the scan."""
    from test_opdef_precheck import _gd, _node, _ph

    g = Graph(_gd(_ph("x", 1), _node("Identity", "i", ["x"], T=("type", 1))))
    for name in ("c", "a", "b", "d"):
        g.new_node("Identity", name, ["x"], attrs={"T": 1})
    node = g.nodes["a"]
    g.remove_node("a")
    g.add_node(node)
    g.remove_node("d")
    want = ["c", "b", "a"]
    for ranked in (True, False):
        monkeypatch.setattr(Graph, "ranked_created", ranked)
        assert g.created_in_order() == want == [n for n in g.nodes if n in g.created]
    g.nodes["by_hand"] = _node("NoOp", "by_hand")
    g.created.add("by_hand")
    monkeypatch.setattr(Graph, "ranked_created", True)
    assert g.created_in_order() == ["c", "b", "a", "by_hand"]


def _rewrite(monkeypatch, gd, fetches, fast, kw, calls):
    for flag in SWITCHES:
        monkeypatch.setattr(Graph, flag, fast)
    monkeypatch.setattr(pipeline, "PROMOTE_SURVIVORS", fast)

    orig = Graph.remove_nodes

    def counted(self, names, force=False, inputs=None):
        names = list(names)
        calls.append(len(names))
        return orig(self, names, force, inputs)

    monkeypatch.setattr(Graph, "remove_nodes", counted)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    monkeypatch.setattr(Graph, "remove_nodes", orig)
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json())


@pytest.mark.parametrize("mode", ["fp16", "bf16_l3"])
def test_pipeline_equals_reference_on_real_graphs(real_graphs, monkeypatch, mode):
    batched = 0
    for label, gd, fetches in real_graphs:
        calls = []
        fast_gd, fast_rep = _rewrite(monkeypatch, gd, fetches, True, MODES[mode], calls)
        ref_gd, ref_rep = _rewrite(monkeypatch, gd, fetches, False, MODES[mode], [])
        assert fast_rep["summary"].get("failed_pass") is None, (label, fast_rep["warnings"][:3])
        assert fast_gd == ref_gd, f"{label} {mode}: the shortcuts rewrote the graph differently"
        assert fast_rep == ref_rep, f"{label} {mode}: the shortcuts changed the report"
        batched += sum(1 for c in calls if c > 1)
    assert batched > 0, "no fusion removed a batch: the comparison is vacuous"


class _Node:
    pass


def _young_after_run(gd, promote, monkeypatch):
    """(objects in generations 0 and 1 after a rewrite, the report) with the
    collector enabled around it."""
    monkeypatch.setattr(pipeline, "PROMOTE_SURVIVORS", promote)
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(10 ** 8, 10, 10)  # (no automatic collection moves them meanwhile)
    try:
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"])
        young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
    finally:
        gc.set_threshold(*threshold)
    return young, (out, rep)


def test_survivors_are_promoted_nothing_stays_frozen_and_cycles_are_found(monkeypatch):
    gd = bert_like_training_graph()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    # a garbage cycle made before the run: still collected after it
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    dead = weakref.ref(a)
    del a, b
    young_ref, kept_ref = _young_after_run(gd, False, monkeypatch)
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    dead2 = weakref.ref(a)
    del a, b
    young, kept = _young_after_run(gd, True, monkeypatch)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    # the reference leaves the run's survivors young (thousands: graph
    # indexes kept by the lazy report); promoted, only what the caller made
    # after the run is young
    assert young_ref > 1000 and young < young_ref // 10, (young, young_ref)
    gc.collect()
    assert dead() is None and dead2() is None
    assert kept[0].SerializeToString(deterministic=True) == kept_ref[0].SerializeToString(deterministic=True)


def test_objects_the_process_froze_stay_frozen(monkeypatch):
    """A process that froze objects itself (a pre-fork server): the run does
    not unfreeze them (no promotion then)."""
    monkeypatch.setattr(pipeline, "PROMOTE_SURVIVORS", True)
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        npu_amp_tf.rewrite_graph(bert_like_training_graph(layers=1), fetches=["loss", "train"])
        # (frozen objects freed by reference counting meanwhile leave the
        # count; an unfreeze would have emptied it)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
