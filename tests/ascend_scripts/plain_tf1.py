"""A plain TF1 Session script that names neither npu_bridge nor npu_amp_tf."""
import json
import sys

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
tf1.disable_eager_execution()
rng = np.random.RandomState(0)
x = tf1.placeholder(tf.float32, [8, 16], name="x")
w = tf1.get_variable("w", initializer=tf.constant(rng.randn(16, 16).astype(np.float32) * 0.2))
v = tf1.get_variable("v", initializer=tf.constant(rng.randn(16, 4).astype(np.float32) * 0.2))
h = tf.nn.relu(tf.matmul(x, w, name="fc1"))
# a batched matmul (BatchMatMulV2 in TF, BatchMatMulV2 in GE too)
logits = tf.squeeze(tf.matmul(tf.expand_dims(h, 0), tf.expand_dims(v, 0), name="fc2"), 0)
loss = tf.reduce_mean(tf.square(logits))
train = tf1.train.GradientDescentOptimizer(0.05).minimize(loss)
xs = rng.rand(8, 16).astype(np.float32)
losses = []
with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
        losses.append(float(sess.run([train, loss], {x: xs})[1]))
print("RESULT " + json.dumps({"losses": losses}))
