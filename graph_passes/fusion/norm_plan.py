"""The layer-norm rule's decisions at one anchor, as data, and their C++ form.

``builtin._build_norm`` splits in two: the decisions (``_norm_facts``, with
``_grad_facts`` for the backward region: every check, the region search, the
roles of the tensors leaving it) and the emission (``_emit_norm``).  The
decisions are a :class:`NormFacts`; this module also asks the C++ planner
(``NpuAmpGrNormPlan`` in custom_ops/grad_region.cc, issue 17) for them over
the gradient-region search's mirror of the graph.  The C++ planner answers
only where each question has the answer Python would give (see its comment);
every refusal and every doubt is left to Python, which words the reason.
The emission, the framework's checks (``core._plan_one``) and the commit stay
in Python, so a C++ plan and a Python one emit the same nodes.

    facts = native_facts(m, b)      # (NormFacts,), or None: Python decides
    facts = builtin._norm_facts(m, b)   # the reference (Skip with the reason)

The rules that match a norm by a pattern (``layer_norm_moments``, the Keras
forms) decide only its backward half (``builtin._norm_backward``): that half
too comes from the planner where it answers (``NpuAmpGrNormGradPlan``,
:func:`grad_facts`), else from ``builtin._grad_facts``.  The planner never
answers once the graph's shape table has been inferred (the oracle then asks
the table, which C++ does not hold): on a Keras 2 graph a rule before it
usually has.

:data:`NATIVE_PLAN` False: Python decides every anchor (the reference).
With ``grad_region.CHECK_NATIVE`` (the test suite) both decide and any
difference fails the run (:data:`CHECKED_PLANS`).
"""
from __future__ import annotations

import dataclasses

#: (issue 17) the layer-norm rule decides in C++ where it can; False: the reference
NATIVE_PLAN = True
#: [anchors planned in C++, anchors compared with the reference (CHECK_NATIVE), differences]
CHECKED_PLANS = [0, 0, []]
#: why the planner left anchors to Python: {why: count} (for debugging and tests)
LEFT = {}


@dataclasses.dataclass
class GradFacts:
    """The backward region a fused norm replaces (``builtin._grad_facts``)."""
    #: the region's nodes, in its topological order
    nodes: list
    #: the incoming gradient
    dy: str
    #: role ("dx", "dgamma", "dbeta") -> grad_region.Term, in the order the roles were met
    terms: dict
    #: the shape of each tensor of a term without an aggregator
    shapes: dict
    #: x's static shape, and the normalised dims
    xs: list
    gs: list

    def key(self):
        return (self.nodes, self.dy, [(r, t.refs, t.aggregator) for r, t in self.terms.items()],
                sorted(self.shapes.items()), self.xs, self.gs)


@dataclasses.dataclass
class NormFacts:
    """What the layer-norm rule decided at an anchor (``builtin._norm_facts``)."""
    kind: str  # "layer_norm" / "rms_norm"
    x: str
    #: gamma / beta as the graph has them, None when absent (the build emits ones / zeros)
    gamma: str | None
    beta: str | None
    dt: int
    eps: float
    #: the normalised (trailing) dims of x
    norm: list
    #: the forward nodes the fused op replaces (the anchor first), without repeats
    inner: list
    #: None: nothing outside the forward region reads its inner tensors
    grad: GradFacts | None = None

    def key(self):
        return (self.kind, self.x, self.gamma, self.beta, self.dt, self.eps, self.norm, self.inner,
                _key(self.grad))


def _key(facts):
    return None if facts is None else facts.key()


def decided(anchor, native, reference):
    """The facts to emit: ``native`` (the C++ planner's, as a 1-tuple: its
    facts may be None; or None: it did not answer), else ``reference()``
    (Python's, Skip with the reason when it refuses).  Under CHECK_NATIVE
    both, compared (:func:`differ` on any difference), and the reference's."""
    from . import grad_region as gr
    from .core import Skip

    if native is not None and not gr.CHECK_NATIVE:
        return native[0]
    try:
        ref = reference()
    except Skip as exc:
        if native is not None:
            differ(anchor, native[0], f"Skip({exc})")
        raise
    if native is not None:
        CHECKED_PLANS[1] += 1
        if _key(native[0]) != _key(ref):
            differ(anchor, native[0], ref)
    return ref


