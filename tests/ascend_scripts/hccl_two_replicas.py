"""hccl_ops / rank helpers under a 2-replica MirroredStrategy (two logical CPUs)."""
import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from hccl.manage.api import get_rank_id, get_rank_size  # noqa: E402
from npu_bridge.hccl import hccl_ops  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def replica_fn():
    rid = tf.distribute.get_replica_context().replica_id_in_sync_group
    x = tf.cast(rid + 1, tf.float32) * tf.ones([2])           # replica 0: 1s, replica 1: 2s
    return (hccl_ops.allreduce(x, "sum"), hccl_ops.broadcast([x], 1)[0],
            hccl_ops.allgather(x, 2), tf.constant(get_rank_size()))


with strategy.scope():
    out = strategy.run(tf.function(replica_fn))
vals = [[strategy.experimental_local_results(t)[i].numpy().tolist() for t in out] for i in range(2)]
print("RESULT " + json.dumps({"replicas": vals}))
