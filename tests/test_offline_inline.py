"""The offline path sees what a Session sees (issue 13, part 5): `npu-amp
report` on a Keras SavedModel (one function per layer) inlines the calls
first, so casts are not put at every layer boundary and the converted ops are
in the drawn graph.  Compared with the session path (enable() + predict) on
the same model, in the same test."""
import json

import numpy as np

import npu_amp_tf
from npu_amp_tf import cli


def _keras_saved_model(k2, path):
    L = k2.layers
    m = k2.Sequential([L.Input((8, 8, 3)), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(),
                       L.ReLU(), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
                       L.MaxPooling2D(), L.Flatten(), L.Dense(4)])
    m.save(str(path))
    return m


def _session_casts(m):
    npu_amp_tf.bridge.clear_reports()
    npu_amp_tf.enable()
    try:
        m.predict(np.zeros((2, 8, 8, 3), np.float32), verbose=0)
    finally:
        npu_amp_tf.disable()
    reps = [r for r in npu_amp_tf.bridge.last_reports()
            if "predict_function" in r["graph"] and r["status"] == "rewritten"]
    assert reps
    s = reps[0]["report"]["summary"]
    return s["casts_inserted"] + s.get("functions_casts_inserted", 0)


def test_report_on_keras_saved_model_inlines_like_a_session(k2, tmp_path, capsys):
    m = _keras_saved_model(k2, tmp_path / "sm")
    out = tmp_path / "rep.json"
    html = tmp_path / "map.html"
    assert cli.main(["report", str(tmp_path / "sm"), "--json", str(out), "--html", str(html)]) == 0
    rep = json.loads(out.read_text())
    s = rep["summary"]
    offline = s["casts_inserted"] + s.get("functions_casts_inserted", 0)
    session = _session_casts(m)
    # the offline report and the session agree within 10% (+1 for tiny counts)
    assert abs(offline - session) <= max(1, 0.1 * session), (offline, session)
    # the converted ops are in the main graph (drawn), not hidden in functions
    assert s["low_precision_nodes"] >= 4 and s["lp_flop_share"] == 1.0
    assert "float16" in html.read_text()
