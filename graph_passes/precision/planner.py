"""The precision planner: the one place that says what dtype an op will run
in, and why, for a given set of options.

Every pass that must anticipate the ``precision`` pass asks this module
instead of re-deriving the rules: ``unfuse`` (split a fused op only when its
matrix part would go low precision), ``fusion`` (check a kernel for the dtype
the fused op will be painted in), and the ``precision`` pass itself (mode,
low dtype, lists, name overrides).  The options are read by attribute from
``npu_amp_tf.options.Options`` (which names, types, defaults and validates
them); this module only turns them into decisions.

Preconditions: ``options`` is an ``Options``-like object or None (defaults).
Postconditions: :func:`plan_for` returns the same :class:`Plan` for one pass
context (cached on it); a plan never changes after it is built.

Mode -> dtype of a matrix (white-list) op, before kernels are checked:

=========================  =============================================
allow_mix_precision(_bf16) low (FP16 / BF16); black ops FP32 (with BF16,
                           lists.BF16_GRAY ops are gray instead, and
                           lists.BF16_GRAY_REDUCTIONS all together where
                           every one's BF16 kernel accumulates in FP32)
force_fp16                 low wherever a kernel exists
cube_fp16in_fp32out        low for white (cube) ops, others unchanged
allow_fp32_to_fp16         FP32 wherever an FP32 kernel exists (low only
                           for ops without one): matrix ops stay FP32
force_fp32                 FP32
must_keep_origin_dtype     unchanged
=========================  =============================================

``keep_dtype_nodes`` / the ``_keep_dtype`` attr keep a node's dtype in every
mode; ``low_precision_nodes`` force low precision where a kernel exists.
"""
from __future__ import annotations

from .. import registry
from ..errors import OptionError
from . import lists as _lists

MODES = ("allow_mix_precision", "allow_mix_precision_bf16", "force_fp16",
         "must_keep_origin_dtype", "allow_fp32_to_fp16", "force_fp32", "cube_fp16in_fp32out")
_ALIASES = {"allow_mix_precision_fp16": "allow_mix_precision", "fp16": "force_fp16",
            "origin": "must_keep_origin_dtype", "mixed_float16": "allow_mix_precision",
            "mixed_bfloat16": "allow_mix_precision_bf16"}
MODE_ERROR_KEY = "precision_mode"
#: modes in which a white-list (matrix) op with an FP32 kernel goes low precision
LOWERING_MODES = frozenset({"allow_mix_precision", "allow_mix_precision_bf16", "force_fp16",
                            "cube_fp16in_fp32out"})
KEEP_DTYPE_ATTR = "_keep_dtype"


def canonical_mode(options) -> tuple[str, int]:
    """(canonical precision mode, low DataType) from an options object."""
    mode = getattr(options, "precision", None) if options is not None else None
    if mode is None and options is not None:
        mode = getattr(options, "precision_mode_v2", None) or getattr(options, "precision_mode", None)
    mode = mode or "allow_mix_precision"
    mode = _ALIASES.get(mode, mode)
    if mode not in MODES:
        raise OptionError(
            f"{MODE_ERROR_KEY}={mode!r} is not valid; accepted: "
            + ", ".join(repr(m) for m in MODES + tuple(_ALIASES)))
    low = getattr(options, "low_dtype", None) if options is not None else None
    if low is None:
        low = "bfloat16" if mode == "allow_mix_precision_bf16" else "float16"
    low_dt = {"float16": registry.DT_HALF, "bfloat16": registry.DT_BFLOAT16}.get(low)
    if low_dt is None:
        raise OptionError(f"low_dtype={low!r} is not valid; accepted: 'float16', 'bfloat16'")
    return mode, low_dt


def _name_match(name, patterns):
    for k in patterns:
        if name == k or (k.endswith("/") and name.startswith(k)):
            return True
    return False


def _truthy_attr(node, key):
    attrs = node.attr
    if key not in attrs:  # (the usual case; cheaper than .get, which wraps the value)
        return False
    a = attrs[key]
    kind = a.WhichOneof("value")
    return bool(getattr(a, kind)) if kind in ("b", "i", "s", "f") else kind is not None


