"""dump / compare / tune-mixlist / profile on TF1 *training* MetaGraphs.

The models are real ``tf.compat.v1`` training scripts (tf1.layers + Adam with
resource variables, TF-Slim + Momentum with ref variables, AMP_Optimizer with
dynamic loss scaling, a v1 while_loop / cond), exported as a user exports them
(``Saver.export_meta_graph``, ``Saver.save``): see tests/train_graphs.py.
Expected values come from plain TF sessions on the same files, never from the
tools.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

import train_graphs as tg

tf1 = tf.compat.v1


def _options(mode="allow_mix_precision"):
    from npu_amp_tf.options import Options

    return Options.from_kwargs(_groups=("rewrite",), _env=False, precision_mode=mode)


def _plain_session(meta, ckpt, feed, fetches):
    """The user's own way: import_meta_graph, initializers or Saver.restore, run."""
    g = tf.Graph()
    with g.as_default(), tf1.Session(graph=g) as s:
        saver = tf1.train.import_meta_graph(meta)
        s.run(tf1.global_variables_initializer())
        if ckpt:
            saver.restore(s, ckpt)
        return s.run(fetches, {g.get_tensor_by_name(k): v for k, v in feed.items()})


@pytest.fixture(scope="module")
def adam(tmp_path_factory):
    return tg.layers_adam(str(tmp_path_factory.mktemp("adam")), checkpoint=True)


def test_loader_keeps_resource_variables_and_trains(adam):
    from npu_amp_tf.tools import ToolError, load_model, runnable
    from npu_amp_tf.tools.model_io import StepSession

    meta, ckpt, feed = adam
    m = load_model(meta, outputs=["loss", "train"])
    for c in (ckpt, None):
        run = runnable(m, checkpoint=c)
        assert run.training and "conv1/kernel/Adam" in run.variables
        assert {n.op for n in run.graph_def.node} >= {"VarHandleOp", "ResourceApplyAdam"}
        (want0,) = _plain_session(meta, c, feed, ["loss:0"])
        with StepSession(run.graph_def, run.variables) as s:
            first = s.run(["loss:0", "train:0"], feed)
            second = s.run(["loss:0", "train:0"], feed)
            s.reset()
            again = s.run(["loss:0"], feed)
        assert first[1] is None  # the train op ran as a target
        np.testing.assert_allclose(first[0], want0, rtol=1e-6)
        assert abs(second[0] - first[0]) > 1e-4  # the step updated the weights
        np.testing.assert_allclose(again[0], first[0], rtol=1e-6)
    with pytest.raises(ToolError, match="does not exist"):
        runnable(m, checkpoint=ckpt + "-missing")


def test_dump_compare_training_step_resource_adam_with_checkpoint(adam, tmp_path):
    from npu_amp_tf.tools import compare, dump, load_model, runnable

    meta, ckpt, feed = adam
    run = runnable(load_model(meta, outputs=["train", "loss"]), checkpoint=ckpt)
    md = dump(run, feed, str(tmp_path / "d"), _options(), progress=False)
    assert md["training_step"] and md["weights_from"].startswith("checkpoint")
    t = md["tensors"]
    # forward in FP16, backward (gradients of the conv) dumped and in FP16 too
    assert t["conv1/Conv2D:0"]["mixed_dtype"] == "float16"
    grads = [k for k, v in t.items() if v["op"] == "Conv2DBackpropFilter"]
    assert grads and all(t[k]["mixed_dtype"] == "float16" for k in grads)
    assert md["not_dumped"] == {"fp32": {}, "mixed": {}}
    fp32 = np.load(tmp_path / "d" / "fp32.npz")
    (want,) = _plain_session(meta, ckpt, feed, ["loss:0"])
    np.testing.assert_allclose(fp32["loss:0"], want, rtol=1e-6)
    res = compare(str(tmp_path / "d"))
    assert res.overflow is None
    loss = [r for r in res.outputs if r["tensor"] == "loss:0"][0]
    assert 0 < loss["max_rel_err"] < 2e-2  # FP16 forward: ~1e-3 relative on a cross-entropy of ~1


