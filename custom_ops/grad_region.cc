// The gradient-region search of graph_passes/fusion/grad_region.py in C++
// (issue 17): find_grad_region's two growth passes (pass A finds the
// incoming gradient dy, pass B grows the region G), with try_add and its
// helpers (classify_input, from_inputs, after_forward, the static-value
// memo, attributed_forward, the autodiff scope matchers).  The Python
// search is the reference: this file makes the same decisions in the same
// order (the same heap order on the same positions, the same refusal
// texts), and Python keeps everything after the growth (the inner tensors'
// readers, the forward-code check, outputs, control edges, the cycle
// check).  With NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION=1 every search runs
// both and compares (the test suite does).
//
// No TensorFlow types: the graph comes as a *mirror* of node names, ops and
// inputs, built once from serialized GraphDef bytes (only fields 1-3 of
// each NodeDef are read) and then patched with the nodes created, edited or
// removed since (Graph.edits_since / removed_since); the topological
// positions come from Python (grad_region._positions).  The one question
// about values, whether an external tensor has a float dtype and dy's
// shape, is a callback into Python; the shapes themselves come from this
// file's port of shapes.local_shape (NpuAmpGrShape, below), which reads the
// attrs of the loaded NodeDef bytes of the nodes not edited since.  Names must be printable ASCII (else
// the mirror refuses and Python searches): the Python matchers' \d and
// isdecimal() then mean [0-9].
//
// Calls (ctypes, from npu_amp_tf/bridge.py):
//   h = NpuAmpGrMirrorNew()
//   rc = NpuAmpGrMirrorLoad(h, graphdef, len)      upsert every node (0 ok)
//   rc = NpuAmpGrMirrorUpsertText(h, text, len)   the same, nodes as text
//   rc = NpuAmpGrMirrorRemove(h, names, len)       \x01-separated names
//   rc = NpuAmpGrMirrorBefore(h, names, len, reset)  known names of removed nodes
//   rc = NpuAmpGrMirrorPositions(h, names, len, pos, n, reset)
//   rc = NpuAmpGrMirrorPositionsBase(h, ranks, nb, names, len, pos, n)
//   rc = NpuAmpGrSearch(h, request, len, dy_cb, &out, &out_len)
//   memo = NpuAmpGrShapeMemoNew(); rank = NpuAmpGrShape(h, memo, ref, len, dims, cap)
//   rc = NpuAmpGrAnalyzeNorms(h, names, len, &out, &out_len)
//   rc = NpuAmpGrNormPlan(h, memo, request, len, &out, &out_len)       the layer-norm
//   rc = NpuAmpGrNormGradPlan(h, memo, request, len, &out, &out_len)   rule's decisions
//   NpuAmpGrShapeMemoFree(memo); NpuAmpGrMirrorFree(h)
//
// (stop 57) The layer-norm rule's whole decision at an anchor, the checks
// after the growth included, is made here too (NormPlanner, at the end of
// this file): see its comment.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory_resource>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "deferred_free.h"   // npu_amp_tf::DeferFree
#include "graph_views.h"     // npu_amp_tf::ViewsOfBytes
#include "name_table.h"      // npu_amp_tf::NameTable
#include "worker.h"          // npu_amp_tf::Job

namespace {

using std::string;
using std::string_view;

constexpr double kNoPos = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------- op sets
// The op sets (grad_region.GRAD_OPS, _STATIC_ARITH, _FROM_INPUT_OPS,
// AGGREGATIONS, SHAPE_OPS, VALUE_STATIC_OPS) come from Python
// (NpuAmpGrMirrorOps): the module's constants stay the one place they live.
struct OpSets {
  string text;  // (the sets view it)
  std::unordered_set<string_view> grad, static_arith, from_input, aggregation, shape, value_static;
  // the shape walk's (graph_passes/shapes.py _SAME_SHAPE, _BROADCAST, _MATMUL,
  // _BATCH_MATMUL, _REDUCE)
  std::unordered_set<string_view> same_shape, broadcast, matmul, batch_matmul, reduce;
  bool set = false;
};

bool IsIdentityLike(string_view op) { return op == "Identity" || op == "Snapshot"; }

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// ---------------------------------------------------------------- references
// graph.parse_tensor: "^a" -> (a, -1, ctrl); "a:2" -> (a, 2); else (ref, 0).
// False when a port does not fit (Python's ints do: the caller refuses).
bool ParseRef(string_view ref, string_view* name, int64_t* port, bool* ctrl) {
  if (!ref.empty() && ref[0] == '^') {
    *name = ref.substr(1);
    *port = -1;
    *ctrl = true;
    return true;
  }
  *ctrl = false;
  const size_t c = ref.rfind(':');
  if (c != string_view::npos && c + 1 < ref.size()) {
    string_view p = ref.substr(c + 1);
    if (std::all_of(p.begin(), p.end(), IsDigit)) {
      if (p.size() > 15) return false;
      int64_t v = 0;
      for (char ch : p) v = v * 10 + (ch - '0');
      *name = ref.substr(0, c);
      *port = v;
      return true;
    }
  }
  *name = ref;
  *port = 0;
  return true;
}

// grad_region._canon
string Canon(string_view name, int64_t port, bool ctrl) {
  if (ctrl) return "^" + string(name);
  if (port == 0) return string(name);
  return string(name) + ":" + std::to_string(port);
}

bool Printable(string_view s) {
  // (issue 17) eight bytes at a time: a byte below 0x20 or above 0x7e sets
  // its high bit in `bad` (the "has a byte less / more than n" word tests,
  // exact for n <= 0x80 / 0x7f); node names are ~100 bytes on BERT-12
  constexpr uint64_t kOnes = 0x0101010101010101ULL, kHighs = 0x8080808080808080ULL;
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    const uint64_t below = (w - kOnes * 0x20) & ~w & kHighs;
    const uint64_t above = ((w + kOnes * (0x7f - 0x7e)) | w) & kHighs;
    if (below | above) return false;
  }
  for (; n > 0; --n, ++p) {
    const unsigned char c = static_cast<unsigned char>(*p);
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// ---------------------------------------------------------------- scope names
struct Groups {
  bool ok = false;
  bool has_prefix = false;  // group(1) is not None
  string_view prefix;       // group(1): the name up to the scope word ("a/")
  string_view tail;         // group(2)
};

// _tf1_tail: gradients(?:_\d+)?/(.+?)_grad(?:/|$) at p
bool Tf1Tail(string_view name, size_t p, string_view* g) {
  size_t j = p + 9;
  if (j < name.size() && name[j] == '_') {
    size_t k = j + 1;
    while (k < name.size() && IsDigit(name[k])) ++k;
    if (k == j + 1) return false;
    j = k;
  }
  if (j >= name.size() || name[j] != '/') return false;
  const size_t q = j + 1;
  size_t k = name.find("_grad", q + 1);
  while (k != string_view::npos) {
    const size_t e = k + 5;
    if (e == name.size() || name[e] == '/') {
      *g = name.substr(q, k - q);
      return true;
    }
    k = name.find("_grad", k + 1);
  }
  return false;
}

// _tf2_tail: gradient_tape/(.+)$ at p
bool Tf2Tail(string_view name, size_t p, string_view* g) {
  if (p + 14 >= name.size()) return false;
  *g = name.substr(p + 14);
  return true;
}

// _ScopeMatch.match: the last occurrence of `word` that starts the name or
// follows a '/' and at which the tail matches
template <typename Tail>
Groups ScopeMatch(string_view name, string_view word, Tail tail) {
  Groups out;
  size_t end = name.size();
  while (true) {
    if (end < word.size()) return out;
    const size_t p = name.rfind(word, end - word.size());
    if (p == string_view::npos) return out;
    if (p == 0 || name[p - 1] == '/') {
      string_view g;
      if (tail(name, p, &g)) {
        out.ok = true;
        out.has_prefix = p != 0;
        out.prefix = name.substr(0, p);
        out.tail = g;
        return out;
      }
    }
    end = p + word.size() - 1;
  }
}

Groups Tf1(string_view name) { return ScopeMatch(name, "gradients", Tf1Tail); }
Groups Tf2(string_view name) { return ScopeMatch(name, "gradient_tape/", Tf2Tail); }

// is_autodiff_name: (?:^|/)(?:gradients(?:_\d+)?|gradient_tape)/ anywhere
bool IsAutodiff(string_view name) {
  for (size_t i = 0; i < name.size(); ++i) {
    if (i != 0 && name[i - 1] != '/') continue;
    string_view rest = name.substr(i);
    if (rest.substr(0, 14) == "gradient_tape/") return true;
    if (rest.substr(0, 9) == "gradients") {
      size_t j = 9;
      if (j < rest.size() && rest[j] == '/') return true;
      if (j < rest.size() && rest[j] == '_') {
        size_t k = j + 1;
        while (k < rest.size() && IsDigit(rest[k])) ++k;
        if (k > j + 1 && k < rest.size() && rest[k] == '/') return true;
      }
    }
  }
  return false;
}

// _GRAPPLER.match
bool GrapplerMade(string_view name) {
  for (string_view p : {"ArithmeticOptimizer/", "ConstantFolding/", "DependencyOptimizer/",
                        "LayoutOptimizer/", "LoopOptimizer/", "Remapper/", "MemoryOptimizer/",
                        "PinToHostOptimizer/"}) {
    if (name.substr(0, p.size()) == p) return true;
  }
  return false;
}

bool StartsWith(string_view s, string_view p) { return s.substr(0, p.size()) == p; }

// _under_scope
bool UnderScope(string_view name, string_view scope) {
  for (int which = 0; which < 2; ++which) {
    Groups m = which == 0 ? Tf2(name) : Tf1(name);
    if (m.ok) {
      return StartsWith(string(m.prefix) + string(m.tail), scope) || StartsWith(m.tail, scope);
    }
  }
  return true;
}

// rsplit("/", 1)[0]
string_view Parent(string_view s) {
  const size_t k = s.rfind('/');
  return k == string_view::npos ? s : s.substr(0, k);
}

std::vector<string_view> Split(string_view s, char sep) {
  std::vector<string_view> out;
  if (s.empty()) return out;
  size_t at = 0;
  while (true) {
    const size_t k = s.find(sep, at);
    if (k == string_view::npos) {
      out.push_back(s.substr(at));
      return out;
    }
    out.push_back(s.substr(at, k - at));
    at = k + 1;
  }
}

// ---------------------------------------------------------------- the mirror

struct InputRef {
  int32_t src;  // interned source name (a node, or a dangling name)
  int64_t port;
  bool ctrl;
  string_view ref;  // as written (in the mirror's arena)
};

// A per-id table's size for `n` ids: room for the ids later fusions add, so
// that a table is not copied again for every few ids the mirror gains.
inline size_t Headroom(size_t n) { return n + n / 8 + 64; }

// Per-id values valid for one generation: Begin() forgets them all in O(1)
// (a search touches a few hundred of the graph's ids).
template <typename T>
struct Stamped {
  std::vector<uint32_t> stamp;
  std::vector<T> val;
  uint32_t cur = 0;
  T def{};
  void Begin(size_t n, T d) {
    if (stamp.size() < n) {  // (with headroom: the mirror grows by a few ids per fusion)
      const size_t want = Headroom(n);
      stamp.resize(want, 0);
      val.resize(want);
    }
    def = d;
    if (++cur == 0) {
      std::fill(stamp.begin(), stamp.end(), 0);
      cur = 1;
    }
  }
  T get(int32_t i) const { return stamp[i] == cur ? val[i] : def; }
  T operator[](int32_t i) const { return get(i); }
  void set(int32_t i, T v) {
    stamp[i] = cur;
    val[i] = v;
  }
};

// (issue 17) a node's inputs and a name's readers live in the mirror's pool
// (Mirror::pool_): a bump allocation each, freed with the mirror at once
using InputList = std::pmr::vector<InputRef>;
using ReaderList = std::pmr::vector<std::pair<int32_t, int32_t>>;

struct Node {
  explicit Node(std::pmr::memory_resource* r) : inputs(r) {}
  string_view op;  // (in the mirror's buffers)
  InputList inputs;
  bool alive = false;
  double pos = kNoPos;
  // (the shape walk) the NodeDef bytes of the fresh load, while no upsert or
  // removal since has touched the node (`dirty`): its attrs are these
  string_view def;
  bool dirty = false;
};

class Mirror {
 public:
  int32_t Find(string_view name) const { return ids_.Find(name); }

  // `stable`: `name` views the mirror's own buffers (else a new name is copied)
  int32_t Intern(string_view name, bool stable = false) {
    size_t at;
    uint32_t tag;
    const int32_t found = ids_.FindSlot(name, &at, &tag);  // (one hash: FindSlot, then InsertAt)
    if (found >= 0) return found;
    if (!Printable(name)) return -1;
    const int32_t id = static_cast<int32_t>(names_.size());
    if (!stable) {
      buffers_.emplace_back(name);
      name = buffers_.back();
    }
    names_.push_back(name);
    ids_.InsertAt(at, tag, name);  // (the table's ids are its insertion order: id)
    nodes_.emplace_back(&pool_);
    consumers_.emplace_back(&pool_);
    return id;
  }

  bool Alive(int32_t id) const { return id >= 0 && nodes_[id].alive; }
  const Node& node(int32_t id) const { return nodes_[id]; }
  string_view name(int32_t id) const { return names_[id]; }
  const ReaderList& consumers(int32_t id) const {
    return consumers_[id];
  }
  double pos(int32_t id) const { return id >= 0 ? nodes_[id].pos : kNoPos; }
  bool known_before(string_view name) const { return before_.count(name) != 0; }
  int32_t size() const { return static_cast<int32_t>(names_.size()); }

  OpSets ops;

  void Remove(int32_t id) {
    Node& n = nodes_[id];
    if (!n.alive) return;
    Unlink(id);
    n.alive = false;
    n.dirty = true;
    n.def = string_view();
    n.inputs.clear();
    n.op = string_view();
  }

  // A buffer the mirror keeps (the loaded bytes: names, ops and inputs view it).
  string_view Keep(const char* data, size_t len) {
    buffers_.emplace_back(data, len);
    return buffers_.back();
  }

  // the node `name` now has `op` and `inputs` (created, or edited in place);
  // every view is into a buffer of Keep()
  // (`link` false: the readers' entries are left to LinkLoaded, a fresh load's)
  // (`id_out`: the node's id, when given)
  bool Upsert(string_view name, string_view op, const string_view* inputs, size_t n_inputs,
              bool fresh, string_view def = string_view(), bool link = true,
              int32_t* id_out = nullptr) {
    if (!Printable(op)) return false;
    const int32_t id = Intern(name, /*stable=*/true);
    if (id < 0) return false;
    if (id_out != nullptr) *id_out = id;
    if (nodes_[id].alive) {
      if (fresh) return false;  // a name twice in the bytes
      Unlink(id);
    }
    InputList ins(&pool_);
    ins.reserve(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) {
      string_view ref = inputs[i], src;
      int64_t port;
      bool ctrl;
      // (a ref is printable when its name is: '^', ':' and digits are; Intern checks a new name)
      if (!ParseRef(ref, &src, &port, &ctrl)) return false;
      const int32_t sid = Intern(src, /*stable=*/true);
      if (sid < 0) return false;
      ins.push_back(InputRef{sid, port, ctrl, ref});
    }
    Node& n = nodes_[id];
    n.op = op;
    n.inputs = std::move(ins);
    n.alive = true;
    n.def = fresh ? def : string_view();
    n.dirty = n.dirty || !fresh;
    if (link) Link(id);
    return true;
  }

  // (issue 17) the readers' entries of the nodes `ids` upserted without them,
  // in the order Upsert would have appended them, each list grown once
  void LinkLoaded(const std::vector<int32_t>& ids) {
    std::vector<int32_t> more(consumers_.size(), 0);
    for (int32_t id : ids) {
      for (const InputRef& in : nodes_[id].inputs) ++more[in.src];
    }
    for (size_t s = 0; s < more.size(); ++s) {
      if (more[s]) consumers_[s].reserve(consumers_[s].size() + static_cast<size_t>(more[s]));
    }
    for (int32_t id : ids) Link(id);
  }

  void Reserve(size_t n) {
    if (names_.empty()) ids_.Reserve(n);  // (NameTable::Reserve empties the table)
    names_.reserve(n);
    nodes_.reserve(n);
    consumers_.reserve(n);
  }

  // attributed_forward's known names besides the live nodes': those of the
  // graph when the fusion pass began that are gone since (`reset`: only these)
  void AddBefore(string_view names, bool reset) {
    if (reset) before_.clear();
    if (names.empty()) return;
    for (string_view n : Split(Keep(names.data(), names.size()), '\x01')) before_.insert(n);
  }
  void SetPos(int32_t id, double p) { nodes_[id].pos = p; }
  // AddBefore of one name that views the mirror's own buffers (no copy)
  void AddBeforeName(string_view name) { before_.insert(name); }

  // (issue 17, NormFuser) edits with graph_passes.graph.Graph's own index
  // rules, so that the consumer lists keep the order Python's would have
  // (Upsert re-appends every input of an edited node; Python moves only the
  // input edited).  Graph.remove_nodes: each removed node's entries filtered
  // out of its sources' lists, its own list dropped.
  void PyRemove(int32_t id) {
    Node& n = nodes_[id];
    if (!n.alive) return;
    Unlink(id);
    consumers_[id].clear();
    n.alive = false;
    n.dirty = true;
    n.def = string_view();
    n.inputs.clear();
    n.op = string_view();
  }
  // Graph.add_node: `name` (not alive) with `op`, `inputs` and its NodeDef
  // bytes `def` (views of Keep() buffers); its entries appended to its
  // sources' lists.  -1 when a name is not printable.
  int32_t PyAdd(string_view name, string_view op, const std::vector<string_view>& inputs,
                string_view def) {
    const int32_t id = Intern(name, /*stable=*/true);
    if (id < 0 || nodes_[id].alive || !Printable(op)) return -1;
    InputList ins(&pool_);
    ins.reserve(inputs.size());
    for (string_view ref : inputs) {
      string_view src;
      int64_t port;
      bool ctrl;
      if (!ParseRef(ref, &src, &port, &ctrl)) return -1;
      const int32_t sid = Intern(src, /*stable=*/true);
      if (sid < 0) return -1;
      ins.push_back(InputRef{sid, port, ctrl, ref});
    }
    Node& n = nodes_[id];
    n.op = op;
    n.inputs = std::move(ins);
    n.alive = true;
    n.def = def;
    n.dirty = false;  // (its attrs are `def`'s: this file wrote them)
    Link(id);
    return id;
  }
  // Graph.set_input: input i of `id` becomes `ref` (a Keep() view): its entry
  // leaves the old source's list and is appended to the new one's.  The
  // NodeDef bytes keep the attrs (the inputs are `inputs`).
  bool PySetInput(int32_t id, size_t i, string_view ref) {
    string_view src;
    int64_t port;
    bool ctrl;
    if (i >= nodes_[id].inputs.size() || !ParseRef(ref, &src, &port, &ctrl)) return false;
    const int32_t sid = Intern(src, /*stable=*/true);  // (may grow nodes_: no reference before)
    if (sid < 0) return false;
    Node& n = nodes_[id];
    const InputRef old = n.inputs[i];
    auto& lst = consumers_[old.src];
    const std::pair<int32_t, int32_t> key(id, old.ctrl ? -1 : static_cast<int32_t>(i));
    auto it = std::find(lst.begin(), lst.end(), key);
    if (it != lst.end()) lst.erase(it);
    n.inputs[i] = InputRef{sid, port, ctrl, ref};
    consumers_[sid].emplace_back(id, ctrl ? -1 : static_cast<int32_t>(i));
    return true;
  }
  // Graph.add_control_input (the caller checked "^src" is not there yet)
  bool PyAddControl(int32_t id, string_view ref) {
    string_view src;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &src, &port, &ctrl) || !ctrl) return false;
    const int32_t sid = Intern(src, /*stable=*/true);
    if (sid < 0) return false;
    nodes_[id].inputs.push_back(InputRef{sid, -1, true, ref});
    consumers_[sid].emplace_back(id, -1);
    return true;
  }
  // a list to repair (core._commit's index repair of kept readers)
  ReaderList& py_consumers(int32_t id) { return consumers_[id]; }
  // (issue 17) the ids of the first fresh load's nodes, in the order of its
  // bytes (NpuAmpGrMirrorPositionsBase: the Python graph's node ids of the
  // graph as created, Graph._seq, number them so)
  std::vector<int32_t> base_ids;

  // (issue 17) the first load on a helper thread (NpuAmpGrMirrorLoadAsync):
  // the mirror is its until Join(); every entry but New joins first
  npu_amp_tf::Job loader;  // (on a kept helper thread, worker.h)
  int load_rc = 0;  // the helper's LoadGraphDef: 0 ok, 1 refused (read after the join)
  void Join() {
    if (loader.joinable()) loader.join();
  }
  ~Mirror() { Join(); }
  void ClearPositions() {
    for (auto& n : nodes_) n.pos = kNoPos;
  }

 private:
  void Link(int32_t id) {
    const InputList& ins = nodes_[id].inputs;
    for (size_t i = 0; i < ins.size(); ++i) {
      consumers_[ins[i].src].emplace_back(id, ins[i].ctrl ? -1 : static_cast<int32_t>(i));
    }
  }

  void Unlink(int32_t id) {
    for (const auto& in : nodes_[id].inputs) {
      auto& v = consumers_[in.src];
      v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& c) { return c.first == id; }),
              v.end());
    }
  }

  // (declared before every member that allocates from it: destroyed after them)
  std::pmr::monotonic_buffer_resource pool_{1 << 16};
  std::deque<string> buffers_;  // (a deque: every view stays valid)
  std::vector<string_view> names_;
  npu_amp_tf::NameTable ids_;
  std::vector<Node> nodes_;
  std::vector<ReaderList> consumers_;
  struct ViewHash {
    size_t operator()(string_view s) const { return npu_amp_tf::NameTable::Hash(s); }
  };
  std::unordered_set<string_view, ViewHash> before_;

 public:
  // the searches' per-id scratch (Search)
  Stamped<char> in_region, fwd_dep, dy_dep, val_static, done, fwd, out_node, side_node, prot,
      seen;
  Stamped<signed char> static_memo, in_memo, anc_memo, owner_memo;
  std::vector<string> owners;
  std::string norm_text;  // NpuAmpGrAnalyzeNorms' answer
};

