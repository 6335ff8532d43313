"""``hccl.manage.api`` rank helpers, answered from ``tf.distribute`` /
``TF_CONFIG`` or the ``RANK_SIZE`` / ``RANK_ID`` environment (1 and 0 alone).

Order: an active ``tf.distribute`` strategy (``num_replicas_in_sync`` and the
replica id in replica context), then ``TF_CONFIG`` (workers of the cluster,
the task index), then ``RANK_SIZE`` / ``RANK_ID`` (what Ascend launch scripts
export), else one worker.
"""
import json
import os

WORLD = "hccl_world_group"


def _tf_config():
    try:
        cfg = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
    except ValueError:
        return None
    cluster = cfg.get("cluster") or {}
    workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    if not workers:
        return None
    task = cfg.get("task") or {}
    idx = int(task.get("index", 0))
    if task.get("type") == "worker" and cluster.get("chief"):
        idx += len(cluster["chief"])
    return workers, idx


def _strategy():
    import tensorflow as tf

    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    return None


def _check_group(group):
    if group not in (WORLD, None):
        from npu_amp_tf.errors import OptionError

        raise OptionError(f"group={group!r} is not available off the NPU; accepted: "
                          f"'{WORLD}' (create_group is an HCCL device feature)")


def get_rank_size(group=WORLD):
    _check_group(group)
    s = _strategy()
    if s is not None:
        return int(s.num_replicas_in_sync)
    tc = _tf_config()
    if tc is not None:
        return tc[0]
    return int(os.environ.get("RANK_SIZE", "1"))


def get_rank_id(group=WORLD):
    _check_group(group)
    s = _strategy()
    if s is not None:
        import tensorflow as tf

        ctx = tf.distribute.get_replica_context()
        rid = getattr(ctx, "replica_id_in_sync_group", None) if ctx is not None else None
        if isinstance(rid, int):
            return rid
        resolver = getattr(s, "cluster_resolver", None)
        if resolver is not None and getattr(resolver, "task_id", None) is not None:
            return int(resolver.task_id)
    tc = _tf_config()
    if tc is not None:
        return tc[1]
    return int(os.environ.get("RANK_ID", "0"))


def get_local_rank_size(group=WORLD):
    _check_group(group)
    return int(os.environ.get("RANK_SIZE_LOCAL", os.environ.get("LOCAL_RANK_SIZE", "1")))


def get_local_rank_id(group=WORLD):
    _check_group(group)
    return int(os.environ.get("LOCAL_RANK_ID", "0"))


def get_world_rank_from_group_rank(group, group_rank_id):
    _check_group(group)
    return group_rank_id


def get_group_rank_from_world_rank(world_rank_id, group):
    _check_group(group)
    return world_rank_id


def create_group(group, rank_num, rank_ids):
    from npu_amp_tf.errors import OptionError

    raise OptionError(f"create_group({group!r}, ...) is an HCCL device feature with no equivalent "
                      "off the NPU; accepted: the world group 'hccl_world_group' only")


def destroy_group(group):
    _check_group(group)
