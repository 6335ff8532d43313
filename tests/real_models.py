"""Model code for tests and benchmarks: TF-Slim nets on both TF lanes, and the
BERT-like training graph the pipeline-speed tests and ``benchmarks/precision.py`` share.

TF-Slim 1.1.0 builds its layers through ``tensorflow.python.layers``, which on
TF 2.15 and 2.21 forwards to ``tf_keras.legacy_tf_layers``.  Keras 2.15 ships
those modules as ``keras.src.legacy_tf_layers``; tf_keras 2.21 ships them as
``tf_keras.src.legacy_tf_layers``.  ``import_slim()`` aliases the installed
package under the name TF looks for (the same modules, not copies), then
imports ``tf_slim``.
"""
import importlib
import sys

_SUBMODULES = ("base", "convolutional", "core", "normalization", "pooling",
               "variable_scope_shim")


def import_slim():
    if "tf_keras.legacy_tf_layers" not in sys.modules:
        try:
            import tf_keras  # noqa: F401  (TF >= 2.16 lane)
            src = "tf_keras.src.legacy_tf_layers"
        except ImportError:  # TF 2.15: Keras 2.15 carries the layers itself
            import keras
            sys.modules.setdefault("tf_keras", keras)
            src = "keras.src.legacy_tf_layers"
        pkg = importlib.import_module(src)
        sys.modules["tf_keras.legacy_tf_layers"] = pkg
        for sub in _SUBMODULES:
            try:
                mod = importlib.import_module(f"{src}.{sub}")
            except ImportError:
                continue
            sys.modules[f"tf_keras.legacy_tf_layers.{sub}"] = mod
    import tf_slim
    return tf_slim


def bert_training_graph(layers=12, hidden=768, heads=12, seq=128, batch=8, vocab=30522, ffn=3072,
                        pooler=True):
    """A BERT-base-like encoder from raw ops (embeddings, attention, GELU, layer
    norms from ``tf.nn.moments``) + Adam, in a TF1 graph: the graph
    ``benchmarks/precision.py`` measures and, small, the pipeline-speed tests
    use.  Returns ``(tf.Graph, fetches)``."""
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        init = v1.truncated_normal_initializer(stddev=0.02)
        ids = v1.placeholder(tf.int32, [batch, seq], name="input_ids")
        labels = v1.placeholder(tf.int32, [batch], name="labels")
        emb = v1.get_variable("word_embeddings", [vocab, hidden], initializer=init)
        pos = v1.get_variable("position_embeddings", [seq, hidden], initializer=init)

        def dense(z, n_out, name, act=None):
            with v1.variable_scope(name):
                w = v1.get_variable("kernel", [z.shape[-1], n_out], initializer=init)
                b = v1.get_variable("bias", [n_out], initializer=tf.zeros_initializer())
                out = tf.nn.bias_add(tf.matmul(z, w), b)
                return act(out) if act is not None else out

        def layer_norm(z, name):
            with v1.variable_scope(name):
                gamma = v1.get_variable("gamma", [hidden], initializer=tf.ones_initializer())
                beta = v1.get_variable("beta", [hidden], initializer=tf.zeros_initializer())
                mean, var = tf.nn.moments(z, axes=[-1], keepdims=True)
                return (z - mean) * tf.math.rsqrt(var + 1e-12) * gamma + beta

        h = tf.reshape(tf.gather(emb, ids) + pos, [batch * seq, hidden])
        h = layer_norm(h, "emb_ln")
        dh = hidden // heads
        for i in range(layers):
            with v1.variable_scope(f"layer_{i}"):
                def split(z):
                    return tf.transpose(tf.reshape(z, [batch, seq, heads, dh]), [0, 2, 1, 3])
                q, k_, v = (split(dense(h, hidden, n)) for n in ("query", "key", "value"))
                scores = tf.matmul(q, k_, transpose_b=True) * (1.0 / float(np.sqrt(dh)))
                probs = tf.nn.softmax(scores)
                ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [batch * seq, hidden])
                h = layer_norm(h + dense(ctx, hidden, "attn_out"), "attn_ln")
                inter = dense(h, ffn, "intermediate", act=tf.nn.gelu)
                h = layer_norm(h + dense(inter, hidden, "output"), "out_ln")
        first = tf.reshape(h, [batch, seq, hidden])[:, 0]
        logits = dense(dense(first, hidden, "pooler", act=tf.tanh) if pooler else first, 2, "classifier")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        train = v1.train.AdamOptimizer(1e-4).minimize(loss, name="train")
    return g, ["loss", train.name.split(":")[0]]
