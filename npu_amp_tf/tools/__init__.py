"""Diagnostics for mixed-precision graphs: the Python API behind ``npu-amp``.

==================  ==========================================================
``load_model``      read a GraphDef (.pb/.pbtxt), MetaGraph or SavedModel
``save_model``      write a rewritten graph back as the same kind (+ report)
``runnable``        freeze a model (variables -> constants) for running
``load_inputs``     read an .npz keyed by placeholder name, checked
``format_report``   the precision map table, totals and warnings
``write_html``      self-contained HTML page of the graph coloured by precision
``dump``            one step of FP32 and rewritten graph, every float tensor
``compare``         rank ops by divergence; locate the first overflow
``tune_mixlist``    smallest black-list addition within rtol -> mixlist JSON
``profile_graph``   trace N steps -> Chrome trace + summary
``profile_script``  the same for a TF1 Session training script
``run_demo``        FP32 vs plugin training on the embedded model
==================  ==========================================================

See ``docs/tools.md``.
"""
from .compare import CompareResult, compare, format_table, locate_overflow, tensor_stats
from .compare import write_outputs as write_compare_outputs
from .demo import DemoResult, format_result as format_demo, run_demo
from .dump import dump
from .model_io import (Model, Runnable, ToolError, load_inputs, load_model, run_graph, runnable,
                       save_model, synthetic_inputs)
from .profile import chrome_trace, format_summary, profile_graph, profile_script, summarize
from .report import format_report, load_report, write_html
from .tune import TuneResult, tune_mixlist

__all__ = [
    "Model", "Runnable", "ToolError", "load_model", "save_model", "runnable", "load_inputs",
    "synthetic_inputs", "run_graph", "format_report", "load_report", "write_html", "dump", "compare",
    "CompareResult", "format_table", "locate_overflow", "tensor_stats", "write_compare_outputs",
    "tune_mixlist", "TuneResult", "profile_graph", "profile_script", "chrome_trace", "summarize",
    "format_summary", "run_demo", "DemoResult", "format_demo",
]
