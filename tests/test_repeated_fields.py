"""The plugin iterates protobuf repeated fields through a slice (issue 17).

upb's repeated containers (``NodeDef.input``, ``TensorShapeProto.dim``,
``AttrValue.list.type``...; protobuf 4.25 on TF 2.15, 7.x on TF 2.21) define
no ``__iter__`` and no ``__contains__``: Python iterates them by index until
``__getitem__`` raises ``IndexError``, and formatting that exception costs
~2,200 instructions per loop (callgrind, ``benchmarks/instructions.py``):
12,991 such loops, 29 M instructions, 3% of the whole grappler callback on the
12-layer BERT training graph.  ``node.input[:]`` is a plain list (one C call,
no exception).  The AST check below keeps new per-node loops on slices;
loops over ``GraphDef.node`` (one exception per graph) are left alone.
"""
from __future__ import annotations

import ast
import pathlib

from tensorflow.core.framework import attr_value_pb2, node_def_pb2, tensor_shape_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: repeated fields of per-node messages (NodeDef, TensorShapeProto, OpDef)
FIELDS = {"input", "dim", "input_arg", "output_arg"}
#: repeated fields of ``AttrValue.list`` (``attr.list.type``...)
LIST_FIELDS = {"type", "shape", "tensor", "func", "s", "i", "f", "b"}
#: calls that iterate their positional arguments
ITERATING = {"list", "tuple", "set", "frozenset", "enumerate", "zip", "map", "filter", "filterfalse", "sorted",
             "any", "all", "sum", "min", "max", "join", "fromkeys", "compress", "Counter", "chain", "islice",
             "accumulate", "extend", "update"}


def _is_field(e) -> bool:
    if not isinstance(e, ast.Attribute):
        return False
    if e.attr in LIST_FIELDS:
        return isinstance(e.value, ast.Attribute) and e.value.attr == "list"
    return e.attr in FIELDS


def iterated_fields(source: str) -> list[int]:
    """Line numbers where ``source`` iterates (or tests membership in) a
    repeated field directly rather than a slice of it."""
    lines = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.For, ast.comprehension)) and _is_field(n.iter):
            lines.append(n.iter.lineno)
        elif isinstance(n, ast.Compare):
            lines += [c.lineno for op, c in zip(n.ops, n.comparators)
                      if isinstance(op, (ast.In, ast.NotIn)) and _is_field(c)]
        elif isinstance(n, ast.Call):
            fn = n.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name in ITERATING:
                lines += [a.lineno for a in n.args if _is_field(a)]
    return sorted(lines)


def test_the_check_finds_each_form():
    src = ("for i in node.input: pass\n"
           "x = [d.size for d in s.dim]\n"
           "y = ref in node.input\n"
           "z = list(a.list.type)\n"
           "w = enumerate(od.input_arg)\n"
           "ok = [i for i in node.input[:]] + list(a.list.i[:]) + [n for n in gd.node]\n"
           "ok2 = len(node.input), node.input[0], x.type, list(t.shape)\n")
    assert iterated_fields(src) == [1, 2, 3, 4, 5]


def test_no_direct_iteration_in_the_plugin():
    found = []
    for pkg in ("graph_passes", "npu_amp_tf"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{ln}" for ln in iterated_fields(path.read_text())]
    assert not found, ("iterate a repeated protobuf field through a slice (node.input[:]): upb's containers "
                       "have no __iter__, each loop ends in a formatted IndexError: " + ", ".join(found))


def test_slices_are_the_fields_values():
    """The slice is a list equal to the field, on this TF's protobuf."""
    node = node_def_pb2.NodeDef(name="n", op="Mul", input=["a", "b:1", "^c"])
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in (2, -1)])
    attr = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=[1, 19], i=[1, 2, 2, 1]))
    for field, want in ((node.input, ["a", "b:1", "^c"]), (attr.list.type, [1, 19]), (attr.list.i, [1, 2, 2, 1])):
        got = field[:]
        assert type(got) is list and got == want
    assert [d.size for d in shape.dim[:]] == [2, -1]
    assert node.input[1:] == ["b:1", "^c"]
