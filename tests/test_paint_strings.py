"""Issue 17: inside the grappler callback, the precision pass's native
painting gets the inputs of the nodes no pass created or edited from the
item grappler holds (``NpuAmpItemPaintStrings`` in
custom_ops/grappler_bridge.cc, through ``Graph.base_inputs`` and
``Graph.base_positions``) instead of turning every NodeDef's inputs into
Python strings and joining them (``PrecisionPass.base_strings`` /
``bridge.BASE_PAINT_STRINGS``; False: the reference join).

Oracles: the bytes the reference join builds from the same graph at the same
moment (compared inside every real callback), the input graph's own node
order (``base_positions``), and grappler's output bytes and the reports with
the switch off."""
import numpy as np
import pytest
from operator import getitem
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.grappler import tf_optimizer

from graph_passes.graph import Graph
from graph_passes.precision import amp, native
from npu_amp_tf import bridge
from test_precision_core import _build
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler

pytestmark = pytest.mark.skipif(not hasattr(bridge.library(), "NpuAmpItemPaintStrings"),
                                reason="library without NpuAmpItemPaintStrings")


def _node(name, op="Identity", inputs=()):
    n = node_def_pb2.NodeDef(name=name, op=op)
    n.input.extend(inputs)
    return n


def _chain():
    gd = graph_pb2.GraphDef()
    gd.node.extend([_node("a", "Placeholder"), _node("b", inputs=["a"]), _node("c", inputs=["b", "^a"]),
                    _node("d", inputs=["c"]), _node("e", "AddV2", ["d", "b"])])
    return gd


def test_base_positions_follow_the_edits():
    g = Graph(_chain())
    assert g.base_positions().tolist() == [0, 1, 2, 3, 4]
    g.set_input("d", 0, "b")  # edited
    g.remove_node("c", force=True)
    g.add_node(_node("f", inputs=["e"]))  # created
    g.add_node(_node("c", inputs=["a"]))  # created again under a removed node's name
    names = list(g.nodes)
    want = {"a": 0, "b": 1, "d": -1, "e": 4, "f": -1, "c": -1}
    assert g.base_positions().tolist() == [want[n] for n in names]
    g.touch("b")
    assert g.base_positions().tolist() == [-1 if n == "b" else want[n] for n in names]
    g.touch_all()  # an untracked pass: nothing is known
    assert g.base_positions() is None
    g2 = Graph(_chain())
    g2.reindex()  # node ranks no longer the input's
    assert g2.base_positions() is None


def _reference(names, nodes, cid, cut):
    data_ins = map(getitem, map(native._input, nodes), map(cut.__getitem__, cid))
    return ("\x01".join(names) + "\x03" + "\x02".join(map("\x01".join, data_ins))).encode()


@pytest.fixture
def spy(monkeypatch):
    """Every painting's strings from the item compared with the reference
    join of the same graph; ``seen``: (used the item, edited nodes, nodes)."""
    seen = []
    real = native._strings

    def wrapped(g, names, nodes, cid, cut, ins_dts, base_at):
        got = real(g, names, nodes, cid, cut, ins_dts, base_at)
        base = g.base_positions()
        if got is not None:
            assert got == _reference(names, nodes, cid, cut)
        seen.append((got is not None, None if base is None else int((base < 0).sum()), len(names)))
        return got

    monkeypatch.setattr(native, "_strings", wrapped)
    return seen


GRAPHS = ["keras_resnet50_training", "bert_like", "learning_phase_functions", "control_inputs", "v1_loop",
          "type_lists_unknown_op", "slim_resnet_v1_50", "keras3_transformer"]


def _graph(name, k2):
    if name == "keras3_transformer":
        from test_fusion_skip import keras3_transformer_training_graph

        return keras3_transformer_training_graph()
    return _build(name, k2)


