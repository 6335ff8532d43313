"""Issue 17: ``registry.has_kernel`` keeps its answers beside the kernel
cache it reads them from (``HAS_KERNEL_MEMO``).

The precision pass asks the same few dozen kernel questions of every graph
(per op type, device type and dtype); each answer walks the op's registered
kernels and its OpDef.  Kept answers must be the ones asked again
(``HAS_KERNEL_MEMO = False``, the reference) for every question the pass asks
of real graphs, they must not outlive the kernel table they came from, and
the pipeline's output must not change."""
import pytest

import npu_amp_tf
from graph_passes import registry
from npu_amp_tf import bridge
from test_precision_native import _graph

GRAPHS = ["keras_resnet50_training", "bert_like", "keras_transformer_training"]


@pytest.fixture(autouse=True)
def _library():
    bridge.register()


def _questions(k2):
    """Every (op, device type, type attrs) the precision pass asks of the
    test graphs in FP16 and BF16, recorded from the reference path."""
    asked = []
    orig = registry._has_kernel

    def spy(op, dev, attrs):
        asked.append((op, dev, dict(attrs)))
        return orig(op, dev, attrs)

    mp = pytest.MonkeyPatch()
    mp.setattr(registry, "_has_kernel", spy)
    mp.setattr(registry, "HAS_KERNEL_MEMO", False)
    try:
        for name in GRAPHS:
            gd, fetches = _graph(name, k2)
            for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
                npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode=mode)
    finally:
        mp.undo()
    return asked


def test_kept_answers_are_the_answers(k2, monkeypatch):
    asked = _questions(k2)
    ops = {q[0] for q in asked}
    assert len(ops) > 20, ops  # (the pass asked about most of the graphs' op types)
    dtypes = {dt for q in asked for dt in q[2].values()}
    assert {registry.DT_HALF, registry.DT_BFLOAT16, registry.DT_FLOAT} <= dtypes
    # the reference: each question answered again from the registry
    monkeypatch.setattr(registry, "HAS_KERNEL_MEMO", False)
    want = [registry.has_kernel(op, dev, attrs) for op, dev, attrs in asked]
    assert True in want and False in want
    monkeypatch.setattr(registry, "HAS_KERNEL_MEMO", True)
    monkeypatch.setattr(registry, "_HAS_KERNEL", {})
    first = [registry.has_kernel(op, dev, attrs) for op, dev, attrs in asked]
    again = [registry.has_kernel(op, dev, attrs) for op, dev, attrs in asked]
    assert first == want and again == want
    # known answers of TF's registry, derived without the memo's code
    assert registry.has_kernel("MatMul", "CPU", {"T": registry.DT_FLOAT})
    assert not registry.has_kernel("_FusedConv2D", "CPU", {"T": registry.DT_BFLOAT16})  # (OpDef refuses)
    assert not registry.has_kernel("NoSuchOp_npu_amp", "CPU", {"T": registry.DT_FLOAT})


def test_a_kept_answer_is_not_asked_again(monkeypatch):
    monkeypatch.setattr(registry, "HAS_KERNEL_MEMO", True)
    monkeypatch.setattr(registry, "_HAS_KERNEL", {})
    calls = []
    orig = registry._has_kernel
    monkeypatch.setattr(registry, "_has_kernel", lambda *a: calls.append(a[0]) or orig(*a))
    for _ in range(3):
        assert registry.has_kernel("Mul", "CPU", {"T": registry.DT_HALF})
    assert calls == ["Mul"]
    # another device, dtype or attr is another question
    registry.has_kernel("Mul", "GPU", {"T": registry.DT_HALF})
    registry.has_kernel("Mul", "CPU", {"T": registry.DT_BFLOAT16})
    assert calls == ["Mul"] * 3


def test_a_new_kernel_table_empties_the_answers(monkeypatch):
    """Answers read from one kernel table are dropped with it: a test (or a
    reload) that replaces ``_KERNELS`` gets its questions answered anew."""
    monkeypatch.setattr(registry, "HAS_KERNEL_MEMO", True)
    assert registry.has_kernel("Mul", "CPU", {"T": registry.DT_HALF})
    fetched = []
    orig = registry._kernels
    monkeypatch.setattr(registry, "_kernels", lambda op: fetched.append(op) or orig(op))
    assert registry.has_kernel("Mul", "CPU", {"T": registry.DT_HALF})
    assert fetched == []  # (kept)
    monkeypatch.setattr(registry, "_KERNELS", {})
    monkeypatch.setattr(registry, "_FETCHED", {})
    assert registry.has_kernel("Mul", "CPU", {"T": registry.DT_HALF})
    assert fetched == ["Mul"]
    # a planted answer in the new table's memo is what the memo returns:
    # the memo, not the registry, answered the kept question
    registry._HAS_KERNEL[("Mul", "CPU", (("T", registry.DT_HALF),))] = False
    assert registry.has_kernel("Mul", "CPU", {"T": registry.DT_HALF}) is False


@pytest.mark.parametrize("name", GRAPHS)
def test_pipeline_output_identical_with_and_without_kept_answers(k2, monkeypatch, name):
    gd, fetches = _graph(name, k2)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(registry, "HAS_KERNEL_MEMO", on)
        monkeypatch.setattr(registry, "_HAS_KERNEL", {})
        for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
            for _ in range(2):  # (the second run reads the kept answers)
                out, rep = npu_amp_tf.rewrite_graph(gd, fetches=fetches, precision_mode=mode)
                assert rep.summary.get("failed_pass") is None
                outs.setdefault(on, []).append(out.SerializeToString(deterministic=True))
    assert outs[True] == outs[False]
