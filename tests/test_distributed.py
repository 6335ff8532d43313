"""tf.distribute: MirroredStrategy in process, and a real 2-process
MultiWorkerMirroredStrategy run on 127.0.0.1 with an overflow injected on one
worker only (both must skip; weights and scales stay identical)."""
import functools
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import npu_amp_tf
from npu_amp_tf import OptionError
from conftest import TWO_CPUS

v1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    K = npu_amp_tf.keras.keras_module()
except OptionError:
    K = None


@functools.lru_cache(maxsize=None)
def _mirrored():
    """MirroredStrategy over the two logical CPUs of conftest (a real all-reduce).

    One instance for the module: collective instance keys are allocated per
    strategy object, and a second MirroredStrategy in the same process reuses
    them, so TF aborts its collectives on a dtype mismatch between tests."""
    assert len(tf.config.list_logical_devices("CPU")) == 2, "conftest sets 2 logical CPUs"
    return tf.distribute.MirroredStrategy(TWO_CPUS)


def _bad_on_replica_1(bad):
    """inf on the second replica only: the replicas must agree to skip."""
    rid = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.where(tf.logical_and(bad, tf.equal(rid, 1)), np.float32(np.inf), 1.0)


def _keras_step_fns(strategy, model, opt, x, y):
    @tf.function
    def step(bad):
        def replica_fn():
            with tf.GradientTape() as tape:
                per_ex = tf.square(model(x) - y)
                loss = tf.nn.compute_average_loss(tf.reduce_mean(per_ex, 1),
                                                  global_batch_size=x.shape[0])
                loss = loss * _bad_on_replica_1(bad)
            opt.minimize(loss, model.trainable_variables, tape=tape)
        strategy.run(replica_fn)
    return step


@pytest.mark.skipif(K is None, reason="Keras 2 not available")
@pytest.mark.parametrize("allreduce_dtype", ["float32", "float16"])
def test_mirrored_strategy_keras_skip_and_options(allreduce_dtype):
    strategy = _mirrored()
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    y = x.sum(1, keepdims=True)
    with strategy.scope():
        K.utils.set_random_seed(0)
        model = K.Sequential([K.layers.Dense(3, input_shape=(4,)), K.layers.Dense(1)])
        opt = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05), decr_every_n_nan_or_inf=1,
                                       allreduce_dtype=allreduce_dtype, bucket_size_mb=1)
    assert opt._npu_amp_core.comm_options.bytes_per_pack == 1024 * 1024
    step = _keras_step_fns(strategy, model, opt, x, y)
    step(tf.constant(False))
    before = [v.numpy() for v in model.weights + opt.variables()]
    step(tf.constant(True))
    after = [v.numpy() for v in model.weights + opt.variables()]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert float(opt.loss_scale) == 64.0
    step(tf.constant(False))
    assert not np.array_equal(model.weights[0].numpy(), before[0])
    st = opt.loss_scale_manager.state()
    assert st["steps"] == 3 and st["skipped_steps"] == 1


