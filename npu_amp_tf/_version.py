"""Version and the supported TensorFlow range."""
__version__ = "0.1.0"

TF_MIN = (2, 15, 0)
TF_MAX_EXCLUSIVE = (2, 22, 0)
SUPPORTED_RANGE = "tensorflow (or tensorflow-cpu) >=2.15,<2.22 (2.15.1 primary, tested up to 2.21)"


def _parse(v):
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def check_tensorflow():
    """Fail at import with a message naming the supported range."""
    try:
        import tensorflow as tf  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"npu_amp_tf needs TensorFlow: install {SUPPORTED_RANGE}, for example "
            "`pip install 'npu-amp-tf[cpu]'` or `pip install 'npu-amp-tf[gpu]'` "
            f"(import failed: {exc})") from exc
    ver = _parse(tf.__version__)
    if not (TF_MIN <= ver < TF_MAX_EXCLUSIVE):
        raise ImportError(
            f"npu_amp_tf supports {SUPPORTED_RANGE}; found TensorFlow {tf.__version__}")
    return tf.__version__
