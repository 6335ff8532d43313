"""Issue 17: ``bridge.EARLY_MIRROR`` (C++ ``kFlagEarlyMirror``, ``NpuAmpSinkTakeMirror``).

An item whose layer norms are fused in C++ before the parse (graph_passes/fusion/prefuse.py)
needs the gradient-region mirror loaded from its bytes (~2.3 ms on BERT-12).  After a callback
that ran that fusion, the C++ side starts loading the next item's mirror on a helper thread as
soon as it has written the bytes, so that the load overlaps the fingerprint and the callback's
entry; the fusion's run takes it instead of loading its own.  One it does not take (another kind
of graph came next, or the switch is off) is dropped, its load joined, when the callback ends.

Checked through grappler on real graphs (a BERT-base-like training graph, whose layer norms are
fused before the parse, and Keras ResNet50, which has none): the output bytes and the report are the
same with the early mirror, with the reference (the run loads its own) and across a change of
graph; the counters show which path ran, so that a test cannot pass with the mirror never used."""
import pytest

from graph_passes.fusion import prefuse
from npu_amp_tf import bridge
from real_models import bert_training_graph
from test_precision_core import _build
from test_speed_paths import plugin_only_grappler, rewritten_counting

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpEarlyMirrorCounts"), reason="library without the early mirror")


def _bert():
    """The BERT-base-like training graph (2 layers, small): its 5 layer norms and their gradients
    are fused in C++ before the parse (tests/test_prefuse.py)."""
    g, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
    return g.as_graph_def(), fetches


def _run(cfg, mg, monkeypatch, **switches):
    for name, value in switches.items():
        monkeypatch.setattr(bridge, name, value)  # (undone after the test)
    fused = prefuse.CHECKED[1]
    got = rewritten_counting(cfg, mg, b"test_early_mirror", bridge.early_mirror_counts)
    _run.fused = prefuse.CHECKED[1] - fused  # (fusions made before the parse)
    return got


def test_the_same_output_with_the_early_mirror_and_without(k2, monkeypatch):
    bridge.register()
    gd, fetches = _bert()
    mg, cfg = plugin_only_grappler(gd, fetches)
    # the reference: no early mirror, and the next call starts none
    _run(cfg, mg, monkeypatch, EARLY_MIRROR=False)
    ref, ref_rep, counts = _run(cfg, mg, monkeypatch)
    assert counts == (0, 0) and _run.fused == 5
    # switched on: this call sets the flags, the next one loads its mirror early and takes it
    _run(cfg, mg, monkeypatch, EARLY_MIRROR=True)
    early, early_rep, counts = _run(cfg, mg, monkeypatch)
    assert counts == (1, 1) and _run.fused == 5  # (the fusions made on the mirror taken)
    assert early == ref and early_rep == ref_rep
    # switched off with the flags still set: the mirror loaded early is not taken, but dropped
    off, off_rep, counts = _run(cfg, mg, monkeypatch, EARLY_MIRROR=False)
    assert counts == (1, 0)
    assert off == ref and off_rep == ref_rep


def test_a_graph_without_layer_norms_after_one_with_them(k2, monkeypatch):
    """The flags come from the previous callback: a Keras ResNet50 item after the BERT-like one
    has its mirror loaded for nothing; it is dropped, the output is the reference's, and the
    next item starts none."""
    bridge.register()
    bert, bert_fetches = _bert()
    resnet, resnet_fetches = _build("keras_resnet50_training", k2)
    mg_b, cfg_b = plugin_only_grappler(bert, bert_fetches)
    mg_r, cfg_r = plugin_only_grappler(resnet, resnet_fetches)
    ref, ref_rep, counts = _run(cfg_r, mg_r, monkeypatch, EARLY_MIRROR=False)
    _run(cfg_b, mg_b, monkeypatch, EARLY_MIRROR=True)  # (sets the flags)
    out, rep, counts = _run(cfg_r, mg_r, monkeypatch)
    assert counts == (1, 0)
    assert out == ref and rep == ref_rep
    again, _, counts = _run(cfg_r, mg_r, monkeypatch)
    assert counts == (0, 0) and again == ref


def test_no_early_mirror_while_the_fusion_before_the_parse_does_not_run(k2, monkeypatch):
    """``graph_level`` 0 (no fusion pass): the BERT-like item could be fused before the parse
    (it has candidates) but the run never asks for the mirror, so the items after it load none
    (the callback says so at its end, ``NpuAmpNextFlags``)."""
    bridge.register()
    gd, fetches = _bert()
    mg, cfg = plugin_only_grappler(gd, fetches)
    _run(cfg, mg, monkeypatch, EARLY_MIRROR=True)  # (fused: sets the flags)
    cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["graph_level"].i = 0
    _, rep, counts = _run(cfg, mg, monkeypatch)
    assert counts == (1, 0) and _run.fused == 0  # loaded on the previous call's say, not taken
    _, _, counts = _run(cfg, mg, monkeypatch)
    assert counts == (0, 0)