def test_dump_ref_variables_slim_momentum_from_initializers(tmp_path):
    from npu_amp_tf.tools import dump, load_model, runnable

    meta, _, feed = tg.slim_momentum(str(tmp_path / "m"))
    run = runnable(load_model(meta, outputs=["train"]))
    assert run.weights_from == "initializers" and run.training
    assert {n.op for n in run.graph_def.node} >= {"VariableV2", "ApplyMomentum"}
    assert "VarHandleOp" not in {n.op for n in run.graph_def.node}
    md = dump(run, feed, str(tmp_path / "d"), _options(), progress=False)
    fp32, mixed = np.load(tmp_path / "d" / "fp32.npz"), np.load(tmp_path / "d" / "mixed.npz")
    (want,) = _plain_session(meta, None, feed, ["train:0"])  # slim's train op returns the loss
    np.testing.assert_allclose(fp32["train:0"], want, rtol=1e-6)
    assert md["tensors"]["conv1/Conv2D:0"]["mixed_dtype"] == "float16"
    assert mixed["conv1/Conv2D:0"].dtype == np.float16
    assert any(k.startswith("gradients/") for k in md["tensors"])


def test_compare_finds_overflow_in_amp_training_step_and_loss_scaling_runs(tmp_path):
    from npu_amp_tf.tools import compare, dump, load_model, runnable
    from npu_amp_tf.tools.model_io import StepSession, rewrite_runnable

    meta, ckpt, feed = tg.amp_overflow(str(tmp_path / "m"), checkpoint=True)
    run = runnable(load_model(meta, outputs=["train_step", "loss"]), checkpoint=ckpt)
    md = dump(run, feed, str(tmp_path / "d"), _options(), progress=False)
    res = compare(str(tmp_path / "d"))
    assert res.overflow["node"] == "big/MatMul" and res.overflow["mixed_dtype"] == "float16"
    # the skip branch is a control-flow-v2 cond: its body is named, not silently missing
    assert any("function" in why for why in md["not_dumped"]["mixed"].values())

    # the loss-scaling ops ran as in the job: FP32 applies, the mixed step skips and halves the scale
    def after_step(gd):
        with StepSession(gd, run.variables) as s:
            with s.graph.as_default():
                reads = [tf.raw_ops.ReadVariableOp(resource=s.graph.get_tensor_by_name(v + ":0"), dtype=tf.float32)
                         for v in ("w_small", "loss_scale/loss_scale")]
                reads.append(tf.raw_ops.ReadVariableOp(resource=s.graph.get_tensor_by_name("loss_scale/bad_steps:0"),
                                                       dtype=tf.as_dtype(run.variables["loss_scale/bad_steps"].dtype)))
            s.run(["train_step:0"], feed)
            return s.session.run(reads)

    w0, bad0 = run.variables["w_small"], int(run.variables["loss_scale/bad_steps"])
    w32, _, bad32 = after_step(run.graph_def)
    w16, _, bad16 = after_step(rewrite_runnable(run, _options())[0])
    assert not np.array_equal(w32, w0) and bad32 == bad0
    np.testing.assert_array_equal(w16, w0)  # bit-identical: the step was skipped
    assert bad16 == bad0 + 1  # the overflow counted by the dynamic loss scale (decreases every 2nd, CANN)


