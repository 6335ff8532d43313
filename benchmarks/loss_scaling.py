"""Per-step overhead of npu_amp_tf's loss scaling vs Keras's own LossScaleOptimizer.

Same FP32 model, same data, one process, interleaved rounds; the figure of
merit is

    ratio = (t_npu_amp - t_plain) / (t_keras_lso - t_plain)      (goal <= 1.0)

where each t is the median per-step time of a ``tf.function`` training step
(``optimizer.minimize(loss, vars, tape=tape)``) with the plain Keras 2 Adam,
Keras's dynamic ``LossScaleOptimizer`` around it, or ``npu_amp_tf.AMP_Optimizer``
around it.  Both loss-scaling variants do the same work per step (scale the
loss, unscale, check finiteness, conditional apply, update the scale);
npu_amp_tf additionally keeps counters and hysteresis.  Times are printed,
never asserted.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/loss_scaling.py [--steps 200 --rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import npu_amp_tf  # noqa: E402

K = npu_amp_tf.keras.keras_module()


def build(depth, width, seed=0):
    K.utils.set_random_seed(seed)
    layers = [K.layers.Dense(width, activation="relu", input_shape=(width,))]
    layers += [K.layers.Dense(width, activation="relu") for _ in range(depth - 1)]
    layers += [K.layers.Dense(10)]
    return K.Sequential(layers)


def make_step(model, opt, x, y):
    loss_fn = K.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)
    return step


def time_steps(step, n):
    t = time.perf_counter()
    for _ in range(n):
        step()
    # flush: the last step's ops have run when a variable read returns
    return (time.perf_counter() - t) / n


def bench(depth, width, batch, steps, rounds):
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(batch, width).astype(np.float32))
    y = tf.constant(rng.randint(0, 10, batch))
    variants = {
        "plain Adam": lambda: K.optimizers.Adam(1e-3),
        "Keras LossScaleOptimizer": lambda: K.mixed_precision.LossScaleOptimizer(K.optimizers.Adam(1e-3)),
        "npu_amp_tf AMP_Optimizer": lambda: npu_amp_tf.AMP_Optimizer(K.optimizers.Adam(1e-3)),
    }
    fns = {}
    for name, mk in variants.items():
        model = build(depth, width)
        fns[name] = make_step(model, mk(), x, y)
        for _ in range(10):  # trace + warm up
            fns[name]()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_steps(fn, steps))
    return {name: statistics.median(ts) for name, ts in times.items()}, len(
        build(depth, width).trainable_variables)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    configs = [("MLP 4x256, batch 64", 4, 256, 64), ("MLP 24x32, batch 32", 24, 32, 32)]
    print(f"TensorFlow {tf.__version__}, Keras {K.__version__ if hasattr(K, '__version__') else '?'}; "
          f"{args.rounds} rounds x {args.steps} steps, median per-step time")
    print()
    print(f"| model | variables | plain Adam (us) | Keras LSO (us) | npu_amp (us) | "
          f"Keras overhead (us) | npu_amp overhead (us) | ratio npu_amp/Keras |")
    print("|---|---|---|---|---|---|---|---|")
    for label, depth, width, batch in configs:
        t, nvars = bench(depth, width, batch, args.steps, args.rounds)
        p, k, a = (t["plain Adam"], t["Keras LossScaleOptimizer"], t["npu_amp_tf AMP_Optimizer"])
        ok, oa = k - p, a - p
        ratio = oa / ok if ok > 0 else float("nan")
        print(f"| {label} | {nvars} | {p * 1e6:.0f} | {k * 1e6:.0f} | {a * 1e6:.0f} | "
              f"{ok * 1e6:.0f} | {oa * 1e6:.0f} | {ratio:.2f} |")
    print()
    print("ratio = (npu_amp - plain) / (Keras LSO - plain); goal <= 1.0. "
          "Noise on a shared CPU is a few us per step.")


if __name__ == "__main__":
    main()
