"""``Graph``: a mutable view over a ``GraphDef`` with the indexes passes need.

* ``graph.nodes``: name -> NodeDef (graph order kept);
* ``graph.consumers(name)``: who reads a node's outputs (data and control);
* :func:`parse_tensor` is the one helper that understands ``node``,
  ``node:1`` and ``^ctrl``;
* add / remove / replace-all-uses / insert-on-edge / :meth:`Graph.set_op`
  keep the indexes true (consumers, and op type -> nodes for
  :meth:`Graph.nodes_of_type`); ``graph.version`` counts the mutations made
  through them;
* :meth:`Graph.topo_order` handles v1 loops (``NextIteration`` back edges);
  it sorts in C++ over integer arrays kept from one sort to the next (from
  the C++ index's edge arrays at first) and patched for the consumer lists
  the edit methods changed since (issue 17q: :meth:`Graph._kahn_arrays`);
* :meth:`Graph.validate` reports duplicate names, dangling inputs, cycles
  outside loops and edge dtype mismatches;
* :meth:`Graph.to_graph_def` round-trips byte-for-byte when nothing changed.

Function bodies (``graph.library``) are edited through
:func:`graph_passes.functions.function_graph`, which gives a ``Graph`` whose
inputs are ``_Arg`` nodes and outputs ``_Retval`` nodes, and
:meth:`Graph.set_function` which writes it back.  Mutate inputs and op types
only through the methods here (``set_input``, ``set_op``...), or call
:meth:`Graph.reindex` afterwards (:meth:`Graph.index_problems` says whether
the indexes still agree with the nodes).
"""
from __future__ import annotations

import functools
import logging
import struct
from array import array
from bisect import bisect_right
from collections import defaultdict, deque
from itertools import accumulate, chain, compress, filterfalse, repeat
from operator import is_not, itemgetter, methodcaller
from typing import NamedTuple

import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2

from . import registry
from .errors import GraphError

log = logging.getLogger("npu_amp_tf")

LOOP_BACK_OPS = frozenset({"NextIteration", "RefNextIteration"})
_is_control = methodcaller("startswith", "^")
_first = itemgetter(0)

#: Kahn's order in C++ over integer arrays (issue 17f):
#: ``fn(n, counts, readers, back) -> array of node indices or None``, the rule
#: of :meth:`Graph._compute_topo_order` (see ``NpuAmpKahnOrder`` in
#: custom_ops/grappler_bridge.cc).  graph_passes never imports npu_amp_tf:
#: the package installs it when its library is loaded; None: Python sorts.
native_kahn = None

#: (issue 17) the nodes a graph makes share one protobuf arena
#: (:meth:`Graph.blank_node`); False: each NodeDef has its own (the
#: reference; the same graphs)
SHARED_ARENA = True


@functools.lru_cache(maxsize=1 << 17)
def parse_tensor(ref: str) -> tuple[str, int, bool]:
    """``"a"`` -> (a, 0, False); ``"a:2"`` -> (a, 2, False); ``"^a"`` -> (a, -1, True).
    (Memoised: every pass parses the same few thousand references many times.)"""
    if ref.startswith("^"):
        return ref[1:], -1, True
    name, sep, port = ref.rpartition(":")
    if sep and port.isdigit():
        return name, int(port), False
    return ref, 0, False


def _colocation_kept(node, names):
    """None when every ``loc:@X`` entry of ``node``'s ``_class`` names a node
    in ``names`` (bytes); else the entries to keep."""
    a = node.attr.get("_class")
    if a is None:
        return None
    vals = a.list.s
    if all(v[5:] in names for v in vals if v.startswith(b"loc:@")):
        return None  # (the usual case: nothing to drop)
    return [v for v in vals if not v.startswith(b"loc:@") or v[5:] in names]


def _drop_colocation(node, keep):
    if keep:
        del node.attr["_class"].list.s[:]
        node.attr["_class"].list.s.extend(keep)
    else:
        del node.attr["_class"]


class _EncodedNames:
    """``b in names``, for a ``loc:@X`` entry's bytes, over a container of
    node names (str: the graph's dict, a set): what ``{name.encode() for
    name in nodes}`` answers without encoding and hashing every name (9k on
    a BERT-12 training graph) to check the few colocation entries a graph
    has."""

    __slots__ = ("_nodes",)

    def __init__(self, nodes):
        self._nodes = nodes

    def __contains__(self, b) -> bool:
        try:
            return b.decode() in self._nodes  # (UTF-8 both ways: equal bytes iff equal names)
        except UnicodeDecodeError:
            return False


def _split_bytes(data: bytes, sep: bytes, maxsplit: int) -> list:
    """``data.split(sep, maxsplit)`` for a one-byte ``sep`` through
    ``bytes.find`` (a memchr scan; ``split`` compares byte by byte, 3.6M
    instructions for a Keras ResNet50 index): the same parts."""
    out, at = [], 0
    for _ in range(maxsplit):
        k = data.find(sep, at)
        if k < 0:
            break
        out.append(data[at:k])
        at = k + 1
    out.append(data[at:])
    return out


def packed_ints(values, count: int, dtype=np.int64):
    """The ``count`` ints of ``values`` as a numpy array of ``dtype`` (int32
    or int64): ``struct.pack`` converts each with one C call (~0.45x the
    instructions of ``np.fromiter``, which packs each through numpy's generic
    item assignment; ``array()`` parses each).  Raises as the iteration does
    (a KeyError of a ``map``), or ``struct.error`` when ``values`` does not
    hold ``count`` ints that fit."""
    code = "i" if np.dtype(dtype).itemsize == 4 else "q"
    return np.frombuffer(struct.pack(f"{count}{code}", *values), dtype)


def drop_dangling_colocation(nodes) -> int:
    """Remove ``_class: loc:@X`` colocation entries naming a node X that is
    not among ``nodes`` (NodeDefs, edited in place); ``import_graph_def``
    rejects a graph that keeps them (a pass removed X, or grappler inlined it
    away).  Returns how many entries were dropped."""
    nodes = list(nodes)
    names = _EncodedNames({n.name for n in nodes})
    dropped = 0
    for n in nodes:
        keep = _colocation_kept(n, names)
        if keep is None:
            continue
        dropped += len(n.attr["_class"].list.s) - len(keep)
        _drop_colocation(n, keep)
    return dropped


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@functools.lru_cache(maxsize=4096)
def _node_field_header(k: int) -> bytes:
    """A GraphDef ``node`` entry's tag and length (field 1, length-delimited)."""
    return b"\x0a" + _varint(k)


#: a NodeDef's deterministic bytes
_serialize_det = methodcaller("SerializeToString", deterministic=True)


def tensor_name(node: str, port: int = 0) -> str:
    """Canonical reference: ``node`` for port 0, ``node:k`` otherwise, ``^node`` for -1."""
    if port < 0:
        return "^" + node
    return node if port == 0 else f"{node}:{port}"


class GraphPatch(NamedTuple):
    """A rewritten graph as a patch of its input (:meth:`Graph.serialize_patch`)."""

    order: array  #: int32 per output node: its index in the input, or -1 (next of payload)
    payload: bytes  #: serialized GraphDef: the created / edited nodes, library, versions
    nodes: int  #: the output's node count


