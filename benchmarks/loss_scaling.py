"""Per-step overhead of npu_amp_tf's loss scaling vs Keras's own LossScaleOptimizer.

Same FP32 model, same data, one process, interleaved rounds; the figure of
merit is

    ratio = overhead(npu_amp) / overhead(Keras LSO)      (goal <= 1.0)

where each overhead is the median over interleaved rounds of the per-step
time difference to the plain step measured in the same round (process CPU
time of all threads, and wall time) of a ``tf.function`` training step
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
import statistics
import os
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
    """(wall, process CPU) seconds per step.  Process CPU time (all TF threads)
    is far less disturbed by other processes on a shared machine than wall time."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n, (time.process_time() - c) / n


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
    order = list(fns)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):  # alternate the order
            times[name].append(time_steps(fns[name], steps))
    nvars = len(build(depth, width).trainable_variables)
    # per-round paired differences to the plain step cancel slow load drifts
    out = {}
    for k, metric in ((0, "wall time"), (1, "CPU time")):
        plain = [t[k] for t in times["plain Adam"]]
        out[metric] = {"plain Adam": statistics.median(plain)}
        for name in order[1:]:
            out[metric][name] = statistics.median(
                [t[k] - p for t, p in zip(times[name], plain)])
    return out, nvars


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args(argv)
    configs = [("MLP 4x256, batch 64", 4, 256, 64), ("MLP 24x32, batch 32", 24, 32, 32)]
    print(f"TensorFlow {tf.__version__}, Keras 2 from {K.__name__}; "
          f"{args.rounds} interleaved rounds x {args.steps} steps; overhead = median over rounds "
          "of (variant - plain) in the same round")
    print()
    print("| model | vars | metric | plain Adam step (us) | Keras LSO overhead (us) | "
          "npu_amp overhead (us) | ratio npu_amp/Keras |")
    print("|---|---|---|---|---|---|---|")
    for label, depth, width, batch in configs:
        res, nvars = bench(depth, width, batch, args.steps, args.rounds)
        for metric in ("CPU time", "wall time"):
            t = res[metric]
            ok, oa = t["Keras LossScaleOptimizer"], t["npu_amp_tf AMP_Optimizer"]
            ratio = oa / ok if ok > 0 else float("nan")
            print(f"| {label} | {nvars} | {metric} | {t['plain Adam'] * 1e6:.0f} | {ok * 1e6:.0f} | "
                  f"{oa * 1e6:.0f} | {ratio:.2f} |")
    print()
    print("ratio = (npu_amp - plain) / (Keras LSO - plain); goal <= 1.0. "
          "CPU time = process CPU (all threads) per step; wall time is noisier on a shared machine.")


if __name__ == "__main__":
    main()
