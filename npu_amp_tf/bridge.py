"""The Python side of the grappler bridge (``custom_ops/grappler_bridge.cc``).

``import npu_amp_tf`` calls :func:`register`, which builds/loads the custom-op
library (``_loader.load()``, which also registers the ``NpuAmpOptimizer``
grappler optimizer) and hands the library a ctypes callback.  From then on,
whenever grappler optimizes a graph whose ``RewriterConfig`` lists a custom
optimizer named ``NpuAmpOptimizer`` (a TF1 ``Session`` graph, or a TF2
``tf.function``/Keras function called under :func:`npu_amp_tf.enable`), the
C++ optimizer calls :func:`_on_optimize` with the serialized ``GraphDef``, the
serialized ``parameter_map`` entry, the fetch and preserved node names and the
device list.  This module validates the parameters with
:meth:`Options.from_parameter_map`, runs :func:`npu_amp_tf.pipeline.optimize`
and hands the serialized result back.

Error policy (see ``docs/bridge.md``)
-------------------------------------
Grappler swallows every error a custom optimizer returns: the meta-optimizer
logs it and keeps the graph, and even with
``rewrite_options.fail_on_optimizer_errors`` the callers (TF1
``GraphExecutionState::BuildGraph``, TF2 function instantiation) fall back to
the unoptimized graph.  ``Init()`` errors are swallowed the same way.  So the
errors a user must see are delivered *through the graph*:

* **invalid parameters** (unknown key, bad value, unreadable mixlist...): the
  returned graph gets an ``NpuAmpRaiseError`` node that every root node waits
  on; the first ``Session.run`` / function call raises
  ``tf.errors.InvalidArgumentError`` whose message is the options module's
  message (prefixed with ``npu_amp_tf:``).  The error is also logged and kept
  in :func:`last_reports`.
* **a pass fails** (``PassError``): the graph is returned unchanged, a
  warning naming the pass and the node is logged and recorded; with
  ``fail_on_error=True`` the graph fails at run time the same way as above,
  carrying the ``PassError`` message.
"""
from __future__ import annotations

import array
import atexit
import collections
import ctypes
import hashlib
import json
import logging
import os
import re
import threading
import time

log = logging.getLogger("npu_amp_tf")

OPTIMIZER_NAME = "NpuAmpOptimizer"
RAISE_OP = "NpuAmpRaiseError"
_RAISE_OP_BYTES = RAISE_OP.encode()
#: name of the node inserted when the parameters are invalid
INVALID_OPTIONS_NODE = "npu_amp_tf/InvalidOptions"
#: name of the node inserted when a pass failed and fail_on_error=True
PASS_FAILED_NODE = "npu_amp_tf/PassFailed"
_POISON_NODES = (INVALID_OPTIONS_NODE, PASS_FAILED_NODE)
_ARG_LIKE = ("_Arg", "Placeholder", "PlaceholderWithDefault", "PlaceholderV2")

#: callback return codes (see grappler_bridge.cc); RC_UNCHANGED tells the C++
#: side to remember the graph as needing nothing, RC_NOT_NOW does not
RC_OK, RC_UNCHANGED, RC_ERROR, RC_NOT_NOW = 0, 1, 2, 3

_CALLBACK_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,                    # sink
    ctypes.c_void_p, ctypes.c_size_t,   # graph bytes
    ctypes.c_void_p, ctypes.c_size_t,   # RewriterConfig.CustomGraphOptimizer bytes
    ctypes.c_char_p,                    # fetch, '\n'-joined
    ctypes.c_char_p,                    # nodes to preserve, '\n'-joined
    ctypes.c_char_p,                    # device names, '\n'-joined
    ctypes.c_char_p)                    # grappler item id

