// The OpDef guard's pre-check in C++ (issue 17m).
//
// Before the pipeline hands a rewritten graph back, graph_passes/opdef_check.py
// checks the nodes the passes created or edited, and the data edges from them
// into their readers, against their OpDefs (a node TF would reject, or a
// kernel that would CHECK-fail and abort the process).  In Python that costs
// ~10% of the grappler callback on a Keras ResNet-50 training graph, and the
// answer is almost always "clean".  This file answers that question in C++,
// over the graph the bridge hands back (the item's nodes plus the patch of
// changed nodes, Graph.serialize_patch):
//
//   kPrecheckClean    graph_passes.opdef_check.changed_problems(after, changed,
//                     default_device) would be empty, so the guard's
//                     new_problems is too: the Python guard does not run;
//   kPrecheckFlagged  it may not be: the Python guard runs and words the
//                     problems (and drops those the input graph had);
//   kPrecheckUnable   cannot tell (a patch that does not fit, a byte the
//                     Python rules read differently): the Python guard runs.
//
// The checks mirror opdef_check.node_problems and Graph._dtype_problems rule
// by rule, so that Flagged is answered whenever Python would find a problem
// (a superset is harmless: Python then decides):
//   registered ops (OpRegistry), per changed node:
//     * an attr its OpDef lacks (names starting with '_' are allowed);
//     * an OpDef attr without default that the node lacks;
//     * a `type` attr that holds no type or a type outside allowed_values;
//       a `list(type)` attr with an entry outside allowed_values or fewer
//       entries than its minimum; an `int` attr below its minimum;
//     * (op, device type of the node, T) listed as a broken kernel, or with
//       a `fused_ops` entry listed as broken (the Python tables, handed over
//       as text: registry.BROKEN_KERNELS / BROKEN_FUSED_OPS);
//   registered ops and function calls (the library's signatures), per changed
//   node: the number of data inputs equals its signature's, and each data
//   input carries the dtype the signature wants (the producer's output dtype
//   from its own attrs and OpDef defaults; DT_RESOURCE matches anything; a
//   producer that is no node, or whose outputs are unknown, is not checked;
//   an output port past the producer's outputs is a problem);
//   per unchanged reader of a changed node whose arity is right: its data
//   edges from changed nodes, the same way.
// Python's registry.signature_of resolution is followed: a registered OpDef
// first, then a function of the output's library, then the `_Arg` / `_Retval`
// special case.  The graph is not modified.

#include "opdef_precheck.h"

#include <memory>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "graph_views.h"  // ReadVarint
#include "worker.h"       // Job
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"
#include "tensorflow/core/framework/types.pb.h"

#define NPU_AMP_EXPORT extern "C" __attribute__((visibility("default")))