// ---------------------------------------------------------------- loading
// Every NodeDef of a serialized GraphDef (name, op, inputs: ViewsOfBytes,
// the bridge's reader) upserted; the mirror keeps a copy the views point into.
bool LoadGraphDef(Mirror* m, const char* bytes, size_t len, bool fresh) {
  npu_amp_tf::GraphViews v;
  v.want_defs = fresh;
  if (!npu_amp_tf::ViewsOfBytes(m->Keep(bytes, len), &v)) return false;
  const bool first = fresh && m->size() == 0;
  // (a fresh load links the readers after every node is in: each list grown once)
  std::vector<int32_t> ids;
  if (fresh) ids.reserve(v.name.size());
  for (size_t i = 0; i < v.name.size(); ++i) {
    const string_view* ins = v.input.data() + v.in_start[i];
    const size_t n_ins = static_cast<size_t>(v.in_start[i + 1] - v.in_start[i]);
    int32_t id = -1;
    if (!m->Upsert(v.name[i], v.op[i], ins, n_ins, fresh, fresh ? v.def[i] : string_view(),
                   /*link=*/!fresh, &id)) {
      m->base_ids.clear();
      return false;
    }
    if (fresh) ids.push_back(id);
  }
  if (fresh) m->LinkLoaded(ids);
  if (first) m->base_ids = std::move(ids);
  return true;
}

// LoadGraphDef, the mirror's tables reserved first for a fresh load.
bool LoadBytes(Mirror* m, const char* bytes, size_t len, bool fresh) {
  if (fresh) m->Reserve(m->size() + len / 128);  // (a NodeDef of a training graph: ~160 bytes)
  return LoadGraphDef(m, bytes, len, fresh);
}

// ---------------------------------------------------------------- the search
using DyCallback = int (*)(const char* ref, size_t len);

enum Status { kFound = 0, kRefused = 1, kNoDy = 2, kUnable = 3 };

enum Kind { kG, kF, kIn, kStatic, kDy, kOut, kExt, kCtrlExt };

struct Unable {};  // the callback failed: Python searches

class Search {
  Mirror& m_;
  DyCallback cb_;

 public:
  // (the per-id state lives in the mirror's stamped scratch: nothing O(graph) per search)
  Search(Mirror& m, DyCallback cb)
      : m_(m),
        cb_(cb),
        fwd(m.fwd),
        out_node(m.out_node),
        side_node(m.side_node),
        prot(m.prot),
        in_region(m.in_region),
        fwd_dep(m.fwd_dep),
        dy_dep(m.dy_dep),
        val_static(m.val_static),
        done_(m.done),
        static_memo_(m.static_memo),
        in_memo_(m.in_memo),
        anc_memo_(m.anc_memo),
        owner_memo_(m.owner_memo),
        owners_(m.owners) {}

  // the request's fields
  std::vector<string> fwd_sorted;
  std::vector<int32_t> fwd_ids;
  Stamped<char>& fwd;        // per id
  Stamped<char>& out_node;   // per id: a node of `outputs`
  std::vector<std::pair<int32_t, int64_t>> outs;
  std::unordered_set<string> ins, side;
  Stamped<char>& side_node;  // per id
  Stamped<char>& prot;       // per id
  string fscope;
  std::vector<string> owner_scopes;
  int64_t max_nodes = 4000;
  bool grad_reads_output = false;
  bool stop_at_dy = true;
  // (the layer-norm plan) dy's question answered in C++: 1 / 0, or throws Unable
  std::function<int(const InputRef&)> cand;

  // the result
  std::vector<int32_t> region;  // insertion order
  Stamped<char>& in_region;
  Stamped<char>& fwd_dep;
  Stamped<char>& dy_dep;
  Stamped<char>& val_static;
  std::vector<std::pair<int32_t, string>> why_not;
  string dy;  // canonical ref, or empty
  bool has_dy = false;
  string refusal;

  // a new search over the mirror's n ids: every per-id value forgotten
  void Begin(size_t n) {
    n_ = n;
    for (Stamped<char>* a : std::initializer_list<Stamped<char>*>{&fwd, &out_node, &side_node, &prot, &in_region, &fwd_dep, &dy_dep,
                             &val_static, &done_}) {
      a->Begin(n, 0);
    }
    static_memo_.Begin(n, -1);
    in_memo_.Begin(n, -1);
    anc_memo_.Begin(n, -1);
    owner_memo_.Begin(n, -2);
    if (owners_.size() < n) owners_.resize(Headroom(n));
  }

  // pass A, then pass B; kFound / kRefused / kNoDy
  Status Run() {
    std::vector<int32_t> seeds;
    std::sort(fwd_ids.begin(), fwd_ids.end());
    fwd_ids.erase(std::unique(fwd_ids.begin(), fwd_ids.end()), fwd_ids.end());
    for (int32_t id : fwd_ids) {
      for (const auto& c : m_.consumers(id)) {
        if (!fwd.get(c.first)) seeds.push_back(c.first);
      }
    }
    if (!Grow(seeds, stop_at_dy)) return kRefused;
    if (!has_dy) return kNoDy;
    const string found = dy;
    ClearPass();
    string_view dname;
    int64_t dport;
    bool dctrl;
    ParseRef(found, &dname, &dport, &dctrl);
    const int32_t dsrc = m_.Find(dname);
    std::vector<int32_t> readers;
    if (dsrc >= 0) {
      for (const auto& c : m_.consumers(dsrc)) {  // graph.consumers(dsrc, port=dport)
        if (c.second >= 0 && m_.node(c.first).inputs[c.second].port == dport) {
          readers.push_back(c.first);
        }
      }
      for (const auto& c : m_.consumers(dsrc)) {
        if (c.second < 0) readers.push_back(c.first);
      }
    }
    // the readers of dy's Identity aliases
    std::vector<int32_t> stack;
    for (int32_t c : readers) {
      if (IsIdentityLike(m_.node(c).op)) stack.push_back(c);
    }
    std::unordered_set<int32_t> seen_alias;
    while (!stack.empty()) {
      const int32_t a = stack.back();
      stack.pop_back();
      if (seen_alias.count(a) || IdentityRoot(m_.name(a)) != found) continue;
      seen_alias.insert(a);
      for (const auto& c : m_.consumers(a)) {
        readers.push_back(c.first);
        if (c.second >= 0 && IsIdentityLike(m_.node(c.first).op)) stack.push_back(c.first);
      }
    }
    seeds.insert(seeds.end(), readers.begin(), readers.end());
    if (!Grow(seeds, false)) return kRefused;
    if (dy != found) {
      refusal = "not fused: the incoming gradient is not one tensor";
      why_not.clear();
      return kRefused;
    }
    return kFound;
  }

 private:
  void ClearPass() {
    for (Stamped<char>* a : std::initializer_list<Stamped<char>*>{&in_region, &fwd_dep, &dy_dep, &val_static, &done_}) {
      a->Begin(n_, 0);
    }
    region.clear();
    why_not.clear();
  }

  // (a node is tried once per pass, Grow's `done`: once in why_not)
  void WhyNot(int32_t id, string msg) { why_not.emplace_back(id, std::move(msg)); }

  // _grow: a heap on (position, name); false when the region grew too large
  bool Grow(const std::vector<int32_t>& seeds, bool stop) {
    using Item = std::pair<double, int32_t>;
    auto later = [this](const Item& a, const Item& b) {
      if (a.first != b.first) return a.first > b.first;
      return m_.name(a.second) > m_.name(b.second);
    };
    std::priority_queue<Item, std::vector<Item>, decltype(later)> heap(later);
    auto key = [this](int32_t id) {
      const double p = m_.pos(id);
      return std::isnan(p) ? 0.0 : p;
    };
    std::unordered_set<int32_t> uniq(seeds.begin(), seeds.end());
    for (int32_t s : uniq) heap.emplace(key(s), s);
    while (!heap.empty()) {
      const int32_t id = heap.top().second;
      heap.pop();
      if (done_.get(id)) continue;
      done_.set(id, 1);
      int r = TryAdd(id);
      if (r < 0) return false;
      if (r == 1) {
        if (stop && has_dy) return true;
        for (const auto& c : m_.consumers(id)) {
          if (!in_region.get(c.first) && !done_.get(c.first)) heap.emplace(key(c.first), c.first);
        }
      }
    }
    return true;
  }

  bool InOuts(int32_t id, int64_t port) const {
    for (const auto& o : outs) {
      if (o.first == id && o.second == port) return true;
    }
    return false;
  }

  // _identity_root
  string IdentityRoot(string_view ref0) const {
    string ref(ref0);
    for (int i = 0; i < 32; ++i) {
      string_view name;
      int64_t port;
      bool ctrl;
      if (!ParseRef(ref, &name, &port, &ctrl)) break;
      const int32_t id = m_.Find(name);
      if (!m_.Alive(id) || ctrl || port != 0 || !IsIdentityLike(m_.node(id).op)) break;
      const InputRef* first = nullptr;
      for (const auto& in : m_.node(id).inputs) {
        if (in.ref.empty() || in.ref[0] != '^') {
          first = &in;
          break;
        }
      }
      if (first == nullptr) break;
      ref = first->ref;
    }
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &name, &port, &ctrl)) return ref;
    return Canon(name, port, ctrl);
  }

  // _Static.__call__
  bool IsStatic(int32_t id, int depth = 0) {
    if (id < 0) return false;
    const signed char memo = static_memo_.get(id);
    if (memo >= 0) return memo == 1;
    if (!m_.Alive(id) || depth > 32) return false;
    const Node& n = m_.node(id);
    bool res;
    if (n.op == "Const" || m_.ops.shape.count(n.op)) {
      res = true;
    } else if (m_.ops.static_arith.count(n.op)) {
      bool any = false;
      res = true;
      for (const auto& in : n.inputs) {
        if (in.ctrl) continue;
        any = true;
        if (!IsStatic(in.src, depth + 1)) {
          res = false;
          break;
        }
      }
      res = res && any;
    } else {
      res = false;
    }
    static_memo_.set(id, res ? 1 : 0);
    return res;
  }

  // from_inputs
  bool FromInputs(int32_t id, int depth = 0) {
    const signed char memo = in_memo_.get(id);
    if (memo >= 0) return memo == 1;
    bool res = false;
    if (m_.Alive(id) && m_.ops.from_input.count(m_.node(id).op) && depth < 8 && !fwd.get(id)) {
      bool any = false;
      res = true;
      for (const auto& in : m_.node(id).inputs) {
        if (in.ctrl) continue;
        any = true;
        if (!(ins.count(Canon(m_.name(in.src), in.port, false)) || IsStatic(in.src) ||
              FromInputs(in.src, depth + 1))) {
          res = false;
          break;
        }
      }
      res = res && any;
    }
    in_memo_.set(id, res ? 1 : 0);
    return res;
  }

  // after_forward (with a topological order; the caller ran only then)
  bool AfterForward(int32_t start) {
    const signed char memo = anc_memo_.get(start);
    if (memo >= 0) return memo == 1;
    auto inner = [this](int32_t id) {
      return fwd.get(id) && !out_node.get(id) && !side_node.get(id);
    };
    bool hit = false;
    const double limit = m_.pos(start);
    Stamped<char>& seen = m_.seen;
    seen.Begin(n_, 0);
    std::vector<int32_t> stack;
    if (!std::isnan(limit)) {  // (`start in pos`: a removed node's position stays)
      for (int32_t id : fwd_ids) {
        if (inner(id)) {
          seen.set(id, 1);
          stack.push_back(id);
        }
      }
      while (!stack.empty() && !hit) {
        const int32_t cur = stack.back();
        stack.pop_back();
        for (const auto& c : m_.consumers(cur)) {
          if (c.first == start) {
            hit = true;
            break;
          }
          if (seen.get(c.first) || out_node.get(c.first) || side_node.get(c.first)) continue;
          const double p = m_.pos(c.first);
          if (std::isnan(p) || p >= limit) continue;
          seen.set(c.first, 1);
          stack.push_back(c.first);
        }
      }
    } else {
      seen.set(start, 1);
      stack.push_back(start);
      while (!stack.empty() && !hit) {
        const int32_t cur = stack.back();
        stack.pop_back();
        if (!m_.Alive(cur)) continue;
        for (const auto& in : m_.node(cur).inputs) {
          if (inner(in.src)) {
            hit = true;
            break;
          }
          if (seen.get(in.src) || InOuts(in.src, 0)) continue;
          seen.set(in.src, 1);
          stack.push_back(in.src);
        }
      }
    }
    anc_memo_.set(start, hit ? 1 : 0);
    return hit;
  }

  // attributed_forward (memoised per name: the graph does not change)
  const string* Owner(int32_t id) {
    if (owner_memo_[id] == -2) {
      owner_memo_.set(id, Attributed(m_.name(id), &owners_[id]) ? 1 : 0);
    }
    return owner_memo_[id] == 1 ? &owners_[id] : nullptr;
  }

  bool Known(string_view n) const { return m_.Alive(m_.Find(n)) || m_.known_before(n); }

  bool Attributed(string_view name, string* out) const {
    if (GrapplerMade(name)) return false;
    Groups m = Tf1(name);
    if (m.ok) {
      for (const string& cand : {string(m.prefix) + string(m.tail), string(m.tail)}) {
        if (Known(cand)) {
          *out = cand;
          return true;
        }
      }
      return false;
    }
    m = Tf2(name);
    if (m.ok) {
      std::vector<string_view> parts = Split(m.tail, '/');
      for (size_t k = parts.size() - 1; k > 0; --k) {
        string joined;
        for (size_t i = 0; i < k; ++i) {
          if (i) joined.push_back('/');
          joined.append(parts[i]);
        }
        for (const string& cand : {string(m.prefix) + joined, joined}) {
          if (Known(cand)) {
            *out = cand;
            return true;
          }
        }
      }
    }
    return false;
  }

  // _tf2_scope_owner
  const string* Tf2ScopeOwner(string_view name) const {
    Groups m = Tf2(name);
    if (!m.ok) return nullptr;
    for (const string& rest : {string(m.prefix) + string(m.tail), string(m.tail)}) {
      string_view scope = rest.find('/') != string::npos ? Parent(rest) : string_view();
      for (const string& f : fwd_sorted) {
        if (StartsWith(rest, f + "/") || (!scope.empty() && Parent(f) == scope)) return &f;
      }
    }
    return nullptr;
  }

  Kind Classify(const InputRef& in, string* canon) {
    const int32_t n = in.src;
    if (in_region[n]) return kG;
    if (InOuts(n, in.port)) return kOut;
    if (fwd[n]) return kF;
    *canon = Canon(m_.name(n), in.port, in.ctrl);
    if (ins.count(*canon) || FromInputs(n)) return kIn;
    if (has_dy) {
      const string ref(in.ref);
      auto it = roots_.find(ref);
      if (it == roots_.end()) it = roots_.emplace(ref, IdentityRoot(in.ref)).first;
      if (it->second == dy) return kDy;
    }
    if (IsStatic(n)) return kStatic;
    return kExt;
  }

  // try_add: 1 joined, 0 not, -1 the region grew beyond max_nodes
  int TryAdd(int32_t id) {
    if (in_region[id] || fwd[id]) return 0;
    if (!m_.Alive(id)) return 0;
    const Node& node = m_.node(id);
    const string_view name = m_.name(id);
    const string_view op = node.op;
    if (!m_.ops.grad.count(op)) {
      WhyNot(id, "op " + string(op) + " is not a gradient op");
      return 0;
    }
    if (prot[id]) {
      WhyNot(id, "it is fetched or preserved");
      return 0;
    }
    const bool autodiff = IsAutodiff(name);
    const bool agg = m_.ops.aggregation.count(op) != 0;
    if (!autodiff && !agg) {
      WhyNot(id, "its name is not in an autodiff scope (gradients/, gradient_tape/)");
      return 0;
    }
    const string* owner = Owner(id);
    if (owner != nullptr) {
      const int32_t oid = m_.Find(*owner);
      if (oid < 0 || !fwd[oid]) {
        WhyNot(id, "its name makes it part of the gradient of '" + *owner + "'");
        return 0;
      }
    }
    const bool outside_scope =
        owner == nullptr && !fscope.empty() && autodiff && !UnderScope(name, fscope);
    bool has_owner = owner != nullptr;
    if (!has_owner) has_owner = Tf2ScopeOwner(name) != nullptr;
    if (!has_owner && autodiff && !fwd_sorted.empty()) {
      for (const string& sc : owner_scopes) {
        if (UnderScope(name, sc)) {
          has_owner = true;
          break;
        }
      }
    }
    struct K {
      Kind kind;
      int32_t src;
    };
    std::vector<K> kinds;
    string new_dy;
    bool has_new_dy = false;
    bool ctrl_in_region = false;
    string_view dy_node;
    int64_t dyp;
    bool dyc;
    if (has_dy) ParseRef(dy, &dy_node, &dyp, &dyc);
    string canon;
    for (const auto& in : node.inputs) {
      if (in.ctrl) {
        if (in_region[in.src]) {
          ctrl_in_region = true;
          continue;
        }
        if (fwd[in.src] || (has_dy && m_.name(in.src) == dy_node)) continue;
        if (IsStatic(in.src)) continue;
        kinds.push_back(K{kCtrlExt, in.src});
        continue;
      }
      Kind k = Classify(in, &canon);
      if (k == kExt) {
        if (!has_dy && !has_new_dy) {
          const int r = cand ? cand(in) : cb_(in.ref.data(), in.ref.size());
          if (r < 0) throw Unable();
          if (r == 1 && !AfterForward(in.src)) {
            new_dy = IdentityRoot(in.ref);
            has_new_dy = true;
            k = kDy;
          }
        }
        if (k == kExt) {
          WhyNot(id, "it reads '" + string(in.ref) + "', which is neither the gradient nor the fused region's");
          return 0;
        }
      }
      if (k == kOut && !grad_reads_output) {
        WhyNot(id, "it reads the fused op's output '" + string(in.ref) + "'");
        return 0;
      }
      kinds.push_back(K{k, in.src});
    }
    bool any_data = false, all_g = true, all_f_static = true, reads_dy = false, has_out = false,
         has_g = false, has_f = false, g_dy = false;
    for (const K& k : kinds) {
      if (k.kind == kCtrlExt) continue;
      any_data = true;
      all_g = all_g && k.kind == kG;
      all_f_static = all_f_static && (k.kind == kF || k.kind == kStatic);
      reads_dy = reads_dy || k.kind == kDy;
      has_out = has_out || k.kind == kOut;
      has_g = has_g || k.kind == kG;
      has_f = has_f || k.kind == kF;
    }
    for (const K& k : kinds) {
      if (k.kind == kG && dy_dep[k.src]) g_dy = true;
    }
    if (outside_scope && !(agg && any_data && all_g) &&
        !(m_.ops.value_static.count(op) != 0 && any_data && all_f_static) && op != "NoOp" && op != "Const") {
      WhyNot(id, "its name is outside the fused ops' scope '" + fscope + "'");
      return 0;
    }
    if (!autodiff && any_data && !all_g) {
      WhyNot(id, "a sum outside an autodiff scope that reads more than the region");
      return 0;
    }
    if (agg && reads_dy) {
      WhyNot(id, "it sums the incoming gradient with another gradient (a residual path)");
      return 0;
    }
    if (has_out && !(reads_dy || has_new_dy || g_dy)) {
      WhyNot(id, "it reads the fused op's output but no gradient (a forward reader)");
      return 0;
    }
    if (reads_dy && !grad_reads_output && g_dy) {
      WhyNot(id, "it combines the incoming gradient with a gradient already derived from it");
      return 0;
    }
    if (node.inputs.empty()) return 0;
    const bool from_g = ctrl_in_region || has_g;
    if (!from_g && !has_f && !reads_dy) return 0;
    const bool via_dy = !from_g && !has_f;
    if (via_dy && (!has_owner || agg)) {
      WhyNot(id, "it reads only the incoming gradient and its name ties it to no fused op");
      return 0;
    }
    if (has_new_dy) {
      dy = new_dy;
      has_dy = true;
    }
    in_region.set(id, 1);
    region.push_back(id);
    const bool vstatic_op = m_.ops.value_static.count(op) != 0;
    bool fdep = false, vs = true;
    for (const K& k : kinds) {
      if ((k.kind == kF && !vstatic_op) || (k.kind == kG && fwd_dep[k.src])) fdep = true;
      if (k.kind != kCtrlExt && !(k.kind == kStatic || (k.kind == kG && val_static[k.src]))) {
        vs = false;
      }
    }
    fwd_dep.set(id, fdep);
    dy_dep.set(id, reads_dy || g_dy);
    val_static.set(id, vstatic_op || (m_.ops.static_arith.count(op) && vs));
    if (static_cast<int64_t>(region.size()) > max_nodes) {
      refusal = "the gradient region grew beyond " + std::to_string(max_nodes) + " nodes";
      why_not.clear();
      return -1;
    }
    return 1;
  }

  size_t n_ = 0;
  Stamped<char>& done_;
  Stamped<signed char>& static_memo_;
  Stamped<signed char>& in_memo_;
  Stamped<signed char>& anc_memo_;
  Stamped<signed char>& owner_memo_;
  std::vector<string>& owners_;
  std::unordered_map<string, string> roots_;
};

// ---------------------------------------------------------------- shapes
// (issue 17, graph_passes.shapes.NATIVE_WALK) local_shape's walk
// (graph_passes/shapes.py: _head, _op_shape, _const_ints, _const_ints_walk,
// const_node, tensor_value, _broadcast, _known) over the mirror: the same
// rules, in the same order (an input is walked exactly when Python's walk
// would walk it), with the same memo semantics (an answer, once given, is
// kept).  The structure (ops, inputs, which nodes are alive) is the mirror's,
// current after a sync; attrs are read from the NodeDef bytes of the fresh
// load, so a node upserted or removed since (`dirty`) whose attrs the walk
// needs makes it give up (kShapeAbort): Python walks that tensor itself.  It
// also gives up on what it does not decode the way Python does (a tensor in
// a form tensor_value leaves to tf.make_ndarray, a tensor named "x:0", a
// cycle), so every answer it gives is Python's.
namespace wire = npu_amp_tf;