_lock = threading.Lock()
_lib = None
_callback = None            # keep the ctypes thunk alive
_tls = threading.local()    # re-entrancy guard
_REPORTS_MAX = 64
_reports: collections.deque = collections.deque(maxlen=_REPORTS_MAX)
_MEMO_MAX = 16
_memo: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_stats = collections.Counter()


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------
def library():
    """The ctypes handle on the custom-op library (built and loaded on demand).

    ``tf.load_op_library`` and ``ctypes.CDLL`` both ``dlopen`` the same path,
    which returns the same handle: one copy of the library's globals."""
    global _lib
    with _lock:
        if _lib is None:
            from . import _loader

            _loader.load()  # registers NpuAmpOptimizer and NpuAmpRaiseError with TF
            lib = ctypes.CDLL(str(_loader.library_path()))
            lib.NpuAmpSetCallback.argtypes = [_CALLBACK_TYPE]
            lib.NpuAmpSetCallback.restype = None
            lib.NpuAmpWriteResult.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.NpuAmpWriteResult.restype = None
            lib.NpuAmpWriteError.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.NpuAmpWriteError.restype = None
            lib.NpuAmpOptimizeCount.restype = ctypes.c_uint64
            lib.NpuAmpStateAddress.restype = ctypes.c_void_p
            lib.NpuAmpHasCallback.restype = ctypes.c_int
            lib.NpuAmpInFlight.restype = ctypes.c_int
            lib.NpuAmpBridgeAbiVersion.restype = ctypes.c_int
            _shape_fns = (
                ("NpuAmpItemShapes", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_size_t)]),
                ("NpuAmpGraphShapes", [ctypes.c_char_p, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]))
            for fn, argtypes in _shape_fns:
                getattr(lib, fn).argtypes = argtypes
                getattr(lib, fn).restype = ctypes.c_int
            for fn, argtypes in (
                    ("NpuAmpItemIndex", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_size_t)]),
                    ("NpuAmpGraphIndex", [ctypes.c_char_p, ctypes.c_size_t,
                                          ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)])):
                if hasattr(lib, fn):  # (a library built before them: Python builds the index)
                    getattr(lib, fn).argtypes = argtypes
                    getattr(lib, fn).restype = ctypes.c_int
            if hasattr(lib, "NpuAmpWritePatch"):  # (issue 17h; an older library: bytes)
                lib.NpuAmpWritePatch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.c_char_p, ctypes.c_size_t]
                lib.NpuAmpWritePatch.restype = None
                lib.NpuAmpAssemblePatch.argtypes = [
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                    ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpAssemblePatch.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpItemOpdefPrecheck"):  # (issue 17m; else the Python guard alone)
                for fn, first in (("NpuAmpItemOpdefPrecheck", [ctypes.c_void_p]),
                                  ("NpuAmpGraphOpdefPrecheck", [ctypes.c_char_p, ctypes.c_size_t])):
                    getattr(lib, fn).argtypes = first + [
                        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t,
                        ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
                    getattr(lib, fn).restype = ctypes.c_int
            if hasattr(lib, "NpuAmpGraphOpdefPrecheckFlags"):  # (issue 17u)
                lib.NpuAmpGraphOpdefPrecheckFlags.argtypes = [
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
                lib.NpuAmpGraphOpdefPrecheckFlags.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpSerializeGraph"):  # (issue 17: the item's bytes written by hand)
                lib.NpuAmpSerializeGraph.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                                     ctypes.POINTER(ctypes.c_void_p),
                                                     ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpSerializeGraph.restype = ctypes.c_int
                lib.NpuAmpSetSerializeFast.argtypes = [ctypes.c_int]
                lib.NpuAmpSetSerializeFast.restype = ctypes.c_int
                lib.NpuAmpSerializeKnownSchema.restype = ctypes.c_int
                if hasattr(lib, "NpuAmpSetSerializeSplit"):  # (issue 17: two threads)
                    lib.NpuAmpSetSerializeSplit.argtypes = [ctypes.c_int]
                    lib.NpuAmpSetSerializeSplit.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpKahnOrder"):  # (issue 17f; an older library: Python sorts)
                lib.NpuAmpKahnOrder.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                lib.NpuAmpKahnOrder.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpSinkFlags"):  # (issue 17r)
                lib.NpuAmpSinkFlags.argtypes = [ctypes.c_void_p, ctypes.c_int]
                lib.NpuAmpSinkFlags.restype = None
                lib.NpuAmpGraphIndexFlags.argtypes = [
                    ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                    ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpGraphIndexFlags.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpItemFingerprint"):  # (issue 17u)
                lib.NpuAmpItemFingerprint.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
                lib.NpuAmpItemFingerprint.restype = ctypes.c_int
            for fn in ("NpuAmpItemHasOp", "NpuAmpItemHasAttr", "NpuAmpItemAttrByIndex"):  # (issue 17)
                if hasattr(lib, fn):
                    getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
                    getattr(lib, fn).restype = ctypes.c_int
            if hasattr(lib, "NpuAmpItemIndexStart"):  # (issue 17)
                lib.NpuAmpItemIndexStart.argtypes = [ctypes.c_void_p]
                lib.NpuAmpItemIndexStart.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpItemClasses"):  # (issue 17: LATE_CLASSES)
                lib.NpuAmpItemClasses.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)),
                                                  ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpItemClasses.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpSetDeferFree"):  # (issue 17: DEFER_FREES)
                lib.NpuAmpSetDeferFree.argtypes = [ctypes.c_int]
                lib.NpuAmpSetDeferFree.restype = ctypes.c_int
                lib.NpuAmpDrainDeferredFrees.argtypes = []
                lib.NpuAmpDrainDeferredFrees.restype = None
            if hasattr(lib, "NpuAmpSinkUsePrefused"):  # (issue 17)
                lib.NpuAmpSinkUsePrefused.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.NpuAmpSinkUsePrefused.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpSinkTakeMirror"):  # (issue 17: EARLY_MIRROR)
                lib.NpuAmpSinkTakeMirror.argtypes = [ctypes.c_void_p]
                lib.NpuAmpSinkTakeMirror.restype = ctypes.c_void_p
                lib.NpuAmpNextFlags.argtypes = [ctypes.c_int]
                lib.NpuAmpNextFlags.restype = None
            if hasattr(lib, "NpuAmpItemHasDevice"):  # (issue 17)
                lib.NpuAmpItemHasDevice.argtypes = [ctypes.c_void_p]
                lib.NpuAmpItemHasDevice.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpKernelsForOps"):  # (issue 17; else one TF call per op type)
                lib.NpuAmpKernelsForOps.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpKernelsForOps.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpItemPaintStrings"):  # (issue 17; else Python joins every node's inputs)
                lib.NpuAmpItemPaintStrings.argtypes = [
                    ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                    ctypes.POINTER(ctypes.c_size_t)]
                lib.NpuAmpItemPaintStrings.restype = ctypes.c_int
            if hasattr(lib, "NpuAmpStepTimes"):  # (issue 17r)
                lib.NpuAmpStepTimes.argtypes = [ctypes.c_void_p, ctypes.c_int]
                lib.NpuAmpStepTimes.restype = ctypes.c_int
            lib.NpuAmpSkipCount.argtypes = [ctypes.c_int]
            lib.NpuAmpSkipCount.restype = ctypes.c_uint64
            lib.NpuAmpClearSeen.restype = None
            if lib.NpuAmpBridgeAbiVersion() != 1:
                from .errors import BuildError

                raise BuildError(
                    f"libnpu_amp_tf.so bridge ABI {lib.NpuAmpBridgeAbiVersion()} != 1; "
                    "rebuild with `python -m npu_amp_tf._loader --force`")
            _lib = lib
            if hasattr(lib, "NpuAmpKahnOrder"):
                from graph_passes import graph as _graph

                _graph.native_kahn = kahn_order
            if hasattr(lib, "NpuAmpGrSearch"):  # (issue 17; else Python grows every region)
                from graph_passes.fusion import grad_region as _grad_region

                _grad_region.native = GradRegionLib(lib)
            if hasattr(lib, "NpuAmpKernelsForOps"):
                from graph_passes import registry as _registry

                _registry.native_kernels = kernels_for_ops
        return _lib


def register():
    """Install the Python callback in the C++ optimizer (idempotent)."""
    global _callback
    lib = library()
    with _lock:
        if _callback is None:
            _callback = _CALLBACK_TYPE(_on_optimize)
            lib.NpuAmpSetCallback(_callback)
            atexit.register(unregister)
    return lib


def unregister():
    """Remove the callback; NpuAmpOptimizer then fails (and grappler skips it).
    Called at interpreter exit so TF never calls into a finalizing Python."""
    global _callback
    with _lock:
        if _lib is not None and _callback is not None:
            _lib.NpuAmpSetCallback(_CALLBACK_TYPE())
            _callback = None


def is_registered() -> bool:
    return _lib is not None and bool(_lib.NpuAmpHasCallback())


def optimize_count() -> int:
    """How many times grappler called ``NpuAmpOptimizer`` in this process."""
    return int(library().NpuAmpOptimizeCount())


# ---------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------
def last_reports(n: int | None = None) -> list[dict]:
    """The most recent bridge records, oldest first (at most 64 are kept).

    Each record: ``{"graph": item id, "status": "rewritten" | "unchanged" |
    "cached" | "invalid_options" | "pass_failed" | "error", "time_s": ... (wall),
    "cpu_s": ... (this thread's CPU time: wall time on a loaded machine counts
    the neighbours too), "bridge_s": ... (parsing the graph here: ~0 with
    ``pipeline.OWN_PARSE``, where the pipeline parses it in its "graph" stage;
    the output is serialized inside the pipeline), "nodes": ...,
    "report": Report.to_json() or None, "error": message or None}``."""
    with _lock:
        items = list(_reports)
    items = items if n is None else items[-n:]
    for entry in items:
        rep = entry.get("report")
        if rep is not None and not isinstance(rep, dict):
            # the Report object: its deferred figures (FLOP share, activation
            # bytes) are computed now, when someone reads them, not in grappler
            entry["report"] = rep.to_json()
    return items


def clear_reports():
    """Forget the records, the memo and the counters (also the C++ side's
    fingerprints of graphs it answers without calling Python)."""
    with _lock:
        _reports.clear()
        _memo.clear()
        _stats.clear()
        if _lib is not None:
            _lib.NpuAmpClearSeen()


#: NpuAmpSkipCount kinds: calls answered in C++ without calling Python
_SKIP_KINDS = ("skipped_seen", "skipped_tf_data", "skipped_no_float")


def stats() -> dict:
    """Counters: calls, rewritten, unchanged, cached, errors; and the calls the
    C++ optimizer answered without Python (``skipped_seen``: a graph it
    returned or left unchanged before, such as grappler's second iteration;
    ``skipped_tf_data``; ``skipped_no_float``)."""
    with _lock:
        out = dict(_stats)
        if _lib is not None:
            for k, kind in enumerate(_SKIP_KINDS):
                n = int(_lib.NpuAmpSkipCount(k))
                if n:
                    out[kind] = n
        return out


#: the C++ optimizer's steps, in NpuAmpStepTimes's order (grappler_bridge.cc, Step)
STEPS = ("no_float", "serialize", "context", "callback", "index", "precheck", "assemble", "mark",
         "total", "precheck_parse")


def step_times() -> dict:
    """Thread CPU seconds of each C++ step of the last ``NpuAmpOptimizer::Optimize``
    that called Python (issue 17r): ``no_float`` (the float-type scan),
    ``serialize`` (the item's GraphDef to bytes), ``context`` (fetch /
    preserve / devices, the done mark, the fingerprint), ``callback`` (the
    whole Python callback: ctypes, GIL, :func:`handle`, writing the result),
    ``index`` and ``precheck`` (the C++ index and OpDef pre-check, called
    inside the callback; ``precheck_parse``, part of ``precheck``: the patch
    parsed and its records applied), ``assemble`` (the patch or bytes into grappler's
    output GraphDef), ``mark`` (marking the output), ``total`` (the whole
    ``Optimize``: grappler's own timer minus what happens before and after);
    {} without the library or the function."""
    fn = getattr(_lib, "NpuAmpStepTimes", None) if _lib is not None else None
    if fn is None:
        return {}
    buf = array.array("q", bytes(8 * len(STEPS)))
    fn(buf.buffer_info()[0], len(STEPS))
    return {k: v / 1e9 for k, v in zip(STEPS, buf)}


# ---------------------------------------------------------------------------
# shapes: grappler's C++ inference, handed over with the graph
# ---------------------------------------------------------------------------
def _shapes_call(fn, *args):
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    rc = fn(*args, ctypes.byref(data), ctypes.byref(size))
    text = ctypes.string_at(data, size.value).decode("utf-8", "replace") if size.value else ""
    if rc != 0:
        raise RuntimeError(text or "shape inference failed")
    from graph_passes.shapes import LineShapes

    return LineShapes(text)


class _ItemShapes:
    """Lazy shape source for the graph grappler is optimizing now: runs
    ``GraphProperties::InferStatically`` on the item the C++ side holds, when
    (and if) a pass first needs a shape.  The item exists only while the
    callback runs; a report read later (its deferred figures) gets the same
    C++ inference on the GraphDef the pipeline received (``fallback``)."""

    def __init__(self, sink):
        self.sink = sink
        self.fallback = None

    def __call__(self):
        if self.sink is not None:
            return _shapes_call(_lib.NpuAmpItemShapes, self.sink)
        if self.fallback is None:
            raise RuntimeError("no grappler item: the callback has returned")
        return self.fallback()

    def expire(self):
        self.sink = None


def item_shape_source(sink):
    """See :class:`_ItemShapes`."""
    return _ItemShapes(sink)


def graph_shape_source(graph_def, data: bytes | None = None):
    """Lazy shape source for an offline GraphDef: the same C++ inference, or
    None when the custom-op library is not loaded (the engine then uses
    ``graph_passes._tf.grappler_op_properties``).  ``data``: the GraphDef's
    serialized bytes instead of ``graph_def`` (issue 17r: a graph the
    pipeline rewrote in place after parsing those bytes)."""
    if _lib is None:
        return None

    def source():
        b = data if data is not None else graph_def.SerializeToString()
        return _shapes_call(_lib.NpuAmpGraphShapes, b, len(b))
    return source


# ---------------------------------------------------------------------------
# the graph's indexes, built in C++ (graph_passes.graph.Graph(index=...))
# ---------------------------------------------------------------------------
def _index_call(fn, *args):
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    if fn(*args, ctypes.byref(data), ctypes.byref(size)) != 0 or not size.value:
        return None
    return ctypes.string_at(data, size.value)


def item_index(sink):
    """The indexes of the graph grappler is optimizing now (names, op types,
    consumers, topological order), computed by the C++ side from the item it
    holds; None when the library cannot (Python then builds them).  An index
    handed over before its signature classes (:data:`LATE_CLASSES`) has a
    magic ending in "+l": :func:`item_classes` gives them."""
    fn = getattr(_lib, "NpuAmpItemIndex", None) if _lib is not None else None
    if fn is None or sink is None:
        return None
    return _index_call(fn, sink)


def item_classes(sink):
    """(issue 17, :data:`LATE_CLASSES`) The signature classes of the item's
    index handed over without them (array('i'), in its node order), once the
    C++ helper thread has computed them (this waits for it); None when there
    are none (no such index, outside the callback, or the thread could not)."""
    fn = getattr(_lib, "NpuAmpItemClasses", None) if _lib is not None else None
    if fn is None or sink is None:
        return None
    data, n = ctypes.POINTER(ctypes.c_int32)(), ctypes.c_size_t()
    if fn(sink, ctypes.byref(data), ctypes.byref(n)) != 0:
        return None
    out = array.array("i")
    if n.value:
        out.frombytes(ctypes.string_at(data, 4 * n.value))
    return out


def _index_and_classes(live):
    """The grappler callback's ``Graph(index=...)``: :func:`item_index` of
    ``live[0]`` (the sink while the callback runs, else None), paired with
    the reader of its classes (``Graph`` reads them only for an index handed
    over without them), or None."""
    blob = item_index(live[0])
    return None if blob is None else (blob, lambda: item_classes(live[0]))


def late_classes_counts():
    """(item indexes handed over before their classes, classes computed
    after) (:data:`LATE_CLASSES`), or None without the library or the call."""
    return _count_pair("NpuAmpLateClassesCounts")


def serialize_graph(data: bytes, fast: bool = True, split: bool = True):
    """The bytes the bridge hands the callback for the GraphDef serialized in
    ``data`` (issue 17): ``fast`` the C++ bridge's own writer, else the
    generated code's deterministic serialization, which it must equal byte
    for byte; None when the library is not loaded or cannot.  ``split``
    False: the writer's passes on one thread even for a large graph (see
    :func:`set_serialize_split`)."""
    fn = getattr(_lib, "NpuAmpSerializeGraph", None) if _lib is not None else None
    if fn is None:
        return None
    return _index_call(fn, data, len(data), (1 if split else 2) if fast else 0)


def set_serialize_split(split: bool) -> bool:
    """Whether the bridge's writer of the item's bytes plans and writes the
    two halves of a graph of 1,024 nodes or more on two threads (True, the
    default: wall time only, the same bytes) or on one (False, the
    reference); returns the previous setting."""
    return bool(_lib.NpuAmpSetSerializeSplit(int(bool(split))))


def set_precheck_split(min_nodes: int) -> int:
    """The node count from which the OpDef pre-check runs its checks in two
    halves on two threads (2048 by default: wall time only, the same
    answer; 0: never, the reference); returns the previous setting."""
    fn = _lib.NpuAmpSetPrecheckSplit
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return int(fn(int(min_nodes)))


def set_serialize_fast(fast: bool) -> bool:
    """Whether the bridge writes the item's bytes with its own writer (True,
    the default) or the generated code's (False, the reference); returns the
    previous setting."""
    return bool(_lib.NpuAmpSetSerializeFast(int(bool(fast))))


def graph_index(graph_def, data=None):
    """The same for an offline GraphDef (``data``: its serialized bytes when
    the caller has them; else serialized here), parsed again in C++: about
    what building the indexes in Python costs (ResNet-50 training graph,
    6.2k nodes: 44 vs 46 ms), and it carries the per-node signature classes
    the precision pass reads instead of NodeDef attrs (pipeline.optimize uses
    it offline by default); None when the library is not loaded or cannot."""
    if _lib is None:
        return None
    if data is None:
        data = graph_def.SerializeToString()
    fn = getattr(_lib, "NpuAmpGraphIndexFlags", None)
    if fn is not None:
        return _index_call(fn, data, len(data), (2 if INDEX_FROM_BYTES else 0)
                           | (4 if FAST_INDEX else 0))
    fn = getattr(_lib, "NpuAmpGraphIndex", None)
    if fn is None:
        return None
    return _index_call(fn, data, len(data))


def kahn_order(n, counts, readers, back):
    """Kahn's topological order in C++ (``graph_passes.graph.native_kahn``,
    installed by :func:`library`): ``counts``/``readers`` int32 arrays
    (``array('i')``), ``back`` an ``array('B')`` of n flags; an ``array('i')``
    of the ordered node indices (cycle nodes left out), or None.  (The
    arrays are passed by address: a ctypes array type per length would be a
    reference cycle per call.)"""
    fn = getattr(_lib, "NpuAmpKahnOrder", None) if _lib is not None else None
    if (fn is None or len(counts) != n or len(back) != n or counts.itemsize != 4
            or readers.itemsize != 4 or back.itemsize != 1):
        return None
    out = array.array("i", bytes(4 * n))
    if n == 0:
        return out
    if not len(readers):
        readers = array.array("i", [0])[:0]
    k = fn(n, counts.buffer_info()[0], readers.buffer_info()[0], len(readers), back.buffer_info()[0],
           out.buffer_info()[0])
    if k < 0:
        return None
    del out[k:]
    return out


class GradRegionLib:
    """The gradient-region search's calls into custom_ops/grad_region.cc
    (``graph_passes.fusion.grad_region.native``, installed by :func:`library`)."""

    _DY_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)

    def __init__(self, lib):
        c_void_p, c_char_p, c_size_t, c_int = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
        lib.NpuAmpGrMirrorNew.argtypes = []
        lib.NpuAmpGrMirrorNew.restype = c_void_p
        lib.NpuAmpGrMirrorFree.argtypes = [c_void_p]
        lib.NpuAmpGrMirrorFree.restype = None
        for fn in ("NpuAmpGrMirrorOps", "NpuAmpGrMirrorRemove"):
            getattr(lib, fn).argtypes = [c_void_p, c_char_p, c_size_t]
            getattr(lib, fn).restype = c_int
        lib.NpuAmpGrMirrorBefore.argtypes = [c_void_p, c_char_p, c_size_t, c_int]
        lib.NpuAmpGrMirrorBefore.restype = c_int
        lib.NpuAmpGrMirrorLoad.argtypes = [c_void_p, c_char_p, c_size_t, c_int]
        lib.NpuAmpGrMirrorLoad.restype = c_int
        lib.NpuAmpGrMirrorPositions.argtypes = [c_void_p, c_char_p, c_size_t, c_void_p, ctypes.c_int64, c_int]
        lib.NpuAmpGrMirrorPositions.restype = c_int
        #: (issue 17) a full order sent by the loaded nodes' indexes (a library built before it: False)
        self.can_positions_base = all(hasattr(lib, f) for f in ("NpuAmpGrMirrorPositionsBase",
                                                                 "NpuAmpGrMirrorPositionsOf"))
        if self.can_positions_base:
            lib.NpuAmpGrMirrorPositionsBase.argtypes = [c_void_p, c_void_p, ctypes.c_int64, c_char_p, c_size_t,
                                                        c_void_p, ctypes.c_int64]
            lib.NpuAmpGrMirrorPositionsBase.restype = c_int
            lib.NpuAmpGrMirrorPositionsOf.argtypes = [c_void_p, c_char_p, c_size_t, c_void_p, ctypes.c_int64]
            lib.NpuAmpGrMirrorPositionsOf.restype = c_int
        #: (issue 17) the first load on a C++ helper thread (a library built before it: None)
        self.can_load_async = hasattr(lib, "NpuAmpGrMirrorLoadAsync") and hasattr(lib, "NpuAmpGrMirrorWait")
        if self.can_load_async:
            lib.NpuAmpGrMirrorLoadAsync.argtypes = [c_void_p, c_char_p, c_size_t]
            lib.NpuAmpGrMirrorLoadAsync.restype = c_int
            lib.NpuAmpGrMirrorWait.argtypes = [c_void_p]
            lib.NpuAmpGrMirrorWait.restype = c_int
        #: (issue 17) nodes upserted from text (a library built before it: None)
        self.can_upsert_text = hasattr(lib, "NpuAmpGrMirrorUpsertText")
        if self.can_upsert_text:
            lib.NpuAmpGrMirrorUpsertText.argtypes = [c_void_p, c_char_p, c_size_t]
            lib.NpuAmpGrMirrorUpsertText.restype = c_int
        lib.NpuAmpGrSearch.argtypes = [c_void_p, c_char_p, c_size_t, self._DY_CALLBACK,
                                       ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t)]
        lib.NpuAmpGrSearch.restype = c_int
        #: (issue 17) the producer walks of ``shapes.local_shape`` over the
        #: mirror (a library built before it: False)
        self.can_shape = all(hasattr(lib, f) for f in ("NpuAmpGrShape", "NpuAmpGrShapeMemoNew",
                                                         "NpuAmpGrShapeMemoFree"))
        if self.can_shape:
            lib.NpuAmpGrShapeMemoNew.argtypes = []
            lib.NpuAmpGrShapeMemoNew.restype = c_void_p
            lib.NpuAmpGrShapeMemoFree.argtypes = [c_void_p]
            lib.NpuAmpGrShapeMemoFree.restype = None
            lib.NpuAmpGrShape.argtypes = [c_void_p, c_void_p, c_char_p, c_size_t,
                                          ctypes.POINTER(ctypes.c_int64), c_int]
            lib.NpuAmpGrShape.restype = c_int
        #: (issue 17) the layer-norm rule's analysis over the mirror (a library built before it: False)
        self.can_analyze_norms = hasattr(lib, "NpuAmpGrAnalyzeNorms")
        if self.can_analyze_norms:
            lib.NpuAmpGrAnalyzeNorms.argtypes = [c_void_p, c_char_p, c_size_t, ctypes.POINTER(c_void_p),
                                                 ctypes.POINTER(c_size_t)]
            lib.NpuAmpGrAnalyzeNorms.restype = c_int
        #: (issue 17) the layer-norm rule's whole decision over the mirror (a library built before it: False)
        self.can_norm_plan = hasattr(lib, "NpuAmpGrNormPlan")
        if self.can_norm_plan:
            lib.NpuAmpGrNormPlan.argtypes = [c_void_p, c_void_p, c_char_p, c_size_t, ctypes.POINTER(c_void_p),
                                             ctypes.POINTER(c_size_t)]
            lib.NpuAmpGrNormPlan.restype = c_int
        self.can_norm_grad_plan = hasattr(lib, "NpuAmpGrNormGradPlan")
        if self.can_norm_grad_plan:
            lib.NpuAmpGrNormGradPlan.argtypes = lib.NpuAmpGrNormPlan.argtypes
            lib.NpuAmpGrNormGradPlan.restype = c_int
        #: (issue 17) the layer-norm rule's whole run before the parse (a library built before it: False)
        self.can_fuse_norms = hasattr(lib, "NpuAmpGrFuseNorms") and hasattr(lib, "NpuAmpGrNormCandidates")
        if self.can_fuse_norms:
            lib.NpuAmpGrNormCandidates.argtypes = [c_char_p, c_size_t]
            lib.NpuAmpGrNormCandidates.restype = c_int
            lib.NpuAmpGrFuseNorms.argtypes = [c_void_p, c_void_p, c_char_p, c_size_t, c_char_p, c_size_t,
                                              ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t),
                                              ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t),
                                              ctypes.POINTER(c_void_p), ctypes.POINTER(c_size_t)]
            lib.NpuAmpGrFuseNorms.restype = c_int
        self._lib = lib

    def norm_candidates(self, graph: bytes):
        """``NpuAmpGrNormCandidates``: whether the layer-norm rule could
        find a candidate in ``graph`` (an Rsqrt / Sqrt a Mul / RealDiv
        reads), read from the bytes without building a mirror: True / False,
        or None (not a GraphDef's bytes, or no such call)."""
        if not self.can_fuse_norms:
            return None
        rc = self._lib.NpuAmpGrNormCandidates(graph, len(graph))
        return None if rc < 0 else rc == 1

    def fuse_norms(self, graph: bytes, ops: bytes, request: bytes, memo=None, mirror=None, loaded=False):
        """``NpuAmpGrFuseNorms`` on a mirror loaded fresh from ``graph`` with
        the op sets ``ops``: (rc, text, the graph's bytes after the fusions,
        array('i') of each output node's index in ``graph`` or -1), rc 0 ran,
        1 could not run (why in the text); or None (no such call, or the
        mirror refused the graph).  ``loaded``: ``mirror`` holds ``graph``
        loaded fresh already (:func:`item_take_mirror`).  ``memo``: the shape walks' memo
        (:meth:`shape_memo`, the caller's: its answers outlive the call);
        None: one made and freed here.  ``mirror``: an empty mirror
        (:meth:`new`, the caller's, who frees it: after the call it holds the
        fused graph); None: one made and freed here."""
        if not self.can_fuse_norms:
            return None
        lib = self._lib
        h = mirror if mirror else lib.NpuAmpGrMirrorNew()
        if not h:
            return None
        own = memo is None
        if own:
            memo = lib.NpuAmpGrShapeMemoNew() if self.can_shape else None
        try:
            if not memo or lib.NpuAmpGrMirrorOps(h, ops, len(ops)) != 0 or \
                    (not (loaded and mirror) and lib.NpuAmpGrMirrorLoad(h, graph, len(graph), 1) != 0):
                return None
            text, tlen = ctypes.c_void_p(), ctypes.c_size_t()
            out, olen = ctypes.c_void_p(), ctypes.c_size_t()
            mp, mlen = ctypes.c_void_p(), ctypes.c_size_t()
            rc = lib.NpuAmpGrFuseNorms(h, memo, graph, len(graph), request, len(request), ctypes.byref(text),
                                       ctypes.byref(tlen), ctypes.byref(out), ctypes.byref(olen),
                                       ctypes.byref(mp), ctypes.byref(mlen))
            if rc not in (0, 1):
                return None
            index = array.array("i")
            if mlen.value:
                index.frombytes(ctypes.string_at(mp, 4 * mlen.value))
            return (rc, ctypes.string_at(text, tlen.value).decode("ascii") if tlen.value else "",
                    ctypes.string_at(out, olen.value) if olen.value else b"", index)
        finally:
            if memo and own:
                lib.NpuAmpGrShapeMemoFree(memo)
            if not mirror:
                lib.NpuAmpGrMirrorFree(h)

    def norm_plan(self, h, memo, request: bytes, grad_only: bool = False):
        """``NpuAmpGrNormPlan`` (``grad_only``: ``NpuAmpGrNormGradPlan``):
        (True, the plan's text), or (False, why Python decides: a refusal's
        source line or the question only Python answers), or None (the
        library has no planner, bad arguments)."""
        if not (self.can_norm_grad_plan if grad_only else self.can_norm_plan):
            return None
        fn = self._lib.NpuAmpGrNormGradPlan if grad_only else self._lib.NpuAmpGrNormPlan
        out, size = ctypes.c_void_p(), ctypes.c_size_t()
        rc = fn(h, memo, request, len(request), ctypes.byref(out), ctypes.byref(size))
        if rc not in (0, 1):
            return None
        return rc == 0, ctypes.string_at(out, size.value).decode("ascii") if size.value else ""

    def analyze_norms(self, h, names):
        """``NpuAmpGrAnalyzeNorms`` at the nodes ``names`` (and their
        Add/AddV2/Mul readers): its answer text, or None."""
        if not self.can_analyze_norms:
            return None
        try:
            data = "\x01".join(names).encode("ascii")
        except UnicodeEncodeError:
            return None
        out, size = ctypes.c_void_p(), ctypes.c_size_t()
        if self._lib.NpuAmpGrAnalyzeNorms(h, data, len(data), ctypes.byref(out), ctypes.byref(size)) != 0:
            return None
        return ctypes.string_at(out, size.value).decode("ascii") if size.value else ""

    def new(self):
        return self._lib.NpuAmpGrMirrorNew()

    def free(self, h):
        self._lib.NpuAmpGrMirrorFree(h)

    def ops(self, h, data: bytes) -> int:
        return self._lib.NpuAmpGrMirrorOps(h, data, len(data))

    def load(self, h, data: bytes, fresh: bool) -> int:
        return self._lib.NpuAmpGrMirrorLoad(h, data, len(data), int(fresh))

    def upsert_text(self, h, data: bytes):
        """:meth:`load` (not fresh) of nodes given as text
        (``grad_region._lean_text``): 0 ok, 1 refused, None when the library
        lacks the call."""
        if not self.can_upsert_text:
            return None
        return self._lib.NpuAmpGrMirrorUpsertText(h, data, len(data))

    def load_async(self, h, data: bytes) -> int:
        """:meth:`load` (fresh) on a C++ helper thread: 0 started (``data``
        must stay alive until :meth:`wait` or :meth:`free` returns), 1 not."""
        if not self.can_load_async:
            return 1
        return self._lib.NpuAmpGrMirrorLoadAsync(h, data, len(data))

    def wait(self, h) -> int:
        """The result of :meth:`load_async`'s load (0 ok), once it is done."""
        return self._lib.NpuAmpGrMirrorWait(h) if self.can_load_async else 0

    def remove(self, h, names: bytes) -> int:
        return self._lib.NpuAmpGrMirrorRemove(h, names, len(names))

    def before(self, h, names: bytes, reset: bool) -> int:
        return self._lib.NpuAmpGrMirrorBefore(h, names, len(names), int(reset))

    def positions(self, h, names, values, reset: bool) -> int:
        """Positions (floats) of the nodes ``names``; ``reset`` forgets the others'."""
        try:
            data = "\x01".join(names).encode("ascii")
        except UnicodeEncodeError:
            return 1
        arr = array.array("d", values)
        return self._lib.NpuAmpGrMirrorPositions(h, data, len(data), arr.buffer_info()[0] if len(arr) else None,
                                                 len(arr), int(reset))

    def positions_base(self, h, ranks, names, values) -> int:
        """Every position anew: the loaded graph's k-th node at ``ranks[k]``
        (a C-contiguous int32 numpy array, -1 none; as many as the first
        load's nodes), then ``names`` at ``values`` (floats).  0 ok, else
        not (send them all by name with :meth:`positions`)."""
        if not self.can_positions_base:
            return 1
        try:
            data = "\x01".join(names).encode("ascii")
        except UnicodeEncodeError:
            return 1
        arr = array.array("d", values)
        return self._lib.NpuAmpGrMirrorPositionsBase(
            h, ranks.ctypes.data if len(ranks) else None, len(ranks), data, len(data),
            arr.buffer_info()[0] if len(arr) else None, len(arr))

    def positions_of(self, h, names) -> list | None:
        """(tests) The mirror's positions of ``names`` (NaN: none), or None."""
        if not self.can_positions_base:
            return None
        data = "\x01".join(names).encode("ascii")
        out = array.array("d", bytes(8 * len(names)))
        rc = self._lib.NpuAmpGrMirrorPositionsOf(h, data, len(data), out.buffer_info()[0] if len(out) else None,
                                                 len(names))
        return None if rc != 0 else out.tolist()

    def shape_memo(self):
        """A new memo for :meth:`shape` (free it with :meth:`free_shape_memo`)."""
        return self._lib.NpuAmpGrShapeMemoNew()

    def free_shape_memo(self, memo):
        self._lib.NpuAmpGrShapeMemoFree(memo)

    #: the most dims :meth:`shape` returns (a higher rank: not answered)
    SHAPE_CAP = 64

    def shape_buffer(self):
        return (ctypes.c_int64 * self.SHAPE_CAP)()

    def shape(self, h, memo, ref: str, buf):
        """(True, the fully known shape of tensor ``ref`` as a list, or None)
        from the C++ walk over mirror ``h`` with ``memo``; (False, None) when
        it gave up (Python walks ``ref`` itself).  ``buf``: :meth:`shape_buffer`."""
        try:
            data = ref.encode("ascii")
        except UnicodeEncodeError:
            return False, None
        r = self._lib.NpuAmpGrShape(h, memo, data, len(data), buf, self.SHAPE_CAP)
        if r >= 0:
            return True, buf[:r]
        return (True, None) if r == -1 else (False, None)

    def search(self, h, request: bytes, dy_candidate):
        """(status, answer text) of one search; ``dy_candidate(ref) -> bool``
        answers the C++ side's dtype-and-shape question (an exception makes
        the search give up: status 3, Python searches and raises it)."""

        def answer(p, n):
            try:
                return 1 if dy_candidate(ctypes.string_at(p, n).decode("ascii")) else 0
            except Exception:  # noqa: BLE001 - Python's own search raises it again
                return -1

        cb = self._DY_CALLBACK(answer)
        out, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = self._lib.NpuAmpGrSearch(h, request, len(request), cb, ctypes.byref(out), ctypes.byref(size))
        text = ctypes.string_at(out, size.value).decode("ascii") if size.value else ""
        return status, text


