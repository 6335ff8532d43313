"""Issue 17: ``bridge.EARLY_INDEX`` (C++ ``kFlagEarlyIndex``), and the mark checked before the
item's bytes are written.

Inside grappler the C++ side builds the item's index on a helper thread while Python parses the
bytes (``INDEX_IN_BACKGROUND``).  With ``EARLY_INDEX`` it starts that thread as soon as it has
written the bytes, before the fingerprint and the callback, with the flags the previous callback
set; a callback whose flags differ (another index switch, or early starts no longer allowed)
drops it and builds its own.  Checked through grappler on real graphs (Keras ResNet50, a
BERT-like training graph): the output bytes and the report are the same with the early start,
with the reference (started by the callback) and when the flags change between two calls (the
early index then dropped and counted); and a graph this optimizer already rewrote is still
recognised (grappler's second iteration), now before its bytes are written."""
import pytest

from npu_amp_tf import bridge
from test_precision_core import _build
from test_speed_paths import plugin_only_grappler, rewritten_counting

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpEarlyIndexCounts"), reason="library without the early index")


@pytest.fixture(autouse=True)
def _no_prefuse(monkeypatch):
    """The early index of the item as it came: an item the layer-norm
    fusion before the parse changes gets its index after it instead
    (tests/test_prefuse.py)."""
    from graph_passes.fusion import prefuse

    monkeypatch.setattr(prefuse, "PREFUSE", False)


def _run(cfg, mg, monkeypatch, **switches):
    for name, value in switches.items():
        monkeypatch.setattr(bridge, name, value)  # (undone after the test)
    return rewritten_counting(cfg, mg, b"test_early_index", bridge.early_index_counts)


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
def test_the_same_output_with_the_early_index_and_without(k2, name, monkeypatch):
    bridge.register()
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    # a first call sets the flags the next one starts its index with
    _run(cfg, mg, monkeypatch, EARLY_INDEX=True, INDEX_IN_BACKGROUND=True)
    early, early_rep, (started, dropped) = _run(cfg, mg, monkeypatch)
    assert (started, dropped) == (1, 0)  # started before the callback, and kept
    ref, ref_rep, (started, dropped) = _run(cfg, mg, monkeypatch, EARLY_INDEX=False)
    assert (started, dropped) == (1, 1)  # started with the previous flags, then dropped
    assert early == ref
    assert early_rep == ref_rep
    # the reference's flags allow no early start: the next call starts none
    again, _, counts = _run(cfg, mg, monkeypatch)
    assert counts == (0, 0) and again == ref
    # another index switch between two calls: the early index (built with the previous
    # flags) is dropped and built again with the callback's
    _run(cfg, mg, monkeypatch, EARLY_INDEX=True)
    fast_off, fast_off_rep, (started, dropped) = _run(cfg, mg, monkeypatch, FAST_INDEX=False)
    assert (started, dropped) == (1, 1)
    assert fast_off == ref and fast_off_rep == ref_rep
    # the background index off entirely (the reference of INDEX_IN_BACKGROUND)
    _run(cfg, mg, monkeypatch, FAST_INDEX=True)
    sync, sync_rep, (started, dropped) = _run(cfg, mg, monkeypatch, INDEX_IN_BACKGROUND=False)
    assert (started, dropped) == (1, 1)
    assert sync == ref and sync_rep == ref_rep


def test_a_rewritten_graph_is_recognised_before_its_bytes_are_written(k2, monkeypatch):
    """Two meta-optimizer iterations: the second hands back our own output, which carries the
    mark: skipped (counted as seen) without a callback and without an early index."""
    from tensorflow.python.grappler import tf_optimizer

    bridge.register()
    gd, fetches = _build("bert_like", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.meta_optimizer_iterations = \
        cfg.graph_options.rewrite_options.TWO
    monkeypatch.setattr(bridge, "EARLY_INDEX", True)
    bridge.clear_reports()
    tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_early_index_mark")  # (sets the flags)
    before = bridge.early_index_counts()
    bridge.clear_reports()  # (and the counters of stats())
    seen = bridge.stats().get("skipped_seen", 0)
    tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"test_early_index_mark")
    after = bridge.early_index_counts()
    rewritten = [r for r in bridge.last_reports() if r["status"] == "rewritten"]
    assert len(rewritten) == 1, bridge.last_reports()  # the first iteration only
    # one early index, for the first iteration's item; none for the marked one
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    assert bridge.stats().get("skipped_seen", 0) == seen + 1  # the marked graph, in C++


def test_only_the_callbacks_first_flags_keep_or_drop_the_early_index(k2, monkeypatch):
    """A later ``NpuAmpSinkFlags`` in the same callback (the pipeline's own call comes first; a
    test may set others once the index is in use) changes the flags but drops nothing."""
    bridge.register()
    gd, fetches = _build("bert_like", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    _run(cfg, mg, monkeypatch, EARLY_INDEX=True, INDEX_IN_BACKGROUND=True)
    ref, ref_rep, _ = _run(cfg, mg, monkeypatch)
    real = bridge.item_opdef_precheck

    def flip_then_check(sink, patch, device="CPU"):
        bridge._lib.NpuAmpSinkFlags(sink, bridge._sink_flags() & ~(4 | 16))  # noqa: SLF001
        bridge._lib.NpuAmpSinkFlags(sink, bridge._sink_flags())  # noqa: SLF001
        return real(sink, patch, device)
    monkeypatch.setattr(bridge, "item_opdef_precheck", flip_then_check)
    out, rep, (started, dropped) = _run(cfg, mg, monkeypatch)
    assert (started, dropped) == (1, 0)
    assert out == ref and rep == ref_rep