def test_tune_mixlist_on_training_step(tmp_path):
    """On an Ascend-style script: NPULossScaleOptimizer + ExponentialUpdateLossScaleManager."""
    from npu_amp_tf.tools import ToolError, load_model, runnable, tune_mixlist

    meta, _, feed = tg.amp_overflow(str(tmp_path / "m"), npu=True)
    run = runnable(load_model(meta, outputs=["train_step", "loss"]))
    res = tune_mixlist(run, feed, rtol=1e-2, options=_options(), progress=False)
    assert res.default_err == float("inf") and res.black_add == ["MatMul"]
    assert 0 <= res.final_err < 1e-2
    with pytest.raises(ToolError, match="no float output"):
        tune_mixlist(runnable(load_model(meta, outputs=["train_step"])), feed, rtol=1e-2, progress=False)


def test_profile_training_step_low_precision_share(adam, tmp_path):
    from npu_amp_tf.tools import load_model, profile_graph, runnable
    from npu_amp_tf.tools.model_io import rewrite_runnable

    meta, ckpt, feed = adam
    run = runnable(load_model(meta, outputs=["train"]), checkpoint=ckpt)
    for mode, low in (("must_keep_origin_dtype", False), ("allow_mix_precision", True)):
        gd, _ = rewrite_runnable(run, _options(mode))
        s = profile_graph(gd, feed, ["train"], 1, str(tmp_path / mode), progress=False,
                          variables=run.variables)
        assert (s["lp_compute_share"] > 0) is low
        assert s["peak_bytes"] > 0
        ops = {t["op"] for t in s["top_ops"]} | set()
        events = json.load(open(tmp_path / mode / "timeline.json"))["traceEvents"]
        names = {e.get("args", {}).get("op") for e in events}
        assert "ResourceApplyAdam" in names or "ResourceApplyAdam" in ops  # the backward + apply ran


def test_dump_v1_while_and_cond_bodies(tmp_path):
    from npu_amp_tf.tools import compare, dump, load_model, runnable

    meta, _, feed = tg.v1_loop_cond(str(tmp_path / "m"))
    run = runnable(load_model(meta, outputs=["train", "loss"]))
    md = dump(run, feed, str(tmp_path / "d"), _options(), progress=False)
    t = md["tensors"]
    assert t["loop/step:0"]["executions"] == 3 and t["loop/step:0"]["mixed_dtype"] == "float16"
    fp32 = np.load(tmp_path / "d" / "fp32.npz")
    # the last iteration: x @ (1.5 I)^3
    np.testing.assert_allclose(fp32["loop/step:0"], feed["x:0"] * 1.5 ** 3, rtol=1e-6)
    assert "branch/pos:0" in t
    assert "untaken cond branch" in md["not_dumped"]["fp32"]["branch/neg:0"]
    res = compare(str(tmp_path / "d"))
    assert res.overflow is None
    from npu_amp_tf.tools import format_table
    assert "branch/neg:0" in format_table(res)


def test_dump_names_loop_tensors_it_cannot_capture(tmp_path):
    """Inside a v1 while body a tensor the debugger got no value for (oneDNN
    fuses the FP32 Conv2D + BiasAdd in the Session) cannot be fetched either:
    it is named in not_dumped with its loop frame, never skipped silently."""
    from npu_amp_tf.tools import dump, load_model, runnable

    meta, _, feed = tg.v1_loop_conv(str(tmp_path / "m"))
    run = runnable(load_model(meta, outputs=["train", "loss"]))
    md = dump(run, feed, str(tmp_path / "d"), _options(), progress=False)
    g = tf.Graph()
    with g.as_default():
        tf1.train.import_meta_graph(meta)
    floats = {t.name for op in g.get_operations() if op.type not in ("NoOp", "Assert")
              for t in op.outputs if t.dtype.base_dtype in (tf.float32, tf.float16, tf.bfloat16)}
    for label, dt in (("fp32", "fp32_dtype"), ("mixed", "mixed_dtype")):
        got = {n for n, t in md["tensors"].items() if t[dt]} | set(md["not_dumped"][label])
        loop = {n for n in floats if n.startswith("loop/")}
        assert loop <= got, sorted(loop - got)  # every loop tensor: a value or a reason
    assert "loop/act:0" in md["tensors"] and md["tensors"]["loop/act:0"]["executions"] == 2
    for label in ("fp32", "mixed"):
        if "loop/conv:0" in md["not_dumped"][label]:
            assert "while_loop frame 'loop/while_context'" in md["not_dumped"][label]["loop/conv:0"]
        else:
            assert md["tensors"]["loop/conv:0"][f"{label}_dtype"]
    in_loop = [n for n, why in md["not_dumped"]["fp32"].items() if "while_loop frame" in why]
    assert all(n.startswith("loop/") for n in in_loop)