bool ReadBytes(const char*& p, const char* end, string_view* out) {
  uint64_t len;
  if (!wire::ReadVarint(p, end, &len) || len > static_cast<uint64_t>(end - p)) return false;
  *out = string_view(p, len);
  p += len;
  return true;
}

struct Bad {};  // malformed bytes, or a form the walk leaves to Python

// The AttrValue bytes of attr `key` of the NodeDef `def` (the map's last
// entry for it); false when it has none.
bool FindAttr(string_view def, string_view key, string_view* val) {
  const char* p = def.data();
  const char* end = p + def.size();
  bool found = false;
  while (p < end) {
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    if (tag != ((5 << 3) | 2)) {
      if (!wire::SkipField(p, end, tag & 7)) throw Bad();
      continue;
    }
    string_view entry;
    if (!ReadBytes(p, end, &entry)) throw Bad();
    const char* q = entry.data();
    const char* qe = q + entry.size();
    string_view k, v;
    bool has_k = false;
    while (q < qe) {
      uint64_t t;
      if (!wire::ReadVarint(q, qe, &t)) throw Bad();
      if ((t >> 3) == 1 && (t & 7) == 2) {
        if (!ReadBytes(q, qe, &k)) throw Bad();
        has_k = true;
      } else if ((t >> 3) == 2 && (t & 7) == 2) {
        if (!ReadBytes(q, qe, &v)) throw Bad();
      } else if (!wire::SkipField(q, qe, t & 7)) {
        throw Bad();
      }
    }
    if (has_k && k == key) {
      *val = v;
      found = true;
    }
  }
  return found;
}

// An AttrValue's oneof: the field set last (a message field given twice
// would be merged by protobuf: Bad), and the views of b, shape, tensor, list.
struct AttrView {
  uint64_t last = 0;
  bool b = false;
  string_view msg;  // shape / tensor / list bytes when `last` is 7 / 8 / 1
  explicit AttrView(string_view a) {
    const char* p = a.data();
    const char* end = p + a.size();
    int msgs = 0;
    while (p < end) {
      uint64_t tag;
      if (!wire::ReadVarint(p, end, &tag)) throw Bad();
      const uint64_t f = tag >> 3, wt = tag & 7;
      if (f == 0 || f > 10) {
        if (!wire::SkipField(p, end, wt)) throw Bad();
        continue;
      }
      last = f;
      if ((f == 5 && wt != 0) || ((f == 1 || f == 7 || f == 8) && wt != 2)) throw Bad();
      if (f == 5) {
        uint64_t x;
        if (!wire::ReadVarint(p, end, &x)) throw Bad();
        b = x != 0;
      } else if (f == 1 || f == 7 || f == 8) {
        if (!ReadBytes(p, end, &msg) || ++msgs > 1) throw Bad();
      } else if (!wire::SkipField(p, end, wt)) {
        throw Bad();
      }
    }
  }
  bool get_b() const { return last == 5 && b; }
  string_view get(uint64_t f) const { return last == f ? msg : string_view(); }
};

// A TensorShapeProto: its dims' sizes, or false when unknown_rank.
bool ShapeDims(string_view s, std::vector<int64_t>* dims) {
  dims->clear();
  bool unknown = false;
  const char* p = s.data();
  const char* end = p + s.size();
  while (p < end) {
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    if (tag == ((2 << 3) | 2)) {
      string_view d;
      if (!ReadBytes(p, end, &d)) throw Bad();
      int64_t size = 0;
      const char* q = d.data();
      const char* qe = q + d.size();
      while (q < qe) {
        uint64_t t, x;
        if (!wire::ReadVarint(q, qe, &t)) throw Bad();
        if (t == ((1 << 3) | 0)) {
          if (!wire::ReadVarint(q, qe, &x)) throw Bad();
          size = static_cast<int64_t>(x);
        } else if (!wire::SkipField(q, qe, t & 7)) {
          throw Bad();
        }
      }
      dims->push_back(size);
    } else if (tag == ((3 << 3) | 0)) {
      uint64_t x;
      if (!wire::ReadVarint(p, end, &x)) throw Bad();
      unknown = x != 0;
    } else if (!wire::SkipField(p, end, tag & 7)) {
      throw Bad();
    }
  }
  return !unknown;
}

// A TensorProto's dtype, shape, content and int_val / int64_val.
struct TensorView {
  uint64_t dtype = 0;
  string_view shape, content;
  std::vector<int64_t> int_val, int64_val;
  std::vector<float> float_val;
  std::vector<double> double_val;
  explicit TensorView(string_view t) {
    const char* p = t.data();
    const char* end = p + t.size();
    int shapes = 0;
    while (p < end) {
      uint64_t tag, x;
      if (!wire::ReadVarint(p, end, &tag)) throw Bad();
      const uint64_t f = tag >> 3, wt = tag & 7;
      if (f == 1 && wt == 0) {
        if (!wire::ReadVarint(p, end, &dtype)) throw Bad();
      } else if (f == 2 && wt == 2) {
        if (!ReadBytes(p, end, &shape) || ++shapes > 1) throw Bad();
      } else if (f == 4 && wt == 2) {
        if (!ReadBytes(p, end, &content)) throw Bad();
      } else if ((f == 5 && (wt == 5 || wt == 2)) || (f == 6 && (wt == 1 || wt == 2))) {
        // float_val / double_val, one fixed-width value or a packed run of them
        const size_t w = f == 5 ? 4 : 8;
        string_view run;
        if (wt == 2) {
          if (!ReadBytes(p, end, &run) || run.size() % w) throw Bad();
        } else {
          if (static_cast<size_t>(end - p) < w) throw Bad();
          run = string_view(p, w);
          p += w;
        }
        for (size_t i = 0; i < run.size(); i += w) {
          if (w == 4) {
            float v;
            std::memcpy(&v, run.data() + i, 4);
            float_val.push_back(v);
          } else {
            double v;
            std::memcpy(&v, run.data() + i, 8);
            double_val.push_back(v);
          }
        }
      } else if ((f == 7 || f == 10) && (wt == 0 || wt == 2)) {
        // int_val (int32) / int64_val, one varint or a packed run of them
        auto read_one = [&](const char*& q, const char* qe) {
          if (!wire::ReadVarint(q, qe, &x)) throw Bad();
          (f == 7 ? int_val : int64_val).push_back(
              f == 7 ? static_cast<int64_t>(static_cast<int32_t>(x)) : static_cast<int64_t>(x));
        };
        if (wt == 0) {
          read_one(p, end);
        } else {
          string_view run;
          if (!ReadBytes(p, end, &run)) throw Bad();
          const char* q = run.data();
          while (q < run.data() + run.size()) read_one(q, run.data() + run.size());
        }
      } else if (!wire::SkipField(p, end, wt)) {
        throw Bad();
      }
    }
  }
};

using Dims = std::vector<int64_t>;

// The TensorShapeProtos of an AttrValue holding a list of shapes
// (`_output_shapes`, `_handle_shapes`): ListValue.shape = 7, repeated.
std::vector<string_view> ListShapes(string_view attr) {
  const string_view list = AttrView(attr).get(1);
  std::vector<string_view> out;
  const char* p = list.data();
  const char* end = p + list.size();
  while (p < end) {
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    if (tag == ((7 << 3) | 2)) {
      string_view s;
      if (!ReadBytes(p, end, &s)) throw Bad();
      out.push_back(s);
    } else if (!wire::SkipField(p, end, tag & 7)) {
      throw Bad();
    }
  }
  return out;
}

// shapes.static_shapes(node)[port] of a NodeDef's bytes, when it is there
// with a known rank
bool OutputShapeAt(string_view def, int64_t port, Dims* out) {
  string_view a;
  if (!FindAttr(def, "_output_shapes", &a)) return false;
  const std::vector<string_view> shapes = ListShapes(a);
  return port >= 0 && port < static_cast<int64_t>(shapes.size()) && ShapeDims(shapes[port], out);
}

struct ShapeEntry {
  bool done = false;  // false: in progress
  bool known = false;
  Dims dims;
};

// One ShapeOracle's memo (its answers outlive any one mirror).
struct ShapeMemo {
  std::unordered_map<string, ShapeEntry> map;
};

constexpr int kShapeAbort = -2;  // the walk gave up: Python walks the tensor
constexpr int kShapeNone = -1;   // no fully known shape

bool Known(const Dims& d) {
  for (int64_t x : d) {
    if (x < 0) return false;
  }
  return true;
}

// The walk: Step() computes one tensor's shape from the memo, or names the
// input whose shape it needs first (then runs again from the start: every
// input it read before is in the memo by then).
// A node's attrs are read: those of the fresh load, while it is clean.
string_view CleanDef(const Node& n) {
  if (n.dirty || n.def.empty()) throw Bad();
  return n.def;
}

enum ConstKind { kNotConst = 0, kConstInts = 1, kConstOther = 2 };

// The Const behind `ref` through at most 8 Identity ops (shapes.const_node,
// by name: the port and a '^' ignored): kConstInts with its int32 / int64
// values in *out (shapes.tensor_value's), kConstOther for a float or bool
// one, kNotConst; Bad for a form Python's decoding decides (tf.make_ndarray:
// other dtypes, a short value list, an unknown dim).
int ConstIntsAt(const Mirror& m, string_view ref, Dims* out) {
  string_view name;
  int64_t port;
  bool ctrl;
  ParseRef(ref, &name, &port, &ctrl);
  const int32_t id = m.Find(name);
  const Node* n = m.Alive(id) ? &m.node(id) : nullptr;
  for (int depth = 0; n != nullptr && n->op == "Identity" && !n->inputs.empty() && depth < 8;
       ++depth) {
    n = m.Alive(n->inputs[0].src) ? &m.node(n->inputs[0].src) : nullptr;
  }
  if (n == nullptr || n->op != "Const") return kNotConst;
  string_view a;
  if (!FindAttr(CleanDef(*n), "value", &a)) throw Bad();  // (Python's attr["value"] would add one)
  const TensorView t(AttrView(a).get(8));
  if (t.dtype == 1 || t.dtype == 2 || t.dtype == 10 || t.dtype == 19) return kConstOther;
  if (t.dtype != 3 && t.dtype != 9) throw Bad();  // (tf.make_ndarray's)
  Dims shape;
  ShapeDims(t.shape, &shape);  // (Python reads the dims whatever unknown_rank says)
  int64_t n_el = 1;
  for (int64_t d : shape) {
    if (d < 0) throw Bad();
    n_el *= d;
  }
  out->clear();
  if (!t.content.empty()) {
    const size_t item = t.dtype == 3 ? 4 : 8;
    if (t.content.size() != static_cast<size_t>(n_el) * item) throw Bad();
    for (int64_t i = 0; i < n_el; ++i) {
      if (item == 4) {
        int32_t v;
        std::memcpy(&v, t.content.data() + i * 4, 4);
        out->push_back(v);
      } else {
        int64_t v;
        std::memcpy(&v, t.content.data() + i * 8, 8);
        out->push_back(v);
      }
    }
    return kConstInts;
  }
  const Dims& vals = t.dtype == 3 ? t.int_val : t.int64_val;
  if (static_cast<int64_t>(vals.size()) != n_el || vals.empty()) throw Bad();
  *out = vals;
  return kConstInts;
}

class ShapeWalk {
 public:
  ShapeWalk(const Mirror& m, ShapeMemo& memo) : m_(m), memo_(memo) {}

  // The shape of `ref`: its rank (dims in *out), kShapeNone, or kShapeAbort.
  int Ask(string_view ref, Dims* out) {
    auto it = memo_.map.find(string(ref));
    if (it != memo_.map.end()) {
      if (!it->second.done) return kShapeAbort;
      return Result(it->second, out);
    }
    std::vector<string> stack{string(ref)};
    memo_.map[stack.back()];  // in progress
    try {
      while (!stack.empty()) {
        need_.clear();
        value_.clear();
        const Outcome o = Step(stack.back());
        if (o == kNeed) {
          auto ins = memo_.map.emplace(need_, ShapeEntry());
          if (!ins.second) throw Bad();  // (in progress: a cycle)
          stack.push_back(need_);
          continue;
        }
        ShapeEntry& e = memo_.map[stack.back()];
        e.done = true;
        e.known = o == kValue && Known(value_);
        if (e.known) e.dims = value_;
        stack.pop_back();
      }
    } catch (const Bad&) {
      for (const string& r : stack) memo_.map.erase(r);  // (nothing in progress stays)
      return kShapeAbort;
    }
    return Result(memo_.map[string(ref)], out);
  }

 private:
  enum Outcome { kValue, kNone, kNeed };

  static int Result(const ShapeEntry& e, Dims* out) {
    if (!e.known) return kShapeNone;
    *out = e.dims;
    return static_cast<int>(e.dims.size());
  }

  // The memo's answer for an input `ref`: true with *known / *dims when
  // there is one; false (need_ set) when the walk must compute it first.
  bool Get(string_view ref, bool* known, Dims* dims) {
    auto it = memo_.map.find(string(ref));
    if (it == memo_.map.end()) {
      need_ = string(ref);
      return false;
    }
    if (!it->second.done) throw Bad();  // (a cycle: Python's walk answers it)
    *known = it->second.known;
    *dims = it->second.dims;
    return true;
  }

  const Node* Alive(string_view name) const {
    const int32_t id = m_.Find(name);
    return m_.Alive(id) ? &m_.node(id) : nullptr;
  }

  static bool Attr(const Node& n, string_view key, string_view* val) {
    return FindAttr(CleanDef(n), key, val);
  }

  static bool BoolAttr(const Node& n, string_view key) {
    string_view a;
    return Attr(n, key, &a) && AttrView(a).get_b();
  }

  // _shape_attr: false for None
  static bool ShapeAttr(const Node& n, Dims* dims) {
    string_view a;
    if (!Attr(n, "shape", &a)) return false;
    return ShapeDims(AttrView(a).get(7), dims);
  }

  // _const_ints: false for None
  bool ConstInts(string_view ref, Dims* out) { return ConstIntsAt(m_, ref, out) == kConstInts; }

  // _const_ints_walk: false for None; throws nothing new, but may set need_
  // (then returns false with *needed true)
  bool ConstIntsWalk(string_view ref, Dims* out, bool* needed) {
    *needed = false;
    string_view name;
    int64_t port;
    bool ctrl;
    ParseRef(ref, &name, &port, &ctrl);
    const Node* n = Alive(name);
    if (n != nullptr && n->op == "Shape" && port == 0 && !ctrl && !n->inputs.empty()) {
      bool known;
      if (!Get(n->inputs[0].ref, &known, out)) {
        *needed = true;
        return false;
      }
      return known;
    }
    return ConstInts(ref, out);
  }

  Outcome Value(Dims d) {
    value_ = std::move(d);
    return kValue;
  }

  Outcome Step(const string& ref) {
    string_view name;
    int64_t port;
    bool ctrl;
    ParseRef(ref, &name, &port, &ctrl);
    if (!ctrl && port == 0 && name.size() != ref.size()) throw Bad();  // ("x:0": Python's own key)
    const Node* np = Alive(name);
    if (np == nullptr || ctrl) return kNone;
    const Node& n = *np;
    Dims d;
    string_view a;
    if (OutputShapeAt(CleanDef(n), port, &d)) return Value(d);
    const string_view op = n.op;
    if (port != 0) return kNone;
    if (op == "Const") {
      if (!Attr(n, "value", &a)) throw Bad();
      const TensorView t(AttrView(a).get(8));
      ShapeDims(t.shape, &d);  // (Python reads the dims whatever unknown_rank says)
      return Value(d);
    }
    if (op == "Placeholder" || op == "VariableV2") return ShapeAttr(n, &d) ? Value(d) : kNone;
    if (op == "VarHandleOp") return Value(Dims());
    // data inputs (Python: only read past input 0 for the ops that need them)
    std::vector<const InputRef*> data;
    for (const InputRef& in : n.inputs) {
      if (!in.ctrl) data.push_back(&in);
    }
    if (data.empty()) return kNone;
    const InputRef& first = *data[0];
    if (op == "ReadVariableOp") {
      const Node* h = m_.Alive(first.src) ? &m_.node(first.src) : nullptr;
      if (h == nullptr || h->op != "VarHandleOp") return kNone;
      return ShapeAttr(*h, &d) ? Value(d) : kNone;
    }
    const OpSets& ops = m_.ops;
    if (!ops.set) throw Bad();
    bool known;
    if (ops.same_shape.count(op)) {
      if (!Get(first.ref, &known, &d)) return kNeed;
      return known ? Value(d) : kNone;
    }
    const size_t nd = data.size();
    Dims x, y;
    bool kx, ky;
    if (ops.broadcast.count(op) && nd == 2) {
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      if (!Get(data[1]->ref, &ky, &y)) return kNeed;
      if (!ky) return kNone;
      return Broadcast(x, y, &d) ? Value(d) : kNone;
    }
    if ((op == "LayerNormGrad" || op == "RMSNormGrad") && nd >= 2) {
      if (!Get(data[1]->ref, &kx, &x)) return kNeed;
      return kx ? Value(x) : kNone;
    }
    if (op == "AddN") {
      for (const InputRef* in : data) {
        if (!Get(in->ref, &kx, &x)) return kNeed;
        if (kx) return Value(x);
      }
      return kNone;
    }
    if (ops.matmul.count(op) && nd >= 2) {
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      if (!Get(data[1]->ref, &ky, &y)) return kNeed;
      if (!ky || x.size() != 2 || y.size() != 2) return kNone;
      const bool ta = BoolAttr(n, "transpose_a"), tb = BoolAttr(n, "transpose_b");
      if ((ta ? x[0] : x[1]) != (tb ? y[1] : y[0])) return kNone;
      return Value(Dims{ta ? x[1] : x[0], tb ? y[0] : y[1]});
    }
    if (ops.batch_matmul.count(op) && nd == 2) {
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      if (!Get(data[1]->ref, &ky, &y)) return kNeed;
      if (!ky || x.size() < 2 || y.size() < 2) return kNone;
      const bool adj_a = BoolAttr(n, "adj_x"), adj_b = BoolAttr(n, "adj_y");
      const size_t rx = x.size(), ry = y.size();
      const int64_t mm = adj_a ? x[rx - 1] : x[rx - 2], ka = adj_a ? x[rx - 2] : x[rx - 1];
      const int64_t kb = adj_b ? y[ry - 1] : y[ry - 2], nn = adj_b ? y[ry - 2] : y[ry - 1];
      if (ka != kb) return kNone;
      const Dims bx(x.begin(), x.end() - 2), by(y.begin(), y.end() - 2);
      if (op == "BatchMatMul") {
        if (bx != by) return kNone;
        d = bx;
      } else if (!Broadcast(bx, by, &d)) {
        return kNone;
      }
      d.push_back(mm);
      d.push_back(nn);
      return Value(d);
    }
    bool needed;
    if ((op == "Fill" || op == "BroadcastTo") && nd == 2) {
      const bool ok = ConstIntsWalk(data[op == "Fill" ? 0 : 1]->ref, &d, &needed);
      if (needed) return kNeed;
      if (!ok) return kNone;
      for (int64_t v : d) {
        if (v < 0) return kNone;
      }
      return Value(d);
    }
    if (op == "Tile" && nd == 2) {
      Dims mult;
      const bool ok = ConstIntsWalk(data[1]->ref, &mult, &needed);
      if (needed) return kNeed;
      if (!ok) return kNone;
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx || x.size() != mult.size()) return kNone;
      for (size_t i = 0; i < x.size(); ++i) d.push_back(x[i] * mult[i]);
      return Value(d);
    }
    if (op == "Reshape" && nd == 2) {
      Dims target;
      const bool ok = ConstIntsWalk(data[1]->ref, &target, &needed);
      if (needed) return kNeed;
      if (!ok) return kNone;
      int minus = 0;
      for (int64_t v : target) {
        if (v < -1) return kNone;
        minus += v == -1;
      }
      if (minus > 1) return kNone;
      if (minus == 0) return Value(target);
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      int64_t total = 1, rest = 1;
      for (int64_t v : x) total *= v;
      for (int64_t v : target) {
        if (v != -1) rest *= v;
      }
      if (rest == 0 || total % rest) return kNone;
      for (int64_t v : target) d.push_back(v == -1 ? total / rest : v);
      return Value(d);
    }
    if (op == "Transpose" && nd == 2) {
      Dims perm;
      if (!ConstInts(data[1]->ref, &perm)) return kNone;
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      Dims sorted_perm = perm;
      std::sort(sorted_perm.begin(), sorted_perm.end());
      if (sorted_perm.size() != x.size()) return kNone;
      for (size_t i = 0; i < sorted_perm.size(); ++i) {
        if (sorted_perm[i] != static_cast<int64_t>(i)) return kNone;
      }
      for (int64_t p : perm) d.push_back(x[p]);
      return Value(d);
    }
    if (ops.reduce.count(op) && nd == 2) {
      Dims axes;
      if (!ConstInts(data[1]->ref, &axes)) return kNone;
      if (!Get(data[0]->ref, &kx, &x)) return kNeed;
      if (!kx) return kNone;
      const int64_t r = static_cast<int64_t>(x.size());
      std::vector<char> on(x.size(), 0);
      for (int64_t v : axes) {
        if (!(-r <= v && v < r)) return kNone;
        on[((v % r) + r) % r] = 1;
      }
      const bool keep = BoolAttr(n, "keep_dims");
      for (int64_t i = 0; i < r; ++i) {
        if (keep) {
          d.push_back(on[i] ? 1 : x[i]);
        } else if (!on[i]) {
          d.push_back(x[i]);
        }
      }
      return Value(d);
    }
    return kNone;
  }

  static bool Broadcast(const Dims& a0, const Dims& b0, Dims* out) {
    const size_t n = std::max(a0.size(), b0.size());
    Dims a(n - a0.size(), 1), b(n - b0.size(), 1);
    a.insert(a.end(), a0.begin(), a0.end());
    b.insert(b.end(), b0.begin(), b0.end());
    out->clear();
    for (size_t i = 0; i < n; ++i) {
      if (a[i] == b[i] || b[i] == 1) {
        out->push_back(a[i]);
      } else if (a[i] == 1) {
        out->push_back(b[i]);
      } else {
        return false;
      }
    }
    return true;
  }

  const Mirror& m_;
  ShapeMemo& memo_;
  string need_;
  Dims value_;
};