def kernels_for_ops(op_types):
    """The serialized ``KernelList`` of every kernel TF registers for the op
    types ``op_types`` (a list of str), from one scan of the registry in C++
    (``graph_passes.registry.native_kernels``, installed by :func:`library`);
    None when the library cannot."""
    fn = getattr(_lib, "NpuAmpKernelsForOps", None) if _lib is not None else None
    if fn is None:
        return None
    ops = "\n".join(op_types).encode()
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    if fn(ops, len(ops), ctypes.byref(data), ctypes.byref(size)) != 0:
        return None
    return ctypes.string_at(data, size.value) if size.value else b""


def item_paint_strings(sink, names: bytes, base, counts, extra: bytes):
    """The precision pass's painting strings (``Graph.base_inputs``, see
    ``graph_passes/precision/native.py``) with the inputs of the nodes whose
    ``base`` entry is an item index read from the item grappler is optimizing
    now (only inside the callback; ``base``/``counts``: ``array('i')`` per
    node, ``extra``: the other nodes' inputs); None when the library lacks
    the call or the arguments do not describe the item (Python then joins
    every node's inputs)."""
    fn = getattr(_lib, "NpuAmpItemPaintStrings", None) if _lib is not None else None
    n = len(base)
    if (fn is None or sink is None or len(counts) != n or base.itemsize != 4 or counts.itemsize != 4
            or not BASE_PAINT_STRINGS):
        return None
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    if fn(sink, names, len(names), base.buffer_info()[0] if n else None,
          counts.buffer_info()[0] if n else None, n, extra, len(extra),
          ctypes.byref(data), ctypes.byref(size)) != 0:
        return None
    return ctypes.string_at(data, size.value) if size.value else b""


