"""Function bodies as ``Graph`` objects.

A ``FunctionDef`` body names tensors ``node:output_arg:k`` and reads its
arguments by bare name.  ``FunctionGraph`` turns it into the GraphDef form
every pass understands (``_Arg`` nodes in, ``_Retval`` nodes out, flat
``node:k`` references) and back again::

    FunctionDef f(x: float) -> y         FunctionGraph
      mm = MatMul(x, w:output:0)   <->     x = _Arg(T=float, index=0)
      ret y = mm:product:0                 mm = MatMul(x, w)
                                           y_RetVal = _Retval(mm, T=float, index=0)

The signature (argument names and dtypes) is never changed here: a pass that
wants another dtype at the boundary inserts a Cast inside the body, so every
caller stays valid.
"""
from __future__ import annotations

from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2

from . import registry
from .errors import GraphError
from .graph import Graph, parse_tensor


class FunctionGraph(Graph):
    """Editable body of one library function (see module docstring)."""

    def __init__(self, fdef: function_pb2.FunctionDef, library: dict):
        self.fdef = fdef
        self.fname = fdef.signature.name
        self._lib = library
        sig = fdef.signature
        gd = graph_pb2.GraphDef()
        body_names = {n.name for n in fdef.node_def}
        self._arg_node = {}
        for i, arg in enumerate(sig.input_arg[:]):
            dt = self._fixed_dtype(arg)
            name = arg.name if arg.name not in body_names else f"{arg.name}__arg"
            self._arg_node[arg.name] = name
            n = gd.node.add(op="_Arg", name=name)
            n.attr["T"].type = dt
            n.attr["index"].i = i
            shapes = fdef.arg_attr[i].attr.get("_output_shapes") if i in fdef.arg_attr else None
            if shapes is not None and shapes.list.shape:
                n.attr["_output_shapes"].CopyFrom(shapes)
        self._arg_by_node = {v: k for k, v in self._arg_node.items()}
        # output arg ranges of the body nodes, to flatten node:arg:k references
        ranges = {}
        for nd in fdef.node_def:
            r = registry.output_arg_ranges(nd, library)
            ranges[nd.name] = {a: s for a, s, _, _ in r} if r is not None else None
        self._ranges = ranges
        for nd in fdef.node_def:
            n = gd.node.add()
            n.CopyFrom(nd)
            del n.input[:]
            n.input.extend(self._flatten(i) for i in nd.input[:])
        taken = body_names | set(self._arg_node.values())
        self._ret_node = {}
        for j, arg in enumerate(sig.output_arg[:]):
            name = f"{arg.name}_RetVal"
            while name in taken:
                name += "_"
            taken.add(name)
            self._ret_node[arg.name] = name
            n = gd.node.add(op="_Retval", name=name)
            n.input.append(self._flatten(fdef.ret[arg.name]))
            n.attr["T"].type = self._fixed_dtype(arg)
            n.attr["index"].i = j
        super().__init__(gd, copy=False)
        self._functions = library

    @classmethod
    def with_body(cls, fdef: function_pb2.FunctionDef, library: dict,
                  body: graph_pb2.GraphDef) -> "FunctionGraph":
        """Function ``fdef`` with its body replaced by ``body``: a GraphDef in
        this class's form holding the same ``_Arg`` / ``_Retval`` nodes (by
        name, dtype and index) as ``FunctionGraph(fdef, library)`` makes, for
        example that graph after grappler inlined its calls.  The signature
        stays that of ``fdef``."""
        fg = cls(fdef, library)
        want = {n.name: (n.op, n.attr["T"].type, n.attr["index"].i)
                for n in fg.nodes.values() if fg.is_boundary(n)}
        got = {n.name: (n.op, n.attr["T"].type, n.attr["index"].i)
               for n in body.node if n.op in ("_Arg", "_Retval")}
        if want != got:
            raise GraphError(f"function '{fg.fname}': the new body's arguments/results "
                             f"differ from the signature's")
        gd = graph_pb2.GraphDef()
        gd.node.extend(body.node)
        Graph.__init__(fg, gd, copy=False)
        fg._functions = library
        fg._dirty = True
        return fg

    def _fixed_dtype(self, arg):
        if arg.type_attr or arg.type_list_attr or arg.number_attr:
            raise GraphError(
                f"function '{self.fname}' is polymorphic in argument '{arg.name}'; "
                "only instantiated (concrete-dtype) functions can be rewritten")
        return arg.type

    def _flatten(self, ref: str) -> str:
        if ref.startswith("^"):
            return ref
        parts = ref.split(":")
        if len(parts) == 1:
            if ref in self._arg_node:
                return self._arg_node[ref]
            raise GraphError(f"function '{self.fname}': input '{ref}' names no argument")
        if len(parts) == 2:  # "arg:k" is not valid in bodies but tolerate "node:k"
            return ref
        node, arg, k = parts[0], parts[1], int(parts[2])
        rng = self._ranges.get(node)
        if rng is None or arg not in rng:
            raise GraphError(
                f"function '{self.fname}': cannot resolve output '{arg}' of body node '{node}'")
        flat = rng[arg] + k
        return node if flat == 0 else f"{node}:{flat}"

    def _unflatten(self, ref: str) -> str:
        if ref.startswith("^"):
            return ref
        src, port, _ = parse_tensor(ref)
        if src in self._arg_by_node:
            return self._arg_by_node[src]
        node = self.nodes[src]
        ranges = registry.output_arg_ranges(node, self._lib)
        if ranges is None:
            raise GraphError(f"function '{self.fname}': cannot name outputs of '{src}' ({node.op})")
        for arg, start, count, _ in ranges:
            if start <= port < start + count:
                return f"{src}:{arg}:{port - start}"
        raise GraphError(f"function '{self.fname}': '{ref}' is past the outputs of {node.op}")

    def to_function_def(self) -> function_pb2.FunctionDef:
        out = function_pb2.FunctionDef()
        out.CopyFrom(self.fdef)
        del out.node_def[:]
        for name in self.nodes:
            n = self.nodes[name]
            if n.op == "_Arg" and name in self._arg_by_node:
                continue
            if n.op == "_Retval" and name in self._ret_node.values():
                continue
            nd = out.node_def.add()
            nd.CopyFrom(n)
            del nd.input[:]
            nd.input.extend(self._unflatten(i) for i in n.input[:])
        for arg, rname in self._ret_node.items():
            out.ret[arg] = self._unflatten(self.nodes[rname].input[0])
        return out

    def is_boundary(self, node: node_def_pb2.NodeDef) -> bool:
        return node.op in ("_Arg", "_Retval")


def function_graph(graph: Graph, fname: str) -> FunctionGraph:
    """The body of library function ``fname`` of ``graph`` as an editable
    :class:`FunctionGraph` (write it back with ``graph.set_function``)."""
    fdef = graph.functions.get(fname)
    if fdef is None:
        raise GraphError(f"function '{fname}' is not in the library; it has {sorted(graph.functions)[:10]}")
    return FunctionGraph(fdef, graph.functions)
