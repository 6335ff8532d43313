"""AMP_Optimizer (TF1 wrapper): overflow skip, growth, fixed scale, accumulation,
FP16 copies, fused check, global_step, checkpoints, convergence on digits."""
import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import (AMP_Optimizer, ExponentialUpdateLossScaleManager, FixedLossScaleManager,
                        NPULossScaleOptimizer, OptionError)
from npu_amp_tf.loss_scale import non_amp_variables
from npu_amp_tf.optimizer import FP16_COPIES_COLLECTION, fused_unscale_and_check

v1 = tf.compat.v1


def _graph_model(opt_fn, wrap=True, sparse=False, **amp):
    """A tiny regression graph: x·w + embedding lookup, loss × inf when `bad`."""
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        ids = v1.placeholder_with_default(tf.constant([0, 2], tf.int64), [None], name="ids")
        bad = v1.placeholder_with_default(False, [], name="bad")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=2))
        b = v1.get_variable("b", [3], initializer=v1.zeros_initializer())
        emb = v1.get_variable("emb", [5, 3], initializer=v1.random_normal_initializer(seed=3))
        y = tf.matmul(x, w) + b
        if sparse:
            y = y + tf.reduce_sum(tf.gather(emb, ids), 0)
        loss = tf.reduce_mean(tf.square(y - 1.0)) * tf.where(bad, np.float32(np.inf), 1.0)
        gs = v1.train.get_or_create_global_step()
        opt = opt_fn()
        if wrap:
            opt = AMP_Optimizer(opt, **amp)
        train = opt.minimize(loss, global_step=gs)
        init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
    return dict(g=g, x=x, bad=bad, loss=loss, train=train, opt=opt, gs=gs, init=init,
                w=w, b=b, emb=emb)


def _all_state(s, m):
    """Every global variable except the loss-scale state and the global step."""
    vs = [v for v in non_amp_variables(m["g"]) if v is not m["gs"]]
    return {v.op.name: val for v, val in zip(vs, s.run(vs))}


X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8.0


@pytest.mark.parametrize("opt_fn", [lambda: v1.train.AdamOptimizer(0.05),
                                    lambda: v1.train.MomentumOptimizer(0.05, 0.9)])
def test_overflow_at_step_k_skips_everything(opt_fn):
    m = _graph_model(opt_fn, sparse=True, incr_every_n_steps=1000)
    mgr = m["opt"].loss_scale_manager
    with v1.Session(graph=m["g"]) as s:
        s.run(m["init"])
        for _ in range(3):
            s.run(m["train"], {m["x"]: X})
        before = _all_state(s, m)
        assert any("Adam" in k or "Momentum" in k for k in before)  # slots exist
        if "w/Adam" in before:
            assert "beta1_power" in before and "beta2_power" in before
        # step k = 4: overflow -> variables, slots and beta powers bit-identical
        s.run(m["train"], {m["x"]: X, m["bad"]: True})
        after = _all_state(s, m)
        for k in before:
            np.testing.assert_array_equal(before[k], after[k], err_msg=k)
        st = mgr.state(s)
        assert st["loss_scale"] == 128.0 and st["overflow_count"] == 1 and st["skipped_steps"] == 1
        assert s.run(m["gs"]) == 4  # global_step advances on a skipped step
        # second overflow: hysteresis reached, scale halves; still nothing changes
        s.run(m["train"], {m["x"]: X, m["bad"]: True})
        assert mgr.state(s)["loss_scale"] == 64.0
        for k, val in _all_state(s, m).items():
            np.testing.assert_array_equal(before[k], val, err_msg=k)
        # training continues
        s.run(m["train"], {m["x"]: X})
        assert not np.array_equal(s.run(m["w"]), before["w"])
        assert np.isfinite(s.run(m["w"])).all()
        assert mgr.state(s)["skipped_steps"] == 2 and s.run(m["gs"]) == 6
    assert [(e.step, e.scale, e.overflow) for e in mgr.history] == [(4, 128.0, True), (5, 64.0, True)]


def test_skip_matches_a_run_without_the_bad_step():
    """Skipping is exact: 3 good + 1 overflow + 2 good == 5 good steps (same scale)."""
    res = []
    for pattern in ([0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0]):
        m = _graph_model(lambda: v1.train.AdamOptimizer(0.05), loss_scale_manager=256)
        with v1.Session(graph=m["g"]) as s:
            s.run(m["init"])
            for p in pattern:
                s.run(m["train"], {m["x"]: X, m["bad"]: bool(p)})
            res.append(_all_state(s, m))
    for k in res[1]:
        np.testing.assert_array_equal(res[0][k], res[1][k], err_msg=k)