#: (issue 17) hand the precision pass :func:`item_paint_strings` inside the
#: callback; False: it joins every node's inputs (the reference; the same bytes)
BASE_PAINT_STRINGS = True


# ---------------------------------------------------------------------------
# the OpDef guard's pre-check in C++ (issue 17m; custom_ops/opdef_precheck.cc)
# ---------------------------------------------------------------------------
def _broken_table() -> bytes:
    """The known-broken kernels the OpDef guard refuses, as the C++ check
    reads them: one line per entry, op, device type, dtype number and fused
    op (empty for a whole kernel) joined by the byte 1; from
    ``registry.BROKEN_KERNELS`` and the ``BROKEN_FUSED_OPS`` entries this TF
    version has (built per call: a handful of entries, and tests may edit the
    tables)."""
    from graph_passes import registry

    rows = [f"{op}\x01{dev}\x01{int(dt)}\x01" for op, dev, dt in registry.BROKEN_KERNELS]
    rows += [f"{op}\x01{dev}\x01{int(dt)}\x01{f}" for op, dev, dt, f in registry.BROKEN_FUSED_OPS
             if registry.fused_ops_broken(op, dev, dt, [f])]
    return "\n".join(rows).encode()


#: (issue 17m) ask the C++ pre-check before the Python OpDef guard; False:
#: the Python guard alone (the reference; the same graphs and reports)
NATIVE_OPDEF_PRECHECK = True