namespace npu_amp_tf {
namespace {

using tensorflow::AttrValue;
using tensorflow::NodeDef;
using tensorflow::OpDef;

constexpr int kRefOffset = 100;  // DT_FLOAT_REF == DT_FLOAT + 100 (registry.REF_OFFSET)
constexpr int64_t kMaxArgs = 1 << 20;  // a number attr beyond this: not mirrored

struct AttrSpec {
  const std::string* name;
  int kind;  // 0 other, 1 type, 2 list(type), 3 int
  bool has_default;
  bool has_min;
  int64_t min;
  std::vector<int> allowed;  // empty: any
};

struct OpInfo {
  const OpDef* sig = nullptr;  // the registered OpDef, or a library function's signature
  bool registered = false;
  std::vector<AttrSpec> attrs;
  bool broken = false;  // the op has an entry in the broken table
};

struct BrokenEntry {
  std::string op, device, fused;
  int dtype;
};

std::vector<BrokenEntry> ParseBroken(std::string_view text) {
  std::vector<BrokenEntry> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    at = end + 1;
    std::string_view f[4];
    int k = 0;
    size_t p = 0;
    while (k < 4) {
      size_t q = line.find('\x01', p);
      if (q == std::string_view::npos) q = line.size();
      f[k++] = line.substr(p, q - p);
      if (q >= line.size()) break;
      p = q + 1;
    }
    if (k < 3 || f[0].empty()) continue;
    BrokenEntry e;
    e.op = std::string(f[0]);
    e.device = std::string(f[1]);
    e.dtype = std::atoi(std::string(f[2]).c_str());
    if (k == 4) e.fused = std::string(f[3]);
    out.push_back(std::move(e));
  }
  return out;
}

bool StartsWithUnderscore(const std::string& s) { return !s.empty() && s[0] == '_'; }

// registry.device_type_of: the type in "/device:TYPE:N" or "/TYPE:N" at the
// end of the device string (the regex (?:/device:|/)([A-Za-z_]+):\d+\s*$),
// upper-cased, XLA_GPU -> GPU, XLA_CPU -> CPU; `def` without a match.  False
// for a byte outside printable ASCII (Python's \s and \d also match others).
bool DeviceType(std::string_view dev, std::string_view def, std::string* out) {
  if (dev.empty()) {
    out->assign(def.data(), def.size());
    return true;
  }
  for (unsigned char c : dev) {
    if (c < 0x20 || c >= 0x7f) return false;
  }
  size_t e = dev.size();
  while (e > 0 && dev[e - 1] == ' ') --e;
  size_t d = e;
  while (d > 0 && dev[d - 1] >= '0' && dev[d - 1] <= '9') --d;
  auto is_type_char = [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
  };
  bool match = d < e && d > 0 && dev[d - 1] == ':';
  size_t t = match ? d - 1 : 0;
  const size_t t_end = t;
  while (match && t > 0 && is_type_char(dev[t - 1])) --t;
  match = match && t < t_end &&
          ((t >= 1 && dev[t - 1] == '/') || (t >= 8 && dev.substr(t - 8, 8) == "/device:"));
  if (!match) {
    out->assign(def.data(), def.size());
    return true;
  }
  std::string type(dev.substr(t, t_end - t));
  for (char& c : type) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (type == "GPU" || type == "XLA_GPU") {
    *out = "GPU";
  } else if (type == "CPU" || type == "XLA_CPU") {
    *out = "CPU";
  } else {
    *out = std::move(type);
  }
  return true;
}

class Checker {
 public:
  Checker(const std::vector<const NodeDef*>& nodes, const std::vector<char>& changed,
          const tensorflow::FunctionDefLibrary& library, std::string_view broken,
          std::string_view default_device)
      : nodes_(nodes), changed_(changed), default_device_(default_device),
        broken_(ParseBroken(broken)) {
    for (const auto& f : library.function()) {
      lib_[f.signature().name()] = &f.signature();  // (Python's dict: the last one wins)
    }
    for (const auto& b : broken_) broken_ops_.insert(b.op);
  }

  // (issue 17u) look names up in `base` (the index of the graph the
  // unchanged nodes come from, order[k] their base ids) instead of indexing
  // every output name; see OpdefPrecheckIndexed
  void UseBase(const BaseIndex* base, const std::vector<int32_t>* order) {
    base_ = base;
    order_ = order;
  }

  size_t size() const { return nodes_.size(); }

  // The names' index (every node's, or from the base index) and the
  // outputs' memo sized: what RunRange reads.  A copy of a prepared Checker
  // runs another range with memos of its own (RunSplit).
  int Prepare() {
    const size_t n = nodes_.size();
    if (changed_.size() != n) return kPrecheckUnable;
    if (base_ != nullptr) {
      if (!IndexFromBase()) return kPrecheckUnable;  // duplicate names (see there)
    } else {
      index_.reserve(n * 2);
      for (size_t k = 0; k < n; ++k) {
        if (!index_.emplace(nodes_[k]->name(), static_cast<int32_t>(k)).second) {
          return kPrecheckUnable;  // duplicate names: Python checks those itself
        }
      }
    }
    out_state_.assign(n, 0);
    out_dts_.resize(n);
    return kPrecheckClean;
  }

  // The nodes lo..hi-1 checked (Prepare first): the first problem's answer
  // in node order, else kPrecheckClean.
  int RunRange(size_t lo, size_t hi) {
    std::vector<int> want;
    std::vector<std::pair<int, const std::string*>> from_changed;
    for (size_t k = lo; k < hi; ++k) {
      const NodeDef& node = *nodes_[k];
      if (changed_[k]) {
        const OpInfo& info = Info(node.op());
        if (info.registered) {
          int rc = AttrProblems(node, info);
          if (rc != kPrecheckClean) return rc;
        }
        int r = Dtypes(node, info, /*outputs=*/false, &want);
        if (r == 2) return kPrecheckUnable;
        if (r == 1) continue;  // unknown signature: nothing to check against
        size_t data = 0;
        for (const auto& inp : node.input()) {
          if (!inp.empty() && inp[0] == '^') continue;
          ++data;
        }
        if (data != want.size()) return kPrecheckFlagged;
        size_t k_data = 0;
        for (const auto& inp : node.input()) {
          if (!inp.empty() && inp[0] == '^') continue;
          int rc = EdgeProblem(inp, want[k_data++]);
          if (rc != kPrecheckClean) return rc;
        }
        continue;
      }
      // an unchanged reader: its data edges from changed nodes, when its arity is right
      // (with a base index, only the nodes it says read a changed node: the
      // others' inputs resolve to no changed node, and being printable ASCII
      // they parse without an Unable)
      if (base_ != nullptr && !reads_changed_[k]) continue;
      from_changed.clear();
      int k_data = 0;
      for (const auto& inp : node.input()) {
        if (!inp.empty() && inp[0] == '^') continue;
        int32_t src;
        int64_t port;
        int rc = Parse(inp, &src, &port);
        if (rc != kPrecheckClean) return rc;
        if (src >= 0 && changed_[src]) from_changed.emplace_back(k_data, &inp);
        ++k_data;
      }
      if (from_changed.empty()) continue;
      const OpInfo& info = Info(node.op());
      int r = Dtypes(node, info, /*outputs=*/false, &want);
      if (r == 2) return kPrecheckUnable;
      if (r == 1 || static_cast<size_t>(k_data) != want.size()) continue;
      for (const auto& e : from_changed) {
        int rc = EdgeProblem(*e.second, want[e.first]);
        if (rc != kPrecheckClean) return rc;
      }
    }
    return kPrecheckClean;
  }