def test_growth_after_n_good_steps_and_global_step_loop_terminates():
    m = _graph_model(lambda: v1.train.GradientDescentOptimizer(0.01),
                     init_loss_scale=32, incr_every_n_steps=3)
    with v1.Session(graph=m["g"]) as s:
        s.run(m["init"])
        scales, n = [], 0
        while s.run(m["gs"]) < 10:  # a loop that runs to a step count
            s.run(m["train"], {m["x"]: X, m["bad"]: n in (4, 5, 6)})
            scales.append(m["opt"].loss_scale_manager.state(s)["loss_scale"])
            n += 1
        assert n == 10
    # grow at 3, overflow 5,6 -> halve at 6, overflow 7 (bad=1), grow after 3 good (8,9,10)
    assert scales == [32, 32, 64, 64, 64, 32, 32, 32, 32, 64]


def test_fixed_scale_without_overflow_check_applies_everything():
    m = _graph_model(lambda: v1.train.GradientDescentOptimizer(0.01),
                     loss_scale_manager=FixedLossScaleManager(1024, enable_overflow_check=False))
    types = [op.type for op in m["g"].get_operations()]
    assert "IsFinite" not in types  # no check is built at all
    with v1.Session(graph=m["g"]) as s:
        s.run(m["init"])
        s.run(m["train"], {m["x"]: X})
        w1 = s.run(m["w"])
        assert np.isfinite(w1).all()
        s.run(m["train"], {m["x"]: X, m["bad"]: True})
        assert not np.isfinite(s.run(m["w"])).all()  # applied: that's what "no check" means
        st = m["opt"].loss_scale_manager.state(s)
        assert st["loss_scale"] == 1024 and st["skipped_steps"] == 0


def test_fixed_scale_with_check_and_fp32_unscaling_exact():
    """With SGD a scaled step equals the unscaled step bit-for-bit (scale = 2^k)."""
    out = []
    for wrap in (True, False):
        m = _graph_model(lambda: v1.train.GradientDescentOptimizer(0.1), wrap=wrap,
                         **({"loss_scale_manager": 4096} if wrap else {}))
        with v1.Session(graph=m["g"]) as s:
            s.run(m["init"])
            for _ in range(3):
                s.run(m["train"], {m["x"]: X})
            out.append(s.run([m["w"], m["b"]]))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_one_fused_finiteness_check_including_indexed_slices():
    m = _graph_model(lambda: v1.train.AdamOptimizer(0.1), sparse=True)
    ops = m["g"].get_operations()
    assert sum(op.type == "IsFinite" for op in ops) == 1
    assert sum(op.type == "All" for op in ops) == 1
    concat = [op for op in ops if op.type == "ConcatV2" and "IsFinite" in
              {c.type for o in op.outputs for c in o.consumers()} | {
                  c2.type for o in op.outputs for c in o.consumers() for c2 in
                  (cc for oo in c.outputs for cc in oo.consumers())}]
    assert concat and len(concat[0].inputs) == 4  # w, b, emb (IndexedSlices values) + axis
    # an inf only in the IndexedSlices gradient is caught
    grads = [tf.constant([1.0, 2.0]),
             tf.IndexedSlices(tf.constant([[np.inf, 1.0]]), tf.constant([1]), tf.constant([3, 2]))]
    out, finite = fused_unscale_and_check(grads, tf.constant(0.5))
    assert not bool(finite)
    assert isinstance(out[1], tf.IndexedSlices)
    np.testing.assert_array_equal(out[0].numpy(), [0.5, 1.0])
    np.testing.assert_array_equal(out[1].indices.numpy(), [1])


def test_compute_and_apply_gradients_are_unscaled_fp32():
    g = tf.Graph()
    with g.as_default():
        w = v1.get_variable("w", initializer=tf.constant([1.0, -2.0]))
        w16 = tf.cast(w, tf.float16)  # FP16 compute, FP32 master
        loss = tf.reduce_sum(tf.cast(w16 * w16, tf.float32))
        opt = AMP_Optimizer(v1.train.GradientDescentOptimizer(0.5), init_loss_scale=1024)
        gv = opt.compute_gradients(loss)
        assert gv[0][0].dtype == tf.float32 and gv[0][1] is w
        clipped = [(tf.clip_by_value(gr, -1.0, 1.0), v) for gr, v in gv]
        train = opt.apply_gradients(clipped)
        with v1.Session() as s:
            s.run(v1.global_variables_initializer())
            np.testing.assert_allclose(s.run(gv[0][0]), [2.0, -4.0])
            s.run(train)
            np.testing.assert_allclose(s.run(w), [0.5, -1.5])
            assert any(x is opt.variables()[-1] for x in v1.global_variables())


