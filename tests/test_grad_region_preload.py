"""Issue 17: the gradient-region search's C++ mirror loaded on a helper thread
from when the fusion pass begins (``grad_region.PRELOAD``,
``NpuAmpGrMirrorLoadAsync`` / ``NpuAmpGrMirrorWait``).

Through grappler on real graphs (the BERT-like graph's plain-op layer norms,
a Keras 2 transformer's LayerNormalization, Keras ResNet50), FP16 and BF16:
the same output bytes and report with the preload and without, the preload
started exactly when a rule that searches gradient regions has candidates,
and the searches then run on the preloaded mirror.  A load the C++ side
refuses ends in the Python search with the same graph; a mirror dropped while
its thread loads ends with the thread joined (in a subprocess)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from graph_passes.fusion import fusion_pass as fpm
from graph_passes.fusion import grad_region as gr
from test_precision_bulk import _library  # noqa: F401  (an autouse fixture: the library loaded)
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run(monkeypatch, name, k2, on, mode="allow_mix_precision", spy=None):
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map[
        "precision_mode"].s = mode.encode()
    monkeypatch.setattr(gr, "PRELOAD", on)
    if spy is not None:
        monkeypatch.setattr(fpm, "preload", spy)
    out, rep = optimize_rewritten(cfg, mg, name.encode())  # (memo and seen cleared first)
    return out, _strip_times(rep)


class _Spy:
    """``grad_region.preload`` recording each answer and the mirror it kept;
    ``_Mirror.sync`` recording the mirrors the searches used."""

    def __init__(self, monkeypatch):
        self.started, self.kept, self.synced = [], [], []
        real_sync = gr._Mirror.sync

        def sync(mirror, graph, pos):
            self.synced.append(mirror)
            return real_sync(mirror, graph, pos)

        monkeypatch.setattr(gr._Mirror, "sync", sync)

    def __call__(self, graph):
        ok = gr.preload(graph)
        self.started.append(ok)
        self.kept.append(getattr(graph, gr._MIRROR_ATTR, None))
        return ok


@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
def test_the_same_output_with_and_without_the_preload(k2, monkeypatch, name, mode):
    spy = _Spy(monkeypatch)
    out_on, rep_on = _run(monkeypatch, name, k2, True, mode, spy)
    # started once (the main graph), and every search used that mirror
    assert spy.started == [True], spy.started
    assert spy.synced and all(m is spy.kept[0] for m in spy.synced)
    assert spy.kept[0].pending is None  # (waited for by the first search)
    fused = rep_on["summary"].get("fusions", 0)
    assert fused >= 2, rep_on["summary"]
    out_off, rep_off = _run(monkeypatch, name, k2, False, mode)
    assert out_on == out_off
    assert json.dumps(rep_on, default=str) == json.dumps(rep_off, default=str)


def test_not_started_without_candidates(k2, monkeypatch):
    """Keras ResNet50, FP16 and BF16: no rule that searches gradient regions
    has an anchor candidate inside grappler (its one Softmax feeds the
    fetched loss), so the preload is not even asked for."""
    spy = _Spy(monkeypatch)
    for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
        _run(monkeypatch, "keras_resnet50_training", k2, True, mode, spy)
    assert spy.started == [] and spy.synced == []


def test_a_rule_its_policy_turns_off_starts_nothing(monkeypatch):
    """The candidates of a rule whose policy gives a reason (it will not run)
    do not start the preload; the same rule without the policy does, and a
    rule that does not search gradient regions never does."""
    import types

    import tensorflow as tf

    from graph_passes.fusion.core import FusionRule
    from graph_passes.graph import Graph
    from graph_passes.pattern import Pat

    g1 = tf.Graph()
    with g1.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8], name="x")
        tf.nn.softmax(x * 2.0, name="probs")
    gd = g1.as_graph_def()
    ctx = types.SimpleNamespace(protected=frozenset())
    monkeypatch.setattr(gr, "PRELOAD", True)

    def started(**kw):
        g = Graph(gd)
        g.source_bytes = gd.SerializeToString()
        rule = FusionRule("t", Pat("Softmax"), lambda m, b: None, **kw)
        ok = fpm._preload_mirror(g, [rule], ctx)
        assert ok == bool(getattr(g, gr._MIRROR_ATTR, None))
        return ok

    assert started(searches_gradient=True, policy=lambda c, g: "off in this run") is False
    assert started(searches_gradient=False) is False
    assert started(searches_gradient=True) is True
    monkeypatch.setattr(gr, "PRELOAD", False)
    assert started(searches_gradient=True) is False


def test_a_refused_load_falls_back_to_the_python_search(monkeypatch):
    """Bytes the C++ side cannot read: the thread's load is refused, the first
    search finds that out (``NpuAmpGrMirrorWait``), marks the graph's mirror
    unusable and searches in Python: the same fused graph as the reference."""
    from graph_passes.graph import Graph
    from test_precision_native import bert_like_training_graph

    if not getattr(gr.native, "can_load_async", False):
        pytest.skip("the library has no NpuAmpGrMirrorLoadAsync")
    gd = bert_like_training_graph()
    fp_pass = fpm.FusionPass

    def fused(preload, corrupt):
        monkeypatch.setattr(gr, "PRELOAD", preload)
        g = Graph(gd)
        g.source_bytes = b"\x0a\xff\xff" if corrupt else gd.SerializeToString()
        fp_pass().run(g, None)
        return g, g.serialize()

    g_bad, out_bad = fused(True, True)
    assert getattr(g_bad, gr._MIRROR_ATTR) is False  # (refused at the first search)
    g_ref, out_ref = fused(False, False)
    assert getattr(g_ref, gr._MIRROR_ATTR)  # (the reference: the C++ search ran)
    assert out_bad == out_ref


def test_a_mirror_dropped_while_loading_joins_its_thread():
    """``NpuAmpGrMirrorFree`` right after the start (and a second start on a
    loading mirror) joins the thread: the process exits cleanly.  In a
    subprocess: a crash there must not take the test run with it."""
    code = textwrap.dedent("""
        import sys
        sys.path[:0] = [%r, %r]
        from npu_amp_tf import bridge
        bridge.library()
        from graph_passes.fusion import grad_region as gr
        from test_precision_native import bert_like_training_graph
        lib = gr.native
        assert lib is not None and lib.can_load_async
        data = bert_like_training_graph().SerializeToString()
        for _ in range(20):
            h = lib.new()
            assert lib.load_async(h, data) == 0
            assert lib.load_async(h, data) == 0  # (joins the first: then refused, a name twice)
            lib.free(h)
        h = lib.new()
        assert lib.load_async(h, data) == 0
        assert lib.wait(h) == 0 and lib.wait(h) == 0
        assert lib.load_async(h, data) == 0
        assert lib.wait(h) == 1  # (fresh: every name is there already)
        lib.free(h)
        print("ok")
    """) % (os.path.dirname(_HERE), _HERE)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
