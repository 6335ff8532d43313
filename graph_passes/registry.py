"""What TensorFlow knows about ops: OpDefs, dtypes, kernels and shapes.

Everything here is cached per op type; the per-node work is a few dict
lookups, so the whole engine stays linear in the graph size.
"""
from __future__ import annotations

import functools
import re

from tensorflow.core.framework import kernel_def_pb2, types_pb2

from . import _tf

DT_FLOAT = types_pb2.DT_FLOAT
DT_HALF = types_pb2.DT_HALF
DT_BFLOAT16 = types_pb2.DT_BFLOAT16
DT_DOUBLE = types_pb2.DT_DOUBLE
DT_RESOURCE = types_pb2.DT_RESOURCE
DT_VARIANT = types_pb2.DT_VARIANT
FLOAT_TYPES = frozenset({DT_FLOAT, DT_HALF, DT_BFLOAT16})
LOW_TYPES = frozenset({DT_HALF, DT_BFLOAT16})
REF_OFFSET = 100  # DT_FLOAT_REF == DT_FLOAT + 100

DTYPE_BY_NAME = {"float32": DT_FLOAT, "float16": DT_HALF, "bfloat16": DT_BFLOAT16,
                 "half": DT_HALF, "float": DT_FLOAT, "float64": DT_DOUBLE}


_DTYPE_NAMES: dict = {}


def dtype_name(dt: int) -> str:
    """``"float16"`` for DT_HALF... (memoised: the precision pass names a dtype
    in every decision it records)."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        import tensorflow as tf
        try:
            name = tf.as_dtype(dt).name
        except TypeError:
            name = f"dtype({dt})"
        _DTYPE_NAMES[dt] = name
    return name


def base_dtype(dt: int) -> int:
    return dt - REF_OFFSET if dt > REF_OFFSET else dt


@functools.lru_cache(maxsize=None)
def op_def(op_type: str):
    """The registered OpDef for ``op_type`` or None (unknown op or a function name)."""
    return _tf.op_def(op_type)


def signature_of(op_type: str, library=None):
    """OpDef-like signature: a registered OpDef, or a library function's signature."""
    od = op_def(op_type)
    if od is not None:
        return od
    if library is not None:
        fdef = library.get(op_type) if isinstance(library, dict) else None
        if fdef is not None:
            return fdef.signature
    return None


def _arg_dtypes(arg, attrs) -> list[int] | None:
    """Resolve one OpDef arg to its list of dtypes given the node's attrs."""
    if arg.type_list_attr:
        a = attrs.get(arg.type_list_attr)
        if a is None:
            return None
        return a.list.type[:]
    if arg.type_attr:
        a = attrs.get(arg.type_attr)
        if a is None:
            return None
        dt = a.type
    else:
        dt = arg.type
    if arg.is_ref:
        dt += REF_OFFSET
    if arg.number_attr:
        n = attrs.get(arg.number_attr)
        if n is None:
            return None
        return [dt] * n.i
    return [dt]


def _defaults(od, node_attr):
    """node attrs with OpDef defaults filled in (no copy when nothing is missing)."""
    missing = [a for a in od.attr if a.name not in node_attr and a.HasField("default_value")]
    if not missing:
        return node_attr
    attrs = dict(node_attr)
    for a in missing:
        attrs[a.name] = a.default_value
    return attrs


@functools.lru_cache(maxsize=None)
def _signature_attrs(op_type: str):
    """(name, kind) of the attrs that decide a registered op's arg dtypes and
    counts; kind 0: a type attr, 1: a type list, 2: a number attr."""
    od = op_def(op_type)
    if od is None:
        return None
    kinds = {}
    for arg in od.input_arg[:] + od.output_arg[:]:
        for n, k in ((arg.type_attr, 0), (arg.type_list_attr, 1), (arg.number_attr, 2)):
            if n:
                kinds.setdefault(n, k)
    return tuple(sorted(kinds.items()))


def _fingerprint(av, kind):
    if av is None:
        return None
    return av.type if kind == 0 else (tuple(av.list.type[:]) if kind == 1 else av.i)


_RANGES_CACHE: dict = {}


