"""NC1HWC0 ("5HD") and FRACTAL_Z: the one module for their shape math and the
NumPy reference conversions.  The layout pass, ``check_align`` and the tests
all use it; the C++ ``TransData`` kernel (custom_ops/trans_data.cc) must agree
with it bit for bit.

* ``NC1HWC0``: ``[N, C1, H, W, C0]`` with ``C1 = ceil(C / C0)``.
* ``FRACTAL_Z`` (conv filters): ``[C1*Kh*Kw, ceil(Cout/16), 16, C0]``, row
  ``(c1*Kh + kh)*Kw + kw``.
* ``C0`` is 16 for float16/float32/bfloat16 and 32 for int8/uint8.  Padding
  lanes are zero.

Example::

    >>> nc1hwc0_shape([1, 8, 8, 17], "NHWC", "float32")
    [1, 2, 8, 8, 16]
    >>> fractal_z_shape([3, 3, 17, 20], "float16")
    [18, 2, 16, 16]
"""
from __future__ import annotations

import numpy as np

from ..errors import NpuAmpError

N0 = 16          #: the FRACTAL_Z row block (Cout) and the cube's matrix tile
MATRIX_ALIGN = 16
ACTIVATION_FORMATS = ("NHWC", "NCHW")
FILTER_FORMATS = ("HWCN",)
ALL_FORMATS = ("NHWC", "NCHW", "C", "HWCN", "NC1HWC0", "FRACTAL_Z")

_C0_BY_DTYPE = {"float16": 16, "float32": 16, "bfloat16": 16, "half": 16, "float": 16,
                "int8": 32, "uint8": 32}


class FormatError(NpuAmpError, ValueError):
    """A format name, dtype or shape the 5HD conversions do not accept."""


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, (int, np.integer)):  # a DataType enum value
        import tensorflow as tf
        return tf.as_dtype(int(dtype)).name
    name = getattr(dtype, "name", None)
    if name is None:
        name = np.dtype(dtype).name
    return name


def c0_for(dtype) -> int:
    """C0 for a dtype (name, numpy/TF dtype or DataType enum)."""
    name = _dtype_name(dtype)
    if name not in _C0_BY_DTYPE:
        raise FormatError(f"dtype '{name}' has no NC1HWC0 layout; accepted: "
                          f"{sorted(set(_C0_BY_DTYPE) - {'half', 'float'})}")
    return _C0_BY_DTYPE[name]


def has_c0(dtype) -> bool:
    try:
        c0_for(dtype)
        return True
    except (FormatError, TypeError):
        return False


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pad_to(n: int, m: int) -> int:
    return ceil_div(n, m) * m


def _check_format(fmt, accepted, what="format"):
    if fmt not in accepted:
        raise FormatError(f"{what} '{fmt}' is not accepted; accepted: {list(accepted)}")


def channel_axis(fmt: str) -> int:
    _check_format(fmt, ACTIVATION_FORMATS)
    return 3 if fmt == "NHWC" else 1


def nc1hwc0_shape(shape, fmt: str = "NHWC", dtype="float32") -> list[int]:
    """5HD shape of a 4-D activation given in ``fmt`` (-1 dims stay -1)."""
    _check_format(fmt, ACTIVATION_FORMATS)
    if len(shape) != 4:
        raise FormatError(f"an {fmt} activation must be 4-D, got shape {list(shape)}")
    c0 = c0_for(dtype)
    if fmt == "NHWC":
        n, h, w, c = shape
    else:
        n, c, h, w = shape
    c1 = -1 if c is None or c < 0 else ceil_div(c, c0)
    return [n, c1, h, w, c0]


def fractal_z_shape(hwcn, dtype="float32") -> list[int]:
    """FRACTAL_Z shape of an HWCN (TF ``[Kh, Kw, Cin, Cout]``) filter."""
    if len(hwcn) != 4 or any(d is None or d < 0 for d in hwcn):
        raise FormatError(f"an HWCN filter needs a fully known 4-D shape, got {list(hwcn)}")
    kh, kw, ci, co = hwcn
    c0 = c0_for(dtype)
    return [ceil_div(ci, c0) * kh * kw, ceil_div(co, N0), N0, c0]


def padded_channels(c: int, dtype="float32") -> int:
    return pad_to(c, c0_for(dtype))


