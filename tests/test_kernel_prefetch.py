"""Issue 17: the kernels of a graph's op types are fetched with one scan of
TF's kernel registry (``registry.prefetch_kernels`` through
``NpuAmpKernelsForOps`` in custom_ops/grappler_bridge.cc) instead of one TF
call per op type, each of which scans the whole registry.

The oracle is TF's own per-op answer (``get_registered_kernels_for_op``
through the compat layer), for every op type ``tf.raw_ops`` names plus the
internal fused ops the passes emit and names TF does not know."""
import pytest
import tensorflow as tf
from tensorflow.core.framework import kernel_def_pb2

import npu_amp_tf
from graph_passes import _tf as gtf
from graph_passes import manager, registry
from npu_amp_tf import bridge
from test_speed_paths import _keras_resnet_training_graph, bert_like_training_graph

INTERNAL = ["_FusedConv2D", "_FusedMatMul", "_MklNativeFusedConv2D", "_FusedBatchNormEx",
            "LayerNorm", "LayerNormGrad", "NoSuchOp_npu_amp", "__inference_f_123"]


@pytest.fixture(autouse=True)
def _library():
    bridge.register()
    assert registry.native_kernels is bridge.kernels_for_ops, "the library did not install the registry scan"


@pytest.fixture
def fresh_caches(monkeypatch):
    """Empty process-wide kernel caches for the test (restored after it)."""
    monkeypatch.setattr(registry, "_KERNELS", {})
    monkeypatch.setattr(registry, "_FETCHED", {})


def _op_types():
    return sorted(n for n in dir(tf.raw_ops) if not n.startswith("__")) + INTERNAL


def test_one_scan_gives_tf_answer_for_every_op_type():
    ops = _op_types()
    assert len(ops) > 1000
    data = bridge.kernels_for_ops(ops)
    got = {op: [] for op in ops}
    for k in kernel_def_pb2.KernelList.FromString(data).kernel:
        got[k.op].append(k.SerializeToString(deterministic=True))
    empty = 0
    for op in ops:
        want = [k.SerializeToString(deterministic=True) for k in gtf.registered_kernels(op).kernel]
        assert got[op] == want, op  # the same kernels in the same order
        empty += not want
    assert got["MatMul"] and got["_FusedConv2D"] and got["LayerNorm"]
    assert not got["NoSuchOp_npu_amp"] and not got["__inference_f_123"]
    assert empty < len(ops) / 2
    assert bridge.kernels_for_ops(["NoSuchOp_npu_amp"]) == b""


def test_prefetch_fills_the_cache_without_per_op_calls(monkeypatch, fresh_caches):
    ops = ["MatMul", "Conv2D", "LayerNorm", "NoSuchOp_npu_amp"]
    want = {op: registry._kernel_entries(gtf.registered_kernels(op).kernel) for op in ops}

    def per_op_call(op):
        raise AssertionError(f"a per-op registry scan for '{op}' after the prefetch")

    monkeypatch.setattr(gtf, "registered_kernels", per_op_call)
    assert registry.prefetch_kernels(ops + ["MatMul"]) == 4
    assert registry.prefetch_kernels(ops) == 0  # all cached
    for op in ops:
        assert registry._kernels(op) == want[op]
    assert registry.has_kernel("MatMul", "CPU", {"T": registry.DT_BFLOAT16})
    assert not registry.has_kernel("NoSuchOp_npu_amp", "CPU", {"T": registry.DT_FLOAT})


@pytest.mark.parametrize("native", ["absent", "fails", "garbage"])
def test_without_a_working_library_scan_each_op_is_asked(monkeypatch, fresh_caches, native):
    def fails(ops):
        raise OSError("the library call failed")

    monkeypatch.setattr(registry, "native_kernels",
                        {"absent": None, "fails": fails, "garbage": lambda ops: b"\xff\xff\xff"}[native])
    asked = []
    orig = gtf.registered_kernels

    def per_op(op):
        asked.append(op)
        return orig(op)

    monkeypatch.setattr(gtf, "registered_kernels", per_op)
    assert registry.prefetch_kernels(["MatMul"]) == 0
    assert registry._kernels("MatMul") == registry._kernel_entries(orig("MatMul").kernel)
    assert asked == ["MatMul"]


@pytest.mark.parametrize("graph", ["keras_resnet50", "bert_like"])
def test_pipeline_output_identical_with_and_without_prefetch(monkeypatch, k2, graph):
    if graph == "keras_resnet50":
        gd, fetches = _keras_resnet_training_graph(k2), ["loss", "train"]
    else:
        gd, fetches = bert_like_training_graph(), ["loss", "train"]
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(registry, "_KERNELS", {})
        monkeypatch.setattr(registry, "_FETCHED", {})
        monkeypatch.setattr(manager.PassManager, "prefetch_kernels", on)
        calls = []
        orig = gtf.registered_kernels
        monkeypatch.setattr(gtf, "registered_kernels", lambda op, o=orig: calls.append(op) or o(op))
        for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
            out, rep = npu_amp_tf.rewrite_graph(gd, fetches=[f.split(":")[0] for f in fetches],
                                                precision_mode=mode)
            assert rep.summary.get("failed_pass") is None
            assert rep.summary["casts_inserted"] > 0
            outs.setdefault(on, []).append(out.SerializeToString(deterministic=True))
        monkeypatch.setattr(gtf, "registered_kernels", orig)
        if on:  # only op types the graph did not have go one at a time (the fused ops emitted)
            ops = {n.op for n in gd.node}
            assert not [op for op in calls if op in ops], calls
        else:
            assert len(calls) > 10
    assert outs[True] == outs[False]
