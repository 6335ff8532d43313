"""The pass pipeline behind every entry point (grappler bridge, enable(),
rewrite_graph, the CLI): fusion -> precision -> layout -> cleanup.

``optimize`` is the single function they all call; it knows nothing of
sessions.  It runs the passes on the main graph and on every function body in
the library, and returns the new GraphDef and one Report.
"""
from __future__ import annotations

import array
import ctypes
import functools
import gc
import importlib
import logging
import time
import weakref

from tensorflow.core.framework import graph_pb2

from graph_passes import manager as _manager
from graph_passes import opdef_check as _opdef_check
from graph_passes.errors import NpuAmpError, PassError
from graph_passes import shapes as _shapes
from graph_passes.graph import Graph, GraphPatch
from graph_passes.report import Report

from .options import Options

log = logging.getLogger("npu_amp_tf")

# Pass modules register themselves on import.  One that fails to import is
# left out of the pipeline, and every report says so (import_problems()).
_PASS_MODULES = ("graph_passes.unfuse", "graph_passes.fusion", "graph_passes.precision",
                 "graph_passes.layout", "graph_passes.cleanup")
_import_failures: dict[str, str] = {}


def _import_passes():
    for mod in _PASS_MODULES:
        if mod in _import_failures:
            continue
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - reported in every report, see import_problems
            _import_failures[mod] = f"{type(exc).__name__}: {exc}"
            log.warning("npu_amp_tf: pass module %s failed to import and is left out of the "
                        "pipeline: %s", mod, _import_failures[mod])


def import_problems() -> dict[str, str]:
    """Pass modules that failed to import: module -> error."""
    _import_passes()
    return dict(_import_failures)


def pass_names(options: Options) -> list[str]:
    """The ordered pass list these options ask for."""
    _import_passes()
    reg = _manager.PASS_REGISTRY
    names = []
    if "unfuse" in reg:
        names.append("unfuse")
    if options.graph_level >= 1 and "fusion" in reg:
        names.append("fusion")
    if "precision" in reg:
        names.append("precision")
    if options.format_mode == "NC1HWC0":
        if "layout" not in reg:
            raise NpuAmpError("format_mode='NC1HWC0' needs the layout pass, which is not available")
        names.append("layout")
    names.append("cleanup")
    return names


def summarize(graph: Graph, report: Report):
    """Totals over the final graph, whatever passes ran."""
    # (from the op-type index, which every pass keeps true or the manager
    # rebuilds after an untracked pass: Graph.index_problems)
    counts = {"nodes": len(graph.nodes), "casts": graph.count_of_type("Cast"),
              "transdata": graph.count_of_type("TransData")}
    report.raw_summary.update(counts)


def optimize(graph_def, options: Options | None = None, fetches=(), preserve=(), devices=(),
             include_functions: bool = True, graph_name: str | None = None, shapes=None,
             index="auto"):
    """Run the pipeline.  Returns ``(GraphDef, Report)``.

    ``shapes``: a lazy shape source for the main graph (see
    :func:`graph_passes.shapes.attach`); by default grappler's C++ shape
    inference runs on ``graph_def`` when, and if, a pass first needs a shape.

    ``index``: the graph's indexes computed in C++ (bytes, or a callable
    giving them; see :class:`graph_passes.graph.Graph`): the bridge hands
    over those of grappler's item (:func:`npu_amp_tf.bridge.item_index`).
    By default (``"auto"``, offline) they are computed by the C++ library
    from ``graph_def``'s bytes when the library is loaded
    (:func:`npu_amp_tf.bridge.graph_index`; about what building them in
    Python costs, and they carry the per-node signature classes the precision
    pass reads instead of NodeDef attrs, issue 17f); with ``index=None``, or
    without the library, the ``Graph`` builds them in Python.

    On an internal pass failure the *original* graph is returned with a
    warning naming the pass and node, unless ``options.fail_on_error``.
    """
    out, report, _ = _optimize(graph_def, options, fetches, preserve, devices, include_functions,
                               graph_name, shapes, index, serialized=False)
    return out, report


