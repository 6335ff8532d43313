"""Issue 17: the ``layer_norm`` rule's first run made in C++ before Python parses
the graph (custom_ops/grad_region.cc ``NormFuser``, graph_passes/fusion/prefuse.py),
and the grappler bridge putting its result into the item it holds
(``NpuAmpSinkUsePrefused``).

What must hold, on real training graphs and through grappler itself:

* the rewritten graph and the report are the same with the C++ run and
  without it (the Python rule doing all), node for node;
* the C++ run fused what the graph's builder put there (counts derived from
  the builders, not from the code under test), and each run is compared with
  the Python rule's own first run under the suite's ``CHECK_NATIVE``;
* where it must not run (a norm another rule matches, a node the unfuse pass
  may split) it does not, and where it stops early (a fetched anchor, a form
  only Python analyses) the Python rule does the rest, with the same result;
* a graph the pipeline hands back unchanged after the C++ run is grappler's
  item as it came (its own nodes put back);
* malformed requests and bytes get an answer, never a crash.
"""
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.training import saver as saver_lib

import npu_amp_tf
from graph_passes.fusion import grad_region as gr
from graph_passes.fusion import prefuse
from npu_amp_tf import bridge
from test_norm_plan import forms_training_graph, moments_training_graph
from test_precision_native import _graph

from conftest import assert_same


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    assert gr.native is not None and gr.native.can_fuse_norms


def _rewrite(gd, fetches, on, monkeypatch, **params):
    """(the rewritten graph's bytes, the report, fusions made before the parse)."""
    monkeypatch.setattr(prefuse, "PREFUSE", on)
    before = prefuse.CHECKED[1]
    params.setdefault("precision_mode", "allow_mix_precision")
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **params)
    return out.SerializeToString(deterministic=True), rep, prefuse.CHECKED[1] - before


def _same(on, off):
    assert_same(on[0], off[0], "the graphs with the C++ run before the parse and without")
    assert on[1].decisions == off[1].decisions
    assert on[1].pass_stats("fusion")["fused"] == off[1].pass_stats("fusion")["fused"]
    assert on[1].summary.get("fusions") == off[1].summary.get("fusions")


def _ops(data, op):
    return sum(n.op == op for n in graph_pb2.GraphDef.FromString(data).node)


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training", "keras_resnet50_training"])
def test_real_graphs_same_with_and_without(k2, monkeypatch, name):
    gd, fetches = _graph(name, k2)
    fetches = [f.split(":")[0] for f in fetches]
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    _same(on, off)
    assert off[2] == 0
    if name == "bert_like":  # the builder: one norm after the embeddings, two per layer (2 layers)
        assert on[2] == 5
        assert _ops(on[0], "LayerNorm") == 5 and _ops(on[0], "LayerNormGrad") == 5
    else:  # Keras 2's LayerNormalization is the FusedBatchNorm form (layer_norm_keras2); ResNet has none
        assert on[2] == 0


def test_forms_fused_up_to_the_one_python_analyses(monkeypatch):
    """One norm of each raw form: the C++ run fuses the forms before the
    Pow-2 variance (which only Python analyses) in topological order, the
    Python rule the rest, and the result is the Python rule's alone."""
    gd, fetches, _ = forms_training_graph()
    left = dict(prefuse.LEFT)
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    _same(on, off)
    fused = [k for k, v in on[1].decisions.items() if v.get("fusion") == "layer_norm"]
    assert len(fused) == 4  # (the builder: moments, reduce_variance, RMSNorm with and without gamma)
    assert 1 <= on[2] < 4  # (some before the Pow-2 form in the order, the rest in Python)
    assert prefuse.LEFT.get("a candidate's analysis is Python's", 0) > left.get("a candidate's analysis is Python's", 0)