def _arg_ranges(node, library, which):
    names = _signature_attrs(node.op)
    if names is not None:  # registered op: memoised on the attrs that matter
        get = node.attr.get
        key = (node.op, which, tuple([_fingerprint(get(n), k) for n, k in names]))
        hit = _RANGES_CACHE.get(key, _RANGES_CACHE)
        if hit is not _RANGES_CACHE:
            return None if hit is None else [(a, s, c, list(d)) for a, s, c, d in hit]
        out = _compute_arg_ranges(node, library, which)
        _RANGES_CACHE[key] = None if out is None else tuple((a, s, c, tuple(d)) for a, s, c, d in out)
        return out
    return _compute_arg_ranges(node, library, which)


def _compute_arg_ranges(node, library, which):
    od = signature_of(node.op, library)
    if od is None:
        return None
    attrs = _defaults(od, node.attr)
    out, start = [], 0
    for arg in getattr(od, which):
        dts = _arg_dtypes(arg, attrs)
        if dts is None:
            return None
        out.append((arg.name, start, len(dts), dts))
        start += len(dts)
    return out


def output_arg_ranges(node, library=None):
    """[(arg_name, start, count, [dtypes])] for the node's outputs, or None if unknown."""
    return _arg_ranges(node, library, "output_arg")


def input_arg_ranges(node, library=None):
    """[(arg_name, start, count, [dtypes])] for the node's inputs, or None if unknown."""
    return _arg_ranges(node, library, "input_arg")


_DTYPES_CACHE: dict = {}


def _flat_dtypes(node, library, which):
    """Flat dtype list of a registered op's inputs/outputs, memoised like
    :func:`_arg_ranges`; ``False`` for ops that are not registered."""
    names = _signature_attrs(node.op)
    if names is None:
        return False
    get = node.attr.get
    key = (node.op, which, tuple([_fingerprint(get(n), k) for n, k in names]))
    hit = _DTYPES_CACHE.get(key, _DTYPES_CACHE)
    if hit is _DTYPES_CACHE:
        ranges = _arg_ranges(node, library, which)
        hit = _DTYPES_CACHE[key] = (None if ranges is None else
                                    tuple(dt for _, _, _, dts in ranges for dt in dts))
    return None if hit is None else list(hit)


def signature_key(node):
    """A hashable key that decides a registered op's input/output dtypes and
    counts (the op type and the attrs its args name), or None for an op that
    is not registered: nodes with equal keys have equal
    :func:`input_dtypes` / :func:`output_dtypes`."""
    names = _signature_attrs(node.op)
    if names is None:
        return None
    get = node.attr.get
    return (node.op, tuple([_fingerprint(get(n), k) for n, k in names]))


def output_dtypes(node, library=None) -> list[int] | None:
    flat = _flat_dtypes(node, library, "output_arg")
    if flat is not False:
        return flat
    ranges = _arg_ranges(node, library, "output_arg")
    if ranges is None:
        if node.op in ("_Arg", "_Retval") and "T" in node.attr:
            return [node.attr["T"].type] if node.op == "_Arg" else []
        return None
    return [dt for _, _, _, dts in ranges for dt in dts]


def input_dtypes(node, library=None) -> list[int] | None:
    flat = _flat_dtypes(node, library, "input_arg")
    if flat is not False:
        return flat
    ranges = _arg_ranges(node, library, "input_arg")
    if ranges is None:
        if node.op == "_Retval" and "T" in node.attr:
            return [node.attr["T"].type]
        if node.op == "_Arg":
            return []
        return None
    return [dt for _, _, _, dts in ranges for dt in dts]


# ---------------------------------------------------------------- kernels
#: ``fn(op types) -> bytes | None``: the serialized ``KernelList`` of every
#: kernel registered for those op types, from one scan of TF's kernel
#: registry (``NpuAmpKernelsForOps`` in custom_ops/grappler_bridge.cc; TF's
#: own call scans the whole registry once per op type).  graph_passes never
#: imports npu_amp_tf: the package installs it when its library is loaded;
#: None: :func:`_kernels` asks TF one op type at a time.
native_kernels = None

#: op type -> :func:`_kernels`' answer, process-wide (an op's kernels are
#: registered with its OpDef: the answer does not change)
_KERNELS: dict = {}
#: op type -> its ``KernelDef`` messages from :func:`prefetch_kernels`, until
#: :func:`_kernels` first reads them (most prefetched op types are never asked)
_FETCHED: dict = {}


def _kernel_entries(kernels):
    return tuple((k.device_type, k.label, {c.name: frozenset(c.allowed_values.list.type[:]) for c in k.constraint})
                 for k in kernels)


