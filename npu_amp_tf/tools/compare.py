"""Compare a dump (:mod:`.dump`): rank ops by divergence, locate the overflow.

For every tensor present in both graphs (the mixed value is widened to
float64 first):

``max_abs_err``
    max |fp32 - mixed| over elements where both are finite;
``max_rel_err``
    ``max_abs_err / max|fp32|``: error relative to the tensor's own scale
    (element-wise relative error explodes on values near zero, this does not);
``cosine``
    cosine similarity of the flattened tensors (1.0 = same direction);
``fp32_absmax``, ``fp16_overflow``, ``fp16_underflow``
    FP16-range statistics of the FP32 reference: its largest magnitude, and
    the fraction of elements above 65504 (become inf in FP16) or non-zero
    below 2**-24 (flush to 0 in FP16);
``mixed_nonfinite``
    count of inf / NaN elements in the mixed tensor.

Ranking: tensors with new inf/NaN first, then by ``max_rel_err``.

The **overflow locator** walks the mixed graph in topological order and
names the first op whose output holds inf or NaN while its FP32 counterpart
(when it has one) is finite: that is where the overflow starts, everything
after it only propagates it.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os

import numpy as np

from .model_io import ToolError

FP16_MAX = 65504.0
FP16_MIN_SUBNORMAL = 2.0 ** -24

COLUMNS = ("rank", "tensor", "op", "mixed_dtype", "max_abs_err", "max_rel_err", "cosine",
           "fp32_absmax", "fp16_overflow", "fp16_underflow", "mixed_nonfinite")


@dataclasses.dataclass
class CompareResult:
    rows: list  # dicts with COLUMNS, ranked
    overflow: dict | None  # the overflow locator's finding
    outputs: list  # rows for the graph outputs
    dump_dir: str
    not_dumped: dict = dataclasses.field(default_factory=dict)  # {"fp32"|"mixed": {tensor: why}} from dump


    def to_json(self) -> dict:
        return {"overflow": self.overflow, "outputs": self.outputs, "ops": self.rows,
                "not_dumped": self.not_dumped}


def load_dump(dump_dir: str):
    meta_path = os.path.join(dump_dir, "meta.json")
    if not os.path.isdir(dump_dir):
        raise ToolError(f"dump directory '{dump_dir}' does not exist")
    if not os.path.exists(meta_path):
        raise ToolError(f"'{dump_dir}' is not a dump directory (no meta.json); create one with 'npu-amp dump'")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        fp32 = np.load(os.path.join(dump_dir, "fp32.npz"), allow_pickle=False)
        mixed = np.load(os.path.join(dump_dir, "mixed.npz"), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ToolError(f"dump directory '{dump_dir}' is incomplete or corrupt: {exc}") from None
    return meta, fp32, mixed


def tensor_stats(ref, got) -> dict:
    """Divergence metrics between an FP32 reference and a mixed tensor."""
    a = np.asarray(ref, dtype=np.float64).ravel()
    b = np.asarray(got).astype(np.float64).ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    diff = np.abs(a[finite] - b[finite])
    absmax = float(np.max(np.abs(a[np.isfinite(a)]))) if np.isfinite(a).any() else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    na, nb = np.linalg.norm(a[finite]), np.linalg.norm(b[finite])
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        cos = float(np.dot(a[finite], b[finite]) / (na * nb))
    n = max(a.size, 1)
    absa = np.abs(a)
    new_nonfinite = bool(np.count_nonzero(~np.isfinite(b) & np.isfinite(a)))
    if new_nonfinite:  # inf/NaN only in the mixed tensor: unbounded error
        max_abs = float("inf")
    return {
        "max_abs_err": max_abs,
        "max_rel_err": (max_abs / absmax if absmax > 0 else (0.0 if max_abs == 0 else float("inf"))),
        "cosine": cos,
        "fp32_absmax": absmax,
        "fp16_overflow": float(np.count_nonzero(absa > FP16_MAX)) / n,
        "fp16_underflow": float(np.count_nonzero((absa > 0) & (absa < FP16_MIN_SUBNORMAL))) / n,
        "mixed_nonfinite": int(b.size - np.count_nonzero(np.isfinite(b))),
        "fp32_nonfinite": int(a.size - np.count_nonzero(np.isfinite(a))),
    }


def compare(dump_dir: str) -> CompareResult:
    meta, fp32, mixed = load_dump(dump_dir)
    tensors = meta["tensors"]
    rows = []
    fp32_keys, mixed_keys = set(fp32.files), set(mixed.files)
    for name, info in tensors.items():
        if name not in fp32_keys or name not in mixed_keys:
            continue
        ra, rb = fp32[name], mixed[name]
        if ra.shape != rb.shape:
            continue
        row = {"tensor": name, "node": info["node"], "op": info["op"],
               "mixed_dtype": info["mixed_dtype"], "fp32_dtype": info["fp32_dtype"],
               "topo_index": info["topo_index"]}
        row.update(tensor_stats(ra, rb))
        rows.append(row)
    rows.sort(key=lambda r: (-(r["mixed_nonfinite"] > r["fp32_nonfinite"]), -r["max_rel_err"],
                             r["cosine"], r["tensor"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    overflow = locate_overflow(meta, fp32, mixed)
    out_tensors = set(meta.get("outputs", {}).values())
    outputs = [r for r in rows if r["tensor"] in out_tensors]
    return CompareResult(rows, overflow, outputs, dump_dir, meta.get("not_dumped", {}))


def locate_overflow(meta, fp32, mixed) -> dict | None:
    """The first op (topological order of the mixed graph) whose output is
    inf/NaN in the mixed graph while finite (or absent) in FP32."""
    tensors = meta["tensors"]
    fp32_keys = set(fp32.files)
    ordered = sorted((info["topo_index"] if info["topo_index"] is not None else 1 << 30, name)
                     for name, info in tensors.items() if name in mixed.files)
    for _, name in ordered:
        val = mixed[name]
        if np.isfinite(val.astype(np.float64)).all():
            continue
        ref = fp32[name] if name in fp32_keys else None
        if ref is not None and not np.isfinite(ref.astype(np.float64)).all():
            continue  # already non-finite in FP32: not an FP16 overflow
        info = tensors[name]
        v = val.astype(np.float64)
        found = {
            "tensor": name, "node": info["node"], "op": info["op"],
            "mixed_dtype": info["mixed_dtype"],
            "inf": int(np.count_nonzero(np.isinf(v))), "nan": int(np.count_nonzero(np.isnan(v))),
            "size": int(v.size),
        }
        if ref is not None:
            absmax = float(np.max(np.abs(ref.astype(np.float64)))) if ref.size else 0.0
            found["fp32_absmax"] = absmax
            found["explanation"] = (
                f"FP32 max |x| = {absmax:.4g}" + (f" exceeds the FP16 max {FP16_MAX:g}" if absmax > FP16_MAX
                                                   else " is within FP16 range; the inputs or an "
                                                        "intermediate accumulation overflowed"))
        else:
            found["explanation"] = "tensor exists only in the mixed graph (an inserted node)"
        return found
    return None


def _fmt(v):
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def format_table(result: CompareResult, top: int = 20) -> str:
    """A fixed-width table of the ``top`` most divergent tensors."""
    cols = ("rank", "tensor", "op", "mixed_dtype", "max_abs_err", "max_rel_err", "cosine",
            "fp32_absmax", "fp16_overflow", "mixed_nonfinite")
    head = ("#", "tensor", "op", "dtype", "max_abs", "max_rel", "cosine", "fp32|max|", "ovf>65504",
            "inf/nan")
    body = [[_fmt(r[c]) for c in cols] for r in result.rows[:top]]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    widths[1] = min(widths[1], 48)
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for b in body:
        b[1] = b[1] if len(b[1]) <= 48 else "…" + b[1][-47:]
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)))
    lines.append(f"({len(result.rows)} tensors compared; showing the top {min(top, len(result.rows))})")
    ov = result.overflow
    if ov:
        lines.append(f"OVERFLOW: first inf/NaN in the mixed graph at op '{ov['node']}' ({ov['op']}, "
                     f"{ov['mixed_dtype']}) tensor {ov['tensor']}: {ov['inf']} inf, {ov['nan']} NaN of "
                     f"{ov['size']}; {ov['explanation']}")
    else:
        lines.append("no overflow: no tensor becomes inf/NaN in the mixed graph only")
    for side, missing in sorted(result.not_dumped.items()):
        if missing:
            first = sorted(missing)[:3]
            lines.append(f"not in the {side} dump ({len(missing)}, not compared): {', '.join(first)}"
                         f"{' ...' if len(missing) > 3 else ''}; reasons in meta.json 'not_dumped'")
    for r in result.outputs:
        lines.append(f"output {r['tensor']}: max_rel_err={_fmt(r['max_rel_err'])} cosine={_fmt(r['cosine'])}")
    return "\n".join(lines)


def write_outputs(result: CompareResult, out_dir: str | None = None) -> list[str]:
    out_dir = out_dir or result.dump_dir
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "compare.csv")
    json_path = os.path.join(out_dir, "compare.json")
    fields = list(COLUMNS) + ["node", "fp32_dtype", "topo_index", "fp32_nonfinite"]
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in result.rows:
            w.writerow(r)
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(_strict(result.to_json()), fh, indent=1, allow_nan=False)
    return [csv_path, json_path]


def _strict(o):
    """Strict JSON: inf / NaN become the strings "inf", "-inf", "nan"."""
    if isinstance(o, float) and not np.isfinite(o):
        return "nan" if np.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {k: _strict(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict(v) for v in o]
    return o
