"""Python wrappers of the custom ops in ``libnpu_amp_tf.so`` and their gradients.

Importing this module builds (once, cached) and loads the library, which
registers the ops with TensorFlow, so GraphDefs rewritten by the layout pass
(which contain ``TransData`` nodes) can be imported and run.

* :func:`trans_data` -- GE's format conversion (NHWC/NCHW/C <-> NC1HWC0,
  HWCN <-> FRACTAL_Z).  Its gradient is the inverse ``TransData``.
"""
from __future__ import annotations

import tensorflow as tf

from . import _loader
from .errors import NpuAmpError

_TRANS_DATA_PAIRS = {
    ("NHWC", "NC1HWC0"), ("NCHW", "NC1HWC0"), ("C", "NC1HWC0"),
    ("NC1HWC0", "NHWC"), ("NC1HWC0", "NCHW"), ("NC1HWC0", "C"),
    ("HWCN", "FRACTAL_Z"), ("FRACTAL_Z", "HWCN"),
}
_TRANS_DATA_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.int8, tf.uint8)


def load():
    """The loaded op module (builds the library on first use)."""
    return _loader.load()


def trans_data(x, src_format: str, dst_format: str, orig_shape=None, name=None):
    """Convert ``x`` from ``src_format`` to ``dst_format``.

    ``orig_shape`` is the shape in the original (non-5HD) format; it is needed
    when converting back (``NC1HWC0 -> NHWC`` needs at least the channel count,
    ``FRACTAL_Z -> HWCN`` the full ``[Kh, Kw, Cin, Cout]``).  -1 marks dims
    taken from the input.
    """
    if (src_format, dst_format) not in _TRANS_DATA_PAIRS:
        raise NpuAmpError(
            f"trans_data: src_format={src_format!r}, dst_format={dst_format!r} is not a supported "
            f"conversion; accepted: {sorted(_TRANS_DATA_PAIRS)}")
    x = tf.convert_to_tensor(x)
    if x.dtype not in _TRANS_DATA_DTYPES:
        raise NpuAmpError(f"trans_data: dtype {x.dtype.name} is not supported; accepted: "
                          f"{[d.name for d in _TRANS_DATA_DTYPES]}")
    if orig_shape is None:
        orig_shape = []
        if dst_format in ("NHWC", "NCHW", "C", "HWCN"):
            raise NpuAmpError(f"trans_data: converting to {dst_format} needs orig_shape "
                              f"(the {dst_format} shape, -1 where unknown)")
    return load().trans_data(x, src_format=src_format, dst_format=dst_format,
                             orig_shape=[int(d) for d in orig_shape], name=name)


def _trans_data_grad(op, grad):
    """The inverse TransData: zero padding and dropping the padding are adjoint."""
    src = op.get_attr("src_format").decode()
    dst = op.get_attr("dst_format").decode()
    shape = op.inputs[0].shape
    orig = [-1 if d is None else int(d) for d in shape.as_list()] if shape.rank is not None else []
    if src == "HWCN" and (len(orig) != 4 or min(orig) < 0):
        raise NpuAmpError(f"TransData '{op.name}': the gradient needs a fully known HWCN filter "
                          f"shape, got {shape}")
    return load().trans_data(grad, src_format=dst, dst_format=src, orig_shape=orig)


def _register_gradients():
    try:
        tf.RegisterGradient("TransData")(_trans_data_grad)
    except KeyError:  # already registered (module reloaded)
        pass


load()
_register_gradients()

__all__ = ["trans_data", "load"]
