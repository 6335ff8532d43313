"""ModelZoo-style TF1 training script written for Huawei's tf_adapter (unchanged).

Hand-written NpuOptimizer entry with GE keys, NPULossScaleOptimizer with
ExponentialUpdateLossScaleManager(2**32), fetched loss_scale:0 and
overflow_status_reduce_all:0.  Prints one JSON line with the results.
"""
import argparse
import json
import sys

import numpy as np
from npu_bridge.npu_init import *  # noqa: F401,F403

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--fp32", action="store_true", help="plain FP32 session (reference)")
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--bad-key", action="store_true", help="a misspelled GE key in the entry")
args = parser.parse_args()

tf.disable_eager_execution()  # noqa: F405
tf.set_random_seed(0)  # noqa: F405
rng = np.random.RandomState(0)
x_np = rng.rand(16, 12).astype(np.float32)
y_np = rng.randint(0, 4, size=16)

x = tf.placeholder(tf.float32, [None, 12], name="x")  # noqa: F405
y = tf.placeholder(tf.int32, [None], name="y")  # noqa: F405
w1 = tf.get_variable("w1", initializer=tf.constant(rng.randn(12, 16).astype(np.float32) * 0.3))  # noqa: F405
w2 = tf.get_variable("w2", initializer=tf.constant(rng.randn(16, 4).astype(np.float32) * 0.3))  # noqa: F405
h = tf.nn.relu(tf.matmul(x, w1, name="fc1"))  # noqa: F405
logits = tf.matmul(h, w2, name="fc2")  # noqa: F405
loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))  # noqa: F405

opt = tf.train.GradientDescentOptimizer(0.1)  # noqa: F405
if not args.fp32:
    manager = ExponentialUpdateLossScaleManager(init_loss_scale=2**32, incr_every_n_steps=1000)  # noqa: F405
    opt = NPULossScaleOptimizer(opt, manager, is_distributed=False)  # noqa: F405
train_op = opt.minimize(loss)

config = tf.ConfigProto()  # noqa: F405
custom_op = config.graph_options.rewrite_options.custom_optimizers.add()
custom_op.name = "NpuOptimizer"
custom_op.parameter_map["use_off_line"].b = True
custom_op.parameter_map["mix_compile_mode"].b = False
custom_op.parameter_map["enable_data_pre_proc"].b = True
custom_op.parameter_map["iterations_per_loop"].i = 1
if args.bad_key:
    custom_op.parameter_map["use_of_line"].b = True
custom_op.parameter_map["precision_mode"].s = tf.compat.as_bytes(  # noqa: F405
    "must_keep_origin_dtype" if args.fp32 else "allow_mix_precision")
config.graph_options.rewrite_options.remapping = RewriterConfig.OFF  # noqa: F405
config.graph_options.rewrite_options.memory_optimization = RewriterConfig.OFF  # noqa: F405

out = {"losses": [], "loss_scale": [], "finite": []}
with tf.Session(config=config) as sess:  # noqa: F405
    sess.run(tf.global_variables_initializer())  # noqa: F405
    for step in range(args.steps):
        if args.fp32:
            _, l = sess.run([train_op, loss], {x: x_np, y: y_np})
        else:
            s = sess.run("loss_scale:0")  # the scale this step is taken with
            _, l, f = sess.run([train_op, loss, "overflow_status_reduce_all:0"], {x: x_np, y: y_np})
            out["loss_scale"].append(float(s))
            out["finite"].append(bool(f))
        out["losses"].append(float(l))
    out["w2"] = sess.run(w2).tolist()
out["argv"] = sys.argv[1:]
out["name"] = __name__
print("RESULT " + json.dumps(out))
sys.exit(args.exit_code)