def optimize_serialized(graph_def, options: Options | None = None, fetches=(), preserve=(),
                        devices=(), include_functions: bool = True, graph_name: str | None = None,
                        shapes=None, index="auto", patch: bool = False, opdef_precheck="auto",
                        base_inputs=None, source_has_attr=None, source_has_device=None, prefuse=None,
                        prefuse_mirror=None):
    """:func:`optimize`, with the rewritten graph as its deterministic
    serialization (what the grappler bridge hands back), written straight
    from the indexed graph (``Graph.serialize``) instead of through a copied
    GraphDef.  Returns ``(bytes, Report, nodes)``: ``nodes`` the rewritten
    graph's node count; the bytes are ``graph_def``'s when the graph is left
    unchanged after a failure.

    ``patch``: the rewritten graph may instead be a
    :class:`graph_passes.graph.GraphPatch` of ``graph_def`` (its changed
    nodes and the positions of the others, ``Graph.serialize_patch``; the
    grappler bridge assembles it in C++ from the item it holds): when the
    node count changed, no GE dump is asked for and no pass left the graph
    untracked.

    ``opdef_precheck`` (issue 17m): for a patch, the OpDef guard's C++
    pre-check, ``fn(patch, default_device_type)`` -> True (clean: the
    Python guard does not run), False or None (it runs): the bridge's
    :func:`npu_amp_tf.bridge.item_opdef_precheck` on the item grappler
    holds.  ``"auto"``: the same check on ``graph_def``'s bytes when they
    were given and the library is loaded; None: the Python guard alone.

    ``base_inputs`` (issue 17): ``Graph.base_inputs`` of the main graph (a
    source of the input's node inputs for the precision pass's painting:
    the bridge's :func:`npu_amp_tf.bridge.item_paint_strings` on the item it
    was serialized from), or None.  ``source_has_attr``: ``Graph.source_has_attr``
    of the main graph (the bridge's :func:`npu_amp_tf.bridge.item_has_attr`
    on that item), or None; ``source_has_device`` likewise
    ``Graph.source_has_device`` (:func:`npu_amp_tf.bridge.item_has_device`).

    ``prefuse`` (issue 17, bytes only): None, the layer-norm rule's first
    run made in C++ on the bytes when it can be
    (:mod:`graph_passes.fusion.prefuse`); False, never; a callable
    ``prefuse(pre) -> bool``, asked whether to use a run's result (the
    grappler bridge applies it to the item it holds first).  ``prefuse_mirror``
    (issue 17): None, or a callable giving the gradient-region mirror already
    loaded from ``graph_def``'s bytes (a handle the run then owns) or None:
    the C++ run takes it instead of loading its own (the grappler bridge's
    :func:`npu_amp_tf.bridge.item_take_mirror`)."""
    return _optimize(graph_def, options, fetches, preserve, devices, include_functions, graph_name,
                     shapes, index, serialized="patch" if patch else True,
                     opdef_precheck=opdef_precheck, base_inputs=base_inputs,
                     source_has_attr=source_has_attr, source_has_device=source_has_device,
                     prefuse=prefuse, prefuse_mirror=prefuse_mirror)


def _optimize(*args, **kwargs):
    """The pipeline with Python's cyclic garbage collector paused.

    A run allocates ~100k objects that live for the run (node wrappers,
    index tuples), so generation-2 collections kept traversing them: ≈ 70 ms
    of collector time per run on a ResNet-50 training graph.  The pipeline
    leaves no reference cycles behind (``tests/test_speed_paths.py``), so
    what it frees is freed by reference counting; the collector's previous
    state is restored, also on an error."""
    if not gc.isenabled():
        return _optimize_run(*args, **kwargs)
    gc.disable()
    try:
        return _optimize_run(*args, **kwargs)
    finally:
        if PROMOTE_SURVIVORS and gc.get_freeze_count() == 0:
            # (issue 17j) what the run leaves alive (the result, the lazy
            # report's graphs) would be traversed by the first young
            # collection after gc.enable() and again as it ages (≈ 10-20 ms
            # per run on ResNet-50, more on BERT): move every tracked object to
            # the oldest generation instead (freeze + unfreeze: a list splice,
            # no traversal; nothing stays frozen, a cycle among them is still
            # found by the next full collection).  Skipped when the process
            # froze objects itself (unfreeze would release them).
            gc.freeze()
            gc.unfreeze()
        gc.enable()