// ------------------------------------------------------- the norm analysis
// (issue 17, the C++ core's milestone 3: the layer-norm fusion's match)
// graph_passes/fusion/builtin.py _analyze_norm over the mirror, the same
// answer: LayerNorm `[gamma *] (x - mean) {* rsqrt(var + eps) | / sqrt(var +
// eps)} [+ beta]` (var: moments' Mean(SquaredDifference(x, [StopGradient]
// mean)) or Mean(Square|x*x (x - mean))), RMSNorm `[gamma *] x {* rsqrt(
// mean(x^2) + eps) | ...}`, with the refs as written and the inner nodes in
// Python's order (duplicates kept).  Bad: a form Python decides (an input
// count Python's unpacking would refuse, a Pow exponent, a node edited since
// the load whose attrs are read, a constant tf.make_ndarray decodes).
class NormAnalyzer {
 public:
  explicit NormAnalyzer(const Mirror& m) : m_(m) {}

  struct Result {
    bool rms = false;
    const InputRef *x = nullptr, *axes = nullptr, *eps = nullptr, *gamma = nullptr, *beta = nullptr;
    std::vector<int32_t> inner;
  };

  // false: no norm at `anchor` (Python's None)
  bool Analyze(int32_t anchor, Result* res) {
    const Node& a = m_.node(anchor);
    self_ = InputRef{anchor, 0, false, m_.name(anchor)};  // (the anchor's name as a reference)
    std::vector<std::pair<const InputRef*, const InputRef*>> roots;  // (product, beta)
    if (a.op == "Add" || a.op == "AddV2") {
      const InputRef *x, *y;
      Two(anchor, &x, &y);
      roots = {{x, y}, {y, x}};
    } else if (a.op == "Mul" || a.op == "RealDiv") {
      roots = {{&self_, nullptr}};
    }
    for (const auto& [prod, beta] : roots) {
      const int32_t p = Src(*prod);
      if (p < 0 || (m_.node(p).op != "Mul" && m_.node(p).op != "RealDiv")) continue;
      std::vector<Factor> factors;
      std::vector<int32_t> pinner;
      Product(*prod, &factors, &pinner, 0);
      std::vector<int32_t> inner = {anchor};
      for (int32_t n : pinner) {
        if (n != anchor) inner.push_back(n);
      }
      if (Classify(factors, inner, res)) {
        res->beta = beta;
        return true;
      }
    }
    return false;
  }

 private:
  struct Factor {
    bool div;
    const InputRef* ref;
  };
  struct Mean {
    const InputRef *x, *axes;
    int32_t node;
  };

  // _src: the node a data reference of output 0 names, or -1
  int32_t Src(const InputRef& r) const {
    if (r.ctrl || r.port != 0 || !m_.Alive(r.src)) return -1;
    return r.src;
  }
  string_view Op(int32_t id) const { return m_.node(id).op; }
  // `a, c = graph.data_inputs(node)`: exactly two, else Python's unpacking decides
  void Two(int32_t id, const InputRef** a, const InputRef** c) const {
    std::vector<const InputRef*> d = Data(id);
    if (d.size() != 2) throw Bad();
    *a = d[0];
    *c = d[1];
  }
  std::vector<const InputRef*> Data(int32_t id) const {
    std::vector<const InputRef*> d;
    for (const InputRef& in : m_.node(id).inputs) {
      if (!in.ctrl) d.push_back(&in);
    }
    return d;
  }

  void Product(const InputRef& ref, std::vector<Factor>* factors, std::vector<int32_t>* inner,
               int depth) const {
    const int32_t n = Src(ref);
    if (n >= 0 && depth < 4 && (Op(n) == "Mul" || Op(n) == "RealDiv")) {
      const InputRef *a, *c;
      Two(n, &a, &c);
      inner->push_back(n);
      Product(*a, factors, inner, depth + 1);
      if (Op(n) == "Mul") {
        Product(*c, factors, inner, depth + 1);
      } else {
        factors->push_back({true, c});
      }
      return;
    }
    factors->push_back({false, &ref});
  }

  bool MeanOf(const InputRef& ref, Mean* out) const {
    const int32_t n = Src(ref);
    if (n < 0 || Op(n) != "Mean") return false;
    string_view a;
    if (!FindAttr(CleanDef(m_.node(n)), "keep_dims", &a) || !AttrView(a).get_b()) return false;
    Two(n, &out->x, &out->axes);
    out->node = n;
    return true;
  }

  // const_value(...) of integer axes, sorted; false for None
  bool SortedAxes(const InputRef& ref, Dims* v) const {
    const int k = ConstIntsAt(m_, ref.ref, v);
    if (k == kConstOther) throw Bad();  // (a float "axes": numpy's comparison, in Python)
    std::sort(v->begin(), v->end());
    return k == kConstInts;
  }

  bool SameMean(const Mean& a, const Mean& b) const {
    if (a.node == b.node) return true;
    Dims va, vb;
    const bool ka = SortedAxes(*a.axes, &va), kb = SortedAxes(*b.axes, &vb);
    return a.x->ref == b.x->ref && ka && kb && va == vb;
  }

  bool SameAxes(const InputRef& a, const InputRef& c) const {
    Dims va, vc;
    const bool ka = SortedAxes(a, &va), kc = SortedAxes(c, &vc);
    return ka && kc && va == vc;
  }

  // _inv_std: (var ref, eps ref) of Rsqrt(v + eps) ('mul') / Sqrt(v + eps) ('div')
  bool InvStd(bool div, const InputRef& ref, std::vector<int32_t>* inner, const InputRef** var,
              const InputRef** eps) const {
    const int32_t n = Src(ref);
    if (n < 0 || Op(n) != (div ? "Sqrt" : "Rsqrt")) return false;
    const std::vector<const InputRef*> d = Data(n);
    if (d.empty()) throw Bad();  // (Python's [0] would raise)
    const int32_t add = Src(*d[0]);
    if (add < 0 || (Op(add) != "Add" && Op(add) != "AddV2")) return false;
    const InputRef *a, *c;
    Two(add, &a, &c);
    inner->push_back(n);
    inner->push_back(add);
    for (const auto& [v, e] : {std::pair{a, c}, std::pair{c, a}}) {
      const int32_t s = Src(*v);
      if (s >= 0 && Op(s) == "Mean") {
        *var = v;
        *eps = e;
        return true;
      }
    }
    return false;
  }

  bool Variance(const InputRef& ref, const Mean& mean, std::vector<int32_t>* inner) const {
    Mean mv;
    if (!MeanOf(ref, &mv)) return false;
    inner->push_back(mv.node);
    const int32_t sq = Src(*mv.x);
    if (sq < 0) return false;
    const string_view x = mean.x->ref;
    if (Op(sq) == "SquaredDifference") {
      const InputRef *a, *c;
      Two(sq, &a, &c);
      inner->push_back(sq);
      for (const auto& [xx, mm0] : {std::pair{a, c}, std::pair{c, a}}) {
        if (xx->ref != x) continue;
        const InputRef* mm = mm0;
        const int32_t mn = Src(*mm);
        if (mn >= 0 && Op(mn) == "StopGradient") {
          inner->push_back(mn);
          if (m_.node(mn).inputs.empty()) throw Bad();
          mm = &m_.node(mn).inputs[0];
        }
        Mean m2;
        if (MeanOf(*mm, &m2) && SameMean(mean, m2)) {
          inner->push_back(m2.node);
          return SameAxes(*mv.axes, *mean.axes);
        }
      }
      return false;
    }
    if (Op(sq) == "Square" || Op(sq) == "Pow" || Op(sq) == "Mul") {
      if (Op(sq) == "Pow") throw Bad();  // (its exponent: scalar_value, in Python)
      const std::vector<const InputRef*> d = Data(sq);
      if (d.empty() || (Op(sq) == "Mul" && d.size() < 2)) throw Bad();
      if (Op(sq) == "Mul" && d[0]->ref != d[1]->ref) return false;
      const int32_t sub = Src(*d[0]);
      if (sub < 0 || Op(sub) != "Sub") return false;
      const std::vector<const InputRef*> ds = Data(sub);
      if (ds.empty()) throw Bad();
      if (ds[0]->ref != x) return false;
      if (ds.size() < 2) throw Bad();
      Mean m2;
      if (!MeanOf(*ds[1], &m2) || !SameMean(mean, m2)) return false;
      inner->insert(inner->end(), {sq, sub, m2.node});
      return SameAxes(*mv.axes, *mean.axes);
    }
    return false;
  }

  // _mean_square: (x, axes) of Mean(Square(x) | x * x)
  bool MeanSquare(const InputRef& ref, std::vector<int32_t>* inner, const InputRef** x,
                  const InputRef** axes) const {
    Mean mv;
    if (!MeanOf(ref, &mv)) return false;
    const int32_t sq = Src(*mv.x);
    if (sq < 0 || (Op(sq) != "Square" && Op(sq) != "Pow" && Op(sq) != "Mul")) return false;
    if (Op(sq) == "Pow") throw Bad();
    const std::vector<const InputRef*> d = Data(sq);
    if (d.empty() || (Op(sq) == "Mul" && d.size() < 2)) throw Bad();
    if (Op(sq) == "Mul" && d[0]->ref != d[1]->ref) return false;
    inner->push_back(mv.node);
    inner->push_back(sq);
    *x = d[0];
    *axes = mv.axes;
    return true;
  }

  bool Classify(const std::vector<Factor>& factors, const std::vector<int32_t>& inner,
                Result* res) const {
    if (factors.size() < 2 || factors.size() > 3) return false;
    for (size_t i = 0; i < factors.size(); ++i) {
      std::vector<int32_t> sub_inner;
      const InputRef *var, *eps;
      if (!InvStd(factors[i].div, *factors[i].ref, &sub_inner, &var, &eps)) continue;
      std::vector<const InputRef*> rest;
      for (size_t k = 0; k < factors.size(); ++k) {
        if (k == i) continue;
        if (factors[k].div) return false;
        rest.push_back(factors[k].ref);
      }
      auto others = [&](size_t j) {  // gamma: the rest but j, the first of them
        for (size_t k = 0; k < rest.size(); ++k) {
          if (k != j) return rest[k];
        }
        return static_cast<const InputRef*>(nullptr);
      };
      for (size_t j = 0; j < rest.size(); ++j) {
        const int32_t sub = Src(*rest[j]);
        if (sub < 0 || Op(sub) != "Sub") continue;
        const InputRef *x, *mref;
        Two(sub, &x, &mref);
        Mean mean;
        if (!MeanOf(*mref, &mean) || mean.x->ref != x->ref) continue;
        std::vector<int32_t> v_inner;
        if (!Variance(*var, mean, &v_inner)) continue;
        res->rms = false;
        res->x = x;
        res->axes = mean.axes;
        res->eps = eps;
        res->gamma = others(j);
        res->inner = inner;
        res->inner.insert(res->inner.end(), sub_inner.begin(), sub_inner.end());
        res->inner.insert(res->inner.end(), v_inner.begin(), v_inner.end());
        res->inner.push_back(sub);
        res->inner.push_back(mean.node);
        return true;
      }
      std::vector<int32_t> ms_inner;
      const InputRef *x, *axes;
      if (!MeanSquare(*var, &ms_inner, &x, &axes)) return false;
      for (size_t j = 0; j < rest.size(); ++j) {
        if (rest[j]->ref != x->ref) continue;
        res->rms = true;
        res->x = x;
        res->axes = axes;
        res->eps = eps;
        res->gamma = others(j);
        res->inner = inner;
        res->inner.insert(res->inner.end(), sub_inner.begin(), sub_inner.end());
        res->inner.insert(res->inner.end(), ms_inner.begin(), ms_inner.end());
        return true;
      }
      return false;
    }
    return false;
  }

  const Mirror& m_;
  InputRef self_;
};

}  // namespace

#define NPU_AMP_GR_EXPORT extern "C" __attribute__((visibility("default")))

NPU_AMP_GR_EXPORT void* NpuAmpGrMirrorNew() { return new Mirror(); }

// (issue 17) destroyed on the helper thread (deferred_free.h): the caller
// drops the handle, nothing reads the mirror again
NPU_AMP_GR_EXPORT void NpuAmpGrMirrorFree(void* h) {
  if (h == nullptr) return;
  Mirror* m = static_cast<Mirror*>(h);
  m->Join();  // (an async load reads the caller's bytes: done before this returns)
  npu_amp_tf::DeferFree([m] { delete m; });
}

// Upsert every NodeDef of the serialized GraphDef `data` (fresh: a name may
// not appear twice, nor name a node the mirror has).  0 ok, 1 refused (the
// mirror is then unusable: drop it).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorLoad(void* h, const char* data, size_t len, int fresh) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || (len && data == nullptr)) return 1;
  m->Join();
  return LoadBytes(m, data, len, fresh != 0) ? 0 : 1;
}

// (issue 17) NpuAmpGrMirrorLoad(h, data, len, fresh=0) of the nodes in
// `data` as text: records separated by \x02, each name \x01 op \x01 input
// \x01 input... (grad_region._lean_text: no GraphDef built, serialized and
// parsed for the few nodes a sync sends).  0 ok, 1 refused (drop the mirror).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorUpsertText(void* h, const char* data, size_t len) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || (len && data == nullptr)) return 1;
  m->Join();
  if (len == 0) return 0;
  for (string_view rec : Split(m->Keep(data, len), '\x02')) {
    const std::vector<string_view> f = Split(rec, '\x01');
    if (f.size() < 2 || f[0].empty()) return 1;
    if (!m->Upsert(f[0], f[1], f.data() + 2, f.size() - 2, /*fresh=*/false)) return 1;
  }
  return 0;
}

// (issue 17) NpuAmpGrMirrorLoad(h, data, len, fresh=1) on a helper thread, so
// that it overlaps the Python work before the first search; `data` must stay
// valid until NpuAmpGrMirrorWait (or Free) returns.  0 started, 1 not (no
// thread to be had: the caller loads with NpuAmpGrMirrorLoad).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorLoadAsync(void* h, const char* data, size_t len) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || (len && data == nullptr)) return 1;
  m->Join();
  try {
    m->loader = npu_amp_tf::Job([m, data, len] {
      int rc = 1;
      try {
        rc = LoadBytes(m, data, len, true) ? 0 : 1;
      } catch (...) {  // (bad_alloc: the mirror is refused, Python searches)
        rc = 1;
      }
      m->load_rc = rc;  // (read after the join)
    });
  } catch (...) {  // (std::system_error: no thread)
    return 1;
  }
  return 0;
}

// Waits for NpuAmpGrMirrorLoadAsync's load: its result (0 ok, 1 refused: the
// mirror is then unusable), or 0 when none was started.
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorWait(void* h) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr) return 1;
  m->Join();
  const int rc = m->load_rc;
  m->load_rc = 0;
  return rc;
}

// Remove the nodes named in `names` (\x01-separated).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorRemove(void* h, const char* names, size_t len) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr) return 1;
  m->Join();
  for (string_view n : Split(string_view(names, len), '\x01')) {
    const int32_t id = m->Find(n);
    if (id >= 0) m->Remove(id);
  }
  return 0;
}

// The op sets: sections separated by \x03 (GRAD_OPS, _STATIC_ARITH,
// _FROM_INPUT_OPS, AGGREGATIONS, SHAPE_OPS, VALUE_STATIC_OPS, then the shape
// walk's: shapes._SAME_SHAPE, _BROADCAST, _MATMUL, _BATCH_MATMUL, _REDUCE),
// names by \x01.
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorOps(void* h, const char* data, size_t len) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr) return 1;
  m->Join();
  std::vector<string_view> sec = Split(string_view(data, len), '\x03');
  std::unordered_set<string_view>* sets[] = {
      &m->ops.grad,       &m->ops.static_arith, &m->ops.from_input, &m->ops.aggregation,
      &m->ops.shape,      &m->ops.value_static, &m->ops.same_shape, &m->ops.broadcast,
      &m->ops.matmul,     &m->ops.batch_matmul, &m->ops.reduce};
  constexpr size_t kSets = sizeof(sets) / sizeof(sets[0]);
  if (sec.size() != kSets) return 1;
  m->ops.text.assign(data, len);
  sec = Split(m->ops.text, '\x03');
  for (size_t i = 0; i < kSets; ++i) {
    sets[i]->clear();
    for (string_view op : Split(sec[i], '\x01')) sets[i]->emplace(op);
  }
  m->ops.set = true;
  return 0;
}

// attributed_forward's known names that no live node has: the names of the
// graph when the fusion pass began that are gone since (\x01-separated;
// `reset`: forget those given before).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorBefore(void* h, const char* names, size_t len, int reset) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr) return 1;
  m->Join();
  m->AddBefore(string_view(names, len), reset != 0);
  return 0;
}

// The positions `pos` of the n nodes `names` (\x01-joined): 0 ok, 1 not.
static int SetPositionsByName(Mirror* m, const char* names, size_t len, const double* pos, int64_t n) {
  std::vector<string_view> v = Split(string_view(names, len), '\x01');
  if (static_cast<int64_t>(v.size()) != n) return 1;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = m->Intern(v[i]);
    if (id < 0) return 1;
    m->SetPos(id, pos[i]);
  }
  return 0;
}

// Positions of the nodes named (\x01-separated; NaN: none); `reset` first
// forgets every position.
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorPositions(void* h, const char* names, size_t len,
                                              const double* pos, int64_t n, int reset) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr) return 1;
  m->Join();
  if (reset) m->ClearPositions();
  return SetPositionsByName(m, names, len, pos, n);
}

// (issue 17) Every position anew, as NpuAmpGrMirrorPositions(reset=1) with
// the positions of every node would set them, for a fresh full order: the
// nodes of the first fresh load by their index in its bytes (`ranks[k]`,
// k < nb, the k-th node's position, -1 none), then the nodes `names` (\x01-joined)
// by name (`pos`, n of them: created since, or created again under a loaded
// name).  0 ok, 1 not (nb is not the load's node count, a bad name: nothing
// or part set; the caller sends every position by name).
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorPositionsBase(void* h, const int32_t* ranks, int64_t nb,
                                                  const char* names, size_t len, const double* pos,
                                                  int64_t n) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || nb < 0 || n < 0) return 1;
  m->Join();
  if (static_cast<int64_t>(m->base_ids.size()) != nb || (nb && ranks == nullptr)) return 1;
  m->ClearPositions();
  for (int64_t k = 0; k < nb; ++k) {
    if (ranks[k] >= 0) m->SetPos(m->base_ids[k], static_cast<double>(ranks[k]));
  }
  return n == 0 ? 0 : SetPositionsByName(m, names, len, pos, n);
}

// (issue 17, tests) The positions of the nodes `names` (\x01-joined, n of
// them) into out[0..n): NaN for none or an unknown name.  0 ok, 1 bad arguments.
NPU_AMP_GR_EXPORT int NpuAmpGrMirrorPositionsOf(void* h, const char* names, size_t len, double* out,
                                                int64_t n) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || n < 0) return 1;
  m->Join();
  if (n == 0) return 0;
  std::vector<string_view> v = Split(string_view(names, len), '\x01');
  if (static_cast<int64_t>(v.size()) != n) return 1;
  for (int64_t i = 0; i < n; ++i) out[i] = m->pos(m->Find(v[i]));
  return 0;
}

// (issue 17) What grad_region._finish needs of a found region, computed
// here so that Python walks only the nodes on G's boundary
// (grad_region.NATIVE_FINISH): `ok1` no reader of an F node outside F and G
// that _finish's first check refuses; `ok2` no forward-only tensor of G read
// outside it (its second check); `cycle` 0 no control input from outside F
// and G, 1 there are some and _check_no_cycle finds nothing (no target in the
// closure it walks, which is at most its step bound), 2 Python must check;
// then G's indexes sorted by position (stable, no position as 0: Python's
// sorted(region, key=pos.get(n, 0))) and the places in that order of the
// nodes with a control input from outside F and G or a reader outside G.
// Each is a fact about sets (no consumer order): Python redoes a failed
// check itself, for its message.
struct Finish {
  bool ok1 = true, ok2 = true;
  int cycle = 0;
  std::vector<size_t> order;     // G's indexes sorted by position
  std::vector<size_t> boundary;  // places in `order` of the nodes to walk
};

