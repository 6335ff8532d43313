"""Where the precision pass's casts sit decides what a training step holds:
an FP32 copy of a forward activation read only by the backward pass waits
for the gradient (``_delay_widening_casts``), and with BF16 the softmax
follows its producers (``lists.BF16_GRAY``).  Real tf.compat.v1 training
graphs, numerics checked against FP32 in TF."""
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from graph_passes.manager import run_passes
from npu_amp_tf.options import Options

F32, F16, BF16 = types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16
v1 = tf.compat.v1


def precision(gd, fetches, **params):
    opts = Options.from_kwargs(_env=False, **params)
    out, rep = run_passes(gd, ["precision"], options=opts, fetches=fetches, validate=True)
    again, rep2 = run_passes(out, ["precision"], options=opts, fetches=fetches, validate=True)
    assert again == out, "precision pass is not idempotent"
    assert rep2.summary["casts_inserted"] == 0
    return out, rep


def nodes(gd):
    return {n.name: n for n in gd.node}


def attention_step():
    """x ─► MatMul(wq) ─► Softmax ─► MatMul(wv) ─► loss, with tf.gradients
    for both weights (the softmax backward reads the softmax output)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 16], name="x")
        wq = tf.constant(np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16), name="wq")
        wv = tf.constant(np.linspace(1, -1, 256, dtype=np.float32).reshape(16, 16), name="wv")
        p = tf.nn.softmax(tf.matmul(x, wq, name="scores"), name="probs")
        out = tf.matmul(p, wv, name="ctx")
        loss = tf.reduce_sum(out * out, name="loss")
        grads = tf.gradients(loss, [wq, wv], name="gradients")
        tf.identity(grads[0], name="g_wq")
        tf.identity(grads[1], name="g_wv")
    return g.as_graph_def()


FETCHES = ["loss", "g_wq", "g_wv"]
#: the delay tests need a softmax backward that runs in FP32 (it reads an FP32 copy of the
#: BF16 softmax): its Sum is black on TF 2.15; on TF >= 2.21 BF16 Sum follows its producers
#: (lists.BF16_GRAY_REDUCTIONS) and the backward needs no FP32 copy at all
#: (test_precision_reductions), so these tests keep Sum black as a user would
BF16_SUM_BLACK = {"precision_mode": "allow_mix_precision_bf16", "custom_black_list": ["Sum"]}
FEED = {"x:0": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}


def run(gd, fetches=FETCHES, feed=FEED):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with v1.Session(graph=g) as s:
        return s.run([f + ":0" for f in fetches], feed)


def test_bf16_softmax_follows_producers_fp16_keeps_it_fp32():
    gd = attention_step()
    out, rep = precision(gd, FETCHES, precision_mode="allow_mix_precision_bf16")
    assert nodes(out)["probs"].attr["T"].type == BF16
    assert rep.decisions["probs"]["list"] == "gray"
    from graph_passes.precision.planner import Plan

    lst, why = Plan(Options.from_kwargs(_env=False, precision_mode="allow_mix_precision_bf16")).list_of("Softmax")
    assert lst == "gray" and why.startswith("BF16:")
    plan16 = Plan(Options.from_kwargs(_env=False, precision_mode="allow_mix_precision"))
    for op in ("Softmax", "Exp", "Expm1"):
        assert plan16.list_of(op)[0] == "black"
    assert Plan(Options.from_kwargs(_env=False, precision_mode="allow_mix_precision_bf16")).list_of("Exp")[0] == "gray"
    out16, rep16 = precision(gd, FETCHES, precision_mode="allow_mix_precision")
    assert nodes(out16)["probs"].attr["T"].type == F32
    assert rep16.decisions["probs"]["list"] == "black"
    # the user's own black entry wins over the BF16 relaxation
    outb, repb = precision(gd, FETCHES, precision_mode="allow_mix_precision_bf16",
                           custom_black_list=["Softmax"])
    assert nodes(outb)["probs"].attr["T"].type == F32
    ref = run(gd)
    for got, want in zip(run(out), ref):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2 * np.abs(want).max())


def test_fp32_copy_read_by_backward_waits_for_the_gradient():
    """The softmax backward runs in FP32 (its Sum is black here): the FP32 copy
    of the BF16 softmax output gets a control edge from the incoming
    gradient, so TF makes it in the backward pass, not right after the
    forward softmax."""
    gd = attention_step()
    out, rep = precision(gd, FETCHES, **BF16_SUM_BLACK)
    n = nodes(out)
    cast = n["probs/CastToFp32"]
    assert cast.input[0] == "probs" and cast.attr["DstT"].type == F32
    waits = [i[1:] for i in cast.input if i.startswith("^")]
    assert waits and all(w.startswith("gradients/") for w in waits), cast.input
    # every reader of the copy is in the backward pass, and one of them reads the awaited tensor
    readers = [m for m in out.node if "probs/CastToFp32" in m.input]
    assert readers and all(r.name.startswith("gradients/") for r in readers)
    assert any(any(i.split(":")[0] in waits for i in r.input) for r in readers)
    assert rep.summary["casts_delayed"] >= 1
    assert rep.decisions["probs/CastToFp32"]["waits_for"] == waits
    # the step runs (no cycle) and matches FP32 within BF16 tolerance
    ref = run(gd)
    for got, want in zip(run(out), ref):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2 * np.abs(want).max())
    # and TF does make the copy after the gradient it waits for
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(out, name="")
    md = v1.RunMetadata()
    cfg = v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    with v1.Session(graph=g, config=cfg) as s:
        s.run([f + ":0" for f in FETCHES], FEED,
              options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE), run_metadata=md)
    t = {}
    for dev in md.step_stats.dev_stats:
        for ns in dev.node_stats:
            t[ns.node_name] = (ns.all_start_micros, ns.all_start_micros + ns.all_end_rel_micros)
    assert "probs/CastToFp32" in t and "ctx" in t
    assert t["probs/CastToFp32"][0] >= max(t[w][1] for w in waits if w in t)
    assert t["probs/CastToFp32"][0] >= t["ctx"][0]  # after the forward pass's last matmul started


def test_delay_fp32_copies_off_leaves_casts_unordered():
    """``delay_fp32_copies=False``: the same graph as with the delay, minus
    the control edges (no Cast waits), and the same numbers."""
    gd = attention_step()
    on, rep_on = precision(gd, FETCHES, **BF16_SUM_BLACK)
    off, rep_off = precision(gd, FETCHES, **BF16_SUM_BLACK, delay_fp32_copies=False)
    assert rep_on.summary["casts_delayed"] >= 1 and rep_off.summary["casts_delayed"] == 0
    assert not any(i.startswith("^") for i in nodes(off)["probs/CastToFp32"].input)

    def strip(g):
        return {n.name: (n.op, [i for i in n.input if not i.startswith("^")]) for n in g.node}

    assert strip(on) == strip(off)
    for got, want in zip(run(off), run(on)):
        np.testing.assert_array_equal(got, want)


def test_no_delay_without_backward_or_inside_v1_loops():
    # inference: the FP32 copies feed forward readers that have no later input
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 16], name="x")
        w = tf.constant(np.ones((16, 16), np.float32), name="w")
        tf.identity(tf.nn.softmax(tf.matmul(x, w)), name="y")
    out, rep = precision(g.as_graph_def(), ["y"], precision_mode="allow_mix_precision")
    assert rep.summary["casts_delayed"] == 0
    assert not any(i.startswith("^") for m in out.node if m.op == "Cast" for i in m.input)
    # a v1 while loop anywhere in the graph: no control edge may cross a frame, none is added
    from tensorflow.python.ops import control_flow_util  # as tests/train_graphs.v1_loop_cond

    old = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(attention_step(), name="")
            w = tf.constant(np.eye(16, dtype=np.float32) * 1.5, name="lw")
            v1.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.matmul(h, w)),
                          [tf.constant(0), g.get_tensor_by_name("x:0")], name="loop")
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = old
    assert any(n.op == "Enter" for n in g.as_graph_def().node)
    out, rep = precision(g.as_graph_def(), FETCHES, **BF16_SUM_BLACK)
    assert nodes(out)["probs"].attr["T"].type == BF16 and "probs/CastToFp32" in nodes(out)
    assert rep.summary["casts_delayed"] == 0
    assert not any(i.startswith("^") for m in out.node if m.op == "Cast" for i in m.input)


def test_delayed_casts_in_grappler_session_keep_the_graph_acyclic():
    """Inside a Session grappler's dependency optimizer removes the gradient
    tuples' Identities first, so in a BERT-style block the FP32 copies of the
    softmax and of its incoming gradient feed ONE Mul: the two new Casts must
    not wait on each other (grappler rejected the cyclic graph and ran the
    original FP32 one)."""
    import npu_amp_tf
    from _combo_worker import _build_transformer

    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        feeds, loss, train = _build_transformer(tf, v1)
        init = v1.global_variables_initializer()
    losses, ran = {}, {}
    for label, cfg in (("bf16", npu_amp_tf.session_config(precision_mode="allow_mix_precision_bf16",
                                                             graph_level=0)),
                       ("fp32", v1.ConfigProto())):
        md = v1.RunMetadata()
        with v1.Session(graph=g, config=cfg) as s:
            s.run(init)
            losses[label] = s.run([loss, train], feeds, options=v1.RunOptions(output_partition_graphs=True),
                                  run_metadata=md)[0]
        ran[label] = [n for pg in md.partition_graphs for n in pg.node]
    mm = {n.attr["T"].type for n in ran["bf16"] if n.op.endswith("MatMul") or "BatchMatMul" in n.op}
    assert mm == {BF16}, mm
    assert any(n.op == "Cast" and any(i.startswith("^") for i in n.input) for n in ran["bf16"])
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=2.5e-2)


def two_attention_step(big_rows):
    """Two softmax branches feeding one loss: a big one ([big_rows, 256]) and
    a tiny one ([2, 2]); each softmax backward reads an FP32 copy of its
    BF16 softmax.  ``big_rows=None`` leaves the big branch's rows unknown."""
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        x = v1.placeholder(tf.float32, [big_rows, 256], name="x")
        t = v1.placeholder(tf.float32, [2, 2], name="t")
        w = tf.constant(rng.standard_normal((256, 256)).astype(np.float32) * 0.1, name="w")
        u = tf.constant(rng.standard_normal((2, 2)).astype(np.float32), name="u")
        big = tf.nn.softmax(tf.matmul(x, w, name="big_scores"), name="big")
        tiny = tf.nn.softmax(tf.matmul(t, u, name="tiny_scores"), name="tiny")
        loss = tf.add(tf.reduce_sum(tf.square(tf.matmul(big, w, name="big_out"))),
                      tf.reduce_sum(tf.square(tf.matmul(tiny, u, name="tiny_out"))), name="loss")
        grads = tf.gradients(loss, [w, u], name="gradients")
        tf.identity(grads[0], name="g_w")
        tf.identity(grads[1], name="g_u")
    return g.as_graph_def()