 private:
  const OpInfo& Info(const std::string& op) {
    auto it = infos_.find(op);
    if (it != infos_.end()) return it->second;
    OpInfo info;
    const OpDef* od = nullptr;
    if (tensorflow::OpRegistry::Global()->LookUpOpDef(op, &od).ok() && od != nullptr) {
      info.sig = od;
      info.registered = true;
      for (const auto& a : od->attr()) {
        AttrSpec s;
        s.name = &a.name();
        s.kind = a.type() == "type" ? 1 : a.type() == "list(type)" ? 2 : a.type() == "int" ? 3 : 0;
        s.has_default = a.has_default_value();
        s.has_min = a.has_minimum();
        s.min = a.minimum();
        if (s.kind == 1 || s.kind == 2) {
          for (int t : a.allowed_values().list().type()) s.allowed.push_back(t);
        }
        info.attrs.push_back(std::move(s));
      }
      info.broken = broken_ops_.count(op) > 0;
    } else {
      auto lit = lib_.find(op);
      if (lit != lib_.end()) info.sig = lit->second;
    }
    return infos_.emplace(op, std::move(info)).first->second;
  }

  // opdef_check.node_problems for a registered op
  int AttrProblems(const NodeDef& node, const OpInfo& info) {
    const auto& attrs = node.attr();
    for (const auto& kv : attrs) {
      if (StartsWithUnderscore(kv.first)) continue;
      bool known = false;
      for (const auto& s : info.attrs) {
        if (*s.name == kv.first) {
          known = true;
          break;
        }
      }
      if (!known) return kPrecheckFlagged;
    }
    for (const auto& s : info.attrs) {
      auto it = attrs.find(*s.name);
      if (it == attrs.end()) {
        if (!s.has_default) return kPrecheckFlagged;
        continue;
      }
      const AttrValue& v = it->second;
      auto allowed = [&s](int t) {
        return s.allowed.empty() || std::find(s.allowed.begin(), s.allowed.end(), t) != s.allowed.end();
      };
      if (s.kind == 1) {
        if (v.value_case() != AttrValue::kType || !allowed(v.type())) return kPrecheckFlagged;
      } else if (s.kind == 2) {
        for (int t : v.list().type()) {
          if (!allowed(t)) return kPrecheckFlagged;
        }
        if (s.has_min && v.list().type_size() < s.min) return kPrecheckFlagged;
      } else if (s.kind == 3) {
        if (s.has_min && v.value_case() == AttrValue::kI && v.i() < s.min) return kPrecheckFlagged;
      }
    }
    if (!info.broken) return kPrecheckClean;
    auto t = attrs.find("T");
    if (t == attrs.end() || t->second.value_case() != AttrValue::kType) return kPrecheckClean;
    std::string dev;
    if (!DeviceType(node.device(), default_device_, &dev)) return kPrecheckUnable;
    const int dt = t->second.type();
    auto fused = attrs.find("fused_ops");
    for (const auto& b : broken_) {
      if (b.op != node.op() || b.device != dev || b.dtype != dt) continue;
      if (b.fused.empty()) return kPrecheckFlagged;
      if (fused == attrs.end()) continue;
      for (const auto& f : fused->second.list().s()) {
        if (f == b.fused) return kPrecheckFlagged;
      }
    }
    return kPrecheckClean;
  }

