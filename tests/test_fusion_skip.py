"""Issue 17e: the fusion pass's shortcuts change nothing.

* ``FusionPass.skip_untouched``: a rule that declares what it reads
  (``FusionRule.reads``) is not run again in a later sweep when no change
  since its last run reaches a node it reads.  Each real graph is rewritten
  with it and with the reference (``skip_untouched = False``: every rule runs
  again after any change); the GraphDefs must be byte-identical (deterministic
  serialisation) and the reports equal (timings aside), and rules must have
  been skipped, so the comparison is not vacuous.
* ``find_matches`` visits only the anchors a rarer inner position can reach
  (``pattern._candidates``): every anchor at which ``match_at`` matches is a
  candidate, for every registered rule on real graphs, and ``find_matches``
  returns what a visit of every node in topological order returns.
"""
import pytest
import tensorflow as tf

import npu_amp_tf
from graph_passes import pattern, shapes
from graph_passes.fusion import RULES, register_fusion_rule, unregister_fusion_rule
from graph_passes.fusion import builtin, fusion_pass, grad_region, prefuse
from graph_passes.graph import Graph
from test_precision_fast import _strip_times, slim_resnet_graph
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

tf1 = tf.compat.v1

MODES = {
    "fp16": dict(precision_mode="allow_mix_precision"),
    "bf16": dict(precision_mode="allow_mix_precision_bf16"),
    "bf16_l3": dict(precision_mode="allow_mix_precision_bf16", graph_level=3),
}


#: the fusion pass's shortcuts (issue 17e, 17g): True each in the optimized
#: path, False in the reference (and ``pattern.PREDICATE_CANDIDATES``,
#: ``grad_region.STOP_AT_DY``, ``pattern.INNER_FILTER``,
#: ``shapes.FAST_TENSOR_DECODE``, ``builtin.NORM_MEMO`` (17i),
#: ``pattern.RAREST_MEMO``)
SHORTCUTS = ("skip_untouched", "share_shapes")


def _rewrite(monkeypatch, gd, fetches, skip, kw):
    """(GraphDef bytes, report without timings, [(sweep, rule) skipped]);
    ``skip`` False: the reference (every shortcut off)."""
    for flag in SHORTCUTS:
        monkeypatch.setattr(fusion_pass.FusionPass, flag, skip)
    monkeypatch.setattr(pattern, "PREDICATE_CANDIDATES", skip)
    monkeypatch.setattr(grad_region, "STOP_AT_DY", skip)
    monkeypatch.setattr(pattern, "INNER_FILTER", skip)
    monkeypatch.setattr(shapes, "FAST_TENSOR_DECODE", skip)
    monkeypatch.setattr(builtin, "NORM_MEMO", skip)
    monkeypatch.setattr(pattern, "RAREST_MEMO", skip)
    # (both arms: the bias family matched per anchor in FP16 too, so that its FP16 skips exercise
    # skip_untouched; builtin.FUSED_KERNEL_POLICY, which takes it off there, has its own test)
    monkeypatch.setattr(builtin, "FUSED_KERNEL_POLICY", False)
    # (the layer-norm rule run by the pass, in its sweep 1: not before the parse, prefuse.py)
    monkeypatch.setattr(prefuse, "PREFUSE", False)
    passes = []
    orig = fusion_pass.FusionPass.run

    def run(self, graph, ctx):
        passes.append(self)
        return orig(self, graph, ctx)

    monkeypatch.setattr(fusion_pass.FusionPass, "run", run)
    out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, **kw)
    monkeypatch.setattr(fusion_pass.FusionPass, "run", orig)
    skipped = [s for p in passes for s in getattr(p, "skipped_runs", [])]
    return out.SerializeToString(deterministic=True), _strip_times(rep.to_json()), skipped


def assert_skips_change_nothing(monkeypatch, gd, fetches, modes):
    """Per mode: skipping equals the reference; returns the runs skipped."""
    skipped_all = []
    for mode in modes:
        fast_gd, fast_rep, skipped = _rewrite(monkeypatch, gd, fetches, True, MODES[mode])
        ref_gd, ref_rep, ref_skipped = _rewrite(monkeypatch, gd, fetches, False, MODES[mode])
        assert fast_rep["summary"].get("failed_pass") is None, fast_rep["warnings"][:3]
        assert ref_skipped == []
        assert fast_gd == ref_gd, f"{mode}: skipping rules rewrote the graph differently"
        assert fast_rep == ref_rep, f"{mode}: skipping rules changed the report"
        skipped_all += skipped
    return skipped_all