class Graph:
    """Mutable graph with a name index and a consumers index."""

    def __init__(self, graph_def: graph_pb2.GraphDef | bytes | None = None, copy: bool = True,
                 index=None):
        """``index``: the indexes of ``graph_def`` precomputed in C++ (the
        format of ``GraphIndexText`` in custom_ops/grappler_bridge.cc; bytes,
        or a callable returning them or None); used when it describes this
        graph, else (and by default) they are built here.  Bytes handed over
        before their signature classes (the magic's "+l") come as a pair
        (bytes, a callable returning the classes, array('i'), or None), read
        the first time :meth:`signature_classes` is asked."""
        if graph_def is None:
            graph_def = graph_pb2.GraphDef()
        elif isinstance(graph_def, (bytes, bytearray)):
            gd = graph_pb2.GraphDef()
            gd.ParseFromString(bytes(graph_def))
            graph_def, copy = gd, False
        elif copy:
            gd = graph_pb2.GraphDef()
            gd.CopyFrom(graph_def)
            graph_def = gd
        self._gd = graph_def
        self._scratch = None  # (the arena of the nodes made here: blank_node)
        self.nodes: dict[str, node_def_pb2.NodeDef] = {}
        self.duplicates: list[str] = []
        self.version = 0
        if callable(index):
            index = index()
        late = None
        if isinstance(index, tuple):
            index, late = index
        self._classes = None  # (names, int32 signature classes) from the C++ index
        #: (issue 17) (names, callable) for classes still to be read (an index whose magic ends in "+l")
        self._classes_late = None
        # (issue 17q) the Kahn sort's input kept as integer arrays between
        # sorts: node ids are ``_seq``'s ranks (``_id_name``: id -> name,
        # None once removed); see :meth:`_kahn_arrays`
        self._id_name = []
        self._id_dead = bytearray()  # per id: 1 once removed
        self._kbase = None  # (counts per id, flat reader ids) as of the last sort, or None
        self._kblob = None  # the C++ index's edge arrays, until the first sort uses them
        self._kdirty = set()  # ids whose consumer lists changed since then
        self._kdnames = set()  # (the same, by name: resolved to ids at the next sort)
        #: (issue 17) (the names' order, the node ids in that order) of the last
        #: native sort (:meth:`topo_ranks`), or None
        self._topo_ids = None
        adopted = index is not None and self._adopt_index(graph_def, index, late)
        #: True when the indexes came from ``index`` (C++), not from reindex()
        self.prebuilt_index = adopted
        if not adopted:
            for n in graph_def.node:
                if n.name in self.nodes:
                    self.duplicates.append(n.name)
                self.nodes[n.name] = n
        self.library = graph_def.library
        self.versions = graph_def.versions
        self._functions = {f.signature.name: f for f in self.library.function}
        #: how many times an out-of-sync consumers index was found and rebuilt
        self.index_repairs = 0
        #: names of the nodes added through this object (by passes): only
        #: these may be removed by ``cleanup`` when dead
        self.created: set[str] = set()
        #: bumped by every mutation made through this object's methods (``version``)
        #: names of the nodes edited in place through this object's methods
        #: (set_input, add_control_input, set_op) or declared with touch();
        #: with ``created``, what :meth:`changed_nodes` gives the OpDef guard
        self.modified: set[str] = set()
        #: the same edits in the order they were made (a name again for every
        #: edit; see :meth:`edits_since`)
        self._edit_log: list[str] = []
        #: the names of the nodes removed through this object's methods, in
        #: order (see :meth:`removed_since`)
        self._removed_log: list[str] = []
        self._all_modified = False
        # (issue 17, :attr:`patch_records`) the nodes whose every edit since
        # the input is recorded (:meth:`note_retyped`, :meth:`add_and_rewire`),
        # the records in order, and the modified nodes edited otherwise
        # (:meth:`touch`, :meth:`set_input`, ...): sent whole
        self._rec: set[str] = set()
        self._rec_attrs: list = []
        self._rec_inputs: list = []
        self._full: set[str] = set()
        if not adopted:
            self.reindex()
        self._dirty = False
        #: (issue 17u) ``_seq`` still ranks the input's nodes by their input
        #: index (no :meth:`reindex` since): :meth:`serialize_patch` reads it
        self._seq_is_base = True
        #: the input graph's node names in its order (serialize_patch)
        self._base_names = None if self.duplicates else list(self.nodes)

    #: (issue 17u) :meth:`_adopt_index` maps the C++ index's int32 sections
    #: to names and consumer pairs through numpy object arrays; False: through
    #: Python maps over the arrays (the reference; equal indexes)
    numpy_adopt = True

    # ------------------------------------------------------------ indexes
    def _adopt_index(self, graph_def, blob, late=None) -> bool:
        """Take the names, op-type, consumers indexes and the topological
        order from ``blob`` (see ``index`` in :meth:`__init__`): what
        :meth:`reindex` and :meth:`_compute_topo_order` would build, without
        their per-edge Python work.  False (nothing set) when ``blob`` does not
        describe ``graph_def``.  ``late``: the callable giving the classes of
        an index handed over without them (see :meth:`__init__`)."""
        try:
            head, names_b, ops_b, srcs_b, binary = _split_bytes(bytes(blob), b"\x03", 4)
            fields = head.split(b"\x02")
            # (issue 17m: NPUIDX5 shares the consumers' (reader, position) tuples)
            magic, count, cycle, nsrc, *ntab = fields
            # (issue 17: "+l", the signature classes left out, read later through `late`)
            no_classes = magic.endswith(b"+l")
            if no_classes:
                magic = magic[:-2]
            # (issue 17: "+s", the consumed names' node indexes after the classes)
            has_src = magic.endswith(b"+s")
            if has_src:
                magic = magic[:-2]
            n, ns = int(count), int(nsrc)
            t = int(ntab[0]) if magic == b"NPUIDX5" and len(ntab) == 1 else None
            gnodes = graph_def.node
            if (magic not in (b"NPUIDX3", b"NPUIDX4", b"NPUIDX5") or n != len(gnodes)
                    or (t is None) != (magic != b"NPUIDX5") or (ntab and t is None)):
                return False
            ncls = n if magic != b"NPUIDX3" and not no_classes else 0  # (issue 17f: signature classes)
            names = names_b.decode("ascii").split("\x01") if n else []
            nodes = dict(zip(names, gnodes))
            if len(names) != n or len(nodes) != n:
                return False
            # the same graph: the names agree (spot checks; both sides come
            # from the same serialized bytes)
            for k in (*range(0, n, max(1, n // 32)), n - 1) if n else ():
                if gnodes[k].name != names[k]:
                    return False
            ops = ops_b.decode("ascii").split("\x01") if n else []
            srcs = srcs_b.decode("ascii").split("\x01") if ns else []
            ints = array("i")
            if ints.itemsize != 4 or len(srcs) != ns:
                return False
            ints.frombytes(binary)
            no = len(ops)
            op_counts, src_counts = ints[:no], ints[no:no + ns]
            e = sum(src_counts)
            at = no + ns
            # the edge section: E readers and E positions, or (NPUIDX5) the t
            # distinct (reader, position) pairs and E indices into them
            edge_ints = 2 * e if t is None else 2 * t + e
            if (len(ints) != at + 2 * n + edge_ints + ncls + (ns if has_src else 0) or sum(op_counts) != n
                    or (has_src and magic == b"NPUIDX3")):
                return False
            nget = names.__getitem__
            if self.numpy_adopt:
                # (issue 17u) the id -> name / pair maps as numpy object
                # arrays indexed by the int32 sections (no Python int per id)
                a32 = np.frombuffer(binary, np.int32) if len(binary) else np.zeros(0, np.int32)
                name_arr = np.fromiter(names, object, n)
                nget = lambda sec: name_arr[sec].tolist()  # noqa: E731
                members = nget(a32[at:at + n])
            # (C-level loops: no Python statement per node or edge)
            else:
                members = list(map(nget, ints[at:at + n]))
            ends = list(accumulate(op_counts))
            by_op = dict(zip(ops, map(dict.fromkeys, map(members.__getitem__,
                                                         map(slice, [0, *ends[:-1]], ends)))))
            at_e = at + n
            if self.numpy_adopt:
                if t is None:
                    pairs = list(zip(nget(a32[at_e:at_e + e]), a32[at_e + e:at_e + 2 * e].tolist()))
                else:
                    table = np.fromiter(zip(nget(a32[at_e:at_e + t]), a32[at_e + t:at_e + 2 * t].tolist()),
                                        object, t)
                    pairs = table[a32[at_e + 2 * t:at_e + 2 * t + e]].tolist()
            elif t is None:
                pairs = list(zip(map(nget, ints[at_e:at_e + e]), ints[at_e + e:at_e + 2 * e]))
            else:
                # one tuple per distinct pair, shared by the edges (a reader's
                # control edges from many sources: one (reader, -1))
                table = list(zip(map(nget, ints[at_e:at_e + t]), ints[at_e + t:at_e + 2 * t]))
                pairs = list(map(table.__getitem__, ints[at_e + 2 * t:at_e + 2 * t + e]))
            ends = list(accumulate(src_counts))
            cons = defaultdict(list, zip(srcs, map(pairs.__getitem__, map(slice, [0, *ends[:-1]], ends))))
            at_o = at_e + edge_ints
            order = nget(a32[at_o:at_o + n]) if self.numpy_adopt else list(map(nget, ints[at_o:at_o + n]))
            if len(by_op) != no or len(cons) != ns:
                return False
        except (ValueError, IndexError, UnicodeDecodeError, TypeError):
            return False
        self.nodes = nodes
        self._consumers = cons
        self._by_op = by_op
        self._seq = dict(zip(names, range(n)))
        self._next_seq = n
        self._has_cycle = cycle == b"1"
        self._topo_cache = (order, bool(n) and self._has_cycle)
        self._topo_ids = (order, a32[at_o:at_o + n]) if self.numpy_adopt else None
        self._classes = (names, ints[at_o + n:at_o + n + ncls]) if ncls else None
        self._classes_late = (names, late) if no_classes and n and callable(late) else None
        # (issue 17q) the edge arrays, for the first sort after edits
        self._id_name = list(names)
        self._id_dead = bytearray(n)
        src_at = at_o + n + ncls if has_src else None
        self._kblob = (ints, no, ns, at_e, t, e, srcs, n, src_at)
        self._kbase = None
        self._kdirty = set()
        self._kdnames = set()
        self.version += 1
        return True

    def signature_classes(self):
        """{name: signature class} from the C++ index (see ``GraphIndexText``
        in custom_ops/grappler_bridge.cc), for the nodes left as they were
        when it was built: nodes of one class have the same op and equal
        :func:`registry.signature_key`; classes are ints >= 0 (nodes of an op
        the C++ registry does not know are left out).  Nodes created, edited
        through this object's methods or declared with :meth:`touch` are left
        out too (a pass that edits a node's attrs in place declares it, as the
        OpDef guard needs: ``Pass.tracks_edits``); None without a C++ index
        or after :meth:`touch_all`.  A fresh dict: the caller may drop
        entries (nodes it edits itself)."""
        if self._classes_late is not None:  # (issue 17: handed over after the index)
            names, fetch = self._classes_late
            self._classes_late = None
            got = fetch()
            if got is not None and len(got) == len(names):
                self._classes = (names, got)
        cl = self._classes
        if cl is None or self._all_modified:
            return None
        names, classes = cl
        pairs = zip(names, classes)
        if -1 in classes:  # (the nodes without a class left out: C-level, in order)
            pairs = compress(pairs, map((-1).__lt__, classes))  # (v >= 0)
        out = dict(pairs)
        for name in self.created:
            out.pop(name, None)
        for name in self.modified:
            out.pop(name, None)
        return out

    def reindex(self):
        """Rebuild the consumers and op-type indexes (after editing
        ``node.input`` or ``node.op`` by hand)."""
        cons: dict[str, list[tuple[str, int]]] = defaultdict(list)
        by_op: dict[str, dict[str, None]] = {}
        seq = {}
        pt = parse_tensor
        for k, (name, n) in enumerate(self.nodes.items()):
            seq[name] = k
            ops = by_op.get(n.op)
            if ops is None:
                ops = by_op[n.op] = {}
            ops[name] = None
            i = 0
            for inp in n.input[:]:
                src, _, ctrl = pt(inp)
                cons[src].append((name, -1 if ctrl else i))
                i += 1
        self._consumers = cons
        self._by_op = by_op
        self._seq = seq  # name -> rank in graph order (new nodes rank last)
        self._seq_is_base = False
        self._next_seq = len(seq)
        self._id_name = list(seq)
        self._id_dead = bytearray(len(seq))
        self._kbase = self._kblob = None
        self._kdirty = set()
        self._kdnames = set()
        self._dirty = True
        self._topo_cache = None
        self.version += 1

    def reindex_ops(self):
        """Rebuild the op-type index alone (after ``node.op`` edits made
        without :meth:`set_op`; the manager does it after a pass that does
        not declare ``tracks_edits``)."""
        by_op: dict[str, dict[str, None]] = {}
        for name, n in self.nodes.items():
            ops = by_op.get(n.op)
            if ops is None:
                ops = by_op[n.op] = {}
            ops[name] = None
        self._by_op = by_op
        self._topo_cache = None  # LOOP_BACK_OPS may have changed

    def index_problems(self) -> list[str]:
        """Where the consumers / op-type indexes disagree with the nodes
        (empty when every edit went through this object's methods)."""
        out = []
        for name, n in self.nodes.items():
            if name not in self._by_op.get(n.op, ()):
                out.append(f"op index: node '{name}' ({n.op}) is not indexed under its op type "
                           "(node.op changed without Graph.set_op)")
        for op, names in self._by_op.items():
            for name in names:
                n = self.nodes.get(name)
                if n is None or n.op != op:
                    out.append(f"op index: '{name}' is indexed as {op} but is "
                               f"{'gone' if n is None else n.op}")
        want = defaultdict(list)
        for name, n in self.nodes.items():
            for i, inp in enumerate(n.input[:]):
                src, _, ctrl = parse_tensor(inp)
                want[src].append((name, -1 if ctrl else i))
        for src in set(want) | {k for k, v in self._consumers.items() if v}:
            if sorted(want.get(src, ())) != sorted(self._consumers.get(src, ())):
                out.append(f"consumers index: the readers of '{src}' are out of sync "
                           "(node inputs edited without Graph.reindex())")
        return out

    def consumers(self, name: str, port: int | None = None, control: bool = True):
        """[(consumer_name, input_index)]; index -1 marks a control edge.
        With ``port`` set, only data consumers of that output."""
        out = self._consumers.get(name, ())
        if port is None:
            if control and self.fast_consumers:
                return list(out)  # (issue 17j: the same list, copied in C)
            return [c for c in out if control or c[1] >= 0]
        res = []
        nodes = self.nodes
        if self.fast_consumers:
            # (issue 17j) an input equal to the canonical reference needs no
            # parse: its port is that of the reference, found once
            ref = name if port == 0 else f"{name}:{port}"
            same = parse_tensor(ref)[1] == port
            for c in out:
                idx = c[1]
                if idx < 0:
                    continue
                inp = nodes[c[0]].input[idx]
                if same if inp == ref else parse_tensor(inp)[1] == port:
                    res.append(c)
            return res
        for cname, idx in out:
            if idx < 0:
                continue
            if parse_tensor(nodes[cname].input[idx])[1] == port:
                res.append((cname, idx))
        return res

    #: (issue 17j) :meth:`consumers` with ``port`` compares each input with
    #: the canonical reference before parsing it, and copies the whole list
    #: in C for ``port=None, control=True``; False: parse every one, filter
    #: every entry (the reference; the same lists)
    fast_consumers = True

    def data_inputs(self, node) -> list[str]:
        return [i for i in node.input[:] if not i.startswith("^")]

    def input_node(self, node, index: int):
        return self.nodes.get(parse_tensor(node.input[index])[0])

    @property
    def functions(self) -> dict:
        return self._functions

    # ----------------------------------------------------------- dtypes
    def output_dtypes(self, node) -> list[int] | None:
        return registry.output_dtypes(node, self._functions)

    def input_dtypes(self, node) -> list[int] | None:
        return registry.input_dtypes(node, self._functions)

    def tensor_dtype(self, ref: str) -> int | None:
        src, port, ctrl = parse_tensor(ref)
        if ctrl or src not in self.nodes:
            return None
        dts = self.output_dtypes(self.nodes[src])
        if dts is None or port >= len(dts):
            return None
        return dts[port]

    # -------------------------------------------------------- mutations
    def unique_name(self, base: str) -> str:
        if base not in self.nodes:
            return base
        k = 1
        while f"{base}_{k}" in self.nodes:
            k += 1
        return f"{base}_{k}"

    def add_node(self, node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
        name = node.name  # (one str object for every index: the sort's names are the dict's keys)
        if name in self.nodes:
            raise GraphError(f"cannot add node '{name}': a node with that name exists")
        self.nodes[name] = node
        self.created.add(name)
        self._edit_log.append(name)
        marked = self._kdnames
        for i, inp in enumerate(node.input[:]):
            src, _, ctrl = parse_tensor(inp)
            self._consumers[src].append((name, -1 if ctrl else i))
            marked.add(src)
        ops = self._by_op.get(node.op)
        if ops is None:
            ops = self._by_op[node.op] = {}
        ops[name] = None
        k = self._next_seq
        self._seq[name] = k
        self._kdirty.add(k)
        self._id_name.append(name)
        self._id_dead.append(0)
        self._next_seq = k + 1
        self._dirty = True
        self._topo_cache = None
        self.version += 1
        return node

    def blank_node(self, op: str = "", name: str = "", device: str = "") -> node_def_pb2.NodeDef:
        """(issue 17) A NodeDef holding only ``op``, ``name`` and ``device``,
        for a node the graph is about to hold (:meth:`add_node` it): one
        protobuf arena per graph holds them all
        (``_scratch``'s), where a NodeDef made on its own has an arena of its
        own, ~3 allocations for a Cast.  Python's protobuf (upb) calls
        ``malloc_trim(0)`` after every 10,000 arena blocks the process frees,
        which hands the heap's free pages back and makes the next callback
        fault them in again (~12k faults, ~3-4 ms on BERT-12); a graph's own
        arenas were ~1,450 of the ~2,000 blocks a BERT-12 callback freed."""
        if not SHARED_ARENA:
            return node_def_pb2.NodeDef(op=op, name=name, device=device)
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = graph_pb2.GraphDef()
        return scratch.node.add(op=op, name=name, device=device)

    def new_node(self, op: str, name: str, inputs=(), attrs: dict | None = None,
                 device: str = "") -> node_def_pb2.NodeDef:
        """Create and add a node.  ``attrs`` values may be AttrValue protos,
        DataType ints (for keys named like type attrs: use ``registry``
        helpers), or python scalars."""
        from tensorflow.core.framework import attr_value_pb2

        node = self.blank_node(op, name, device)
        node.input.extend(inputs)
        for k, v in (attrs or {}).items():
            if isinstance(v, attr_value_pb2.AttrValue):
                node.attr[k].CopyFrom(v)
            elif isinstance(v, bool):
                node.attr[k].b = v
            elif isinstance(v, int):
                node.attr[k].i = v
            elif isinstance(v, float):
                node.attr[k].f = v
            elif isinstance(v, (str, bytes)):
                node.attr[k].s = v.encode() if isinstance(v, str) else v
            else:
                raise GraphError(f"attr '{k}' of new node '{name}': unsupported value {v!r}")
        return self.add_node(node)

    def remove_node(self, name: str, force: bool = False):
        """Remove a node.  Refuses (GraphError) while it still has consumers,
        unless ``force``."""
        node = self.nodes.get(name)
        if node is None:
            return
        if not force and self._consumers.get(name):
            raise GraphError(
                f"cannot remove node '{name}': still read by {sorted({c for c, _ in self._consumers[name]})}")
        marked = self._kdnames
        for inp in node.input[:]:
            src, _, _ = parse_tensor(inp)
            lst = self._consumers.get(src)
            if lst:
                self._consumers[src] = [c for c in lst if c[0] != name]
            marked.add(src)
        del self.nodes[name]
        self._removed_log.append(name)
        self.created.discard(name)
        self._consumers.pop(name, None)
        ops = self._by_op.get(node.op)
        if ops is not None:
            ops.pop(name, None)
        self._forget_id(name)
        self._dirty = True
        self._topo_cache = None
        self.version += 1

    #: (issue 17j) :meth:`remove_nodes` removes a batch in one sweep over
    #: the inputs' consumer lists; False: one :meth:`remove_node` per name
    #: (the reference: both leave the same nodes, indexes and ``version``)
    batch_remove = True

    def remove_nodes(self, names, force: bool = False, inputs=None):
        """Remove the nodes named in ``names`` (in order; names already gone
        or repeated are skipped), as ``remove_node(name, force)`` for each
        would: the same nodes, consumers / op-type indexes, ``created`` and
        ``version`` (one bump per node removed).  Without ``force`` (or with
        :data:`batch_remove` False) it is that loop; with it, each input's
        consumer list is filtered once for the whole batch instead of once per
        removed reader (a fused LayerNorm removes ~80 nodes).

        Returns the names the removed nodes read (data and control inputs,
        each once).  ``inputs``: {name: its node's ``input`` as a list} the
        caller read already (not edited since), for some of ``names``."""
        if not force or not self.batch_remove:
            read = {}
            for name in names:
                node = self.nodes.get(name)
                if node is not None:
                    read.update(dict.fromkeys(parse_tensor(i)[0] for i in node.input[:]))
                self.remove_node(name, force=force)
            return list(read)
        nodes = self.nodes
        gone = {}
        for name in names:
            node = nodes.get(name)
            if node is not None and name not in gone:
                gone[name] = node
        if not gone:
            return []
        cons = self._consumers
        # remove_node(x) rewrites, per input source of x, the source's list
        # when it is non-empty, and pops x's own list: the end state is every
        # list of a non-removed source filtered of the removed readers (a
        # list left non-empty-then-empty, or already empty, is [] either way)
        # and the removed nodes' own lists gone
        srcs = {}
        pt = parse_tensor
        known = inputs.get if inputs else None
        for name, node in gone.items():
            ins = known(name) if known is not None else None
            for inp in (ins if ins is not None else node.input[:]):
                srcs[pt(inp)[0]] = None
        self._kdnames.update(srcs)
        for src in srcs:
            if src in gone:
                continue
            lst = cons.get(src)
            if lst:
                cons[src] = [c for c in lst if c[0] not in gone]
        by_op = self._by_op
        created = self.created
        forget = self._forget_id
        self._removed_log.extend(gone)
        for name, node in gone.items():
            del nodes[name]
            created.discard(name)
            cons.pop(name, None)
            ops = by_op.get(node.op)
            if ops is not None:
                ops.pop(name, None)
            forget(name)
        self._dirty = True
        self._topo_cache = None
        self.version += len(gone)
        return list(srcs)

    def touch(self, *names: str):
        """Declare nodes edited in place (attrs) outside this object's methods."""
        self.modified.update(names)
        self._edit_log.extend(names)
        self._full.update(names)

    def note_retyped(self, groups):
        """Declare nodes edited in place by setting type attrs and nothing
        else: ``groups`` is ``[(names, items)]``, ``items`` a tuple of
        ``(attr, serialized AttrValue)`` set on every node of ``names``.
        :meth:`touch`'s bookkeeping, and (issue 17) the edits kept as
        records, so that :meth:`serialize_patch` may send these nodes as
        their edits (:attr:`patch_records`).  A node also touched, or edited
        by another method, is sent whole.  Empty ``items``: nodes that count
        as changed (the OpDef guard checks them) though they are as this
        graph was built (edits made before the parse)."""
        names = list(chain.from_iterable(map(itemgetter(0), groups)))
        self.modified.update(names)
        self._edit_log.extend(names)
        self._rec.update(names)
        self._rec_attrs.extend(groups)

    def touch_all(self):
        """Declare that any node may have been edited in place (a pass that
        does not track its edits): :meth:`changed_nodes` then gives None."""
        self._all_modified = True

    #: (issue 17) :meth:`created_in_order` sorts the live created nodes by
    #: rank (their graph order) instead of scanning every node; False: the
    #: scan (the reference; the same list)
    ranked_created = True

    def created_in_order(self) -> list[str]:
        """The live nodes of :attr:`created`, in graph order (``nodes``'
        order).  Ranks are given in increasing order as nodes are put in
        (see :meth:`_dense_ranks`), so sorting by rank gives graph order; a
        node put in by hand has no rank: then every node is scanned."""
        created, nodes = self.created, self.nodes
        if self.ranked_created:
            seq = self._seq
            try:
                return sorted([n for n in created if n in nodes], key=seq.__getitem__)
            except KeyError:
                pass
        return [n for n in nodes if n in created]

    def changed_nodes(self) -> set[str] | None:
        """Nodes that may differ from the graph this object was built from:
        created or edited through its methods or declared with :meth:`touch`;
        None when :meth:`touch_all` was called (anything may have)."""
        if self._all_modified:
            return None
        nodes = self.nodes
        return {n for n in self.created if n in nodes} | {n for n in self.modified if n in nodes}

    def edits_since(self, mark: int) -> tuple[list[str], int]:
        """(names of the nodes created or edited since ``mark``, in order and
        with repeats, the new mark); ``mark`` 0 is this object's creation.
        The same edits as :meth:`changed_nodes` (removals are not edits: a
        removed node's name may appear, check ``nodes``), so a caller that
        checked them all once checks only the new ones next time.  None
        instead of the names after :meth:`touch_all`."""
        log = self._edit_log
        if self._all_modified:
            return None, len(log)
        return log[mark:], len(log)

    def edit_marks(self) -> tuple[int, int] | None:
        """The current marks of :meth:`edits_since` and :meth:`removed_since`
        (nothing copied), or None after :meth:`touch_all`."""
        if self._all_modified:
            return None
        return len(self._edit_log), len(self._removed_log)

    def removed_since(self, mark: int) -> tuple[list[str], int]:
        """(names of the nodes removed since ``mark``, in order, the new
        mark); ``mark`` 0 is this object's creation.  With
        :meth:`edits_since`, what a caller keeping its own copy of the
        graph (the gradient-region search's C++ mirror) must update."""
        log = self._removed_log
        return log[mark:], len(log)

    def set_op(self, name: str, op: str):
        """Change a node's op type in place (keeps :meth:`nodes_of_type` true;
        the caller fixes the attrs the new op needs)."""
        node = self.nodes[name]
        if node.op == op:
            return
        ops = self._by_op.get(node.op)
        if ops is not None:
            ops.pop(name, None)
        node.op = op
        self.modified.add(name)
        self._full.add(name)
        self._edit_log.append(name)
        ops = self._by_op.get(op)
        if ops is None:
            ops = self._by_op[op] = {}
        ops[name] = None
        self._dirty = True
        self._topo_cache = None  # LOOP_BACK_OPS may have changed
        self.version += 1

    def set_input(self, node_name: str, index: int, new_ref: str):
        node = self.nodes[node_name]
        old = node.input[index]
        if old == new_ref:
            return
        self.modified.add(node_name)
        self._full.add(node_name)
        self._edit_log.append(node_name)
        osrc, _, octrl = parse_tensor(old)
        lst = self._consumers.get(osrc)
        key = (node_name, -1 if octrl else index)
        marked = self._kdnames
        marked.add(osrc)
        indexed = lst is not None  # (checked, not caught: a caught AttributeError costs its message)
        if indexed:
            try:
                lst.remove(key)
            except ValueError:
                indexed = False
        if not indexed:
            if osrc not in self.nodes:  # the source was force-removed: nothing indexed
                node.input[index] = new_ref
                nsrc, _, nctrl = parse_tensor(new_ref)
                self._consumers[nsrc].append((node_name, -1 if nctrl else index))
                marked.add(nsrc)
                self._dirty = True
                self._topo_cache = None
                self.version += 1
                return
            # someone edited node.input by hand without reindex(): the index
            # cannot be trusted anywhere, so rebuild it (and say so)
            node.input[index] = new_ref
            self.index_repairs += 1
            log.warning("npu_amp_tf: the consumers index of the graph was out of sync at edge "
                        "'%s' -> '%s':%d (node inputs edited without Graph.reindex()); rebuilt it",
                        old, node_name, index)
            self.reindex()
            return
        node.input[index] = new_ref
        nsrc, _, nctrl = parse_tensor(new_ref)
        self._consumers[nsrc].append((node_name, -1 if nctrl else index))
        marked.add(nsrc)
        self._dirty = True
        self._topo_cache = None
        self.version += 1

    def add_control_input(self, node_name: str, src: str):
        node = self.nodes[node_name]
        ref = "^" + src
        if ref in node.input[:]:
            return
        self.modified.add(node_name)
        self._full.add(node_name)
        self._edit_log.append(node_name)
        node.input.append(ref)
        self._consumers[src].append((node_name, -1))
        self._kdnames.add(src)
        self._topo_cache = None
        self.version += 1

    def replace_all_uses(self, old_ref: str, new_ref: str, exclude=()) -> int:
        """Point every data consumer of tensor ``old_ref`` at ``new_ref``.
        Returns the number of edges changed."""
        src, port, _ = parse_tensor(old_ref)
        exclude = set(exclude)
        changed = 0
        for cname, idx in list(self.consumers(src, port=port)):
            if cname in exclude:
                continue
            self.set_input(cname, idx, new_ref)
            changed += 1
        return changed

    def insert_on_edge(self, consumer: str, index: int, op: str, name: str,
                       attrs: dict | None = None, extra_inputs=()) -> node_def_pb2.NodeDef:
        """``src -> consumer[index]`` becomes ``src -> new -> consumer[index]``."""
        src_ref = self.nodes[consumer].input[index]
        dev = self.nodes[consumer].device
        new = self.new_node(op, name, [src_ref, *extra_inputs], attrs, device=dev)
        self.set_input(consumer, index, name)
        return new

    # -------------------------------------------------------------- order
    def topo_order(self, strict: bool = False) -> list[str]:
        """Kahn order.  Edges out of NextIteration are loop back edges and are
        ignored.  Nodes on a cycle come last (or GraphError when ``strict``).
        Cached until the next mutation; the caller gets a fresh list."""
        cached = self._topo_cache
        if cached is not None and not (strict and cached[1]):
            return list(cached[0])
        order = self._compute_topo_order(strict)
        self._topo_cache = (order, len(order) and self._has_cycle)
        return list(order)

    def topo_positions(self) -> dict:
        """name -> index in :meth:`topo_order` (cached with it; do not mutate)."""
        cached = self._topo_cache
        if cached is None:
            self.topo_order()
            cached = self._topo_cache
        if len(cached) < 3:
            order = cached[0]
            cached = self._topo_cache = (*cached[:2], dict(zip(order, range(len(order)))))
        return cached[2]

    def sort_by_topo(self, names: list) -> None:
        """(issue 17) Sort ``names`` (graph nodes) in place by their index in
        :meth:`topo_order`, as ``names.sort(key=topo_positions().__getitem__)``
        does, from the native sort's ranks per node id when it made the
        cached order (:meth:`topo_ranks`: no dict of every node built for a
        few names); KeyError for a name not in the graph."""
        cached = self._topo_cache
        if cached is None:
            self.topo_order()
            cached = self._topo_cache
        # (no dict of positions built yet: the sort's ranks of these names alone)
        ranks = self.topo_ranks(cached[0]) if self.ids_without_lookups and len(cached) < 3 else None
        if ranks is not None:
            at = ranks[packed_ints(map(self._seq.__getitem__, names), len(names))].tolist()
            if min(at, default=0) >= 0:  # (else an id the order does not hold: the positions say)
                names[:] = [n for _, n in sorted(zip(at, names))]
                return
        names.sort(key=self.topo_positions().__getitem__)

    def topo_ranks(self, order):
        """(issue 17) Per node id (``_seq``) its index in the cached
        :meth:`topo_order` ``order`` (the cache's own list, as
        :meth:`topo_positions` numbers it), an int32 array (-1: a removed id),
        from the node ids the native sort ordered (no name looked up); None
        when the cache no longer holds ``order`` or it did not come from the
        native sort (the Python sort, a cycle)."""
        cached, ids = self._topo_cache, self._topo_ids
        if (cached is None or cached[0] is not order or cached[1] or ids is None or ids[0] is not order
                or len(ids[1]) != len(order)):
            return None
        ranks = np.full(self._next_seq, -1, np.int32)
        ranks[ids[1]] = np.arange(len(ids[1]), dtype=np.int32)
        return ranks

    def nodes_of_type(self, ops) -> list[str]:
        """Names of the nodes whose op is in ``ops`` (a type name or a
        collection of them), in graph order; from the op-type index, so the
        cost is the number of such nodes, not the graph's size."""
        if isinstance(ops, str):
            ops = (ops,)
        by_op = self._by_op
        found = []
        for op in ops:
            names = by_op.get(op)
            if names:
                found.extend(names)
        if len(found) > 1:
            seq = self._seq
            found.sort(key=seq.__getitem__)
        return found

    def op_types(self) -> list[str]:
        """The op types of the graph's nodes (from the op-type index)."""
        return [op for op, names in self._by_op.items() if names]

    def count_of_type(self, op: str) -> int:
        """How many nodes have op type ``op`` (from the op-type index)."""
        return len(self._by_op.get(op, ()))

    #: sort in C++ when :data:`native_kahn` is installed (False: the Python
    #: reference below, which tests compare it with)
    native_sort = True

    def _compute_topo_order(self, strict: bool) -> list[str]:
        self._has_cycle = False
        nodes = self.nodes
        back = set(self.nodes_of_type(LOOP_BACK_OPS))
        consumers = self._consumers
        fn = native_kahn
        if fn is not None and self.native_sort and nodes:
            order = self._native_topo_order(fn, back)
            if order is not None:
                if len(order) < len(nodes):
                    self._has_cycle = True
                    seen = set(order)
                    rest = [n for n in nodes if n not in seen]
                    if strict:
                        raise GraphError(f"graph has a cycle outside loops through: {rest[:10]}")
                    order.extend(rest)
                return order
        # in-degree = inputs from nodes of the graph that are not loop back
        # edges, counted through the consumers index (the same edges)
        indeg = dict.fromkeys(nodes, 0)
        for src, lst in consumers.items():
            if src not in nodes or src in back:
                continue
            for cname, _ in lst:
                if cname in indeg:
                    indeg[cname] += 1
        ready = deque(n for n, d in indeg.items() if d == 0)
        order = []
        while ready:
            name = ready.popleft()
            order.append(name)
            if name in back:
                continue
            for cname, _ in consumers.get(name, ()):
                d = indeg.get(cname)
                if d is not None:
                    d -= 1
                    indeg[cname] = d
                    if d == 0:
                        ready.append(cname)
        if len(order) < len(self.nodes):
            self._has_cycle = True
            seen = set(order)
            rest = [n for n in self.nodes if n not in seen]
            if strict:
                raise GraphError(f"graph has a cycle outside loops through: {rest[:10]}")
            order.extend(rest)
        return order

    #: (issue 17q) keep the sort's integer arrays between sorts (from the
    #: C++ index's edge arrays at first) and rebuild only the consumer lists
    #: edited since the last sort (:meth:`_kahn_arrays`); False: build them
    #: from every node's consumer list on each sort (the reference; the same
    #: arrays up to removed nodes' empty slots, the same order)
    incremental_sort = True

    def _native_topo_order(self, fn, back):
        """The nodes Kahn's rule orders (cycle nodes left out), from
        :data:`native_kahn` over this graph's consumers index as integer
        arrays (built with C-level loops: no Python statement per edge);
        None when it refuses."""
        if self.incremental_sort:
            got = self._kahn_arrays()
            if got is not None:
                at = self._live_kahn_ids(fn, back, got)
                if at is None:
                    return None
                # ids -> names in numpy: no Python int per id (~4x faster at 48k nodes)
                order = np.array(self._id_name, dtype=object)[at].tolist()
                self._topo_ids = (order, at)
                return order
        names = list(self.nodes)
        n = len(names)
        lists = list(map(self._consumers.get, names, repeat((), n)))
        counts = array("i", map(len, lists))
        idx = dict(zip(names, range(n)))
        readers = array("i", map(idx.get, map(_first, chain.from_iterable(lists)), repeat(-1)))
        flags = array("B", bytes(n))
        for name in back:
            flags[idx[name]] = 1
        res = fn(n, counts, readers, flags)
        if res is None:
            return None
        return list(map(names.__getitem__, res))

    def kahn_positions(self):
        """(issue 17) The Kahn position of every node id (``_seq``) as an
        int32 array indexed by id (removed ids: -1), from :data:`native_kahn`
        over the incremental sort arrays, without the names' order that
        :meth:`topo_order` builds (nor caching it); None when the sort cannot
        run so, or the graph has a cycle outside loops (every node is then
        not ordered).  The same order as :meth:`topo_order`."""
        fn = native_kahn
        if fn is None or not self.native_sort or not self.incremental_sort or not self.nodes:
            return None
        got = self._kahn_arrays()
        if got is None:
            return None
        at = self._live_kahn_ids(fn, self.nodes_of_type(LOOP_BACK_OPS), got)
        if at is None or len(at) != len(self.nodes):
            return None  # (refused, or a cycle: its nodes are not ordered)
        pos = np.full(len(got[0]), -1, np.int32)
        pos[at] = np.arange(len(at), dtype=np.int32)
        return pos

    def _live_kahn_ids(self, fn, back, got):
        """The live node ids in Kahn's order (an int32 array; cycle nodes
        left out) from :data:`native_kahn` ``fn`` over ``got`` (what
        :meth:`_kahn_arrays` returned), ``back`` the loop back-edge sources;
        None when ``fn`` refuses."""
        counts, readers, ids = got
        flags = array("B", bytes(len(counts)))
        for name in back:
            flags[ids[name]] = 1
        res = fn(len(counts), counts, readers, flags)
        if res is None:
            return None
        at = np.asarray(res, np.int32)
        if len(counts) != len(self.nodes):  # (removed nodes' ids: empty, unread)
            at = at[np.frombuffer(self._id_dead, np.uint8)[at] == 0]
        return at

    def _forget_id(self, name):
        """Drop a removed node's id (its slot in the sort's arrays empties)."""
        k = self._seq.pop(name, None)
        if k is not None:
            self._kdirty.add(k)
            if k < len(self._id_name):
                self._id_name[k] = None
                self._id_dead[k] = 1

    def _kahn_arrays(self):
        """(counts, readers, ids): the input of :data:`native_kahn` over node
        ids ``0.._next_seq-1`` (``ids``: ``_seq``, name -> id, increasing in
        graph order): ``counts[i]`` consumer entries of node ``i`` in its
        consumer list's order, flattened in ``readers`` as reader ids (-1: a
        reader that is no node); a removed node's id has none and nothing
        reads it, so it is ordered alone and dropped after.  Kahn's FIFO
        order over these equals the one over the current nodes renumbered
        ``0..n-1`` (the same relative order, the same lists).

        Kept from the previous sort and patched for the ids whose consumer
        lists changed since: every edit method marks them (``_kdirty``: new
        and removed ids; ``_kdnames``: the sources whose lists it appended
        to or filtered, by name, resolved here), and their lists are read
        again here, so an entry appended by hand to a list of a node added
        since the last sort (the fusion pass's index repair) is seen too;
        the first time, from the C++ index's edge arrays (``_kblob``) or from
        every consumer list.  None when the ids do not describe ``nodes`` (a
        node put in by hand: the caller renumbers)."""
        ids = self._seq
        id_name = self._id_name
        n = self._next_seq
        if len(id_name) != n or len(self._id_dead) != n or len(ids) != len(self.nodes):
            return None
        cons = self._consumers
        dirty = self._kdirty
        marked = self._kdnames
        if marked:  # (names of removed nodes or no node: their ids, if any, are marked)
            dirty.update(filter(functools.partial(is_not, None), map(ids.get, marked)))
            marked.clear()
        base = self._kbase
        if base is None and self._kblob is not None:
            base = self._kbase = self._kbase_from_blob()
            self._kblob = None
        if base is None:
            lists = list(map(cons.get, id_name, repeat((), n)))
            counts = array("i", map(len, lists))
            readers = array("i", map(ids.get, map(_first, chain.from_iterable(lists)), repeat(-1)))
            dirty.clear()
            self._kbase = (counts, readers)
            return counts, readers, ids
        bc, br = base
        nb = len(bc)
        if nb < n:
            dirty.update(range(nb, n))
        if not dirty:
            return bc, br, ids
        # the dirty ids' lists, read again (one C-level pass over them all),
        # put in place of their old segments: np.insert puts each new
        # segment before the first kept edge of a later id, in id order
        dl = sorted(dirty)
        dirty.clear()
        names = list(map(id_name.__getitem__, dl))
        lists = list(map(cons.get, names, repeat((), len(dl))))
        lens = packed_ints(map(len, lists), len(dl))
        new = packed_ints(map(ids.get, map(_first, chain.from_iterable(lists)), repeat(-1)),
                          int(lens.sum()), np.int32)
        c = np.frombuffer(bc, np.int32) if nb else np.zeros(0, np.int32)
        r = np.frombuffer(br, np.int32) if len(br) else np.zeros(0, np.int32)
        d = np.array(dl, np.int64)
        old = d[d < nb]
        starts = np.zeros(nb + 1, np.int64)
        np.cumsum(c, out=starts[1:])
        gone = np.zeros(nb, np.bool_)
        gone[old] = True
        kept = r[~np.repeat(gone, c)] if len(old) else r
        # position in ``kept`` of id k's segment: its base start less the
        # dropped edges of dirty ids before it (all of them for a new id)
        dropped = np.cumsum(c[old].astype(np.int64)) - c[old]
        at = np.full(len(dl), len(kept), np.int64)
        at[:len(old)] = starts[old] - dropped
        readers = np.insert(kept, np.repeat(at, lens), new) if len(new) else kept
        counts = np.zeros(n, np.int32)
        counts[:nb] = c
        counts[d] = lens
        out_c, out_r = array("i"), array("i")
        out_c.frombytes(counts.tobytes())
        out_r.frombytes(readers.astype(np.int32, copy=False).tobytes())
        self._kbase = (out_c, out_r)
        return out_c, out_r, ids

    #: (issue 17) :meth:`_kbase_from_blob` takes each consumed name's node
    #: index from the C++ index ("+s") instead of looking every name up in
    #: ``_seq``; False: the lookups (the reference; the same arrays once the
    #: marked ids are read again, :meth:`_kahn_arrays`)
    index_src_nodes = True

    def _kbase_from_blob(self):
        """The sort's arrays of the graph as the C++ index saw it (ids
        ``0..n-1``: its node order), regrouped from its per-source edge
        sections by node id.  Ids whose lists changed since are marked
        already (``_kdirty`` / ``_kdnames``): a source that is no longer a
        node, or a new node of a removed one's name, has a marked id, so its
        edges here are dropped or replaced."""
        ints, no, ns, at_e, t, e, srcs, n0, src_at = self._kblob
        a = np.frombuffer(ints, np.int32)
        sc = a[no:no + ns]
        if t is None:
            er = a[at_e:at_e + e]
        else:
            er = a[at_e:at_e + t][a[at_e + 2 * t:at_e + 2 * t + e]]
        if src_at is not None and self.index_src_nodes:
            # (issue 17) the index's own node index per consumed name: a name
            # removed since keeps its old id, which is marked (its segment is
            # read again), as is a name's new id
            sn = a[src_at:src_at + ns].astype(np.int64)
        else:
            sn = packed_ints(map(self._seq.get, srcs, repeat(-1)), ns).copy()
            sn[sn >= n0] = -1
        ss = np.zeros(ns + 1, np.int64)
        np.cumsum(sc, out=ss[1:])
        # the slots in node id order (ids are distinct: a scatter, no sort)
        slot_at = np.full(n0, -1, np.int64)
        live = np.flatnonzero(sn >= 0)
        slot_at[sn[live]] = live
        so = slot_at[slot_at >= 0]
        lens = sc[so].astype(np.int64)
        new = np.cumsum(lens) - lens
        idx = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(ss[:-1][so] - new, lens)
        counts = np.zeros(n0, np.int32)
        counts[sn[so]] = lens
        out_c, out_r = array("i"), array("i")
        out_c.frombytes(counts.tobytes())
        out_r.frombytes(er[idx].astype(np.int32, copy=False).tobytes())
        return out_c, out_r

    # ----------------------------------------------------------- validate
    def validate(self, raise_error: bool = False, check_dtypes: bool = True) -> list[str]:
        problems = [f"duplicate node name '{d}'" for d in self.duplicates]
        for n in self.nodes.values():
            for inp in n.input[:]:
                src, port, _ = parse_tensor(inp)
                if src not in self.nodes:
                    problems.append(f"node '{n.name}' reads '{inp}', which does not exist")
        order = self.topo_order()
        seen_ok = self._acyclic_prefix(order)
        if seen_ok < len(order):
            problems.append(f"cycle outside loops through: {order[seen_ok:seen_ok + 10]}")
        if check_dtypes:
            problems.extend(self._dtype_problems())
        if problems and raise_error:
            raise GraphError("invalid graph: " + "; ".join(problems[:20]) +
                             (f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""))
        return problems

    def _acyclic_prefix(self, order):
        # topo_order appends cyclic nodes last; find where the valid prefix ends
        pos = {n: i for i, n in enumerate(order)}
        for i, name in enumerate(order):
            for inp in self.nodes[name].input[:]:
                src = parse_tensor(inp)[0]
                if src in pos and pos[src] > i and self.nodes[src].op not in LOOP_BACK_OPS:
                    return i
        return len(order)

    def _in_graph_order(self, names):
        """The names of ``names`` that are nodes here, in graph order (the
        order of ``nodes``: ``_seq`` ranks new nodes last, in the order
        they were added, as the dict does)."""
        nodes = self.nodes
        found = [n for n in names if n in nodes]
        try:
            found.sort(key=self._seq.__getitem__)
        except KeyError:  # (a node put in ``nodes`` by hand: the dict's order)
            keep = set(found)
            found = [n for n in nodes if n in keep]
        return found

    def _dtype_problems(self, names=None, partial=None):
        """Arity and edge-dtype problems of every node (of the nodes in
        ``names`` only, when given), in graph order.

        ``partial`` (with ``names``): {node name: raw input indices}, nodes
        outside ``names`` of which only the data edges at those input
        indices are checked, and only when the node's arity is right (the
        full check reports an arity problem instead of any edge problem).
        The OpDef guard gives the unchanged readers of changed nodes and the
        edges from changed producers there: their other edges, and their
        arity, are the input graph's (:func:`opdef_check.new_problems`)."""
        problems = []
        out_cache = {}
        if names is None:
            order = self.nodes.values()
        else:
            nodes = self.nodes
            order = map(nodes.__getitem__,
                        self._in_graph_order(set(names) | set(partial) if partial else names))
        for n in order:
            want = self.input_dtypes(n)
            if want is None:
                continue
            idxs = partial.get(n.name) if partial else None
            if idxs is not None and n.name not in names:
                self._edge_problems_at(n, want, idxs, out_cache, problems)
                continue
            data = list(filterfalse(_is_control, n.input[:]))
            if len(data) != len(want):
                problems.append(f"node '{n.name}' ({n.op}) has {len(data)} data inputs, its signature wants {len(want)}")
                continue
            for k, inp in enumerate(data):
                self._edge_problem(n, k, inp, want, out_cache, problems)
        return problems

    def _edge_problem(self, n, k, inp, want, out_cache, problems):
        """The problem of data input ``k`` (reference ``inp``) of ``n``, if any."""
        src, port, _ = parse_tensor(inp)
        srcn = self.nodes.get(src)
        if srcn is None:
            return
        dts = out_cache.get(src)
        if dts is None:
            dts = out_cache[src] = self.output_dtypes(srcn) or ()
        if port >= len(dts):
            if dts:
                problems.append(f"node '{n.name}' reads output {port} of '{src}', which has {len(dts)}")
            return
        have = registry.base_dtype(dts[port])
        w = registry.base_dtype(want[k])
        if have != w and not (have == registry.DT_RESOURCE or w == registry.DT_RESOURCE):
            problems.append(
                f"edge '{inp}' -> '{n.name}':{k} carries {registry.dtype_name(have)} "
                f"but {n.op} expects {registry.dtype_name(w)}")

    def _edge_problems_at(self, n, want, idxs, out_cache, problems):
        """The problems of ``n``'s data edges at raw input indices ``idxs``,
        as the full check gives them: none when the arity is wrong (read only
        then, and only when an edge has a problem: a node's input list can
        hold hundreds of control inputs)."""
        inputs = n.input
        found = []
        for idx in sorted(set(idxs)):
            inp = inputs[idx]
            if inp.startswith("^"):
                continue
            before = inputs[:idx]
            k = idx - sum(map(_is_control, before)) if before else 0
            if k >= len(want):
                continue  # an arity problem: the full check stops there
            self._edge_problem(n, k, inp, want, out_cache, found)
        if found and sum(1 for _ in filterfalse(_is_control, inputs)) == len(want):
            problems.extend(found)

    # ---------------------------------------------------------- functions
    # (graph_passes.functions.function_graph(graph, name) gives a body as a Graph)
    def set_function(self, fgraph):
        fdef = fgraph.to_function_def()
        for i, f in enumerate(self.library.function):
            if f.signature.name == fdef.signature.name:
                self.library.function[i].CopyFrom(fdef)
                self._functions[fdef.signature.name] = self.library.function[i]
                self._dirty = True
                return
        raise GraphError(f"function '{fdef.signature.name}' is not in the library")

    # ------------------------------------------------------------ output
    def to_graph_def(self) -> graph_pb2.GraphDef:
        if not self._dirty and not self.duplicates:
            out = graph_pb2.GraphDef()
            out.CopyFrom(self._gd)
            return out
        out = graph_pb2.GraphDef()
        out.node.extend(self.nodes.values())
        drop_dangling_colocation(out.node)  # colocated with a node a pass removed
        out.library.CopyFrom(self.library)
        out.versions.CopyFrom(self.versions)
        return out

    def serialize(self) -> bytes:
        """``self.to_graph_def().SerializeToString(deterministic=True)``, the
        same bytes, without copying every node into a new GraphDef first: a
        GraphDef's bytes are its nodes' (field 1, in order), then the rest."""
        if not self._dirty and not self.duplicates:
            return self._gd.SerializeToString(deterministic=True)
        nodes = self.nodes
        names = _EncodedNames(nodes)
        parts = []
        add = parts.append
        entry = self._node_entry
        for n in nodes.values():
            entry(n, names, add)
        add(self._tail())
        return b"".join(parts)

    def _node_bytes(self, n, names):
        """``n``'s deterministic bytes as a GraphDef ``node`` entry (field 1),
        colocation entries naming a node not in ``names`` dropped (see
        :meth:`_node_entry`; one bytes object instead of three parts)."""
        b = n.SerializeToString(deterministic=True)
        if b.find(b"_class") >= 0:  # (not `in`: see _node_entry)
            keep = _colocation_kept(n, names() if callable(names) else names)
            if keep is not None:
                c = node_def_pb2.NodeDef()
                c.CopyFrom(n)
                _drop_colocation(c, keep)
                b = c.SerializeToString(deterministic=True)
        return _node_field_header(len(b)) + b

    def _node_entry(self, n, names, add):
        """Append ``n``'s bytes as a GraphDef ``node`` entry (field 1), with
        colocation entries naming a node not in ``names`` (bytes; or a
        callable giving them) dropped."""
        b = n.SerializeToString(deterministic=True)
        # (only a node whose bytes hold "_class" can carry colocation entries;
        # `bytes.find`, not `in`: CPython's `in` on bytes first tries the
        # operand as an int and formats a TypeError, ~2k instructions a call)
        keep = (_colocation_kept(n, names() if callable(names) else names)
                if b.find(b"_class") >= 0 else None)
        if keep is not None:  # colocated with a node that is gone: a fixed copy
            c = node_def_pb2.NodeDef()
            c.CopyFrom(n)
            _drop_colocation(c, keep)
            b = c.SerializeToString(deterministic=True)
        add(b"\x0a")  # field 1 (node), length-delimited
        add(_varint(len(b)))
        add(b)

    def _tail(self) -> bytes:
        tail = graph_pb2.GraphDef()
        tail.library.CopyFrom(self.library)
        tail.versions.CopyFrom(self.versions)
        return tail.SerializeToString(deterministic=True)

    #: hand the bridge a patch (:meth:`serialize_patch`) instead of the whole
    #: graph's bytes; False: always :meth:`serialize` (the reference)
    patch_output = True
    #: (issue 17u) :meth:`serialize_patch` takes the order from ``_seq`` with
    #: numpy and writes each node entry as one bytes object; False: names
    #: mapped through a dict of the input's names (the reference; the same patch)
    fast_patch = True

    def serialize_patch(self):
        """The rewritten graph as a patch of the graph this object was built
        from, or None (then use :meth:`serialize`): a :class:`GraphPatch`
        whose ``order`` gives, per output node, its index in the input graph
        (a node no pass created or edited: :meth:`changed_nodes`) or -1 (the
        next node of ``payload``), and ``payload`` the serialized GraphDef of
        those created or edited nodes, in output order, with the output's
        library and versions.  Taking the input's nodes for the
        non-negative entries (``AssemblePatch`` in
        custom_ops/grappler_bridge.cc, which also drops their colocation
        entries naming a node that is gone, as :meth:`serialize` does) gives
        the GraphDef :meth:`serialize`'s bytes parse to.

        None when the patch would not pay or could be wrong: nothing changed,
        the node count is the input's (the bridge then compares the output
        with the input, on :meth:`serialize`'s bytes), duplicate names,
        :meth:`touch_all` (an untracked pass), or :attr:`patch_output` off."""
        base = self._base_names
        if (not self.patch_output or base is None or self.duplicates or self._all_modified
                or not self._dirty):
            return None
        nodes = self.nodes
        if len(nodes) == len(base):
            return None
        if self.fast_patch:
            out = self._fast_patch(base, nodes)
            if out is not None:
                return out
        keys = list(nodes)
        order = list(map(dict(zip(base, range(len(base)))).get, keys, repeat(-1)))
        special = self.created | self.modified
        if special:
            at = dict(zip(keys, range(len(keys))))
            for name in special:
                k = at.get(name)
                if k is not None:
                    order[k] = -1
        parts = []
        add = parts.append
        entry = self._node_entry
        names = _EncodedNames(nodes)
        for k in [i for i, v in enumerate(order) if v < 0]:
            entry(nodes[keys[k]], names, add)
        add(self._tail())
        return GraphPatch(array("i", order), b"".join(parts), len(keys))

    def _fast_patch(self, base, nodes):
        """:meth:`serialize_patch`'s result from ``_seq`` (issue 17u): a node's
        rank is its input index while no :meth:`reindex` ran since the
        input (``_seq_is_base``); a node added since ranks past the input's
        and is in ``created``; so the order is the rank for the other nodes
        below the input's count, -1 else.  None when ``_seq`` does not name
        every node (a node put in by hand): the caller maps names."""
        keys = list(nodes)
        n = len(keys)
        got = self._base_ranks(keys, len(base), with_ranks=True)
        if got is None:
            return None
        order, ranks = got
        names = _EncodedNames(nodes)
        entry = self._node_bytes
        kget = keys.__getitem__
        head = self._records(order, ranks, len(base)) if self.patch_records else None
        changed = [nodes[kget(k)] for k in np.flatnonzero(order == -1).tolist()]
        parts = self._joined_entries(changed, names) if self.joined_patch else None
        if parts is None:
            parts = [entry(n, names) for n in changed]
        if head is not None:
            parts.insert(0, head)
        parts.append(self._tail())
        out = array("i")
        out.frombytes(order.tobytes())
        return GraphPatch(out, b"".join(parts), n)

    #: (issue 17) :meth:`serialize_patch` sends the nodes whose every edit is
    #: recorded (re-typed through :meth:`note_retyped`, re-wired through
    #: :meth:`add_and_rewire`) as those edits on the input's NodeDef instead
    #: of serialized whole: a records field first in the payload, their order
    #: entries -2 - (input index) (read by custom_ops/opdef_precheck.cc
    #: ``ParsePatch``).  Off by default: whoever reads the patch turns it on
    #: (the grappler bridge, when its library reads the records' format)
    patch_records = False
    #: the records' format (``kPatchRecordsVersion``) and field number (``kPatchRecordsField``)
    RECORDS_VERSION = 2
    RECORDS_FIELD = 2047

    def _records(self, order, ranks, nb):
        """The records field (bytes) of the record nodes, their entries of
        ``order`` (:meth:`_base_ranks`' array, updated in place; ``ranks``: every node's) set to
        -2 - (input index); None when there is none."""
        rec = self._rec
        if not rec:
            return None
        nodes, seq = self.nodes, self._seq
        live = [n for n in (rec & self.modified) - self._full - self.created if n in nodes]
        if not live:
            return None
        rec_ranks = packed_ints(map(seq.__getitem__, live), len(live), np.int32)
        if (rec_ranks >= nb).any():  # (a rank past the input's: not an input node)
            return None
        mark = np.zeros(self._next_seq + 1, np.bool_)
        mark[rec_ranks] = True
        at = np.flatnonzero(order == -1)
        base = ranks[at]
        hit = mark[base]
        order[at[hit]] = -2 - base[hit]
        big = 2 ** 31 - 1  # (a name no longer in the graph: a rank the reader skips)
        pack = struct.pack
        groups = self._rec_attrs
        # the distinct attr sets, then per group its count and set, then the members
        sets = {}
        # (C-level: each group's set numbered by the count of sets before it)
        ids = list(map(sets.setdefault, map(itemgetter(1), groups), map(len, repeat(sets))))
        parts = [pack("<ii", self.RECORDS_VERSION, len(sets))]
        for items in sets:
            parts.append(pack("<i", len(items)))
            for a, v in items:
                ab = a.encode()
                parts.append(pack("<i", len(ab)) + ab + pack("<i", len(v)) + v)
        counts = array("i", map(len, map(itemgetter(0), groups)))
        members = chain.from_iterable(map(itemgetter(0), groups))
        total = sum(counts)
        parts += [pack("<i", len(groups)), counts.tobytes(), array("i", ids).tobytes(),
                  packed_ints(map(seq.get, members, repeat(big)), total, np.int32).tobytes()]
        edits = self._rec_inputs
        k = len(edits)
        cons = packed_ints(map(seq.get, map(itemgetter(0), edits), repeat(big)), k, np.int32)
        idx = packed_ints(map(itemgetter(1), edits), k, np.int32)
        refs = "\x01".join(map(itemgetter(2), edits)).encode()
        parts += [pack("<i", k), cons.tobytes(), idx.tobytes(), pack("<i", len(refs)), refs]
        body = b"".join(parts)
        return _varint((self.RECORDS_FIELD << 3) | 2) + _varint(len(body)) + body

    #: (issue 17) :meth:`_fast_patch` writes the changed nodes' entries as
    #: one join of their bytes and headers, serialising each node once and
    #: looking for colocation entries in the joined payload; False: one
    #: :meth:`_node_bytes` per node (the reference; the same bytes)
    joined_patch = True

    @staticmethod
    def _joined_entries(changed, names):
        """[the GraphDef ``node`` entries of ``changed``, joined]: what
        :meth:`_node_bytes` gives per node.  Only a node whose bytes hold
        "_class" can carry a colocation entry (one naming a node not in
        ``names`` is dropped, as :meth:`_node_bytes` does); those nodes are
        found from the hits in the joined payload, and only they are looked
        at again (a TF1 graph's variables carry ``_class``: the reference
        serialised every changed node a second time when one did)."""
        bodies = list(map(_serialize_det, changed))
        heads = list(map(_node_field_header, map(len, bodies)))
        parts = [None] * (2 * len(bodies))
        parts[0::2] = heads
        parts[1::2] = bodies
        joined = b"".join(parts)
        at = joined.find(b"_class")
        if at < 0:
            return [joined]
        # each entry's end offset in `joined`: the entry holding a hit is the first ending after it
        ends = list(accumulate(map(len, parts)))[1::2]
        fixed = False
        k = -1
        while at >= 0:
            k = bisect_right(ends, at, lo=k + 1)
            keep = _colocation_kept(changed[k], names)
            if keep is not None:
                c = node_def_pb2.NodeDef()
                c.CopyFrom(changed[k])
                _drop_colocation(c, keep)
                b = c.SerializeToString(deterministic=True)
                parts[2 * k], parts[2 * k + 1] = _node_field_header(len(b)), b
                fixed = True
            at = joined.find(b"_class", ends[k])
        return [b"".join(parts)] if fixed else [joined]

    def _base_ranks(self, keys, nb, with_ranks=False):
        """Per name of ``keys`` (every node, in ``nodes`` order) its index in
        the input graph when no pass created or edited it, else -1 (int32
        numpy array), from ``_seq`` (see :meth:`_fast_patch`); None when
        ``_seq`` does not name every node or no longer ranks by input index.
        ``with_ranks``: (that array, every node's rank)."""
        seq = self._seq
        n = len(keys)
        if not getattr(self, "_seq_is_base", False) or len(seq) != n:
            return None
        if list(seq) == keys:  # (the usual case: ``_seq`` holds the nodes in their order)
            ranks = packed_ints(seq.values(), n)
        else:
            ranks = packed_ints(map(seq.get, keys, repeat(-1)), n)
            if n and ranks.min() < 0:
                return None
        special = self.created | self.modified
        mark = np.zeros(self._next_seq + 1, np.bool_)
        if special:
            mark[packed_ints(map(seq.get, special, repeat(self._next_seq)), len(special))] = True
        order = np.where((ranks < nb) & ~mark[ranks], ranks, -1).astype(np.int32)
        return (order, ranks) if with_ranks else order

    #: (issue 17) who built this graph from a serialized one it still holds
    #: may set this to ``fn(names, base, counts, extra) -> bytes | None``: the
    #: precision pass's painting strings (see ``precision/native.py``) with
    #: the inputs of the nodes no pass created or edited read from that
    #: graph (``base``: per node its input index or -1, :meth:`base_positions`)
    #: instead of from the NodeDefs here (the grappler bridge does, from the
    #: item it holds: ``NpuAmpItemPaintStrings``); None: not available
    base_inputs = None

    #: (issue 17) who built this graph from a serialized one may set this to
    #: ``fn(attr_name) -> bool | None``: whether a node of that graph carries
    #: the attr (the grappler bridge does, from the item it holds:
    #: ``NpuAmpItemHasAttr``); False lets a pass skip reading every node's attr
    #: map for an attr no pass writes (the precision pass's ``_keep_dtype``,
    #: which only the user sets); None: not available
    source_has_attr = None

    #: (issue 17) ``source_has_device() -> bool | None``: whether a node of the
    #: graph this object was built from has a device string (the grappler
    #: bridge's ``NpuAmpItemHasDevice``); False lets a pass take "" for every
    #: node no pass created or edited (:meth:`base_positions`) instead of
    #: reading each one's; None: not available
    source_has_device = None

    #: (issue 17) who built this graph from a serialized GraphDef may set this
    #: to those bytes (or a callable returning them): the graph as it was
    #: created, before any edit (:meth:`edits_since` / :meth:`removed_since`
    #: since 0 give the rest); the gradient-region search builds its C++
    #: mirror from them instead of serialising every node.  None: not available
    source_bytes = None

    def base_positions(self):
        """Per node (``nodes`` order) its index in the graph this object was
        built from when no pass created or edited it since, else -1 (an
        int32 numpy array); None when that is not known (duplicate names,
        an untracked pass, a node put in by hand, a :meth:`reindex`)."""
        base = self._base_names
        if base is None or self.duplicates or self._all_modified:
            return None
        return self._base_ranks(list(self.nodes), len(base))

    #: (issue 17) :meth:`positions` copies ``_seq`` when it already ranks
    #: the nodes by their position (checked); False: always built (the reference)
    dense_positions = True

    def _dense_ranks(self) -> bool:
        """True when ``_seq[name]`` is ``name``'s index in ``list(self.nodes)``
        for every node: ranks are given in increasing order as nodes are put
        in (``_adopt_index``, :meth:`reindex`, :meth:`add_node`,
        :meth:`add_and_rewire`), so with none removed since (as many ranks as
        ever given) and the same names in the same order, rank = position."""
        seq = self._seq
        return (len(seq) == self._next_seq == len(self.nodes)
                and list(seq) == list(self.nodes))

    #: (issue 17) :meth:`order_positions` and :meth:`ids_of` answer from the
    #: node ids the graph already holds (the native sort's order, ids that
    #: are positions) instead of looking each name up; False: looked up
    #: (the reference; the same arrays)
    ids_without_lookups = True

    def order_positions(self, order):
        """(issue 17) The index in ``list(self.nodes)`` of each name of
        ``order``, a topological order equal to the one cached (a copy
        :meth:`topo_order` gave), as an int32 array: the ids the native sort
        ordered, which are positions when :meth:`_dense_ranks`; None when
        that does not hold (the caller looks the names up)."""
        cached, ids = self._topo_cache, self._topo_ids
        if (not self.ids_without_lookups or cached is None or ids is None or ids[0] is not cached[0]
                or len(ids[1]) != len(order) or len(order) != len(self.nodes) or cached[0] != order
                or not self._dense_ranks()):
            return None
        return np.asarray(ids[1], np.int32)

    def ids_of(self, names) -> np.ndarray:
        """(issue 17) The node ids (``_seq``) of the names in the list
        ``names``, an int64 array: 0, 1, ... without a name looked up when
        they are the graph's nodes in its order and ids are positions
        (:meth:`_dense_ranks`); else each looked up (KeyError for a name not
        in the graph)."""
        n = len(names)
        if self.ids_without_lookups and n == len(self.nodes) and self._dense_ranks() and list(self.nodes) == names:
            return np.arange(n, dtype=np.int64)
        return packed_ints(map(self._seq.__getitem__, names), n)

    def positions(self) -> dict:
        """name -> index in ``list(self.nodes)``: a fresh dict, the caller's
        to keep (a copy of ``_seq`` when :meth:`_dense_ranks`: C-level, ~15×
        less than building it name by name on a 6k-node graph)."""
        if self.dense_positions and self._dense_ranks():
            return dict(self._seq)
        names = list(self.nodes)
        return dict(zip(names, range(len(names))))

    def __len__(self):
        return len(self.nodes)

    def __contains__(self, name):
        return name in self.nodes

    def __getitem__(self, name):
        return self.nodes[name]

    # ------------------------------------------------ bulk edits (issue 17t)
    #: (issue 17) :meth:`add_and_rewire` does ``add_node`` / ``set_input``'s
    #: bookkeeping in its own loop; False: calls them per step (the
    #: reference; the same graph, indexes, logs and version)
    inline_rewire = True
    #: (issue 17) :meth:`add_and_rewire` takes a new node's one input from
    #: the caller (``only_inputs``) instead of reading it back from the
    #: NodeDef; False: read back (the reference; the same indexes)
    known_inputs = True

    def add_and_rewire(self, steps, only_inputs=None):
        """Apply ``steps`` in order, each ``(node, consumer, index, ref)``:
        ``add_node(node)`` when ``node`` is not None, then
        ``set_input(consumer, index, ref)``: the same nodes, indexes, edit
        log and ``version`` as those calls one by one (they are what runs,
        so the graph's bookkeeping stays this class's).  The precision pass
        inserts its casts through it in one batch (``PrecisionPass.bulk_casts``).
        ``only_inputs`` (issue 17): per step, the one input of its new node
        (a data input; the caller made the node so), which is then not read
        back from the NodeDef (:attr:`known_inputs`)."""
        add, rewire = self.add_node, self.set_input
        if not self.known_inputs:
            only_inputs = None
        if not self.inline_rewire:
            for node, consumer, index, ref in steps:
                if node is not None:
                    add(node)
                rewire(consumer, index, ref)
            return
        # (issue 17) add_node's and set_input's bookkeeping inline, the
        # indexes read once; a step set_input would repair (an index out of
        # sync) or a name taken goes through the methods themselves
        nodes, elog, created, modified = self.nodes, self._edit_log, self.created, self.modified
        rec_add, rec_in = self._rec.add, self._rec_inputs.append  # (issue 17: patch records)
        state = None
        bumps = 0  # (version bumps not written yet: written once, at the end or before a method runs)
        k = self._next_seq
        ins = iter(only_inputs) if only_inputs is not None else None
        try:
            for node, consumer, index, ref in steps:
                only = next(ins) if ins is not None else None
                if state is None:  # (again after a repair: reindex() makes new indexes)
                    state = (self._consumers, self._kdnames, self._by_op, self._seq, self._kdirty,
                             self._id_name, self._id_dead)
                    cons, marked, by_op, seq, kdirty, id_name, id_dead = state
                if node is not None:
                    name = node.name
                    if name in nodes:
                        add(node)  # (raises)
                    nodes[name] = node
                    created.add(name)
                    elog.append(name)
                    if only is not None:  # (its one data input, as the caller made it)
                        src = parse_tensor(only)[0]
                        cons[src].append((name, 0))
                        marked.add(src)
                    else:
                        for i, inp in enumerate(node.input[:]):
                            src, _, ctrl = parse_tensor(inp)
                            cons[src].append((name, -1 if ctrl else i))
                            marked.add(src)
                    ops = by_op.get(node.op)
                    if ops is None:
                        ops = by_op[node.op] = {}
                    ops[name] = None
                    seq[name] = k
                    kdirty.add(k)
                    id_name.append(name)
                    id_dead.append(0)
                    k += 1
                    bumps += 1
                cnode = nodes[consumer]
                old = cnode.input[index]
                if old == ref:
                    continue
                osrc, _, octrl = parse_tensor(old)
                lst = cons.get(osrc)
                if lst is not None:
                    try:
                        lst.remove((consumer, -1 if octrl else index))
                    except ValueError:
                        lst = None
                if lst is None:  # set_input's repair paths, with the state written first
                    self._next_seq = k
                    self._flush_bumps(bumps)
                    bumps = 0
                    rewire(consumer, index, ref)
                    k = self._next_seq
                    state = None
                    continue
                modified.add(consumer)
                elog.append(consumer)
                rec_add(consumer)
                rec_in((consumer, index, ref))
                marked.add(osrc)
                cnode.input[index] = ref
                nsrc, _, nctrl = parse_tensor(ref)
                cons[nsrc].append((consumer, -1 if nctrl else index))
                marked.add(nsrc)
                bumps += 1
        finally:
            self._next_seq = k
            self._flush_bumps(bumps)

    def _flush_bumps(self, bumps):
        if bumps:
            self._dirty = True
            self._topo_cache = None
            self.version += bumps