class Plan:
    """The precision rules resolved for one set of options."""

    def __init__(self, options):
        self.options = options
        self.mode, self.low = canonical_mode(options)
        self.low_name = registry.dtype_name(self.low)
        self.lists = _lists.lists_for(options)
        if self.low == registry.DT_BFLOAT16:
            black, gray = self.lists["black"], self.lists["gray"]
            relaxed = dict(_lists.BF16_GRAY)
            if all(registry.bf16_accumulates_in_fp32(op) for op in _lists.BF16_GRAY_REDUCTIONS):
                relaxed.update(_lists.BF16_GRAY_REDUCTIONS)
            for op, why in relaxed.items():
                if op in black and not black[op].startswith("user:"):
                    del black[op]
                    gray[op] = f"BF16: {why}"
        self.op_list = {}
        for lname in _lists.LIST_NAMES:
            for op, why in self.lists[lname].items():
                self.op_list[op] = (lname, why)
        get = (lambda k, d=None: getattr(options, k, d)) if options is not None else (lambda k, d=None: d)
        self.unknown_policy = get("unknown_op_policy", "black") or "black"
        self.keep_names = tuple(get("keep_dtype_nodes", ()) or ())
        self.low_names = tuple(get("low_precision_nodes", ()) or ())

    # ----------------------------------------------------------- queries
    @property
    def lowers_matrix_ops(self) -> bool:
        """Whether white-list (matrix) ops that have an FP32 kernel go low."""
        return self.mode in LOWERING_MODES

    def list_of(self, op_type):
        """(list name, reason) of an op type from the resolved lists, or None."""
        return self.op_list.get(op_type)

    def is_keep(self, node) -> bool:
        if _truthy_attr(node, KEEP_DTYPE_ATTR):
            return True
        return bool(self.keep_names) and _name_match(node.name, self.keep_names)

    @property
    def names_matter(self) -> bool:
        """Whether :meth:`matrix_dtype` can answer two nodes of one op type
        and dtype differently by their names (``keep_dtype_nodes``,
        ``low_precision_nodes``); else its answer is one per (op type, dtype)."""
        return bool(self.keep_names or self.low_names)

    def is_keep_name(self, name) -> bool:
        return _name_match(name, self.keep_names)

    def is_forced_low(self, name) -> bool:
        return bool(self.low_names) and _name_match(name, self.low_names)

    def matrix_dtype(self, op_type: str, node_name: str, dtype: int, node=None) -> tuple[int, str]:
        """(dtype, why) a white-list-like matrix op of ``op_type`` (currently
        ``dtype``) will run in after the precision pass, kernels aside (the
        caller checks the kernel for the dtype returned).  Used by passes that
        run before the precision pass."""
        if dtype != registry.DT_FLOAT:
            return dtype, "not FP32: the precision pass leaves its dtype"
        if (node is not None and self.is_keep(node)) or self.is_keep_name(node_name):
            return dtype, "keep_dtype: never converted"
        if self.mode in ("must_keep_origin_dtype", "force_fp32"):
            return dtype, f"precision_mode={self.mode}: stays FP32"
        if self.mode == "allow_fp32_to_fp16":
            return dtype, "allow_fp32_to_fp16: an FP32 kernel exists, stays FP32"
        if self.is_forced_low(node_name):
            return self.low, "low_precision_nodes"
        entry = self.list_of(op_type)
        lst = entry[0] if entry else None
        if self.mode == "force_fp16":
            return self.low, "force_fp16"
        if lst == "black":
            return dtype, "black list"
        if self.mode == "cube_fp16in_fp32out" and lst != "white":
            return dtype, "cube_fp16in_fp32out: not a cube op"
        if lst == "white" or entry is None:
            # (an op that is in no list but emitted in place of a white op
            # is painted like the op it replaces)
            return self.low, f"{self.mode}: white list"
        return dtype, f"{lst} list: follows its producers"


def plan_for(ctx) -> Plan:
    """The :class:`Plan` of a pass context (built once per pipeline run)."""
    plan = getattr(ctx, "_precision_plan", None)
    if plan is None:
        plan = Plan(ctx.options)
        try:
            ctx._precision_plan = plan
        except AttributeError:  # a context that takes no attributes: no cache
            pass
    return plan


__all__ = ["Plan", "plan_for", "canonical_mode", "MODES", "LOWERING_MODES"]