  // registry._defaults: the node's attr, else its signature's default
  static const AttrValue* AttrOrDefault(const NodeDef& node, const OpDef& od,
                                        const std::string& name) {
    auto it = node.attr().find(name);
    if (it != node.attr().end()) return &it->second;
    for (const auto& a : od.attr()) {
      if (a.name() == name && a.has_default_value()) return &a.default_value();
    }
    return nullptr;
  }

  // registry.input_dtypes / output_dtypes: 0 known (in *out), 1 unknown (None),
  // 2 not mirrored (a number attr too large)
  static int Dtypes(const NodeDef& node, const OpInfo& info, bool outputs, std::vector<int>* out) {
    out->clear();
    if (info.sig == nullptr) {
      // an unregistered op that is no function: registry's _Arg / _Retval case
      auto t = node.attr().find("T");
      const bool has_t = t != node.attr().end();
      if (node.op() == "_Arg") {
        if (outputs && !has_t) return 1;
        if (outputs) out->push_back(t->second.type());
        return 0;
      }
      if (node.op() == "_Retval") {
        if (!outputs && !has_t) return 1;
        if (!outputs) out->push_back(t->second.type());
        return 0;
      }
      return 1;
    }
    const OpDef& od = *info.sig;
    for (const auto& arg : outputs ? od.output_arg() : od.input_arg()) {
      if (!arg.type_list_attr().empty()) {
        const AttrValue* a = AttrOrDefault(node, od, arg.type_list_attr());
        if (a == nullptr) return 1;
        for (int t : a->list().type()) out->push_back(t);
        continue;
      }
      int dt;
      if (!arg.type_attr().empty()) {
        const AttrValue* a = AttrOrDefault(node, od, arg.type_attr());
        if (a == nullptr) return 1;
        dt = a->type();
      } else {
        dt = arg.type();
      }
      if (arg.is_ref()) dt += kRefOffset;
      if (!arg.number_attr().empty()) {
        const AttrValue* a = AttrOrDefault(node, od, arg.number_attr());
        if (a == nullptr) return 1;
        const int64_t k = a->i();
        if (k > kMaxArgs) return 2;
        for (int64_t j = 0; j < k; ++j) out->push_back(dt);
      } else {
        out->push_back(dt);
      }
    }
    return 0;
  }

  // graph.parse_tensor on a data input: the producer's index (-1: no node)
  // and port; kPrecheckUnable for a port Python might read differently
  int Parse(const std::string& ref, int32_t* src, int64_t* port) {
    std::string_view name(ref);
    *port = 0;
    const size_t colon = name.rfind(':');
    if (colon != std::string_view::npos && colon + 1 < name.size()) {
      bool digits = true;
      int64_t p = 0;
      for (size_t j = colon + 1; j < name.size(); ++j) {
        const unsigned char c = static_cast<unsigned char>(name[j]);
        if (c >= 0x80) return kPrecheckUnable;  // str.isdigit() accepts non-ASCII digits
        if (c < '0' || c > '9') {
          digits = false;
          break;
        }
        p = p > (int64_t{1} << 40) ? p : p * 10 + (c - '0');  // (saturates: past any output)
      }
      if (digits) {
        *port = p;
        name = name.substr(0, colon);
      }
    }
    if (base_ != nullptr) {
      *src = Lookup(name);
      return kPrecheckClean;
    }
    auto it = index_.find(name);
    *src = it == index_.end() ? -1 : it->second;
    return kPrecheckClean;
  }

  // (issue 17u) The output node named `name` (-1: none) from the patch's
  // names and the base index.
  int32_t Lookup(std::string_view name) const {
    const int32_t p = patch_names_.Find(name);
    if (p >= 0) return patch_k_[p];
    const int32_t id = base_->names.Find(name);
    return id >= 0 ? out_of_base_[id] : -1;
  }

