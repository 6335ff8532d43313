"""Issue 17: the precision pass re-types a one-value float Const without
TensorFlow's ``make_ndarray`` / ``make_tensor_proto`` (``amp.SCALAR_CONSTS``).

The expectation is TensorFlow's own: the reference path builds the new
``value`` with ``tf.make_tensor_proto`` of the value cast by numpy.  Every
source and target float dtype, scalar and one-element shapes, values that
round, underflow, overflow, signed zeros, infinities and NaN: the bytes of
the re-typed NodeDef must be identical.  Then on a real graph (BERT-like,
whose layer norms' epsilons and GELU's constants are such scalars), through
the pipeline: the same graph and report with the switch on and off, and
the switch's path taken."""
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from graph_passes import registry
from graph_passes.precision import amp

F32, F16, BF16 = registry.DT_FLOAT, registry.DT_HALF, registry.DT_BFLOAT16
VALUES = [0.0, -0.0, 1.0, -2.5, 1e-3, 1e-8, 3.0e-5, 65504.0, 70000.0, 1e30, float("inf"), float("-inf"),
          float("nan"), 0.1, 1.0 / 3.0]
SHAPES = [(), (1,), (1, 1)]


def _const(value, src, shape):
    """A Const as TF writes one: ``tf.make_tensor_proto`` of the value in ``src``."""
    np_src = tf.dtypes.as_dtype(src).as_numpy_dtype
    n = node_def_pb2.NodeDef(name="c", op="Const")
    n.attr["dtype"].type = src
    n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.full(shape, value, dtype=np_src), dtype=src,
                                                        shape=shape))
    return n


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src,dst", [(F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (F16, BF16), (BF16, F16)])
def test_one_value_consts_as_tensorflow_writes_them(monkeypatch, src, dst, shape):
    for value in VALUES:
        got, ref = _const(value, src, shape), _const(value, src, shape)
        monkeypatch.setattr(amp, "SCALAR_CONSTS", True)
        amp._convert_const(got, dst)
        monkeypatch.setattr(amp, "SCALAR_CONSTS", False)
        amp._convert_const(ref, dst)
        assert got.attr["dtype"].type == dst
        assert got.SerializeToString(deterministic=True) == ref.SerializeToString(deterministic=True), \
            (value, src, dst, shape, got.attr["value"], ref.attr["value"])


def test_the_fast_path_takes_no_tensorflow_call(monkeypatch):
    """With the switch on, a scalar is re-typed without tf.make_ndarray /
    tf.make_tensor_proto (with it off, through them)."""
    calls = []
    real = tf.make_tensor_proto
    on, off = _const(0.5, F32, ()), _const(0.5, F32, ())
    monkeypatch.setattr(tf, "make_tensor_proto", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(amp, "SCALAR_CONSTS", True)
    amp._convert_const(on, F16)
    assert not calls
    monkeypatch.setattr(amp, "SCALAR_CONSTS", False)
    amp._convert_const(off, F16)
    assert calls


def test_a_real_graph_is_the_same_either_way(k2, monkeypatch):
    import npu_amp_tf
    from test_precision_fast import _strip_times
    from test_precision_native import _graph

    gd, fetches = _graph("bert_like", k2)
    seen = []
    real = amp._convert_const

    def convert(node, dt):
        t = node.attr["value"].tensor
        seen.append((len(t.float_val) + len(t.half_val), [d.size for d in t.tensor_shape.dim]))
        return real(node, dt)

    monkeypatch.setattr(amp, "_convert_const", convert)
    res = []
    for on in (True, False):
        monkeypatch.setattr(amp, "SCALAR_CONSTS", on)
        out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches],
                                           precision_mode="allow_mix_precision")
        j = _strip_times(rep.to_json())
        res.append((out.SerializeToString(deterministic=True), json.dumps(j, sort_keys=True, default=str)))
    assert any(k == 1 and all(d == 1 for d in dims) for k, dims in seen), seen[:5]  # one-value consts converted
    assert res[0][0] == res[1][0]
    assert res[0][1] == res[1][1]