def _precheck_answer(rc: int):
    return True if rc == 0 else False if rc == 1 else None


def item_opdef_precheck(sink, patch, device: str = "CPU"):
    """The OpDef guard's C++ pre-check (``pipeline.optimize_serialized``'s
    ``opdef_precheck``) of ``patch`` (a GraphPatch of the item grappler is
    optimizing now; only inside the callback): True when the nodes it
    changed and their edges satisfy their OpDefs (the Python guard need not
    run), False when they may not, None when it cannot tell or the library
    lacks the check.  The C++ side keeps the parsed patch for
    ``NpuAmpWritePatch``."""
    fn = getattr(_lib, "NpuAmpItemOpdefPrecheck", None) if _lib is not None else None
    if fn is None or sink is None or not NATIVE_OPDEF_PRECHECK:
        return None
    order, table = patch.order, _broken_table()
    return _precheck_answer(fn(sink, order.buffer_info()[0] if len(order) else None, len(order),
                               patch.payload, len(patch.payload), table, len(table),
                               (device or "CPU").encode()))


def graph_opdef_precheck(graph_bytes: bytes, patch, device: str = "CPU", indexed: bool = False):
    """:func:`item_opdef_precheck` offline: ``patch`` a GraphPatch of the
    GraphDef serialized in ``graph_bytes`` (parsed again in C++).
    ``indexed`` (issue 17u, for tests): the callback's path under
    :data:`PRECHECK_FROM_INDEX` (the input's C++ index built first, its
    names and consumers read; with :data:`FAST_INDEX`'s lookups);
    False: the reference check (offline, an index built only for the check
    would cost more than it saves)."""
    fn = getattr(_lib, "NpuAmpGraphOpdefPrecheck", None) if _lib is not None else None
    if fn is None or not NATIVE_OPDEF_PRECHECK:
        return None
    order, table = patch.order, _broken_table()
    if indexed:
        flags_fn = getattr(_lib, "NpuAmpGraphOpdefPrecheckFlags", None)
        if flags_fn is None:
            return None
        return _precheck_answer(flags_fn(graph_bytes, len(graph_bytes),
                                         8 | (4 if FAST_INDEX else 0),
                                         order.buffer_info()[0] if len(order) else None, len(order),
                                         patch.payload, len(patch.payload), table, len(table),
                                         (device or "CPU").encode()))
    return _precheck_answer(fn(graph_bytes, len(graph_bytes),
                               order.buffer_info()[0] if len(order) else None, len(order),
                               patch.payload, len(patch.payload), table, len(table),
                               (device or "CPU").encode()))


#: records whose report keeps its deferred figures (and so its graphs) alive
_LAZY_REPORTS_MAX = 16


def _record(entry: dict):
    with _lock:
        _reports.append(entry)
        if len(_reports) > _LAZY_REPORTS_MAX:
            old = _reports[-_LAZY_REPORTS_MAX - 1]
            rep = old.get("report")
            if rep is not None and not isinstance(rep, dict):
                rep.discard_pending(f"more than {_LAZY_REPORTS_MAX} newer graphs; set report_path "
                                    "to keep every report's figures")
                old["report"] = rep.to_json()
        _stats["calls"] += 1
        _stats[entry["status"]] += 1


# ---------------------------------------------------------------------------
# the callback
# ---------------------------------------------------------------------------
def _split(b: bytes | None) -> list[str]:
    if not b:
        return []
    return [s for s in b.decode("utf-8", "replace").split("\n") if s]


def _on_optimize(sink, gptr, glen, cptr, clen, fetch, preserve, devices, item_id):
    """Called by NpuAmpOptimizer::Optimize (ctypes holds the GIL for us).
    Never lets an exception escape into C."""
    try:
        if getattr(_tls, "active", False):
            return RC_NOT_NOW  # a pass itself ran a TF function: do not recurse
        _tls.active = True
        if _helpers_applied[0] != (DEFER_FREES, KEPT_WORKERS):
            _apply_helper_settings()
        # (issue 17) an item the layer-norm fusion before the parse may change
        # gets its index built after it (NpuAmpSinkUsePrefused starts it), not
        # now and not early on the next call: one of the item as it came
        # would be thrown away
        graph_bytes = ctypes.string_at(gptr, glen) if glen else b""
        later = _may_prefuse(graph_bytes)
        if hasattr(_lib, "NpuAmpSinkFlags"):
            _lib.NpuAmpSinkFlags(sink, _sink_flags(early=not later, mirror=later))
        if INDEX_IN_BACKGROUND and not later and hasattr(_lib, "NpuAmpItemIndexStart"):
            _lib.NpuAmpItemIndexStart(sink)  # (0 started; else built when asked)
        shapes = item_shape_source(sink)
        digest = item_fingerprint(sink, glen) if SHARED_FINGERPRINT else None
        # the sink lives on the C++ stack for this call only: the callables
        # handed on read it from `live`, emptied when the call ends (one kept
        # past it then answers None, as outside a callback, and never reads
        # freed memory)
        live = [sink]
        took = []  # (the fusion's run asked for the mirror: it went ahead)

        def take_mirror():
            took.append(True)
            return item_take_mirror(live[0]) if EARLY_MIRROR else None

        try:
            config_bytes = ctypes.string_at(cptr, clen) if clen else b""
            code, out = handle(graph_bytes, config_bytes, _split(fetch), _split(preserve),
                               _split(devices), (item_id or b"").decode("utf-8", "replace"),
                               shapes=shapes,
                               index=lambda: _index_and_classes(live),
                               patch=_patch_fn() is not None,
                               opdef_precheck=lambda p, dev: item_opdef_precheck(live[0], p, dev),
                               digest=digest,
                               base_inputs=lambda *a: item_paint_strings(live[0], *a),
                               has_op=lambda op: item_has_op(live[0], op),
                               prefuse=lambda pre: item_use_prefused(live[0], pre),
                               prefuse_mirror=take_mirror,
                               has_attr=lambda a: item_has_attr(live[0], a),
                               has_device=lambda: item_has_device(live[0]))
        finally:
            live[0] = None
            shapes.expire()
            _tls.active = False
            if later and not took and hasattr(_lib, "NpuAmpNextFlags"):
                # (the fusion before the parse did not run: no early mirror for the next items)
                _lib.NpuAmpNextFlags(_sink_flags(early=False))
        if code == RC_OK:
            if isinstance(out, bytes):
                _lib.NpuAmpWriteResult(sink, out, len(out))
            else:  # a GraphPatch of the item's graph
                _patch_fn()(sink, out.order.buffer_info()[0], len(out.order), out.payload,
                            len(out.payload))
        return code
    except Exception as exc:  # noqa: BLE001 - must not cross the C boundary
        _report_error(sink, exc)
        return RC_ERROR
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ctrl-C / sys.exit() inside grappler cannot propagate through C:
        # grappler keeps this graph, and the very exception is re-raised in
        # the main thread as soon as it runs Python again (_redeliver).
        _report_error(sink, exc)
        _redeliver(exc)
        return RC_ERROR


#: (issue 17) the C++ side destroys what a callback leaves behind (the nodes
#: the layer-norm fusion before the parse replaced, the patch parsed for the
#: OpDef pre-check, the index, the gradient-region mirrors) on a helper
#: thread (custom_ops/deferred_free.cc), not inside grappler's timer around
#: the optimizer.  Wall time only: the same frees, on a second core.  False:
#: every free inline (the reference; the same output)
DEFER_FREES = True
#: (issue 17) the C++ side's work beside the callback's thread (the item's
#: index, the early mirror's load, the second half of the item's bytes, a
#: mirror's load the fusion pass starts) runs as jobs on two helper threads
#: it keeps (custom_ops/worker.h), not on a thread made per call: a fresh
#: thread's allocations page-fault again (the mirror's load of BERT-12's
#: bytes: ~4.3 ms on a new thread, ~2 ms on a kept one).  Wall time only.
#: False: a thread per job (the reference; the same output)
KEPT_WORKERS = True
_helpers_applied = [None]  # (the settings last given to the library)


