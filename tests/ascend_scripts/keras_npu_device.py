"""ModelZoo-style TF2 Keras script for tf_adapter 2.x (unchanged): npu_device
options, npu.open().as_default(), NpuLossScaleOptimizer, model.fit."""
import argparse
import json

import numpy as np
import tensorflow as tf

import npu_device as npu

parser = argparse.ArgumentParser()
parser.add_argument("--precision_mode", default="allow_mix_precision")
parser.add_argument("--mixlist", default=None)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

npu.global_options().precision_mode = args.precision_mode
if args.mixlist:
    npu.global_options().modify_mixlist = args.mixlist
npu.global_options().hcom_parallel = True
npu.open().as_default()

rng = np.random.RandomState(0)
X = rng.rand(32, 12).astype(np.float32)
Y = rng.randint(0, 3, size=32)
tf.random.set_seed(0)
model = tf.keras.Sequential([
    tf.keras.layers.Dense(16, activation="relu", input_shape=(12,), name="dense1",
                          kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1)),
    tf.keras.layers.Dense(3, name="dense2", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)),
    tf.keras.layers.Softmax(name="softmax"),
])
opt = npu.train.optimizer.NpuLossScaleOptimizer(tf.keras.optimizers.SGD(0.1), dynamic=True,
                                                initial_scale=2 ** 10)
assert isinstance(opt, npu.train.optimizer.NpuLossScaleOptimizer)
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
hist = model.fit(X, Y, batch_size=8, epochs=args.epochs, verbose=0, shuffle=False)
print("RESULT " + json.dumps({"loss": hist.history["loss"],
                              "w": [w.tolist() for w in model.get_weights()]}))
