"""Issue 17: how the gradient-region search's C++ mirror keeps in step with
the graph (``grad_region._Mirror.sync``), two exact shortcuts against their
reference switches.

* ``GONE_FROM_LOG``: the first sync learns the names removed since the
  fusion pass began from the graph's removal log, not by testing every name
  the graph had: the same names (the C++ side keeps a set) through edits, and
  byte-identical output through grappler.
* ``LEAN_TEXT``: a sync sends the nodes edited since the last one as text
  (``NpuAmpGrMirrorUpsertText``), not as a GraphDef built, serialized and
  parsed: byte-identical output through grappler with every search compared
  with Python's (the suite's ``CHECK_NATIVE``), every sync sent as text; a
  name holding a separator or a non-ASCII character goes the GraphDef way,
  which the mirror refuses (Python searches, the same graph).
* ``POSITIONS_BY_INDEX``: a full order's positions go to the mirror by the
  loaded graph's node indexes (``Graph.topo_ranks``), the nodes created since
  by name: read back equal to the order's (the suite's ``CHECK_NATIVE``),
  byte-identical output through grappler, and the reference (every name)
  when the order is not the native sort's.
"""
import pytest

from graph_passes.fusion import grad_region as gr
from graph_passes.graph import Graph
from test_precision_bulk import _library  # noqa: F401  (an autouse fixture: the library loaded)
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_gone_from_log_sends_the_same_names_through_grappler(k2, monkeypatch, name, mode):
    """Through grappler: every ``before`` the mirror sends is the same set
    with the removal log as with the reference scan, and the output and the
    report are the same."""
    if gr.native is None:
        pytest.skip("the C++ gradient-region search is not loaded")
    runs = {}
    real_before = type(gr.native).before
    for on in (True, False):
        sent = []

        def before(self, h, names, reset, _sent=sent, _real=real_before):
            _sent.append((frozenset(n for n in names.decode().split("\x01") if n), bool(reset)))
            return _real(self, h, names, reset)

        monkeypatch.setattr(type(gr.native), "before", before)
        monkeypatch.setattr(gr, "GONE_FROM_LOG", on)
        gd, fetches = _graph(name, k2)
        mg, cfg = plugin_only_grappler(gd, fetches)
        cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["precision_mode"].s = mode.encode()
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        runs[on] = (out, _strip_times(rep), sent)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]
    assert runs[True][2] == runs[False][2]
    assert any(reset for _, reset in runs[True][2])


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_gone_before_equals_the_scan_through_edits(k2, monkeypatch, name):
    """``_gone_before`` from the removal log equals the scan of every
    recorded name: after batch and single removals, a removed name added
    back, nodes created and removed again (never recorded), a removal
    repeated, and again after a second mark.  Without a mark, or with the
    mark of another set, it scans."""
    from tensorflow.core.framework import node_def_pb2

    gd, _ = _graph(name, k2)
    g = Graph(gd)

    def both():
        before = getattr(g, gr.ORIGINAL_NAMES_ATTR)
        got = []
        for on in (True, False):
            monkeypatch.setattr(gr, "GONE_FROM_LOG", on)
            got.append(gr._gone_before(g, before))
        assert len(got[0]) == len(set(got[0]))
        assert set(got[0]) == set(got[1])
        return set(got[0])

    gr.mark_original_names(g)
    assert both() == set()
    names = list(g.nodes)
    sinks = [n for n in names if not g.consumers(n)][:5]
    g.remove_nodes(sinks, force=True)
    g.remove_node(names[3], force=True)
    back = node_def_pb2.NodeDef()
    back.CopyFrom(gd.node[3])
    g.add_node(back)  # (removed, then added back under its name: not gone)
    extra = node_def_pb2.NodeDef(name="never_recorded", op="NoOp")
    g.add_node(extra)
    g.remove_node("never_recorded")
    g.remove_nodes(sinks[:2], force=True)  # (already gone: nothing more)
    assert both() == set(sinks)
    gr.mark_original_names(g)  # a second pass over the edited graph
    g.remove_node(names[4], force=True)
    assert both() == {names[4]}
    setattr(g, gr.ORIGINAL_MARK_ATTR, None)  # no mark: the scan
    assert set(gr._gone_before(g, getattr(g, gr.ORIGINAL_NAMES_ATTR))) == {names[4]}
    setattr(g, gr.ORIGINAL_MARK_ATTR, (frozenset(), 0))  # the mark of another set: the scan
    assert set(gr._gone_before(g, getattr(g, gr.ORIGINAL_NAMES_ATTR))) == {names[4]}


