"""tf_adapter ``npu_hook`` (hooks with a TF equivalent)."""
import tensorflow as tf

from npu_amp_tf.errors import OptionError

SessionRunHook = tf.compat.v1.train.SessionRunHook


class NPUBroadcastGlobalVariablesHook(SessionRunHook):
    """Broadcast the root rank's variables at start.  One worker: nothing to
    do; several: tf.distribute strategies keep replicas in sync themselves."""

    def __init__(self, root_rank=None, index=None):
        self._root_rank = root_rank
        self._index = index


class NPUCheckpointSaverHook(tf.compat.v1.train.CheckpointSaverHook):
    pass


class NPUOutputTensorHook(tf.compat.v1.train.LoggingTensorHook):
    """``NPUOutputTensorHook(tensors, dependencies=None, output_fn=None,
    output_every_n_steps=0)``: calls ``output_fn`` with the fetched tensors."""

    def __init__(self, tensors, dependencies=None, output_fn=None, output_every_n_steps=0):
        if output_every_n_steps < 0:
            raise OptionError(f"output_every_n_steps={output_every_n_steps} is not valid; accepted: >= 0")
        self._output_fn = output_fn
        n = output_every_n_steps or 1
        super().__init__(tensors, every_n_iter=n, formatter=self._fmt)

    def _fmt(self, values):
        if self._output_fn is not None:
            self._output_fn(values)
        return ", ".join(f"{k} = {v}" for k, v in values.items())


class SetIterationsVarHook(SessionRunHook):
    def __init__(self, iterations_per_loop=None):
        self._n = iterations_per_loop
