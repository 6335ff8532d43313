"""Training batch norm, forward + backward, as moments + arithmetic (Keras 3's
``BatchNormalization``, ``tf.nn.moments`` + ``tf.nn.batch_normalization``) vs
``FusedBatchNormV3`` / ``FusedBatchNormGradV3``, in FP32 and BF16, on ResNet-50's
shapes at batch 16, 128² (the end_to_end.py size).  Interleaved rounds in one
process; prints the median time per form and the ratios.  No assertion: the
figures justify ``registry.BN_FUSED_FORMS`` and the ``batch_norm_moments`` rule.

    python benchmarks/bn_forms.py [--rounds 5] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tensorflow as tf

SHAPES = [(16, 32, 32, 64), (16, 32, 32, 256), (16, 16, 16, 512), (16, 8, 8, 1024), (16, 4, 4, 2048)]


def forms(shape, dt):
    c = shape[-1]
    rng = np.random.RandomState(0)
    x = tf.constant(rng.standard_normal(shape).astype(np.float32))
    dy = tf.constant(rng.standard_normal(shape).astype(np.float32))
    gamma = tf.constant(rng.uniform(0.5, 1.5, c).astype(np.float32))
    beta = tf.constant(rng.standard_normal(c).astype(np.float32))

    @tf.function
    def moments(x, dy, gamma, beta):
        x, dy = tf.cast(x, dt), tf.cast(dy, dt)
        with tf.GradientTape() as t:
            t.watch([x, gamma, beta])
            mean, var = tf.nn.moments(x, [0, 1, 2])
            y = tf.nn.batch_normalization(x, mean, var, tf.cast(beta, dt), tf.cast(gamma, dt), 1e-3)
        return t.gradient(y, [x, gamma, beta], output_gradients=dy) + [mean, var]

    @tf.function
    def fused(x, dy, gamma, beta):
        x, dy = tf.cast(x, dt), tf.cast(dy, dt)
        e = tf.zeros([0])
        y, m, v, r1, r2, r3 = tf.raw_ops.FusedBatchNormV3(x=x, scale=gamma, offset=beta, mean=e, variance=e,
                                                          epsilon=1e-3, is_training=True)
        dx, dg, db, _, _ = tf.raw_ops.FusedBatchNormGradV3(y_backprop=dy, x=x, scale=gamma, reserve_space_1=r1,
                                                           reserve_space_2=r2, reserve_space_3=r3,
                                                           epsilon=1e-3, is_training=True)
        return [y, dx, dg, db, m, v]

    return {"moments": lambda: moments(x, dy, gamma, beta), "fused": lambda: fused(x, dy, gamma, beta)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    print(f"TF {tf.__version__}, TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')}, "
          f"load {os.getloadavg()[0]:.1f}")
    total = {}
    for shape in SHAPES:
        fns = {(d.name, k): f for d in (tf.float32, tf.bfloat16) for k, f in forms(shape, d).items()}
        for f in fns.values():
            [t.numpy() for t in f()]
        times = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    out = f()
                out[0].numpy()
                times[k].append((time.perf_counter() - t0) / a.iters * 1e3)
        med = {k: float(np.median(v)) for k, v in times.items()}
        for k, v in med.items():
            total[k] = total.get(k, 0.0) + v
        print(f"{str(list(shape)):20s} " + "  ".join(f"{d}/{k} {v:7.2f} ms" for (d, k), v in med.items())
              + f"  | bf16 moments/fused {med[('bfloat16', 'moments')] / med[('bfloat16', 'fused')]:.2f}x"
              f"  fp32 moments/fused {med[('float32', 'moments')] / med[('float32', 'fused')]:.2f}x"
              f"  bf16 fused vs fp32 moments {med[('float32', 'moments')] / med[('bfloat16', 'fused')]:.2f}x")
    print("sum  " + "  ".join(f"{d}/{k} {v:7.2f} ms" for (d, k), v in total.items()))


if __name__ == "__main__":
    main()