def test_a_norm_another_rule_matches_is_left_alone(monkeypatch):
    """tf.nn.moments + batch_normalization is ``layer_norm_moments``' (a rule
    that runs before ``layer_norm``): the C++ run does not start."""
    gd, fetches = moments_training_graph()
    on = _rewrite(gd, fetches, True, monkeypatch)
    off = _rewrite(gd, fetches, False, monkeypatch)
    _same(on, off)
    assert on[2] == 0
    assert sum(v.get("fusion") == "layer_norm_moments" for v in on[1].decisions.values()) == 3
    assert any(k.endswith("may be a norm another norm rule matches") for k in prefuse.LEFT)


def test_a_fetched_anchor_ends_the_run_there(k2, monkeypatch):
    """A fetched norm output is refused by the rule (its outputs keep their
    form): the C++ run stops at it, keeps the fusions before it, and the
    Python rule words the refusal and fuses the rest."""
    gd, fetches = _graph("bert_like", k2)
    fetches = [f.split(":")[0] for f in fetches]
    anchors = [k for k, v in _rewrite(gd, fetches, False, monkeypatch)[1].decisions.items()
               if v.get("fusion") == "layer_norm"]
    fetched = sorted(anchors)[2]
    on = _rewrite(gd, fetches + [fetched], True, monkeypatch)
    off = _rewrite(gd, fetches + [fetched], False, monkeypatch)
    _same(on, off)
    assert 0 < on[2] < 4
    assert on[1].decisions[fetched].get("fusion_skipped") == "layer_norm"


def test_fused_ops_refuse_the_run(monkeypatch):
    """A node the unfuse pass may split (``_FusedMatMul``): no C++ run."""
    gd, fetches = _graph("bert_like", None)
    fetches = [f.split(":")[0] for f in fetches]
    node = gd.node.add()
    node.CopyFrom(next(n for n in gd.node if n.op == "MatMul"))
    node.name = "planted_fused"
    node.op = "_FusedMatMul"
    node.attr["fused_ops"].list.s.append(b"BiasAdd")
    node.attr["num_args"].i = 0
    before = prefuse.CHECKED[1]
    assert prefuse.run(gd.SerializeToString(), _ctx(fetches), ["unfuse", "fusion", "precision"]) is None
    assert prefuse.CHECKED[1] == before
    assert any("unfuse pass may split" in k for k in prefuse.LEFT)


def _ctx(fetches):
    from graph_passes.manager import PassContext
    from npu_amp_tf.options import Options

    return PassContext(Options.from_kwargs(precision_mode="allow_mix_precision"), fetches, (), ())


def _metagraph(g, fetches):
    mg = saver_lib.export_meta_graph(graph_def=g.as_graph_def(add_shapes=True), graph=g)
    coll = mg.collection_def["train_op"]
    for f in fetches:
        coll.node_list.value.append(f)
    return mg


def _config(**params):
    cfg = config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    for f in ("constant_folding", "arithmetic_optimization", "layout_optimizer", "remapping", "dependency_optimization",
              "loop_optimization", "function_optimization", "shape_optimization", "debug_stripper",
              "pin_to_host_optimization", "implementation_selector", "auto_mixed_precision",
              "auto_mixed_precision_mkl", "auto_mixed_precision_cpu", "scoped_allocator_optimization"):
        setattr(ro, f, off)
    ro.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    ro.disable_model_pruning = True
    ro.min_graph_nodes = -1
    ro.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    co = ro.custom_optimizers.add()
    co.name = "NpuAmpOptimizer"
    co.parameter_map["precision_mode"].s = b"allow_mix_precision"
    for k, v in params.items():
        co.parameter_map[k].s = str(v).encode()
    return cfg


def _bert_graph(layers=2):
    from real_models import bert_training_graph

    return bert_training_graph(layers=layers, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)


