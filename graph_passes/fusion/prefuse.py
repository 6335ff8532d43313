"""The ``layer_norm`` rule run in C++ before Python parses the graph (issue 17).

On a transformer's training graph the ``layer_norm`` rule is most of the
fusion pass: per norm, the forward ops and their ~80-node gradient region
become ``LayerNorm`` / ``LayerNormGrad``.  Done by the Python rule, each fusion
pays for nodes Python parsed, indexed, matched and then removed.  Here the
rule's whole first run (its anchors, the plan of each, the emission, the
framework's checks, the commit, with ``grad_region._positions``' positions)
runs over the gradient-region search's C++ mirror of the graph's bytes
(``NpuAmpGrFuseNorms``, custom_ops/grad_region.cc ``NormFuser``), and Python
parses the graph it leaves:

    pre = prefuse.run(data, ctx, pass_names)     # Prefused, or None
    graph = Graph(parse(pre.data))               # the pipeline goes on from there
    FusionPass                                   # reports pre's fusions as its own

It is the same run as the Python rule's first one because the layer-norm
rules run first in each sweep (``builtin.register_norms``) and nothing before
the fusion pass would change what they read:

* the three pattern norm rules before ``layer_norm`` must find nothing: the
  C++ side refuses a graph where one of their patterns may match (a
  necessary condition of each, ``NormFuser::OtherNormRuleMayMatch``);
* the unfuse pass must change nothing: a graph with one of
  ``unfuse.FUSED_OPS`` is refused;
* the rule and its three predecessors are the built-in ones, in that order,
  with no policy, and the fusion pass runs at a graph level that has it.

The first anchor the C++ run cannot decide as Python would (a question only
Python answers, a refusal Python words, a kernel missing) ends the run there:
the fusions before it are kept and the rule, which runs again in the fusion
pass, does the rest.  ``PREFUSE = False`` is the reference; under
``grad_region.CHECK_NATIVE`` (the test suite) every run is compared with the
Python rule's on the same graph (:data:`CHECKED`).
"""
from __future__ import annotations

import functools
import weakref

from ..graph import parse_tensor

#: (issue 17) the layer-norm rule runs in C++ before the parse; False: the reference
PREFUSE = True
#: the norm rules, in the order they must run first (builtin.register_norms)
NORM_RULES = ("layer_norm_moments", "layer_norm_keras3", "layer_norm_keras2", "layer_norm")
#: the ops a fused norm emits (the kernels the C++ side may emit, checked here once)
EMITTED_OPS = ("LayerNorm", "LayerNormGrad", "RMSNorm", "RMSNormGrad", "Reshape", "Identity", "AddN",
               "Add", "AddV2")
#: [runs that fused, fusions made, runs compared with the Python rule (CHECK_NATIVE), differences]
CHECKED = [0, 0, 0, []]
#: why runs ended before their last anchor, or could not run: {why: count} (for tests and debugging)
LEFT = {}


class Prefused:
    """What the C++ run did to a graph's bytes.  The name lists are split
    from the run's text when first read (the grappler callback hands the
    bytes to the item, and starts its index, before any is needed)."""

    def __init__(self, data: bytes, index, fused: int, why: str, touched: str, removed: str,
                 entries: str, shapes=None):
        #: the graph's bytes after the fusions
        self.data = data
        #: per node of ``data``, its index in the input bytes; -1: created, or edited
        self.index = index
        #: the fusions made
        self.fused = fused
        #: why the run ended before its last anchor ("" when it did not)
        self.why = why
        self._text = [touched, removed, entries]
        self._lists = [None, None, None]
        #: the shapes the run's C++ walks found (:class:`WalkedShapes`), or None
        self.shapes = shapes

    def _list(self, k):
        got = self._lists[k]
        if got is None:
            text = self._text[k]
            if k < 2:
                got = text.split("\x02") if text else []
            else:
                got = []
                for item in text.split("\x03") if text else ():
                    anchor, nodes, region = item.split("\x01")
                    got.append((anchor, nodes.split("\x02") if nodes else [],
                                region.split("\x02") if region else []))
            self._lists[k] = got
        return got

    @property
    def touched(self) -> list:
        """The nodes created or edited (Python serialises and checks them as its passes' own)."""
        return self._list(0)

    @property
    def removed(self) -> list:
        """The input's nodes removed."""
        return self._list(1)

    @property
    def entries(self) -> list:
        """Per fusion: (anchor, fused nodes, gradient nodes), the report's entries."""
        return self._list(2)

    def shape_asker(self, graph):
        """An ``ask`` of ``shapes.local_shape`` over ``graph`` (the graph
        parsed from :attr:`data`, as the passes after the fusion pass hold
        it) from the run's walks (:data:`SHAPES_AFTER`), or None."""
        if not SHAPES_AFTER or self.shapes is None:
            return None
        return _WalkedAsk(self.shapes, graph, self.touched)