# ------------------------------------------------------------- skip_untouched
def test_bert_like_training_graph_skips_equal_reference(monkeypatch):
    """LayerNorm fuses first in sweep 1 (with its gradient region), the bias
    family after it (BF16); sweep 2 runs only what those changes can reach:
    the rules they cannot reach are skipped there."""
    gd = bert_like_training_graph()
    skipped = assert_skips_change_nothing(monkeypatch, gd, ["loss", "train"], tuple(MODES))
    names = {r for _, r in skipped}
    assert {"bias_gelu_exact", "bias_act", "identity_chain", "cast_chain"} <= names, names
    assert all(sweep >= 2 for sweep, _ in skipped)


def test_keras_resnet50_skips_equal_reference(k2, monkeypatch):
    """BF16 under oneDNN fuses bias / batch-norm + Relu / residual units and
    the filter gradients: several rules change the graph in sweep 1."""
    gd = _keras_resnet_training_graph(k2)
    assert_skips_change_nothing(monkeypatch, gd, ["loss", "train"], ("fp16", "bf16"))


def test_slim_resnet_v1_50_skips_equal_reference(monkeypatch):
    pytest.importorskip("tf_slim", reason="tf_slim is not installed in this environment")
    gd, fetches = slim_resnet_graph()
    assert_skips_change_nothing(monkeypatch, gd, fetches, ("bf16", "bf16_l3"))


def keras3_transformer_training_graph():
    """A post-LN Keras 3 transformer layer (MultiHeadAttention, two
    LayerNormalization, GELU feed-forward) and its gradients in one
    ``tf.function`` step: (GraphDef, fetches).  Skips the test without Keras 3."""
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip(f"Keras 3 is not installed for TensorFlow {tf.__version__}")
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 16))
    att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inp, inp)
    h = keras.layers.LayerNormalization()(inp + att)
    f = keras.layers.Dense(16)(keras.layers.Dense(32, activation="gelu")(h))
    out = keras.layers.LayerNormalization()(h + f)
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Flatten()(out)))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        return [loss] + tape.gradient(loss, model.trainable_variables)

    gd = step.get_concrete_function(tf.TensorSpec([2, 8, 16], tf.float32, name="x"),
                                    tf.TensorSpec([2, 4], tf.float32, name="y")).graph.as_graph_def()
    fetches = [n.name for n in gd.node if n.op == "Identity" and n.name.startswith("Identity")]
    assert fetches and any(n.op == "Rsqrt" for n in gd.node)
    return gd, fetches