@pytest.mark.parametrize("background", [True, False])
def test_through_grappler_same_with_and_without(monkeypatch, background):
    """Inside grappler (the bridge puts the C++ run's graph into the item:
    the index, paint strings, OpDef pre-check and the patch's assembly then
    read it): the same output graph as the Python rule's, with the item's
    index built on a helper thread after the run or when asked."""
    monkeypatch.setattr(bridge, "INDEX_IN_BACKGROUND", background)
    g, fetches = _bert_graph()
    mg = _metagraph(g, fetches)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(prefuse, "PREFUSE", on)
        bridge.clear_reports()
        before = prefuse.CHECKED[1]
        out = tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse")
        rec = bridge.last_reports()[-1]
        assert rec["status"] == "rewritten", rec
        outs[on] = ({n.name: n for n in out.node}, prefuse.CHECKED[1] - before)
    assert outs[True][1] == 5 and outs[False][1] == 0  # (the builder: 1 + 2 per layer)
    assert set(outs[True][0]) == set(outs[False][0])
    assert [k for k in outs[True][0] if outs[True][0][k] != outs[False][0][k]] == []
    assert sum(n.op == "LayerNormGrad" for n in outs[True][0].values()) == 5


def test_a_graph_handed_again_is_answered_from_the_memo(monkeypatch):
    """The same graph handed to grappler again (a second session on it): the
    memo's patch is based on the item with the fusions put into it, so they
    are put into this item too, and the output is the first one."""
    g, fetches = _bert_graph()
    mg = _metagraph(g, fetches)
    monkeypatch.setattr(prefuse, "PREFUSE", True)
    bridge.clear_reports()
    before = prefuse.CHECKED[1]
    first = tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse_memo")
    again = tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse_memo")
    assert prefuse.CHECKED[1] - before == 5  # (one run: the second call is the memo's)
    assert [r["status"] for r in bridge.last_reports()] == ["rewritten", "cached"]
    assert again.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True)
    assert sum(n.op == "LayerNormGrad" for n in again.node) == 5


