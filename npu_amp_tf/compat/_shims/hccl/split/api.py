"""``hccl.split.api``: gradient split strategies steer HCCL's fused
all-reduce on the NPU; off the NPU they have no effect (logged once)."""
import logging

_logged = set()


def _note(name):
    if name not in _logged:
        _logged.add(name)
        logging.getLogger("npu_amp_tf").warning("hccl.split.api.%s: no effect off the NPU", name)


def set_split_strategy_by_idx(idxList, group="hccl_world_group"):  # noqa: N803 (tf_adapter name)
    _note("set_split_strategy_by_idx")


def set_split_strategy_by_size(dataSizeList, group="hccl_world_group"):  # noqa: N803
    _note("set_split_strategy_by_size")