def _apply_helper_settings():
    fn = getattr(_lib, "NpuAmpSetDeferFree", None)
    if fn is not None:
        fn(int(bool(DEFER_FREES)))
    fn = getattr(_lib, "NpuAmpSetKeptWorkers", None)
    if fn is not None:
        fn(int(bool(KEPT_WORKERS)))
    _helpers_applied[0] = (DEFER_FREES, KEPT_WORKERS)


def worker_counts():
    """(jobs the library queued on its kept helper threads, jobs it ran on a
    thread of their own) (:data:`KEPT_WORKERS`), or None without the call."""
    return _count_pair("NpuAmpWorkerCounts")


def _loaded_lib():
    """The library: ``_lib`` inside a callback (library() would take
    ``_lock``, which a caller may hold), else loaded; None without it."""
    if _lib is not None:
        return _lib
    try:
        return library()
    except Exception:  # noqa: BLE001 - no library
        return None


def drain_deferred_frees():
    """Wait until the frees the library deferred so far have run (tests)."""
    fn = getattr(_loaded_lib(), "NpuAmpDrainDeferredFrees", None)
    if fn is not None:
        fn()


def _count_pair(name: str):
    """The two uint64 counts the library's ``name(a*, b*)`` writes, or None
    without the library or the call."""
    fn = getattr(_loaded_lib(), name, None)
    if fn is None:
        return None
    a, b = ctypes.c_uint64(), ctypes.c_uint64()
    fn(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def steal_counts():
    """(record nodes the OpDef pre-check took out of items, those put back)
    (:data:`STEAL_RECORDS`), or None without the library or the call."""
    return _count_pair("NpuAmpStealCounts")


def deferred_free_counts():
    """(frees handed to the library's helper thread, frees it ran), or None
    without the library or the call."""
    return _count_pair("NpuAmpDeferredFreeCounts")


#: (issue 17r) the C++ side assembles a patch by moving the item's unchanged
#: nodes into grappler's output instead of copying them (grappler discards
#: its working item's graph once an optimizer succeeds; ~9 ms of grappler's
#: time on the Keras ResNet-50 training graph); False: copied (the reference;
#: the same output bytes)
MOVE_ITEM_NODES = True
#: (issue 17, with MOVE_ITEM_NODES) the OpDef pre-check inside grappler takes
#: the patch's record nodes (``Graph.patch_records``) out of the item and
#: edits them there, instead of copying each from the item (a NodeDef copy
#: costs what its parse does); every path that does not assemble that
#: patch puts them back as they were (``Sink::RestoreStolen`` in
#: custom_ops/grappler_bridge.cc).  False: copied (the reference; the same
#: output)
STEAL_RECORDS = True
#: (issue 17r) the C++ index (:func:`item_index`, :func:`graph_index`) reads
#: node names, ops and inputs from the serialized bytes in one sequential
#: pass instead of from the parsed GraphDef's scattered strings; False: from
#: the parsed GraphDef (the reference; the same index bytes)
INDEX_FROM_BYTES = True


#: (issue 17u) the C++ index looks node names up in an open-addressing table
#: (``NameTable`` in custom_ops/opdef_precheck.h) instead of a
#: ``std::unordered_map``, checks names and inputs for printable ASCII 8 bytes
#: at a time and keys the signature classes in binary instead of text; False:
#: the map, per byte, text keys (the reference; the same index bytes)
FAST_INDEX = True
#: (issue 17u) the C++ index keeps the item's names and consumers for the
#: OpDef pre-check, which then visits only the unchanged nodes reading a
#: changed node instead of parsing every node's inputs
#: (``OpdefPrecheckIndexed``); False: the pre-check indexes the output
#: itself (the reference; the same answers)
PRECHECK_FROM_INDEX = True
#: (issue 17u) the memo of :func:`handle` knows the item's bytes by the
#: fingerprint the C++ side computed of them anyway (:func:`item_fingerprint`)
#: instead of their SHA-1 (~2 ms per 4 MB); False: SHA-1 (the reference; the
#: same graphs and reports)
SHARED_FINGERPRINT = True
#: (issue 17) the C++ side starts building the item's index on a helper
#: thread as the callback begins (``NpuAmpItemIndexStart``), so that it
#: overlaps Python's parse of the bytes; :func:`item_index` then waits for
#: it.  Wall time only: the same work, on a second core.  False: built when
#: asked (the reference; the same index bytes and output)
INDEX_IN_BACKGROUND = True
#: (issue 17, with INDEX_IN_BACKGROUND) the C++ side starts the next items'
#: index as soon as it has written their bytes, before the callback, with the
#: flags this callback set (``kFlagEarlyIndex``); a callback whose flags
#: differ drops it and builds its own.  Wall time only (the index's wait:
#: ~1-2.7 ms on the Keras ResNet-50 training graph).  False: started by the
#: callback (the reference; the same index bytes and output)
EARLY_INDEX = True
#: (issue 17, with INDEX_IN_BACKGROUND) the helper thread hands the index over
#: before its signature classes (``kFlagLateClasses``: the index's magic ends
#: in "+l") and computes them next, while Python adopts the index and runs
#: the passes before the precision pass, which reads them
#: (:func:`item_classes`, through ``Graph.signature_classes``).  Wall time
#: only: the index's wait shrinks by the classes' share.  False: the classes
#: inside the index (the reference; the same classes and output)
LATE_CLASSES = True


#: (issue 17) after a callback that may run the layer-norm fusion before
#: the parse, the C++ side starts loading the next items' gradient-region
#: mirror from their bytes on a helper thread as soon as it has written them
#: (``kFlagEarlyMirror``), where it would start their early index otherwise;
#: the fusion's run takes it (:func:`item_take_mirror`) instead of loading
#: one itself.  Wall time only (the load, ~2.3 ms on BERT-12, overlaps the
#: fingerprint and the callback's entry).  False: the run loads its own (the
#: reference; the same mirror, output and report)
EARLY_MIRROR = True


def _sink_flags(early: bool = True, mirror: bool = False) -> int:
    """NpuAmpSinkFlags's flags from MOVE_ITEM_NODES / INDEX_FROM_BYTES /
    FAST_INDEX / PRECHECK_FROM_INDEX / EARLY_INDEX (with INDEX_IN_BACKGROUND;
    ``early`` False: not for the next item either) / STEAL_RECORDS (which
    the library applies only with MOVE_ITEM_NODES) / LATE_CLASSES (with
    INDEX_IN_BACKGROUND) / EARLY_MIRROR (``mirror``: this item may run the
    layer-norm fusion before the parse, so the next one likely does too)."""
    return ((1 if MOVE_ITEM_NODES else 0) | (2 if INDEX_FROM_BYTES else 0)
            | (4 if FAST_INDEX else 0) | (8 if PRECHECK_FROM_INDEX else 0)
            | (16 if early and EARLY_INDEX and INDEX_IN_BACKGROUND else 0)
            | (32 if STEAL_RECORDS else 0) | (64 if LATE_CLASSES and INDEX_IN_BACKGROUND else 0)
            | (128 if mirror and EARLY_MIRROR else 0))


def item_take_mirror(sink):
    """(issue 17, :data:`EARLY_MIRROR`) The gradient-region mirror the C++
    side loaded from the item's bytes before the callback, its load done: a
    handle the caller owns from here (the grad_region library's ``free``),
    or None (none was started, it was taken already, its load refused, or
    outside the callback)."""
    fn = getattr(_lib, "NpuAmpSinkTakeMirror", None) if _lib is not None else None
    if fn is None or sink is None:
        return None
    return fn(sink) or None


def early_mirror_counts():
    """(mirrors the C++ side started loading before the callback, those the
    callbacks took), or None without the library call."""
    return _count_pair("NpuAmpEarlyMirrorCounts")


def _may_prefuse(graph_bytes: bytes) -> bool:
    """Whether the layer-norm fusion before the parse may change this item
    (``graph_passes.fusion.prefuse``: on, put into the item, and a candidate
    in the bytes)."""
    from graph_passes.fusion import grad_region as gr
    from graph_passes.fusion import prefuse

    lib = gr.native
    return bool(prefuse.PREFUSE and USE_PREFUSED and lib is not None and prefuse.has_candidates(graph_bytes))


def early_index_counts():
    """(item indexes the C++ side started before the callback, those the
    callback's flags then discarded), or None without the library call."""
    fn = getattr(_lib, "NpuAmpEarlyIndexCounts", None) if _lib is not None else None
    if fn is None:
        return None
    started, discarded = ctypes.c_uint64(), ctypes.c_uint64()
    fn(ctypes.byref(started), ctypes.byref(discarded))
    return started.value, discarded.value


def item_use_prefused(sink, pre) -> bool:
    """(issue 17) Put the layer-norm fusions made before the parse
    (``graph_passes.fusion.prefuse.Prefused``) into the item grappler holds
    (``NpuAmpSinkUsePrefused``), so that its index, paint strings, OpDef
    pre-check and the patch's assembly see the graph Python parses: True
    done, False (nothing changed) without the call or when it refuses."""
    fn = getattr(_lib, "NpuAmpSinkUsePrefused", None) if _lib is not None else None
    if fn is None or sink is None or not USE_PREFUSED:
        return False
    index = pre.index
    if len(index) and index.itemsize != 4:
        return False
    ptr = index.buffer_info()[0] if len(index) else None
    return fn(sink, pre.data, len(pre.data), ptr, len(index), int(bool(INDEX_IN_BACKGROUND))) == 0


#: (issue 17) the grappler callback hands the layer-norm fusions made before
#: the parse to the item (:func:`item_use_prefused`); False: the callback
#: does not use them (the pipeline then parses the item's own bytes)
USE_PREFUSED = True


def item_fingerprint(sink, size: int):
    """The C++ side's fingerprint of the item grappler is optimizing now (its
    serialized bytes and context: ``Fingerprint`` in grappler_bridge.cc) as
    :func:`handle`'s ``digest``, ``("fp", value, size)``; None without the
    library function or outside the callback (then SHA-1)."""
    fn = getattr(_lib, "NpuAmpItemFingerprint", None) if _lib is not None else None
    if fn is None or sink is None:
        return None
    fp = ctypes.c_uint64()
    if fn(sink, ctypes.byref(fp)) != 0:
        return None
    return ("fp", fp.value, size)


def _item_has(fn_name, sink, *what: str):
    fn = getattr(_lib, fn_name, None) if _lib is not None else None
    if fn is None or sink is None:
        return None
    r = fn(sink, *(w.encode() for w in what))
    return None if r < 0 else bool(r)


def item_has_op(sink, op: str):
    """Whether the item grappler is optimizing now has a node of op type
    ``op`` (``NpuAmpItemHasOp``): True / False, or None without the library
    function or outside the callback."""
    return _item_has("NpuAmpItemHasOp", sink, op)


def item_has_attr(sink, name: str):
    """Whether a node of the item grappler is optimizing now carries the
    attr ``name`` (``NpuAmpItemHasAttr``): True / False, or None without the
    library function or outside the callback.  (issue 17) A name beginning
    with '_' is answered from the item index's read of the bytes when it has
    one (``NpuAmpItemAttrByIndex``, :data:`ATTRS_BY_INDEX`)."""
    return _by_index_or_walk(sink, name, "NpuAmpItemHasAttr", name)


#: (issue 17) :func:`item_has_attr` and :func:`item_has_device` answered from
#: what the item's index read of its bytes on its own thread (the distinct
#: '_' attr names, whether a node has a device) instead of walking every
#: NodeDef; False: the walks (the reference; the same answers)
ATTRS_BY_INDEX = True


def item_has_device(sink):
    """Whether a node of the item grappler is optimizing now has a device
    string (``NpuAmpItemHasDevice``): True / False, or None without the
    library function or outside the callback.  (issue 17) Answered from the
    item index's read of the bytes when it has one (:data:`ATTRS_BY_INDEX`)."""
    return _by_index_or_walk(sink, "", "NpuAmpItemHasDevice")


def _by_index_or_walk(sink, what, walk, *args):
    """``NpuAmpItemAttrByIndex``'s answer to ``what`` (an attr name, or ""
    for the device question) when it has one and :data:`ATTRS_BY_INDEX`,
    else the library walk ``walk`` over the item's NodeDefs."""
    if ATTRS_BY_INDEX:
        got = _item_has("NpuAmpItemAttrByIndex", sink, what)
        if got is not None:
            return got
    return _item_has(walk, sink, *args)


def _patch_fn():
    """``NpuAmpWritePatch`` when the library has it (else results go back as bytes)."""
    return getattr(_lib, "NpuAmpWritePatch", None) if _lib is not None else None


def patch_records_version() -> int:
    """The patch records' format the library reads (``NpuAmpPatchRecordsVersion``;
    ``graph_passes.graph.Graph.patch_records``), 0 when it reads none."""
    fn = getattr(_loaded_lib(), "NpuAmpPatchRecordsVersion", None)
    return int(fn()) if fn is not None else 0


def assemble_patch(graph_bytes: bytes, patch) -> bytes | None:
    """The C++ side's assembly of ``patch`` (a :class:`graph_passes.graph.GraphPatch`)
    on the graph ``graph_bytes``, as deterministic bytes (tests compare it
    with ``Graph.serialize``); None without the library; ValueError when
    the patch does not fit the graph."""
    fn = getattr(library(), "NpuAmpAssemblePatch", None)
    if fn is None:
        return None
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    order = patch.order
    rc = fn(graph_bytes, len(graph_bytes), order.buffer_info()[0] if len(order) else None,
            len(order), patch.payload, len(patch.payload), ctypes.byref(data), ctypes.byref(size))
    out = ctypes.string_at(data, size.value) if size.value else b""
    if rc != 0:
        raise ValueError(out.decode("utf-8", "replace"))
    return out


_redelivery: threading.Event | None = None


def _redeliver(exc):
    """Raise ``exc`` (KeyboardInterrupt or SystemExit) in the main thread once
    it runs Python outside this module again (raised inside the ctypes
    callback, ctypes would print and drop it).  On the main thread: a one-shot
    SIGINT handler that raises ``exc``, and a helper thread that trips SIGINT
    again (10 ms later) each time the handler ran while the main thread was
    still in bridge code.  From another thread: a KeyboardInterrupt in the
    main thread (only the main thread can install signal handlers)."""
    import _thread
    import signal

    global _redelivery
    if threading.current_thread() is not threading.main_thread():
        _thread.interrupt_main()
        return
    if _redelivery is not None and not _redelivery.is_set():
        return  # one is pending already (grappler called again): that one is raised
    previous = signal.getsignal(signal.SIGINT)
    delivered = _redelivery = threading.Event()
    ran = threading.Event()

    def once(signum, frame):  # noqa: ARG001
        ran.set()
        f = frame
        while f is not None:
            if f.f_code.co_filename == __file__:  # still inside the callback: the helper retries
                return
            f = f.f_back
        delivered.set()
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        raise exc

    def trip():
        while not delivered.is_set():
            if signal.getsignal(signal.SIGINT) is not once:  # someone else took SIGINT over
                delivered.set()
                return
            ran.clear()
            _thread.interrupt_main()
            ran.wait()  # the signal stays pending while the main thread runs C++ (grappler, TF)
            delivered.wait(0.01)

    try:
        signal.signal(signal.SIGINT, once)
    except (ValueError, OSError) as err:  # no signal support: a KeyboardInterrupt is delivered
        log.warning("npu_amp_tf bridge: %s inside grappler is delivered as KeyboardInterrupt (%s)",
                    type(exc).__name__, err)
        _thread.interrupt_main()
        return
    threading.Thread(target=trip, name="npu_amp_tf-redeliver", daemon=True).start()


def _report_error(sink, exc):
    msg = f"{type(exc).__name__}: {exc}"
    log.error("npu_amp_tf bridge: unexpected error: %s", msg)
    data = msg.encode("utf-8", "replace")
    try:
        _lib.NpuAmpWriteError(sink, data, len(data))
    except (ctypes.ArgumentError, AttributeError, OSError) as err:  # library gone at exit
        log.error("npu_amp_tf bridge: could not hand the error to grappler: %s", err)


def parse_options(config_bytes: bytes):
    """``RewriterConfig.CustomGraphOptimizer`` bytes -> validated Options."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    from .options import Options

    entry = rewriter_config_pb2.RewriterConfig.CustomGraphOptimizer()
    if config_bytes:
        entry.ParseFromString(config_bytes)
    return Options.from_parameter_map(
        entry.parameter_map, _source=f"ConfigProto custom_optimizers['{OPTIMIZER_NAME}'].parameter_map")


def handle(graph_bytes: bytes, config_bytes: bytes, fetches=(), preserve=(), devices=(),
           item_id: str = "graph", shapes=None, index=None, patch: bool = False,
           opdef_precheck="auto", digest=None, base_inputs=None, has_op=None, has_attr=None,
           has_device=None, prefuse=None, prefuse_mirror=None):
    """Everything the C++ optimizer asks for, in pure Python (also used by the
    benchmark and the tests): returns ``(code, result_bytes)``.  ``shapes``:
    a lazy shape source for the graph (:func:`item_shape_source`); by default
    the C++ inference runs on the parsed graph when a pass needs shapes.
    ``index``: the graph's indexes from C++ (:func:`item_index`), or a
    callable giving them; by default :func:`pipeline.optimize` asks for them.
    ``patch``: a rewritten graph may come back as a
    :class:`graph_passes.graph.GraphPatch` of ``graph_bytes``'s graph
    (:func:`pipeline.optimize_serialized`) instead of bytes: the grappler
    callback hands it to C++ (``NpuAmpWritePatch``).  ``opdef_precheck``:
    the OpDef guard's C++ pre-check of such a patch (:func:`item_opdef_precheck`),
    see :func:`pipeline.optimize_serialized`.  ``digest``: what the memo
    knows ``graph_bytes`` by (the grappler callback hands the C++ side's
    fingerprint of them, :func:`item_fingerprint`); None: their SHA-1.
    ``base_inputs``: ``Graph.base_inputs`` of the graph parsed from
    ``graph_bytes`` (the callback's :func:`item_paint_strings`), or None.
    ``has_op``: ``has_op(op) -> bool | None``, whether ``graph_bytes``'s
    graph has a node of op type ``op`` (the callback's :func:`item_has_op`),
    asked before the bytes are searched for the plugin's error op; None: the
    bytes are searched.  ``has_attr``: ``has_attr(name) -> bool | None``, the
    same for node attrs (the callback's :func:`item_has_attr`), handed to the
    pipeline as ``Graph.source_has_attr``; ``has_device``: ``has_device() ->
    bool | None``, whether a node of it has a device string (the callback's
    :func:`item_has_device`), handed on as ``Graph.source_has_device``.
    ``prefuse``, ``prefuse_mirror``: see :func:`pipeline.optimize_serialized`
    (the callback's :func:`item_use_prefused` and :func:`item_take_mirror`)."""
    from tensorflow.core.framework import graph_pb2

    from .errors import NpuAmpError, PassError

    t0 = time.perf_counter()
    entry = {"graph": item_id, "status": None, "report": None, "error": None,
             "_cpu0": time.thread_time()}

    # 1. parameters
    try:
        options = parse_options(config_bytes)
    except NpuAmpError as exc:
        msg = f"npu_amp_tf: invalid {OPTIMIZER_NAME} parameters: {exc}"
        gd = graph_pb2.GraphDef.FromString(graph_bytes)
        if _has_poison(gd):
            return _finish(entry, "invalid_options", t0, msg, gd=gd, code=RC_UNCHANGED)
        log.error("%s", msg)
        out = poison(gd, msg, fetches, devices, INVALID_OPTIONS_NODE)
        return _finish(entry, "invalid_options", t0, msg, out=out, gd=gd)

    # 2. seen these exact bytes with these options before?  (a Session built
    #    twice on one graph, a function re-instantiated...).  The pipeline is
    #    a pure function of (graph, options, fetch, preserve, devices).
    #    The mixlist file is keyed by its parsed CONTENT (read again by
    #    parse_options on every call), not its path: an edited file is seen.
    mix = json.dumps(options.mixlist, sort_keys=True, default=list) if options.mixlist else None
    if digest is None:
        digest = hashlib.sha1(graph_bytes).digest()
    key = (hash(options), mix, digest, tuple(fetches), tuple(preserve), tuple(devices), bool(patch))
    with _lock:
        cached = _memo.get(key)
        if cached is not None:
            _memo.move_to_end(key)
    # (issue 17) a patch of the item with the layer-norm fusions made before
    # the parse put into it: the cached one fits only once they are put into
    # this item too (else the pipeline runs again)
    if cached is not None and cached[2] is not None and not (callable(prefuse) and prefuse(cached[2])):
        cached = None
    if cached is not None:
        code, out, _ = cached
        return _finish(entry, "cached", t0, None, out=out or None, code=code)
    applied = []
    if callable(prefuse):
        use = prefuse

        def prefuse(pre):  # noqa: F811 - the caller's, remembering what it took
            ok = use(pre)
            if ok:
                applied.append(pre)
            return ok

    from . import pipeline

    t_parse = time.perf_counter()
    # (issue 17r) pipeline.OWN_PARSE: the pipeline parses the bytes itself and
    # rewrites that parse in place; the GraphDef here is parsed only when a
    # path below needs the input graph (errors, an unchanged result)
    own = pipeline.OWN_PARSE
    original = _Parsed(graph_bytes)
    if not own:
        original()
    parse_s = time.perf_counter() - t_parse
    if _has_poison(original, graph_bytes, has_op):
        return _finish(entry, "unchanged", t0, None, gd=original(), code=RC_UNCHANGED)
    gd = None if own else original()

    # 3. the pipeline
    try:
        out, report, nodes = pipeline.optimize_serialized(
            graph_bytes if own else gd, options, fetches=fetches, preserve=preserve, devices=devices,
            graph_name=item_id, shapes=shapes, index=index, patch=patch,
            opdef_precheck=opdef_precheck, base_inputs=base_inputs, source_has_attr=has_attr,
            source_has_device=has_device, prefuse=prefuse,
            prefuse_mirror=prefuse_mirror)
    except PassError as exc:
        msg = f"npu_amp_tf: {exc} (fail_on_error=True)"
        log.error("%s", msg)
        gd = original()
        out = poison(gd, msg, fetches, devices, PASS_FAILED_NODE)
        return _finish(entry, "pass_failed", t0, msg, out=out, gd=gd)
    except Exception as exc:  # noqa: BLE001 - a bug outside any pass
        msg = f"npu_amp_tf: the pass pipeline failed on graph '{item_id}': {type(exc).__name__}: {exc}"
        gd = original()
        if options.fail_on_error:
            log.error("%s", msg)
            out = poison(gd, msg, fetches, devices, PASS_FAILED_NODE)
            return _finish(entry, "pass_failed", t0, msg, out=out, gd=gd)
        log.warning("%s; the graph is left unchanged", msg)
        return _finish(entry, "error", t0, msg, gd=gd, code=RC_NOT_NOW)

    # the Report itself: last_reports() / report_path turn it into JSON, which
    # computes its deferred shape-based figures only then
    if isinstance(shapes, _ItemShapes):
        shapes.fallback = graph_shape_source(gd) if gd is not None else \
            graph_shape_source(None, graph_bytes)
    entry["report"] = rep = report
    failed = report.raw_summary.get("failed_pass")
    if failed:
        _write_report_file(options, item_id, rep)
        # pipeline already logged "pass '<p>' at node '<n>': ...; the graph is left unchanged"
        msg = report.warnings[-1]["message"] if report.warnings else f"pass '{failed}' failed"
        _remember(key, RC_UNCHANGED, b"")
        return _finish(entry, "pass_failed_kept", t0, msg, gd=original(), code=RC_UNCHANGED)
    # byte comparison with graph_bytes is useless here: C++ and Python order
    # map keys differently; message equality costs ~40 ms on a 9k-node graph,
    # so count nodes first
    # (a patch only comes with a changed node count)
    if (isinstance(out, bytes) and nodes == len(original().node)
            and graph_pb2.GraphDef.FromString(out) == original()):
        _remember(key, RC_UNCHANGED, b"")
        entry["bridge_s"] = parse_s
        # (grappler's repeated call on our own output: keep the file of the call that rewrote it)
        return _finish(entry, "unchanged", t0, None, nodes=nodes, code=RC_UNCHANGED)
    _write_report_file(options, item_id, rep)
    # (the rewritten graph is serialized inside the pipeline: Graph.serialize)
    entry["bridge_s"] = parse_s
    _remember(key, RC_OK, out, applied[0] if applied and not isinstance(out, bytes) else None)
    return _finish(entry, "rewritten", t0, None, out=out, nodes=nodes)


def _remember(key, code, out, prefused=None):
    """``prefused``: the fusions made before the parse that ``out`` (a
    patch) is based on, to put into the item again on a hit."""
    with _lock:
        _memo[key] = (code, out, prefused)
        while len(_memo) > _MEMO_MAX:
            _memo.popitem(last=False)


def _finish(entry, status, t0, error, out=None, gd=None, code=RC_OK, nodes=None):
    entry["status"] = status
    entry["error"] = error
    entry["time_s"] = round(time.perf_counter() - t0, 6)
    cpu0 = entry.pop("_cpu0", None)
    entry["cpu_s"] = round(time.thread_time() - cpu0, 6) if cpu0 is not None else None
    entry.setdefault("bridge_s", None)
    entry["nodes"] = len(gd.node) if gd is not None else nodes
    _record(entry)
    if out is None:
        return (RC_UNCHANGED if code == RC_OK else code), b""
    return code, out


def _write_report_file(options, item_id, rep):
    path = options.report_path
    if not path:
        return
    if not isinstance(rep, dict):
        rep = rep.to_json()
    try:
        os.makedirs(path, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", item_id or "graph")[:120]
        with open(os.path.join(path, f"{safe}.json"), "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1, default=str)
    except OSError as exc:
        log.warning("npu_amp_tf: cannot write the report for graph '%s' to report_path=%r: %s",
                    item_id, path, exc)


# ---------------------------------------------------------------------------
# delivering an error through the graph
# ---------------------------------------------------------------------------
class _Parsed:
    """The GraphDef serialized in ``data``, parsed when first called (issue 17r)."""

    __slots__ = ("data", "_gd")

    def __init__(self, data: bytes):
        self.data, self._gd = data, None

    def __call__(self):
        if self._gd is None:
            from tensorflow.core.framework import graph_pb2

            self._gd = graph_pb2.GraphDef.FromString(self.data)
        return self._gd


def _has_poison(gd, data: bytes | None = None, has_op=None) -> bool:
    """Does ``gd`` (a GraphDef, or a callable giving it) hold one of our error
    nodes?  (``has_op(op)``: whether the graph has a node of that op type, or
    None when it cannot tell (:func:`item_has_op`, inside the callback);
    ``data``: its bytes; without the op's name in them it cannot, which a
    substring search of the bytes answers at once instead of visiting every
    node.)"""
    if has_op is not None and has_op(RAISE_OP) is False:
        return False
    if data is not None and data.find(_RAISE_OP_BYTES) < 0:
        return False
    if callable(gd):
        gd = gd()
    return any(n.name in _POISON_NODES and n.op == RAISE_OP for n in gd.node)


def _pick_device(gd, devices) -> str:
    node_devs = [n.device for n in gd.node if n.device]
    for d in node_devs:
        if "CPU" in d.upper():
            return d
    if node_devs:
        # every node is placed (a TF2 function graph): a host device must exist
        for d in devices:
            if "CPU" in d.upper():
                return d
        return node_devs[0]
    return ""


def poison(gd, message: str, fetches=(), devices=(), name: str = INVALID_OPTIONS_NODE) -> bytes:
    """Return ``gd`` (serialized) with an ``NpuAmpRaiseError`` node that every
    root of the graph waits on, so that running anything fails with ``message``.

    Roots are nodes without inputs and nodes whose data inputs all come from
    arguments/placeholders (feeds replace placeholders), plus the fetched
    nodes.  Every other node depends on one of them, and none of them sits
    inside a v1 while-loop frame, so the control edges are always legal.
    """
    from tensorflow.core.framework import graph_pb2

    out = graph_pb2.GraphDef()
    out.CopyFrom(gd)
    by_name = {n.name: n for n in out.node}
    fetch_names = {f.split(":")[0].lstrip("^") for f in fetches}
    ctrl = "^" + name
    for n in out.node:
        if n.op in _ARG_LIKE:
            continue
        data_srcs = [i.split(":")[0] for i in n.input[:] if not i.startswith("^")]
        root = (not n.input
                or all(by_name.get(s) is not None and by_name[s].op in _ARG_LIKE for s in data_srcs)
                or n.name in fetch_names)
        if root and ctrl not in n.input[:]:
            n.input.append(ctrl)
    node = out.node.add()
    node.name = name
    node.op = RAISE_OP
    node.attr["message"].s = message.encode("utf-8")
    node.device = _pick_device(gd, devices)
    return out.SerializeToString(deterministic=True)


# ---------------------------------------------------------------------------
# import-time registration
# ---------------------------------------------------------------------------
_import_error = None


def register_on_import():
    """Called by ``import npu_amp_tf``.  A failed build (no compiler, say)
    does not make the package unimportable (offline ``rewrite_graph`` still
    works); it is reported as a warning here and raised by
    :func:`ensure_registered` (``session_config``, ``enable``)."""
    global _import_error
    from .errors import BuildError

    try:
        register()
    except BuildError as exc:
        import warnings

        _import_error = exc
        warnings.warn(f"npu_amp_tf: the grappler bridge is not available: {exc}", RuntimeWarning,
                      stacklevel=3)


def ensure_registered():
    """Register the bridge now, raising the build error if there is one."""
    if _import_error is not None and _callback is None:
        raise _import_error
    return register()
