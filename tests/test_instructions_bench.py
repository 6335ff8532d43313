"""benchmarks/instructions.py (issue 17): instructions counted under callgrind.

The parser reads callgrind's tagged dumps; a missing valgrind is one clear
error; and one real run (a 1-layer BERT-like training graph, ~50 s under
valgrind) counts grappler's AMP pass and ours, repeatably, and resolves an A/B
that changes no output: ``grad_region.NATIVE_SEARCH`` runs the gradient
region's search in C++ instead of Python, so it must count fewer
instructions, with identical graphs.

(The A/B was ``grad_region.STOP_AT_DY`` until it saved only ~0.2%, and the
child inherited the suite's ``NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION``: every C++
search was also run in Python and counted, 1.7% apart between two runs on the
CI host.  The child now drops that cross-check, and NATIVE_SEARCH saves ~5% on
the 1-layer graph, outside any spread.)"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import instructions  # noqa: E402  (sets no environment at import)


def _dump(path, tag, total):
    head = "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 1\ncmd: python\npart: 1\n\n"
    desc = f"desc: Trigger: Client Request: {tag}\n" if tag else "desc: Trigger: Program termination\n"
    with open(path, "w") as f:
        f.write(head + "desc: I1 cache: \n" + desc + "\npositions: line\nevents: Ir\nsummary: "
                f"{total}\n\nfl=(1) x.c\nfn=(1) f\n0 {total}\n\ntotals: {total}\n")


def test_read_dumps(tmp_path):
    _dump(tmp_path / "cg.7.1", "bert|amp|0", 279_400_000)
    _dump(tmp_path / "cg.7.2", "bert|ours|on|1", 936_400_123)
    _dump(tmp_path / "cg.7", None, 5)  # the program-end dump: no tag, not a run
    (tmp_path / "other.txt").write_text("desc: Trigger: Client Request: x\nsummary: 1\n")
    assert instructions.read_dumps(str(tmp_path)) == {"bert|amp|0": 279_400_000, "bert|ours|on|1": 936_400_123}


def test_native_differences_names_the_outputs_that_differ():
    native = [{"graph": "bert", "digests": {"amp": "a", "ours|on": "b", "ours|off": "c"}}]
    counted = [{"graph": "bert", "digests": {"amp": "a", "ours|on": "x", "ours|off": "c"}}]
    assert instructions.native_differences(native, counted) == {"bert": ["ours|on"]}
    assert instructions.native_differences(native, native) == {"bert": []}
    # a configuration the native run lacks is no match either
    assert instructions.native_differences([{"graph": "bert", "digests": {}}], counted) == \
        {"bert": ["amp", "ours|off", "ours|on"]}


def test_missing_valgrind_is_one_clear_error(tmp_path, monkeypatch):
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool == "valgrind" else real(tool, *a, **k))
    with pytest.raises(SystemExit, match="'valgrind' is not on PATH.*Debian package 'valgrind'"):
        instructions.build_marker(str(tmp_path))


def test_bad_graph_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        instructions.main(["--graphs", "vgg"])
    assert "unknown graph 'vgg'; accepted: resnet50, bert" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"),
                    reason="valgrind (with valgrind/callgrind.h) is not installed")
def test_counts_repeat_and_resolve_an_exact_ab(capsys):
    (row,) = instructions.main(["--graphs", "bert", "--bert-layers", "1", "--runs", "2",
                                "--ab", "graph_passes.fusion.grad_region.NATIVE_SEARCH"])
    out = capsys.readouterr().out
    c = row["counts"]
    assert set(c) == {"amp", "ours|on", "ours|off"}, out
    # grappler's AMP pass on ~1.1k nodes is millions of instructions; ours runs Python on top of that
    assert c["amp"] > 1e6 and c["ours|on"] > c["amp"], out
    # repeatable: the same work counted twice in one process differs only by
    # Python's adaptive interpreter (code objects quicken and specialise after
    # some calls: the first counted run can still carry some of it); 0.01-0.3%
    # on a quiet or a loaded host (stop 56: 5 runs each), but one clean-clone CI
    # run (both lanes side by side) saw 1.3% once: the bound is 2%, which the
    # A/B below still resolves (the C++ search saves ~11% on this graph)
    spreads = []
    for label, runs in row["runs"].items():
        assert len(runs) == 2, (label, runs)
        spreads.append((max(runs) - min(runs)) / min(runs))
        assert spreads[-1] < 0.02, (label, runs)
    assert row["identical"], out
    # the A/B resolves: the C++ search counts fewer, by more than twice the
    # largest spread of any configuration (a difference the noise cannot make)
    saved = (c["ours|off"] - c["ours|on"]) / c["ours|off"]
    assert saved > 2 * max(spreads), (saved, spreads, out)
    # (the cross-check is the suite's, not the child's: with it, the C++ search
    # would count more than the Python one, as it did before the child dropped it)
    assert os.environ.get("NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION") == "1"
    # the rewrite counted is the native one: TF's oneDNN state pinned to the native run's
    # (valgrind's CPU has no AVX-512: unpinned, TF turns oneDNN off under it)
    from graph_passes import _tf
    assert row["onednn"] == _tf.onednn_enabled(), out
    assert row["native_identical"] and "identical to the native run's" in out, out


def test_stages_need_the_end_to_end_runs(capsys):
    with pytest.raises(SystemExit):
        instructions.main(["--graphs", "bert", "--stages", "--replay", "fusion"])
    assert "--stages: splits the end-to-end 'ours' runs; not with --ab or --replay" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"),
                    reason="valgrind (with valgrind/callgrind.h) is not installed")
def test_stages_split_ours_at_the_pipelines_timers(capsys):
    (row,) = instructions.main(["--graphs", "bert", "--bert-layers", "1", "--runs", "1", "--stages"])
    out = capsys.readouterr().out
    st = list(row["stages"])
    # the bridge enters first, the C++ assembly ends; the pipeline's stages and the default passes between
    assert st[0].startswith("C++ bridge before the callback") and st[-1] == "C++ assembly of the output", st
    for label in ("graph", "pass fusion", "pass precision", "serialize", "opdef_check"):
        assert label in st, (label, st)
    assert st.index("graph") < st.index("pass fusion") < st.index("pass precision") < st.index("serialize"), st
    assert all(n > 0 for n in row["stages"].values()), row["stages"]
    # a 1-layer BERT-like graph has layer norms to fuse and matmuls to paint: both passes do real work
    assert row["stages"]["pass fusion"] > 1e6 and row["stages"]["pass precision"] > 1e6, out


def test_prefused_needs_the_end_to_end_runs(capsys):
    with pytest.raises(SystemExit):
        instructions.main(["--graphs", "bert", "--prefused", "--replay", "fusion"])
    assert "--prefused: counts the end-to-end runs of ours on the pre-fused graph; not with --ab or " \
           "--replay" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"),
                    reason="valgrind (with valgrind/callgrind.h) is not installed")
def test_prefused_counts_ours_on_the_graph_our_fusion_pass_leaves(capsys):
    (row,) = instructions.main(["--graphs", "bert", "--bert-layers", "1", "--runs", "1", "--prefused"])
    out = capsys.readouterr().out
    c = row["counts"]
    # grappler's AMP pass on the graph itself, ours on the pre-fused one (and nothing else)
    assert set(c) == {"amp", "ours-prefused"}, out
    assert c["amp"] > 1e6 and c["ours-prefused"] > 1e6, out
    assert "ours-prefused / amp:" in out
    # the pre-fused input is built the same way in the native and the counted child
    assert row["native_identical"] and "identical to the native run's" in out, out