def test_mirrored_strategy_tf1_optimizer():
    strategy = _mirrored()
    with strategy.scope():
        w = tf.Variable([1.0, -1.0])
        opt = npu_amp_tf.AMP_Optimizer(v1.train.AdamOptimizer(0.1), decr_every_n_nan_or_inf=1)
        gs = tf.Variable(0, dtype=tf.int64, trainable=False,
                         aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @tf.function
    def step(bad):
        def fn():
            loss = tf.reduce_sum(w * w) * _bad_on_replica_1(bad)
            return opt.minimize(loss, var_list=[w], global_step=gs)
        strategy.run(fn)

    step(tf.constant(False))
    w1, m1 = w.numpy(), opt.get_slot(w, "m").numpy()
    step(tf.constant(True))
    np.testing.assert_array_equal(w.numpy(), w1)
    np.testing.assert_array_equal(opt.get_slot(w, "m").numpy(), m1)
    assert int(gs.numpy()) == 2 and float(opt.get_loss_scale().numpy()) == 64.0
    step(tf.constant(False))
    assert not np.array_equal(w.numpy(), w1)


def test_unsupported_strategy_inside_step():
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with pytest.raises(npu_amp_tf.NpuAmpError, match="does not support CentralStorageStrategy"):
        with strategy.scope():
            npu_amp_tf.AMP_Optimizer(v1.train.GradientDescentOptimizer(0.1))


# ------------------------------------------------------------------ 2 processes
WORKER = textwrap.dedent("""
    import json, os, sys, time
    t0 = time.time()
    import numpy as np
    import tensorflow as tf
    import npu_amp_tf

    out_path, modes = sys.argv[1], sys.argv[2].split(",")
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.RandomState(task)  # each worker gets different data
    x = rng.randn(4, 4).astype(np.float32)
    y = x.sum(1, keepdims=True)
    BAD_STEP = 2
    result = {"import_s": time.time() - t0}

    def run(mode):
        with strategy.scope():
            if mode == "keras":
                K = npu_amp_tf.keras.keras_module()
                K.utils.set_random_seed(0)
                model = K.Sequential([K.layers.Dense(3, input_shape=(4,)), K.layers.Dense(1)])
                opt = npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(0.05), allreduce_dtype="float16",
                                               bucket_size_mb=1, decr_every_n_nan_or_inf=1)
                weights = lambda: [v.numpy() for v in model.weights] + [
                    v.numpy() for v in opt.variables()]
                var_list = model.trainable_variables
            else:
                w = tf.Variable(np.ones([4, 1], np.float32))
                opt = npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.AdamOptimizer(0.05),
                                               decr_every_n_nan_or_inf=1)
                model = lambda t: tf.matmul(t, w)
                weights = lambda: [w.numpy(), opt.get_slot(w, "m").numpy(),
                                   opt.get_slot(w, "v").numpy()]
                var_list = [w]

        @tf.function
        def step(bad):
            def replica_fn():
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(
                        tf.reduce_mean(tf.square(model(x) - y), 1), global_batch_size=8)
                    loss = loss * tf.where(bad, np.float32(np.inf), 1.0)
                if mode == "keras":
                    opt.minimize(loss, var_list, tape=tape)
                else:
                    opt.minimize(loss, var_list=var_list)
            strategy.run(replica_fn)

        snaps, scales = [], []
        for i in range(4):
            step(tf.constant(i == BAD_STEP and task == 1))   # overflow on worker 1 only
            snaps.append([a.tolist() for a in weights()])
            scales.append(opt.loss_scale_manager.state())
        return {"snaps": snaps, "scales": scales}

    for mode in modes:
        t = time.time()
        result[mode] = run(mode)
        result[mode + "_s"] = time.time() - t
    json.dump(result, open(out_path, "w"))
""")


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_workers(tmp_path, modes):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs, outs = [], []
    for i in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                   OMP_NUM_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
        out = tmp_path / f"w{i}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(script), str(out), ",".join(modes)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(o.read_text()) for o in outs]


def test_two_worker_mwms_overflow_on_one_worker(tmp_path):
    """Both wrappers (Keras 2 with allreduce_dtype=float16 + bucket_size_mb, and
    TF1) in one 2-process cluster; ~1 minute on 2 cores."""
    modes = ["keras", "tf1"] if K is not None else ["tf1"]
    w0, w1 = _run_workers(tmp_path, modes)
    print({k: v for k, v in w0.items() if k.endswith("_s")})
    for mode in modes:
        _check_identical_and_skipped(w0[mode], w1[mode])


def _check_identical_and_skipped(w0, w1):
    # weights (and optimizer state) identical on both workers after every step
    for s0, s1 in zip(w0["snaps"], w1["snaps"]):
        for a, b in zip(s0, s1):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    # step 2 (overflow on worker 1 only) was skipped on BOTH workers
    for w in (w0, w1):
        for a, b in zip(w["snaps"][1], w["snaps"][2]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert not np.array_equal(np.array(w["snaps"][2][0]), np.array(w["snaps"][3][0]))
        assert [s["loss_scale"] for s in w["scales"]] == [128.0, 128.0, 64.0, 64.0]
        assert w["scales"][-1]["skipped_steps"] == 1 and w["scales"][-1]["overflow_count"] == 1
    assert w0["scales"] == w1["scales"]


PSS_SCRIPT = textwrap.dedent("""
    import socket
    import tensorflow as tf
    import npu_amp_tf

    def port():
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
        return p

    cs = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port()}"], "ps": [f"127.0.0.1:{port()}"]})
    for job in ("worker", "ps"):  # in-process servers
        tf.distribute.Server(cs, job_name=job, task_index=0, protocol="grpc", start=True)
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(cs, rpc_layer="grpc"))
    with strategy.scope():
        try:
            npu_amp_tf.AMP_Optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        except npu_amp_tf.NpuAmpError as exc:
            print("ERROR:", exc)
""")


def test_parameter_server_strategy_is_a_clear_error(tmp_path):
    """Run in a subprocess: a PS cluster reconfigures the process's eager context."""
    script = tmp_path / "pss.py"
    script.write_text(PSS_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR: AMP_Optimizer does not support ParameterServerStrategy" in out.stdout
    assert "Supported: no strategy, OneDeviceStrategy, MirroredStrategy" in out.stdout


def test_accumulation_under_a_strategy_is_a_clear_error():
    strategy = _mirrored()
    msg = "gradient_accumulation_steps=2 is not supported under MirroredStrategy yet; accepted there: 1"
    with strategy.scope():
        with pytest.raises(OptionError, match=msg):
            npu_amp_tf.AMP_Optimizer(v1.train.GradientDescentOptimizer(0.1),
                                     gradient_accumulation_steps=2)
    # created outside the scope: the step refuses to build
    opt = npu_amp_tf.AMP_Optimizer(v1.train.GradientDescentOptimizer(0.1),
                                   gradient_accumulation_steps=2)
    with strategy.scope():
        w = tf.Variable([1.0])

    @tf.function
    def step():
        strategy.run(lambda: opt.minimize(tf.reduce_sum(w * w), var_list=[w]))

    with pytest.raises(Exception, match=msg):
        step()


def _keras3():
    try:
        import keras
    except ImportError:
        return None
    return keras if int(keras.__version__.split(".")[0]) >= 3 else None


@pytest.mark.skipif(_keras3() is None,
                    reason=f"Keras 3 is not installed for TensorFlow {tf.__version__}")
def test_mirrored_strategy_keras3_replicas_agree_on_overflow():
    """Two replicas, inf on replica 1 only: both skip (weights, slots, iterations bit-identical
    on every replica); model.fit under the strategy trains with the scale growing."""
    keras = _keras3()
    strategy = _mirrored()
    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    y = x.sum(1, keepdims=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        opt = npu_amp_tf.AMP_Optimizer(keras.optimizers.Adam(0.05), decr_every_n_nan_or_inf=1)

    @tf.function
    def step(bad):
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    tf.reduce_mean(tf.square(model(x) - y), 1), global_batch_size=16)
                loss = opt.scale_loss(loss * _bad_on_replica_1(bad))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        strategy.run(replica_fn)

    def per_replica_state():
        out = []
        for v in model.weights + opt.variables:
            vals = [t.numpy() for t in strategy.experimental_local_results(v.value)]
            assert len(vals) == 2
            np.testing.assert_array_equal(vals[0], vals[1])  # replicas in sync
            out.append(vals[0])
        return out

    step(tf.constant(False))
    before = per_replica_state()
    step(tf.constant(True))
    for a, b in zip(before, per_replica_state()):
        np.testing.assert_array_equal(a, b)
    assert opt.loss_scale_manager.state()["loss_scale"] == 64.0 and int(opt.iterations.numpy()) == 1
    step(tf.constant(False))
    assert not np.array_equal(per_replica_state()[0], before[0])
    st = opt.loss_scale_manager.state()
    assert st["steps"] == 3 and st["skipped_steps"] == 1 and int(opt.iterations.numpy()) == 2

    with strategy.scope():
        model.compile(optimizer=npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.01),
                                                         incr_every_n_steps=2), loss="mse")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)  # 2 replicas x 2 examples, 4 steps
    assert model.optimizer.loss_scale_manager.state()["loss_scale"] == 128 * 4
    with strategy.scope():
        with pytest.raises(OptionError, match="allreduce_dtype='float16'.*Keras 3.*accepted"):
            npu_amp_tf.AMP_Optimizer(keras.optimizers.SGD(0.01), allreduce_dtype="float16")