@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
@pytest.mark.parametrize("name", GRAPHS)
def test_grappler_output_identical_and_strings_equal_the_join(k2, name, mode, spy, monkeypatch):
    gd, fetches = _graph(name, k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["precision_mode"].s = mode.encode()
    outs, reps = [], []
    for on in (False, True, False):
        monkeypatch.setattr(bridge, "BASE_PAINT_STRINGS", on)
        del spy[:]
        out, rep = optimize_rewritten(cfg, mg, b"test_paint_strings")
        outs.append(out)
        reps.append(_strip_times(rep))
        assert spy, "the native painting did not run"
        assert all(used == on for used, _, _ in spy), spy
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert reps[1] == reps[0] and reps[2] == reps[0]


def test_fusion_edits_come_from_python_and_the_rest_from_the_item(k2, spy):
    """BERT-like: the fusion pass edits nodes before the precision pass, so
    both sources meet in one section (and their bytes equal the join: spy)."""
    gd, fetches = _build("bert_like", k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    optimize_rewritten(cfg, mg, b"test_paint_strings_mixed")
    used = [s for s in spy if s[0]]
    assert used, spy
    _, edited, n = used[0]
    assert 0 < edited < n / 4, used


CORRUPT = {
    "wrong name": lambda names, base, counts, extra: (names.replace(b"\x01", b"\x01x", 1), base, counts, extra),
    "index past the item": lambda names, base, counts, extra: (names, _set(base, 0, 10 ** 6), counts, extra),
    "fewer names": lambda names, base, counts, extra: (names.rsplit(b"\x01", 1)[0], base, counts, extra),
    "more names": lambda names, base, counts, extra: (names + b"\x01zz", base, counts, extra),
    "extra section missing": lambda names, base, counts, extra: (names, _set(base, 0, -1), counts, extra),
    "extra section left over": lambda names, base, counts, extra: (names, base, counts, extra + b"\x02x"),
}


def _set(arr, i, v):
    out = type(arr)(arr.typecode, arr)
    out[i] = v
    return out


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_arguments_that_do_not_describe_the_item_are_refused(k2, case, monkeypatch):
    gd, fetches = _build("bert_like", k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    ref, _ = optimize_rewritten(cfg, mg, b"test_paint_strings_ref")
    answers = []
    real = native._strings

    def corrupt(g, names, nodes, cid, cut, ins_dts, base_at):
        fn = g.base_inputs

        def bad(n, base, counts, extra):
            good = fn(n, base, counts, extra)
            answers.append((good is not None, fn(*CORRUPT[case](n, base, counts, extra))))
            return None  # the reference join then
        g.base_inputs = bad
        try:
            return real(g, names, nodes, cid, cut, ins_dts, base_at)
        finally:
            g.base_inputs = fn

    monkeypatch.setattr(native, "_strings", corrupt)
    out, _ = optimize_rewritten(cfg, mg, b"test_paint_strings_bad")
    assert answers and all(good and bad is None for good, bad in answers), answers
    assert out == ref


def test_outside_the_callback_nothing_is_read_from_an_item(k2):
    """Offline (``rewrite_graph``) no builder source is set: the join runs."""
    import npu_amp_tf

    gd, fetches = _build("bert_like", k2)
    assert Graph(gd).base_inputs is None
    assert bridge.item_paint_strings(None, b"a", np.zeros(1, np.int32), np.zeros(1, np.int32), b"") is None
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=list(fetches), precision_mode="allow_mix_precision")
    assert rep.summary["casts_inserted"] > 0
    assert amp.PrecisionPass.base_strings


def test_callables_kept_past_the_callback_answer_none(k2, monkeypatch):
    """The sink lives on the C++ stack during one callback: the item-bound
    callables the bridge hands the pipeline answer None once it returned
    (a test or a user keeping one must not read freed memory)."""
    kept = []
    real = bridge.handle

    def handle(*args, **kw):
        kept.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(bridge, "handle", handle)
    gd, fetches = _build("bert_like", k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    bridge.clear_reports()
    tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_paint_strings_kept")
    assert kept
    import array

    a = array.array("i", [0])
    for kw in kept:
        assert kw["base_inputs"](b"x", a, a, b"") is None
        assert kw["index"]() is None
        assert kw["opdef_precheck"](None, "CPU") is None


def test_without_the_index_the_item_is_read_through_its_parsed_graph(k2, spy, monkeypatch):
    """No C++ index asked for in this callback (Python builds the indexes):
    the strings come from views of the item's parsed GraphDef, equal to the
    join (spy), and grappler's output is the one with the switch off."""
    gd, fetches = _build("bert_like", k2)
    bridge.register()
    mg, cfg = plugin_only_grappler(gd, fetches)
    monkeypatch.setattr(bridge, "BASE_PAINT_STRINGS", False)
    ref, _ = optimize_rewritten(cfg, mg, b"test_paint_strings_noindex_ref")
    monkeypatch.setattr(bridge, "BASE_PAINT_STRINGS", True)
    monkeypatch.setattr(bridge, "item_index", lambda sink: None)
    del spy[:]
    out, _ = optimize_rewritten(cfg, mg, b"test_paint_strings_noindex")
    assert spy and all(used for used, _, _ in spy), spy
    assert out == ref