#: (issue 17) the passes after the fusion pass ask the shapes the run's C++
#: walks found (:meth:`Prefused.shape_asker`; BERT-12: the precision pass's
#: FP32 copies' sizes, otherwise walked again in Python); False: the
#: reference, Python walks them
SHAPES_AFTER = True
#: (CHECK_NATIVE) the walked shapes asked and compared with Python's walk
CHECKED_SHAPES = [0]
#: (CHECK_NATIVE) the runs that reached their last anchor, after which the
#: Python rule was run a second time and found nothing (:func:`finished_rules`)
CHECKED_IDLE = [0]


class WalkedShapes:
    """The run's mirror (the fused graph) and its shape walks' memo, kept
    for the walks the passes after it make (freed with this object)."""

    def __init__(self, lib, h=None):
        """``h``: a mirror loaded already, which this object then owns; None: a new one."""
        self.lib, self.memo, self.h = lib, lib.shape_memo(), h or lib.new()
        self.buf = lib.shape_buffer()
        weakref.finalize(self, _free_walked, lib, self.memo, self.h)


def _free_walked(lib, memo, h):
    if memo:
        lib.free_shape_memo(memo)
    if h:
        lib.free(h)


class _WalkedAsk:
    """``ask`` of :func:`graph_passes.shapes.local_shape`: a tensor's fully
    known shape as the run's walks found it, for a node the run neither
    created nor edited and no pass created since (a node a pass rewired
    keeps its output's shape: casts are inserted, fusions replace what
    feeds it with what has the same shape); else ``UNANSWERED``.  Under
    ``CHECK_NATIVE`` each answer is compared with Python's walk."""

    def __init__(self, walked, graph, touched):
        from . import grad_region as gr

        self.walked, self.graph = walked, graph
        self.touched = frozenset(touched)
        self.reference = {} if gr.CHECK_NATIVE else None

    def __call__(self, ref):
        from ..shapes import UNANSWERED, local_shape

        g = self.graph
        src = parse_tensor(ref)[0]
        if src in self.touched or src in g.created or src not in g.nodes:
            return UNANSWERED
        w = self.walked
        ok, got = w.lib.shape(w.h, w.memo, ref, w.buf)
        if not ok or got is None:  # (gave up, or no fully known shape: Python walks it)
            return UNANSWERED
        if self.reference is not None:
            CHECKED_SHAPES[0] += 1
            want = local_shape(g, ref, self.reference)
            if want != got:
                CHECKED[3].append([f"shape of {ref!r}: the run's walk {got!r}, Python's {want!r}"])
                raise AssertionError(f"the shape the run before the parse walked for {ref!r} differs from "
                                     f"Python's walk: C++ {got!r}, Python {want!r}")
        return got