#: (issue 17j) promote the objects alive after a run to the oldest GC
#: generation (see :func:`_optimize`); False: leave the collector's
#: generations as they are (the reference; the same graphs and reports)
PROMOTE_SURVIVORS = True


def _optimize_run(graph_def, options, fetches, preserve, devices, include_functions, graph_name,
                  shapes, index, serialized, opdef_precheck=None, base_inputs=None,
                  source_has_attr=None, source_has_device=None, prefuse=None, prefuse_mirror=None):
    options = options if options is not None else Options.from_kwargs()
    data = None
    own = False  # (issue 17r) graph_def is this run's own parse: rewritten in place
    if isinstance(graph_def, (bytes, bytearray)):
        data = bytes(graph_def)
    report = Report()
    report.graph_name = graph_name
    report.options = options.rewrite_params()
    if options.env_overrides:
        report.raw_summary["env_overrides"] = dict(options.env_overrides)
    for note in options.notes:
        report.warn(note)
    if options.device_only_keys:
        report.raw_summary["ge_device_only_keys"] = sorted(options.device_only_keys)
        report.warn("GE option(s) " + ", ".join(sorted(options.device_only_keys))
                    + ": no effect off the NPU")
    t0 = time.perf_counter()
    # (issue 17k) this thread's CPU time per stage: wall time on a shared machine counts the neighbours
    cpu, stages = time.thread_time, {}
    c0 = cpu()
    names = pass_names(options)
    for mod, err in _import_failures.items():
        report.warn(f"pass module {mod} failed to import and did not run: {err}")
    ctx = _manager.PassContext(options, fetches, preserve, devices, report)
    # (issue 17) the layer-norm rule's first run made in C++ on the bytes
    # (graph_passes/fusion/prefuse.py); ``prefuse(pre)``: the caller's say
    # on using it (the grappler bridge applies it to the item it holds)
    pre = None
    # (a patch's base is the caller's graph: the bridge's item takes the
    # fusions in, `prefuse(pre)`; an offline caller's graph does not)
    if prefuse is not False and "fusion" in names and (serialized != "patch" or callable(prefuse)):
        from graph_passes.fusion import prefuse as _prefuse

        raw = data
        if raw is None and _prefuse.refusal(ctx, names) is None and _prefuse.may_have_norms(graph_def):
            raw = graph_def.SerializeToString()  # (a GraphDef given: its bytes, for the C++ run)
        # (a mirror loaded already is of the caller's bytes: used only for them)
        pre = (_prefuse.run(raw, ctx, names, mirror=prefuse_mirror if raw is data else None)
               if raw is not None else None)
        if pre is not None and callable(prefuse) and not prefuse(pre):
            pre = None
        if pre is not None and data is None:
            data = raw  # (the input as it came, from here: bytes)
        stages["prefuse"] = cpu() - c0
        c0 = cpu()
    ctx.prefused = pre
    source = pre.data if pre is not None else data  # the bytes the graph is parsed from
    if data is not None:
        gd = graph_pb2.GraphDef()
        gd.ParseFromString(source)
        graph_def = gd
        own = OWN_PARSE
    # the input graph as it came: with `own` (or when `source` is not it),
    # parsed again only when a path below needs it (a failure, an OpDef
    # problem, a GE dump)
    original = _Reparsed(data) if own or pre is not None else (lambda: graph_def)
    if isinstance(index, str) and index == "auto":  # offline: the C++ index, when the library is loaded
        from .bridge import graph_index

        index = functools.partial(graph_index, graph_def, source)
    try:
        graph = Graph(graph_def, index=index, copy=not own)
        if base_inputs is not None:
            graph.base_inputs = base_inputs
        if source_has_attr is not None:
            graph.source_has_attr = source_has_attr
        if source_has_device is not None:
            graph.source_has_device = source_has_device
        # the graph as created (the gradient-region search's C++ mirror): the
        # bytes it was parsed from, or the caller's GraphDef (Graph copied it)
        graph.source_bytes = source if source is not None else (None if own else graph_def.SerializeToString)
        stages["graph"] = cpu() - c0
        if shapes is None:
            from .bridge import graph_shape_source

            # (the graph as it came, also after the layer-norm fusions made before the parse:
            # the passes' shape table is the input's, as when the fusion pass makes them)
            shapes = (graph_shape_source(None, data) if pre is not None else
                      graph_shape_source(graph_def) if not own else graph_shape_source(None, source))
        if shapes is not None:
            _shapes.attach(graph, _timed(shapes, report))
        ctx.native_paint = native_paint_entry()
        mgr = _manager.PassManager(names, validate=options.validate_graph)
        c0 = cpu()
        mgr.run(graph, ctx)
        stages["passes"] = cpu() - c0
        if include_functions and graph.library.function:
            c0 = cpu()
            _optimize_functions(graph, mgr, options, devices, report)
            stages["functions"] = cpu() - c0
        if pre is not None:  # the nodes the C++ run created or edited: the passes' own from here
            pre.shapes = None  # (its mirror and walks, for the passes' shape lookups: freed now)
            live = [n for n in pre.touched if n in graph.nodes]
            if live:
                # (issue 17) as they are in the graph the passes began with (and the
                # item now holds): changed for the OpDef guard, their bytes not sent
                # again (records with no edit; a node a pass edited since goes whole)
                graph.note_retyped([(live, ())])
        summarize(graph, report)
        c0 = cpu()
        dump = options.ge.get("enable_dump") or options.ge.get("enable_dump_debug")
        if serialized == "patch" and not dump:
            graph.patch_records = PATCH_RECORDS and _records_readable()
            out = graph.serialize_patch()
            if out is not None and _grad_region_checks() and len(out.order) and min(out.order) < -1:
                _check_records(source if source is not None else graph_def.SerializeToString(), out, graph)
        else:
            out = None
        if out is None:
            out = graph.serialize() if serialized else graph.to_graph_def()
        nodes = len(graph.nodes)
        stages["serialize"] = cpu() - c0
        c0 = cpu()
        # checked on the indexed graph itself (its nodes are `out`'s, bar the
        # private `_class` attrs to_graph_def drops): no second index to build;
        # only the nodes the passes created or edited and their readers
        # (every node with validate_graph=True, or after an untracked pass)
        changed = None if options.validate_graph else graph.changed_nodes()
        dev = ctx.default_device_type()
        problems = _opdef_check.new_problems(original, graph, dev, changed,
                                             _precheck(opdef_precheck, out, source, dev))
        stages["opdef_check"] = cpu() - c0
        if problems:
            _opdef_failure(problems, "main graph", options, report)
            out, nodes = _original(original(), serialized), len(original().node)
    except PassError as exc:
        if options.fail_on_error:
            raise
        msg = f"{exc}; the graph is left unchanged"
        log.warning("npu_amp_tf: %s", msg)
        report.warn(msg, node=exc.node, pass_name=exc.pass_name)
        report.raw_summary["failed_pass"] = exc.pass_name
        out, nodes = _original(original(), serialized), len(original().node)
    finally:
        if pre is not None:
            pre.shapes = None  # (the run's mirror and walks: not kept past the passes, on any path)
    if options.ge.get("enable_dump") or options.ge.get("enable_dump_debug"):
        report.summary["ge_dump"] = _ge_dump(original(), out, report, options, graph_name)
    report.raw_summary["pipeline"] = names
    # whether a pass needed shapes (else they are inferred when the report is read)
    report.raw_summary["shapes_inferred_in_pipeline"] = "shape_inference_s" in report.raw_summary
    report.raw_summary["time_s"] = round(time.perf_counter() - t0, 6)
    #: {stage: this thread's CPU seconds}: graph (parse, C++ index, Graph()), passes
    #: (main graph), functions (their bodies), serialize, opdef_check
    report.raw_summary["stages_cpu_s"] = {k: round(v, 6) for k, v in stages.items()}
    return out, report, nodes