def keras_transformer_block_training_graph(k, batch=2, seq=8, d=16, heads=2):
    """A post-LN Keras 2 transformer block (MultiHeadAttention, two
    LayerNormalization, GELU feed-forward) trained by Adam, as a TF1 graph."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, seq, d], name="x")
        y = tf1.placeholder(tf.float32, [batch, seq, d], name="y")
        att = k.layers.MultiHeadAttention(num_heads=heads, key_dim=d // heads)(x, x)
        h = k.layers.LayerNormalization()(x + att)
        f = k.layers.Dense(d)(k.layers.Dense(2 * d, activation="gelu")(h))
        out = k.layers.LayerNormalization()(h + f)
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        tf1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
    return g.as_graph_def()


def test_keras_transformer_block_skips_equal_reference(k2, monkeypatch):
    """Keras 2 LayerNormalization (its own rule) and, at level 3, attention
    with its gradient region (``attention_train``)."""
    gd = keras_transformer_block_training_graph(k2)
    assert_skips_change_nothing(monkeypatch, gd, ["loss", "train"], tuple(MODES))


def test_a_wrong_declaration_misses_a_fusion_the_reference_makes(monkeypatch):
    """The comparison has teeth: a rule whose predicate reads one edge above
    its anchor but declares ``reads=0`` is skipped in sweep 2 after another
    rule changed that node, and misses the fusion the reference makes;
    declared ``reads=1`` it is run again and equals the reference."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        tf.identity(tf.nn.relu(tf.abs(x, name="abs"), name="relu"), name="out")
    gd = g.as_graph_def()

    def relu_after_sqrt(node, graph):  # reads the anchor's producer
        src = graph.input_node(node, 0)
        return src is not None and src.op == "Sqrt"

    def to_relu6(m, b):
        b.emit("Relu6", m.anchor, [b.anchor.input[0]], {"T": b.anchor.attr["T"]})

    def abs_to_sqrt(m, b):  # a test rewrite (not value-preserving): Abs -> Sqrt
        b.emit("Sqrt", m.anchor, [b.anchor.input[0]], {"T": b.anchor.attr["T"]})

    results = {}
    for reads in (0, 1):
        register_fusion_rule("t_relu_after_sqrt", pattern.Pat("Relu", predicate=relu_after_sqrt),
                             to_relu6, reads=reads)
        register_fusion_rule("t_abs_to_sqrt", pattern.Pat("Abs"), abs_to_sqrt, reads=0)
        try:
            for skip in (True, False):
                out, _, skipped = _rewrite(monkeypatch, gd, ["out"], skip, {"graph_level": 2})
                ops = {n.name: n.op for n in tf1.GraphDef.FromString(out).node}
                results[(reads, skip)] = (ops["relu"], skipped)
        finally:
            unregister_fusion_rule("t_relu_after_sqrt")
            unregister_fusion_rule("t_abs_to_sqrt")
    assert results[(0, False)][0] == results[(1, False)][0] == "Relu6"  # the reference fuses
    assert results[(1, True)][0] == "Relu6"
    assert results[(0, True)][0] == "Relu"  # wrongly skipped ...
    assert (2, "t_relu_after_sqrt") in results[(0, True)][1]  # ... in sweep 2


def test_reads_declaration_is_validated():
    with pytest.raises(ValueError, match="reads"):
        register_fusion_rule("t_bad_reads", pattern.Pat("Relu"), lambda m, b: None, reads=-1)
    assert "t_bad_reads" not in RULES


# ---------------------------------------------------------- anchor narrowing
def _graphs_for_narrowing(k2):
    yield "bert", bert_like_training_graph()
    yield "keras_resnet50", _keras_resnet_training_graph(k2)
    try:
        yield "slim_resnet_v1_50", slim_resnet_graph()[0]
    except ImportError:
        pass


def test_anchor_candidates_hold_every_match(k2):
    """On the raw graphs and on the graphs the pipeline wrote (LayerNorm,
    fused ops, casts present): for every registered rule, every anchor at
    which match_at matches (even with escaping inner tensors) is a candidate,
    and find_matches equals the visit of every node in topological order."""
    checked = narrowed = 0
    for name, gd in _graphs_for_narrowing(k2):
        fetches = ["loss", "train"]
        out, _ = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode="allow_mix_precision_bf16")
        for g in (Graph(gd), Graph(out)):
            for rule in RULES.values():
                pat = rule.pattern
                cands = pattern._candidates(g, pat)
                if cands is None:
                    continue
                narrowed += 1
                ops = pattern._anchor_ops(pat)
                for anchor in g.nodes_of_type(ops):
                    m = pattern.match_at(g, pat, anchor, escapes_ok=True)
                    if m is not None:
                        checked += 1
                        assert anchor in cands, (name, rule.name, anchor)
                for escapes in (False, True):
                    fast = pattern.find_matches(g, pat, escapes_ok=escapes)
                    ref = pattern.find_matches(g, pat, order=g.topo_order(), escapes_ok=escapes)
                    assert [(m.anchor, m.matched) for m in fast] == [(m.anchor, m.matched) for m in ref], \
                        (name, rule.name)
    assert narrowed > 10 and checked > 20, (narrowed, checked)