def refusal(ctx, pass_names) -> str | None:
    """Why the C++ run cannot stand for the rule's first run in this
    pipeline (None: it can)."""
    from . import builtin, norm_plan
    from . import grad_region as gr
    from .core import RULES

    if not PREFUSE:
        return "off (prefuse.PREFUSE)"
    lib = gr.native
    if lib is None or not getattr(lib, "can_fuse_norms", False):
        return "the library has no NpuAmpGrFuseNorms"
    if not (gr.NATIVE_SEARCH and gr.NATIVE_SHAPES and norm_plan.NATIVE_PLAN and builtin.NATIVE_NORMS):
        return "a C++ step of the rule is switched off"
    if "fusion" not in pass_names:
        return "no fusion pass"
    order = list(RULES)[:len(NORM_RULES)]
    if tuple(order) != NORM_RULES or not all(RULES[n].builtin and RULES[n].policy is None for n in order):
        return "the norm rules are not the built-in ones, first"
    rule = RULES["layer_norm"]
    level = ctx.option("graph_level", 2) if ctx is not None else 2
    if rule.build is not builtin._build_norm or int(2 if level is None else level) < rule.graph_level:
        return "the layer_norm rule does not run"
    return None


def request(ctx) -> bytes | None:
    """``NpuAmpGrFuseNorms``' request for this run, or None (a name it cannot take)."""
    from .. import unfuse
    from . import grad_region as gr
    from .core import _KEEP_OPS

    protected = ctx.protected if ctx is not None else frozenset()
    default = ctx.default_device_type() if ctx is not None else "CPU"
    try:
        return "\x03".join((
            "\x02".join(sorted(protected)),
            str(int(gr.MAX_NODES)),
            str(int(bool(gr.STOP_AT_DY))),
            default,
            "\x02".join(_kernels(tuple(sorted({default, "CPU", "GPU"})))),
            "\x02".join(sorted(_KEEP_OPS)),
            "\x02".join(unfuse.FUSED_OPS),
        )).encode("ascii")
    except UnicodeEncodeError:
        return None


@functools.lru_cache(maxsize=8)
def _kernels(dev_types) -> tuple:
    """"type\\x01op\\x01dtype" of every emitted op the fusion may emit on
    ``dev_types``: the kernel and OpDef checks ``core._kernel_problems`` makes
    of each emitted node, made once of a node like it."""
    from tensorflow.core.framework import node_def_pb2

    from .. import registry
    from ..opdef_check import node_problems
    from .core import _requirement_problem, _type_attrs

    out = []
    for dev in dev_types:
        for dt in sorted(registry.FLOAT_TYPES):
            for op in EMITTED_OPS:
                node = node_def_pb2.NodeDef(op=op, name="n")
                node.attr["T"].type = dt
                if op in ("LayerNorm", "RMSNorm"):
                    node.attr["epsilon"].f = 1e-5
                elif op == "AddN":
                    node.attr["N"].i = 2
                elif op == "Reshape":
                    node.attr["Tshape"].type = registry.types_pb2.DT_INT32
                if registry.op_def(op) is None:
                    continue
                if node_problems(node, None, dev) or _requirement_problem(op, _type_attrs(node), "", dev):
                    continue
                out.append(f"{dev}\x01{op}\x01{dt}")
    return tuple(out)


#: the ops a norm's inverse standard deviation is read from (builtin._norm_candidates)
_INV_STD_OPS = ("Rsqrt", "Sqrt")


def may_have_norms(graph_def) -> bool:
    """Whether a GraphDef has an op the rule's candidates start from (a
    GraphDef without one is not serialised for the C++ run)."""
    return any(n.op in _INV_STD_OPS for n in graph_def.node)


#: (the bytes last asked about and the answer: the grappler callback asks before the pipeline)
_CANDIDATES = [None, None]


def has_candidates(data: bytes) -> bool:
    """Whether the rule could find a candidate in the serialized graph
    ``data`` (an Rsqrt / Sqrt a Mul / RealDiv reads; C++, one read of the
    nodes' names, ops and inputs, no mirror built).  (Not ``bytes.find``
    first: Python's search for a short pattern reads a graph without it at
    ~2.5 instructions a byte, 20 M on Keras ResNet50's 4 MB, ten times the
    C++ read.)"""
    from . import grad_region as gr

    if _CANDIDATES[0] is data:
        return _CANDIDATES[1]
    lib = gr.native
    found = lib is not None and getattr(lib, "can_fuse_norms", False) and lib.norm_candidates(data) is True
    _CANDIDATES[0], _CANDIDATES[1] = data, found
    return found


