"""The options module: one place that names, types, defaults and validates."""
import json

import pytest
import tensorflow as tf

from npu_amp_tf import options as O
from npu_amp_tf.errors import MixlistError, NpuAmpError, OptionError


def test_defaults_and_derived():
    o = O.Options.from_kwargs()
    assert o.precision == "allow_mix_precision" and o.low_dtype == "float16"
    assert o.graph_level == 2 and o.format_mode == "origin"
    assert o.init_loss_scale == 128.0 and o.incr_every_n_steps == 1000
    assert o.decr_every_n_nan_or_inf == 2 and o.max_loss_scale == 2.0 ** 24


@pytest.mark.parametrize("v2,canon", sorted(O.PRECISION_MODES_V2.items()))
def test_precision_mode_v2_names(v2, canon):
    assert O.Options.from_kwargs(precision_mode_v2=v2).precision == canon


def test_alias_and_bf16():
    assert O.Options.from_kwargs(precision_mode="allow_mix_precision_fp16").precision == "allow_mix_precision"
    assert O.Options.from_kwargs(precision_mode="allow_mix_precision_bf16").low_dtype == "bfloat16"


def test_bad_mode_names_key_value_and_every_valid_value():
    with pytest.raises(OptionError) as ei:
        O.Options.from_kwargs(precision_mode="fp8_please")
    msg = str(ei.value)
    assert "precision_mode='fp8_please'" in msg
    for mode in O.PRECISION_MODES:
        assert mode in msg
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, NpuAmpError)


def test_both_modes_is_an_error():
    with pytest.raises(OptionError, match="precision_mode and precision_mode_v2 are both set"):
        O.Options.from_kwargs(precision_mode="force_fp16", precision_mode_v2="fp16")


@pytest.mark.parametrize("kw,needle", [
    (dict(graph_level=7), "graph_level=7"),
    (dict(graph_level="two"), "expected an integer"),
    (dict(incr_ratio=1.0), "incr_ratio=1.0"),
    (dict(decr_ratio=1.5), "decr_ratio=1.5"),
    (dict(init_loss_scale=0.5), "init_loss_scale=0.5"),
    (dict(format_mode="NCHW"), "'origin', 'NC1HWC0'"),
    (dict(fail_on_error="maybe"), "expected a boolean"),
    (dict(allreduce_dtype="int8"), "allreduce_dtype"),
    (dict(no_such_key=1), "unknown parameter 'no_such_key'"),
])
def test_bad_values(kw, needle):
    with pytest.raises(OptionError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        O.Options.from_kwargs(**kw)


def test_parameter_map_round_trip():
    cfg = tf.compat.v1.ConfigProto()
    entry = cfg.graph_options.rewrite_options.custom_optimizers.add()
    entry.name = "NpuAmpOptimizer"
    entry.parameter_map["precision_mode"].s = b"force_fp16"
    entry.parameter_map["graph_level"].i = 3
    entry.parameter_map["custom_black_list"].s = b"Tanh, Sigmoid"
    o = O.Options.from_parameter_map(entry.parameter_map)
    assert o.precision == "force_fp16" and o.graph_level == 3
    assert o.custom_black_list == ("Tanh", "Sigmoid")
    # write back into another map and read again
    cfg2 = tf.compat.v1.ConfigProto()
    e2 = cfg2.graph_options.rewrite_options.custom_optimizers.add()
    o.fill_parameter_map(e2.parameter_map)
    assert O.Options.from_parameter_map(e2.parameter_map) == o
    entry.parameter_map["precision_mode"].s = b"nope"
    with pytest.raises(OptionError, match="ConfigProto parameter_map"):
        O.Options.from_parameter_map(entry.parameter_map)
    # loss-scale keys are not graph-rewrite keys
    with pytest.raises(OptionError, match="unknown parameter 'init_loss_scale'"):
        O.Options.from_kwargs(_groups=("rewrite",), init_loss_scale=4)


def test_env_override_wins_and_is_recorded(monkeypatch):
    monkeypatch.setenv("NPU_AMP_PRECISION_MODE", "must_keep_origin_dtype")
    o = O.Options.from_kwargs(precision_mode="force_fp16")
    assert o.precision == "must_keep_origin_dtype"
    assert o.env_overrides == {"precision_mode": "must_keep_origin_dtype"}
    monkeypatch.setenv("NPU_AMP_GRAPH_LEVEL", "9")
    with pytest.raises(OptionError, match="environment NPU_AMP_GRAPH_LEVEL"):
        O.Options.from_kwargs()


def write(tmp_path, data, name="mix.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_mixlist_file_ok(tmp_path):
    path = write(tmp_path, {"black-list": {"to-add": ["Tanh"]}, "white-list": {"to-remove": ["MatMul"]}})
    o = O.Options.from_kwargs(modify_mixlist=path)
    assert o.mixlist["black-list"]["to-add"] == ("Tanh",)


@pytest.mark.parametrize("data,needle", [
    ("{not json", "is not valid JSON"),
    ({"grey-list": {"to-add": ["Tanh"]}}, "unknown key 'grey-list'"),
    ({"black-list": {"add": ["Tanh"]}}, "unknown key 'black-list.add'"),
    ({"black-list": {"to-add": "Tanh"}}, "must be an array"),
    ({"black-list": {"to-add": ["Tanh"]}, "white-list": {"to-add": ["Tanh"]}}, "op 'Tanh' is put in two lists"),
    ([1, 2], "top level must be an object"),
])
def test_bad_mixlist_files(tmp_path, data, needle):
    path = write(tmp_path, data)
    with pytest.raises(MixlistError) as ei:
        O.Options.from_kwargs(modify_mixlist=path)
    assert needle in str(ei.value)
    if needle != "op 'Tanh' is put in two lists":
        assert path in str(ei.value)


def test_missing_mixlist_file(tmp_path):
    with pytest.raises(MixlistError, match="cannot be read"):
        O.Options.from_kwargs(modify_mixlist=str(tmp_path / "absent.json"))


def test_custom_list_conflicts_with_mixlist(tmp_path):
    path = write(tmp_path, {"white-list": {"to-add": ["Exp"]}})
    with pytest.raises(MixlistError, match="custom_black_list"):
        O.Options.from_kwargs(modify_mixlist=path, custom_black_list=["Exp"])


def test_cli_arguments_are_generated():
    import argparse
    p = O.add_cli_arguments(argparse.ArgumentParser())
    ns = p.parse_args(["--precision-mode", "force_fp32", "--graph-level", "1"])
    o = O.Options.from_cli(ns)
    assert o.precision == "force_fp32" and o.graph_level == 1


def test_markdown_table_lists_every_option():
    table = O.markdown_table()
    for name in O.OPTIONS:
        assert f"`{name}`" in table
    # the memory levers (GE keys acting on the session config) are documented there too
    for name in ("memory_optimize", "buffer_optim"):
        assert f"| `{name}` | str (GE key) |" in table


def test_readme_parameter_table_is_current():
    """The README's table is generated from OPTIONS (`make readme-table`)."""
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split(O.TABLE_START, 1)[1].split(O.TABLE_END, 1)[0].strip()
    assert block == O.markdown_table(), "README parameter table is stale: run `make readme-table`"