void FinishFacts(const Search& s, const Mirror& m, Finish* fin) {
  bool ok1 = true, ok2 = true;
  for (int32_t f : s.fwd_ids) {
    if (!ok1) break;
    for (const auto& c : m.consumers(f)) {
      if (s.fwd.get(c.first) || s.in_region.get(c.first)) continue;
      const int64_t port = c.second >= 0 ? m.node(c.first).inputs[c.second].port : -1;
      bool out_port = false, anchor_port = false;
      for (const auto& o : s.outs) {
        if (o.first != f) continue;
        if (o.second == port) out_port = true;
        if (o.second == 0) anchor_port = true;
      }
      if (out_port || (c.second < 0 && anchor_port)) continue;
      if (c.second >= 0 && s.side.count(Canon(m.name(f), port, false))) continue;
      ok1 = false;
      break;
    }
  }
  const size_t n = s.region.size();
  std::vector<char> needs(n, 0);
  std::vector<int32_t> targets;
  std::unordered_set<int32_t> target_set;
  for (size_t i = 0; i < n; ++i) {
    const int32_t id = s.region[i];
    const Node& node = m.node(id);
    for (const auto& in : node.inputs) {
      if (in.ctrl && !s.in_region.get(in.src) && !s.fwd.get(in.src)) {
        needs[i] = 1;
        if (target_set.insert(in.src).second) targets.push_back(in.src);
      }
    }
    bool read_outside = false;
    for (const auto& c : m.consumers(id)) {
      if (s.in_region.get(c.first)) continue;
      needs[i] = 1;
      if (c.second >= 0) read_outside = true;
    }
    if (ok2 && read_outside && node.op != "NoOp" && !s.dy_dep.get(id) && !s.val_static.get(id) &&
        s.fwd_dep.get(id)) {
      ok2 = false;
    }
  }
  int cycle = 0;
  if (!targets.empty()) {
    // _check_no_cycle's walk: region, then readers placed at or before the
    // last target (a reader with no position counts as placed there)
    double last = -std::numeric_limits<double>::infinity();
    for (int32_t t : targets) {
      const double p = m.pos(t);
      last = std::max(last, std::isnan(p) ? std::numeric_limits<double>::infinity() : p);
    }
    std::unordered_set<int32_t> seen(s.region.begin(), s.region.end());
    std::vector<int32_t> stack(s.region.begin(), s.region.end());
    int64_t steps = 0;
    cycle = 1;
    while (!stack.empty() && cycle == 1) {
      const int32_t id = stack.back();
      stack.pop_back();
      for (const auto& c : m.consumers(id)) {
        if (seen.count(c.first)) continue;
        if (target_set.count(c.first)) {
          cycle = 2;
          break;
        }
        seen.insert(c.first);
        const double p = m.pos(c.first);
        if (!std::isnan(p) && p > last) continue;
        stack.push_back(c.first);
        if (++steps > 200000) {
          cycle = 2;
          break;
        }
      }
    }
  }
  std::vector<size_t>& order = fin->order;
  order.resize(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  auto key = [&](size_t i) {
    const double p = m.pos(s.region[i]);
    return std::isnan(p) ? 0.0 : p;
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  fin->ok1 = ok1;
  fin->ok2 = ok2;
  fin->cycle = cycle;
  fin->boundary.clear();
  for (size_t k = 0; k < n; ++k) {
    if (needs[order[k]]) fin->boundary.push_back(k);
  }
}

void FinishHints(const Search& s, const Mirror& m, string* out) {
  Finish fin;
  FinishFacts(s, m, &fin);
  out->append(fin.ok1 ? "1" : "0");
  out->push_back('\x02');
  out->append(fin.ok2 ? "1" : "0");
  out->push_back('\x02');
  out->append(std::to_string(fin.cycle));
  out->push_back('\x02');
  for (size_t k = 0; k < fin.order.size(); ++k) {
    if (k) out->push_back(',');
    out->append(std::to_string(fin.order[k]));
  }
  out->push_back('\x02');
  for (size_t k = 0; k < fin.boundary.size(); ++k) {
    if (k) out->push_back(',');
    out->append(std::to_string(fin.boundary[k]));
  }
}

// One search.  `request`: sections separated by \x03 (fwd names; outputs as
// name\x01port; inputs (canonical); side outputs (canonical); F's common
// scope; owner scopes; protected names; max_nodes; flags
// grad_reads_output,stop_at_dy), items by \x02.  Writes the answer (see
// grad_region._native_search) to *out; returns its Status.
NPU_AMP_GR_EXPORT int NpuAmpGrSearch(void* h, const char* request, size_t len, DyCallback cb,
                                     const char** out, size_t* out_len) {
  thread_local string buf;
  auto* m = static_cast<Mirror*>(h);
  buf.clear();
  *out = buf.data();
  *out_len = 0;
  if (m == nullptr || cb == nullptr) return kUnable;
  m->Join();
  if (!m->ops.set) return kUnable;
  std::vector<string_view> sec = Split(string_view(request, len), '\x03');
  if (sec.size() != 9) return kUnable;
  Search s(*m, cb);
  for (string_view f : Split(sec[0], '\x02')) {
    s.fwd_sorted.emplace_back(f);
  }
  std::sort(s.fwd_sorted.begin(), s.fwd_sorted.end());
  // every name the request gives gets an id (an unknown one: a dead entry)
  std::vector<std::pair<int32_t, int64_t>> outs;
  for (string_view o : Split(sec[1], '\x02')) {
    const size_t k = o.find('\x01');
    if (k == string_view::npos) return kUnable;
    int64_t port = 0;
    for (char c : o.substr(k + 1)) {
      if (!IsDigit(c)) return kUnable;
      port = port * 10 + (c - '0');
    }
    const int32_t id = m->Intern(o.substr(0, k));
    if (id < 0) return kUnable;
    outs.emplace_back(id, port);
  }
  std::vector<int32_t> fwd_ids, prot_ids, side_ids;
  for (const string& f : s.fwd_sorted) {
    fwd_ids.push_back(m->Intern(f));
    if (fwd_ids.back() < 0) return kUnable;
  }
  for (string_view i : Split(sec[2], '\x02')) s.ins.emplace(i);
  for (string_view i : Split(sec[3], '\x02')) {
    s.side.emplace(i);
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(i, &name, &port, &ctrl)) return kUnable;
    side_ids.push_back(m->Intern(name));
    if (side_ids.back() < 0) return kUnable;
  }
  s.fscope = string(sec[4]);
  for (string_view o : Split(sec[5], '\x02')) s.owner_scopes.emplace_back(o);
  for (string_view p : Split(sec[6], '\x02')) {
    const int32_t id = m->Find(p);
    if (id >= 0) prot_ids.push_back(id);
  }
  s.max_nodes = std::atoll(string(sec[7]).c_str());
  std::vector<string_view> flags = Split(sec[8], '\x02');
  if (flags.size() != 2) return kUnable;
  s.grad_reads_output = flags[0] == "1";
  s.stop_at_dy = flags[1] == "1";
  // (ids are final now: size the per-id vectors)
  const int32_t n = m->size();
  s.Begin(static_cast<size_t>(n));
  for (int32_t id : fwd_ids) s.fwd.set(id, 1);
  for (int32_t id : prot_ids) s.prot.set(id, 1);
  for (int32_t id : side_ids) s.side_node.set(id, 1);
  for (const auto& o : outs) s.out_node.set(o.first, 1);
  s.fwd_ids = std::move(fwd_ids);
  s.outs = std::move(outs);
  Status st;
  try {
    st = s.Run();
  } catch (const Unable&) {
    return kUnable;
  }
  // status \x03 refusal \x03 dy \x03 region (name\x01flags)\x02... \x03 why_not (name\x01why)\x02...
  // (found: \x03 FinishHints)
  buf.append(std::to_string(static_cast<int>(st)));
  buf.push_back('\x03');
  buf.append(s.refusal);
  buf.push_back('\x03');
  if (s.has_dy) buf.append(s.dy);
  buf.push_back('\x03');
  for (size_t i = 0; i < s.region.size(); ++i) {
    const int32_t id = s.region[i];
    if (i) buf.push_back('\x02');
    buf.append(m->name(id));
    buf.push_back('\x01');
    buf.push_back(static_cast<char>('0' + (s.fwd_dep[id] ? 1 : 0) + (s.dy_dep[id] ? 2 : 0) +
                                    (s.val_static[id] ? 4 : 0)));
  }
  buf.push_back('\x03');
  for (size_t i = 0; i < s.why_not.size(); ++i) {
    if (i) buf.push_back('\x02');
    buf.append(m->name(s.why_not[i].first));
    buf.push_back('\x01');
    buf.append(s.why_not[i].second);
  }
  if (st == kFound) {
    buf.push_back('\x03');
    FinishHints(s, *m, &buf);
  }
  *out = buf.data();
  *out_len = buf.size();
  return st;
}

// ---------------------------------------------------------------- shapes
// (issue 17) graph_passes.shapes.local_shape's walk over the mirror, for one
// memo (a ShapeOracle's; it outlives any one mirror): the rank of `ref`'s
// fully known shape with its dims in out[0..rank), -1 when it has none, -2
// when the walk gave up (a node it needs the attrs of was edited since the
// load, a form it leaves to Python, more than `cap` dims): Python walks it.
// The mirror must be synced, and loaded from the graph's own bytes.
NPU_AMP_GR_EXPORT void* NpuAmpGrShapeMemoNew() { return new ShapeMemo(); }

NPU_AMP_GR_EXPORT void NpuAmpGrShapeMemoFree(void* p) {
  if (p == nullptr) return;
  npu_amp_tf::DeferFree([m = static_cast<ShapeMemo*>(p)] { delete m; });
}

NPU_AMP_GR_EXPORT int NpuAmpGrShape(void* h, void* memo, const char* ref, size_t len, int64_t* out,
                                    int cap) {
  auto* m = static_cast<Mirror*>(h);
  auto* mm = static_cast<ShapeMemo*>(memo);
  if (m == nullptr || mm == nullptr || ref == nullptr) return kShapeAbort;
  m->Join();
  try {
    Dims d;
    const int r = ShapeWalk(*m, *mm).Ask(string_view(ref, len), &d);
    if (r < 0) return r;
    if (r > cap) return kShapeAbort;
    std::copy(d.begin(), d.end(), out);
    return r;
  } catch (...) {  // (bad_alloc)
    return kShapeAbort;
  }
}

// (issue 17) builtin.py _analyze_norm at each node named in `names`
// (\x01-joined) and at its Add/AddV2/Mul readers (NormAnalyzer): per node
// analysed, "name\x01n" (no norm), "name\x01p" (Python decides) or
// "name\x01y\x01kind\x01x\x01axes\x01eps\x01gamma\x01beta\x01inner" (kind "l" /
// "r", an absent gamma / beta "\x04", the inner names \x05-joined), entries
// \x02-joined in *out (valid until the next call on `h`).  0 ok, -1 bad
// arguments.  The mirror must be synced (names and inputs).
NPU_AMP_GR_EXPORT int NpuAmpGrAnalyzeNorms(void* h, const char* names, size_t len, const char** out,
                                           size_t* out_len) {
  auto* m = static_cast<Mirror*>(h);
  if (m == nullptr || names == nullptr || out == nullptr || out_len == nullptr) return -1;
  m->Join();
  std::string& text = m->norm_text;
  text.clear();
  try {
    NormAnalyzer an(*m);
    std::vector<int32_t> ids;
    std::vector<char> seen(m->size(), 0);
    for (string_view name : Split(string_view(names, len), '\x01')) {
      const int32_t id = m->Find(name);
      if (!m->Alive(id)) continue;
      if (!seen[id]) ids.push_back(id), seen[id] = 1;
      for (const auto& [c, idx] : m->consumers(id)) {
        if (idx < 0 || seen[c] || !m->Alive(c)) continue;
        const string_view op = m->node(c).op;
        if (op == "Add" || op == "AddV2" || op == "Mul") ids.push_back(c), seen[c] = 1;
      }
    }
    for (int32_t id : ids) {
      if (!text.empty()) text.push_back('\x02');
      text.append(m->name(id));
      NormAnalyzer::Result r;
      bool found;
      try {
        found = an.Analyze(id, &r);
      } catch (const Bad&) {
        text.append("\x01p");
        continue;
      }
      if (!found) {
        text.append("\x01n");
        continue;
      }
      text.append(r.rms ? "\x01y\x01r\x01" : "\x01y\x01l\x01");
      for (const InputRef* ref : {r.x, r.axes, r.eps, r.gamma, r.beta}) {
        if (ref == nullptr) {
          text.push_back('\x04');
        } else {
          text.append(ref->ref);
        }
        text.push_back('\x01');
      }
      for (size_t k = 0; k < r.inner.size(); ++k) {
        if (k) text.push_back('\x05');
        text.append(m->name(r.inner[k]));
      }
    }
  } catch (...) {  // (bad_alloc)
    return -1;
  }
  *out = text.data();
  *out_len = text.size();
  return 0;
}

// ------------------------------------------------------- the layer-norm plan
// (issue 17) graph_passes/fusion/builtin.py _norm_facts (with _grad_facts,
// find_grad_region, its _finish, classify and assign_outputs) over the
// mirror: the layer-norm rule's decisions at one anchor, the same ones, or
// nothing (Python decides).  It answers only where every question Python
// asks has the same answer here: a dtype it reads from an attr it knows the
// meaning of (a node not edited since the load), a shape ShapeOracle gives
// by its own rules or by this file's walk (not one it would take from the
// graph's shape table), constants it decodes as shapes.tensor_value does,
// and a region whose checks all pass.  Every refusal, every doubt, goes to
// Python, which words the reason.  Python keeps the emission, the
// framework's checks and the commit.  grad_region.CHECK_NATIVE (the test
// suite) decides both ways and compares (graph_passes/fusion/norm_plan.py).
namespace {

// ops whose one output has the dtype of their attr T (the rest: Python)
const std::unordered_set<string_view>& TypedByT() {
  static const std::unordered_set<string_view> ops = {
      "Mul", "RealDiv", "Div", "DivNoNan", "Neg", "Sub", "Add", "AddV2", "AddN", "Square", "Sqrt",
      "Rsqrt", "Reciprocal", "Pow", "Maximum", "Minimum", "SquaredDifference", "RsqrtGrad",
      "SqrtGrad", "ReciprocalGrad", "SoftmaxGrad", "Exp", "Log", "Sum", "Mean", "Prod", "Max", "Min",
      "Tile", "BroadcastTo", "Reshape", "ExpandDims", "Squeeze", "Identity", "Snapshot",
      "StopGradient", "PreventGradient", "Transpose", "Fill", "ZerosLike", "OnesLike",
      "StridedSlice", "Pack", "ConcatV2", "Select", "SelectV2", "BiasAdd", "MatMul",
      "BatchMatMulV2", "BatchMatMul", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Tanh",
      "Sigmoid", "Erf", "Erfc", "Softmax", "LogSoftmax", "_FusedMatMul", "TanhGrad", "SigmoidGrad",
      "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SoftplusGrad", "BiasAddGrad",
      "Conv2D", "Conv2DBackpropInput", "Abs", "Sign", "Floor", "Round", "Cumsum", "Slice", "Pad",
      "PadV2", "MirrorPad", "ReverseV2", "Einsum", "ClipByValue", "DepthwiseConv2dNative"};
  return ops;
}

// an AttrValue's `type` (field 6) when that is the value it holds, else -1
int64_t AttrType(string_view a) {
  const char* p = a.data();
  const char* end = p + a.size();
  uint64_t last = 0, val = 0;
  while (p < end) {
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    const uint64_t f = tag >> 3;
    if (f == 6 && (tag & 7) == 0) {
      if (!wire::ReadVarint(p, end, &val)) throw Bad();
    } else if (!wire::SkipField(p, end, tag & 7)) {
      throw Bad();
    }
    if (f >= 1 && f <= 10) last = f;
  }
  return last == 6 ? static_cast<int64_t>(val) : -1;
}

bool IsFloatType(int64_t dt) { return dt == 1 || dt == 19 || dt == 14; }  // registry.FLOAT_TYPES

std::vector<int64_t> SqueezeLead(std::vector<int64_t> s) {  // builtin._squeeze_lead
  while (s.size() > 1 && s[0] == 1) s.erase(s.begin());
  return s;
}

class NormPlanner {
 public:
  NormPlanner(Mirror& m, ShapeMemo& memo) : m_(m), memo_(memo) {}

  std::vector<string> prot;
  int64_t max_nodes = 4000;
  bool stop_at_dy = true;

  // true: the plan in *out; false: Python decides
  bool Plan(string_view anchor_name, string* out) {
    return Guarded([&] { return Run(anchor_name, out); });
  }

  // _grad_facts alone (a norm another rule matched: its forward region
  // `inner`, gamma / beta as the graph has them in `params`): "0" (no reader
  // outside the forward region) or "1\x03" and Grad's text in *out; false:
  // Python decides
  bool GradPlan(string_view anchor_name, const std::vector<string_view>& inner, const string& x,
                const std::vector<string>& params, bool has_gamma, bool has_beta, const Dims& gs,
                string* out) {
    return Guarded([&] {
      const int32_t anchor = m_.Find(anchor_name);
      if (!m_.Alive(anchor) || !m_.ops.set) return Leave(__LINE__);
      std::unordered_set<int32_t> inner_set{anchor};
      for (string_view n : inner) {
        const int32_t id = m_.Find(n);
        if (!m_.Alive(id)) return Leave(__LINE__);
        inner_set.insert(id);
      }
      bool escaping = false;
      for (int32_t id : inner_set) {
        if (id == anchor) continue;
        for (const auto& c : m_.consumers(id)) {
          if (!inner_set.count(c.first)) escaping = true;
        }
      }
      out->clear();
      if (!escaping) {
        out->append("0");
        return true;
      }
      const int64_t dt = Dtype(x);
      if (dt < 0) return Leave(__LINE__);
      Dims xs;
      Shape(x, &xs);
      out->append("1\x03");
      return Grad(anchor, x, params, has_gamma, has_beta, dt, xs, gs, inner_set, out);
    });
  }

  template <typename F>
  bool Guarded(F&& f) {
    try {
      return f();
    } catch (const Bad&) {
      if (why.empty()) why = "a question answered only by Python (a shape, dtype or constant)";
      return false;
    } catch (const Unable&) {
      why = "the incoming gradient's candidate: a dtype or shape only Python answers";
      return false;
    }
  }

  // why the plan was left to Python (the source line of the refusal), for debugging
  string why;

 private:
  bool Leave(int line) {
    why = "refused at grad_region.cc:" + std::to_string(line);
    return false;
  }

  // graph.tensor_dtype(ref) where this file knows it, else -1
  int64_t Dtype(string_view ref) const {
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &name, &port, &ctrl) || ctrl || port != 0) return -1;
    const int32_t id = m_.Find(name);
    if (!m_.Alive(id)) return -1;
    const Node& n = m_.node(id);
    if (n.dirty || n.def.empty()) return -1;
    string_view key;
    if (n.op == "Const" || n.op == "Placeholder" || n.op == "ReadVariableOp") {
      key = "dtype";
    } else if (n.op == "Cast") {
      key = "DstT";
    } else if (TypedByT().count(n.op)) {
      key = "T";
    } else {
      return -1;
    }
    string_view a;
    if (!FindAttr(n.def, key, &a)) return -1;
    return AttrType(a);
  }

  // core.ShapeOracle.shape(ref) where its answer is a list this file can
  // give; Bad where it is None, or could come from the graph's shape table
  void Shape(string_view ref, Dims* out, int depth = 0) {
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &name, &port, &ctrl) || ctrl || depth > 16) throw Bad();
    const int32_t id = m_.Find(name);
    if (!m_.Alive(id)) throw Bad();
    const Node& n = m_.node(id);
    const string_view def = CleanDef(n);
    string_view a;
    if (OutputShapeAt(def, port, out)) return;  // shapes.static_shapes
    if (n.op == "Const") {
      if (!FindAttr(def, "value", &a)) throw Bad();
      const TensorView t(AttrView(a).get(8));
      ShapeDims(t.shape, out);
      return;
    }
    if ((n.op == "Placeholder" || n.op == "VarHandleOp") && FindAttr(def, "shape", &a)) {
      if (!ShapeDims(AttrView(a).get(7), out)) throw Bad();  // (unknown rank: None)
      return;
    }
    if (n.op == "ReadVariableOp" && !n.inputs.empty()) {
      const int32_t h = n.inputs[0].src;
      if (m_.Alive(h) && FindAttr(CleanDef(m_.node(h)), "_handle_shapes", &a)) {
        const std::vector<string_view> shapes = ListShapes(a);
        Dims d;
        if (shapes.size() == 1 && ShapeDims(shapes[0], &d) && Known(d)) {
          *out = d;
          return;
        }
      }
    }
    if ((n.op == "Identity" || n.op == "ReadVariableOp" || n.op == "Cast" || n.op == "StopGradient") &&
        !n.inputs.empty()) {
      Shape(n.inputs[0].ref, out, depth + 1);
      return;
    }
    if (n.op == "Reshape" && n.inputs.size() >= 2) {
      Dims v;
      if (ConstIntsAt(m_, n.inputs[1].ref, &v) == kConstInts && Known(v)) {
        *out = v;
        return;
      }
    }
    const string key = port == 0 ? string(name) : string(name) + ":" + std::to_string(port);
    if (ShapeWalk(m_, memo_).Ask(key, out) < 0) throw Bad();  // (none, or gave up: Python)
  }

  // builtin.const_scalar of a Const written as one float32 / float64 value
  double Eps(string_view ref) const {
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &name, &port, &ctrl) || ctrl || port != 0) throw Bad();
    const int32_t id = m_.Find(name);
    if (!m_.Alive(id) || m_.node(id).op != "Const") throw Bad();
    string_view a;
    if (!FindAttr(CleanDef(m_.node(id)), "value", &a)) throw Bad();
    const TensorView t(AttrView(a).get(8));
    Dims shape;
    ShapeDims(t.shape, &shape);
    for (int64_t d : shape) {
      if (d != 1) throw Bad();
    }
    double v;
    if (t.dtype == 1 && t.content.size() == 4) {
      float f;
      std::memcpy(&f, t.content.data(), 4);
      v = f;
    } else if (t.dtype == 1 && t.content.empty() && t.float_val.size() == 1) {
      v = t.float_val[0];
    } else if (t.dtype == 2 && t.content.size() == 8) {
      std::memcpy(&v, t.content.data(), 8);
    } else if (t.dtype == 2 && t.content.empty() && t.double_val.size() == 1) {
      v = t.double_val[0];
    } else {
      throw Bad();
    }
    return static_cast<double>(static_cast<float>(v));  // (const_eval: as float32)
  }

  static string Ref(string_view ref) {  // _canon
    string_view name;
    int64_t port;
    bool ctrl;
    if (!ParseRef(ref, &name, &port, &ctrl)) throw Bad();
    return Canon(name, port, ctrl);
  }

  // grad_region._alias_root
  string AliasRoot(const Stamped<char>& member, string ref) const {
    for (int seen = 0; seen < 16; ++seen) {
      string_view name;
      int64_t port;
      bool ctrl;
      if (!ParseRef(ref, &name, &port, &ctrl)) throw Bad();
      const int32_t id = m_.Find(name);
      if (!m_.Alive(id) || !member.get(id) || port != 0) return ref;
      const Node& n = m_.node(id);
      if (n.op != "Identity" && n.op != "Snapshot" && n.op != "Reshape" && n.op != "StopGradient") {
        return ref;
      }
      const InputRef* src = nullptr;
      for (const auto& in : n.inputs) {
        if (!in.ctrl) {
          src = &in;
          break;
        }
      }
      if (src == nullptr) throw Bad();  // (Python: IndexError)
      if (!member.get(src->src)) return ref;
      ref = Ref(src->ref);
    }
    return ref;
  }

  static void Ints(const Dims& d, string* out) {
    for (size_t i = 0; i < d.size(); ++i) {
      if (i) out->push_back(',');
      out->append(std::to_string(d[i]));
    }
  }

  bool Run(string_view anchor_name, string* out) {
    const int32_t anchor = m_.Find(anchor_name);
    if (!m_.Alive(anchor) || !m_.ops.set) return Leave(__LINE__);
    NormAnalyzer an(m_);
    NormAnalyzer::Result r;
    if (!an.Analyze(anchor, &r)) return Leave(__LINE__);
    const bool rms = r.rms;
    const string x(r.x->ref);
    const int64_t dt = Dtype(x);
    if (!IsFloatType(dt)) return Leave(__LINE__);
    Dims xs;
    Shape(x, &xs);
    Dims ax;
    if (ConstIntsAt(m_, r.axes->ref, &ax) != kConstInts) return Leave(__LINE__);
    const int64_t rank = static_cast<int64_t>(xs.size());
    if (rank == 0) return Leave(__LINE__);
    std::vector<int64_t> axes;
    for (int64_t v : ax) axes.push_back(((v % rank) + rank) % rank);
    std::sort(axes.begin(), axes.end());
    axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
    if (axes.empty()) return Leave(__LINE__);
    const int64_t k = static_cast<int64_t>(axes.size());
    for (int64_t i = 0; i < k; ++i) {
      if (axes[i] != rank - k + i) return Leave(__LINE__);
    }
    const Dims norm(xs.end() - k, xs.end());
    for (int64_t d : norm) {
      if (d <= 0) return Leave(__LINE__);
    }
    const double eps = Eps(r.eps->ref);
    if (!(eps >= 0)) return Leave(__LINE__);
    auto param = [&](const InputRef* ref) {
      if (ref == nullptr) return;
      if (Dtype(ref->ref) != dt) throw Bad();
      Dims ps;
      Shape(ref->ref, &ps);
      while (ps.size() > norm.size() && ps[0] == 1) ps.erase(ps.begin());
      if (ps != norm) throw Bad();
    };
    param(r.gamma);
    if (!rms) {
      param(r.beta);
    } else if (r.beta != nullptr) {
      return Leave(__LINE__);
    }
    std::vector<int32_t> inner;
    std::unordered_set<int32_t> inner_set;
    for (int32_t id : r.inner) {
      if (inner_set.insert(id).second) inner.push_back(id);
    }
    inner_set.insert(anchor);
    for (int32_t id : inner) {
      if (id == anchor) continue;
      for (const string& p : prot) {
        if (m_.name(id) == p) return Leave(__LINE__);
      }
    }
    // the plan: kind, x, gamma, beta, dtype, eps, the normalised dims, the inner nodes
    out->clear();
    out->append(rms ? "r" : "l");
    for (const InputRef* ref : {r.x, r.gamma, r.beta}) {
      out->push_back('\x03');
      if (ref == nullptr) {
        out->push_back('\x04');
      } else {
        out->append(ref->ref);
      }
    }
    char eps_text[40];
    std::snprintf(eps_text, sizeof eps_text, "%.17g", eps);
    out->append("\x03" + std::to_string(dt) + "\x03" + eps_text + "\x03");
    Ints(norm, out);
    out->push_back('\x03');
    for (size_t i = 0; i < inner.size(); ++i) {
      if (i) out->push_back('\x02');
      out->append(m_.name(inner[i]));
    }
    bool escaping = false;
    for (int32_t id : inner_set) {
      if (id == anchor) continue;
      for (const auto& c : m_.consumers(id)) {
        if (!inner_set.count(c.first)) escaping = true;
      }
    }
    if (!escaping) {
      out->append("\x03" "0");
      return true;
    }
    std::vector<string> params;
    if (r.gamma != nullptr) params.emplace_back(r.gamma->ref);
    if (r.beta != nullptr && !rms) params.emplace_back(r.beta->ref);
    out->append("\x03" "1\x03");
    return Grad(anchor, x, params, r.gamma != nullptr, r.beta != nullptr && !rms, dt, xs, norm, inner_set,
                out);
  }

 public:
  // _grad_facts (the region's part) at `anchor` with forward region `inner_set`:
  // appends "nodes\x03dy\x03xs\x03terms\x03shapes" to *out, or false
  bool Grad(int32_t anchor, const string& x, const std::vector<string>& params, bool has_gamma,
            bool has_beta, int64_t dt, const Dims& xs, const Dims& gs,
            const std::unordered_set<int32_t>& inner_set, string* out) {
    for (int64_t d : xs) {
      if (d <= 0) return Leave(__LINE__);
    }
    if (SqueezeLead(xs) == SqueezeLead(gs)) return Leave(__LINE__);
    // find_grad_region(inner, [anchor], [x, gamma, beta], dy_shape=xs)
    Dims y_shape;
    Shape(m_.name(anchor), &y_shape);
    if (!Known(y_shape)) y_shape = xs;
    Search s(m_, nullptr);
    for (int32_t id : inner_set) s.fwd_sorted.emplace_back(m_.name(id));
    std::sort(s.fwd_sorted.begin(), s.fwd_sorted.end());
    s.ins.insert(Ref(x));
    for (const string& p : params) s.ins.insert(Ref(p));
    {  // grad_region._common_scope
      std::vector<std::vector<string_view>> parts;
      for (const string& f : s.fwd_sorted) {
        std::vector<string_view> p = Split(f, '/');
        p.pop_back();
        parts.push_back(std::move(p));
      }
      size_t common = 0;
      while (true) {
        bool same = true;
        for (const auto& p : parts) {
          if (p.size() <= common || p[common] != parts[0][common]) {
            same = false;
            break;
          }
        }
        if (!same) break;
        ++common;
      }
      for (size_t i = 0; i < common; ++i) {
        s.fscope.append(parts[0][i]);
        s.fscope.push_back('/');
      }
    }
    s.max_nodes = max_nodes;
    s.grad_reads_output = false;
    s.stop_at_dy = stop_at_dy;
    s.Begin(static_cast<size_t>(m_.size()));
    std::vector<int32_t> fwd_ids;
    for (const string& f : s.fwd_sorted) {
      fwd_ids.push_back(m_.Find(f));
      s.fwd.set(fwd_ids.back(), 1);
    }
    for (const string& p : prot) {
      const int32_t id = m_.Find(p);
      if (id >= 0) s.prot.set(id, 1);
    }
    s.out_node.set(anchor, 1);
    s.fwd_ids = std::move(fwd_ids);
    s.outs = {{anchor, 0}};
    s.cand = [&](const InputRef& in) -> int {
      const int64_t d = Dtype(in.ref);
      if (d < 0) throw Unable();
      if (!IsFloatType(d)) return 0;
      Dims sh;
      try {
        Shape(in.ref, &sh);
      } catch (const Bad&) {
        throw Unable();
      }
      return sh == y_shape && Known(sh) ? 1 : 0;
    };
    if (s.Run() != kFound) return Leave(__LINE__);
    Finish fin;
    FinishFacts(s, m_, &fin);
    if (!fin.ok1 || !fin.ok2 || fin.cycle == 2) return Leave(__LINE__);
    // _boundary: the tensors read outside G, in G's order
    std::vector<string> refs;
    std::unordered_map<string, std::vector<int32_t>> readers;
    std::unordered_map<string, int32_t> ref_node;
    for (size_t k : fin.boundary) {
      const int32_t id = s.region[fin.order[k]];
      string node_ref;
      for (const auto& c : m_.consumers(id)) {
        if (s.in_region.get(c.first) || c.second < 0) continue;
        const string ref = Canon(m_.name(id), m_.node(c.first).inputs[c.second].port, false);
        if (!node_ref.empty() && node_ref != ref) return Leave(__LINE__);  // (two ports: Python's consumer order)
        node_ref = ref;
        auto it = readers.find(ref);
        if (it == readers.end()) {
          refs.push_back(ref);
          ref_node[ref] = id;
          it = readers.emplace(ref, std::vector<int32_t>()).first;
        }
        it->second.push_back(c.first);
      }
    }
    // classify, then assign_outputs(summed=("dx",))
    std::vector<std::pair<string, std::vector<string>>> roles;
    std::unordered_map<string, Dims> shapes;
    for (const string& ref : refs) {
      const int32_t id = ref_node[ref];
      if (Dtype(ref) != dt || !s.dy_dep.get(id)) return Leave(__LINE__);
      Dims sh;
      Shape(ref, &sh);
      if (!Known(sh)) return Leave(__LINE__);
      const bool fwd = s.fwd_dep.get(id);
      string role;
      if (sh == xs && fwd) {
        role = "dx";
      } else if (SqueezeLead(sh) == SqueezeLead(gs)) {
        if (fwd && has_gamma) {
          role = "dgamma";
        } else if (!fwd && has_beta) {
          role = "dbeta";
        } else {
          return Leave(__LINE__);
        }
      } else {
        return Leave(__LINE__);
      }
      shapes[ref] = sh;
      auto it = std::find_if(roles.begin(), roles.end(), [&](const auto& e) { return e.first == role; });
      if (it == roles.end()) {
        roles.emplace_back(role, std::vector<string>{ref});
      } else {
        it->second.push_back(ref);
      }
    }
    bool has_dx = false;
    std::vector<string> aggregators;
    for (const auto& [role, rr] : roles) {
      string agg;
      if (role == "dx") has_dx = true;
      if (role == "dx" && rr.size() > 1) {
        std::unordered_set<int32_t> aggs;
        for (const string& ref : rr) {
          for (int32_t c : readers[ref]) aggs.insert(c);
        }
        if (aggs.size() != 1) return Leave(__LINE__);
        const int32_t a = *aggs.begin();
        if (!m_.ops.aggregation.count(m_.node(a).op)) return Leave(__LINE__);
        std::vector<string> ins;
        for (const auto& in : m_.node(a).inputs) {
          if (!in.ctrl) ins.push_back(Ref(in.ref));
        }
        for (const string& ref : rr) {
          if (std::count(ins.begin(), ins.end(), ref) != 1) return Leave(__LINE__);
        }
        agg = string(m_.name(a));
      } else if (rr.size() > 1) {
        const string root = AliasRoot(s.in_region, rr[0]);
        for (const string& ref : rr) {
          if (AliasRoot(s.in_region, ref) != root) return Leave(__LINE__);
        }
      }
      aggregators.push_back(agg);
    }
    if (!has_dx || Dtype(s.dy) != dt) return Leave(__LINE__);
    // the gradient: G in order, dy, x's shape, the terms, the shapes of the refs rewired
    for (size_t k = 0; k < fin.order.size(); ++k) {
      if (k) out->push_back('\x02');
      out->append(m_.name(s.region[fin.order[k]]));
    }
    out->append("\x03" + s.dy + "\x03");
    Ints(xs, out);
    out->push_back('\x03');
    for (size_t i = 0; i < roles.size(); ++i) {
      if (i) out->push_back('\x02');
      out->append(roles[i].first + "\x01" + (aggregators[i].empty() ? string("\x04") : aggregators[i]));
      for (const string& ref : roles[i].second) out->append("\x01" + ref);
    }
    out->push_back('\x03');
    bool first = true;
    for (size_t i = 0; i < roles.size(); ++i) {
      if (!aggregators[i].empty()) continue;
      for (const string& ref : roles[i].second) {
        if (!first) out->push_back('\x02');
        first = false;
        out->append(ref + "\x01");
        Ints(shapes[ref], out);
      }
    }
    return true;
  }

  Mirror& m_;
  ShapeMemo& memo_;
};