def run(data: bytes, ctx, pass_names, mirror=None) -> Prefused | None:
    """The C++ run over ``data`` (a serialized GraphDef), or None: it cannot
    run here (:func:`refusal`), or fused nothing.  ``mirror``: None, or a
    callable giving a mirror loaded from ``data`` already (a handle this run
    then owns and frees) or None; asked only when the run goes ahead."""
    from . import grad_region as gr

    found = has_candidates(data)
    _CANDIDATES[0] = _CANDIDATES[1] = None  # (not kept past its run: the bytes may be large)
    if not found:  # (no mirror loaded for a graph without a candidate)
        return None
    why = refusal(ctx, pass_names)
    req = request(ctx) if why is None else None
    if req is None:
        return None
    lib = gr.native
    loaded = mirror() if mirror is not None else None
    walked = WalkedShapes(lib, loaded) if SHAPES_AFTER and getattr(lib, "can_shape", False) else None
    try:
        res = lib.fuse_norms(data, gr._op_sets(), req, walked.memo if walked is not None else None,  # noqa: SLF001
                             walked.h if walked is not None else loaded, loaded=bool(loaded))
    finally:
        if loaded and walked is None:  # (else the walks' object owns it)
            lib.free(loaded)
    if res is None:
        _left("the mirror refused the graph")
        return None
    rc, text, out, index = res
    sec = text.split("\x03", 4)
    if rc != 0 or len(sec) < 5:
        _left(sec[1] if len(sec) > 1 and sec[1] else "could not run")
        return None
    fused = int(sec[0] or 0)
    if sec[1]:
        _left(_why_key(sec[1]))
    if fused == 0:
        return None
    pre = Prefused(out, index, fused, sec[1], sec[2], sec[3], sec[4], walked)
    CHECKED[0] += 1
    CHECKED[1] += fused
    if gr.CHECK_NATIVE:
        compare(data, pre, ctx)
    return pre


def _why_key(why: str) -> str:
    """``why`` without the anchor's name (LEFT counts kinds of reasons)."""
    if why.startswith("at '"):
        end = why.find("': ")
        if end > 0:
            return why[end + 3:]
    return why


def _left(why: str):
    if len(LEFT) < 256:
        LEFT[why] = LEFT.get(why, 0) + 1


def record(ctx, pre: Prefused, stats: dict):
    """The fusion pass's share: ``pre``'s fusions reported as the rule's own
    (``core.apply_rule``'s entries and count)."""
    if pre is None or not pre.fused:
        return
    fused = stats.setdefault("fused", {})
    fused["layer_norm"] = fused.get("layer_norm", 0) + pre.fused
    if ctx is not None:
        for anchor, nodes, region in pre.entries:
            ctx.report.decide(anchor, fusion="layer_norm", fused_nodes=list(nodes))
            if region:
                ctx.report.decide(anchor, fused_gradient_nodes=list(region))


#: (issue 17) a run that reached its last anchor leaves the rule idle in the
#: fusion pass's first sweep (:func:`finished_rules`); False: the rule runs
#: again there, as in the reference, and finds nothing
IDLE_AFTER = True


def finished_rules(pre: Prefused | None) -> tuple:
    """The rules whose whole first run ``pre`` was (``("layer_norm",)`` when
    the run fused and did not end before its last anchor, else ``()``): the
    fusion pass starts them idle."""
    if not IDLE_AFTER or pre is None or not pre.fused or pre.why:
        return ()
    return ("layer_norm",)