def test_small_fp32_copies_run_when_ready_large_ones_wait():
    """Only copies whose bytes matter wait: the tiny softmax's FP32 copy
    (16 bytes, far below 1% of the delayed copies' bytes) gets no control
    edge, the big one ([64, 256], 64 KiB) waits for its gradient; a copy of
    unknown size counts as large."""
    fetches = ["loss", "g_w", "g_u"]
    out, rep = precision(two_attention_step(64), fetches, **BF16_SUM_BLACK)
    n = nodes(out)
    assert n["big"].attr["T"].type == BF16 and n["tiny"].attr["T"].type == BF16
    big_waits = [i for i in n["big/CastToFp32"].input if i.startswith("^")]
    assert big_waits and all(w[1:].startswith("gradients/") for w in big_waits)
    assert not [i for i in n["tiny/CastToFp32"].input if i.startswith("^")]
    assert rep.summary["casts_delayed"] == 1
    assert "16 bytes" in rep.decisions["tiny/CastToFp32"]["not_delayed"]
    assert "waits_for" not in rep.decisions["tiny/CastToFp32"]
    feeds = {"x:0": np.random.RandomState(1).standard_normal((64, 256)).astype(np.float32),
             "t:0": np.random.RandomState(2).standard_normal((2, 2)).astype(np.float32)}

    for got, want in zip(run(out, fetches, feeds), run(two_attention_step(64), fetches, feeds)):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2 * np.abs(want).max())
    # rows unknown: the big copy's size is unknown, so it is never "small"; the tiny one is
    # then the only sized copy, and a lone copy is not compared with anything: both wait
    out_u, rep_u = precision(two_attention_step(None), fetches, **BF16_SUM_BLACK)
    nu = nodes(out_u)
    assert [i for i in nu["big/CastToFp32"].input if i.startswith("^")]
    assert [i for i in nu["tiny/CastToFp32"].input if i.startswith("^")]
    assert rep_u.summary["casts_delayed"] == 2
