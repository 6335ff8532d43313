"""benchmarks/end_to_end.py: the ``--processes N`` mode (child command line, aggregation,
verdicts) and the same start in every process (weights, losses), on real Keras models.

The aggregation tests feed hand-written rows whose medians are worked out by hand; the
subprocess test runs the benchmark itself at a tiny size (it may abort inside TF: run in
children) and checks what the fix is for: the initial-weights digest and every
configuration's loss are the same in every process, and ``fp32_again`` equals FP32."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import end_to_end as e2e  # noqa: E402  (imports numpy only; TF is imported where models run)


def test_module_does_not_import_tensorflow_in_the_parent():
    # the --processes parent only starts children: TF stays out of it
    code = ("import sys; sys.path.insert(0, %r); import end_to_end; "
            "print('tensorflow' in sys.modules)" % os.path.join(ROOT, "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_child_argv_drops_processes_models_json_in_both_spellings():
    argv = ["--processes", "3", "--models=slim_resnet50,bert", "--configs", "fp32,ours",
            "--json", "/tmp/x.json", "--rounds=2", "--processes=3", "--models", "bert", "--json=/y"]
    cmd = e2e.child_argv(argv, "bert", "/tmp/c.json")
    assert cmd[0] == sys.executable and cmd[1].endswith("end_to_end.py")
    assert cmd[2:] == ["--configs", "fp32,ours", "--rounds=2", "--models", "bert", "--json", "/tmp/c.json"]


def test_round_bf16_ties_to_even():
    # BF16 keeps 7 fraction bits: at 1.0 the step is 2**-7; hand-worked expectations
    a = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 3 * 2**-9), 3.0], np.float32)
    want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -(1 + 2**-7), 3.0], np.float32)
    np.testing.assert_array_equal(e2e.round_bf16(a), want)
    assert e2e.round_bf16(np.zeros((2, 3), np.float32)).shape == (2, 3)


def _row(model, config, wall, cpu, xw=None, xc=None, pw=None, pc=None, dloss=0.0):
    return {"model": model, "config": config, "step_s": wall, "cpu_s": cpu, "speedup_vs_fp32": xw,
            "cpu_speedup_vs_fp32": xc, "ours_vs_best_peer": pw, "cpu_ours_vs_best_peer": pc,
            "loss_rel_diff": dloss, "loadavg_1m": [1.0, 1.2]}


def _runs(ours_cpu_x, ours_wall_x, peer_cpu_x, dloss=(0.01, 0.01, 0.01)):
    runs = []
    for p, (xc, xw, pc, d) in enumerate(zip(ours_cpu_x, ours_wall_x, peer_cpu_x, dloss), 1):
        runs.append({"process": p, "model": "m", "rows": [
            _row("m", "fp32", 1.0, 2.0, 1.0, 1.0),
            _row("m", "grappler", 0.6, 1.2, 1.6, 1.6, dloss=0.005),
            _row("m", "ours", 0.5, 1.0, xw, xc, 1.2, pc, dloss=d)]})
    return runs


def test_summary_medians_over_processes_and_verdict_on_cpu_median():
    # CPU x FP32 per process 1.7, 1.9, 1.85 -> median 1.85 (met), min 1.7 < 1.8: straddles;
    # wall 1.6, 1.75, 1.79 -> median 1.75 (would miss: the verdict must follow the CPU median)
    runs = _runs([1.7, 1.9, 1.85], [1.6, 1.75, 1.79], [0.9, 1.1, 1.05])
    lines, summ = e2e.summarize_processes(runs, ["fp32", "grappler", "ours"], True, False, "data=fixed")
    ours = summ["m"]["ours"]
    assert ours["cpu_speedup_vs_fp32"] == (1.85, 1.7, 1.9)
    assert ours["speedup_vs_fp32"] == (1.75, 1.6, 1.79)
    assert ours["cpu_ours_vs_best_peer"] == (1.05, 0.9, 1.1)
    v = {name: status for name, status, *_ in summ["m"]["verdicts"]}
    assert v["ours >= 1.8x FP32"] == "MET"
    assert v["ours >= 1.0x best peer (grappler/keras)"] == "MET"
    assert v["loss"] == "not judged"
    text = "\n".join(lines)
    assert "MEDIAN over 3 processes" in text and "straddle" in text and "not judged" in text


def test_summary_missed_and_loss_judged():
    runs = _runs([1.5, 1.6, 1.9], [2.0, 2.0, 2.0], [0.95, 0.97, 1.2], dloss=(0.03, 0.03, 0.03))
    _, summ = e2e.summarize_processes(runs, ["fp32", "grappler", "ours"], True, True, "data=teacher, 50 steps")
    v = {name: status for name, status, *_ in summ["m"]["verdicts"]}
    assert v["ours >= 1.8x FP32"] == "MISSED"          # CPU median 1.6, though wall is 2.0
    assert v["ours >= 1.0x best peer (grappler/keras)"] == "MISSED"  # median 0.97
    assert v["loss"] == "MISSED"                        # 3% > 2%
    _, summ = e2e.summarize_processes(runs, ["fp32", "grappler", "ours"], False, True, "x")
    v = {name: status for name, status, *_ in summ["m"]["verdicts"]}
    assert v["ours >= 1.8x FP32"].startswith("does not apply")


def test_verdict_line_shows_more_digits_where_two_would_round_across_the_goal():
    # CPU medians 1.7996 (rounds to 1.80 but misses 1.8) and 1.804 (meets): the printed figure
    # must not read as the goal itself next to MISSED
    for cpu, status, shown in ((1.7996, "MISSED", "CPU 1.7996 "), (1.804, "MET", "CPU 1.80 ")):
        runs = _runs([cpu, cpu, cpu], [2.0, 2.0, 2.0], [1.1, 1.1, 1.1])
        lines, summ = e2e.summarize_processes(runs, ["fp32", "grappler", "ours"], True, False, "x")
        line = next(x for x in lines if x.strip().startswith("ours >= 1.8x FP32"))
        assert f"{status}: {shown}" in line, line


def test_summary_skips_failed_process():
    runs = _runs([1.7, 1.9, 2.0], [1.7, 1.9, 2.0], [1.0, 1.1, 1.2])
    runs[1]["rows"] = []  # a child that died
    lines, summ = e2e.summarize_processes(runs, ["fp32", "grappler", "ours"], True, False, "x")
    assert summ["m"]["ours"]["cpu_speedup_vs_fp32"] == (1.85, 1.7, 2.0)
    assert "1 failed: [2]" in "\n".join(lines)


def test_processes_same_start_and_loss_in_every_process(tmp_path):
    """Two fresh processes of the Keras ``train_on_batch`` model (the one whose FP32 loss
    moved 8.6% between runs, docs/benchmarks.md 18i): the initial weights' digest and each
    configuration's per-step losses are the same in both processes (before the fix, Keras'
    initializers took their seeds from Python's random: another start per process),
    fp32_again repeats FP32 exactly, fp32_w0bf16 starts elsewhere (its first loss differs).
    (FP32 configurations only: the test is about the start; ours' own rewrite is tested
    elsewhere.  The TF1-session Keras model is seeded the same way (``K.utils.set_random_seed(1)``
    before the build) and is left out to keep the suite's time: each process and configuration costs a
    ResNet-50 build.)"""
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "end_to_end.py"), "--processes", "2",
           "--models", "keras_fit", "--configs", "fp32,fp32_again,fp32_w0bf16",
           "--batch", "2", "--size", "32", "--classes", "10", "--warmup", "1", "--rounds", "1",
           "--steps", "2", "--data", "teacher", "--loss-window", "3", "--json", str(out)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(got["processes"]) == 2 and all(r["rc"] == 0 for r in got["processes"])
    for model in ("keras_fit",):
        runs = [r for r in got["processes"] if r["model"] == model]
        digests = {line for r in runs for line in r["stdout"].splitlines() if "initial weights" in line}
        assert len(digests) == 1, digests
        rows = [{row["config"]: row for row in r["rows"]} for r in runs]
        assert set(rows[0]) == {"fp32", "fp32_again", "fp32_w0bf16"}
        for cfg in rows[0]:
            assert rows[0][cfg]["losses"] == rows[1][cfg]["losses"], (model, cfg)
        fp32 = rows[0]["fp32"]["losses"]
        assert len(fp32) == 3 and all(np.isfinite(fp32))
        assert rows[0]["fp32_again"]["losses"] == fp32
        assert rows[0]["fp32_w0bf16"]["losses"][0] != fp32[0]
        assert rows[0]["fp32_again"]["loss_rel_diff"] == 0.0
    assert "verdict: none (needs fp32 and ours)" in p.stdout