  // (issue 17u) The output's names from the base index: out_of_base_ (base
  // id -> output position of the unchanged node), patch_names_ (the changed
  // nodes), and reads_changed_ (the unchanged nodes with a data input whose
  // name is a changed node's: the base's consumers of that name).  False
  // when the output has a name twice (a base id twice in the order, a
  // changed node named as another or as a kept base node): the reference's
  // index_ refuses those as well.
  bool IndexFromBase() {
    const BaseIndex& b = *base_;
    const std::vector<int32_t>& order = *order_;
    const size_t n = nodes_.size();
    const int32_t nb = static_cast<int32_t>(b.names.size());
    if (order.size() != n || static_cast<int32_t>(b.slot_of_node.size()) != nb) return false;
    out_of_base_.assign(nb, -1);
    for (size_t k = 0; k < n; ++k) {
      if (changed_[k]) continue;
      const int32_t id = order[k];
      if (id < 0 || id >= nb || out_of_base_[id] >= 0) return false;
      out_of_base_[id] = static_cast<int32_t>(k);
    }
    size_t n_changed = 0;
    for (size_t k = 0; k < n; ++k) n_changed += changed_[k] ? 1 : 0;
    patch_names_.Reserve(n_changed);
    patch_k_.reserve(n_changed);
    reads_changed_.assign(n, 0);
    for (size_t k = 0; k < n; ++k) {
      if (!changed_[k]) continue;
      const std::string& name = nodes_[k]->name();
      if (!patch_names_.Insert(name)) return false;
      patch_k_.push_back(static_cast<int32_t>(k));
      const int32_t id = b.names.Find(name);
      int32_t slot = -1;
      if (id >= 0) {
        if (out_of_base_[id] >= 0) return false;
        slot = b.slot_of_node[id];
      } else {
        auto it = b.dangling.find(name);
        if (it != b.dangling.end()) slot = it->second;
      }
      if (slot < 0) continue;
      for (int32_t e = b.start[slot]; e < b.start[slot + 1]; ++e) {
        if (b.positions[e] < 0) continue;
        const int32_t r = out_of_base_[b.readers[e]];
        if (r >= 0) reads_changed_[r] = 1;
      }
    }
    return true;
  }

  // Graph._edge_problem: does data input `ref` carry `want`?
  int EdgeProblem(const std::string& ref, int want) {
    int32_t src;
    int64_t port;
    int rc = Parse(ref, &src, &port);
    if (rc != kPrecheckClean || src < 0) return rc;
    if (out_state_[src] == 0) {
      const NodeDef& p = *nodes_[src];
      int r = Dtypes(p, Info(p.op()), /*outputs=*/true, &out_dts_[src]);
      if (r == 2) return kPrecheckUnable;
      if (r == 1) out_dts_[src].clear();  // (Python: output_dtypes(...) or ())
      out_state_[src] = 1;
    }
    const std::vector<int>& dts = out_dts_[src];
    if (port >= static_cast<int64_t>(dts.size())) {
      return dts.empty() ? kPrecheckClean : kPrecheckFlagged;
    }
    auto base = [](int dt) { return dt > kRefOffset ? dt - kRefOffset : dt; };
    const int have = base(dts[port]), w = base(want);
    if (have != w && have != tensorflow::DT_RESOURCE && w != tensorflow::DT_RESOURCE) {
      return kPrecheckFlagged;
    }
    return kPrecheckClean;
  }

  const std::vector<const NodeDef*>& nodes_;
  const std::vector<char>& changed_;
  std::string_view default_device_;
  std::vector<BrokenEntry> broken_;
  std::unordered_set<std::string> broken_ops_;
  std::unordered_map<std::string, const OpDef*> lib_;
  std::unordered_map<std::string, OpInfo> infos_;
  std::unordered_map<std::string_view, int32_t> index_;
  // (issue 17u) with a base index (UseBase)
  const BaseIndex* base_ = nullptr;
  const std::vector<int32_t>* order_ = nullptr;
  std::vector<int32_t> out_of_base_;
  NameTable patch_names_;
  std::vector<int32_t> patch_k_;
  std::vector<char> reads_changed_;
  std::vector<char> out_state_;
  std::vector<std::vector<int>> out_dts_;
};

}  // namespace

bool PatchNodes(const tensorflow::GraphDef& base, const std::vector<int32_t>& order,
                const tensorflow::GraphDef& patch, std::vector<const NodeDef*>* nodes,
                std::vector<char>* changed) {
  nodes->clear();
  changed->clear();
  nodes->reserve(order.size());
  changed->reserve(order.size());
  int next = 0;
  const int n_base = base.node_size();
  for (const int32_t k : order) {
    if (k >= 0) {
      if (k >= n_base) return false;
      nodes->push_back(&base.node(k));
      changed->push_back(0);
    } else {
      if (next >= patch.node_size()) return false;
      nodes->push_back(&patch.node(next++));
      changed->push_back(1);
    }
  }
  return next == patch.node_size();
}