// The two plan entries' frame: the arguments checked, the request split into
// `sections` (its last three: the protected names, \x02-joined; max_nodes;
// stop_at_dy "0" / "1"), `plan(planner, sections, &text)` run; its text, or
// why Python decides, in *out (valid until the entry's next call on this
// thread).  0 planned, 1 Python decides, -1 bad arguments.
template <typename F>
int PlanEntry(void* h, void* memo, const char* request, size_t len, size_t sections, F&& plan,
              const char** out, size_t* out_len) {
  thread_local string buf;
  auto* m = static_cast<Mirror*>(h);
  auto* mm = static_cast<ShapeMemo*>(memo);
  if (m == nullptr || mm == nullptr || request == nullptr || out == nullptr || out_len == nullptr) return -1;
  m->Join();
  *out = nullptr;
  *out_len = 0;
  const std::vector<string_view> sec = Split(string_view(request, len), '\x03');
  if (sec.size() != sections) return -1;
  bool ok;
  try {
    NormPlanner p(*m, *mm);
    for (string_view n : Split(sec[sections - 3], '\x02')) {
      if (!n.empty()) p.prot.emplace_back(n);
    }
    p.max_nodes = std::atoll(string(sec[sections - 2]).c_str());
    p.stop_at_dy = sec[sections - 1] == "1";
    buf.clear();
    ok = plan(p, sec, &buf);
    if (!ok) buf = p.why;
  } catch (...) {  // (bad_alloc)
    return 1;
  }
  *out = buf.data();
  *out_len = buf.size();
  return ok ? 0 : 1;
}

}  // namespace

// (issue 17) the layer-norm rule's plan at one anchor (NormPlanner::Plan).
// `request`: sections separated by \x03: the anchor; the protected names
// (\x02-joined); max_nodes; stop_at_dy ("0" / "1").  `memo`: the
// ShapeOracle's walk memo (NpuAmpGrShapeMemoNew).  Returns 0 with the plan
// in *out (valid until the next call on this thread), 1 when Python decides
// (with why in *out, for debugging), -1 bad arguments.  The mirror must be
// synced, with positions.
NPU_AMP_GR_EXPORT int NpuAmpGrNormPlan(void* h, void* memo, const char* request, size_t len,
                                       const char** out, size_t* out_len) {
  return PlanEntry(
      h, memo, request, len, 4,
      [](NormPlanner& p, const std::vector<string_view>& sec, string* text) { return p.Plan(sec[0], text); },
      out, out_len);
}

// (issue 17) the backward half of a norm another rule matched
// (NormPlanner::GradPlan, builtin._grad_facts).  `request`: sections
// separated by \x03: the anchor; the forward region's names (\x02-joined); x;
// gamma / beta as the graph has them (\x02-joined, absent ones left out);
// has_gamma, has_beta ("0" / "1"); the normalised dims (comma-separated);
// the protected names (\x02-joined); max_nodes; stop_at_dy.  Returns as
// NpuAmpGrNormPlan.
NPU_AMP_GR_EXPORT int NpuAmpGrNormGradPlan(void* h, void* memo, const char* request, size_t len,
                                           const char** out, size_t* out_len) {
  return PlanEntry(
      h, memo, request, len, 10,
      [](NormPlanner& p, const std::vector<string_view>& sec, string* text) {
        std::vector<string> params;
        for (string_view v : Split(sec[3], '\x02')) {
          if (!v.empty()) params.emplace_back(v);
        }
        Dims gs;
        for (string_view v : Split(sec[6], ',')) {
          if (!v.empty()) gs.push_back(std::atoll(string(v).c_str()));
        }
        return p.GradPlan(sec[0], Split(sec[1], '\x02'), string(sec[2]), params, sec[4] == "1", sec[5] == "1",
                          gs, text);
      },
      out, out_len);
}

