"""A plain TF2 script (tf.function) that names neither npu_device nor npu_amp_tf."""
import json

import tensorflow as tf

w = tf.Variable(tf.reshape(tf.range(64, dtype=tf.float32), [8, 8]) / 64.0)


@tf.function
def f(x):
    return tf.nn.relu(tf.matmul(x, w, name="mm"))


print("RESULT " + json.dumps({"sum": float(tf.reduce_sum(f(tf.ones([4, 8]))))}))