def compare(data: bytes, pre: Prefused, ctx):
    """(CHECK_NATIVE) the Python rule's first run on the same graph
    (``core.apply_rule`` of ``layer_norm``, the C++ steps of its decisions
    off), up to the anchor the C++ run ended at: the same nodes, the same
    report entries.  Records and raises on a difference."""
    from tensorflow.core.framework import graph_pb2

    from ..graph import Graph
    from ..manager import PassContext
    from . import builtin, norm_plan
    from . import grad_region as gr
    from .core import RULES, ShapeOracle, Trail, apply_rule

    CHECKED[2] += 1
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(data)
    graph = Graph(gd)
    graph.source_bytes = data
    ref_ctx = PassContext(ctx.options if ctx is not None else None, ctx.fetches if ctx is not None else (),
                          ctx.preserve if ctx is not None else (), ctx.devices if ctx is not None else ())
    gr.mark_original_names(graph)
    stop = _stop_anchor(pre.why)
    saved = (norm_plan.NATIVE_PLAN, builtin.NATIVE_NORMS, gr.CHECK_NATIVE)
    norm_plan.NATIVE_PLAN = builtin.NATIVE_NORMS = gr.CHECK_NATIVE = False
    try:
        rule = RULES["layer_norm"]
        again = None
        if stop is None:
            apply_rule(graph, rule, ref_ctx, ShapeOracle(graph), {}, Trail())
            if not pre.why:  # (finished_rules: the rule run again finds nothing)
                before = repr(ref_ctx.report.decisions)
                stats = {}
                n = apply_rule(graph, rule, ref_ctx, ShapeOracle(graph), stats, Trail())
                again = (n, stats.get("skipped"), repr(ref_ctx.report.decisions) == before)
                CHECKED_IDLE[0] += 1
        else:
            _apply_until(graph, rule, ref_ctx, stop)
    finally:
        norm_plan.NATIVE_PLAN, builtin.NATIVE_NORMS, gr.CHECK_NATIVE = saved
    want = {n.name: n for n in graph.to_graph_def().node}
    got_gd = graph_pb2.GraphDef()
    got_gd.ParseFromString(pre.data)
    # (as Python writes a graph: colocation with a removed node dropped, Graph._drop_colocation)
    got = {n.name: n for n in Graph(got_gd).to_graph_def().node}
    problems = []
    if set(want) != set(got):
        problems.append(f"nodes only in C++: {sorted(set(got) - set(want))[:5]}, "
                        f"only in Python: {sorted(set(want) - set(got))[:5]}")
    else:
        diff = [n for n in want if want[n] != got[n]]
        if diff:
            problems.append(f"nodes differing: {diff[:5]} (C++ {got[diff[0]]!r}, Python {want[diff[0]]!r})")
    decided = {a: (d.get("fused_nodes"), d.get("fused_gradient_nodes"))
               for a, d in ref_ctx.report.decisions.items() if d.get("fusion") == "layer_norm"}
    mine = {a: (list(n), list(r) if r else None) for a, n, r in pre.entries}
    if decided != mine:
        problems.append(f"report entries differ: C++ {sorted(mine)[:3]}, Python {sorted(decided)[:3]}")
    if again is not None and again != (0, None, True):
        problems.append(f"the rule run again after its whole first run changed or reported something: "
                        f"{again[0]} fusions, skipped {again[1]}, report unchanged: {again[2]}")
    if problems:
        CHECKED[3].append(problems)
        raise AssertionError("the C++ layer-norm fusion before the parse differs from the Python rule's: "
                             + "; ".join(problems))


def _stop_anchor(why: str) -> str | None:
    if why.startswith("at '"):
        end = why.find("': ")
        if end > 0:
            return why[4:end]
    return None


def _apply_until(graph, rule, ctx, stop: str):
    """``core.apply_rule`` of ``rule`` over its matches before anchor ``stop``."""
    from ..pattern import find_matches, match_at
    from .core import ShapeOracle, _apply_one

    protected = ctx.protected
    shapes = ShapeOracle(graph)
    changed = False
    pos = dict(graph.topo_positions())  # (the order find_matches visits the anchors in)
    for m in find_matches(graph, rule.pattern, protected, escapes_ok=rule.escapes):
        if pos.get(m.anchor, -1) >= pos.get(stop, -1):
            return
        if changed:
            if m.anchor not in graph.nodes:
                continue
            m = match_at(graph, rule.pattern, m.anchor, protected, rule.escapes)
            if m is None:
                continue
        outcome = _apply_one(graph, rule, m, ctx, shapes)
        if outcome.fused:
            ctx.report.decide(m.anchor, fusion=rule.name, fused_nodes=list(m.matched))
            if outcome.region:
                ctx.report.decide(m.anchor, fused_gradient_nodes=list(outcome.region))
        changed = changed or outcome.fused
