"""Issue 17: ``bridge.EARLY_MIRROR`` (C++ ``kFlagEarlyMirror``, ``NpuAmpGrMirrorLoadEarly``).

Inside grappler the C++ side writes the item's bytes, then fingerprints them and calls Python,
whose first long step on a graph with layer norms is the run before the parse
(``graph_passes/fusion/prefuse.py``): it loads a gradient-region mirror of the bytes (~1.8 ms on
BERT-12) and fuses the norms in it.  With ``EARLY_MIRROR`` the C++ side looks for the rule's
candidates as soon as the bytes are written and, where there are some, loads the mirror on a
helper thread, from a copy of its own, while the main thread fingerprints and enters the
callback; the run takes that mirror instead of loading one, and Python reuses the candidates
answer instead of reading the bytes again.

Checked through grappler on graphs nobody here wrote the layers of (TF-Slim's ``layer_norm``
in an MLP, Keras 3's ``LayerNormalization`` / ``MultiHeadAttention`` block in a
``tf.function``; Keras 2's block has no candidate: its layer norm is a fused batch norm) and on the BERT-base-like training graph of ``benchmarks/precision.py``: the
output bytes and the report equal the reference's (the mirror loaded by the run), and the early
path ran (the library's counts and the run's); a graph without candidates (Keras ResNet50) gets
no mirror and the same output; a mirror the run does not take is freed; a load that fails leaves
the run to say so, as a refused load does; and the mirror reads only its own copy of the bytes
(the caller's buffer is overwritten as soon as the load has started)."""
import ctypes

import pytest

from graph_passes.fusion import grad_region as gr
from graph_passes.fusion import prefuse
from npu_amp_tf import bridge
import tensorflow as tf

from real_models import bert_training_graph, import_slim
from test_fusion_skip import keras3_transformer_training_graph
from test_precision_fast import _strip_times
from test_speed_paths import _keras_resnet_training_graph, optimize_rewritten, plugin_only_grappler

pytestmark = pytest.mark.skipif(
    not hasattr(bridge.library(), "NpuAmpSinkEarlyMirror") or gr.native is None
    or not getattr(gr.native, "can_fuse_norms", False),
    reason="library without the early mirror or the layer-norm rule in C++")


def _counts():
    """(mirrors the C++ side started, those no callback took, those a callback took and
    dropped because the run did not take them, runs that took one)"""
    started, dropped = bridge.early_mirror_counts()
    return started, dropped, bridge.EARLY_MIRRORS_DROPPED[0], prefuse.EARLY_MIRRORS[0]


def _run(cfg, mg, monkeypatch, on, tag=b"test_early_mirror"):
    """(output bytes, report, (mirrors started, dropped by the C++ side, dropped by the
    callback, taken by the run)) of one ``OptimizeGraph`` call with EARLY_MIRROR = ``on``,
    after a first call that sets the flags the C++ side reads before the next callback."""
    monkeypatch.setattr(bridge, "EARLY_MIRROR", on)
    optimize_rewritten(cfg, mg, tag)
    before = _counts()
    out, rep = optimize_rewritten(cfg, mg, tag)
    after = _counts()
    return out, _strip_times(rep), tuple(a - b for a, b in zip(after, before))