def test_gradient_accumulation_equivalence_fp32():
    """N micro-steps of batch B == one step of batch N*B (mean losses, FP32)."""
    rng = np.random.RandomState(0)
    data = rng.randn(12, 4).astype(np.float32)
    results = []
    for n, batches in ((3, np.split(data, 3)), (1, [data])):
        m = _graph_model(lambda: v1.train.AdamOptimizer(0.05), gradient_accumulation_steps=n)
        with v1.Session(graph=m["g"]) as s:
            s.run(m["init"])
            w0 = s.run(m["w"])
            for i, xb in enumerate(batches * 2):  # two applied updates
                s.run(m["train"], {m["x"]: xb})
                if n == 3 and i in (0, 1):
                    np.testing.assert_array_equal(s.run(m["w"]), w0)  # not applied yet
            results.append(_all_state(s, m))
            if n == 3:
                assert s.run(m["gs"]) == 6
    for k in results[1]:
        np.testing.assert_allclose(results[0][k], results[1][k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_overflow_in_a_micro_step_discards_the_accumulation():
    rng = np.random.RandomState(0)
    xs = [rng.randn(4, 4).astype(np.float32) for _ in range(4)]
    out = []
    for bad_first in (True, False):
        m = _graph_model(lambda: v1.train.GradientDescentOptimizer(0.1),
                         gradient_accumulation_steps=2, loss_scale_manager=64)
        with v1.Session(graph=m["g"]) as s:
            s.run(m["init"])
            w0 = s.run(m["w"])
            if bad_first:  # good micro-step, then an overflow: both discarded
                s.run(m["train"], {m["x"]: xs[0]})
                s.run(m["train"], {m["x"]: xs[1], m["bad"]: True})
                np.testing.assert_array_equal(s.run(m["w"]), w0)
                assert m["opt"].loss_scale_manager.state(s)["skipped_steps"] == 1
            s.run(m["train"], {m["x"]: xs[2]})
            s.run(m["train"], {m["x"]: xs[3]})
            out.append(s.run(m["w"]))
    np.testing.assert_array_equal(out[0], out[1])


def test_keep_fp16_copies_refreshed_after_applied_updates_only():
    m = _graph_model(lambda: v1.train.GradientDescentOptimizer(0.1), keep_fp16_copies=True)
    opt, g = m["opt"], m["g"]
    c = opt.fp16_copy(m["w"])
    assert c is not None and c.dtype == tf.float16 and c.op.name == "w/Fp16Copy"
    assert any(x is c for x in g.get_collection(FP16_COPIES_COLLECTION))
    # never checkpointed
    assert not any(x is c for x in g.get_collection(v1.GraphKeys.GLOBAL_VARIABLES))
    with v1.Session(graph=g) as s:
        s.run(m["init"][0])
        s.run(m["init"][1])  # local (copies) after global, as MonitoredSession does
        np.testing.assert_array_equal(s.run(c), s.run(m["w"]).astype(np.float16))
        s.run(m["train"], {m["x"]: X})
        w1 = s.run(m["w"])
        assert not np.array_equal(w1.astype(np.float16), s.run(m["w"].initial_value).astype(np.float16))
        np.testing.assert_array_equal(s.run(c), w1.astype(np.float16))
        s.run(m["train"], {m["x"]: X, m["bad"]: True})
        np.testing.assert_array_equal(s.run(c), w1.astype(np.float16))


def test_checkpoint_round_trip_both_directions(tmp_path):
    amp_ck, plain_ck = str(tmp_path / "amp"), str(tmp_path / "plain")
    m = _graph_model(lambda: v1.train.AdamOptimizer(0.05), decr_every_n_nan_or_inf=1)
    with v1.Session(graph=m["g"]) as s:
        s.run(m["init"])
        s.run(m["train"], {m["x"]: X})
        s.run(m["train"], {m["x"]: X, m["bad"]: True})  # scale 128 -> 64
        amp_state = _all_state(s, m)
        with m["g"].as_default():
            v1.train.Saver().save(s, amp_ck)
    # AMP checkpoint -> model without AMP (master weights + slots load)
    p = _graph_model(lambda: v1.train.AdamOptimizer(0.05), wrap=False)
    with v1.Session(graph=p["g"]) as s:
        with p["g"].as_default():
            v1.train.Saver().restore(s, amp_ck)
        for k, val in _all_state(s, p).items():
            np.testing.assert_array_equal(val, amp_state[k], err_msg=k)
        s.run(p["train"], {p["x"]: X})
        plain_state = _all_state(s, p)
        with p["g"].as_default():
            v1.train.Saver().save(s, plain_ck)
    # plain checkpoint -> AMP model (loss-scale state starts fresh)
    a = _graph_model(lambda: v1.train.AdamOptimizer(0.05))
    with v1.Session(graph=a["g"]) as s:
        s.run(a["init"])
        with a["g"].as_default():
            v1.train.Saver(var_list=non_amp_variables()).restore(s, plain_ck)
        for k, val in _all_state(s, a).items():
            np.testing.assert_array_equal(val, plain_state[k], err_msg=k)
        assert a["opt"].loss_scale_manager.state(s)["loss_scale"] == 128.0
    # AMP checkpoint -> AMP model: the saved scale is restored
    r = _graph_model(lambda: v1.train.AdamOptimizer(0.05))
    with v1.Session(graph=r["g"]) as s:
        with r["g"].as_default():
            v1.train.Saver().restore(s, amp_ck)
        st = r["opt"].loss_scale_manager.state(s)
        assert st["loss_scale"] == 64.0 and st["overflow_count"] == 1


def test_npu_alias_and_tf2_function_use():
    w = tf.Variable([1.0, 2.0])
    opt = NPULossScaleOptimizer(v1.train.AdamOptimizer(0.1),
                                ExponentialUpdateLossScaleManager(8, 2))
    assert isinstance(opt, v1.train.Optimizer)

    @tf.function
    def step(bad):
        loss = tf.reduce_sum(w * w) * tf.where(bad, np.float32(np.inf), 1.0)
        opt.minimize(loss, var_list=[w])

    step(tf.constant(False))
    w1 = w.numpy()
    m1 = opt.get_slot(w, "m").numpy()
    step(tf.constant(True))
    np.testing.assert_array_equal(w.numpy(), w1)
    np.testing.assert_array_equal(opt.get_slot(w, "m").numpy(), m1)
    step(tf.constant(False))
    assert not np.array_equal(w.numpy(), w1)
    st = opt.loss_scale_manager.state()
    assert st["overflow_count"] == 1 and st["steps"] == 3
    # eager, callable loss
    opt.minimize(lambda: tf.reduce_sum(w * w), var_list=[w])
    assert opt.loss_scale_manager.state()["steps"] == 4


def test_bad_options_raise_clear_errors():
    sgd = v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(OptionError, match=r"gradient_accumulation_steps=0.*accepted: an integer >= 1"):
        AMP_Optimizer(sgd, gradient_accumulation_steps=0)
    with pytest.raises(OptionError, match=r"allreduce_dtype='int8'.*float16"):
        AMP_Optimizer(sgd, allreduce_dtype="int8")
    with pytest.raises(OptionError, match=r"unknown parameter 'loss_scale_window'.*accepted keys"):
        AMP_Optimizer(sgd, loss_scale_window=10)
    with pytest.raises(OptionError, match=r"bucket_size_mb=-1"):
        AMP_Optimizer(sgd, bucket_size_mb=-1)
    # rewrite keys are validated here too (the CANN AMP guide passes one dict)
    with pytest.raises(OptionError, match="precision_mode='fast16'.*accepted"):
        AMP_Optimizer(sgd, precision_mode="fast16")
    with pytest.raises(OptionError, match="not a supported optimizer"):
        AMP_Optimizer(object())
    with pytest.raises(OptionError, match="init_loss_scale=4096.*outside"):
        AMP_Optimizer(sgd, init_loss_scale=4096, max_loss_scale=1024)


def test_unsupported_strategy_is_a_clear_error():
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope():
        with pytest.raises(npu_amp_tf.NpuAmpError, match="CentralStorageStrategy.*Supported"):
            AMP_Optimizer(v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(npu_amp_tf.NpuAmpError, match="is_distributed=True needs"):
        w = tf.Variable(1.0)
        NPULossScaleOptimizer(v1.train.GradientDescentOptimizer(0.1), None,
                              is_distributed=True).minimize(lambda: w * w, var_list=[w])


# ---------------------------------------------------------------- convergence
def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    y = d.target.astype(np.int64)
    rng = np.random.RandomState(0)
    idx = rng.permutation(len(x))
    x, y = x[idx], y[idx]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _train_cnn(dtype, steps=300, batch=50):
    xtr, ytr, xte, yte = _digits()
    init = np.random.RandomState(1)
    k1 = tf.Variable(init.randn(3, 3, 1, 8).astype(np.float32) * 0.3)
    b1 = tf.Variable(np.zeros(8, np.float32))
    w2 = tf.Variable(init.randn(4 * 4 * 8, 10).astype(np.float32) * 0.1)
    b2 = tf.Variable(np.zeros(10, np.float32))
    params = [k1, b1, w2, b2]

    def logits(x):  # master weights FP32; compute in `dtype` with plain casts
        c = lambda t: tf.cast(t, dtype)  # noqa: E731
        h = tf.nn.relu(tf.nn.conv2d(c(x), c(k1), 1, "SAME") + c(b1))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.reshape(h, [-1, 4 * 4 * 8])
        return tf.cast(tf.matmul(h, c(w2)) + c(b2), tf.float32)

    opt = AMP_Optimizer(v1.train.AdamOptimizer(0.01))

    @tf.function
    def step(x, y):
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
        opt.minimize(loss, var_list=params)
        return loss

    order = np.random.RandomState(2)
    for _ in range(steps):
        i = order.randint(0, len(xtr), batch)
        step(tf.constant(xtr[i]), tf.constant(ytr[i]))
    pred = np.argmax(logits(tf.constant(xte)).numpy(), 1)
    assert all(p.dtype == tf.float32 for p in params)
    return 100.0 * np.mean(pred == yte), opt.loss_scale_manager.state()


def test_convergence_on_digits_fp32_fp16_bf16():
    acc32, _ = _train_cnn(tf.float32)
    acc16, st16 = _train_cnn(tf.float16)
    acc_bf, _ = _train_cnn(tf.bfloat16)
    print(f"digits test accuracy: fp32 {acc32:.2f}  fp16 {acc16:.2f}  bf16 {acc_bf:.2f}")
    assert acc32 > 90.0
    assert abs(acc16 - acc32) <= 1.0, (acc32, acc16)
    assert abs(acc_bf - acc32) <= 1.0, (acc32, acc_bf)
    assert st16["steps"] == 300


def test_tf2_object_checkpoint_round_trip_tf1_wrapper(tmp_path):
    def make(amp, init):
        w = tf.Variable(init)
        opt = v1.train.AdamOptimizer(0.1)
        if amp:
            opt = AMP_Optimizer(opt, decr_every_n_nan_or_inf=1)
        return w, opt

    w, opt = make(True, [1.0, 2.0])
    opt.minimize(lambda: tf.reduce_sum(w * w), var_list=[w])
    opt.minimize(lambda: tf.reduce_sum(w * w) * np.float32(np.inf), var_list=[w])
    amp_path = tf.train.Checkpoint(w=w, optimizer=opt).save(str(tmp_path / "amp"))
    names = {n for n, _ in tf.train.list_variables(amp_path)}
    assert "optimizer/loss_scale_manager/loss_scale/.ATTRIBUTES/VARIABLE_VALUE" in names
    # AMP -> plain (slots restored)
    w2, plain = make(False, [0.0, 0.0])
    tf.train.Checkpoint(w=w2, optimizer=plain).restore(amp_path).expect_partial()
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    plain.minimize(lambda: tf.reduce_sum(w2 * 0.0), var_list=[w2])  # creates (restored) slots
    m_amp = opt.get_slot(w, "m").numpy()
    np.testing.assert_allclose(plain.get_slot(w2, "m").numpy(), 0.9 * m_amp, rtol=1e-6)
    plain_path = tf.train.Checkpoint(w=w2, optimizer=plain).save(str(tmp_path / "plain"))
    # plain -> AMP (fresh scale) and AMP -> AMP (saved scale)
    w3, amp3 = make(True, [5.0, 5.0])
    tf.train.Checkpoint(w=w3, optimizer=amp3).restore(plain_path)
    np.testing.assert_array_equal(w3.numpy(), w2.numpy())
    assert amp3.loss_scale_manager.state()["loss_scale"] == 128.0
    w4, amp4 = make(True, [5.0, 5.0])
    tf.train.Checkpoint(w=w4, optimizer=amp4).restore(amp_path)
    st = amp4.loss_scale_manager.state()
    assert st["loss_scale"] == 64.0 and st["overflow_count"] == 1
