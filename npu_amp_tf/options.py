"""The one place where every npu-amp-tf parameter is named, typed, defaulted
and validated.

Every entry point reads its parameters through this module:

* ``ConfigProto`` ``custom_optimizers`` ``parameter_map`` (:meth:`Options.from_parameter_map`),
* ``npu_amp_tf.rewrite_graph(**kw)``, ``session_config(**kw)``, ``enable(**kw)``,
  ``estimator.RunConfig(**kw)`` (:meth:`Options.from_kwargs`),
* ``AMP_Optimizer(**options)`` (the ``loss_scale`` group),
* the ``npu-amp`` CLI flags (:func:`add_cli_arguments` / :meth:`Options.from_cli`).

The README's parameter table is generated from :data:`OPTIONS`
(:func:`markdown_table`) and a test checks that it is current.

Environment override: for jobs whose scripts you cannot edit, any option can
be forced with ``NPU_AMP_<KEY IN UPPER CASE>`` (for example
``NPU_AMP_PRECISION_MODE=must_keep_origin_dtype`` or
``NPU_AMP_MODIFY_MIXLIST=/path/fix.json``).  The environment wins over the
script, and the report records every override.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, Iterable, Mapping

from .errors import MixlistError, OptionError

ENV_PREFIX = "NPU_AMP_"

# --------------------------------------------------------------------------
# precision modes
# --------------------------------------------------------------------------
PRECISION_MODES = (
    "allow_mix_precision",
    "allow_mix_precision_fp16",
    "allow_mix_precision_bf16",
    "force_fp16",
    "must_keep_origin_dtype",
    "allow_fp32_to_fp16",
    "force_fp32",
    "cube_fp16in_fp32out",
)
#: precision_mode_v2 name -> canonical precision_mode
PRECISION_MODES_V2 = {
    "fp16": "force_fp16",
    "origin": "must_keep_origin_dtype",
    "cube_fp16in_fp32out": "cube_fp16in_fp32out",
    "mixed_float16": "allow_mix_precision",
    "mixed_bfloat16": "allow_mix_precision_bf16",
}
#: aliases folded into a canonical precision_mode
PRECISION_ALIASES = {"allow_mix_precision_fp16": "allow_mix_precision"}

FORMAT_MODES = ("origin", "NC1HWC0")
MIXLIST_KEYS = ("black-list", "white-list", "gray-list")
MIXLIST_ACTIONS = ("to-add", "to-remove")


# --------------------------------------------------------------------------
# value converters (each accepts python values and strings from env / CLI /
# ConfigProto and returns the normalised value or raises ValueError)
# --------------------------------------------------------------------------
def _to_bool(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int,)) and v in (0, 1):
        return bool(v)
    if isinstance(v, (str, bytes)):
        s = v.decode() if isinstance(v, bytes) else v
        s = s.strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
    raise ValueError("expected a boolean (true/false/1/0)")


def _to_int(v):
    if isinstance(v, bool):
        raise ValueError("expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, (str, bytes)):
        s = v.decode() if isinstance(v, bytes) else v
        try:
            return int(s.strip())
        except ValueError:
            pass
    raise ValueError("expected an integer")


def _to_float(v):
    if isinstance(v, bool):
        raise ValueError("expected a number")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (str, bytes)):
        s = v.decode() if isinstance(v, bytes) else v
        try:
            return float(s.strip())
        except ValueError:
            pass
    raise ValueError("expected a number")


def _to_str(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, str):
        return v
    raise ValueError("expected a string")


def _to_str_list(v):
    """A list of names: a python list/tuple, or a comma/space separated string."""
    if v is None:
        return ()
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, str):
        items = [s for s in v.replace(";", ",").replace(" ", ",").split(",")]
    elif isinstance(v, (list, tuple, set, frozenset)):
        items = [x.decode() if isinstance(x, bytes) else x for x in v]
        if not all(isinstance(x, str) for x in items):
            raise ValueError("expected a list of strings")
    else:
        raise ValueError("expected a list of strings or a comma-separated string")
    return tuple(s.strip() for s in items if s and s.strip())


def _to_dtype_name(v):
    """A float dtype given as string or tf.DType; returns 'float32' / 'float16' / 'bfloat16'."""
    name = getattr(v, "name", v)
    name = _to_str(name).strip().lower()
    name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "float": "float32"}.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError("expected one of float32, float16, bfloat16")
    return name


def _to_loss_scale(v):
    """'dynamic' or a finite number >= 1 (returned as float)."""
    if isinstance(v, (str, bytes)):
        t = (v.decode() if isinstance(v, bytes) else v).strip().lower()
        if t == "dynamic":
            return "dynamic"
    f = _to_float(v)
    if not math.isfinite(f) or f < 1.0:
        raise ValueError("expected 'dynamic' or a number >= 1")
    return f


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "bool": _to_bool,
    "int": _to_int,
    "float": _to_float,
    "str": _to_str,
    "path": _to_str,
    "list[str]": _to_str_list,
    "dtype": _to_dtype_name,
    "loss_scale": _to_loss_scale,
    "any": lambda v: v.decode() if isinstance(v, bytes) else v,
}


@dataclasses.dataclass(frozen=True)
class Option:
    """One parameter: its name, type, default, accepted values and meaning."""

    name: str
    type: str
    default: Any
    doc: str
    group: str = "rewrite"
    choices: tuple | None = None
    #: extra check on the converted value; returns a message when invalid
    check: Callable[[Any], str | None] | None = None
    #: human description of the accepted range (used in errors and docs)
    accepts: str | None = None

    def describe_accepted(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(repr(c) for c in self.choices)
        if self.accepts:
            return self.accepts
        return {"bool": "true or false", "int": "an integer", "float": "a number",
                "str": "a string", "path": "a file path",
                "list[str]": "a list of names (or a comma-separated string)",
                "dtype": "one of float32, float16, bfloat16"}[self.type]

    def convert(self, value, source="argument"):
        if value is None and self.default is None:
            return None
        try:
            out = _CONVERTERS[self.type](value)
        except (ValueError, TypeError) as exc:
            raise OptionError(
                f"{self.name}={value!r} ({source}) is not valid: {exc}; "
                f"accepted: {self.describe_accepted()}") from None
        if self.choices is not None and out not in self.choices:
            raise OptionError(
                f"{self.name}={value!r} ({source}) is not valid; "
                f"accepted: {self.describe_accepted()}")
        if self.check is not None:
            msg = self.check(out)
            if msg:
                raise OptionError(
                    f"{self.name}={value!r} ({source}) is not valid: {msg}; "
                    f"accepted: {self.describe_accepted()}")
        return out


def _range(lo=None, hi=None, lo_open=False, hi_open=False):
    def check(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "must be finite"
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None
    return check


def _rng_text(lo, hi, lo_open=False, hi_open=False):
    a = f"{'(' if lo_open else '['}{lo}" if lo is not None else "(-inf"
    b = f"{hi}{')' if hi_open else ']'}" if hi is not None else "inf)"
    return f"a number in {a}, {b}"


def _opt(name, type_, default, doc, **kw):
    return Option(name=name, type=type_, default=default, doc=doc, **kw)


_OPTION_LIST = [
    # ---------------------------------------------------------------- rewrite
    _opt("precision_mode", "str", "allow_mix_precision",
         "How float ops are lowered (CANN names). See 'Precision modes'.",
         choices=PRECISION_MODES),
    _opt("precision_mode_v2", "str", None,
         "CANN precision_mode_v2 name; mutually exclusive with precision_mode.",
         choices=tuple(PRECISION_MODES_V2)),
    _opt("custom_white_list", "list[str]", (),
         "Op types added to the white list (always low precision)."),
    _opt("custom_black_list", "list[str]", (),
         "Op types added to the black list (always FP32)."),
    _opt("custom_gray_list", "list[str]", (),
         "Op types added to the gray list (follow their producers)."),
    _opt("modify_mixlist", "path", None,
         "CANN modify_mixlist JSON file: {black,white,gray}-list -> {to-add,to-remove}."),
    _opt("keep_dtype_nodes", "list[str]", (),
         "Node names (or name prefixes ending in '/') never converted, like CANN's _keep_dtype."),
    _opt("low_precision_nodes", "list[str]", (),
         "Node names forced to low precision where a kernel exists."),
    _opt("delay_fp32_copies", "bool", True,
         "An FP32 copy of a low-precision tensor whose readers also wait for a later producer (in "
         "practice: a forward activation read by the backward pass) is made when those inputs are ready "
         "(control edges), not held from the forward pass on; the smallest such copies, together <= 1% "
         "of their bytes (unknown size counts as large), are not delayed. Measured (TF 2.15.1, BF16): "
         "BERT-like b32 peak 0.77x -> 0.71x of FP32; ResNet-50 (Keras, TF-Slim): no copy qualifies, the "
         "graph is the same either way. Off: casts run as soon as their input is ready."),
    _opt("unknown_op_policy", "str", "black",
         "Ops in no list: 'black' keeps them FP32, 'gray' lets them follow their producers.",
         choices=("black", "gray")),
    _opt("graph_level", "int", 2,
         "Fusion depth: 0 none, 1 cleanups, 2 standard fusions, 3 aggressive (may change rounding).",
         check=_range(0, 3), accepts="an integer 0..3"),
    _opt("format_mode", "str", "origin",
         "'NC1HWC0' rewrites 4-D conv graphs into GE's 5HD layout with TransData; 'origin' keeps layouts.",
         choices=FORMAT_MODES),
    _opt("variable_format_optimize", "bool", False,
         "With format_mode=NC1HWC0, keep conv filters as FRACTAL_Z variables (CANN's variable format optimisation)."),
    _opt("device_type", "str", "auto",
         "Device type whose kernel registry decides what may run in low precision; 'auto' reads node devices (default CPU).",
         choices=("auto", "CPU", "GPU")),
    _opt("fail_on_error", "bool", False,
         "Raise when a pass fails instead of keeping the graph unchanged with a warning."),
    _opt("validate_graph", "bool", False,
         "Validate the graph after every pass (slower; on in tests)."),
    _opt("report_path", "path", None,
         "Write the JSON report of every optimized graph here (a directory; one file per graph)."),
    # ------------------------------------------------------------- loss scale
    _opt("loss_scale", "loss_scale", "dynamic",
         "CANN AMP guide key: 'dynamic' (ExponentialUpdateLossScaleManager from the keys below) or a "
         "number >= 1 (FixedLossScaleManager); accepted by AMP_Optimizer, session_config and enable "
         "(there it sets the default of later AMP_Optimizer calls).", group="loss_scale",
         accepts="'dynamic' or a number >= 1"),
    _opt("init_loss_scale", "float", 128.0,
         "Initial dynamic loss scale (tf_adapter accepts any value >= 1, e.g. 2**32).",
         group="loss_scale", check=_range(1.0, 2.0 ** 64), accepts=_rng_text(1, 2 ** 64)),
    _opt("incr_every_n_steps", "int", 1000,
         "Multiply the scale by incr_ratio after this many consecutive finite steps.",
         group="loss_scale", check=_range(1), accepts="an integer >= 1"),
    _opt("decr_every_n_nan_or_inf", "int", 2,
         "Multiply the scale by decr_ratio after this many overflowing steps (hysteresis).",
         group="loss_scale", check=_range(1), accepts="an integer >= 1"),
    _opt("incr_ratio", "float", 2.0, "Growth factor of the scale (> 1).", group="loss_scale",
         check=_range(1.0, lo_open=True), accepts=_rng_text(1, None, lo_open=True)),
    _opt("decr_ratio", "float", 0.5,
         "Shrink factor of the scale (0 < r < 1) of AMP_Optimizer's dynamic manager; the "
         "ExponentialUpdateLossScaleManager class defaults to tf_adapter's 0.8.",
         group="loss_scale",
         check=_range(0.0, 1.0, lo_open=True, hi_open=True),
         accepts=_rng_text(0, 1, True, True)),
    _opt("min_loss_scale", "float", 1.0, "Lower bound of the dynamic scale.", group="loss_scale",
         check=_range(1.0, 2.0 ** 64), accepts=_rng_text(1, 2 ** 64)),
    _opt("max_loss_scale", "float", 2.0 ** 24,
         "Upper bound of the dynamic scale (raised to init_loss_scale when that is larger and "
         "max_loss_scale is not set).", group="loss_scale",
         check=_range(1.0, 2.0 ** 128), accepts=_rng_text(1, 2 ** 128)),
    _opt("enable_overflow_check", "bool", True,
         "Check gradients for inf/NaN and skip the step on overflow.", group="loss_scale"),
    _opt("keep_fp16_copies", "bool", False,
         "Keep low-precision working copies of the FP32 master weights, refreshed after each applied update.",
         group="loss_scale"),
    _opt("gradient_accumulation_steps", "int", 1,
         "Accumulate unscaled FP32 gradients over N micro-steps before applying.",
         group="loss_scale", check=_range(1), accepts="an integer >= 1"),
    _opt("allreduce_dtype", "dtype", "float32",
         "dtype of the cross-replica gradient all-reduce (float16 is the HCCL_FP16_ENABLE analogue).",
         group="loss_scale", choices=("float32", "float16", "bfloat16")),
    _opt("bucket_size_mb", "float", 0.0,
         "All-reduce packing size in MB (tf.distribute bytes_per_pack); 0 lets TF decide.",
         group="loss_scale", check=_range(0.0), accepts="a number >= 0"),
]

#: name -> Option, in documentation order
OPTIONS: dict[str, Option] = {o.name: o for o in _OPTION_LIST}
REWRITE_KEYS = tuple(k for k, o in OPTIONS.items() if o.group == "rewrite")
LOSS_SCALE_KEYS = tuple(k for k, o in OPTIONS.items() if o.group == "loss_scale")


# --------------------------------------------------------------------------
# GE / tf_adapter keys (an "NpuOptimizer" entry, NPURunConfig, npu_device
# global_options, CANN's AMP guide).  Accepted wherever rewrite options are.
# --------------------------------------------------------------------------
#: keys that act through a tool here: key -> (kind, value type, what it does)
GE_ACTING_KEYS: dict[str, tuple[str, str, str]] = {
    "enable_dump": ("dump", "bool", "write the graph before/after the rewrite and the report to dump_path"),
    "enable_dump_debug": ("dump", "bool", "as enable_dump (GE's overflow dump: compare them with `npu-amp dump/compare`)"),
    "dump_path": ("dump", "path", "directory of the graph dump (one sub-directory per graph)"),
    "dump_step": ("dump", "str", "recorded in the dump's meta.json (graphs are dumped once per rewrite)"),
    "dump_mode": ("dump", "str", "recorded in the dump's meta.json"),
    "dump_debug_mode": ("dump", "str", "recorded in the dump's meta.json"),
    "dump_data": ("dump", "str", "recorded in the dump's meta.json"),
    "dump_layer": ("dump", "str", "recorded in the dump's meta.json"),
    "profiling_mode": ("profiling", "bool", "trace the session's steps (npu-amp run / npu_amp_tf.compat sessions) "
                                             "into profiling_options.output"),
    "profiling_options": ("profiling", "str", "JSON; 'output' is the trace directory (default ./profiling)"),
    "memory_optimize": ("memory", "str", "TF memory optimizer: on/true/MemoryPriority -> RECOMPUTATION_HEURISTICS, BalanceMode -> DEFAULT, off/false -> NO_MEM_OPT"),
    "buffer_optim": ("memory", "str", "TF memory optimizer: l2_optimize -> DEFAULT_MEM_OPT, off_optimize -> NO_MEM_OPT"),
    "buffer_optimize": ("memory", "str", "NPURunConfig spelling of buffer_optim"),
}

#: keys that only steer the NPU runtime/compiler: accepted, listed in the
#: report and logged once as "no effect off the NPU"
GE_DEVICE_ONLY_KEYS: tuple[str, ...] = (
    "use_off_line", "enable_data_pre_proc", "mix_compile_mode", "iterations_per_loop",
    "graph_run_mode", "dynamic_input", "dynamic_graph_execute_mode", "dynamic_inputs_shape_range",
    "hcom_parallel", "hcom_multi_mode", "enable_reduce_precision", "graph_memory_max_size",
    "variable_memory_max_size", "stream_max_parallel_num", "is_tailing_optimization", "horovod_mode",
    "op_debug_level", "enable_scope_fusion_passes", "enable_exception_dump", "op_select_implmode",
    "optypelist_for_implmode", "aoe_mode", "work_path", "enable_small_channel", "fusion_switch_file",
    "enable_compress_weight", "compress_weight_conf", "op_compiler_cache_mode", "op_compiler_cache_dir",
    "debug_dir", "local_rank_id", "local_device_list", "session_device_id", "distribute_config",
    "op_precision_mode", "soc_config", "hccl_timeout", "op_wait_timeout", "op_execute_timeout",
    "HCCL_algorithm", "customize_dtypes", "op_debug_config", "topo_sorting_mode", "aoe_config_file",
    "insert_op_file", "stream_sync_timeout", "event_sync_timeout", "external_weight",
    "es_cluster_config", "deterministic", "frozen_variable", "variable_placement", "jit_compile",
    "ac_parallel_enable", "graph_exec_timeout", "input_shape", "dynamic_dims", "dynamic_node_type",
    "atomic_clean_policy", "static_memory_policy", "memory_optimization_policy", "graph_slice",
    "graph_parallel_option_path", "enable_graph_parallel", "execute_times", "job", "task_index",
    "local_device_id", "enable_hccl_trace", "export_compile_stat", "oo_constant_folding",
    "oo_level", "resource_config_path", "precision_mode_for_compile", "graph_compiler_cache_dir",
    "enable_data_pre_proc_cache", "experimental_accelerate_train_mode", "hccl_timeout",
)

GE_KEYS = tuple(GE_ACTING_KEYS) + tuple(k for k in GE_DEVICE_ONLY_KEYS if k not in GE_ACTING_KEYS)

_DEVICE_ONLY_LOGGED: set = set()


def _log_device_only(keys):
    """Log each device-only key once per process."""
    import logging

    new = [k for k in keys if k not in _DEVICE_ONLY_LOGGED]
    if new:
        _DEVICE_ONLY_LOGGED.update(new)
        logging.getLogger("npu_amp_tf").warning(
            "GE option(s) %s: no effect off the NPU (accepted for Ascend scripts; listed in the report)",
            ", ".join(sorted(new)))


def memory_optimization_of(ge: Mapping) -> str | None:
    """The ``RewriterConfig.memory_optimization`` value name the GE memory keys
    map to (None when none is set).  ``memory_optimize`` wins over ``buffer_optim``."""
    mo = ge.get("memory_optimize")
    if mo is not None:
        t = str(mo).strip().lower()
        if t in ("1", "true", "on", "memorypriority", "heavy"):
            return "RECOMPUTATION_HEURISTICS"
        if t in ("0", "false", "off", "no_mem_opt"):
            return "NO_MEM_OPT"
        if t in ("balancemode", "default"):
            return "DEFAULT_MEM_OPT"
    bo = ge.get("buffer_optim", ge.get("buffer_optimize"))
    if bo is not None:
        return "NO_MEM_OPT" if str(bo).strip().lower() == "off_optimize" else "DEFAULT_MEM_OPT"
    return None


def _convert_ge(key, raw, source):
    if key in GE_ACTING_KEYS:
        _, type_, _ = GE_ACTING_KEYS[key]
        val = Option(name=key, type=type_, default=None, doc="").convert(raw, source)
        if key == "memory_optimize" or key in ("buffer_optim", "buffer_optimize"):
            val = str(val)
            ok = memory_optimization_of({key: val}) is not None and (
                key != "memory_optimize" or val.strip().lower() in (
                    "1", "true", "on", "memorypriority", "heavy", "0", "false", "off", "no_mem_opt",
                    "balancemode", "default"))
            if key != "memory_optimize" and val.strip().lower() not in ("l2_optimize", "off_optimize"):
                ok = False
            if not ok:
                accepted = ("l2_optimize, off_optimize" if key != "memory_optimize"
                            else "on/true/MemoryPriority, BalanceMode, off/false")
                raise OptionError(f"{key}={raw!r} ({source}) is not valid; accepted: {accepted}")
        if key == "profiling_options" and val:
            try:
                json.loads(val)
            except json.JSONDecodeError as exc:
                raise OptionError(f"profiling_options={raw!r} ({source}) is not valid JSON: {exc}; "
                                  "accepted: a JSON object such as '{\"output\": \"/tmp/prof\"}'") from None
        return val
    return _CONVERTERS["any"](raw)


def _unknown_key_error(key, source, allowed: Iterable[str]):
    import difflib

    close = difflib.get_close_matches(key, list(allowed) + list(GE_KEYS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return OptionError(
        f"unknown parameter '{key}' ({source}){hint}; accepted keys: {', '.join(sorted(allowed))}, "
        "and the GE keys in npu_amp_tf.options.GE_KEYS")


# --------------------------------------------------------------------------
# modify_mixlist
# --------------------------------------------------------------------------
def load_mixlist(path: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """Parse a CANN ``modify_mixlist`` JSON file.

    Returns ``{"black-list": {"to-add": (...), "to-remove": (...)}, ...}``.
    Every problem raises :class:`MixlistError` naming the file and the key.
    """
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise MixlistError(f"modify_mixlist file '{path}' cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MixlistError(f"modify_mixlist file '{path}' is not valid JSON: {exc}") from None
    return parse_mixlist(data, where=f"modify_mixlist file '{path}'")


def parse_mixlist(data, where="modify_mixlist") -> dict[str, dict[str, tuple[str, ...]]]:
    if not isinstance(data, dict):
        raise MixlistError(f"{where}: top level must be an object with keys {', '.join(MIXLIST_KEYS)}")
    out = {}
    for key, body in data.items():
        if key not in MIXLIST_KEYS:
            raise MixlistError(
                f"{where}: unknown key '{key}'; accepted top-level keys: {', '.join(MIXLIST_KEYS)}")
        if not isinstance(body, dict):
            raise MixlistError(f"{where}: '{key}' must be an object with keys {', '.join(MIXLIST_ACTIONS)}")
        entry = {}
        for action, ops in body.items():
            if action not in MIXLIST_ACTIONS:
                raise MixlistError(
                    f"{where}: unknown key '{key}.{action}'; accepted: {', '.join(MIXLIST_ACTIONS)}")
            if not isinstance(ops, list) or not all(isinstance(o, str) and o for o in ops):
                raise MixlistError(f"{where}: '{key}.{action}' must be an array of op type names")
            entry[action] = tuple(ops)
        out[key] = entry
    return out


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------
class Options(Mapping):
    """Validated, immutable parameter set.  Read values as attributes.

    ``opts.precision`` is the canonical precision mode after folding
    ``precision_mode_v2`` and aliases; ``opts.low_dtype`` is ``"float16"`` or
    ``"bfloat16"``; ``opts.mixlist`` is the parsed modify_mixlist (or None).
    """

    __slots__ = ("_values", "_explicit", "env_overrides", "mixlist", "ge", "notes")

    def __init__(self, values: dict, explicit: frozenset, env_overrides: dict, mixlist, ge=None,
                 notes=()):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_explicit", explicit)
        object.__setattr__(self, "env_overrides", env_overrides)
        object.__setattr__(self, "mixlist", mixlist)
        #: GE / tf_adapter keys given (key -> value); see GE_KEYS
        object.__setattr__(self, "ge", dict(ge or {}))
        #: warnings for the report (GE list names with no TF op type...)
        object.__setattr__(self, "notes", tuple(notes))

    # Mapping interface -----------------------------------------------------
    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __getattr__(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        raise AttributeError("Options are immutable; use Options.from_kwargs(**dict(opts, key=value))")

    def __repr__(self):
        shown = {k: v for k, v in self._values.items() if k in self._explicit}
        return f"Options({shown})"

    def __eq__(self, other):
        return isinstance(other, Options) and self._values == other._values and self.ge == other.ge

    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in list(self._values.items())
                                 + [("ge:" + k, v) for k, v in self.ge.items()])))

    # derived values --------------------------------------------------------
    @property
    def precision(self) -> str:
        if self._values["precision_mode_v2"] is not None:
            return PRECISION_MODES_V2[self._values["precision_mode_v2"]]
        mode = self._values["precision_mode"]
        return PRECISION_ALIASES.get(mode, mode)

    @property
    def low_dtype(self) -> str:
        return "bfloat16" if self.precision == "allow_mix_precision_bf16" else "float16"

    @property
    def explicit(self) -> frozenset:
        """Keys the caller set (not defaults)."""
        return self._explicit

    def rewrite_params(self) -> dict:
        """The explicitly set rewrite-group params (what a ConfigProto entry needs),
        plus the GE keys that were given."""
        out = {k: self._values[k] for k in REWRITE_KEYS if k in self._explicit}
        out.update(self.ge)
        return out

    @property
    def device_only_keys(self) -> tuple:
        """GE keys given that have no effect off the NPU."""
        return tuple(k for k in self.ge if k not in GE_ACTING_KEYS and k != "loss_scale")

    def loss_scale_params(self) -> dict:
        return {k: self._values[k] for k in LOSS_SCALE_KEYS}

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self._values.items()}

    # constructors ----------------------------------------------------------
    @classmethod
    def from_kwargs(cls, _source="argument", _groups=("rewrite", "loss_scale"), _env=True, **kwargs):
        """Validate keyword parameters (python values or strings)."""
        allowed = [k for k, o in OPTIONS.items() if o.group in _groups]
        values, explicit, ge = {}, set(), {}
        for key, raw in kwargs.items():
            if key not in allowed:
                if "rewrite" in _groups and key in GE_KEYS:
                    ge[key] = _convert_ge(key, raw, _source)
                    continue
                if "rewrite" in _groups and key == "loss_scale":  # CANN AMP guide key
                    ge[key] = OPTIONS[key].convert(raw, _source)
                    continue
                raise _unknown_key_error(key, _source, allowed)
            values[key] = OPTIONS[key].convert(raw, _source)
            explicit.add(key)
        env_overrides = {}
        if _env:
            for key in allowed:
                env_name = ENV_PREFIX + key.upper()
                if env_name in os.environ:
                    values[key] = OPTIONS[key].convert(os.environ[env_name], f"environment {env_name}")
                    env_overrides[key] = values[key]
                    explicit.add(key)
        for key in OPTIONS:
            values.setdefault(key, OPTIONS[key].default)
        # cross-field checks
        if "precision_mode" in explicit and values["precision_mode_v2"] is not None:
            raise OptionError(
                "precision_mode and precision_mode_v2 are both set "
                f"({values['precision_mode']!r}, {values['precision_mode_v2']!r}); set only one")
        if values["min_loss_scale"] > values["max_loss_scale"]:
            raise OptionError(
                f"min_loss_scale={values['min_loss_scale']} > max_loss_scale={values['max_loss_scale']}; "
                "accepted: min_loss_scale <= max_loss_scale")
        if values["init_loss_scale"] > values["max_loss_scale"] and "max_loss_scale" not in explicit:
            values["max_loss_scale"] = values["init_loss_scale"]  # tf_adapter: any start >= 1
        if not values["min_loss_scale"] <= values["init_loss_scale"] <= values["max_loss_scale"]:
            raise OptionError(
                f"init_loss_scale={values['init_loss_scale']} lies outside "
                f"[min_loss_scale={values['min_loss_scale']}, max_loss_scale={values['max_loss_scale']}]")
        if (ge.get("enable_dump") or ge.get("enable_dump_debug")) and not ge.get("dump_path"):
            raise OptionError(f"enable_dump/enable_dump_debug=true ({_source}) needs dump_path; "
                              "accepted: dump_path set to a directory")
        mixlist = load_mixlist(values["modify_mixlist"]) if values["modify_mixlist"] else None
        values, mixlist, notes = _map_list_names(values, mixlist)
        opts = cls(values, frozenset(explicit), env_overrides, mixlist, ge, notes)
        _check_lists(opts)
        if opts.device_only_keys:
            _log_device_only(opts.device_only_keys)
        return opts

    @classmethod
    def from_parameter_map(cls, parameter_map, _source="ConfigProto parameter_map"):
        """Read a ``RewriterConfig.CustomGraphOptimizer.parameter_map``
        (a protobuf map of ``AttrValue``) or a plain dict of AttrValue."""
        kwargs = {}
        for key in parameter_map:
            kwargs[key] = attr_value_to_python(parameter_map[key])
        return cls.from_kwargs(_source=_source, _groups=("rewrite",), **kwargs)

    @classmethod
    def from_cli(cls, namespace, _source="command line"):
        kwargs = {}
        for key in REWRITE_KEYS:
            val = getattr(namespace, key, None)
            if val is not None:
                kwargs[key] = val
        return cls.from_kwargs(_source=_source, _groups=("rewrite",), **kwargs)

    def fill_parameter_map(self, parameter_map, keys: Iterable[str] | None = None):
        """Write the explicitly set rewrite params into a protobuf parameter_map."""
        for key in (keys if keys is not None else self.rewrite_params()):
            if key in self.ge:
                val = self.ge[key]
                type_ = GE_ACTING_KEYS[key][1] if key in GE_ACTING_KEYS else (
                    "bool" if isinstance(val, bool) else "int" if isinstance(val, int)
                    else "float" if isinstance(val, float) else "str")
                python_to_attr_value(val, parameter_map[key], type_)
                continue
            python_to_attr_value(self._values[key], parameter_map[key], OPTIONS[key].type)


_LIST_KEYS = ("custom_white_list", "custom_black_list", "custom_gray_list")


def _map_list_names(values, mixlist):
    """GE op type names in the custom lists / modify_mixlist -> TF op types
    (:mod:`graph_passes.precision.ge_names`).  A name that is neither a GE
    type in the table nor a TF op type raises :class:`MixlistError`; a GE
    type with no TF counterpart becomes a note (a report warning)."""
    from graph_passes.precision import ge_names
    from graph_passes.precision import lists as _lists

    known = set()
    for table in _lists.default_lists().values():
        known.update(table)
    notes = []

    def do(names, where):
        out, unmapped, unknown = ge_names.map_names(names, extra=known)
        if unknown:
            raise MixlistError(
                f"{where}: op type(s) {', '.join(repr(u) for u in unknown)} are neither TensorFlow op "
                "types nor GE op types this plugin maps (graph_passes/precision/ge_names.py); "
                "accepted: a TF op type (e.g. 'MatMul') or a GE type (e.g. 'MatMulV2')")
        for u in unmapped:
            notes.append(f"{where}: GE op type '{u}' has no TensorFlow op type (an NPU-only fused "
                         "kernel); the entry has no effect here")
        return out

    values = dict(values)
    for key in _LIST_KEYS:
        if values[key]:
            values[key] = do(values[key], key)
    if mixlist:
        name = values.get("modify_mixlist")
        mixlist = {k: {a: do(ops, f"modify_mixlist '{name}' {k}.{a}") for a, ops in body.items()}
                   for k, body in mixlist.items()}
    return values, mixlist, notes


def _check_lists(opts: Options):
    """An op may sit in only one list after every custom list and mixlist edit."""
    from graph_passes.precision import lists as _lists  # engine data; safe direction

    _lists.resolve_lists(
        white_add=opts.custom_white_list, black_add=opts.custom_black_list,
        gray_add=opts.custom_gray_list, mixlist=opts.mixlist,
        mixlist_name=opts.modify_mixlist)


# --------------------------------------------------------------------------
# AttrValue <-> python
# --------------------------------------------------------------------------
def attr_value_to_python(av):
    kind = av.WhichOneof("value")
    if kind == "s":
        return av.s.decode()
    if kind in ("i", "f", "b"):
        return getattr(av, kind)
    if kind == "type":
        import tensorflow as tf
        return tf.as_dtype(av.type).name
    if kind == "list":
        lst = av.list
        if lst.s:
            return [s.decode() for s in lst.s]
        if lst.i:
            return list(lst.i)
        if lst.f:
            return list(lst.f)
        if lst.b:
            return list(lst.b)
        return []
    if kind is None:
        return None
    raise OptionError(f"parameter_map value of kind '{kind}' is not supported; use s, i, f, b or list")


def python_to_attr_value(value, av, type_):
    if value is None:
        av.s = b""
    elif type_ == "bool":
        av.b = bool(value)
    elif type_ == "int":
        av.i = int(value)
    elif type_ == "float":
        av.f = float(value)
    elif type_ == "list[str]":
        av.list.s.extend(s.encode() for s in value)
    else:
        av.s = str(value).encode()


# --------------------------------------------------------------------------
# CLI and docs
# --------------------------------------------------------------------------
def add_cli_arguments(parser, keys: Iterable[str] = REWRITE_KEYS):
    """Add ``--precision-mode`` style flags for the given options to an argparse parser."""
    for key in keys:
        opt = OPTIONS[key]
        flag = "--" + key.replace("_", "-")
        # argparse %-formats help texts: a literal "%" in a doc must be doubled
        kw = dict(dest=key, default=None, help=f"{opt.doc} Default: {opt.default!r}.".replace("%", "%%"))
        if opt.choices:
            kw["choices"] = opt.choices
        parser.add_argument(flag, **kw)
    return parser


def markdown_table(groups=("rewrite", "loss_scale")) -> str:
    """The README's parameter table, generated from :data:`OPTIONS`."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for opt in OPTIONS.values():
        if opt.group not in groups:
            continue
        default = "none" if opt.default is None else (
            "[]" if opt.default == () else f"`{opt.default!r}`")
        meaning = opt.doc
        if opt.choices:
            meaning += " Accepted: " + ", ".join(f"`{c}`" for c in opt.choices) + "."
        elif opt.accepts:
            meaning += f" Accepted: {opt.accepts}."
        rows.append(f"| `{opt.name}` | {opt.type} | {default} | {meaning} |")
    # GE keys that act on the session's ConfigProto (session_config, an entry's
    # parameter_map, NPURunConfig, npu-amp run): the memory levers
    for key, (kind, type_, doc) in GE_ACTING_KEYS.items():
        if kind == "memory":
            rows.append(f"| `{key}` | {type_} (GE key) | none | {doc}. Acts on the Session's ConfigProto: "
                        f"`session_config`, `estimator.RunConfig`, an entry's parameter_map in sessions under "
                        f"`npu-amp run` / `npu_amp_tf.compat`; not in `rewrite_graph` or `enable`. |")
    return "\n".join(rows)


def defaults() -> Options:
    return Options.from_kwargs()


TABLE_START = "<!-- options-table:start (generated by `make readme-table`; do not edit) -->"
TABLE_END = "<!-- options-table:end -->"


def update_readme(path: str) -> bool:
    """Rewrite the parameter table between the markers in README.md.
    Returns True when the file changed."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if TABLE_START not in text or TABLE_END not in text:
        raise OptionError(f"{path} has no parameter-table markers ({TABLE_START!r} ... {TABLE_END!r})")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
        return True
    return False


if __name__ == "__main__":  # python -m npu_amp_tf.options README.md
    import sys

    changed = update_readme(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    print("README parameter table " + ("updated" if changed else "already current"))