# ------------------------------------------------------------ shared shapes
def test_rule_runs_on_an_unchanged_graph_share_one_shape_oracle(monkeypatch):
    """``FusionPass.share_shapes`` (17g): the rule runs between two changes of
    the graph get the same ``ShapeOracle`` (its memo of producer-walked
    shapes), a change gets a fresh one, and the reference makes one per rule
    run; the graphs and reports of both are compared above."""
    from graph_passes.fusion import core

    gd = bert_like_training_graph()
    monkeypatch.setattr(prefuse, "PREFUSE", False)  # (the pass's own oracles only)
    counts = {}
    for share in (True, False):
        made = []
        orig_init = core.ShapeOracle.__init__

        def init(self, graph, _orig=orig_init, _made=made):
            _made.append((graph.version, fusion_pass._edit_mark(graph)))
            _orig(self, graph)

        monkeypatch.setattr(core.ShapeOracle, "__init__", init)
        monkeypatch.setattr(fusion_pass.FusionPass, "share_shapes", share)
        npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"], **MODES["bf16"])
        monkeypatch.setattr(core.ShapeOracle, "__init__", orig_init)
        counts[share] = made
    shared, ref = counts[True], counts[False]
    assert len(set(shared)) == len(shared), "one oracle per state of the graph when shared"
    assert len(ref) > len(shared) > 0, (len(ref), len(shared))


# ----------------------------------------------------- predicate candidates
def _norm_graphs():
    """LayerNorm / RMSNorm as plain ops in the forms analyze_norm knows, in
    one graph, with their gradients (a training graph) and look-alikes."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        w = tf1.get_variable("w", [8, 8])
        gamma = tf1.get_variable("gamma", [8], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [8], initializer=tf1.zeros_initializer())
        h = tf.matmul(x, w)
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        ln1 = (h - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta  # moments, rsqrt
        m2 = tf.reduce_mean(ln1, -1, keepdims=True)
        v2 = tf.reduce_mean(tf.square(ln1 - m2), -1, keepdims=True)
        ln2 = (ln1 - m2) / tf.sqrt(v2 + 1e-5) * gamma  # reduce_variance, sqrt/div, no beta
        rms = ln2 * tf.math.rsqrt(tf.reduce_mean(tf.square(ln2), -1, keepdims=True) + 1e-6) * gamma
        odd = tf.math.rsqrt(tf.abs(rms) + 1.0) * rms * 2.0 + 1.0  # an Rsqrt product, no norm
        # a training batch norm as moments over (0, 1, 2) (batch_norm_moments), with and
        # without scale/offset
        x4 = tf.reshape(odd, [2, 4, 2, 2])
        m4, v4 = tf.nn.moments(x4, axes=[0, 1, 2], keepdims=True)
        bn = tf.nn.batch_normalization(x4, m4, v4, tf.ones([2]), tf.zeros([2]), 1e-3)
        m5, v5 = tf.nn.moments(bn, axes=[0, 1, 2])
        bn2 = tf.nn.batch_normalization(bn, m5, v5, None, None, 1e-3)
        loss = tf.reduce_mean(tf.square(bn2), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g.as_graph_def()


@pytest.mark.parametrize("rule_name,least", [("layer_norm", 4), ("batch_norm_moments", 2)])
def test_norm_predicate_candidates_hold_every_node_it_accepts(k2, rule_name, least):
    """The LayerNorm and batch-norm rules' predicates narrow their anchors
    through a ``candidates`` hook (``builtin._norm_candidates``,
    ``batch_norm._candidates``): on plain-op norms of every form, the
    BERT-like, Keras ResNet50 and TF-Slim graphs, raw and rewritten, every
    node the predicate accepts is a candidate, and find_matches equals the
    visit of every node in topological order."""
    rule = RULES[rule_name]
    hook = rule.pattern.predicate.candidates
    accepted = 0
    graphs = [("norms", _norm_graphs())] + list(_graphs_for_narrowing(k2))
    for name, gd in graphs:
        out, _ = npu_amp_tf.rewrite_graph(gd, fetches=["loss", "train"], graph_level=1)
        for g in (Graph(gd), Graph(out)):
            cands = hook(g)
            for anchor in g.nodes_of_type(pattern._anchor_ops(rule.pattern)):
                if rule.pattern.predicate(g.nodes[anchor], g):
                    accepted += 1
                    assert anchor in cands, (name, anchor)
            fast = pattern.find_matches(g, rule.pattern, escapes_ok=True)
            ref = pattern.find_matches(g, rule.pattern, order=g.topo_order(), escapes_ok=True)
            assert [m.anchor for m in fast] == [m.anchor for m in ref], name
    assert accepted >= least, accepted
