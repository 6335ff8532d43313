"""Accuracy-guided mixlist tuning.

Finds a small set of op types whose addition to the black list (FP32) keeps
the mixed graph's outputs within tolerance of the FP32 graph, and writes it
as a CANN ``modify_mixlist`` JSON that ``--modify-mixlist`` accepts.

Tolerance: every output must be finite and satisfy
``max|fp32 - mixed| <= atol + rtol * max|fp32|`` (error relative to the
output's own scale, robust to elements near zero).

Search:

1. *candidates*: op types the default rewrite runs in low precision, ordered
   by how far their outputs diverge from FP32 (most divergent first; an op
   whose output overflows comes first);
2. *bisection*: the shortest prefix of that order which, black-listed,
   passes (``O(log n)`` trials, assuming that adding ops to the black list
   does not make accuracy worse);
3. *minimisation*: drop each prefix member whose removal still passes, so
   the result is 1-minimal (no single op can be removed);
4. *verification*: the written file itself is loaded and the graph rewritten
   with it once more.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from . import model_io
from .model_io import ToolError

LOW_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass
class TuneResult:
    black_add: list
    candidates: list
    trials: list  # [{"black": [...], "ok": bool, "err": float}]
    default_err: float
    final_err: float
    mixlist: dict
    path: str | None = None

    def to_json(self):
        return dataclasses.asdict(self)


def output_error(ref: list, got: list) -> float:
    """max over outputs of max|ref - got| / max|ref| (inf if non-finite)."""
    worst = 0.0
    for a, b in zip(ref, got):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b).astype(np.float64)
        if a.shape != b.shape:
            return float("inf")
        if not np.isfinite(b).all() and np.isfinite(a).all():
            return float("inf")
        fin = np.isfinite(a) & np.isfinite(b)
        if not fin.any():
            continue
        scale = float(np.max(np.abs(a[fin])))
        err = float(np.max(np.abs(a[fin] - b[fin])))
        worst = max(worst, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
    return worst


def within(ref: list, got: list, rtol: float, atol: float = 0.0) -> bool:
    for a, b in zip(ref, got):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b).astype(np.float64)
        if a.shape != b.shape or not np.isfinite(b).all():
            return False
        scale = float(np.max(np.abs(a))) if a.size else 0.0
        if a.size and float(np.max(np.abs(a - b))) > atol + rtol * scale:
            return False
    return True


def _low_precision_types(orig_gd, mixed_gd) -> dict[str, list[str]]:
    """op type -> node names that run in low precision after the rewrite."""
    from graph_passes import registry

    orig = {n.name: n for n in orig_gd.node}
    out: dict[str, list[str]] = {}
    for n in mixed_gd.node:
        if n.name not in orig or n.op in ("Cast", "Const", "Placeholder"):
            continue
        dts = registry.output_dtypes(n, mixed_gd.library) or []
        if any(registry.dtype_name(d) in LOW_DTYPES for d in dts):
            out.setdefault(n.op, []).append(n.name)
    return out


def tune_mixlist(model, feeds: dict, rtol: float, atol: float = 0.0, options=None,
                 out_path: str | None = None, progress: bool = True) -> TuneResult:
    """Search the smallest black-list addition; write it to ``out_path``."""
    from tqdm import tqdm

    from ..options import Options

    base = options if options is not None else Options.from_kwargs(_groups=("rewrite",))
    run = model if isinstance(model, model_io.Runnable) else model_io.runnable(model)
    fetches = list(run.outputs.values())
    ref_all = model_io.run_graph(run.graph_def, feeds, fetches, variables=run.variables)
    compared = [i for i, v in enumerate(ref_all) if v is not None and np.asarray(v).dtype.kind == "f"]
    if not compared:
        raise ToolError(f"no float output to compare among {', '.join(run.outputs)}; name one with --outputs "
                        "(for a training step: the train op and the loss, e.g. --outputs train,loss)")
    ref = [ref_all[i] for i in compared]
    base_params = dict(base.rewrite_params())
    base_black = tuple(base.custom_black_list)

    trials = []
    bar = tqdm(desc="tune-mixlist", unit="trial", disable=not progress, leave=False)

    def trial(black: list[str], opts=None):
        o = opts or Options.from_kwargs(_groups=("rewrite",), _env=False, **dict(
            base_params, custom_black_list=list(base_black) + list(black)))
        gd, _ = model_io.rewrite_runnable(run, o)
        got_all = model_io.run_graph(gd, feeds, fetches, variables=run.variables)
        got = [got_all[i] for i in compared]
        ok = within(ref, got, rtol, atol)
        err = output_error(ref, got)
        trials.append({"black": list(black), "ok": ok, "err": err})
        bar.update(1)
        bar.set_postfix(black=len(black), ok=ok)
        return ok, err, gd

    try:
        ok, default_err, mixed_gd = trial([], base)
        lp = _low_precision_types(run.graph_def, mixed_gd)
        if ok:
            chosen, final_err = [], default_err
        else:
            candidates = _rank_candidates(run, mixed_gd, lp, feeds, rtol)
            bar.total = 2 + int(np.ceil(np.log2(max(len(candidates), 1)))) + len(candidates)
            if not candidates:
                raise ToolError(f"the mixed graph misses rtol={rtol} (error {default_err:.3g}) but no op runs "
                                "in low precision; nothing to black-list")
            ok_all, err_all, _ = trial(candidates)
            if not ok_all:
                raise ToolError(
                    f"even with every low-precision op type black-listed ({', '.join(candidates)}) the "
                    f"outputs miss rtol={rtol} (relative error {err_all:.3g}); loosen --rtol")
            lo, hi = 0, len(candidates)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if trial(candidates[:mid])[0]:
                    hi = mid
                else:
                    lo = mid
            chosen = list(candidates[:hi])
            for op in reversed(list(chosen)):
                if len(chosen) == 1:
                    break
                rest = [c for c in chosen if c != op]
                if trial(rest)[0]:
                    chosen = rest
            final_err = None
    finally:
        bar.close()
    mixlist = {"black-list": {"to-add": sorted(set(base_black) | set(chosen))}} if (chosen or base_black) \
        else {"black-list": {"to-add": []}}
    if base.mixlist:
        mixlist = _merge_mixlist(base.mixlist, chosen)
    result = TuneResult(black_add=chosen, candidates=sorted(lp), trials=trials,
                        default_err=default_err, final_err=final_err if final_err is not None else -1.0,
                        mixlist=mixlist, path=out_path)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(mixlist, fh, indent=2)
            fh.write("\n")
        params = {k: v for k, v in base_params.items() if k not in ("custom_black_list", "modify_mixlist")}
        verify = Options.from_kwargs(_groups=("rewrite",), _env=False, modify_mixlist=out_path, **params)
        ok, err, _ = trial(chosen, verify)
        if not ok:
            raise ToolError(f"the written mixlist '{out_path}' does not reach rtol={rtol} "
                            f"(relative error {err:.3g}); accuracy is not monotone in the black list here")
        result.final_err = err
    elif final_err is None:
        result.final_err = trials[-1]["err"]
    return result


def _merge_mixlist(existing: dict, black_add: list[str]) -> dict:
    out = {k: {a: list(v) for a, v in body.items()} for k, body in existing.items()}
    bl = out.setdefault("black-list", {})
    adds = list(bl.get("to-add", []))
    for op in black_add:
        if op not in adds:
            adds.append(op)
        for key in ("white-list", "gray-list"):
            if op in out.get(key, {}).get("to-add", []):
                out[key]["to-add"].remove(op)
    bl["to-add"] = sorted(adds)
    return out


def _rank_candidates(run, mixed_gd, lp: dict, feeds, rtol: float) -> list[str]:
    """Candidate op types, the likeliest culprit first.

    Every low-precision node's output is compared with FP32.  A type ranks
    higher when one of its nodes misses ``rtol`` *earlier* in topological
    order (the first op to go wrong is the cause; what follows inherits its
    error), then by its largest error."""
    from graph_passes.graph import Graph

    from .dump import _run_all

    names = sorted({n for nodes in lp.values() for n in nodes})
    topo = {n: i for i, n in enumerate(Graph(mixed_gd).topo_order())}
    never = 1 << 30
    onset = {op: never for op in lp}
    score = {op: 0.0 for op in lp}
    # one step of each graph with every tensor captured (loop / cond bodies included)
    a, _, _ = _run_all(run.graph_def, run, feeds, "fp32", progress=False)
    b, _, _ = _run_all(mixed_gd, run, feeds, "mixed", progress=False)
    node_op = {n.name: n.op for n in mixed_gd.node}
    for n in names:
        x, y = a.get(n + ":0"), b.get(n + ":0")
        if x is None or y is None:
            continue
        e = output_error([x], [y])
        op = node_op[n]
        score[op] = max(score[op], e)
        if e > rtol:
            onset[op] = min(onset[op], topo.get(n, never - 1))
    return sorted(lp, key=lambda op: (onset[op], -score[op], op))
