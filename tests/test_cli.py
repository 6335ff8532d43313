"""``npu-amp`` subcommands run as subprocesses on real small models."""
import csv
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import test_tools as tm
from chromium_cdp import png_pixels

BIN = os.path.join(os.path.dirname(sys.executable), "npu-amp")
TF_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} \d\d:\d\d:\d\d|"
                    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] |To enable the following instructions)")


def cli(*args, check=True, cwd=None):
    cmd = [BIN] if os.path.exists(BIN) else [sys.executable, "-m", "npu_amp_tf.cli"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=300)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def error_lines(p):
    """stderr without TensorFlow's own start-up log lines (TF >= 2.16 prints
    them before absl logging is initialised, whatever TF_CPP_MIN_LOG_LEVEL says)."""
    return [ln for ln in p.stderr.splitlines() if ln.strip() and not TF_LOG.match(ln)]


def assert_one_line_error(p, *needles):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = error_lines(p)
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("npu-amp"), lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    m = {
        "mlp_pb": tm.write_pb(tm.mlp_graph_def(), d / "mlp.pb"),
        "mlp_pbtxt": tm.write_pb(tm.mlp_graph_def(), d / "mlp.pbtxt", text=True),
        "ovf_pb": tm.write_pb(tm.overflow_graph_def(), d / "ovf.pb"),
        "meta": tm.write_metagraph(d / "model.meta"),
        "saved": tm.write_saved_model(d / "saved"),
        "dir": d,
    }
    np.savez(d / "ovf_in.npz", **tm.overflow_inputs())
    np.savez(d / "mlp_in.npz", **{"x:0": np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)})
    m["ovf_in"] = str(d / "ovf_in.npz")
    m["mlp_in"] = str(d / "mlp_in.npz")
    return m


def load_gd(path):
    gd = tf.compat.v1.GraphDef()
    if str(path).endswith(".pbtxt"):
        from google.protobuf import text_format
        text_format.Parse(open(path).read(), gd)
    else:
        gd.ParseFromString(open(path, "rb").read())
    return gd


def half_ops(gd):
    return {n.name for n in gd.node if n.attr["T"].type == tf.float16.as_datatype_enum}


# --------------------------------------------------------------------------
# help
# --------------------------------------------------------------------------
def inproc(capsys, *args):
    """``npu_amp_tf.cli.main`` in this process (for the cheap cases: each
    subprocess pays a TensorFlow import)."""
    from npu_amp_tf import cli as cli_mod

    rc = cli_mod.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_every_subcommand_help_has_an_example(capsys):
    p = cli("--help")
    assert "example:" in p.stdout
    for sub in ("rewrite", "report", "check-align", "dump", "compare", "tune-mixlist", "profile", "demo"):
        with pytest.raises(SystemExit) as exc:
            inproc(capsys, sub, "--help")
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "example:" in out and f"npu-amp {sub}" in out, out


# --------------------------------------------------------------------------
# rewrite: each model kind in, the same kind out, plus the report JSON
# --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp_pb", "mlp_pbtxt"])
def test_rewrite_graphdef(models, tmp_path, kind):
    suffix = ".pbtxt" if kind == "mlp_pbtxt" else ".pb"
    out = tmp_path / f"amp{suffix}"
    p = cli("rewrite", models[kind], out)
    assert "low-precision FLOP share: 100.0%" in p.stdout
    gd = load_gd(out)
    # both matrix ops run in FP16 (on TF >= 2.16 the fusion pass may fold
    # fc1's MatMul+BiasAdd+Relu into one _FusedMatMul, which has FP16 kernels there)
    matmuls = [n.name for n in gd.node if n.op in ("MatMul", "_FusedMatMul")]
    assert len(matmuls) == 2 and set(matmuls) <= half_ops(gd)
    assert sum(n.op == "Cast" for n in gd.node) >= 2
    report = json.load(open(tmp_path / "amp.report.json"))
    assert report["decisions"]["fc2/MatMul"]["dtype"] == "float16"
    # numerically close to the original
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    a = tm.run_gd(load_gd(models[kind]), {"x:0": x}, "y:0")
    b = tm.run_gd(gd, {"x:0": x}, "y:0")
    np.testing.assert_allclose(a, b, atol=2e-2)