def _kernels(op_type: str):
    """(device type, label, {attr: allowed dtypes}) per registered kernel.

    TF answers an unknown op name with an empty list; any exception from TF
    here is a real fault and propagates (the pass manager turns it into a
    report warning and keeps the original graph)."""
    out = _KERNELS.get(op_type)
    if out is None:
        kernels = _FETCHED.pop(op_type, None)
        if kernels is None:
            kernels = _tf.registered_kernels(op_type).kernel
        out = _KERNELS[op_type] = _kernel_entries(kernels)
    return out


def prefetch_kernels(op_types) -> int:
    """Fill :func:`_kernels`' cache for every op type in ``op_types`` not in
    it yet, with one scan of TF's registry (:data:`native_kernels`): the
    same entries, in the same order, as one TF call per op type.  Returns
    how many op types were fetched (0 without the native scan, when all
    were cached already, or when the scan failed: then each op type is
    asked of TF when first needed, as without it)."""
    fn = native_kernels
    if fn is None:
        return 0
    missing = [op for op in dict.fromkeys(op_types) if op not in _KERNELS and op not in _FETCHED]
    if not missing:
        return 0
    try:
        data = fn(missing)
        if data is None:
            return 0
        found = kernel_def_pb2.KernelList.FromString(data).kernel
    except Exception:  # noqa: BLE001 - a shortcut only: TF's per-op call answers instead
        return 0
    grouped = {op: [] for op in missing}
    for k in found:
        if k.op in grouped:
            grouped[k.op].append(k)
    for op, kernels in grouped.items():
        _FETCHED.setdefault(op, kernels)
    return len(missing)


#: known-broken combinations: (op, device type, dtype) -> why.  TensorFlow
#: registers a kernel for each of them, but using it fails or aborts the
#: process.  has_kernel() treats them as absent, so no pass ever creates them.
#: One line per entry, each with the evidence (tests/test_bf16_safety.py
#: proves every entry is avoided).
BROKEN_KERNELS = {
    ("_FusedConv2D", "CPU", DT_HALF):
        "TF >= 2.16 registers it, but running it fails with 'Op does not support half inputs'",
    ("_FusedConv2D", "CPU", DT_BFLOAT16):
        "a CPU kernel is registered, but the OpDef does not allow T=bfloat16: with oneDNN off TF "
        "rejects the node; with oneDNN on it runs only through the MKL rewrite, and aborted the "
        "process (tensor.cc 'Check failed: dtype() == expected_dtype') when a fused arg stayed float",
}


def onednn_enabled() -> bool:
    """Is TensorFlow's oneDNN (MKL) path on in this process (``TF_ENABLE_ONEDNN_OPTS``)?
    See :func:`graph_passes._tf.onednn_enabled`."""
    return _tf.onednn_enabled()


def _tf_version() -> tuple:
    import tensorflow as tf
    return tuple(int(p) for p in re.findall(r"\d+", tf.__version__)[:2])


#: broken only when oneDNN is off: (op, device, dtype) -> (first TF version
#: that fixed it or None, why).  Measured with benchmarks/fused_forms.py.
_BROKEN_WITHOUT_ONEDNN = {
    ("_FusedMatMul", "CPU", DT_BFLOAT16):
        ((2, 16), "TF 2.15 with oneDNN off registers it, but running it fails with "
                  "'Op does not support bfloat16 inputs'"),
    **{("_FusedDepthwiseConv2dNative", "CPU", dt):
        (None, "with oneDNN off the registered kernel produces no output ('Missing 0-th output')")
       for dt in (DT_FLOAT, DT_HALF, DT_BFLOAT16, DT_DOUBLE)},
}


#: fused activations a registered fused kernel does not implement in a dtype:
#: (op, device, dtype, fused op) -> (first TF version where it is broken, why).
#: Measured by running each combination (TF 2.15.1 and 2.21.0, oneDNN on).
BROKEN_FUSED_OPS = {
    **{("_FusedMatMul", "CPU", DT_HALF, act):
        ((2, 16), f"TF >= 2.16 registers an FP16 _FusedMatMul CPU kernel, but running it with "
                  f"{act} fails with 'Fusion is not implemented: [BiasAdd,{act}]'")
       for act in ("GeluExact", "GeluApproximate")},
}


def fused_ops_broken(op_type: str, device_type: str, dtype, fused_ops) -> str | None:
    """Why ``op_type`` in ``dtype`` cannot run with these ``fused_ops`` (names,
    str or bytes) on ``device_type`` although a kernel is registered, or None."""
    ver = None
    for f in fused_ops or ():
        f = f.decode() if isinstance(f, bytes) else f
        entry = BROKEN_FUSED_OPS.get((op_type, device_type, dtype, f))
        if entry is None:
            continue
        ver = ver or _tf_version()
        if ver >= entry[0]:
            return entry[1]
    return None