def _through_grappler(k2, name, mode):
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["precision_mode"].s = mode.encode()
    out, rep = optimize_rewritten(cfg, mg, name.encode())
    return out, _strip_times(rep)


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_lean_text_gives_the_same_graph_through_grappler(k2, monkeypatch, name, mode):
    if gr.native is None:
        pytest.skip("the C++ gradient-region search is not loaded")
    lib = type(gr.native)
    sent = {"text": 0, "graphdef": 0}
    real_text, real_load = lib.upsert_text, lib.load

    def text(self, h, data):
        sent["text"] += 1
        return real_text(self, h, data)

    def load(self, h, data, fresh):
        if not fresh:
            sent["graphdef"] += 1
        return real_load(self, h, data, fresh)

    monkeypatch.setattr(lib, "upsert_text", text)
    monkeypatch.setattr(lib, "load", load)
    checked = len(gr.CHECKED[1])
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(gr, "LEAN_TEXT", on)
        runs[on] = _through_grappler(k2, name, mode)
        if on:
            on_sent = dict(sent)
            sent.update(text=0, graphdef=0)
    assert runs[True] == runs[False]
    assert on_sent["text"] > 0 and on_sent["graphdef"] == 0, on_sent
    assert sent["text"] == 0 and sent["graphdef"] > 0, sent
    assert len(gr.CHECKED[1]) == checked  # (with CHECK_NATIVE: every search equal to Python's)


def test_lean_text_declines_names_it_cannot_carry():
    from tensorflow.core.framework import node_def_pb2

    ok = node_def_pb2.NodeDef(name="a/b", op="AddV2", input=["x", "y:1", "^z"])
    assert gr._lean_text([ok]) == b"a/b\x01AddV2\x01x\x01y:1\x01^z"
    assert gr._lean_text([ok, node_def_pb2.NodeDef(name="n", op="NoOp")]) == \
        b"a/b\x01AddV2\x01x\x01y:1\x01^z\x02n\x01NoOp"
    for bad in (node_def_pb2.NodeDef(name="a\x02b", op="NoOp"),
                node_def_pb2.NodeDef(name="c", op="Identity", input=["d\x01e"]),
                node_def_pb2.NodeDef(name="c\u00e9", op="NoOp")):
        assert gr._lean_text([ok, bad]) is None


