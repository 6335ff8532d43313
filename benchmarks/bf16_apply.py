"""Momentum updates of ResNet-50's kernels: TF's ``Cast(bf16 -> f32) -> ResourceApplyMomentum`` against
``ResourceApplyMomentumMixed`` reading the BF16 gradient (issue 18j, rule ``bf16_apply_momentum``), and TF's
FP32 update against ``ResourceApplyMomentumMixed(T=float)``.

The 54 kernels (rank >= 2: the variables whose gradient a BF16 conv / matmul produces) of a 100-class
``ResNet50`` at 128x128, 23.66M parameters, one update op per kernel grouped per form in one TF1
session; every form includes its gradient's producer (a variable read, and a Cast to BF16 for the BF16
forms).  Prints CPU ms per step (``time.process_time``: all threads; min and median of 7 interleaved
rounds of 3 runs) and the minimum wall time, with the load average.  Never asserts a time.

    PYTHONPATH=$PWD python benchmarks/bf16_apply.py
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from npu_amp_tf import _loader  # noqa: E402

tf1 = tf.compat.v1
FORMS = ("cast_tf", "mixed_bf16", "tf_f32", "mixed_f32")


def kernel_shapes():
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 16):
        import tf_keras as K
    else:
        K = tf.keras
    model = K.applications.ResNet50(weights=None, input_shape=(128, 128, 3), classes=100)
    return [tuple(w.shape) for w in model.trainable_weights if len(w.shape) >= 2]


def main(rounds=7, runs=3):
    mod = _loader.load()
    shapes = kernel_shapes()
    print(f"TF {tf.__version__}: {len(shapes)} kernels, {sum(int(np.prod(s)) for s in shapes) / 1e6:.2f}M parameters")
    g = tf.Graph()
    forms = {}
    with g.as_default():
        for form in FORMS:
            ups = []
            for i, s in enumerate(shapes):
                v = tf1.get_variable(f"{form}/v{i}", s, initializer=tf1.zeros_initializer(), use_resource=True)
                a = tf1.get_variable(f"{form}/a{i}", s, initializer=tf1.zeros_initializer(), use_resource=True)
                src = tf1.get_variable(f"{form}/g{i}", s, initializer=tf1.random_normal_initializer(),
                                       use_resource=True)
                grad = src.read_value()
                grad = tf.identity(tf.cast(grad, tf.bfloat16) if form in ("cast_tf", "mixed_bf16") else grad)
                if form == "cast_tf":
                    ups.append(tf.raw_ops.ResourceApplyMomentum(var=v.handle, accum=a.handle, lr=0.01,
                                                                grad=tf.cast(grad, tf.float32), momentum=0.9))
                elif form == "tf_f32":
                    ups.append(tf.raw_ops.ResourceApplyMomentum(var=v.handle, accum=a.handle, lr=0.01, grad=grad,
                                                                momentum=0.9))
                else:
                    ups.append(mod.resource_apply_momentum_mixed(var=v.handle, accum=a.handle, lr=0.01, grad=grad,
                                                                 momentum=0.9))
            forms[form] = tf.group(*ups)
        init = tf1.global_variables_initializer()
    with tf1.Session(graph=g) as s:
        s.run(init)
        for op in forms.values():
            s.run(op)
        res = {k: [] for k in forms}
        load0 = os.getloadavg()[0]
        for _ in range(rounds):
            for k, op in forms.items():
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(runs):
                    s.run(op)
                res[k].append(((time.process_time() - c0) / runs, (time.perf_counter() - t0) / runs))
    for k, v in res.items():
        cpu = sorted(x[0] for x in v)
        print(f"{k:12s} cpu min {cpu[0] * 1e3:7.1f} ms  median {cpu[len(cpu) // 2] * 1e3:7.1f}  "
              f"wall min {min(x[1] for x in v) * 1e3:7.1f}")
    print(f"load average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
