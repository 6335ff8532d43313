"""tf_adapter ``npu.util`` (the parts with a meaning off the NPU)."""
import logging

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from npu_amp_tf import _tf
from npu_amp_tf.errors import OptionError

_values = {}
_logged = set()


def _note(key, msg):
    if key not in _logged:
        _logged.add(key)
        logging.getLogger("npu_amp_tf").warning(msg)


def keep_tensors_dtypes(graph, input_tensors):
    """Mark the ops producing ``input_tensors`` (names) with ``_keep_dtype``:
    the precision pass never converts them."""
    if not isinstance(graph, tf.Graph):
        raise OptionError("keep_tensors_dtypes: graph must be a tf.Graph")
    if not isinstance(input_tensors, (list, tuple)):
        raise OptionError("keep_tensors_dtypes: input_tensors must be a list or tuple of tensor names")
    for name in input_tensors:
        t = graph.get_tensor_by_name(name)
        _tf.set_op_attr(t.op, "_keep_dtype", attr_value_pb2.AttrValue(i=1))


def set_iteration_per_loop(sess, train_op, iterations_per_loop=1):
    """On the NPU one ``Session.run`` runs ``iterations_per_loop`` steps on the
    device.  Here each ``Session.run`` runs one step (logged once); returns
    the op grouped as tf_adapter's ``IterationOp``."""
    if not isinstance(train_op, tf.Operation):
        raise OptionError(f"set_iteration_per_loop: train_op must be a tf.Operation, got "
                          f"{type(train_op).__name__}")
    if not isinstance(iterations_per_loop, int) or iterations_per_loop < 1:
        raise OptionError(f"iterations_per_loop={iterations_per_loop!r} is not valid; accepted: an "
                          "integer >= 1")
    if iterations_per_loop == 1:
        return train_op
    _note("iterations_per_loop", f"set_iteration_per_loop({iterations_per_loop}): no effect off the "
          "NPU; each Session.run runs one training step")
    return tf.group(train_op, name="IterationOp")


def global_dict_init():
    _values.clear()


def set_value(key, value):
    _values[key] = value


def get_value(key, def_value=None):
    return _values.get(key, def_value)


def get_ranksize():
    from hccl.manage.api import get_rank_size

    return get_rank_size()