def test_a_name_the_text_cannot_carry_ends_in_the_python_search(monkeypatch):
    """A node the fusion edits, renamed with a separator in its name: the
    sync falls back to the GraphDef, which the mirror refuses; the search is
    then Python's, with the same region as without the C++ search."""
    from test_grad_region import _native_lib, _tf1_graph
    from graph_passes.fusion.grad_region import find_grad_region

    gr_ = _native_lib()
    monkeypatch.setattr(gr_, "CHECK_NATIVE", False)
    regions = []
    for native_on in (True, False):
        monkeypatch.setattr(gr_, "NATIVE_SEARCH", native_on)
        graph, fwd, inputs, _ = _tf1_graph()
        r1 = find_grad_region(graph, fwd, ["ln/y"], inputs)  # (the mirror built and synced)
        graph.new_node("Identity", "odd\x02name", [r1.nodes[0]])
        regions.append(find_grad_region(graph, fwd, ["ln/y"], inputs).nodes)
        if native_on:
            assert getattr(graph, gr_._MIRROR_ATTR) is False  # refused: Python searched
    assert regions[0] == regions[1]


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
def test_positions_by_index_give_the_same_graph_through_grappler(k2, monkeypatch, name):
    """Through grappler: the full orders went by index (and, with CHECK_NATIVE, read back
    equal to the positions Python computed), the output and the report equal the
    reference's (every position sent by name)."""
    if gr.native is None or not getattr(gr.native, "can_positions_base", False):
        pytest.skip("the C++ gradient-region search is not loaded")
    lib = type(gr.native)
    by_name = []
    real = lib.positions

    def positions(self, h, names, values, reset):
        if reset:
            by_name.append(len(names))
        return real(self, h, names, values, reset)

    monkeypatch.setattr(lib, "positions", positions)
    checked = len(gr.CHECKED[1])
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(gr, "POSITIONS_BY_INDEX", on)
        sent, read_back = list(gr.POSITIONS_SENT_BY_INDEX), gr.POSITIONS_SENT_BY_INDEX[1]
        del by_name[:]
        runs[on] = _through_grappler(k2, name, "allow_mix_precision")
        if on:
            assert gr.POSITIONS_SENT_BY_INDEX[0] > sent[0] and not by_name
            if gr.CHECK_NATIVE:
                assert gr.POSITIONS_SENT_BY_INDEX[1] > read_back
        else:
            assert gr.POSITIONS_SENT_BY_INDEX[0] == sent[0] and by_name
    assert runs[True] == runs[False]
    assert len(gr.CHECKED[1]) == checked


def test_positions_by_index_cover_created_nodes_and_refuse_a_foreign_order():
    """A mirror loaded from a graph's bytes: after nodes are removed, created and one
    created again under a loaded name, the positions by index read back as the full
    order's; an order the native sort did not make (Graph.topo_ranks None) is not sent
    by index."""
    if gr.native is None or not getattr(gr.native, "can_positions_base", False):
        pytest.skip("the C++ gradient-region search is not loaded")
    from test_opdef_precheck import _gd, _node, _ph

    gd = _gd(_ph("x", 1), _node("Identity", "a", ["x"], T=("type", 1)), _node("Identity", "b", ["a"], T=("type", 1)),
             _node("Identity", "c", ["b", "^a"], T=("type", 1)))
    data = gd.SerializeToString()
    g = Graph(data)
    g.source_bytes = data
    node_b = g.nodes["b"]
    g.remove_node("c", force=True)
    g.remove_node("b", force=True)
    g.new_node("Identity", "d", ["a"], attrs={"T": 1})
    g.add_node(node_b)  # 'b' again: a loaded name, a new id
    g.set_input("b", 0, "d")
    m = gr._Mirror(gr.native, g)
    assert m.ok and m.attrs
    pos = gr._positions(g)
    first = gr.POSITIONS_SENT_BY_INDEX[0]
    assert m.sync(g, pos)
    assert m.pos is pos and gr.POSITIONS_SENT_BY_INDEX[0] == first + 1
    got = gr.native.positions_of(m.h, ["x", "a", "d", "b", "c"])
    want = [pos["x"], pos["a"], pos["d"], pos["b"]]
    assert got[:4] == [float(v) for v in want] and got[4] != got[4]  # ('c' removed: none)
    assert sorted(want) == want  # (x -> a -> d -> b)
    # the same positions sent by name
    m2 = gr._Mirror(gr.native, g)
    sent = gr.POSITIONS_SENT_BY_INDEX[0]
    setattr(g, gr._POS_ATTR, (*getattr(g, gr._POS_ATTR)[:3], None))  # (no longer the sort's order)
    assert m2.sync(g, pos) and gr.POSITIONS_SENT_BY_INDEX[0] == sent
    assert gr.native.positions_of(m2.h, ["x", "a", "d", "b"]) == got[:4]
    g._topo_ids = None  # (an order the native sort did not make)
    setattr(g, gr._POS_ATTR, (*getattr(g, gr._POS_ATTR)[:3], g._topo_cache[0]))
    m3 = gr._Mirror(gr.native, g)
    assert m3.sync(g, pos) and gr.POSITIONS_SENT_BY_INDEX[0] == sent
