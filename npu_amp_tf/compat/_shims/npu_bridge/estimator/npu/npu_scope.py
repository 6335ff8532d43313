"""tf_adapter ``npu_scope``: ``keep_dtype_scope`` is the plugin's own (node
attr ``_keep_dtype``, honoured by the precision pass)."""
import contextlib

from npu_amp_tf.precision import keep_dtype_scope  # noqa: F401


@contextlib.contextmanager
def without_npu_compile_scope():
    """Ops inside run on the host on the NPU; everything runs on the host here."""
    yield