#: unusable only when oneDNN is on: (op, device, dtype) -> (first TF version, why).
#: The kernel runs and is correct, but so slowly that using it is a defect.
_BROKEN_WITH_ONEDNN = {
    ("_FusedMatMul", "CPU", DT_HALF):
        ((2, 16), "TF >= 2.16 with oneDNN runs an FP16 _FusedMatMul as _MklNativeFusedMatMul, which "
                  "took 3-10 s per op on a BERT-like training step whose weights are variables "
                  "(measured 2026-12-02, TF 2.21.0, avx512_fp16 CPU: a 1-layer b1 step 32 s, vs "
                  "0.7 s for FP16 MatMul + BiasAdd unfused)"),
}


#: reductions whose BF16 CPU kernel accumulates in FP32, so that in BF16 only
#: the result is rounded: op -> (first TF version measured so, evidence).  TF
#: versions before it are treated as accumulating in BF16 (unmeasured or
#: measured so).  Measured 2026-12-02 by reducing BF16 tensors of U(0.5, 1.5)
#: values and comparing with the exact float64 reduction of the same BF16
#: values (an FP32 accumulator rounds once: <= 2^-8 = 3.9e-3 relative), over
#: 3072 / 1024 / 16 / 32768 / 8192 elements on the inner, outer, middle and
#: all axes ([1024,3072] axis -1, [1024,768] axis 0, [16,4,4,2048] axes 1-2,
#: [8,64,64,64] axes 0-2, [4,8192,4] axis 1, full reductions); the same check
#: runs in tests/test_precision_reductions.py against the real kernel.  TF
#: 2.16-2.20 were not measured.  Not listed because they do not: ``Prod``
#: (0.44-1.0 relative error over >= 1024 factors on both versions; a product compounds one
#: rounding per factor), TF 2.15's ``Mean``.
BF16_FP32_ACCUMULATION = {
    "Mean": ((2, 21), "TF 2.21.0's BF16 Mean rounds only its result (<= 3.9e-3 relative in every "
                      "layout); TF 2.15.1's accumulates in BF16 on inner/outer reductions (0.94 "
                      "relative over [8,64,64,64] axes 0-2 and [4,8192,4] axis 1, 2.6e-2 over 1024 rows)"),
    "Sum": ((2, 15), "BF16 Sum rounds only its result on TF 2.15.1 and 2.21.0 (<= 3.9e-3 relative "
                     "in every layout, 32768 elements included)"),
    "EuclideanNorm": ((2, 15), "rounds only its result on TF 2.15.1 and 2.21.0 (<= 3.9e-3 relative)"),
}


def bf16_accumulates_in_fp32(op_type: str) -> str | None:
    """Why ``op_type``'s BF16 CPU kernel in this TensorFlow accumulates in
    FP32 (see :data:`BF16_FP32_ACCUMULATION`), or None if it may not."""
    entry = BF16_FP32_ACCUMULATION.get(op_type)
    if entry is None or _tf_version() < entry[0]:
        return None
    return entry[1]


def _install_conditional_broken():
    ver = _tf_version()
    if onednn_enabled():
        for key, (first, why) in _BROKEN_WITH_ONEDNN.items():
            if ver >= first:
                BROKEN_KERNELS.setdefault(key, why + " (this process runs with oneDNN on)")
        return
    for key, (fixed_in, why) in _BROKEN_WITHOUT_ONEDNN.items():
        if fixed_in is None or ver < fixed_in:
            BROKEN_KERNELS.setdefault(key, why + " (this process runs with oneDNN off)")


_install_conditional_broken()


@functools.lru_cache(maxsize=None)
def allowed_types(op_type: str) -> dict:
    """{type or list(type) attr name: frozenset of allowed dtypes, or None = any}
    from the op's OpDef ({} for an unknown op)."""
    od = op_def(op_type)
    if od is None:
        return {}
    out = {}
    for a in od.attr:
        if a.type in ("type", "list(type)"):
            allowed = a.allowed_values.list.type if a.HasField("allowed_values") else ()
            out[a.name] = frozenset(allowed) if allowed else None
    return out


