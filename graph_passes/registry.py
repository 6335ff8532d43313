"""What TensorFlow knows about ops: OpDefs, dtypes, kernels and shapes.

Everything here is cached per op type; the per-node work is a few dict
lookups, so the whole engine stays linear in the graph size.
"""
from __future__ import annotations

import functools
import re

from tensorflow.core.framework import types_pb2

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


def dtype_name(dt: int) -> str:
    from tensorflow.python.framework import dtypes
    try:
        return dtypes.as_dtype(dt).name
    except TypeError:
        return f"dtype({dt})"


def base_dtype(dt: int) -> int:
    return dt - REF_OFFSET if dt > REF_OFFSET else dt


@functools.lru_cache(maxsize=None)
def op_def(op_type: str):
    """The registered OpDef for ``op_type`` or None (unknown op or a function name)."""
    from tensorflow.python.framework import op_def_registry
    return op_def_registry.get(op_type)


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
        return list(a.list.type)
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
    for arg in list(od.input_arg) + list(od.output_arg):
        for n, k in ((arg.type_attr, 0), (arg.type_list_attr, 1), (arg.number_attr, 2)):
            if n:
                kinds.setdefault(n, k)
    return tuple(sorted(kinds.items()))


def _fingerprint(av, kind):
    if av is None:
        return None
    return av.type if kind == 0 else (tuple(av.list.type) if kind == 1 else av.i)


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
@functools.lru_cache(maxsize=None)
def _kernels(op_type: str):
    from tensorflow.python.framework import kernels
    try:
        kl = kernels.get_registered_kernels_for_op(op_type)
    except Exception:  # noqa: BLE001 - unknown op names raise inside TF
        return ()
    out = []
    for k in kl.kernel:
        cons = {c.name: frozenset(c.allowed_values.list.type) for c in k.constraint}
        out.append((k.device_type, k.label, cons))
    return tuple(out)


#: kernels that TensorFlow registers but that fail when run:
#: (op, device type, dtype) -> why.  has_kernel() treats them as absent.
BROKEN_KERNELS = {
    ("_FusedConv2D", "CPU", DT_HALF):
        "TF >= 2.16 registers it, but running it fails with 'Op does not support half inputs'",
}


def has_kernel(op_type: str, device_type: str = "CPU", type_attrs: dict | None = None) -> bool:
    """Is a *working* kernel registered for ``op_type`` on ``device_type``
    accepting these type attrs (attr name -> DataType)?  Labelled kernels and
    the known-broken registrations in :data:`BROKEN_KERNELS` are ignored."""
    type_attrs = type_attrs or {}
    for dt in type_attrs.values():
        if (op_type, device_type, dt) in BROKEN_KERNELS:
            return False
    for dev, label, cons in _kernels(op_type):
        if dev != device_type or label:
            continue
        if all(name not in cons or dt in cons[name] for name, dt in type_attrs.items()):
            return True
    return False


def kernel_devices(op_type: str) -> set[str]:
    return {dev for dev, _, _ in _kernels(op_type)}


_DEVICE_RE = re.compile(r"(?:/device:|/)(?P<type>[A-Za-z_]+):\d+\s*$")


def device_type_of(node, default: str = "CPU") -> str:
    """Device type from a node's device string (``/job:x/device:GPU:0`` -> ``GPU``)."""
    dev = node.device
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