def test_rewrite_metagraph_keeps_train_op_and_signature(models, tmp_path):
    out = tmp_path / "amp.meta"
    cli("rewrite", models["meta"], out, "--precision-mode", "allow_mix_precision")
    mg = tf.compat.v1.MetaGraphDef()
    mg.ParseFromString(open(out, "rb").read())
    assert "serving_default" in mg.signature_def
    names = {n.name for n in mg.graph_def.node}
    assert "train" in names and "dense/MatMul" in names
    assert "dense/MatMul" in half_ops(mg.graph_def)
    # it still trains: import, initialise, run the train op
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.train.import_meta_graph(mg)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            x = np.ones((2, 8), np.float32)
            l0 = s.run("loss:0", {"x:0": x})
            for _ in range(3):
                s.run("train", {"x:0": x})
            assert s.run("loss:0", {"x:0": x}) < l0


def test_rewrite_saved_model(models, tmp_path):
    out = tmp_path / "saved_amp"
    p = cli("rewrite", models["saved"], out, "--signature", "serving_default")
    assert "low-precision FLOP share: 100.0%" in p.stdout
    assert (out / "saved_model.pb").exists() and (out / "variables").is_dir()
    assert json.load(open(out / "npu_amp_report.json"))["summary"]["functions_casts_inserted"] > 0
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32))
    ref = tf.saved_model.load(models["saved"]).signatures["serving_default"](x=x)["y"].numpy()
    got = tf.saved_model.load(str(out)).signatures["serving_default"](x=x)["y"].numpy()
    assert not np.array_equal(ref, got)  # FP16 rounding happened
    np.testing.assert_allclose(ref, got, rtol=2e-2, atol=5e-2)


# --------------------------------------------------------------------------
# report + HTML in headless Chromium
# --------------------------------------------------------------------------
def test_report_table_totals(models, tmp_path, capsys):
    p = cli("report", models["mlp_pb"], "--json", tmp_path / "r.json")
    assert re.search(r"fc2/MatMul\s+MatMul\s+float16\s+white\s+256", p.stdout), p.stdout
    assert "low-precision FLOP share:   100.0%" in p.stdout
    assert "casts inserted:" in p.stdout and "warnings (" in p.stdout
    p2 = inproc(capsys, "report", tmp_path / "r.json")  # a saved report prints the same totals
    assert "low-precision FLOP share:   100.0%" in p2.stdout


def test_report_html_renders_in_headless_chromium(models, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    html_path = tmp_path / "precision.html"
    cli("report", models["mlp_pb"], "--html", html_path)
    page = html_path.read_text()
    assert "<svg" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page  # self-contained: no CDN
    png = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
                    "--window-size=1000,800", html_path.as_uri()],
                   capture_output=True, timeout=120, check=True)
    w, h, bpp, rows = png_pixels(png)
    assert (w, h) == (1000, 800)
    # the FP16 nodes are drawn: the FP16 colour (#f28e2b) fills many pixels
    # below the header, the FP32 colour (#4e79a7) some
    def count(rgb):
        return sum(row[i:i + 3] == rgb for row in rows[250:] for i in range(0, len(row), bpp))
    assert count(bytes((0xf2, 0x8e, 0x2b))) > 2000
    assert count(bytes((0x4e, 0x79, 0xa7))) > 500


# --------------------------------------------------------------------------
# check-align
# --------------------------------------------------------------------------
def test_check_align(models, capsys):
    p = cli("check-align", models["mlp_pb"])
    assert "fc1/MatMul" in p.stdout and "unaligned" in p.stdout
    assert inproc(capsys, "check-align", models["mlp_pb"], "--strict").returncode == 1


# --------------------------------------------------------------------------
# dump + compare: the planted overflow is found
# --------------------------------------------------------------------------
def test_dump_and_compare_find_planted_overflow(models, tmp_path):
    d = tmp_path / "dump"
    p = cli("dump", models["ovf_pb"], "--inputs", models["ovf_in"], "--out", d)
    assert "dumped" in p.stdout
    fp32 = np.load(d / "fp32.npz")
    mixed = np.load(d / "mixed.npz")
    assert fp32["big/MatMul:0"].dtype == np.float32 and mixed["big/MatMul:0"].dtype == np.float16
    assert "x/CastToFp16:0" in mixed.files  # inserted nodes are dumped too
    assert np.isfinite(fp32["out:0"]).all() and not np.isfinite(mixed["out:0"]).all()

    p = cli("compare", d, "--fail-on-overflow", check=False)
    assert p.returncode == 3, p.stderr
    assert "OVERFLOW: first inf/NaN in the mixed graph at op 'big/MatMul' (MatMul, float16)" in p.stdout
    res = json.load(open(d / "compare.json"))
    assert res["overflow"]["node"] == "big/MatMul"
    assert res["overflow"]["fp32_absmax"] > tm.FP16_MAX
    rows = list(csv.DictReader(open(d / "compare.csv")))
    assert rows[0]["tensor"] == "big/MatMul:0" or int(rows[0]["mixed_nonfinite"]) > 0
    small = next(r for r in rows if r["tensor"] == "w_small:0")
    assert 0 < float(small["max_rel_err"]) < 1e-3  # FP16 rounding of a benign constant