namespace {

// (issue 17) The nodes of a prepared checker in two halves on two threads
// when there are g_precheck_split_min or more (0: never): the first half's
// answer when it is not clean, else the second's, which is the answer of
// one pass in node order.  The second half runs on a copy (memos of its
// own: a producer's outputs may be worked out on both sides); when no
// helper thread can be had, or the job fails, this thread runs it.
int RunSplit(Checker& checker) {
  int rc = checker.Prepare();
  if (rc != kPrecheckClean) return rc;
  const size_t n = checker.size();
  const int64_t min = g_precheck_split_min.load();
  if (min <= 0 || n < static_cast<size_t>(min)) return checker.RunRange(0, n);
  const size_t mid = n / 2;
  int rc2 = kPrecheckClean;
  bool ran = false;
  {
    std::unique_ptr<Checker> other;
    Job job;
    try {
      other = std::make_unique<Checker>(checker);
      Checker* o = other.get();
      job = Job([o, mid, n, &rc2, &ran] {
        try {
          rc2 = o->RunRange(mid, n);
          ran = true;
        } catch (...) {  // (this thread runs the half again)
        }
      });
    } catch (...) {  // (no helper thread, no memory: this thread runs it)
    }
    rc = checker.RunRange(0, mid);
  }  // (the job joined before `other` goes)
  if (rc != kPrecheckClean) return rc;
  return ran ? rc2 : checker.RunRange(mid, n);
}

}  // namespace

std::atomic<int64_t> g_precheck_split_min{kPrecheckSplitNodes};

int OpdefPrecheck(const std::vector<const NodeDef*>& nodes, const std::vector<char>& changed,
                  const tensorflow::FunctionDefLibrary& library, std::string_view broken,
                  std::string_view default_device) {
  Checker checker(nodes, changed, library, broken, default_device);
  return RunSplit(checker);
}

int OpdefPrecheckIndexed(const tensorflow::GraphDef& base, const BaseIndex& index,
                         const std::vector<int32_t>& order, const tensorflow::GraphDef& patch,
                         std::string_view broken, std::string_view default_device) {
  if (!index.valid || static_cast<int>(index.names.size()) != base.node_size() ||
      index.start.size() < 1 || index.readers.size() != index.positions.size()) {
    return kPrecheckUnable;
  }
  std::vector<const NodeDef*> nodes;
  std::vector<char> changed;
  if (!PatchNodes(base, order, patch, &nodes, &changed)) return kPrecheckUnable;
  Checker checker(nodes, changed, patch.library(), broken, default_device);
  checker.UseBase(&index, &order);
  return RunSplit(checker);
}