def opdef_allows(op_type: str, type_attrs: dict) -> bool:
    """Does the OpDef of ``op_type`` accept these dtypes (attr name -> DataType
    or list of DataTypes, for ``type`` and ``list(type)`` attrs)?"""
    allowed = allowed_types(op_type)
    for name, dt in type_attrs.items():
        ok = allowed.get(name)
        if ok is None:
            continue
        for d in (dt if isinstance(dt, (list, tuple)) else (dt,)):
            if d not in ok:
                return False
    return True


#: fused forms measured with benchmarks/fused_forms.py (TF 2.15.1 and 2.21.0, oneDNN on,
#: avx512_bf16): (generic fused op, device, dtype) -> (op to emit instead, its ``_kernel``
#: label, evidence).  Used only when oneDNN is on.  The generic op's OpDef refuses
#: the dtype, the oneDNN op's OpDef allows it and its kernel (registered under the
#: label) runs the whole conv+bias+activation in one BF16 primitive.
FUSED_FORMS = {
    ("_FusedConv2D", "CPU", DT_BFLOAT16): (
        "_MklNativeFusedConv2D", "MklNameChangeOp",
        "OpDef allows bfloat16 (2.15 and 2.21); conv+bias+relu 16x56x56x64 3x3: one BF16 "
        "primitive, faster than Conv2D+BiasAdd+Relu in BF16 (oneDNN merges only conv+bias)"),
}

#: the training batch norm forms the ``batch_norm_moments`` fusion rule chooses between,
#: measured (benchmarks/bn_forms.py: forward + backward at ResNet-50's shapes, batch 16,
#: 128²; tests/test_fusion_batch_norm.py checks the semantics on both TF lanes):
#: (TF minor, oneDNN on?) -> evidence.  FusedBatchNormV3(is_training) output 2 is the
#: Bessel-corrected variance (x n/(n-1), relative 3e-7 in FP32) and reserve_space_2 the
#: biased one, on 2.15.1 and 2.21.0, oneDNN on and off; T=bfloat16 (U=float) runs forward
#: and FusedBatchNormGradV3 backward on both, oneDNN on and off.  FP16 not measured.
BN_FUSED_FORMS = {
    ("2.21", True): "fused 2.6-3.7x (FP32), 2.0-3.9x (BF16) faster than the moments form; BF16 fused "
                    "2.4-5.6x faster than FP32 moments (sum over 5 shapes 78 vs 350 ms)",
    ("2.15", True): "fused 2.3-3.8x (FP32), 1.9-3.4x (BF16) faster; BF16 fused vs FP32 moments "
                    "2.0-3.6x (65 vs 198 ms)",
    ("2.21", False): "fused 1.4-2.1x (FP32), 1.2-1.5x (BF16) faster (Eigen kernels)",
    ("2.15", False): "fused 1.3-1.6x (FP32), 1.3-1.4x (BF16) faster (Eigen kernels)",
}

#: ops whose kernels are registered under a label and that the passes emit with
#: ``_kernel=<label>`` (so TF selects exactly that kernel): has_kernel accepts it
KERNEL_LABELS = {form[0]: form[1] for form in FUSED_FORMS.values()}


def fused_form(op_type: str, device_type: str, dtype: int):
    """(op, kernel label) to emit for ``op_type`` running in ``dtype`` on
    ``device_type``, or None when the generic op is the one to emit."""
    form = FUSED_FORMS.get((op_type, device_type, dtype))
    if form is None or not onednn_enabled():
        return None
    return form[0], form[1]


def has_kernel(op_type: str, device_type: str = "CPU", type_attrs: dict | None = None) -> bool:
    """Is a *working* kernel registered for ``op_type`` on ``device_type``
    accepting these type attrs (attr name -> DataType)?  The dtypes must be
    allowed by the op's OpDef as well (TF registers kernels for some dtypes
    their OpDef refuses, e.g. ``_FusedConv2D`` bfloat16 on CPU).  Labelled
    kernels and the known-broken registrations in :data:`BROKEN_KERNELS` are
    ignored.  (issue 17) The answers are kept as long as :func:`_kernels`'
    cache, whose entries they are read from (a new ``_KERNELS`` table empties
    them); :data:`HAS_KERNEL_MEMO` False: every question answered again."""
    type_attrs = type_attrs or {}
    if HAS_KERNEL_MEMO:
        if _HAS_KERNEL_OF[0] is not _KERNELS:
            _HAS_KERNEL.clear()
            _HAS_KERNEL_OF[0] = _KERNELS
        key = (op_type, device_type, tuple(type_attrs.items()))
        got = _HAS_KERNEL.get(key)
        if got is not None:
            return got
        got = _HAS_KERNEL[key] = _has_kernel(op_type, device_type, type_attrs)
        return got
    return _has_kernel(op_type, device_type, type_attrs)


