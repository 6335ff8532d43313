"""tf_adapter ``npu_bridge.hccl.hccl_ops`` on ``tf.distribute`` collectives.

Inside ``strategy.run`` (replica context of a MirroredStrategy /
MultiWorkerMirroredStrategy) the ops are the strategy's all-reduce /
all-gather; with one worker and no strategy they are the identity (a world
of one rank), as HCCL is on a single device.
"""
import tensorflow as tf

from npu_amp_tf.errors import OptionError

_REDUCTIONS = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


def _replica_ctx():
    if not tf.distribute.has_strategy():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise OptionError("hccl_ops called in cross-replica context; call it inside strategy.run")
    return ctx if ctx.num_replicas_in_sync > 1 else None


def _check_group(group):
    if group != "hccl_world_group":
        raise OptionError(f"group={group!r} is not available off the NPU; accepted: 'hccl_world_group'")


def allreduce(tensor, reduction, fusion=1, fusion_id=-1, group="hccl_world_group"):
    """``reduction``: 'sum', 'mean' (tf.distribute), 'max' / 'min' / 'prod'
    (one worker only)."""
    _check_group(group)
    if reduction not in ("sum", "mean", "max", "min", "prod"):
        raise OptionError(f"allreduce(reduction={reduction!r}) is not valid; accepted: sum, mean, max, "
                          "min, prod")
    ctx = _replica_ctx()
    if ctx is None:
        return tf.identity(tensor) if not isinstance(tensor, (list, tuple)) else [
            tf.identity(t) for t in tensor]
    if reduction not in _REDUCTIONS:
        raise OptionError(f"allreduce(reduction={reduction!r}) across {ctx.num_replicas_in_sync} "
                          "replicas: tf.distribute reduces with sum or mean only")
    return ctx.all_reduce(_REDUCTIONS[reduction], tensor)


def allgather(tensor, rank_size, group="hccl_world_group", fusion=0, fusion_id=-1):
    _check_group(group)
    ctx = _replica_ctx()
    if ctx is None:
        return tf.identity(tensor)
    if rank_size != ctx.num_replicas_in_sync:
        raise OptionError(f"allgather(rank_size={rank_size}) but the strategy has "
                          f"{ctx.num_replicas_in_sync} replicas")
    return ctx.all_gather(tensor, axis=0)


def broadcast(tensor, root_rank, fusion=2, fusion_id=0, group="hccl_world_group"):
    """``tensor``: a list of tensors (as tf_adapter's HcomBroadcast); returns a
    list with root_rank's values on every replica."""
    _check_group(group)
    ctx = _replica_ctx()
    single = not isinstance(tensor, (list, tuple))
    tensors = [tensor] if single else list(tensor)
    if ctx is None:
        out = [tf.identity(t) for t in tensors]
    else:
        me = ctx.replica_id_in_sync_group
        is_root = tf.equal(me, root_rank)
        out = [ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                              tf.where(is_root, t, tf.zeros_like(t))) for t in tensors]
    return out[0] if single else out


def reduce(tensor, reduction, root_rank, fusion=0, fusion_id=-1, group="hccl_world_group"):
    return allreduce(tensor, reduction, fusion, fusion_id, group)
