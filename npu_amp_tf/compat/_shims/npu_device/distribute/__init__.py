"""tf_adapter ``npu_device.distribute`` on ``tf.distribute`` collectives
(identity with one worker)."""
from npu_bridge.hccl import hccl_ops as _hccl


def all_reduce(values, reduction="mean", fusion=1, fusion_id=-1, group="hccl_world_group"):
    single = not isinstance(values, (list, tuple))
    vals = [values] if single else list(values)
    out = [None if v is None else _hccl.allreduce(v, reduction, fusion, fusion_id, group) for v in vals]
    return out[0] if single else out


def broadcast(values, root_rank=0, fusion=2, fusion_id=0, group="hccl_world_group"):
    import tensorflow as tf

    single = not isinstance(values, (list, tuple))
    vals = [values] if single else list(values)
    for v in vals:
        if isinstance(v, tf.Variable):
            v.assign(_hccl.broadcast(v.read_value(), root_rank, fusion, fusion_id, group))
    return values


def npu_distributed_keras_optimizer_wrapper(optimizer, reduce_reduction="mean", fusion=1, fusion_id=-1,
                                            group="hccl_world_group"):
    """Keras optimizers under tf.distribute all-reduce their gradients
    themselves; with one worker nothing is needed.  Returns ``optimizer``."""
    return optimizer


def npu_callbacks_append(callbacks_list=()):
    return list(callbacks_list) if isinstance(callbacks_list, list) else []


def shard_and_rebatch_dataset(dataset, global_bs):
    from hccl.manage.api import get_rank_id, get_rank_size

    n = get_rank_size()
    if global_bs % n:
        from npu_amp_tf.errors import OptionError

        raise OptionError(f"global_bs={global_bs} is not divisible by the rank size {n}")
    return dataset.shard(n, get_rank_id()).batch(global_bs // n) if n > 1 else dataset.batch(global_bs)