namespace {

// Reads the records' little-endian int32s and strings (ParsePatch).
struct RecordReader {
  const char* p;
  const char* end;
  bool ok = true;
  int32_t Int() {
    int32_t v = 0;
    if (end - p < 4) {
      ok = false;
      return 0;
    }
    std::memcpy(&v, p, 4);
    p += 4;
    return v;
  }
  std::string_view Str() {
    const int32_t len = Int();
    if (!ok || len < 0 || len > end - p) {
      ok = false;
      return {};
    }
    std::string_view out(p, static_cast<size_t>(len));
    p += len;
    return out;
  }
};

bool Refuse(std::string* why, const char* what) {
  *why = std::string("the patch's records ") + what;
  return false;
}

// The records of `rec` applied (see ParsePatch): *patch holds the payload's
// nodes; *order the entries given.
bool ApplyRecords(const tensorflow::GraphDef& base, std::string_view rec,
                  tensorflow::GraphDef* patch, std::vector<int32_t>* order, std::string* why,
                  tensorflow::GraphDef* steal, std::vector<StolenNode>* stolen) {
  const int nb = base.node_size();
  std::vector<int32_t> slot_of(static_cast<size_t>(nb), -1);
  for (size_t k = 0; k < order->size(); ++k) {
    const int32_t v = (*order)[k];
    if (v >= -1) continue;
    const int64_t b = -2 - static_cast<int64_t>(v);
    if (b >= nb || slot_of[b] >= 0) {
      *why = "the patch names a node the graph does not have, or one twice";
      return false;
    }
    slot_of[b] = static_cast<int32_t>(k);
  }
  // the payload's nodes and the record nodes, in output order
  auto* nodes = patch->mutable_node();
  const int n_payload = nodes->size();
  std::vector<std::unique_ptr<tensorflow::NodeDef>> owned(order->size());
  // (steal) per output slot: its entry in *stolen, or -1
  std::vector<int32_t> stolen_at(steal != nullptr ? order->size() : 0, -1);
  // (declared after `owned`: runs first) a refusal puts every stolen node back
  struct Undo {
    tensorflow::GraphDef* steal;
    std::vector<StolenNode>* stolen;
    bool done = false;
    ~Undo() {
      if (!done && steal != nullptr) RestoreStolen(steal, stolen);
    }
  } undo{steal, stolen};
  {
    std::vector<tensorflow::NodeDef*> fresh(static_cast<size_t>(n_payload));
    if (n_payload) nodes->ExtractSubrange(0, n_payload, fresh.data());
    int next = 0;
    for (size_t k = 0; k < order->size(); ++k) {
      const int32_t v = (*order)[k];
      if (v == -1) {
        if (next >= n_payload) {
          *why = "the patch holds fewer nodes than its order needs";
          return false;
        }
        owned[k].reset(fresh[next++]);
      } else if (v < -1) {
        const int b = static_cast<int>(-2 - int64_t{v});
        if (steal != nullptr) {
          owned[k] = std::make_unique<tensorflow::NodeDef>();
          owned[k]->Swap(steal->mutable_node(b));
          stolen_at[k] = static_cast<int32_t>(stolen->size());
          stolen->emplace_back();
          stolen->back().base_index = b;
          stolen->back().node = owned[k].get();
        } else {
          owned[k] = std::make_unique<tensorflow::NodeDef>(base.node(b));
        }
      }
    }
    if (next != n_payload) {
      for (int i = next; i < n_payload; ++i) delete fresh[i];
      *why = "the patch holds more nodes than its order uses";
      return false;
    }
  }
  RecordReader r{rec.data(), rec.data() + rec.size()};
  if (r.Int() != kPatchRecordsVersion || !r.ok) return Refuse(why, "are of another version");
  // the distinct attr sets: [(name, AttrValue)]
  const int32_t n_sets = r.Int();
  if (!r.ok || n_sets < 0 || n_sets > (r.end - r.p) / 4) return Refuse(why, "do not parse");
  std::vector<std::vector<std::pair<std::string, tensorflow::AttrValue>>> sets(static_cast<size_t>(n_sets));
  for (auto& set : sets) {
    const int32_t attrs = r.Int();
    if (!r.ok || attrs < 0 || attrs > (r.end - r.p) / 8) return Refuse(why, "do not parse");
    set.resize(static_cast<size_t>(attrs));
    for (auto& [name, av] : set) {
      name = std::string(r.Str());
      const std::string_view value = r.Str();
      if (!r.ok || !av.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
        return Refuse(why, "do not parse");
      }
    }
  }
  // the groups: per group its member count and its set, then every member
  const int32_t groups = r.Int();
  if (!r.ok || groups < 0 || groups > (r.end - r.p) / 8) return Refuse(why, "do not parse");
  const char* counts = r.p;
  const char* set_ids = r.p + 4 * static_cast<size_t>(groups);
  r.p += 8 * static_cast<size_t>(groups);
  for (int32_t g = 0; g < groups; ++g) {
    int32_t m, id;
    std::memcpy(&m, counts + 4 * static_cast<size_t>(g), 4);
    std::memcpy(&id, set_ids + 4 * static_cast<size_t>(g), 4);
    if (m < 0 || m > (r.end - r.p) / 4 || id < 0 || id >= n_sets) return Refuse(why, "do not parse");
    const auto& set = sets[static_cast<size_t>(id)];
    for (int32_t i = 0; i < m; ++i) {
      int32_t b;
      std::memcpy(&b, r.p + 4 * static_cast<size_t>(i), 4);
      if (b < 0) return Refuse(why, "name a node the graph does not have");
      if (b >= nb || slot_of[b] < 0) continue;  // (created, removed, or sent whole)
      auto* attr = owned[slot_of[b]]->mutable_attr();
      if (steal != nullptr) {
        auto& log = (*stolen)[stolen_at[slot_of[b]]].attrs;
        for (const auto& [name, av] : set) {
          auto it = attr->find(name);
          log.emplace_back(name, it == attr->end() ? nullptr
                                                   : std::make_unique<tensorflow::AttrValue>(it->second));
        }
      }
      for (const auto& [name, av] : set) (*attr)[name] = av;
    }
    r.p += 4 * static_cast<size_t>(m);
  }
  const int32_t edits = r.Int();
  if (!r.ok || edits < 0 || edits > (r.end - r.p) / 8) return Refuse(why, "do not parse");
  const char* at_node = r.p;
  const char* at_index = r.p + 4 * static_cast<size_t>(edits);
  r.p += 8 * static_cast<size_t>(edits);
  const std::string_view refs = r.Str();
  if (!r.ok || r.p != r.end) return Refuse(why, "do not parse");
  size_t from = 0;
  for (int32_t e = 0; e < edits; ++e) {
    size_t to = refs.find('\x01', from);
    if (to == std::string_view::npos) to = refs.size();
    if (e + 1 < edits && to == refs.size()) return Refuse(why, "hold fewer inputs than edits");
    const std::string_view ref = refs.substr(from, to - from);
    from = to + 1;
    int32_t b, index;
    std::memcpy(&b, at_node + 4 * static_cast<size_t>(e), 4);
    std::memcpy(&index, at_index + 4 * static_cast<size_t>(e), 4);
    if (b < 0) return Refuse(why, "name a node the graph does not have");
    if (b >= nb || slot_of[b] < 0) continue;
    tensorflow::NodeDef* node = owned[slot_of[b]].get();
    if (index < 0 || index >= node->input_size()) return Refuse(why, "name an input a node does not have");
    if (steal != nullptr) (*stolen)[stolen_at[slot_of[b]]].inputs.emplace_back(index, node->input(index));
    node->set_input(index, std::string(ref));
  }
  if (edits > 0 ? from != refs.size() + 1 : !refs.empty()) return Refuse(why, "hold more inputs than edits");
  nodes->Reserve(static_cast<int>(order->size()));
  for (size_t k = 0; k < order->size(); ++k) {
    if ((*order)[k] >= 0) continue;
    (*order)[k] = -1;
    nodes->AddAllocated(owned[k].release());
  }
  undo.done = true;
  return true;
}

}  // namespace