def test_cli_dump_and_profile_training_metagraph(adam, tmp_path):
    from test_cli import cli

    meta, ckpt, feed = adam
    np.savez(tmp_path / "in.npz", **feed)
    p = cli("dump", meta, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "d", "--outputs", "train,loss",
            "--checkpoint", ckpt, "--threads", "1", "--no-progress")
    assert "one training step" in p.stdout and "checkpoint" in p.stdout
    p = cli("profile", meta, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "p", "--outputs", "train",
            "--steps", "1", "--no-progress", "--precision-mode", "must_keep_origin_dtype")
    assert json.load(open(tmp_path / "p" / "summary.json"))["lp_compute_share"] == 0


def test_activation_estimate_counts_step_tensors_only():
    """The report's activation bytes: a variable's initializer, its reads and
    their casts, and aliasing ops are not activations; what the step computes
    from the feed is.  Expected values by hand: x[4,8] @ w[8,8] -> [4,8]."""
    import npu_amp_tf

    g = tf.Graph()
    with g.as_default(), tf1.variable_scope("", use_resource=True):
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        w = tf1.get_variable("w", [8, 8], initializer=tf1.truncated_normal_initializer(stddev=0.1))
        h = tf.nn.relu(tf.matmul(x, w, name="mm"), name="r")
        tf.identity(tf.identity(h), name="y")
        tf1.global_variables_initializer()
    out, rep = npu_amp_tf.rewrite_graph(g.as_graph_def(), fetches=["y", "init"], graph_level=0)
    s = rep.summary
    assert s["activation_bytes_sum_before"] == 2 * (4 * 8 * 4)  # mm, r in FP32; not the [8,8] initializer ops
    # mm, r in FP16 (2 x 64 B) + x cast to FP16 (64 B) + at most one [4,8] FP32 cast back (128 B);
    # the [8,8] weight cast (128 B) would exceed this
    assert 3 * 64 <= s["activation_bytes_sum_after"] <= 3 * 64 + 128
    # the step's peak: one [4,8] FP32 buffer (128 B): Relu writes into mm's buffer, which dies there (TF's
    # buffer forwarding); the initializer's three [8,8] FP32 tensors (768 B) are not step memory
    assert s["activation_bytes_before"] == 128


def test_profile_peak_is_allocated_bytes_not_outputs(tmp_path):
    """peak_bytes replays TF's allocation records: buffers are freed after
    their last use, an Identity allocates nothing, so a chain of four
    [256,256] FP32 ops peaks at two 256 KiB buffers at most (an op's input and
    output), not at the 1 MiB of their outputs summed (TF's timeline counter
    keeps each output from creation to last use and counts aliases too)."""
    from npu_amp_tf.tools import profile_graph

    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [256, 256], name="x")
        y = tf.multiply(x, 2.0, name="y")      # new buffer (x is the feed's)
        z = tf.add(y, 1.0, name="z")           # takes over y's buffer
        tf.reduce_sum(tf.identity(tf.nn.relu(z)), name="s")  # relu takes over z's; identity aliases
    one = 256 * 256 * 4
    s = profile_graph(g.as_graph_def(), {"x:0": np.ones((256, 256), np.float32)}, ["s:0"], 1,
                      str(tmp_path / "p"), progress=False)
    assert one <= s["peak_bytes"] <= 2 * one