_paint_entry = None  # (issue 17l) the ctypes painting entry point once set up; False: none


#: (issue 17) a patch sends the nodes a pass only re-typed or re-wired as
#: those edits (``Graph.patch_records``) when the bridge's library reads them;
#: False: every changed node serialized whole (the reference; the same output)
PATCH_RECORDS = True
#: [patches with records assembled and compared with the whole graph's bytes
#: (under grad_region.CHECK_NATIVE, the test suite), differing]
CHECKED_RECORDS = [0, []]


def _records_readable() -> bool:
    from .bridge import patch_records_version

    return patch_records_version() == Graph.RECORDS_VERSION


def _grad_region_checks() -> bool:
    from graph_passes.fusion import grad_region

    return grad_region.CHECK_NATIVE


def _check_records(source, patch, graph):
    """(CHECK_NATIVE) ``patch``, records and all, assembled on ``source``
    (the bytes of the graph the patch is of) gives ``graph.serialize()``'s
    bytes."""
    from .bridge import assemble_patch

    CHECKED_RECORDS[0] += 1
    want = graph.serialize()
    try:
        got = graph_pb2.GraphDef.FromString(assemble_patch(source, patch))
        same = got.SerializeToString(deterministic=True) == want
    except ValueError as exc:
        got, same = str(exc), False
    if not same and len(CHECKED_RECORDS[1]) < 16:
        ref = graph_pb2.GraphDef.FromString(want)
        if isinstance(got, str):
            CHECKED_RECORDS[1].append(got)
        else:
            diff = [(a.name, b.name) for a, b in zip(got.node, ref.node) if a != b]
            CHECKED_RECORDS[1].append((len(got.node), len(ref.node), diff[:3]))