def _prepared(b):
    """(the library, the synced mirror, the oracle's C++ walk) for a plan
    over ``b.graph``, or None (Python decides)."""
    from .. import shapes as _shapes
    from . import grad_region as gr

    lib = gr.native
    g = b.graph
    if (not NATIVE_PLAN or lib is None or not gr.NATIVE_SEARCH or not getattr(lib, "can_norm_plan", False)
            or not hasattr(g, "edits_since") or g.nodes_of_type(("NextIteration", "RefNextIteration"))):
        return None
    oracle = b.shapes
    if _shapes.table(g).inferred:
        return None  # (the oracle asks the shape table before any walk)
    ask = oracle._ask  # noqa: SLF001 - the oracle's C++ walk: its memo is the plan's
    if ask is False:
        ask = oracle._ask = gr.shape_asker(g)  # noqa: SLF001
    if ask is None or not ask.memo:
        return None
    pos = gr._positions(g)  # noqa: SLF001 - the search's order, as find_grad_region takes it
    mirror = gr._mirror(g, pos)  # noqa: SLF001
    if mirror is None or not mirror.attrs:
        return None
    return lib, mirror, ask


def _ask(b, fields, grad_only=False):
    """The planner's answer text for the request ``fields`` (the protected
    names, the search's bound and flag appended), or None (Python decides)."""
    from . import grad_region as gr

    ready = _prepared(b)
    if ready is None:
        return None
    lib, mirror, ask = ready
    protected = b.ctx.protected if b.ctx is not None else ()
    try:
        request = "\x03".join((*fields, "\x02".join(protected), str(int(gr.MAX_NODES)),
                               str(int(bool(gr.STOP_AT_DY))))).encode("ascii")
    except UnicodeEncodeError:
        return None
    answer = lib.norm_plan(mirror.h, ask.memo, request, grad_only)
    if answer is None:
        return None
    planned, text = answer
    if not planned:
        if len(LEFT) < 256:
            LEFT[text] = LEFT.get(text, 0) + 1
        return None
    CHECKED_PLANS[0] += 1
    return text


def native_facts(m, b):
    """The C++ planner's :class:`NormFacts` at ``m.anchor`` (the layer-norm
    rule) as a 1-tuple, or None (Python decides: the planner is off or
    cannot run here, or it left the anchor)."""
    text = _ask(b, (m.anchor,))
    return None if text is None else (_parse(text),)


def grad_facts(m, b, kind, x, params, gshape, inner, has_gamma, has_beta):
    """``builtin._grad_facts`` (a norm any rule matched: its backward half),
    from the C++ planner where it answers (``NpuAmpGrNormGradPlan``), else
    from Python; under CHECK_NATIVE from both, compared."""
    from .builtin import _grad_facts

    native = None
    if gshape is not None and len(params) == int(has_gamma) + int(has_beta):
        text = _ask(b, (m.anchor, "\x02".join(sorted(inner)), x, "\x02".join(params), str(int(has_gamma)),
                        str(int(has_beta)), ",".join(str(int(d)) for d in gshape)), grad_only=True)
        if text is not None:
            sec = text.split("\x03")
            native = (None if sec[0] == "0" else _parse_grad(sec[1:], gshape),)
    return decided(m.anchor, native,
                   lambda: _grad_facts(m, b, kind, x, params, gshape, inner, has_gamma, has_beta))


def _parse(text: str) -> NormFacts:
    sec = text.split("\x03")
    kind, x, gamma, beta, dt, eps, norm, inner, has_grad = sec[:9]
    facts = NormFacts("layer_norm" if kind == "l" else "rms_norm", x, None if gamma == "\x04" else gamma,
                      None if beta == "\x04" else beta, int(dt), float(eps), _ints(norm), inner.split("\x02"))
    if has_grad == "1":
        facts.grad = _parse_grad(sec[9:14], facts.norm)
    return facts


def _parse_grad(sec, gs) -> GradFacts:
    """The planner's region text: nodes, dy, x's shape, the terms, the shapes."""
    from .grad_region import Term

    nodes, dy, xs, terms_s, shapes_s = sec[:5]
    terms = {}
    for item in terms_s.split("\x02"):
        role, agg, *refs = item.split("\x01")
        terms[role] = Term(role, refs, None if agg == "\x04" else agg)
    shapes = {}
    for item in shapes_s.split("\x02") if shapes_s else ():
        ref, dims = item.split("\x01")
        shapes[ref] = _ints(dims)
    return GradFacts(nodes.split("\x02"), dy, terms, shapes, _ints(xs), list(gs))


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",")] if text else []


def differ(anchor, native, reference):
    """(CHECK_NATIVE) the C++ plan differs from the reference: recorded, and raised."""
    CHECKED_PLANS[2].append((anchor, native, reference))
    raise AssertionError(f"the C++ layer-norm plan at '{anchor}' differs from the Python one:\n"
                         f"  C++:    {native!r}\n  Python: {reference!r}")
