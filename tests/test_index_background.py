"""Issue 17: the item's C++ index built on a helper thread while Python
parses the bytes (``bridge.INDEX_IN_BACKGROUND``, ``NpuAmpItemIndexStart``).

Through grappler on real graphs (Keras ResNet50, the BERT-like graph, a
Keras 2 transformer), FP16 and BF16: the same output bytes and report with
the thread and without.  The paths where nothing asks for the index (a graph
the memo answers, a graph with nothing to rewrite) end with the thread
joined and the process alive; the C++ side refuses a second start and a
start outside a callback."""
import json

import pytest
import tensorflow as tf

from npu_amp_tf import bridge
from test_precision_bulk import _library  # noqa: F401  (an autouse fixture: the library loaded)
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

tf1 = tf.compat.v1


def _run(monkeypatch, name, k2, on, mode="allow_mix_precision"):
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
        "precision_mode"].s = mode.encode()
    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", on)
    out, rep = optimize_rewritten(cfg, mg, name.encode())  # (memo and seen cleared first)
    return out, _strip_times(rep)


@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like", "keras_transformer_training"])
def test_the_same_output_with_and_without_the_thread(k2, monkeypatch, name, mode):
    # the callback's own start (an index started before the callback with an earlier
    # call's flags, bridge.EARLY_INDEX, is dropped by these flags: tests/test_bridge_early_index.py)
    monkeypatch.setattr(bridge, "EARLY_INDEX", False)
    # (the index of the item as it came: an item the layer-norm fusion before the parse changes
    # has its index started after that, by NpuAmpSinkUsePrefused, tests/test_prefuse.py)
    from graph_passes.fusion import prefuse

    monkeypatch.setattr(prefuse, "PREFUSE", False)
    starts = []
    real_lib = bridge._lib
    real = real_lib.NpuAmpItemIndexStart

    class _Lib:  # (counts the starts that took)
        def __getattr__(self, attr):
            return getattr(real_lib, attr)

    def start(sink):
        rc = real(sink)
        starts.append(rc)
        return rc

    lib = _Lib()
    lib.NpuAmpItemIndexStart = start
    monkeypatch.setattr(bridge, "_lib", lib)
    out_on, rep_on = _run(monkeypatch, name, k2, True, mode)
    assert starts and starts[0] == 0, starts
    n = len(starts)
    out_off, rep_off = _run(monkeypatch, name, k2, False, mode)
    assert len(starts) == n  # (off: not started)
    assert rep_on["summary"]["casts_inserted"] > 0
    assert out_on == out_off
    assert json.dumps(rep_on, default=str) == json.dumps(rep_off, default=str)


def test_nothing_asks_for_the_index(k2, monkeypatch):
    """The same graph twice (the second answered by the memo, or skipped as
    seen) and a graph without float math: the thread is joined, no crash."""
    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", True)
    gd, fetches = _graph("keras_resnet50_training", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    from tensorflow.python.grappler import tf_optimizer

    bridge.clear_reports()
    for _ in range(3):
        tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"again")
        bridge._lib.NpuAmpClearSeen()  # (the next call reaches Python: its memo answers)
    assert [r["status"] for r in bridge.last_reports()][-1] == "cached", bridge.last_reports()[-1]["status"]
    g = tf.Graph()
    with g.as_default():
        a = tf1.placeholder(tf.int32, [4], name="a")
        tf.identity(a * 2, name="out")
    mg2, cfg2 = plugin_only_grappler(g.as_graph_def(), ("out",))
    tf_optimizer.OptimizeGraph(cfg2, mg2, graph_id=b"ints")


def test_start_refused_outside_a_callback():
    assert bridge._lib.NpuAmpItemIndexStart(None) == 1
