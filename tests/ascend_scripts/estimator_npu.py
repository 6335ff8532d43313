"""ModelZoo-style Estimator script for tf_adapter (unchanged): NPURunConfig +
NPUEstimator + NPUEstimatorSpec + NPULossScaleOptimizer (FixedLossScaleManager).
Prints the final loss and the trained weights as one JSON line."""
import argparse
import json

import numpy as np
import tensorflow as tf
from npu_bridge.estimator.npu.npu_config import NPURunConfig
from npu_bridge.estimator.npu.npu_estimator import NPUEstimator, NPUEstimatorSpec
from npu_bridge.estimator.npu.npu_loss_scale_manager import FixedLossScaleManager
from npu_bridge.estimator.npu.npu_loss_scale_optimizer import NPULossScaleOptimizer

parser = argparse.ArgumentParser()
parser.add_argument("--model_dir", required=True)
parser.add_argument("--precision_mode", default="allow_mix_precision")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

rng = np.random.RandomState(0)
X = rng.rand(32, 8).astype(np.float32)
Y = (X @ rng.randn(8, 1).astype(np.float32)).astype(np.float32)
W0 = (rng.randn(8, 8) * 0.3).astype(np.float32)


def input_fn():
    return tf.compat.v1.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(8)


def model_fn(features, labels, mode, params):
    w = tf.compat.v1.get_variable("w", initializer=tf.constant(W0))
    u = tf.compat.v1.get_variable("u", initializer=tf.ones([8, 1]) * 0.1)
    pred = tf.matmul(tf.tanh(tf.matmul(features, w, name="dense1")), u, name="dense2")
    loss = tf.reduce_mean(tf.square(pred - labels))
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.05)
    opt = NPULossScaleOptimizer(opt, FixedLossScaleManager(loss_scale=1024), is_distributed=False)
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return NPUEstimatorSpec(mode=mode, loss=loss, train_op=train_op)


config = NPURunConfig(model_dir=args.model_dir, save_checkpoints_steps=1000, iterations_per_loop=1,
                      precision_mode=args.precision_mode, enable_data_pre_proc=True,
                      mix_compile_mode=False, hcom_parallel=True, log_step_count_steps=1000)
est = NPUEstimator(model_fn=model_fn, config=config)
assert isinstance(est, tf.estimator.Estimator)
est.train(input_fn, max_steps=args.steps)
print("RESULT " + json.dumps({"w": est.get_variable_value("w").tolist(),
                              "u": est.get_variable_value("u").tolist()}))