#: (issue 17) :func:`has_kernel` keeps its answers beside :func:`_kernels`'
#: cache (the precision pass asks the same few dozen questions of every
#: graph); False: asked again each time (the reference; the same answers)
HAS_KERNEL_MEMO = True
_HAS_KERNEL: dict = {}  # (op, device type, type attrs in order) -> has_kernel's answer
_HAS_KERNEL_OF = [None]  # the _KERNELS table the answers were read from


def _has_kernel(op_type: str, device_type: str, type_attrs: dict) -> bool:
    for dt in type_attrs.values():
        if (op_type, device_type, dt) in BROKEN_KERNELS:
            return False
    if not opdef_allows(op_type, type_attrs):
        return False
    for dev, label, cons in _kernels(op_type):
        if dev != device_type or (label and label != KERNEL_LABELS.get(op_type)):
            continue
        if all(name not in cons or dt in cons[name] for name, dt in type_attrs.items()):
            return True
    return False


#: list(type) attrs whose entries carry the same dtype as a type attr of the
#: op (the fused extra args: bias, BN parameters, side input).  When a pass
#: re-types the type attr, these entries follow (see :func:`retype`).
LIST_ATTRS_FOLLOW = {
    "_FusedConv2D": {"TArgs": "T"},
    "_MklNativeFusedConv2D": {"TArgs": "T"},
    "_FusedConv3D": {"TArgs": "T"},
}


def retype(node, attrs, dt: int):
    """Set the float type attrs ``attrs`` of ``node`` to ``dt``, and the
    entries of the list(type) attrs tied to them (:data:`LIST_ATTRS_FOLLOW`)
    that held the old dtype, so fused args follow the op's dtype."""
    amap = node.attr
    follow = LIST_ATTRS_FOLLOW.get(node.op)
    for a in attrs:
        av = amap.get(a)  # (one map lookup when the attr is there: the usual case)
        if av is None:
            old = None
            amap[a].type = dt
        else:
            old = av.type
            av.type = dt
        if not follow:
            continue
        for lst, owner in follow.items():
            if owner != a or lst not in amap:
                continue
            types = amap[lst].list.type
            for i, t in enumerate(types):
                if t == old or (old is None and t in FLOAT_TYPES):
                    types[i] = dt


def retype_all(nodes, op: str, attrs, dt: int):
    """:func:`retype` of every node of ``nodes``, all of op type ``op``: the
    attr writes in one loop (an op without tied list attrs: the usual case)."""
    if op in LIST_ATTRS_FOLLOW:
        for node in nodes:
            retype(node, attrs, dt)
        return
    if len(attrs) == 1:  # (the usual case: one type attr, "T")
        a, = attrs
        for node in nodes:
            node.attr[a].type = dt  # (a message map's item: made when absent)
        return
    for node in nodes:
        amap = node.attr
        for a in attrs:
            amap[a].type = dt


def kernel_devices(op_type: str) -> set[str]:
    return {dev for dev, _, _ in _kernels(op_type)}


_DEVICE_RE = re.compile(r"(?:/device:|/)(?P<type>[A-Za-z_]+):\d+\s*$")


def device_type_of(node, default: str = "CPU") -> str:
    """Device type from a node's device string (``/job:x/device:GPU:0`` -> ``GPU``)."""
    return device_type_named(node.device, default)


def device_type_named(dev: str, default: str = "CPU") -> str:
    """Device type from a device string (:func:`device_type_of`)."""
    if not dev:
        return default
    m = _DEVICE_RE.search(dev)
    if not m:
        return default
    t = m.group("type").upper()
    return "GPU" if t in ("GPU", "XLA_GPU") else ("CPU" if t in ("CPU", "XLA_CPU") else t)


# ----------------------------------------------------------------- shapes
def static_shapes(node):
    """Output shapes recorded in ``_output_shapes`` (see :mod:`graph_passes.shapes`)."""
    from .shapes import static_shapes as _static
    return _static(node)


def infer_shapes(graph_def):
    """Output shapes from grappler's C++ shape inference (see
    :func:`graph_passes.shapes.infer_shapes`); a mapping with ``.get``."""
    from .shapes import infer_shapes as _infer
    return _infer(graph_def)
