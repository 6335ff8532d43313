"""tf_adapter ``npu_estimator``: ``NPUEstimator`` / ``NPUEstimatorSpec``
(TensorFlow <= 2.15, where ``tf.estimator`` exists), real subclasses of
``tf.estimator.Estimator`` / ``tf.estimator.EstimatorSpec``."""
import tensorflow as tf

from npu_amp_tf.errors import OptionError

if not hasattr(tf, "estimator"):
    raise ImportError(f"npu_bridge.estimator.npu.npu_estimator needs tf.estimator, which TensorFlow "
                      f"{tf.__version__} no longer ships (removed in 2.16); use TensorFlow <= 2.15")


class NPUEstimatorSpec(tf.estimator.EstimatorSpec):
    """``EstimatorSpec`` plus tf_adapter's ``host_call=(fn, tensors)``: on the
    NPU ``fn`` runs on the host on outfed tensors; here it is called on the
    tensors in the graph (its summaries are written like any other)."""

    def __new__(cls, mode, predictions=None, loss=None, train_op=None, eval_metric_ops=None,
                export_outputs=None, training_chief_hooks=None, training_hooks=None, scaffold=None,
                evaluation_hooks=None, prediction_hooks=None, host_call=None):
        if host_call is not None:
            if not (isinstance(host_call, (list, tuple)) and len(host_call) == 2
                    and callable(host_call[0])):
                raise OptionError(f"host_call={host_call!r} is not valid; accepted: (fn, tensors)")
            fn, tensors = host_call
            if isinstance(tensors, dict):
                fn(**tensors)
            else:
                fn(*tensors)
        spec = super().__new__(cls, mode=mode, predictions=predictions, loss=loss, train_op=train_op,
                               eval_metric_ops=eval_metric_ops, export_outputs=export_outputs,
                               training_chief_hooks=training_chief_hooks,
                               training_hooks=training_hooks, scaffold=scaffold,
                               evaluation_hooks=evaluation_hooks, prediction_hooks=prediction_hooks)
        spec._host_call = host_call
        return spec


class NPUEstimator(tf.estimator.Estimator):
    """``NPUEstimator(model_fn=None, model_dir=None, config=None, params=None,
    job_start_file='', warm_start_from=None)``.  A config that is not an
    ``NPURunConfig`` gets the plugin entry (``npu_run_config_init``)."""

    def __init__(self, model_fn=None, model_dir=None, config=None, params=None, job_start_file="",
                 warm_start_from=None):
        from npu_bridge.estimator.npu.npu_config import NPURunConfig

        if config is None or not isinstance(config, NPURunConfig):
            from npu_bridge.npu_init import npu_run_config_init

            config = npu_run_config_init(config if config is not None else tf.estimator.RunConfig(
                model_dir=model_dir))
        self._job_start_file = job_start_file
        super().__init__(model_fn=model_fn, model_dir=model_dir, config=config, params=params,
                         warm_start_from=warm_start_from)