// ------------------------------------------- the layer-norm fusion, whole
// (issue 17) graph_passes/fusion's `layer_norm` rule run over a mirror loaded
// fresh from a graph's bytes, before Python parses the graph: its anchors
// (builtin._norm_candidates, _norm_predicate, pattern.find_matches in
// topological order), then per anchor what core.apply_rule does (the re-match
// after a change, _plan_one: the plan NormPlanner makes, the emission of
// builtin._emit_norm / _emit_norm_grad / reemit_aggregator, the framework's
// checks; core._commit and _remove_dead), with Graph's index rules for every
// edit (Mirror::Py*) and grad_region._positions' positions.  The first
// anchor it cannot decide as Python would ends the run there: everything
// fused before it is kept, the rest is Python's (the rule runs again in the
// fusion pass).  The result: the graph's bytes with the fusions applied, in
// the node order Python's Graph would have (the nodes not removed in their
// order, then the created ones in the order they were last added), and per
// output node its index in the input (-1: created, or an input node edited).
namespace {

void PutVarint(string* o, uint64_t v) {
  while (v >= 0x80) {
    o->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  o->push_back(static_cast<char>(v));
}
void PutKey(string* o, int field, int wt) { PutVarint(o, (static_cast<uint64_t>(field) << 3) | wt); }
void PutLen(string* o, int field, string_view s) {
  PutKey(o, field, 2);
  PutVarint(o, s.size());
  o->append(s);
}

// AttrValue bytes: type (6), i (3), f (4), tensor (8); a oneof: written even
// when 0, as protobuf does for a set oneof field
string AttrOfType(int64_t dt) {
  string a;
  PutKey(&a, 6, 0);
  PutVarint(&a, static_cast<uint64_t>(dt));
  return a;
}
string AttrOfInt(int64_t v) {
  string a;
  PutKey(&a, 3, 0);
  PutVarint(&a, static_cast<uint64_t>(v));
  return a;
}
string AttrOfFloat(float f) {
  string a;
  PutKey(&a, 4, 5);
  char b[4];
  std::memcpy(b, &f, 4);
  a.append(b, 4);
  return a;
}
// tf.make_tensor_proto of a numeric array: dtype, shape, tensor_content
string AttrOfTensor(int64_t dt, const Dims& shape, const string& content) {
  string t, sh;
  PutKey(&t, 1, 0);
  PutVarint(&t, static_cast<uint64_t>(dt));
  for (int64_t d : shape) {
    string dim;
    PutKey(&dim, 1, 0);
    PutVarint(&dim, static_cast<uint64_t>(d));
    PutLen(&sh, 2, dim);
  }
  PutLen(&t, 2, sh);
  if (!content.empty()) PutLen(&t, 4, content);
  string a;
  PutLen(&a, 8, t);
  return a;
}

// the device (field 4) of NodeDef bytes
string_view DeviceOf(string_view def) {
  const char* p = def.data();
  const char* end = p + def.size();
  string_view dev;
  while (p < end) {
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    if (tag == ((4 << 3) | 2)) {
      if (!ReadBytes(p, end, &dev)) throw Bad();
    } else if (!wire::SkipField(p, end, tag & 7)) {
      throw Bad();
    }
  }
  return dev;
}

// NodeDef bytes `def` with its inputs (field 3) replaced by `inputs`
string WithInputs(string_view def, const InputList& inputs) {
  string o;
  o.reserve(def.size() + 64);
  const char* p = def.data();
  const char* end = p + def.size();
  bool written = false;
  auto put_inputs = [&] {
    for (const auto& in : inputs) PutLen(&o, 3, in.ref);
    written = true;
  };
  while (p < end) {
    const char* at = p;
    uint64_t tag;
    if (!wire::ReadVarint(p, end, &tag)) throw Bad();
    if (!wire::SkipField(p, end, tag & 7)) throw Bad();
    const uint64_t f = tag >> 3;
    if (f == 3) continue;
    if (f > 3 && !written) put_inputs();
    o.append(at, static_cast<size_t>(p - at));
  }
  if (!written) put_inputs();
  return o;
}

// registry.device_type_named
string DeviceType(string_view dev, const string& dflt) {
  while (!dev.empty() && (dev.back() == ' ' || dev.back() == '\t' || dev.back() == '\n' || dev.back() == '\r' ||
                          dev.back() == '\f' || dev.back() == '\v')) {
    dev.remove_suffix(1);
  }
  size_t i = dev.size();
  while (i > 0 && IsDigit(dev[i - 1])) --i;
  if (i == dev.size() || i == 0 || dev[i - 1] != ':') return dflt;
  size_t j = i - 1;
  auto word = [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; };
  size_t k = j;
  while (k > 0 && word(dev[k - 1])) --k;
  if (k == j || k == 0) return dflt;
  if (dev[k - 1] != '/' && !(k >= 8 && dev.substr(k - 8, 8) == "/device:")) return dflt;
  string t(dev.substr(k, j - k));  // (after "/device:" or "/": the regex's one match, at the end)
  for (char& c : t) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (t == "GPU" || t == "XLA_GPU") return "GPU";
  if (t == "CPU" || t == "XLA_CPU") return "CPU";
  return t;
}

class NormFuser {
 public:
  NormFuser(Mirror& m, ShapeMemo& memo) : m_(m), memo_(memo) {}

  // the request
  std::vector<string> prot;
  std::unordered_set<string> prot_set;
  int64_t max_nodes = 4000;
  bool stop_at_dy = true;
  string default_type = "CPU";
  std::unordered_set<string> kernels;  // "devtype\x01op\x01dt" that may be emitted
  std::unordered_set<string> keep_ops;  // core._KEEP_OPS
  bool (*removable_op)(string_view op) = nullptr;  // registered and not stateful
  std::unordered_set<string> refuse_ops;  // ops a pass before fusion edits (unfuse.FUSED_OPS)

  // the result
  string why;     // why the run ended before the last anchor (empty: it did not)
  int fused = 0;
  string report;  // per fusion: anchor \x01 fused nodes (\x02) \x01 gradient nodes (\x02); \x03-joined
  std::vector<int32_t> removed_base;  // the input's nodes removed (ids)

  // 0: the run ended (fused may be 0), -1: it could not start
  int Run() {
    if (!m_.ops.set) return Stop("the op sets are not loaded"), -1;
    const size_t n0 = m_.base_ids.size();
    base_index_.assign(static_cast<size_t>(m_.size()), -1);
    for (size_t i = 0; i < n0; ++i) base_index_[m_.base_ids[i]] = static_cast<int32_t>(i);
    for (size_t i = 0; i < n0; ++i) {
      const int32_t id = m_.base_ids[i];
      const string_view op = m_.node(id).op;
      if (op == "NextIteration" || op == "RefNextIteration") return Stop("a loop (NextIteration)"), -1;
      if (refuse_ops.count(string(op))) return Stop("a '" + string(op) + "' node, which the unfuse pass may split"), -1;
      Order(id);
    }
    for (size_t i = 0; i < n0; ++i) {
      if (OtherNormRuleMayMatch(m_.base_ids[i])) {
        return Stop("'" + string(m_.name(m_.base_ids[i])) + "' may be a norm another norm rule matches"), -1;
      }
    }
    if (!FullPositions()) return Stop("a cycle"), -1;
    const std::vector<int32_t> matches = Matches();  // (up to a candidate Python decides: why set)
    const string matches_why = why;  // (a stop at an anchor before that candidate comes first)
    why.clear();
    struct Last {
      string& why;
      const string& later;
      ~Last() {
        if (why.empty()) why = later;
      }
    } last{why, matches_why};
    bool changed = false;
    for (int32_t a : matches) {
      try {
        if (changed) {
          if (!m_.Alive(a)) continue;
          if (!Predicate(a)) continue;
        }
        if (!Fuse(a)) return 0;
      } catch (const Bad&) {
        return Stop("at '" + string(m_.name(a)) + "': a question only Python answers"), 0;
      } catch (const Unable&) {
        return Stop("at '" + string(m_.name(a)) + "': a question only Python answers"), 0;
      }
      changed = true;
    }
    return 0;
  }

  // the graph's bytes after the run: `input` (the bytes the mirror was
  // loaded from) with the fusions applied; `map`: per output node its index
  // in `input`, or -1 (created, or edited); `touched`: the names of those
  // graph.py _colocation_kept / _drop_colocation: `def` with its `_class`
  // entries "loc:@X" naming a node that is gone left out (the attr dropped
  // when none is left); false when it names none (nothing to write)
  bool DropColocation(string_view def, string* out) const {
    if (def.find("_class") == string_view::npos) return false;
    string_view a;
    if (!FindAttr(def, "_class", &a)) return false;
    const AttrView v(a);
    const string_view list = v.get(1);
    std::vector<string_view> vals;
    bool dangling = false;
    const char* p = list.data();
    const char* end = p + list.size();
    while (p < end) {
      uint64_t tag;
      if (!wire::ReadVarint(p, end, &tag)) throw Bad();
      if (tag == ((2 << 3) | 2)) {
        string_view sv;
        if (!ReadBytes(p, end, &sv)) throw Bad();
        if (sv.substr(0, 5) == "loc:@" && !m_.Alive(m_.Find(sv.substr(5)))) {
          dangling = true;
          continue;
        }
        vals.push_back(sv);
      } else if (!wire::SkipField(p, end, tag & 7)) {
        throw Bad();
      } else {
        throw Bad();  // (a list of other kinds: as Python, written again from `s` only)
      }
    }
    if (!dangling) return false;
    out->clear();
    p = def.data();
    end = p + def.size();
    while (p < end) {  // every field but the `_class` map entry
      const char* at = p;
      uint64_t tag;
      if (!wire::ReadVarint(p, end, &tag)) throw Bad();
      if (tag == ((5 << 3) | 2)) {
        string_view entry;
        if (!ReadBytes(p, end, &entry)) throw Bad();
        const char* q = entry.data();
        const char* qe = q + entry.size();
        uint64_t t;
        string_view k;
        if (wire::ReadVarint(q, qe, &t) && t == ((1 << 3) | 2) && ReadBytes(q, qe, &k) && k == "_class") continue;
        out->append(at, static_cast<size_t>(p - at));
        continue;
      }
      if (!wire::SkipField(p, end, tag & 7)) throw Bad();
      out->append(at, static_cast<size_t>(p - at));
    }
    if (!vals.empty()) {
      string l, av, entry;
      for (string_view sv : vals) PutLen(&l, 2, sv);
      PutLen(&av, 1, l);
      PutLen(&entry, 1, "_class");
      PutLen(&entry, 2, av);
      PutLen(out, 5, entry);
    }
    return true;
  }

  bool Write(string_view input, string* out, std::vector<int32_t>* map, string* touched) {
    out->clear();
    map->clear();
    touched->clear();
    out->reserve(input.size() + 4096);
    for (size_t i = 0; i < order_.size(); ++i) {
      const int32_t id = order_[i];
      if (!m_.Alive(id) || slot_[id] != static_cast<int32_t>(i)) continue;
      const Node& n = m_.node(id);
      const int32_t base = id < static_cast<int32_t>(base_index_.size()) ? base_index_[id] : -1;
      auto it = emitted_.find(id);
      string def;
      if (it != emitted_.end()) {
        def = NodeBytes(it->second, n.inputs);
      } else if (edited_.count(id)) {
        def = WithInputs(n.def, n.inputs);
        string fixed;
        if (DropColocation(def, &fixed)) def = std::move(fixed);
      } else if (!DropColocation(n.def, &def)) {
        PutLen(out, 1, n.def);
        map->push_back(base);
        continue;
      }
      PutLen(out, 1, def);
      map->push_back(-1);
      if (!touched->empty()) touched->push_back('\x02');
      touched->append(m_.name(id));
    }
    // the GraphDef's other fields (library, versions), as they were
    const char* p = input.data();
    const char* end = p + input.size();
    while (p < end) {
      const char* at = p;
      uint64_t tag;
      if (!wire::ReadVarint(p, end, &tag) || !wire::SkipField(p, end, tag & 7)) return false;
      if ((tag >> 3) != 1) out->append(at, static_cast<size_t>(p - at));
    }
    return true;
  }

 private:
  struct Emitted {
    string op, device;
    std::vector<std::pair<string, string>> attrs;  // key -> AttrValue bytes, sorted by key
  };

  static string NodeBytes(string_view name, const Emitted& e, const std::vector<string>& inputs) {
    string o;
    PutLen(&o, 1, name);
    PutLen(&o, 2, e.op);
    for (const string& in : inputs) PutLen(&o, 3, in);
    if (!e.device.empty()) PutLen(&o, 4, e.device);
    for (const auto& [k, v] : e.attrs) {
      string entry;
      PutLen(&entry, 1, k);
      PutLen(&entry, 2, v);
      PutLen(&o, 5, entry);
    }
    return o;
  }
  string NodeBytes(const std::pair<string, Emitted>& rec, const InputList& inputs) const {
    std::vector<string> ins;
    for (const auto& in : inputs) ins.emplace_back(in.ref);
    return NodeBytes(rec.first, rec.second, ins);
  }

  bool Stop(const string& reason) {
    if (why.empty()) why = reason;
    return false;
  }

  // Python's dict order of the graph's nodes: `id` added (again) at the end
  void Order(int32_t id) {
    if (slot_.size() <= static_cast<size_t>(id)) slot_.resize(Headroom(static_cast<size_t>(id) + 1), -1);
    slot_[id] = static_cast<int32_t>(order_.size());
    order_.push_back(id);
  }
  bool Live(int32_t id, size_t i) const { return m_.Alive(id) && slot_[id] == static_cast<int32_t>(i); }

  void SetPos(int32_t id, double p) {
    if (has_pos_.size() <= static_cast<size_t>(id)) {
      has_pos_.resize(Headroom(static_cast<size_t>(id) + 1), 0);
      pos_.resize(has_pos_.size(), 0.0);
    }
    has_pos_[id] = 1;
    pos_[id] = p;
    m_.SetPos(id, p);
  }
  bool HasPos(int32_t id) const { return id < static_cast<int32_t>(has_pos_.size()) && has_pos_[id]; }

  // Graph.topo_order (Kahn, FIFO, the nodes without inputs first in graph
  // order, readers in consumer-list order) numbered: grad_region._positions'
  // full sort; false on a cycle
  bool FullPositions() {
    std::vector<int32_t> live;
    for (size_t i = 0; i < order_.size(); ++i) {
      if (Live(order_[i], i)) live.push_back(order_[i]);
    }
    std::vector<int32_t> indeg(static_cast<size_t>(m_.size()), 0);
    for (int32_t u : live) {
      for (const auto& c : m_.consumers(u)) {
        if (m_.Alive(c.first)) ++indeg[c.first];
      }
    }
    std::deque<int32_t> ready;
    for (int32_t u : live) {
      if (indeg[u] == 0) ready.push_back(u);
    }
    std::fill(has_pos_.begin(), has_pos_.end(), 0);  // (Python's dict is replaced whole)
    size_t k = 0;
    while (!ready.empty()) {
      const int32_t u = ready.front();
      ready.pop_front();
      SetPos(u, static_cast<double>(k++));
      for (const auto& c : m_.consumers(u)) {
        if (!m_.Alive(c.first)) continue;
        if (--indeg[c.first] == 0) ready.push_back(c.first);
      }
    }
    log_.clear();
    return k == live.size();
  }

  // grad_region._positions' patch for the nodes created or edited since the
  // last call (log_); false when it would fall back to a sort that fails
  bool PatchPositions() {
    if (log_.empty()) return true;
    std::vector<int32_t> changed;
    {
      std::unordered_set<int32_t> seen;
      for (int32_t id : log_) {
        if (seen.insert(id).second && m_.Alive(id)) changed.push_back(id);
      }
    }
    log_.clear();
    std::vector<int32_t> fresh;
    for (int32_t id : changed) {
      if (!HasPos(id)) fresh.push_back(id);
    }
    if (!fresh.empty()) {
      std::sort(fresh.begin(), fresh.end(), [&](int32_t a, int32_t b) { return m_.name(a) < m_.name(b); });
      std::unordered_set<int32_t> pending(fresh.begin(), fresh.end()), opened;
      std::vector<std::pair<int32_t, bool>> stack;
      for (auto it = fresh.rbegin(); it != fresh.rend(); ++it) stack.emplace_back(*it, false);
      while (!stack.empty()) {
        const auto [id, expanded] = stack.back();
        stack.pop_back();
        if (!pending.count(id) || (!expanded && opened.count(id))) continue;
        const Node& n = m_.node(id);
        if (!expanded) {
          opened.insert(id);
          stack.emplace_back(id, true);
          for (const auto& in : n.inputs) {
            if (pending.count(in.src)) stack.emplace_back(in.src, false);
          }
          continue;
        }
        pending.erase(id);
        double p = -1.0;
        bool any = false;
        for (const auto& in : n.inputs) {
          if (HasPos(in.src)) {
            p = any ? std::max(p, pos_[in.src]) : pos_[in.src];
            any = true;
          }
        }
        SetPos(id, (any ? p : -1.0) + 1e-6);
      }
      if (!pending.empty()) return FullPositions();  // (a cycle among created nodes)
    }
    for (int32_t id : changed) {
      const double p = pos_[id];
      bool ok = true;
      for (const auto& in : m_.node(id).inputs) {
        if (HasPos(in.src) && pos_[in.src] >= p) ok = false;
      }
      for (const auto& c : m_.consumers(id)) {
        if (HasPos(c.first) && !(pos_[c.first] > p)) ok = false;
      }
      if (!ok) return FullPositions();
    }
    return true;
  }

  const Node& N(int32_t id) const { return m_.node(id); }
  bool OpIs(int32_t id, std::initializer_list<string_view> ops) const {
    const string_view op = N(id).op;
    for (string_view o : ops) {
      if (op == o) return true;
    }
    return false;
  }

  // The norm rules registered before `layer_norm` (builtin.register_norms:
  // layer_norm_moments, layer_norm_keras3, layer_norm_keras2) could match at
  // Add `id`: a necessary condition of each pattern (_ln_moments_pat: Add(Mul,
  // Sub(beta, Mul)); _ln_keras3_pat: Add(Mul, Add(Mul(Neg, .), beta)) or
  // Add(AddN(.., Mul(Neg, .)), beta); _ln_keras2_pat: Add(Mul(Reshape(
  // FusedBatchNormV3), gamma), beta)).  Where none holds anywhere, those
  // rules match nothing and `layer_norm` runs first on the graph as it is.
  bool OtherNormRuleMayMatch(int32_t id) const {
    if (!OpIs(id, {"Add", "AddV2"})) return false;
    std::vector<int32_t> data;
    for (const auto& in : N(id).inputs) {
      if (!in.ctrl) data.push_back(m_.Alive(in.src) ? in.src : -1);
    }
    if (data.size() != 2) return false;
    auto is = [&](int32_t n, std::initializer_list<string_view> ops) { return n >= 0 && OpIs(n, ops); };
    auto reads = [&](int32_t n, std::initializer_list<string_view> ops) {
      if (n < 0) return false;
      for (const auto& in : N(n).inputs) {
        if (!in.ctrl && m_.Alive(in.src) && OpIs(in.src, ops)) return true;
      }
      return false;
    };
    auto mul_of_neg = [&](int32_t n) { return is(n, {"Mul"}) && reads(n, {"Neg"}); };
    for (int k = 0; k < 2; ++k) {
      const int32_t p = data[k], q = data[1 - k];
      if (is(p, {"Mul"}) && is(q, {"Sub"}) && reads(q, {"Mul"})) return true;
      if (is(p, {"Mul"}) && is(q, {"Add", "AddV2"})) {
        for (const auto& in : N(q).inputs) {
          if (!in.ctrl && m_.Alive(in.src) && mul_of_neg(in.src)) return true;
        }
      }
      if (is(p, {"AddN"})) {
        for (const auto& in : N(p).inputs) {
          if (!in.ctrl && m_.Alive(in.src) && mul_of_neg(in.src)) return true;
        }
      }
      if (is(p, {"Mul"})) {
        for (const auto& in : N(p).inputs) {
          if (!in.ctrl && m_.Alive(in.src) && is(in.src, {"Reshape"}) && reads(in.src, {"FusedBatchNormV3"})) {
            return true;
          }
        }
      }
    }
    return false;
  }

  // _analyze_norm at `id` (NormAnalyzer; Bad: Python's)
  bool Analyze(int32_t id, NormAnalyzer::Result* r) const {
    NormAnalyzer an(m_);
    return an.Analyze(id, r);
  }

  // builtin._would_extend
  bool WouldExtend(int32_t id) const {
    const auto cons = m_.consumers(id);  // (a copy: the analysis below reads the mirror only)
    for (const auto& [c, idx] : cons) {
      if (idx < 0 || !OpIs(c, {"Add", "AddV2", "Mul"})) continue;
      for (const auto& [o, oi] : cons) {
        (void)oi;
        if (o != c && !IsAutodiff(m_.name(o))) return false;
      }
      NormAnalyzer::Result r;
      if (Analyze(c, &r) && !(r.rms && r.beta != nullptr)) {
        for (int32_t n : r.inner) {
          if (n == id) return true;
        }
      }
    }
    return false;
  }

  // builtin._norm_predicate (the rule's op set first: pattern._candidate)
  bool Predicate(int32_t id) const {
    if (!OpIs(id, {"Add", "AddV2", "Mul", "RealDiv"})) return false;
    if (IsAutodiff(m_.name(id))) return false;
    NormAnalyzer::Result r;
    if (!Analyze(id, &r) || (r.rms && r.beta != nullptr)) return false;
    return !WouldExtend(id);
  }

  // builtin._norm_candidates, sorted by position, through find_matches
  std::vector<int32_t> Matches() {
    std::unordered_set<int32_t> level, roots;
    for (size_t i = 0; i < order_.size(); ++i) {
      const int32_t id = order_[i];
      if (!Live(id, i) || !OpIs(id, {"Rsqrt", "Sqrt"})) continue;
      for (const auto& [c, idx] : m_.consumers(id)) {
        if (idx >= 0 && OpIs(c, {"Mul", "RealDiv"})) level.insert(c);
      }
    }
    roots = level;
    for (int k = 0; k < 3; ++k) {
      std::unordered_set<int32_t> nxt;
      for (int32_t id : level) {
        for (const auto& [c, idx] : m_.consumers(id)) {
          if (idx >= 0 && !roots.count(c) && OpIs(c, {"Mul", "RealDiv"})) nxt.insert(c);
        }
      }
      roots.insert(nxt.begin(), nxt.end());
      level = std::move(nxt);
    }
    std::unordered_set<int32_t> cand = roots;
    for (int32_t id : roots) {
      for (const auto& [c, idx] : m_.consumers(id)) {
        if (idx >= 0 && OpIs(c, {"Add", "AddV2"})) cand.insert(c);
      }
    }
    std::vector<int32_t> anchors(cand.begin(), cand.end());
    std::sort(anchors.begin(), anchors.end(), [&](int32_t a, int32_t b) { return pos_[a] < pos_[b]; });
    std::vector<int32_t> out;
    for (int32_t a : anchors) {
      try {
        if (Predicate(a)) out.push_back(a);  // (matched: the anchor alone; none overlaps)
      } catch (const Bad&) {  // (Python decides this one: the run ends before it)
        Stop("at '" + string(m_.name(a)) + "': a candidate's analysis is Python's");
        break;
      } catch (const Unable&) {
        Stop("at '" + string(m_.name(a)) + "': a candidate's analysis is Python's");
        break;
      }
    }
    return out;
  }

  static string Tensor(const string& node, int port) {
    return port == 0 ? node : node + ":" + std::to_string(port);
  }

  struct Term {
    string role, agg;
    std::vector<string> refs;
  };

  // core._plan_one and _commit at anchor `a` (false: the run ends, why set)
  bool Fuse(int32_t a) {
    const string anchor(m_.name(a));
    if (prot_set.count(anchor)) return Stop("at '" + anchor + "': the anchor is fetched or preserved");
    if (!PatchPositions()) return Stop("at '" + anchor + "': a cycle");
    NormPlanner planner(m_, memo_);
    planner.prot = prot;
    planner.max_nodes = max_nodes;
    planner.stop_at_dy = stop_at_dy;
    string text;
    if (!planner.Plan(anchor, &text)) return Stop("at '" + anchor + "': " + planner.why);
    // the plan (norm_plan._parse)
    const std::vector<string_view> sec = Split(text, '\x03');
    if (sec.size() < 9) return Stop("at '" + anchor + "': a malformed plan");
    const bool ln = sec[0] == "l";
    const string x(sec[1]);
    const string gamma = sec[2] == "\x04" ? string() : string(sec[2]);
    const string beta = sec[3] == "\x04" ? string() : string(sec[3]);
    const int64_t dt = std::atoll(string(sec[4]).c_str());
    const float eps = static_cast<float>(std::strtod(string(sec[5]).c_str(), nullptr));
    Dims norm;
    for (string_view v : Split(sec[6], ',')) {
      if (!v.empty()) norm.push_back(std::atoll(string(v).c_str()));
    }
    std::vector<string> inner;
    for (string_view v : Split(sec[7], '\x02')) inner.emplace_back(v);
    const bool has_grad = sec[8] == "1";
    if (has_grad && sec.size() < 14) return Stop("at '" + anchor + "': a malformed plan");
    const string dev(DeviceOf(CleanDef(N(a))));
    const string type = DeviceType(dev, default_type);
    // the emission
    std::vector<std::pair<string, Emitted>> emitted;
    std::vector<std::vector<string>> emitted_in;
    auto emit = [&](const string& op, const string& name, std::vector<string> ins,
                    std::vector<std::pair<string, string>> attrs, const string& device) {
      std::sort(attrs.begin(), attrs.end());
      emitted.emplace_back(name, Emitted{op, device, std::move(attrs)});
      emitted_in.push_back(std::move(ins));
      return name;
    };
    auto filled = [&](const Dims& shape, int64_t dtype, double v) {
      int64_t count = 1;
      for (int64_t d : shape) count *= d;
      string content;
      for (int64_t i = 0; i < count; ++i) {
        if (dtype == 1) {
          const float f = static_cast<float>(v);
          content.append(reinterpret_cast<const char*>(&f), 4);
        } else if (dtype == 19) {  // (1.0 / 0.0 in IEEE half)
          const uint16_t h = v == 1.0 ? 0x3c00 : 0;
          content.append(reinterpret_cast<const char*>(&h), 2);
        } else if (dtype == 14) {  // (bfloat16: the high half of the float)
          const uint16_t h = v == 1.0 ? 0x3f80 : 0;
          content.append(reinterpret_cast<const char*>(&h), 2);
        } else if (dtype == 3) {
          const int32_t iv = static_cast<int32_t>(v);
          content.append(reinterpret_cast<const char*>(&iv), 4);
        } else {
          throw Bad();
        }
      }
      return content;
    };
    auto const_node = [&](const string& name, const Dims& shape, int64_t dtype, const string& content) {
      return emit("Const", name, {}, {{"dtype", AttrOfType(dtype)}, {"value", AttrOfTensor(dtype, shape, content)}},
                  dev);
    };
    if (!IsFloatType(dt)) return Stop("at '" + anchor + "': dtype");
    const string g_ref = !gamma.empty() ? gamma : const_node(anchor + "/gamma", norm, dt, filled(norm, dt, 1.0));
    string b_ref;
    if (ln) b_ref = !beta.empty() ? beta : const_node(anchor + "/beta", norm, dt, filled(norm, dt, 0.0));
    // b.absorb(inner, escapes_ok=True)
    std::vector<string> matched = {anchor};
    for (const string& nm : inner) {
      if (nm != anchor && prot_set.count(nm)) return Stop("at '" + anchor + "': '" + nm + "' is fetched or preserved");
    }
    for (const string& nm : inner) {
      if (std::find(matched.begin(), matched.end(), nm) == matched.end()) matched.push_back(nm);
    }
    if (ln) {
      emit("LayerNorm", anchor, {x, g_ref, b_ref}, {{"T", AttrOfType(dt)}, {"epsilon", AttrOfFloat(eps)}}, dev);
    } else {
      emit("RMSNorm", anchor, {x, g_ref}, {{"T", AttrOfType(dt)}, {"epsilon", AttrOfFloat(eps)}}, dev);
    }
    std::vector<string> region, replaced;
    std::unordered_map<string, string> rewired;
    string region_target;
    if (has_grad) {
      std::vector<string> nodes;
      for (string_view v : Split(sec[9], '\x02')) nodes.emplace_back(v);
      const string dy(sec[10]);
      Dims xs;
      for (string_view v : Split(sec[11], ',')) {
        if (!v.empty()) xs.push_back(std::atoll(string(v).c_str()));
      }
      std::vector<Term> terms;
      for (string_view item : Split(sec[12], '\x02')) {
        const std::vector<string_view> f = Split(item, '\x01');
        if (f.size() < 2) return Stop("at '" + anchor + "': a malformed plan");
        Term t{string(f[0]), f[1] == "\x04" ? string() : string(f[1]), {}};
        for (size_t k = 2; k < f.size(); ++k) t.refs.emplace_back(f[k]);
        terms.push_back(std::move(t));
      }
      std::unordered_map<string, Dims> shapes;
      if (!sec[13].empty()) {
        for (string_view item : Split(sec[13], '\x02')) {
          const std::vector<string_view> f = Split(item, '\x01');
          if (f.size() != 2) return Stop("at '" + anchor + "': a malformed plan");
          Dims d;
          for (string_view v : Split(f[1], ',')) {
            if (!v.empty()) d.push_back(std::atoll(string(v).c_str()));
          }
          shapes[string(f[0])] = d;
        }
      }
      const string op = ln ? "LayerNormGrad" : "RMSNormGrad";
      const string gname = anchor + "/" + op;
      std::vector<string> gin = {dy, x, g_ref, Tensor(anchor, 1)};
      if (ln) gin.push_back(Tensor(anchor, 2));
      emit(op, gname, gin, {{"T", AttrOfType(dt)}}, dev);
      for (const Term& t : terms) {
        const int port = t.role == "dx" ? 0 : (t.role == "dgamma" ? 1 : 2);
        const string src = Tensor(gname, port);
        if (!t.agg.empty()) {  // reemit_aggregator
          const int32_t g = m_.Find(t.agg);
          if (!m_.Alive(g)) return Stop("at '" + anchor + "': the aggregator is gone");
          if (prot_set.count(t.agg)) return Stop("at '" + anchor + "': '" + t.agg + "' is fetched or preserved");
          if (std::find(replaced.begin(), replaced.end(), t.agg) == replaced.end()) replaced.push_back(t.agg);
          std::vector<string> rest, rest_ctrl;
          for (const auto& in : N(g).inputs) {
            if (in.ctrl) {
              rest_ctrl.emplace_back(in.ref);
              continue;
            }
            const string c = Canon(m_.name(in.src), in.port, false);
            if (std::find(t.refs.begin(), t.refs.end(), c) == t.refs.end()) rest.emplace_back(in.ref);
          }
          const string adev(DeviceOf(CleanDef(N(g))));
          std::vector<string> ins = {src};
          ins.insert(ins.end(), rest.begin(), rest.end());
          ins.insert(ins.end(), rest_ctrl.begin(), rest_ctrl.end());
          const string agg_op(N(g).op);
          if (rest.empty()) {
            emit("Identity", t.agg, ins, {{"T", AttrOfType(dt)}}, adev);
          } else if (agg_op == "AddN") {
            emit("AddN", t.agg, ins,
                 {{"T", AttrOfType(dt)}, {"N", AttrOfInt(1 + static_cast<int64_t>(rest.size()))}}, adev);
          } else {
            emit(agg_op, t.agg, ins, {{"T", AttrOfType(dt)}}, adev);
          }
          continue;
        }
        const Dims& want = t.role == "dx" ? xs : norm;
        for (size_t k = 0; k < t.refs.size(); ++k) {
          auto it = shapes.find(t.refs[k]);
          if (it == shapes.end()) return Stop("at '" + anchor + "': a malformed plan");
          if (it->second == want) {
            rewired[t.refs[k]] = src;
            continue;
          }
          std::string content;
          for (int64_t d : it->second) {
            const int32_t v = static_cast<int32_t>(d);
            content.append(reinterpret_cast<const char*>(&v), 4);
          }
          const string shp = const_node(gname + "/" + t.role + "_shape_" + std::to_string(k),
                                        Dims{static_cast<int64_t>(it->second.size())}, 3, content);
          rewired[t.refs[k]] = emit("Reshape", gname + "/" + t.role + "_" + std::to_string(k), {src, shp},
                                    {{"T", AttrOfType(dt)}, {"Tshape", AttrOfType(3)}}, dev);
        }
      }
      for (const string& nm : nodes) {
        if (prot_set.count(nm)) return Stop("at '" + anchor + "': '" + nm + "' is fetched or preserved");
        if (std::find(region.begin(), region.end(), nm) == region.end()) region.push_back(nm);
      }
      region_target = gname;
    }
    // _plan_one's checks
    std::unordered_set<string> matched_set(matched.begin(), matched.end()),
        region_set(region.begin(), region.end()), replaced_set(replaced.begin(), replaced.end()),
        emitted_names;
    for (const auto& e : emitted) emitted_names.insert(e.first);
    for (const auto& e : emitted) {
      const int32_t id = m_.Find(e.first);
      if (m_.Alive(id) && !matched_set.count(e.first) && !replaced_set.count(e.first)) {
        return Stop("at '" + anchor + "': emitted node name '" + e.first + "' is already taken");
      }
    }
    const auto anchor_cons = m_.consumers(a);
    for (const auto& [c, idx] : anchor_cons) {
      if (idx >= 0 && N(c).inputs[idx].port != 0) return Stop("at '" + anchor + "': an output of the anchor besides 0 is read");
    }
    std::vector<int32_t> matched_ids, region_ids, replaced_ids;
    for (const string& nm : matched) matched_ids.push_back(m_.Find(nm));
    for (const string& nm : region) region_ids.push_back(m_.Find(nm));
    for (const string& nm : replaced) replaced_ids.push_back(m_.Find(nm));
    for (int32_t id : matched_ids) {
      if (!m_.Alive(id)) return Stop("at '" + anchor + "': a matched node is gone");
    }
    for (int32_t id : region_ids) {
      if (!m_.Alive(id)) return Stop("at '" + anchor + "': a region node is gone");
    }
    const std::unordered_set<int32_t> matched_idset(matched_ids.begin(), matched_ids.end()),
        region_idset(region_ids.begin(), region_ids.end()), replaced_idset(replaced_ids.begin(), replaced_ids.end());
    // (a name's id: the mirror interns each name once)
    auto in_set = [&](int32_t id, const std::unordered_set<int32_t>& s) { return s.count(id) != 0; };
    {  // _unhandled_readers
      std::vector<int32_t> names(matched_ids.begin(), matched_ids.end());
      names.insert(names.end(), region_ids.begin(), region_ids.end());
      for (int32_t id : names) {
        if (id == a) continue;
        const bool in_region = in_set(id, region_idset);
        for (const auto& [c, idx] : m_.consumers(id)) {
          if (in_set(c, matched_idset) || in_set(c, region_idset) || in_set(c, replaced_idset)) continue;
          if (in_region) {
            if (idx < 0 && !region_target.empty()) continue;
            if (idx >= 0) {
              const InputRef& in = N(c).inputs[idx];
              if (rewired.count(Canon(m_.name(in.src), in.port, in.ctrl))) continue;
            }
          }
          return Stop("at '" + anchor + "': '" + string(m_.name(id)) + "' is also read by '" + string(m_.name(c)) + "'");
        }
      }
      if (!region.empty() && !emitted_names.count(region_target)) return Stop("at '" + anchor + "': the region's target");
    }
    for (const auto& e : emitted) {  // _kernel_problems (the table Python made)
      if (e.second.op == "Const") continue;
      if (!kernels.count(type + "\x01" + e.second.op + "\x01" + std::to_string(dt))) {
        return Stop("at '" + anchor + "': no kernel known for " + e.second.op + " on " + type);
      }
    }
    // core._commit
    std::vector<int32_t> ctrl, upstream;
    auto has = [](const std::vector<int32_t>& v, int32_t id) { return std::find(v.begin(), v.end(), id) != v.end(); };
    for (int32_t id : matched_ids) {
      for (const auto& in : N(id).inputs) {
        if (in.ctrl) {
          if (!in_set(in.src, matched_idset) && !has(ctrl, in.src) && !in_set(in.src, region_idset)) ctrl.push_back(in.src);
        } else if (!in_set(in.src, matched_idset)) {
          upstream.push_back(in.src);
        }
      }
    }
    std::vector<std::pair<int32_t, std::vector<std::pair<int32_t, int32_t>>>> kept;
    for (int32_t r : replaced_ids) {
      std::vector<std::pair<int32_t, int32_t>> cs;
      for (const auto& c : m_.consumers(r)) {
        if (!in_set(c.first, matched_idset)) cs.push_back(c);
      }
      kept.emplace_back(r, std::move(cs));
    }
    auto gone = [&](int32_t id) {
      return in_set(id, matched_idset) || in_set(id, region_idset) || in_set(id, replaced_idset);
    };
    std::vector<std::tuple<int32_t, int32_t, string>> rewires;
    std::vector<std::pair<int32_t, int32_t>> ctrl_moves;
    std::vector<int32_t> region_ctrl_in;
    for (int32_t id : region_ids) {
      for (const auto& in : N(id).inputs) {
        if (in.ctrl && !gone(in.src) && !has(region_ctrl_in, in.src)) {
          region_ctrl_in.push_back(in.src);
        } else if (!in.ctrl && !gone(in.src)) {
          upstream.push_back(in.src);
        }
      }
      for (const auto& [c, idx] : m_.consumers(id)) {
        if (gone(c)) continue;
        if (idx < 0) {
          ctrl_moves.emplace_back(c, id);
        } else {
          const InputRef& in = N(c).inputs[idx];
          auto it = rewired.find(Canon(m_.name(in.src), in.port, in.ctrl));
          if (it == rewired.end()) return Stop("at '" + anchor + "': an unrewired reader");
          rewires.emplace_back(c, idx, it->second);
        }
      }
    }
    {  // _move_control_input's other branch edits by hand and re-indexes: Python's
      std::unordered_set<int32_t> movers;
      for (const auto& [c, old] : ctrl_moves) {
        (void)old;
        if (!movers.insert(c).second) return Stop("at '" + anchor + "': two control edges move onto one node");
      }
    }
    // --- from here on the mirror is edited: nothing below refuses
    std::vector<int32_t> removal(region_ids);
    removal.insert(removal.end(), matched_ids.begin(), matched_ids.end());
    removal.insert(removal.end(), replaced_ids.begin(), replaced_ids.end());
    for (int32_t id : removal) Remove(id);
    std::vector<int32_t> emitted_ids;
    for (size_t i = 0; i < emitted.size(); ++i) {
      const string& nm = emitted[i].first;
      const string_view stable_name = m_.Keep(nm.data(), nm.size());
      std::vector<string_view> ins;
      for (const string& r : emitted_in[i]) ins.push_back(m_.Keep(r.data(), r.size()));
      const string def = NodeBytes(nm, emitted[i].second, emitted_in[i]);
      const string_view kept_def = m_.Keep(def.data(), def.size());
      const string_view op = m_.Keep(emitted[i].second.op.data(), emitted[i].second.op.size());
      const int32_t id = m_.PyAdd(stable_name, op, ins, kept_def);
      if (id < 0) throw Bad();  // (printable names and ops only: checked by the emission's sources)
      emitted_[id] = emitted[i];
      edited_.erase(id);
      Order(id);
      log_.push_back(id);
      emitted_ids.push_back(id);
    }
    for (auto& [r, cs] : kept) {
      auto& index = m_.py_consumers(r);
      for (const auto& c : cs) {
        if (m_.Alive(c.first) && std::find(index.begin(), index.end(), c) == index.end()) index.push_back(c);
      }
    }
    for (const auto& c : anchor_cons) {  // keep_name: the replacement inherits the readers
      if (m_.Alive(c.first)) m_.py_consumers(a).push_back(c);
    }
    for (const auto& [c, idx] : anchor_cons) {
      if (!m_.Alive(c) || idx < 0) continue;
      if (N(c).inputs[idx].ref != anchor) SetInput(c, static_cast<size_t>(idx), anchor);
    }
    for (int32_t c : ctrl) {
      if (m_.Alive(c) && c != a) AddControl(a, c);
    }
    for (const auto& [c, idx, ref] : rewires) {
      if (m_.Alive(c)) SetInput(c, static_cast<size_t>(idx), ref);
    }
    const int32_t rt = region_target.empty() ? -1 : m_.Find(region_target);
    for (const auto& [c, old] : ctrl_moves) {
      if (!m_.Alive(c)) continue;
      const string want = "^" + string(m_.name(old));
      const auto& ins = N(c).inputs;
      for (size_t i = 0; i < ins.size(); ++i) {
        if (ins[i].ref == want) {
          SetInput(c, i, "^" + region_target);
          break;
        }
      }
    }
    for (int32_t c : region_ctrl_in) {
      if (m_.Alive(c) && c != rt) AddControl(rt, c);
    }
    RemoveDead(upstream);
    // the report: fusion, fused_nodes, fused_gradient_nodes
    if (!report.empty()) report.push_back('\x03');
    report.append(anchor + "\x01");
    for (size_t i = 0; i < matched.size(); ++i) report.append((i ? "\x02" : "") + matched[i]);
    report.push_back('\x01');
    for (size_t i = 0; i < region.size(); ++i) report.append((i ? "\x02" : "") + region[i]);
    ++fused;
    return true;
  }

  void Remove(int32_t id) {
    if (!m_.Alive(id)) return;
    m_.PyRemove(id);
    emitted_.erase(id);
    edited_.erase(id);
    if (id < static_cast<int32_t>(base_index_.size()) && base_index_[id] >= 0) {
      removed_base.push_back(id);
      m_.AddBeforeName(m_.name(id));
    }
  }
  void SetInput(int32_t id, size_t i, const string& ref) {
    if (N(id).inputs[i].ref == ref) return;
    m_.PySetInput(id, i, m_.Keep(ref.data(), ref.size()));
    if (!emitted_.count(id)) edited_.insert(id);
    log_.push_back(id);
  }
  void AddControl(int32_t id, int32_t src) {
    const string ref = "^" + string(m_.name(src));
    for (const auto& in : N(id).inputs) {
      if (in.ref == ref) return;
    }
    m_.PyAddControl(id, m_.Keep(ref.data(), ref.size()));
    if (!emitted_.count(id)) edited_.insert(id);
    log_.push_back(id);
  }
  // core._remove_dead
  void RemoveDead(const std::vector<int32_t>& names) {
    std::vector<int32_t> stack;
    {
      std::unordered_set<int32_t> seen;
      for (int32_t id : names) {
        if (seen.insert(id).second) stack.push_back(id);
      }
    }
    while (!stack.empty()) {
      const int32_t id = stack.back();
      stack.pop_back();
      if (!m_.Alive(id) || prot_set.count(string(m_.name(id))) || !m_.consumers(id).empty()) continue;
      const string_view op = N(id).op;
      const bool removable =
          op == "ReadVariableOp" || (!keep_ops.count(string(op)) && removable_op != nullptr && removable_op(op));
      if (!removable) continue;
      std::vector<int32_t> ins;
      for (const auto& in : N(id).inputs) ins.push_back(in.src);
      Remove(id);
      stack.insert(stack.end(), ins.begin(), ins.end());
    }
  }

  Mirror& m_;
  ShapeMemo& memo_;
  std::vector<int32_t> order_, slot_, base_index_;
  std::vector<char> has_pos_;
  std::vector<double> pos_;
  std::vector<int32_t> log_;  // Graph's edit log since the last positions
  std::unordered_map<int32_t, std::pair<string, Emitted>> emitted_;  // created: name, record
  std::unordered_set<int32_t> edited_;  // the input's nodes edited
};

}  // namespace

// (issue 17) The registry's answer for core._removable: 1 when `op` is
// registered and not stateful (custom_ops/grappler_bridge.cc, which has the
// op registry).
extern "C" int NpuAmpOpRemovable(const char* op, size_t len);

namespace {
bool RemovableOp(string_view op) { return NpuAmpOpRemovable(op.data(), op.size()) == 1; }
}  // namespace

// (issue 17) The `layer_norm` rule over the graph `graph` (the bytes the
// fresh mirror `h` was loaded from, with its op sets): NormFuser.
// `request`: sections separated by \x03: the protected names (\x02-joined);
// max_nodes; stop_at_dy ("0" / "1"); the default device type; the kernels
// that may be emitted ("type\x01op\x01dtype", \x02-joined); core._KEEP_OPS
// (\x02-joined); the ops whose presence refuses the run (unfuse.FUSED_OPS).  Writes *text: "fused\x03why\x03report\x03..." as
// sections: the fusions made, why the run ended early ("" when it did not),
// the touched names (\x02), the input's nodes removed (\x02), then the
// report's entries (each anchor \x01 fused nodes \x01 gradient nodes), and
// *out / *map: the graph's bytes after the fusions and per output node its
// index in `graph` or -1 (valid until the next call on this thread).  0 ran
// (fused may be 0), 1 could not run (why in *text), -1 bad arguments.  The
// mirror is edited: free it after.
NPU_AMP_GR_EXPORT int NpuAmpGrFuseNorms(void* h, void* memo, const char* graph, size_t graph_len,
                                        const char* request, size_t len, const char** text,
                                        size_t* text_len, const char** out, size_t* out_len,
                                        const int32_t** map, size_t* map_len) {
  thread_local string t_buf, g_buf;
  thread_local std::vector<int32_t> m_buf;
  auto* m = static_cast<Mirror*>(h);
  auto* mm = static_cast<ShapeMemo*>(memo);
  if (m == nullptr || mm == nullptr || request == nullptr || text == nullptr || out == nullptr ||
      map == nullptr || (graph_len && graph == nullptr)) {
    return -1;
  }
  m->Join();
  *text = *out = nullptr;
  *map = nullptr;
  *text_len = *out_len = *map_len = 0;
  const std::vector<string_view> sec = Split(string_view(request, len), '\x03');
  if (sec.size() != 7) return -1;
  int rc;
  try {
    NormFuser f(*m, *mm);
    for (string_view n : Split(sec[0], '\x02')) {
      if (!n.empty()) f.prot.emplace_back(n), f.prot_set.emplace(n);
    }
    f.max_nodes = std::atoll(string(sec[1]).c_str());
    f.stop_at_dy = sec[2] == "1";
    f.default_type = string(sec[3]);
    for (string_view k : Split(sec[4], '\x02')) {
      if (!k.empty()) f.kernels.emplace(k);
    }
    for (string_view k : Split(sec[5], '\x02')) {
      if (!k.empty()) f.keep_ops.emplace(k);
    }
    for (string_view k : Split(sec[6], '\x02')) {
      if (!k.empty()) f.refuse_ops.emplace(k);
    }
    f.removable_op = RemovableOp;
    rc = f.Run() < 0 ? 1 : 0;
    string touched;
    g_buf.clear();
    m_buf.clear();
    if (rc == 0 && f.fused > 0 && !f.Write(string_view(graph, graph_len), &g_buf, &m_buf, &touched)) {
      rc = 1;
      f.why = "the input bytes are not a GraphDef";
    }
    string removed;
    for (size_t i = 0; i < f.removed_base.size(); ++i) {
      if (i) removed.push_back('\x02');
      removed.append(m->name(f.removed_base[i]));
    }
    t_buf = std::to_string(rc == 0 ? f.fused : 0) + "\x03" + f.why + "\x03" + touched + "\x03" + removed +
            "\x03" + f.report;
  } catch (...) {  // (bad_alloc; a Bad in the output)
    return 1;
  }
  *text = t_buf.data();
  *text_len = t_buf.size();
  *out = g_buf.data();
  *out_len = g_buf.size();
  *map = m_buf.data();
  *map_len = m_buf.size();
  return rc;
}

// (issue 17) Whether the layer-norm rule's run could find a candidate in the
// serialized GraphDef `graph` (builtin._norm_candidates' first step: an
// Rsqrt / Sqrt read as a data input by a Mul / RealDiv), read from its bytes
// without building a mirror: 1 yes, 0 no, -1 not a GraphDef's bytes.
NPU_AMP_GR_EXPORT int NpuAmpGrNormCandidates(const char* graph, size_t len) {
  if (len && graph == nullptr) return -1;
  try {
    // (one read of the bytes, ViewsOfBytes' rules: a node's last name and op
    // count, its inputs append; only a Mul's / RealDiv's inputs are kept.
    // A serializer writes the fields in order, name, op, inputs: the rest of
    // a node whose op is none of the four is not read, and all of a node's
    // inputs are kept only if they come before its op.  A pre-check: bytes
    // written otherwise can only cost a run that finds nothing, or leave the
    // rule to Python)
    std::unordered_set<string_view> inv;
    std::vector<string_view> read;  // the Muls' and RealDivs' inputs
    std::vector<string_view> ins;
    auto product = [](string_view op) { return op == "Mul" || op == "RealDiv"; };
    const char* p = graph;
    const char* end = graph + len;
    while (p < end) {
      uint64_t tag;
      if (!wire::ReadVarint(p, end, &tag)) return -1;
      if (tag != ((1 << 3) | 2)) {
        if ((tag >> 3) == 1 || !wire::SkipField(p, end, tag & 7)) return -1;
        continue;
      }
      string_view def;
      if (!ReadBytes(p, end, &def)) return -1;
      const char* q = def.data();
      const char* qe = q + def.size();
      string_view name, op;
      ins.clear();
      while (q < qe) {
        uint64_t t;
        if (!wire::ReadVarint(q, qe, &t)) return -1;
        const uint64_t field = t >> 3;
        if (field >= 1 && field <= 3) {
          string_view str;
          if ((t & 7) != 2 || !ReadBytes(q, qe, &str)) return -1;
          if (field == 1) {
            name = str;
          } else if (field == 2) {
            op = str;
            if (!product(op) && op != "Rsqrt" && op != "Sqrt") break;  // (nothing more to read)
          } else if (op.empty() || product(op)) {
            ins.push_back(str);
          }
        } else if (!wire::SkipField(q, qe, t & 7)) {
          return -1;
        }
      }
      if (op == "Rsqrt" || op == "Sqrt") {
        inv.insert(name);
      } else if (product(op)) {
        read.insert(read.end(), ins.begin(), ins.end());
      }
    }
    if (inv.empty()) return 0;
    for (string_view ref : read) {
      string_view name;
      int64_t port;
      bool ctrl;
      if (ParseRef(ref, &name, &port, &ctrl) && !ctrl && inv.count(name)) return 1;
    }
    return 0;
  } catch (...) {  // (bad_alloc)
    return -1;
  }
}