def test_no_index_of_the_item_as_it_came(monkeypatch):
    """An item the C++ run changes gets its index built after the run (the
    index of the item as it came would be thrown away): none started before
    the callback on the next call, and the same output as without the run."""
    g, fetches = _bert_graph()
    mg = _metagraph(g, fetches)
    monkeypatch.setattr(prefuse, "PREFUSE", True)
    outs = []
    for k in range(3):  # (the first call's flags say whether the second's starts early)
        bridge.clear_reports()
        before = bridge.early_index_counts()
        outs.append(tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse_index"))
        after = bridge.early_index_counts()
        if k:
            assert after[0] == before[0]  # (no early index of the item as it came)
    assert outs[0].SerializeToString(deterministic=True) == outs[1].SerializeToString(deterministic=True)
    monkeypatch.setattr(prefuse, "PREFUSE", False)
    bridge.clear_reports()
    ref = tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse_index")
    assert {n.name: n for n in ref.node} == {n.name: n for n in outs[1].node}


def test_candidates_read_from_the_bytes():
    """The pre-check that spares a graph without a candidate the mirror's
    load: an Rsqrt / Sqrt read by a Mul / RealDiv, and nothing else."""
    def graph(build):
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
            build(x)
        return g.as_graph_def().SerializeToString()

    lib = gr.native
    assert lib.norm_candidates(graph(lambda x: tf.math.rsqrt(x) * x)) is True
    assert lib.norm_candidates(graph(lambda x: x / tf.sqrt(x))) is True
    # (Adam's update: sqrt(v) + eps is read by the Add, not by the division)
    assert lib.norm_candidates(graph(lambda x: x / (tf.sqrt(x) + 1e-7))) is False
    assert lib.norm_candidates(graph(lambda x: tf.nn.relu(x))) is False
    assert lib.norm_candidates(b"\x0a\x05junk") is None
    assert prefuse.has_candidates(graph(lambda x: tf.nn.relu(x))) is False


def test_item_restored_when_python_leaves_the_graph(monkeypatch):
    """The pipeline fails after the C++ run (a bug in a pass, fail_on_error
    off): grappler's item is handed back as it came, its own nodes in their
    order, and runs."""
    from npu_amp_tf import pipeline

    g, fetches = _bert_graph()
    mg = _metagraph(g, fetches)
    monkeypatch.setattr(prefuse, "PREFUSE", True)

    def broken(graph, report):
        raise RuntimeError("planted")

    monkeypatch.setattr(pipeline, "summarize", broken)  # (after the passes: outside any pass)
    outs = {}
    for on in (True, False):  # (without the C++ run: the item grappler keeps, untouched)
        monkeypatch.setattr(prefuse, "PREFUSE", on)
        bridge.clear_reports()
        before = prefuse.CHECKED[1]
        outs[on] = tf_optimizer.OptimizeGraph(_config(fail_on_error="false"), mg, graph_id=b"prefuse_restore")
        assert prefuse.CHECKED[1] - before == (5 if on else 0)
        assert bridge.last_reports()[-1]["status"] == "error"
    out = outs[True]
    assert [n.name for n in out.node] == [n.name for n in outs[False].node]  # (every node, in order)
    assert out.SerializeToString(deterministic=True) == outs[False].SerializeToString(deterministic=True)
    assert not any(n.op in ("LayerNorm", "LayerNormGrad") for n in out.node)
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(out, name="")


def test_a_map_naming_other_nodes_is_refused(monkeypatch):
    """The fused graph's map names, for two kept nodes, each other's place in
    the item: ``NpuAmpSinkUsePrefused`` compares every kept node's name with
    the item's (read from the item's bytes) and refuses; the item stays as it
    came, Python parses its own bytes, and the output is the one without the
    run before the parse (the fusion pass's rule fuses the norms)."""
    import array

    g, fetches = _bert_graph()
    mg = _metagraph(g, fetches)
    answers = []
    real = bridge.item_use_prefused

    def swapped(sink, pre):
        index = array.array("i", pre.index)
        kept = [i for i, k in enumerate(index) if k >= 0]
        a, b = kept[3], kept[-3]
        index[a], index[b] = index[b], index[a]
        pre.index = index
        answers.append(real(sink, pre))
        return answers[-1]

    outs = {}
    for on in (True, False):
        monkeypatch.setattr(prefuse, "PREFUSE", on)
        monkeypatch.setattr(bridge, "item_use_prefused", swapped if on else real)
        bridge.clear_reports()
        outs[on] = tf_optimizer.OptimizeGraph(_config(), mg, graph_id=b"prefuse_swapped")
        assert bridge.last_reports()[-1]["status"] == "rewritten"
    assert answers == [False]
    assert outs[True].SerializeToString(deterministic=True) == outs[False].SerializeToString(deterministic=True)
    # (the fusion pass's own layer-norm rule then fused the norms, as without the run)
    assert sum(n.op == "LayerNormGrad" for n in outs[True].node) == 5


def test_bad_requests_never_crash():
    """Malformed requests and bytes get an answer (could not run, bad
    arguments), never a crash."""
    from graph_passes.fusion.grad_region import _op_sets

    gd, fetches = _graph("bert_like", None)
    data = gd.SerializeToString()
    lib = gr.native
    good = prefuse.request(_ctx(["loss", "train"]))
    sec = good.split(b"\x03")
    assert lib.fuse_norms(data, _op_sets(), good)[0] == 0
    assert lib.fuse_norms(data, _op_sets(), b"\x03".join(sec[:-1])) is None  # (too few sections: -1)
    assert lib.fuse_norms(data, _op_sets(), b"") is None
    assert lib.fuse_norms(b"\x0a\x05junk", _op_sets(), good) is None  # (the mirror refuses the bytes)
    no_kernels = b"\x03".join(sec[:4] + [b""] + sec[5:])
    rc, text, out, index = lib.fuse_norms(data, _op_sets(), no_kernels)
    assert rc == 0 and text.startswith("0\x03") and "no kernel known" in text and out == b""
    odd = b"\x03".join([b"\x02\x02x"] + [b"-5", b"1", b"TPU", b"\x01\x01", b"", b""])
    rc, text, out, index = lib.fuse_norms(data, _op_sets(), odd)
    assert rc in (0, 1)