def test_compare_no_overflow_on_benign_graph(models, tmp_path, capsys):
    d = tmp_path / "dump"
    assert inproc(capsys, "dump", models["mlp_pb"], "--inputs", models["mlp_in"], "--out", d,
                  "--no-progress").returncode == 0
    p = inproc(capsys, "compare", d)
    assert "no overflow" in p.stdout
    res = json.load(open(d / "compare.json"))
    assert res["overflow"] is None
    out = next(r for r in res["outputs"] if r["tensor"] == "y:0")
    assert out["cosine"] > 0.999 and 0 < out["max_rel_err"] < 0.05


# --------------------------------------------------------------------------
# tune-mixlist: the written mixlist fixes the graph
# --------------------------------------------------------------------------
def test_tune_mixlist_fixes_the_graph(models, tmp_path):
    fix = tmp_path / "fix.json"
    p = cli("tune-mixlist", models["ovf_pb"], "--inputs", models["ovf_in"], "--rtol", "1e-2", "--out", fix)
    assert "black-list addition: MatMul" in p.stdout, p.stdout
    mix = json.load(open(fix))
    assert mix == {"black-list": {"to-add": ["MatMul"]}}  # smallest: BatchMatMulV2 stays FP16
    feeds = {"x:0": tm.overflow_inputs()["x"]}
    ref = tm.run_gd(load_gd(models["ovf_pb"]), feeds, "out:0")
    # the default rewrite misses the tolerance...
    import npu_amp_tf
    default_gd, _ = npu_amp_tf.rewrite_graph(load_gd(models["ovf_pb"]), fetches=["out"])
    bad = tm.run_gd(default_gd, feeds, "out:0")
    assert not np.isfinite(bad).all()
    # ...the rewrite with the tuned mixlist meets it, still using FP16
    cli("rewrite", models["ovf_pb"], tmp_path / "fixed.pb", "--modify-mixlist", fix)
    gd = load_gd(tmp_path / "fixed.pb")
    got = tm.run_gd(gd, feeds, "out:0")
    assert np.max(np.abs(got - ref)) <= 1e-2 * np.max(np.abs(ref))
    assert "small/BatchMatMul" in half_ops(gd) and "big/MatMul" not in half_ops(gd)