void RestoreStolen(tensorflow::GraphDef* base, std::vector<StolenNode>* stolen) {
  for (auto it = stolen->rbegin(); it != stolen->rend(); ++it) {
    tensorflow::NodeDef* node = it->node;
    for (auto in = it->inputs.rbegin(); in != it->inputs.rend(); ++in) {
      node->set_input(in->first, std::move(in->second));
    }
    auto* attr = node->mutable_attr();
    for (auto a = it->attrs.rbegin(); a != it->attrs.rend(); ++a) {
      if (a->second != nullptr) {
        (*attr)[a->first] = std::move(*a->second);
      } else {
        attr->erase(a->first);
      }
    }
    base->mutable_node(it->base_index)->Swap(node);
  }
  stolen->clear();
}

bool ParsePatch(const tensorflow::GraphDef& base, const int32_t* order, size_t n,
                const char* data, size_t len, tensorflow::GraphDef* patch,
                std::vector<int32_t>* order_out, std::string* why, tensorflow::GraphDef* steal,
                std::vector<StolenNode>* stolen) {
  if (steal != nullptr && (steal != &base || stolen == nullptr || !stolen->empty())) {
    steal = nullptr;  // (only the base itself, into an empty log)
  }
  order_out->assign(order, order + n);
  const char* p = data;
  const char* end = data + len;
  std::string_view rec;
  bool has_rec = false;
  {
    const char* q = p;
    uint64_t tag, size;
    if (ReadVarint(q, end, &tag) && tag == ((uint64_t{kPatchRecordsField} << 3) | 2)) {
      if (!ReadVarint(q, end, &size) || size > static_cast<uint64_t>(end - q)) {
        return Refuse(why, "do not parse");
      }
      rec = std::string_view(q, static_cast<size_t>(size));
      has_rec = true;
      p = q + size;
    }
  }
  patch->Clear();
  if (!patch->ParseFromArray(p, static_cast<int>(end - p))) {
    *why = "the patch does not parse as a GraphDef";
    return false;
  }
  if (!has_rec) {
    for (const int32_t v : *order_out) {
      if (v < -1) return Refuse(why, "are missing: the order names a record node");
    }
    return true;
  }
  return ApplyRecords(base, rec, patch, order_out, why, steal, stolen);
}

}  // namespace npu_amp_tf

// The pre-check offline (rewrite_graph with a patch; tests): `graph` the
// serialized input GraphDef, order / patch as for NpuAmpAssemblePatch,
// `broken` and `device` as for OpdefPrecheck.  Returns kPrecheck*.
NPU_AMP_EXPORT int NpuAmpGraphOpdefPrecheck(const char* graph, size_t graph_len,
                                            const int32_t* order, size_t n, const char* patch,
                                            size_t patch_len, const char* broken,
                                            size_t broken_len, const char* device) {
  tensorflow::GraphDef base, delta;
  std::vector<int32_t> full;
  std::string why;
  if (!base.ParseFromArray(graph, static_cast<int>(graph_len)) ||
      !npu_amp_tf::ParsePatch(base, order, n, patch, patch_len, &delta, &full, &why)) {
    return npu_amp_tf::kPrecheckUnable;
  }
  std::vector<const tensorflow::NodeDef*> nodes;
  std::vector<char> changed;
  if (!npu_amp_tf::PatchNodes(base, full, delta, &nodes, &changed)) {
    return npu_amp_tf::kPrecheckUnable;
  }
  return npu_amp_tf::OpdefPrecheck(nodes, changed, delta.library(),
                                   std::string_view(broken, broken_len),
                                   std::string_view(device ? device : "CPU"));
}