# ------------------------------------------------------- NumPy references
def to_nc1hwc0(x: np.ndarray, fmt: str = "NHWC", c0: int | None = None) -> np.ndarray:
    """NHWC/NCHW (or a per-channel vector with ``fmt='C'``) -> NC1HWC0, zero padded."""
    x = np.asarray(x)
    c0 = c0 or c0_for(x.dtype)
    if fmt == "C":
        x = x.reshape(1, 1, 1, -1)
        fmt = "NHWC"
    _check_format(fmt, ACTIVATION_FORMATS)
    if x.ndim != 4:
        raise FormatError(f"to_nc1hwc0: an {fmt} array must be 4-D, got shape {x.shape}")
    if fmt == "NCHW":
        x = x.transpose(0, 2, 3, 1)
    n, h, w, c = x.shape
    c1 = ceil_div(c, c0)
    xp = np.zeros((n, h, w, c1 * c0), dtype=x.dtype)
    xp[..., :c] = x
    return np.ascontiguousarray(xp.reshape(n, h, w, c1, c0).transpose(0, 3, 1, 2, 4))


def from_nc1hwc0(y: np.ndarray, fmt: str = "NHWC", channels: int | None = None) -> np.ndarray:
    """NC1HWC0 -> NHWC/NCHW (``fmt='C'``: the per-channel vector), dropping padding."""
    y = np.asarray(y)
    if y.ndim != 5:
        raise FormatError(f"from_nc1hwc0: input must be 5-D, got shape {y.shape}")
    n, c1, h, w, c0 = y.shape
    c = c1 * c0 if channels is None else channels
    if not (c1 - 1) * c0 < c <= c1 * c0:
        raise FormatError(f"from_nc1hwc0: {c} channels do not fit C1={c1}, C0={c0}")
    x = y.transpose(0, 2, 3, 1, 4).reshape(n, h, w, c1 * c0)[..., :c]
    if fmt == "C":
        return np.ascontiguousarray(x.reshape(c))
    _check_format(fmt, ACTIVATION_FORMATS)
    if fmt == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x)


def to_fractal_z(w: np.ndarray, c0: int | None = None) -> np.ndarray:
    """HWCN filter -> FRACTAL_Z, zero padded."""
    w = np.asarray(w)
    if w.ndim != 4:
        raise FormatError(f"to_fractal_z: an HWCN filter must be 4-D, got shape {w.shape}")
    c0 = c0 or c0_for(w.dtype)
    kh, kw, ci, co = w.shape
    c1, n1 = ceil_div(ci, c0), ceil_div(co, N0)
    wp = np.zeros((kh, kw, c1 * c0, n1 * N0), dtype=w.dtype)
    wp[:, :, :ci, :co] = w
    # [kh, kw, c1, c0, n1, n0] -> [c1, kh, kw, n1, n0, c0]
    f = wp.reshape(kh, kw, c1, c0, n1, N0).transpose(2, 0, 1, 4, 5, 3)
    return np.ascontiguousarray(f.reshape(c1 * kh * kw, n1, N0, c0))


def from_fractal_z(f: np.ndarray, hwcn) -> np.ndarray:
    """FRACTAL_Z -> HWCN of shape ``hwcn``, dropping padding."""
    f = np.asarray(f)
    kh, kw, ci, co = hwcn
    want = fractal_z_shape(hwcn, f.dtype) if has_c0(f.dtype) else None
    c0 = f.shape[-1]
    c1, n1 = ceil_div(ci, c0), ceil_div(co, N0)
    if want is not None and list(f.shape) != want or f.shape != (c1 * kh * kw, n1, N0, c0):
        raise FormatError(f"from_fractal_z: shape {f.shape} does not match HWCN {list(hwcn)}")
    w = f.reshape(c1, kh, kw, n1, N0, c0).transpose(1, 2, 0, 5, 3, 4)
    return np.ascontiguousarray(w.reshape(kh, kw, c1 * c0, n1 * N0)[:, :, :ci, :co])


INVERSE = {("NHWC", "NC1HWC0"): ("NC1HWC0", "NHWC"), ("NCHW", "NC1HWC0"): ("NC1HWC0", "NCHW"),
           ("C", "NC1HWC0"): ("NC1HWC0", "C"), ("HWCN", "FRACTAL_Z"): ("FRACTAL_Z", "HWCN")}
INVERSE.update({v: k for k, v in list(INVERSE.items())})
