"""``npu-amp``: the command line of npu-amp-tf.

Subcommands: rewrite, report, check-align, dump, compare, tune-mixlist,
profile, run, demo.  Run ``npu-amp <command> --help`` for each one's flags and an
example.  Rewrite flags (``--precision-mode``, ``--modify-mixlist``,
``--graph-level``, ``--format-mode``...) come from :mod:`npu_amp_tf.options`,
the same keys and validation as every other entry point.

Bad input (a missing file, a model that does not parse, an unknown
signature, inputs that do not match the placeholders, an invalid option)
ends with one line on stderr and exit status 2; ``--debug`` (or
``NPU_AMP_DEBUG=1``) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PROG = "npu-amp"
EXIT_USAGE = 2
EXIT_INTERNAL = 1


class _CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line."""

    def error(self, message):
        raise _CliError(f"{message} (see '{self.prog} --help')")


@contextlib.contextmanager
def _quiet_stderr():
    """Hide what TF's C++ runtime prints while it is imported (TF >= 2.16
    logs a few INFO lines before absl logging is initialised, ignoring
    TF_CPP_MIN_LOG_LEVEL); replay it if the import fails."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    tmp = tempfile.TemporaryFile()
    os.dup2(tmp.fileno(), fd)
    failed = True
    try:
        yield
        failed = False
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        if failed:
            tmp.seek(0)
            sys.stderr.write(tmp.read().decode("utf-8", "replace"))
        tmp.close()


def _import_package():
    with _quiet_stderr():
        import npu_amp_tf  # noqa: F401  (imports TensorFlow, registers the optimizer)
    return sys.modules["npu_amp_tf"]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _options(args):
    from .options import Options

    return Options.from_cli(args)


def _model_args(p, outputs=True):
    p.add_argument("--signature", help="SavedModel / MetaGraph signature key (default: serving_default, "
                                       "else the first one)")
    p.add_argument("--tags", help="SavedModel MetaGraph tags, comma-separated (default: serve)")
    if outputs:
        p.add_argument("--outputs", help="output tensors, comma-separated (node or node:k); default: the "
                                         "signature outputs, else the graph's sink nodes")


def _rewrite_args(p):
    from .options import REWRITE_KEYS, add_cli_arguments

    g = p.add_argument_group("rewrite options (same keys as session_config / rewrite_graph)")
    skip = {"report_path", "validate_graph"}
    add_cli_arguments(g, [k for k in REWRITE_KEYS if k not in skip])


def _load(args, path_attr="model"):
    from .tools import model_io

    outputs = [o for o in (getattr(args, "outputs", None) or "").split(",") if o.strip()]
    return model_io.load_model(getattr(args, path_attr), signature=args.signature, tags=args.tags,
                               outputs=[o.strip() for o in outputs] or None)


def _run_args(p):
    p.add_argument("--checkpoint", help="TF1 checkpoint (prefix such as model.ckpt-100, or its directory) "
                                        "holding the MetaGraph's variables; default: the graph's initializers")
    p.add_argument("--threads", type=int, default=None,
                   help="TensorFlow intra- and inter-op threads for the runs (default: TensorFlow's own choice)")


def _runnable(args, model):
    from .tools import model_io

    if args.threads is not None:
        if args.threads < 1:
            raise _CliError(f"--threads={args.threads} is not valid; accepted: an integer >= 1")
        model_io.THREADS = args.threads
    return model_io.runnable(model, checkpoint=args.checkpoint)


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _feeds(args, run):
    from .tools import model_io

    if getattr(args, "inputs", None):
        return model_io.load_inputs(args.inputs, run)
    return model_io.synthetic_inputs(run, batch=getattr(args, "batch", 2))


# --------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------
def cmd_rewrite(args):
    from .pipeline import optimize
    from .tools import model_io

    options = _options(args)
    model = _load(args, "input")
    # what a Session sees: function calls inlined first (npu_amp_tf.inline)
    gd_in = model_io.inlined_graph_def(model, for_saving=True)
    gd, report = optimize(gd_in, options, fetches=model.fetch_nodes,
                          preserve=model.preserve_nodes(), graph_name=os.path.basename(args.input))
    written = model_io.save_model(model, gd, args.output, report)
    from .tools.report import totals

    s = report.summary
    share = totals(report)["lp_flop_share"]
    print(f"rewrote {model.kind} '{args.input}' -> '{written[0]}' ({options.precision})")
    print(f"  low-precision FLOP share: {share * 100:.1f}%" if isinstance(share, (int, float))
          else "  low-precision FLOP share: n/a")
    print(f"  casts: {s.get('casts', 'n/a')}  TransData: {s.get('transdata', 'n/a')}  "
          f"warnings: {len(report.warnings)}")
    print(f"  report: {written[-1]}")
    return 0


def cmd_report(args):
    from .pipeline import optimize
    from .tools import report as rep

    graph_def = None
    if args.model.endswith(".json"):
        report = rep.load_report(args.model)
        if args.html:
            raise _CliError("--html needs the model to draw the graph; pass the model instead of a report JSON")
    else:
        from .tools import model_io

        options = _options(args)
        model = _load(args)
        # report what a Session sees: function calls inlined first (one
        # function per Keras layer in a SavedModel would otherwise put casts
        # at every layer boundary and hide the converted ops from the map)
        gd_in = model_io.inlined_graph_def(model)
        graph_def, report = optimize(gd_in, options, fetches=model.fetch_nodes,
                                     preserve=model.preserve_nodes(),
                                     graph_name=os.path.basename(args.model.rstrip("/")))
    print(rep.format_report(report, graph_def, limit=None if args.all else args.limit))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(report.dumps(indent=1))
        print(f"report JSON: {args.json}")
    if args.html:
        rep.write_html(report, graph_def, args.html, title=f"npu-amp precision map: {args.model}", model=model)
        print(f"HTML: {args.html}")
    return 0


def _align_result(graph_def):
    """``npu_amp_tf.check_align`` on a whole graph (a JSON-serialisable dict)."""
    from .layout import check_align

    return check_align(graph_def)


def format_align(result: dict) -> str:
    items = result.get("items", [])
    lines = []
    if not items:
        lines.append("all conv/matmul ops are aligned (channels to C0, matrix dims to 16)")
    else:
        lines.append(f"{len(items)} op(s) with unaligned dims (padding wastes cube compute):")
        for it in items:
            dims = ", ".join(f"{k}={v}" for k, v in it.get("unaligned_dims", {}).items())
            lines.append(f"  {it.get('name')} ({it.get('op')}, {it.get('dtype')}): unaligned {dims}; "
                         f"shape {it.get('shape')} -> padded {it.get('padded_shape')}; "
                         f"waste {it.get('waste_share', 0) * 100:.1f}% of its FLOPs")
    tp = result.get("total_padded_flops")
    if tp is not None:
        lines.append(f"total: {result.get('total_flops', 0)} FLOPs, {tp} after padding, "
                     f"waste {result.get('waste_share', 0) * 100:.1f}%")
    return "\n".join(lines)


def cmd_check_align(args):
    model = _load(args)
    result = _align_result(model.graph_def)
    print(format_align(result))
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 1 if (args.strict and result.get("items")) else 0


def cmd_dump(args):
    from .tools import model_io
    from .tools.dump import dump as run_dump

    options = _options(args)
    model = _load(args)
    run = _runnable(args, model)
    feeds = model_io.load_inputs(args.inputs, run)
    meta = run_dump(run, feeds, args.out, options, progress=_progress(args))
    n32 = sum(1 for t in meta["tensors"].values() if t["fp32_dtype"])
    nmx = sum(1 for t in meta["tensors"].values() if t["mixed_dtype"])
    for note in meta.get("loader_notes", []):
        print(f"note: {note}")
    missing = sum(len(v) for v in meta["not_dumped"].values())
    print(f"dumped {n32} FP32 and {nmx} mixed tensors to '{args.out}' ({options.precision}; "
          f"{'one training step' if meta['training_step'] else 'one step'}, weights from {meta['weights_from']}"
          f"{f'; {missing} without a value, listed under not_dumped in meta.json' if missing else ''}); "
          f"next: {PROG} compare {args.out}")
    return 0


def cmd_compare(args):
    import importlib

    cmp = importlib.import_module("npu_amp_tf.tools.compare")
    result = cmp.compare(args.dump_dir)
    print(cmp.format_table(result, top=args.top))
    files = cmp.write_outputs(result, args.out)
    print("written: " + ", ".join(files))
    return 3 if (args.fail_on_overflow and result.overflow) else 0


def cmd_tune(args):
    from .tools import model_io
    from .tools import tune as tune_mod

    if args.rtol <= 0:
        raise _CliError(f"--rtol={args.rtol} is not valid; accepted: a number > 0")
    options = _options(args)
    model = _load(args)
    run = _runnable(args, model)
    feeds = model_io.load_inputs(args.inputs, run)
    res = tune_mod.tune_mixlist(run, feeds, args.rtol, args.atol, options, out_path=args.out,
                                progress=_progress(args))
    print(f"default rewrite: output relative error {res.default_err:.4g} (rtol {args.rtol})")
    if res.black_add:
        print(f"black-list addition: {', '.join(res.black_add)} "
              f"(from {len(res.candidates)} low-precision op types, {len(res.trials)} trials)")
    else:
        print("the default rewrite is already within tolerance; nothing to add")
    print(f"with the mixlist: relative error {res.final_err:.4g}")
    print(f"modify_mixlist written to '{args.out}'; use it with --modify-mixlist {args.out} "
          f"or session_config(modify_mixlist='{args.out}')")
    return 0


def cmd_profile(args):
    from .tools import model_io
    from .tools import profile as prof

    if args.steps < 1:
        raise _CliError(f"--steps={args.steps} is not valid; accepted: an integer >= 1")
    target = args.target
    if target.endswith(".py"):
        for flag in ("checkpoint", "threads"):
            if getattr(args, flag, None) is not None:
                raise _CliError(f"--{flag} applies to a model, not to a script ('{target}' runs as it is)")
        from . import compat

        compat.install()
        # the rewrite flags act on the script's sessions / functions too
        with compat.plugin_everywhere(**_explicit_params(args)):
            summary = prof.profile_script(target, args.steps, args.out, args.script_args,
                                          progress=_progress(args))
    else:
        options = _options(args)
        model = _load(args, "target")
        run = _runnable(args, model)
        feeds = _feeds(args, run)
        gd, _ = model_io.rewrite_runnable(run, options)
        summary = prof.profile_graph(gd, feeds, list(run.outputs.values()), args.steps, args.out,
                                     progress=_progress(args), variables=run.variables)
    print(prof.format_summary(summary))
    print("written: " + ", ".join(summary["files"]) + "  (open timeline.json in chrome://tracing or "
                                                       "https://ui.perfetto.dev)")
    return 0


def _explicit_params(args) -> dict:
    """The rewrite flags given on the command line (validated)."""
    return dict(_options(args).rewrite_params())


def cmd_run(args):
    from .compat import run_script

    return run_script(args.script, args.script_args, _explicit_params(args))


def cmd_demo(args):
    from .tools import demo as demo_mod

    res = demo_mod.run_demo(progress=_progress(args), steps=args.steps)
    print(demo_mod.format_result(res))
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res.to_json(), fh, indent=1, default=str)
    return 0


# --------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------
def _sub(subs, name, func, help_, example, description=None):
    p = subs.add_parser(name, help=help_, description=description or help_,
                        epilog="example:\n" + textwrap.indent(example.strip(), "  "),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func, command=name)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="npu-amp-tf: mixed-precision graph rewrite and diagnostics "
                                            "for TensorFlow (Ascend GE style).",
                     epilog="example:\n  npu-amp rewrite model.pb model_amp.pb --precision-mode allow_mix_precision\n"
                            "  npu-amp <command> --help",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="command", parser_class=_Parser)
    subs.required = True

    p = _sub(subs, "rewrite", cmd_rewrite, "rewrite a model offline (GraphDef, MetaGraph or SavedModel)",
             "npu-amp rewrite model.pb model_amp.pb --precision-mode allow_mix_precision\n"
             "npu-amp rewrite saved_model/ saved_model_amp/ --signature serving_default --modify-mixlist fix.json",
             "Rewrite a frozen GraphDef (.pb/.pbtxt), a MetaGraph (.meta) or a SavedModel directory. "
             "The output is the same kind, plus the report as JSON beside it "
             "(OUT.report.json, or OUT/npu_amp_report.json for a SavedModel).")
    p.add_argument("input", help="model: .pb/.pbtxt GraphDef, .meta MetaGraph, or SavedModel directory")
    p.add_argument("output", help="where to write the rewritten model (same kind)")
    _model_args(p)
    _rewrite_args(p)

    p = _sub(subs, "report", cmd_report, "print the precision map: per-op dtype, list, reason, FLOPs; totals; warnings",
             "npu-amp report model.pb --html precision.html\n"
             "npu-amp report model.report.json")
    p.add_argument("model", help="a model (rewritten now with the flags below) or a report .json")
    p.add_argument("--html", help="write a self-contained HTML page drawing the graph coloured by precision")
    p.add_argument("--json", help="also write the report as JSON")
    p.add_argument("--limit", type=int, default=200, help="rows of the table to print (default 200)")
    p.add_argument("--all", action="store_true", help="print every row")
    _model_args(p)
    _rewrite_args(p)

    p = _sub(subs, "check-align", cmd_check_align,
             "check conv/matmul shapes against the NC1HWC0 / FRACTAL_Z 16-alignment",
             "npu-amp check-align model.pb")
    p.add_argument("model")
    p.add_argument("--strict", action="store_true", help="exit 1 when something is misaligned")
    p.add_argument("--json", help="also write the analysis as JSON")
    _model_args(p)

    p = _sub(subs, "dump", cmd_dump, "run one step of the FP32 and the rewritten graph; save every float tensor",
             "python -c \"import numpy as np; np.savez('in.npz', x=np.random.rand(2, 8).astype('float32'))\"\n"
             "npu-amp dump model.pb --inputs in.npz --out dump/\n"
             "npu-amp compare dump/")
    p.add_argument("model")
    p.add_argument("--inputs", required=True, help=".npz keyed by placeholder name (x or x:0, or signature key)")
    p.add_argument("--out", required=True, help="dump directory")
    p.add_argument("--no-progress", action="store_true")
    _run_args(p)
    _model_args(p)
    _rewrite_args(p)

    p = _sub(subs, "compare", cmd_compare,
             "rank ops by FP32-vs-mixed divergence and locate the first overflow (inf/NaN)",
             "npu-amp compare dump/ --top 30")
    p.add_argument("dump_dir", help="a directory written by 'npu-amp dump'")
    p.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    p.add_argument("--out", help="where to write compare.csv / compare.json (default: the dump directory)")
    p.add_argument("--fail-on-overflow", action="store_true", help="exit 3 when an overflow is found")

    p = _sub(subs, "tune-mixlist", cmd_tune,
             "find the smallest black-list addition that keeps outputs within rtol of FP32",
             "npu-amp tune-mixlist model.pb --inputs in.npz --rtol 1e-2 --out fix.json\n"
             "npu-amp rewrite model.pb model_amp.pb --modify-mixlist fix.json")
    p.add_argument("model")
    p.add_argument("--inputs", required=True, help=".npz keyed by placeholder name")
    p.add_argument("--rtol", type=float, required=True,
                   help="tolerance: max|fp32 - mixed| <= atol + rtol * max|fp32| for every output")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--out", default="modify_mixlist.json", help="mixlist JSON to write (default modify_mixlist.json)")
    p.add_argument("--no-progress", action="store_true")
    _run_args(p)
    _model_args(p)
    _rewrite_args(p)

    p = _sub(subs, "profile", cmd_profile,
             "trace N steps: Chrome-trace timeline.json and a summary (low-precision share, Cast share, memory)",
             "npu-amp profile model.pb --steps 5 --out prof/\n"
             "npu-amp profile train.py --steps 5 --out prof/ -- --epochs 1")
    p.add_argument("target", metavar="MODEL|SCRIPT", help="a model, or a TF1 Session training script (.py)")
    p.add_argument("script_args", nargs="*", help="arguments for SCRIPT (after --)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True, help="directory for timeline.json and summary.json")
    p.add_argument("--inputs", help=".npz keyed by placeholder name (default: random data)")
    p.add_argument("--batch", type=int, default=2, help="batch size for random data (unknown dims)")
    p.add_argument("--no-progress", action="store_true")
    _run_args(p)
    _model_args(p)
    _rewrite_args(p)

    p = _sub(subs, "run", cmd_run,
             "run a training script unchanged: npu_bridge / npu_device from the plugin; flags put "
             "the plugin into every session and function",
             "npu-amp run train.py --epochs 1\n"
             "npu-amp run --precision-mode allow_mix_precision --report-path rep/ train.py --lr 0.1\n"
             "python -m npu_amp_tf.run train.py --epochs 1",
             "Run SCRIPT as __main__ with its own arguments (everything after SCRIPT), keeping its "
             "sys.argv and exit status. `import npu_bridge` / `npu_device` resolve to npu-amp-tf's "
             "compatibility layer unless Huawei's tf_adapter is installed (then it is used, and "
             "this says so). Rewrite flags given BEFORE the script put the plugin into every "
             "Session and TF2 function of the script (also one that never names the plugin) and "
             "override the script's own entries (NPU_AMP_<KEY> environment overrides).")
    p.add_argument("script", help="the training script (.py)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    _rewrite_args(p)
    from .options import add_cli_arguments

    add_cli_arguments(p.add_argument_group("reports"), ["report_path"])

    p = _sub(subs, "demo", cmd_demo,
             "train an embedded model in FP32 and with the plugin; print report, loss-scale history, losses",
             "npu-amp demo\nnpu-amp demo --steps 20 --json demo.json")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--json", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true")
    return parser


def _one_line(exc) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("NPU_AMP_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    command = PROG
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except _CliError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        command = f"{PROG} {args.command}"
        _import_package()
        from .errors import NpuAmpError

        try:
            return int(args.func(args) or 0)
        except (NpuAmpError, _CliError) as exc:
            if debug:
                raise
            print(f"{command}: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - last resort: one line, not a traceback
        if debug:
            raise
        print(f"{command}: internal error: {type(exc).__name__}: {_one_line(exc)[:500]} "
              f"(rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