def _slim_layer_norm_graph():
    """A TF-Slim MLP with ``slim.layer_norm`` after each hidden layer (moments, then
    ``batch_normalization``'s Rsqrt), trained with SGD."""
    slim = import_slim()
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 16], name="x")
        y = tf1.placeholder(tf.int32, [4], name="y")
        h = x
        for i in range(2):
            h = slim.fully_connected(h, 32, scope=f"fc{i}")
            h = slim.layer_norm(h, scope=f"ln{i}")
        logits = slim.fully_connected(h, 10, activation_fn=None, scope="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def(), ["loss", "train"]


def _graph(name, k2):
    if name == "bert_like":
        g, fetches = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
        return g.as_graph_def(), fetches
    if name == "slim_layer_norm":
        return _slim_layer_norm_graph()
    if name == "keras3_transformer":
        return keras3_transformer_training_graph()
    return _keras_resnet_training_graph(k2), ["loss", "train"]


@pytest.mark.parametrize("name", ["bert_like", "slim_layer_norm", "keras3_transformer"])
def test_the_same_output_with_the_early_mirror_and_without(k2, name, monkeypatch):
    bridge.register()
    gd, fetches = _graph(name, k2)
    mg, cfg = plugin_only_grappler(gd, list(fetches))
    early, early_rep, counts = _run(cfg, mg, monkeypatch, True)
    assert counts == (1, 0, 0, 1)  # loaded before the callback, taken by the run
    ref, ref_rep, counts = _run(cfg, mg, monkeypatch, False)
    assert counts == (0, 0, 0, 0)
    assert early == ref
    assert early_rep == ref_rep
    # the run fused the norms in the mirror it took
    assert b"LayerNorm" in early


def test_a_graph_without_candidates_gets_no_mirror(k2, monkeypatch):
    """Keras ResNet50 has no layer norm: the C++ side looks, finds none and loads nothing; the
    callback takes its answer (no second read of the bytes) and the output is the reference's."""
    bridge.register()
    gd, fetches = _graph("keras_resnet50", k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    reads = []
    real = gr.native.norm_candidates

    def spy(data):
        reads.append(len(data))
        return real(data)

    monkeypatch.setattr(gr.native, "norm_candidates", spy)
    early, early_rep, counts = _run(cfg, mg, monkeypatch, True)
    assert counts == (0, 0, 0, 0)
    assert reads == [] or len(reads) == 1  # (the first call's, made before the flags were set)
    reads.clear()
    early, early_rep, counts = _run(cfg, mg, monkeypatch, True)
    assert reads == []  # the C++ side's answer, handed over: Python did not read the bytes
    _run(cfg, mg, monkeypatch, False)
    reads.clear()
    ref, ref_rep, counts = _run(cfg, mg, monkeypatch, False)
    assert counts == (0, 0, 0, 0)
    assert len(reads) == 2  # both calls' bytes read by Python
    assert early == ref and early_rep == ref_rep


def test_a_mirror_the_run_does_not_take_is_freed(monkeypatch):
    """The run loads its own (prefuse.EARLY_MIRROR off): the early mirror is dropped when the
    callback returns, and the output is the reference's."""
    bridge.register()
    gd, fetches = _graph("bert_like", None)
    mg, cfg = plugin_only_grappler(gd, list(fetches))
    ref, ref_rep, _ = _run(cfg, mg, monkeypatch, False)
    monkeypatch.setattr(prefuse, "EARLY_MIRROR", False)
    out, rep, counts = _run(cfg, mg, monkeypatch, True)
    assert counts == (1, 0, 1, 0)
    bridge.drain_deferred_frees()
    assert out == ref and rep == ref_rep


def _fused(data, h=None):
    lib = gr.native
    memo = lib.shape_memo()
    try:
        res = lib.fuse_norms(data, gr._op_sets(), prefuse.request(None), memo, h, loaded=h is not None)  # noqa: SLF001
    finally:
        lib.free_shape_memo(memo)
    return res


def _load_early(data_buffer, n):
    lib = bridge.library()
    lib.NpuAmpGrMirrorNew.restype = ctypes.c_void_p
    lib.NpuAmpGrMirrorLoadEarly.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.NpuAmpGrMirrorLoadEarly.restype = ctypes.c_int
    h = lib.NpuAmpGrMirrorNew()
    assert lib.NpuAmpGrMirrorLoadEarly(h, data_buffer, n) == 0
    return h


def test_the_early_load_reads_its_own_copy():
    """The caller's bytes are overwritten as soon as the load has started: the fusions made in
    that mirror equal those made in one loaded by the run itself."""
    g, _ = bert_training_graph(layers=2, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
    data = g.as_graph_def().SerializeToString()
    buf = ctypes.create_string_buffer(data, len(data))
    h = _load_early(buf, len(data))
    ctypes.memset(buf, 0, len(data))  # (the item's bytes, freed when the callback returns)
    try:
        early = _fused(data, h)
    finally:
        gr.native.free(h)
    ref = _fused(data)
    assert early is not None and ref is not None
    assert early[0] == 0 and int(early[1].split("\x03")[0]) >= 2  # ran, fused both layers' norms
    assert early[1:3] == ref[1:3] and list(early[3]) == list(ref[3])


def test_a_failed_early_load_is_refused_like_a_failed_load():
    """Bytes that are no GraphDef: the load fails on the helper thread, and the run's
    ``fuse_norms`` answers None (the mirror refused the graph), as for its own load."""
    junk = b"\x0a\xff\xff\xff\xff\x0f not a graph"
    buf = ctypes.create_string_buffer(junk, len(junk))
    h = _load_early(buf, len(junk))
    try:
        assert _fused(junk, h) is None
    finally:
        gr.native.free(h)
    assert _fused(junk) is None