# --------------------------------------------------------------------------
# profile: Chrome trace + summary
# --------------------------------------------------------------------------
def _check_chrome_trace(path):
    trace = json.load(open(path))
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for ev in events:
        assert ev["ph"] in ("X", "M", "N", "O", "D", "C", "s", "t", "f", "i", "B", "E"), ev
        assert isinstance(ev["pid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["dur"] >= 0 and ev["name"]
    return [e for e in events if e["ph"] == "X"]


def test_profile_model(models, tmp_path):
    out = tmp_path / "prof"
    p = cli("profile", models["mlp_pb"], "--steps", "3", "--out", out, "--inputs", models["mlp_in"])
    assert "low-precision compute:" in p.stdout and "Cast + TransData:" in p.stdout
    ops = _check_chrome_trace(out / "timeline.json")
    names = {e["args"].get("op") or e["name"] for e in ops}
    # TF's oneDNN rewrite (on by default on x86 Linux; TF 2.21 also for FP16)
    # runs the MatMul under its own kernel names
    matmuls = {"MatMul", "_MklMatMul", "_FusedMatMul", "_MklFusedMatMul", "_MklNativeFusedMatMul"}
    assert names & matmuls and "Cast" in names
    s = json.load(open(out / "summary.json"))
    assert s["steps"] == 3
    assert 0 < s["lp_compute_share"] < 1 and 0 < s["cast_transdata_share"] < 1
    assert s["peak_bytes"] > 0
    assert s["top_ops"] and any(t["op"] in matmuls and t["low_precision"] for t in s["top_ops"])


def test_profile_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, tensorflow as tf\n"
        "g = tf.Graph()\n"
        "with g.as_default():\n"
        "    x = tf.compat.v1.placeholder(tf.float32, [4, 8])\n"
        "    w = tf.compat.v1.get_variable('w', [8, 2])\n"
        "    loss = tf.reduce_sum(tf.matmul(x, w))\n"
        "    step = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)\n"
        "    with tf.compat.v1.Session() as s:\n"
        "        s.run(tf.compat.v1.global_variables_initializer())\n"
        "        for _ in range(6):\n"
        "            s.run(step, {x: np.ones((4, 8), np.float32)})\n")
    out = tmp_path / "prof"
    p = cli("profile", script, "--steps", "2", "--out", out)
    assert "steps traced:              2" in p.stdout
    ops = _check_chrome_trace(out / "timeline.json")
    assert any("MatMul" in (e["args"].get("op") or e["name"]) for e in ops)


# --------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------
def test_demo(tmp_path):
    out = tmp_path / "demo.json"
    p = cli("demo", "--steps", "8", "--json", out)
    assert "== loss-scale history" in p.stdout and "== loss, side by side" in p.stdout
    assert "white list" in p.stdout  # the report the grappler pass wrote
    res = json.load(open(out))
    assert len(res["fp32_loss"]) == len(res["amp_loss"]) == 8
    assert res["report"] is not None and res["report"]["summary"]["low_precision_nodes"] > 0
    assert any(ev[2] for ev in res["history"])  # the high initial scale overflowed...
    assert min(res["loss_scale"]) < max(res["loss_scale"])  # ...and came down
    assert res["amp_loss"][-1] < res["amp_loss"][0]  # and AMP training made progress
    assert res["fp32_loss"][-1] < res["fp32_loss"][0]


# --------------------------------------------------------------------------
# bad input: one clear line, non-zero exit
# --------------------------------------------------------------------------
def test_missing_file(tmp_path):
    assert_one_line_error(cli("report", tmp_path / "nope.pb", check=False), "does not exist", "nope.pb")


def test_unparsable_model(tmp_path):
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\x00\xffthis is not a graph" * 10)
    assert_one_line_error(cli("rewrite", bad, tmp_path / "o.pb", check=False), "bad.pb", "not a valid")


def test_unknown_signature(models, tmp_path, capsys):
    line = assert_one_line_error(inproc(capsys, "rewrite", models["saved"], tmp_path / "o", "--signature",
                                        "nope"), "unknown signature 'nope'")
    assert "serving_default" in line  # names what is available


def test_npz_key_not_a_placeholder(models, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, wrong=np.zeros((2, 16), np.float32))
    assert_one_line_error(cli("dump", models["ovf_pb"], "--inputs", bad, "--out", tmp_path / "d", check=False),
                          "key 'wrong' matches no placeholder", "x")


def test_npz_wrong_shape_and_missing_key(models, tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((3, 5), np.float32))
    assert_one_line_error(inproc(capsys, "tune-mixlist", models["ovf_pb"], "--inputs", bad, "--rtol", "0.01"),
                          "shape (3, 5)")
    empty = tmp_path / "empty.npz"
    np.savez(empty, **{"y:0": np.zeros(2, np.float32)})
    assert_one_line_error(inproc(capsys, "profile", models["mlp_pb"], "--inputs", empty, "--out", tmp_path / "p"),
                          "'y:0' matches no placeholder")


def test_bad_option_and_bad_mixlist(models, tmp_path, capsys):
    assert_one_line_error(inproc(capsys, "rewrite", models["mlp_pb"], tmp_path / "o.pb", "--graph-level", "9"),
                          "graph_level=", "0..3")
    mix = tmp_path / "m.json"
    mix.write_text('{"black-list": {"to-addd": ["MatMul"]}}')
    assert_one_line_error(inproc(capsys, "rewrite", models["mlp_pb"], tmp_path / "o.pb", "--modify-mixlist", mix),
                          "to-addd")
    assert_one_line_error(inproc(capsys, "rewrite", models["mlp_pb"], tmp_path / "o.pb", "--precision-mode",
                                 "fp8"), "invalid choice: 'fp8'")


def test_compare_not_a_dump(tmp_path, capsys):
    assert_one_line_error(inproc(capsys, "compare", tmp_path), "not a dump directory")


def test_usage_error_is_one_line(capsys):
    assert_one_line_error(inproc(capsys, "dump"), "required")
