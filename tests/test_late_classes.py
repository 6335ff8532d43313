"""Issue 17: ``bridge.LATE_CLASSES`` (C++ ``kFlagLateClasses``).

Inside grappler the C++ side builds the item's index on a helper thread while Python parses the
bytes, and Python waits for it before it builds its ``Graph``.  With ``LATE_CLASSES`` the thread
hands the index over before the per-node signature classes (its magic ends in "+l"), computes the
classes next, while Python adopts the index and runs the passes before the precision pass, and
Python reads them the first time ``Graph.signature_classes()`` is asked (``bridge.item_classes``).

Checked through grappler on real graphs (Keras ResNet50, whose index starts before the
callback; the BERT-base-like training graph of ``benchmarks/precision.py``, small, whose layer
norms the run before the parse fuses first, its index started after that run): the output bytes, the report and the classes
the precision pass reads are the same as with the classes inside the index (the reference); the
late path did run (the library's counts); and when the late classes cannot be had, or nobody
asks for them, the output is still the reference's and the thread is joined when the callback
returns."""
import pytest

from graph_passes import graph as graph_mod
from graph_passes.precision import amp
from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_precision_core import _build
from test_precision_fast import _strip_times
from test_speed_paths import optimize_rewritten, plugin_only_grappler

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpItemClasses"), reason="library without late classes")


def _run(cfg, mg, monkeypatch, late, tag=b"test_late_classes"):
    """The output, the report and the classes the passes read (one dict per
    ``signature_classes()`` answer), with LATE_CLASSES = ``late``; and how
    many indexes were handed over before their classes, and classes computed after."""
    monkeypatch.setattr(bridge, "LATE_CLASSES", late)
    read = []
    real = graph_mod.Graph.signature_classes

    def spy(self):
        got = real(self)
        read.append(None if got is None else dict(got))
        return got

    monkeypatch.setattr(graph_mod.Graph, "signature_classes", spy)
    before = bridge.late_classes_counts()
    out, rep = optimize_rewritten(cfg, mg, tag)
    after = bridge.late_classes_counts()
    monkeypatch.setattr(graph_mod.Graph, "signature_classes", real)
    return out, _strip_times(rep), read, (after[0] - before[0], after[1] - before[1])


def _graph(name, k2):
    if name == "bert_prefused":
        g, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
        return g.as_graph_def(), fetches
    return _build(name, k2)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_prefused"])
def test_the_same_output_and_classes_with_late_classes_and_without(k2, name, monkeypatch):
    bridge.register()
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", True)
    _run(cfg, mg, monkeypatch, True)  # (a first call: the flags the next early index starts with)
    late, late_rep, late_read, (indexes, classes) = _run(cfg, mg, monkeypatch, True)
    assert indexes >= 1 and classes == indexes  # handed over early, classes computed after
    _run(cfg, mg, monkeypatch, False)  # (an early index started with the late flags: dropped)
    ref, ref_rep, ref_read, (indexes, classes) = _run(cfg, mg, monkeypatch, False)
    assert (indexes, classes) == (0, 0)
    assert late == ref
    assert late_rep == ref_rep
    # the precision pass read classes, and the same ones: every node of the graph it painted
    # has one, as with the classes inside the index
    assert late_read and late_read == ref_read
    assert all(r is not None and len(r) > 100 for r in late_read)


def test_without_the_late_classes_the_output_is_the_reference(k2, monkeypatch):
    """The classes cannot be had (the call answers None): the precision pass goes without them
    (its reference loops), and the output is the same; nobody asks for them: the thread
    computes them anyway and is joined when the callback returns."""
    bridge.register()
    gd, fetches = _graph("bert_prefused", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", True)
    _run(cfg, mg, monkeypatch, False)
    ref, ref_rep, _, _ = _run(cfg, mg, monkeypatch, False)
    _run(cfg, mg, monkeypatch, True)  # (the flags the next early index starts with)

    monkeypatch.setattr(bridge, "item_classes", lambda sink: None)
    none, none_rep, read, (indexes, _) = _run(cfg, mg, monkeypatch, True)
    assert indexes >= 1
    assert read and all(r is None for r in read)  # (no classes: Graph.signature_classes says so)
    assert none == ref and none_rep == ref_rep
    monkeypatch.undo()

    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", True)
    monkeypatch.setattr(amp, "_usable_classes", lambda graph: None)  # (never asked)
    unasked, unasked_rep, read, (indexes, classes) = _run(cfg, mg, monkeypatch, True)
    assert indexes >= 1 and classes == indexes and read == []
    assert unasked == ref and unasked_rep == ref_rep