def native_paint_entry():
    """The precision pass's painting loops in C++ (``ctx.native_paint``: see
    graph_passes/precision/native.py and custom_ops/precision_paint.cc), when
    the custom-op library is loaded and has them; else None (the pass paints
    in Python).  ``fn(strings, ints, n_out, check)`` -> ``array('i')`` or None;
    with the library's ``NpuAmpPaintFixEdges``, a :class:`PaintResult` whose
    painter stays open for the casts' plan (``native.fix_edges``)."""
    global _paint_entry
    if _paint_entry is not None:
        return _paint_entry or None
    from . import bridge

    lib = bridge._lib
    if lib is None:
        return None  # (not loaded yet: asked again next run)
    if not hasattr(lib, "NpuAmpPaintRun"):
        _paint_entry = False
        return None
    c_int64, c_void_p = ctypes.c_int64, ctypes.c_void_p
    lib.NpuAmpPaintOpen.argtypes = [ctypes.c_char_p, ctypes.c_size_t, c_void_p, c_int64]
    lib.NpuAmpPaintOpen.restype = c_void_p
    lib.NpuAmpPaintRun.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int64,
                                   c_void_p, c_int64]
    lib.NpuAmpPaintRun.restype = c_int64
    lib.NpuAmpPaintClose.argtypes = [c_void_p]
    lib.NpuAmpPaintClose.restype = None
    fix = getattr(lib, "NpuAmpPaintFixEdges", None)
    if fix is not None:
        fix.argtypes = [c_void_p, c_void_p, c_int64, c_void_p, c_int64,
                        ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        fix.restype = ctypes.c_int
    delay = getattr(lib, "NpuAmpPaintDelayPlan", None)
    if delay is not None:
        delay.argtypes = [c_void_p, c_void_p, c_int64, ctypes.POINTER(ctypes.c_char_p),
                          ctypes.POINTER(ctypes.c_size_t)]
        delay.restype = ctypes.c_int

    def paint(strings, ints, n_out, check):
        # (arrays passed by address, as bridge.kahn_order does)
        h = lib.NpuAmpPaintOpen(strings, len(strings), ints.buffer_info()[0], len(ints))
        if not h:
            return None
        kept = None
        try:
            n = ints[1]
            asked = array.array("i", bytes(4 * max(n, 1)))
            out = PaintResult(bytes(4 * n_out)) if fix is not None else array.array("i", bytes(4 * n_out))
            answered, bad = array.array("i", [0]), array.array("i", [0])
            na = nb = 0
            for _ in range(n + 1):  # (each round answers at least one more constant)
                k = lib.NpuAmpPaintRun(h, answered.buffer_info()[0], na, bad.buffer_info()[0], nb,
                                       out.buffer_info()[0], n_out, asked.buffer_info()[0], n)
                if k < 0 or k > n:
                    return None
                unsafe = check(asked[:k].tolist()) if k else None
                if not unsafe:  # (the result stands: the constants taken as safe are)
                    if fix is None:
                        return out
                    # (issue 17) the painter stays open for the casts' plan
                    # (PaintResult.fix_edges); closed with the result
                    out.painter = kept = _Painter(lib, fix, h)
                    return out
                new = asked[:k].tolist()
                answered, bad = array.array("i", new), array.array("i", unsafe)
                na, nb = len(new), len(unsafe)
            return None
        finally:
            if kept is None:
                lib.NpuAmpPaintClose(h)

    _paint_entry = paint
    return paint


class PaintResult(array.array):
    """The painting's result record (an ``array('i')``) with the open
    painter behind it (``painter``: :class:`_Painter`), for the casts'
    plan (``graph_passes.precision.native.fix_edges``)."""

    __slots__ = ("painter",)

    def __new__(cls, data):
        return super().__new__(cls, "i", data)


class _Painter:
    """An open C++ painter (``NpuAmpPaintOpen``), closed when dropped."""

    def __init__(self, lib, fix, h):
        self._lib, self._fix, self._h = lib, fix, h

    def fix_edges(self, out, ints):
        """``NpuAmpPaintFixEdges``: the plan's bytes, or None (Python plans)."""
        data, size = ctypes.c_char_p(), ctypes.c_size_t()
        rc = self._fix(self._h, out.buffer_info()[0], len(out), ints.buffer_info()[0], len(ints),
                       ctypes.byref(data), ctypes.byref(size))
        if rc != 0:
            return None
        return ctypes.string_at(data, size.value)

    def delay_plan(self, pos):
        """``NpuAmpPaintDelayPlan`` over ``pos`` (int32 array): the plan's
        int32 array, or None."""
        fn = getattr(self._lib, "NpuAmpPaintDelayPlan", None)
        if fn is None or not self._h:
            return None
        data, size = ctypes.c_char_p(), ctypes.c_size_t()
        if fn(self._h, pos.ctypes.data, len(pos), ctypes.byref(data), ctypes.byref(size)) != 0:
            return None
        return ctypes.string_at(data, size.value)

    def close(self):
        h, self._h = self._h, None
        if h:
            self._lib.NpuAmpPaintClose(h)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
            pass


def _precheck(fn, out, data, device):
    """The OpDef guard's C++ pre-check of ``out`` as ``opdef_check.new_problems``
    takes it (a callable, True: clean), or None: only for a patch (its
    changed nodes are the guard's ``changed``), with ``fn`` given or, for
    ``"auto"``, the input's bytes at hand (offline)."""
    if fn is None or not isinstance(out, GraphPatch):
        return None
    if isinstance(fn, str):
        if fn != "auto" or data is None:
            return None
        from .bridge import graph_opdef_precheck

        return functools.partial(graph_opdef_precheck, data, out, device)
    return functools.partial(fn, out, device)


#: (issue 17r) given serialized bytes, the pipeline rewrites its own parse of
#: them in place (``Graph(copy=False)``) and parses the bytes again only when
#: a failure or an OpDef problem needs the input graph (the grappler bridge
#: hands the bytes, not a GraphDef it parsed: one parse per call, no copy;
#: ~8 ms per call on the Keras ResNet-50 training graph); False: the parse is
#: copied (the reference; the same graphs and reports)
OWN_PARSE = True


class _Reparsed:
    """The GraphDef of ``data``, parsed again when first called (issue 17r)."""

    __slots__ = ("data", "_gd")

    def __init__(self, data):
        self.data, self._gd = data, None

    def __call__(self):
        if self._gd is None:
            self._gd = graph_pb2.GraphDef.FromString(self.data)
        return self._gd


def _original(graph_def, serialized):
    return graph_def.SerializeToString(deterministic=True) if serialized else graph_def


def _timed(source, report):
    """The shape source, recording in the report how long it took.

    The report is held weakly: the graph holds this source and the report's
    deferred figures hold the graph, so a strong reference would make a
    reference cycle that only a full garbage collection frees (≈ 75k objects
    per run on a ResNet-50 training graph)."""
    if not callable(source):
        return source
    report_ref = weakref.ref(report)

    def run():
        t0 = time.perf_counter()
        try:
            return source()
        finally:
            rep = report_ref()
            if rep is not None:
                rep.raw_summary["shape_inference_s"] = round(time.perf_counter() - t0, 6)
    return run


def _opdef_failure(problems, what, options, report: Report):
    """A rewritten graph (or function body) broke its OpDefs: keep the original.

    TF would reject such a graph, or worse, run it into a kernel ``CHECK``
    that aborts the process; the user's graph runs unchanged instead."""
    shown = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
    msg = (f"the rewritten {what} does not satisfy TensorFlow's op definitions ({shown}); "
           f"the {what} is left unchanged")
    if options.fail_on_error:
        raise PassError("opdef_check", msg)
    log.warning("npu_amp_tf: %s", msg)
    quoted = problems[0].split("'")[1::2]  # edge 'src' -> 'dst':k names the consumer second
    node = (quoted[1] if problems[0].startswith("edge") and len(quoted) > 1
            else quoted[0] if quoted else None)
    report.warn(msg, node=node, pass_name="opdef_check")
    report.raw_summary.setdefault("opdef_check_failed", []).append({"graph": what, "problems": problems[:20]})
    if what == "main graph":
        report.raw_summary["failed_pass"] = "opdef_check"


_RATIO_KEYS = frozenset({"lp_flop_share", "time_s"})


def _optimize_functions(graph: Graph, mgr, options, devices, report: Report):
    from graph_passes.errors import GraphError
    from graph_passes.functions import function_graph

    subs = []
    for fname in list(graph.functions):
        try:
            fgraph = function_graph(graph, fname)
        except GraphError as exc:
            report.warn(f"function body not rewritten: {exc}", node=fname)
            continue
        sub = Report()
        preserve = [n for n, node in fgraph.nodes.items() if node.op in ("_Arg", "_Retval")]
        ctx = _manager.PassContext(options, (), preserve, devices, sub)
        ctx.native_paint = native_paint_entry()
        mgr.run(fgraph, ctx)
        problems = _opdef_check.graph_problems(fgraph, ctx.default_device_type())
        if problems:
            old = set(_opdef_check.graph_problems(function_graph(graph, fname), ctx.default_device_type()))
            problems = [p for p in problems if p not in old]
        if problems:
            _opdef_failure(problems, f"function '{fname}'", options, report)
            continue  # the body stays as it was; its decisions are not reported
        graph.set_function(fgraph)
        for node, dec in sub.decisions.items():
            report.decisions[f"{fname}/{node}"] = dict(dec, function=fname)
        for w in sub.warnings:
            report.warnings.append(dict(w, function=fname))
        subs.append(sub)
    # the bodies' totals include their deferred shape figures: summed when read
    report.defer(lambda rep: _sum_functions(subs, rep))


def _sum_functions(subs, report: Report):
    s = report.raw_summary
    for sub in subs:
        for k, v in sub.summary.items():
            if k in _RATIO_KEYS:
                continue  # ratios are recomputed from the summed parts below
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                s.setdefault(f"functions_{k}", 0)
                s[f"functions_{k}"] += v
    if s.get("functions_matrix_flops"):
        s["functions_lp_flop_share"] = s.get("functions_lp_flops", 0) / s["functions_matrix_flops"]
    total = (s.get("matrix_flops") or 0) + (s.get("functions_matrix_flops") or 0)
    if total:
        s["total_lp_flop_share"] = ((s.get("lp_flops") or 0) + (s.get("functions_lp_flops") or 0)) / total


def rewrite_graph(graph_def, fetches=None, preserve=None, **params):
    """Rewrite a GraphDef offline.  ``params`` are the options-module keys
    (``precision_mode=...``, ``modify_mixlist=...``, ``graph_level=...``...).

    As in a Session, function calls (``PartitionedCall`` /
    ``StatefulPartitionedCall``) are first inlined by grappler's function
    optimizer (:func:`npu_amp_tf.inline.inline_calls`): ``fetches``,
    ``preserve`` and every call whose outputs nothing reads keep their names
    and outputs; calls grappler does not inline keep their functions'
    signatures, and those bodies are rewritten on their own.

    Returns ``(new_graph_def, report)``.
    """
    from .inline import InlineError, inline_calls

    options = Options.from_kwargs(_groups=("rewrite",), **params)
    if isinstance(fetches, str):
        fetches = [fetches]
    if isinstance(preserve, str):
        preserve = [preserve]
    problem = None
    try:
        graph_def = inline_calls(graph_def, fetches or (), preserve or ())
    except InlineError as exc:
        if options.fail_on_error:
            raise
        problem = f"{exc}; function bodies are rewritten on their own (casts at their boundaries)"
        log.warning("npu_amp_tf: %s", problem)
    out, report = optimize(graph_def, options, fetches or (), preserve or ())
    if problem:
        report.warn(problem)
    return out, report


def _ge_dump(before, after, report: Report, options: Options, graph_name) -> str:
    """GE's ``enable_dump`` / ``enable_dump_debug`` here: write the graph as
    given and as rewritten, plus the report, under ``dump_path/<graph>/``
    (``before.pb``, ``after.pb``, ``report.json``, ``meta.json``).  Tensor
    values come from ``npu-amp dump after.pb --inputs ...`` / ``npu-amp compare``.
    Returns the directory (or the error text: a failed dump never fails the
    rewrite)."""
    import json
    import os
    import re

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", graph_name or "graph")[:100] or "graph"
    d = os.path.join(options.ge["dump_path"], name)
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "before.pb"), "wb") as fh:
            fh.write(before.SerializeToString())
        with open(os.path.join(d, "after.pb"), "wb") as fh:
            fh.write(after if isinstance(after, bytes) else after.SerializeToString())
        with open(os.path.join(d, "report.json"), "w", encoding="utf-8") as fh:
            json.dump(report.to_json(), fh, indent=1, default=str)
        meta = {k: v for k, v in options.ge.items() if k.startswith(("dump", "enable_dump"))}
        with open(os.path.join(d, "meta.json"), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1, default=str)
    except OSError as exc:
        msg = f"GE dump to '{d}' failed: {exc}"
        report.warn(msg)
        return msg
    return d
