// The grappler bridge: a CustomGraphOptimizer named "NpuAmpOptimizer" that
// hands every graph grappler optimizes to the Python pass pipeline.
//
//   grappler MetaOptimizer
//     └─ NpuAmpOptimizer::Optimize(cluster, item, &out)
//          │ serialize item.graph, the parameter_map (RewriterConfig
//          │ CustomGraphOptimizer), item.fetch, item.NodesToPreserve(),
//          │ the cluster's device names, item.id
//          ▼
//        g_callback(sink, ...)      <- a plain C function pointer, set from
//          │                           Python with ctypes (NpuAmpSetCallback);
//          │                           ctypes takes the GIL itself
//          │ Python calls NpuAmpWriteResult(sink, bytes),
//          │ NpuAmpWritePatch(sink, order, changed nodes) or
//          │ NpuAmpWriteError(sink, message) before returning
//          ▼
//        parse the bytes back into `out` (a patch: the item's unchanged
//        nodes copied, the changed ones parsed; AssemblePatch)
//
// Shapes (issue 17): while the callback runs, Python may call
// NpuAmpItemShapes(sink) to get grappler's own static shape inference
// (GraphProperties::InferStatically) of the item it was handed, computed here
// on demand from the GrapplerItem already in memory; NpuAmpGraphShapes does the
// same for a serialized GraphDef (offline rewrite_graph).  Format, one line per
// node with outputs: "name\x01shape|shape..." with a shape "?" (unknown rank)
// or comma-separated dims (-1 unknown, "" for a scalar).
//
// Indexes (issue 17): NpuAmpItemIndex(sink) gives Python the item's names,
// op-type and consumers indexes and its topological order (GraphIndexText),
// built here in one pass over the GraphDef grappler already holds, instead of
// per edge in Python (graph_passes.graph.Graph(index=...)).
//
// OpDef pre-check (issue 17m): before Python returns a patch, it may call
// NpuAmpItemOpdefPrecheck(sink, patch) to learn in C++ whether the changed
// nodes and their edges satisfy their OpDefs (opdef_precheck.cc); the Python
// guard (graph_passes/opdef_check.py) runs only when that is not certain.
//
// Work skipped before Python is called (counted, see NpuAmpSkipCount):
//   * a graph this optimizer already rewrote: its output carries the attr
//     kDoneAttr (a hash of parameters, fetch, preserve and devices) on the
//     first node grappler must preserve, which no other optimizer removes.
//     Grappler's second meta-optimizer iteration gets it back, often changed
//     by the built-in optimizers in between; like grappler's own
//     auto_mixed_precision (a "run once" optimizer) it is not rewritten again;
//   * the graph's bytes equal a graph this optimizer left unchanged, or
//     returned without a mark (no preserved node to carry it), under the same
//     parameters, fetch, preserve and devices (a function instantiated
//     again): a fingerprint is remembered;
//   * tf.data functions (item id "...Dataset_...") and graphs without any
//     float tensor type in their nodes or function library.
//
// No Python headers are used: the library links only against TensorFlow.
// The library is loaded by tf.load_op_library (which registers the optimizer
// and the NpuAmpRaiseError op) and by ctypes.CDLL on the *same path*; dlopen
// returns the same handle for the same file, so both see one g_callback.
//
// Return codes of the callback:
//   0  OK: a result graph was written with NpuAmpWriteResult
//   1  unchanged: grappler keeps the input graph (Status Aborted, which the
//      meta-optimizer treats as "did nothing")
//   2  error: a message was written with NpuAmpWriteError (Status Internal;
//      grappler logs it and keeps the input graph)
//   3  unchanged for now (a re-entrant call, an unexpected error): like 1,
//      but the graph is not remembered as needing nothing
//
// The NpuAmpRaiseError op exists so that errors the user must see (invalid
// parameters, a pass failure with fail_on_error=True) reach the user even
// though grappler and its callers swallow optimizer errors: the Python side
// returns a graph in which every root node waits on an NpuAmpRaiseError
// node, so the first Session.run / function call fails with the message.

#include <time.h>

#include <mutex>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/grappler/clusters/cluster.h"
#include "tensorflow/core/grappler/costs/graph_properties.h"
#include "tensorflow/core/grappler/grappler_item.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/lib/strings/proto_serialization.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/protobuf/rewriter_config.pb.h"
#include "deferred_free.h"
#include "graph_views.h"
#include "opdef_precheck.h"
#include "worker.h"

// farmhash, as TensorFlow builds and exports it (util::Fingerprint64, what
// tsl::Fingerprint64 calls; TF's pip headers carry it under external/, off
// tsl/platform/fingerprint.h's include path): the item's fingerprint in 0.3 ms
// for 4.2 MB instead of std::hash's 0.7 ms.  std::hash where it is absent.
#if __has_include(<farmhash.h>)
#include <farmhash.h>
#define NPU_AMP_FARMHASH 1
#elif __has_include("external/farmhash_archive/src/farmhash.h")
#include "external/farmhash_archive/src/farmhash.h"
#define NPU_AMP_FARMHASH 1
#endif

#define NPU_AMP_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
// (grad_region.cc, the same library) the gradient-region mirror's handle
// calls: Optimize starts a mirror's load before the callback (kFlagEarlyMirror)
void* NpuAmpGrMirrorNew();
void NpuAmpGrMirrorFree(void* h);
int NpuAmpGrMirrorLoadAsync(void* h, const char* data, size_t len);
int NpuAmpGrMirrorWait(void* h);
typedef int (*NpuAmpCallbackFn)(void* sink, const char* graph, size_t graph_len,
                                const char* config, size_t config_len,
                                const char* fetch, const char* preserve,
                                const char* devices, const char* item_id);
}

namespace {

std::atomic<NpuAmpCallbackFn> g_callback{nullptr};
std::atomic<uint64_t> g_optimize_calls{0};
std::atomic<int> g_in_flight{0};

constexpr int kBridgeAbiVersion = 1;

// ---- step timings (issue 17r) -------------------------------------------------
// Thread CPU time of each step of the last Optimize() that called Python (and
// of the index / pre-check calls made inside it), in ns; read with
// NpuAmpStepTimes.  A few clock_gettime calls per Optimize(): always on.
enum Step {
  kStepNoFloat,      // HasNoFloat
  kStepSerialize,    // item.graph -> bytes
  kStepContext,      // fetch/preserve/devices, mark, fingerprint
  kStepCallback,     // the whole Python callback (ctypes, GIL, handle, write)
  kStepIndex,        // NpuAmpItemIndex (inside the callback)
  kStepPrecheck,     // NpuAmpItemOpdefPrecheck (inside the callback)
  kStepAssemble,     // the patch (or bytes) -> optimized_graph
  kStepMark,         // the done mark / fingerprint of the output
  kStepTotal,        // the whole Optimize()
  kStepPrecheckParse,  // (part of kStepPrecheck) the patch parsed, its records applied
  kStepCount
};
std::atomic<int64_t> g_step_ns[kStepCount];

int64_t ThreadCpuNs() {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

using npu_amp_tf::GraphViews;
using npu_amp_tf::AttrsOfBytes;
using npu_amp_tf::ViewsOfBytes;

// (issue 17) record nodes the pre-check took out of items, and those put
// back (NpuAmpStealCounts; Sink::stolen)
std::atomic<uint64_t> g_stolen{0};
std::atomic<uint64_t> g_stolen_restored{0};

struct Sink {
  std::string result;
  std::string error;
  bool has_result = false;
  bool has_error = false;
  // a result given as a patch of the item's graph (NpuAmpWritePatch)
  std::vector<int32_t> patch_order;
  std::string patch;
  bool has_patch = false;
  // (issue 17) the item being optimized, valid while the callback runs.  It
  // is read through WholeItem() / MutableWholeGraph(), which put back first
  // any record node the pre-check took out of it (kFlagStealRecords), so no
  // reader meets an emptied NodeDef; only the pre-check's own readers of
  // `checked`, which know which nodes were taken, use GraphAsTaken().
 private:
  const tensorflow::grappler::GrapplerItem* item_ = nullptr;

 public:
  bool in_call() const { return item_ != nullptr; }
  void set_item(const tensorflow::grappler::GrapplerItem* item) { item_ = item; }
  const tensorflow::grappler::GrapplerItem& WholeItem() {
    RestoreStolen();
    return *item_;
  }
  tensorflow::GraphDef* MutableWholeGraph() {
    RestoreStolen();
    return const_cast<tensorflow::GraphDef*>(&item_->graph);
  }
  const tensorflow::GraphDef& GraphAsTaken() const { return item_->graph; }
  // the item's shapes
  std::string shapes;
  bool has_shapes = false;
  std::string index;
  // the patch the OpDef pre-check parsed (NpuAmpItemOpdefPrecheck): reused
  // by AssemblePatch when the patch written is the same
  tensorflow::GraphDef checked;
  std::string checked_bytes;
  std::vector<int32_t> checked_order;  // (as written: compared with patch_order)
  // (issue 17) checked_order with its record nodes' entries -1, as `checked`
  // holds them made (npu_amp_tf::ParsePatch)
  std::vector<int32_t> checked_full;
  bool has_checked = false;
  // (issue 17, kFlagMoveItemNodes) the record nodes ParsePatch took out of
  // the item (empty NodeDefs there) into `checked`: put back by
  // RestoreStolen on every path but the assembly of `checked`, which moves
  // them on into grappler's output (CommitStolen)
  std::vector<npu_amp_tf::StolenNode> stolen;
  tensorflow::GraphDef* stolen_from = nullptr;
  void RestoreStolen() {
    if (stolen_from == nullptr) return;
    g_stolen_restored.fetch_add(stolen.size());
    npu_amp_tf::RestoreStolen(stolen_from, &stolen);
    stolen_from = nullptr;
    has_checked = false;  // (its record nodes are the item's again)
  }
  void CommitStolen() {
    // (the undo logs, ~1.5k on BERT-12: freed on the helper thread)
    try {
      npu_amp_tf::DeferFree([logs = std::make_shared<std::vector<npu_amp_tf::StolenNode>>(
                                 std::move(stolen))]() mutable { logs.reset(); });
    } catch (...) {  // (bad_alloc: freed here)
    }
    stolen.clear();
    stolen_from = nullptr;
  }
  // (issue 17r) NpuAmpSinkFlags: kFlagMoveItemNodes, kFlagIndexFromBytes;
  // and the item's serialized bytes (valid while the callback runs)
  int flags = 0;
  std::string_view graph_bytes;
  // (issue 17u) the item index's names and edges (NpuAmpItemIndex with
  // kFlagPrecheckFromIndex), for NpuAmpItemOpdefPrecheck; and the item's
  // fingerprint (NpuAmpItemFingerprint)
  npu_amp_tf::BaseIndex kept;
  uint64_t fingerprint = 0;
  // (issue 17) the views NpuAmpItemIndex read the item's names and inputs
  // through (of graph_bytes, or of the item's GraphDef), for
  // NpuAmpItemPaintStrings; null until then
  std::shared_ptr<GraphViews> views;
  // (issue 17) the index built on a helper thread (NpuAmpItemIndexStart)
  // while Python parses the bytes: index, kept, views and index_rc are its
  // until JoinIndex; every reader of them joins first, and the callback's
  // caller joins as soon as the callback returns (a job on a kept helper
  // thread, worker.h)
  npu_amp_tf::Job index_thread;
  int index_rc = -1;  // the index built: 0, or 1 (refused); -1 not built
  // (issue 17, kFlagLateClasses) the thread hands the index over
  // (PublishIndex: index, kept, views and index_rc written) before it
  // computes the signature classes into `classes` (classes_rc 0; read after
  // the join, NpuAmpItemClasses)
  std::mutex index_mu;
  std::condition_variable index_cv;
  bool index_published = false;
  std::vector<int32_t> classes;
  int classes_rc = -1;
  void PublishIndex(int rc) {
    {
      std::lock_guard<std::mutex> lk(index_mu);
      index_rc = rc;
      index_published = true;
    }
    index_cv.notify_all();
  }
  // NpuAmpItemIndex's wait: until the thread has handed the index over (or
  // there is no thread)
  void WaitIndex() {
    if (!index_thread.joinable()) return;
    std::unique_lock<std::mutex> lk(index_mu);
    index_cv.wait(lk, [this] { return index_published; });
  }
  // the index, its classes and views forgotten (the thread joined first)
  void ForgetIndex() {
    JoinIndex();
    index_rc = -1;
    index.clear();
    kept = npu_amp_tf::BaseIndex();
    views.reset();
    index_published = false;
    classes.clear();
    classes_rc = -1;
  }
  // (issue 17, kFlagEarlyIndex) the index was started by Optimize before the
  // callback, with the flags Python set on the previous call (index_flags)
  bool early_index = false;
  int index_flags = 0;
  bool flags_set = false;  // NpuAmpSinkFlags called in this callback
  void JoinIndex() {
    if (index_thread.joinable()) index_thread.join();
  }
  // (issue 17) the layer-norm fusions made before the parse
  // (NpuAmpSinkUsePrefused): the item's graph holds the fused graph (its
  // nodes moved, not copied) and graph_bytes views prefused_bytes; the
  // item's own nodes in their order, until the call ends: RestorePrefused
  // puts them back (the graph is handed back unchanged), CommitPrefused frees
  // those the fused graph does not hold (it replaced the item's graph)
  std::string prefused_bytes;
  // the views of prefused_bytes NpuAmpSinkUsePrefused read, for the index
  // built next (BuildItemIndex takes them: the bytes are not read again)
  std::shared_ptr<GraphViews> prefused_views;
  tensorflow::GraphDef* prefused_graph = nullptr;
  std::vector<tensorflow::NodeDef*> prefused_orig;
  std::vector<char> prefused_kept;  // per original node: the fused graph holds it
  void RestorePrefused() {
    if (prefused_graph == nullptr) return;
    auto* nodes = prefused_graph->mutable_node();
    const int n = nodes->size();
    std::vector<tensorflow::NodeDef*> cur(static_cast<size_t>(n));
    if (n) nodes->ExtractSubrange(0, n, cur.data());
    std::unordered_set<tensorflow::NodeDef*> orig(prefused_orig.begin(), prefused_orig.end());
    for (tensorflow::NodeDef* p : cur) {
      if (!orig.count(p)) delete p;
    }
    for (tensorflow::NodeDef* p : prefused_orig) nodes->AddAllocated(p);
    prefused_orig.clear();
    prefused_graph = nullptr;
  }
  void CommitPrefused() {
    if (prefused_graph == nullptr) return;
    // (the replaced nodes, ~1,900 on BERT-12: freed on the helper thread;
    // inline when that cannot be arranged, bad_alloc)
    bool handed = false;
    try {
      std::vector<tensorflow::NodeDef*> gone;
      for (size_t k = 0; k < prefused_orig.size(); ++k) {
        if (!prefused_kept[k]) gone.push_back(prefused_orig[k]);
      }
      if (!gone.empty()) {
        npu_amp_tf::DeferFree([gone = std::move(gone)] {
          for (tensorflow::NodeDef* p : gone) delete p;
        });
      }
      handed = true;
    } catch (...) {
    }
    if (!handed) {
      for (size_t k = 0; k < prefused_orig.size(); ++k) {
        if (!prefused_kept[k]) delete prefused_orig[k];
      }
    }
    prefused_orig.clear();
    prefused_graph = nullptr;
  }
  // (issue 17, kFlagEarlyMirror) the gradient-region mirror Optimize began
  // loading from graph_bytes before the callback (NpuAmpGrMirrorLoadAsync),
  // until the callback takes it (NpuAmpSinkTakeMirror); one left untaken is
  // freed, its load joined, before graph_bytes is
  void* early_mirror = nullptr;
  void DropEarlyMirror() {
    if (early_mirror != nullptr) NpuAmpGrMirrorFree(early_mirror);  // (joins its load first)
    early_mirror = nullptr;
  }
  ~Sink() {
    DropEarlyMirror();
    JoinIndex();
    RestoreStolen();    // (before RestorePrefused: they are the fused graph's nodes)
    RestorePrefused();  // (a path that neither restored nor committed: the item as it came)
    // (issue 17) what the call leaves (the patch parsed for the pre-check,
    // the index, the bytes) destroyed on the helper thread: no reader is left
    struct Left {
      tensorflow::GraphDef checked;
      std::string result, patch, shapes, index, checked_bytes, prefused_bytes;
      npu_amp_tf::BaseIndex kept;
      std::shared_ptr<GraphViews> views, prefused_views;
    };
    try {  // (bad_alloc: what was moved is freed here, the rest by the members' destructors)
      auto left = std::make_shared<Left>();
      left->checked.Swap(&checked);
      left->result.swap(result);
      left->patch.swap(patch);
      left->shapes.swap(shapes);
      left->index.swap(index);
      left->checked_bytes.swap(checked_bytes);
      left->prefused_bytes.swap(prefused_bytes);
      left->kept = std::move(kept);
      left->views = std::move(views);
      left->prefused_views = std::move(prefused_views);
      npu_amp_tf::DeferFree([left = std::move(left)]() mutable { left.reset(); });
    } catch (...) {
    }
  }
};

// Sink flags (issue 17r), set by Python (bridge.MOVE_ITEM_NODES,
// bridge.INDEX_FROM_BYTES); 0 is the reference behaviour.
constexpr int kFlagMoveItemNodes = 1;   // AssembleParsedPatch moves the item's nodes
constexpr int kFlagIndexFromBytes = 2;  // GraphIndexText reads ViewsOfBytes
// (issue 17u) set by Python (bridge.FAST_INDEX, bridge.PRECHECK_FROM_INDEX)
constexpr int kFlagFastIndex = 4;          // GraphIndexText: NameTable, IsAsciiWords, binary keys
constexpr int kFlagPrecheckFromIndex = 8;  // the pre-check reads the item index (Sink::kept)
// (issue 17) set by Python (bridge.EARLY_INDEX with bridge.INDEX_IN_BACKGROUND):
// the next items' index may start on its helper thread as soon as their
// bytes are written, before the callback, with these flags
constexpr int kFlagEarlyIndex = 16;
// (issue 17) set by Python (bridge.STEAL_RECORDS, with kFlagMoveItemNodes):
// the pre-check's ParsePatch takes the record nodes out of the item instead
// of copying them (Sink::stolen)
constexpr int kFlagStealRecords = 32;
// (issue 17) set by Python (bridge.LATE_CLASSES): the index built on its
// helper thread is handed over before its signature classes, which the
// thread computes next, while Python adopts the index (NpuAmpItemClasses)
constexpr int kFlagLateClasses = 64;
// (issue 17) set by Python (bridge.EARLY_MIRROR) when the callback ran the
// layer-norm fusion before the parse: the next items' gradient-region mirror
// starts loading from their bytes on a helper thread before the callback
// (Sink::early_mirror), where the early index would start otherwise
constexpr int kFlagEarlyMirror = 128;
// the flags the index's bytes and kept arrays are built with
constexpr int kIndexFlags =
    kFlagIndexFromBytes | kFlagFastIndex | kFlagPrecheckFromIndex | kFlagLateClasses;
// NpuAmpLateClassesCounts: indexes handed over before their classes, and
// classes computed after the hand-over
std::atomic<uint64_t> g_late_indexes{0};
std::atomic<uint64_t> g_late_classes{0};
// the flags of the last NpuAmpSinkFlags call (-1: none yet), and how many
// early indexes were started and how many discarded (the callback's flags
// differed, or no longer allowed it): NpuAmpEarlyIndexCounts
std::atomic<int> g_early_flags{-1};
std::atomic<uint64_t> g_early_started{0};
std::atomic<uint64_t> g_early_discarded{0};
// mirrors Optimize started loading before the callback, and those the
// callback took (NpuAmpEarlyMirrorCounts)
std::atomic<uint64_t> g_early_mirrors{0};
std::atomic<uint64_t> g_early_mirrors_taken{0};

// ---- shapes -----------------------------------------------------------------
// Runs grappler's static shape inference on `item` and writes the line format
// described in the header comment.  Returns false (message in *out) on error.
bool InferShapesText(const tensorflow::grappler::GrapplerItem& item, std::string* out) {
  tensorflow::grappler::GraphProperties props(item);
  auto st = props.InferStatically(/*assume_valid_feeds=*/true,
                                  /*aggressive_shape_inference=*/false,
                                  /*include_input_tensor_values=*/false,
                                  /*include_output_tensor_values=*/false);
  if (!st.ok()) {
    *out = std::string(st.message());
    return false;
  }
  out->clear();
  out->reserve(item.graph.node_size() * 48);
  for (const auto& node : item.graph.node()) {
    if (!props.HasOutputProperties(node.name())) continue;
    if (props.GetOutputProperties(node.name()).empty()) continue;  // no outputs
    out->append(node.name());
    out->push_back('\x01');
    bool first = true;
    for (const auto& tp : props.GetOutputProperties(node.name())) {
      if (!first) out->push_back('|');
      first = false;
      const auto& sh = tp.shape();
      if (sh.unknown_rank()) {
        out->push_back('?');
        continue;
      }
      for (int i = 0; i < sh.dim_size(); ++i) {
        if (i) out->push_back(',');
        const int64_t d = sh.dim(i).size();
        out->append(std::to_string(d < -1 ? -1 : d));  // symbolic dims are unknown to us
      }
    }
    out->push_back('\n');
  }
  return true;
}

// ---- graph index ----------------------------------------------------------------
// The indexes graph_passes.graph.Graph builds over a GraphDef (names in graph
// order, op type -> nodes, consumers, and the Kahn topological order), computed
// here from the parsed GraphDef: the same result as Graph.reindex() and
// Graph._compute_topo_order(), which cost ~1 us per edge in Python (a Keras
// ResNet-50 training graph has 63k edges).  Format (decoded by
// Graph._adopt_index): four ASCII sections ended by '\x03', then int32 arrays
// (native byte order):
//   "NPUIDX5+s" \x02 <node count n> \x02 <1 if a cycle outside loops else 0>
//             \x02 <count of consumed names s> \x02 <count of pairs t> \x03
//   (or, when fewer than a quarter of the edges share a pair, "NPUIDX4+s"
//   without <t>, and the two pair arrays and the E indices below replaced by
//   int32[E] readers and int32[E] positions, one per edge)
//   node names, graph order, joined by \x01 \x03
//   op types, first appearance order, joined by \x01 \x03
//   consumed names (an input's source; first appearance order; may name no
//   node: a dangling input), joined by \x01 \x03
//   int32[ops] nodes per op type;  int32[s] edges per consumed name
//   int32[n]  node indices grouped by op type (section order)
//   int32[t]  reader node index of each distinct (reader, input position)
//             pair, in the order the edges below first name them
//   int32[t]  its input position (-1: a control edge)
//   int32[E]  per edge, grouped by source (section order, then graph order
//             and input order, as Graph.reindex appends them), the index of
//             its (reader, position) pair (issue 17m, NPUIDX5: a data input
//             is one edge, but a reader's control inputs from many sources
//             share one pair; the Keras ResNet-50 training graph has 63k
//             edges and 8.7k pairs, so Python builds 8.7k tuples, not 63k)
//   int32[n]  the topological order (node indices)
//   int32[n]  per node, its signature class (issue 17f): nodes of one class
//             have the same op and the same values of the attrs its OpDef's
//             args name (type_attr / type_list_attr / number_attr), i.e. equal
//             graph_passes.registry.signature_key; -1 for an op that is not
//             registered (a function call).  Classes are numbered in first
//             appearance order.
//   int32[s]  per consumed name, its node index, or -1 (issue 17: the sort's
//             arrays by node id without a name lookup; the magic's "+s")
// Returns false (nothing written) when Python must build the index itself:
// duplicate node names, or a byte outside printable ASCII in a name, op or
// input (Python's str.isdigit accepts non-ASCII digits in a port; control
// bytes are the format's separators).
bool IsAscii(std::string_view s) {  // printable ASCII: no separator of the format
  for (unsigned char c : s) {
    if (c < 0x20 || c >= 0x80) return false;
  }
  return true;
}

// IsAscii, 8 bytes at a time (issue 17u, kFlagFastIndex): a byte b is
// outside [0x20, 0x80) when its high bit is set or b + 0x60 does not carry
// into bit 7 (b < 0x20); per byte, without carries between bytes.
bool IsAsciiWords(std::string_view s) {
  constexpr uint64_t kHigh = 0x8080808080808080ULL, kLow7 = 0x7f7f7f7f7f7f7f7fULL;
  constexpr uint64_t kAdd = 0x6060606060606060ULL;
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    // ((w & 0x7f..) + 0x60..) has bit 7 set per byte iff (b & 0x7f) >= 0x20
    if ((w & kHigh) != 0 || (((w & kLow7) + kAdd) & kHigh) != kHigh) return false;
  }
  for (; n > 0; --n, ++p) {
    const unsigned char c = static_cast<unsigned char>(*p);
    if (c < 0x20 || c >= 0x80) return false;
  }
  return true;
}

void AppendInt32s(const std::vector<int32_t>& v, std::string* out) {
  if (v.empty()) return;
  out->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
}

void AppendJoined(const std::vector<std::string_view>& items, std::string* out) {
  for (size_t j = 0; j < items.size(); ++j) {
    if (j) out->push_back('\x01');
    out->append(items[j].data(), items[j].size());
  }
  out->push_back('\x03');
}

// The signature classes of GraphIndexText (see there).  Per op, the attrs
// its args name, in the order graph_passes.registry._signature_attrs finds
// them (input args, then output args; type_attr, type_list_attr,
// number_attr; the first kind seen wins), so equal keys here are equal keys
// there.  An attr the node does not carry is keyed as absent (Python: None),
// not as its OpDef default.
std::vector<int32_t> SignatureClasses(const tensorflow::GraphDef& graph,
                                      const std::vector<int32_t>& op_of_node,
                                      const std::vector<std::string_view>& op_order,
                                      bool fast = false) {
  const int32_t n = graph.node_size();
  std::vector<int32_t> classes(n, -1);
  // per op slot: the (attr, kind) list, or registered = false
  struct OpSig {
    bool registered = false;
    std::vector<std::pair<std::string, int>> attrs;
  };
  std::vector<OpSig> sigs(op_order.size());
  for (size_t j = 0; j < op_order.size(); ++j) {
    const tensorflow::OpDef* od = nullptr;
    if (!tensorflow::OpRegistry::Global()->LookUpOpDef(std::string(op_order[j]), &od).ok() ||
        od == nullptr) {
      continue;
    }
    OpSig& sig = sigs[j];
    sig.registered = true;
    auto add = [&sig](const std::string& name, int kind) {
      if (name.empty()) return;
      for (const auto& a : sig.attrs) {
        if (a.first == name) return;
      }
      sig.attrs.emplace_back(name, kind);
    };
    for (const auto* args : {&od->input_arg(), &od->output_arg()}) {
      for (const auto& arg : *args) {
        add(arg.type_attr(), 0);
        add(arg.type_list_attr(), 1);
        add(arg.number_attr(), 2);
      }
    }
  }
  std::unordered_map<std::string, int32_t> class_of;
  std::string key;
  // (issue 17u, `fast`) the same classes from a binary key: the op slot and
  // per attr a kind byte and its value's bytes (a list: its count first),
  // as injective as the text key, without std::to_string
  auto put = [&key](int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (int32_t i = 0; i < n; ++i) {
    const OpSig& sig = sigs[op_of_node[i]];
    if (!sig.registered) continue;
    const auto& node = graph.node(i);
    key.clear();
    if (fast) {
      put(op_of_node[i]);
      const auto& attrs = node.attr();
      for (const auto& a : sig.attrs) {
        auto it = attrs.find(a.first);
        if (it == attrs.end()) {
          key.push_back('-');  // absent
          continue;
        }
        const tensorflow::AttrValue& v = it->second;
        if (a.second == 0) {
          key.push_back('t');
          put(static_cast<int>(v.type()));
        } else if (a.second == 1) {
          key.push_back('l');
          put(v.list().type_size());
          for (int t : v.list().type()) put(t);
        } else {
          key.push_back('i');
          put(v.i());
        }
      }
      auto it = class_of.find(key);
      if (it == class_of.end()) it = class_of.emplace(key, static_cast<int32_t>(class_of.size())).first;
      classes[i] = it->second;
      continue;
    }
    key.append(std::to_string(op_of_node[i]));
    for (const auto& a : sig.attrs) {
      key.push_back('|');
      auto it = node.attr().find(a.first);
      if (it == node.attr().end()) {
        key.push_back('-');  // absent
        continue;
      }
      const tensorflow::AttrValue& v = it->second;
      if (a.second == 0) {
        key.append(std::to_string(static_cast<int>(v.type())));
      } else if (a.second == 1) {
        key.push_back('[');
        for (int t : v.list().type()) {
          key.append(std::to_string(t));
          key.push_back(',');
        }
      } else {
        key.append(std::to_string(v.i()));
      }
    }
    // (find first: emplace would build a map node for every node, then drop it)
    auto it = class_of.find(key);
    if (it == class_of.end()) it = class_of.emplace(key, static_cast<int32_t>(class_of.size())).first;
    classes[i] = it->second;
  }
  return classes;
}

// The node names, op types and inputs GraphIndexText reads (issue 17r), as
// views (GraphViews, graph_views.h): of the parsed GraphDef's strings
// (ViewsOfGraph, the reference), or of its serialized bytes (ViewsOfBytes):
// the same strings, read in one sequential pass over the bytes instead of
// chasing every NodeDef's and input's heap string (on the Keras ResNet-50
// training graph, 6.2k nodes and 63k inputs in 4.3 MB, the memory latency of
// that chase was ~10 of the index's ~14 ms).
void ViewsOfGraph(const tensorflow::GraphDef& graph, GraphViews* v) {
  const int n = graph.node_size();
  v->name.reserve(n);
  v->op.reserve(n);
  v->in_start.reserve(static_cast<size_t>(n) + 1);
  for (const auto& node : graph.node()) {
    v->name.emplace_back(node.name());
    v->op.emplace_back(node.op());
    for (const auto& in : node.input()) v->input.emplace_back(in);
    v->in_start.push_back(static_cast<int64_t>(v->input.size()));
  }
}


// (issue 17u) `fast`: names looked up in a NameTable (opdef_precheck.h)
// instead of a std::unordered_map, names and inputs checked 8 bytes at a time
// (IsAsciiWords), signature classes keyed in binary (the same index);
// `keep`: the names and the
// edges grouped by consumed name kept for OpdefPrecheckIndexed (valid only
// when this returns true).
// `late` (issue 17, kFlagLateClasses): the signature classes left out (the
// magic's "+l"), and what SignatureClasses needs for them moved into *late.
struct LateClasses {
  std::vector<int32_t> op_of_node;
  std::vector<std::string_view> op_order;  // (views of the graph's bytes or strings)
};
bool GraphIndexText(const tensorflow::GraphDef& graph, const GraphViews& views,
                    std::string* out, bool fast = false,
                    npu_amp_tf::BaseIndex* keep = nullptr, LateClasses* late = nullptr) {
  if (keep != nullptr) keep->valid = false;
  const int32_t n = graph.node_size();
  if (static_cast<int64_t>(views.name.size()) != n) return false;
  std::unordered_map<std::string_view, int32_t> index;
  npu_amp_tf::NameTable table;
  if (fast) {
    table.Reserve(static_cast<size_t>(n));
  } else {
    index.reserve(static_cast<size_t>(n) * 2);
  }
  auto find = [&](std::string_view name) -> int32_t {
    if (fast) return table.Find(name);
    auto it = index.find(name);
    return it == index.end() ? -1 : it->second;
  };
  std::unordered_map<std::string_view, int32_t> op_slot;
  std::vector<std::string_view> op_order;
  std::vector<int32_t> op_of_node(n);
  for (int32_t i = 0; i < n; ++i) {
    const std::string_view name = views.name[i];
    if (!(fast ? IsAsciiWords(name) : IsAscii(name)) ||
        !(fast ? table.Insert(name) : index.emplace(name, i).second)) {
      return false;
    }
    std::string_view op = views.op[i];
    auto it = op_slot.find(op);
    if (it == op_slot.end()) {
      if (!IsAscii(op)) return false;
      it = op_slot.emplace(op, static_cast<int32_t>(op_order.size())).first;
      op_order.push_back(op);
    }
    op_of_node[i] = it->second;
  }
  // every edge: its source's slot (first appearance order), reader, position
  std::vector<int32_t> slot_of_node(n, -1);
  std::unordered_map<std::string_view, int32_t> dangling_slot;
  std::vector<std::string_view> src_order;
  std::vector<int32_t> src_node;  // per slot: the node, or -1
  std::vector<int32_t> e_slot, e_reader, e_pos;
  e_slot.reserve(views.input.size());
  e_reader.reserve(views.input.size());
  e_pos.reserve(views.input.size());
  // per input position, the source last looked up there and its node (or -1):
  // consecutive nodes often read the same sources in the same order (a TF1
  // training graph's gradient NoOps and ShapeNs each wait on the same ~100
  // update ops, 55k of Keras ResNet50's 63k edges), and comparing with the
  // previous lookup costs less than hashing the name again
  constexpr int32_t kNotLooked = std::numeric_limits<int32_t>::min();
  std::vector<std::pair<std::string_view, int32_t>> last_at;
  for (int32_t i = 0; i < n; ++i) {
    const int64_t k0 = views.in_start[i];
    for (int32_t k = 0; k < views.in_start[i + 1] - k0; ++k) {
      std::string_view ref = views.input[k0 + k];
      // (no check of the whole reference: one that names a node is that
      // node's name, checked above, behind '^' or before ':<digits>'; only a
      // dangling source below is checked, the only part the index writes)
      std::string_view src = ref;
      int32_t pos = k;
      if (!ref.empty() && ref[0] == '^') {
        src = ref.substr(1);
        pos = -1;
      } else {
        const size_t colon = ref.rfind(':');
        bool port = colon != std::string_view::npos && colon + 1 < ref.size();
        for (size_t j = colon + 1; port && j < ref.size(); ++j) {
          if (ref[j] < '0' || ref[j] > '9') port = false;
        }
        if (port) src = ref.substr(0, colon);
      }
      int32_t slot;
      if (static_cast<size_t>(k) >= last_at.size()) {
        last_at.resize(static_cast<size_t>(k) + 1, {std::string_view(), kNotLooked});
      }
      auto& last = last_at[static_cast<size_t>(k)];
      if (last.second == kNotLooked || last.first != src) last = {src, find(src)};
      const int32_t at = last.second;
      if (at >= 0) {
        slot = slot_of_node[at];
        if (slot < 0) {
          slot = slot_of_node[at] = static_cast<int32_t>(src_order.size());
          src_order.push_back(src);
          src_node.push_back(at);
        }
      } else {
        auto dit = dangling_slot.find(src);
        if (dit == dangling_slot.end()) {
          if (!(fast ? IsAsciiWords(src) : IsAscii(src))) return false;
          dit = dangling_slot.emplace(src, static_cast<int32_t>(src_order.size())).first;
          src_order.push_back(src);
          src_node.push_back(-1);
        }
        slot = dit->second;
      }
      e_slot.push_back(slot);
      e_reader.push_back(i);
      e_pos.push_back(pos);
    }
  }
  // group the edges by slot, keeping their order (a counting sort)
  const size_t ns = src_order.size(), ne = e_slot.size();
  std::vector<int32_t> src_count(ns, 0), start(ns + 1, 0);
  for (int32_t s : e_slot) ++src_count[s];
  for (size_t s = 0; s < ns; ++s) start[s + 1] = start[s] + src_count[s];
  std::vector<int32_t> readers(ne), positions(ne), fill(start.begin(), start.end() - 1);
  for (size_t e = 0; e < ne; ++e) {
    const int32_t at = fill[e_slot[e]]++;
    readers[at] = e_reader[e];
    positions[at] = e_pos[e];
  }
  // Kahn order: edges out of NextIteration / RefNextIteration are loop back
  // edges and ignored; FIFO; nodes on a cycle last, in graph order
  std::vector<char> back(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    const std::string_view op = op_order[op_of_node[i]];
    back[i] = op == "NextIteration" || op == "RefNextIteration";
  }
  std::vector<int32_t> indeg(n, 0);
  for (size_t s = 0; s < ns; ++s) {
    if (src_node[s] < 0 || back[src_node[s]]) continue;
    for (int32_t e = start[s]; e < start[s + 1]; ++e) ++indeg[readers[e]];
  }
  std::vector<int32_t> order;
  order.reserve(n);
  std::deque<int32_t> ready;
  for (int32_t i = 0; i < n; ++i) {
    if (indeg[i] == 0) ready.push_back(i);
  }
  while (!ready.empty()) {
    const int32_t u = ready.front();
    ready.pop_front();
    order.push_back(u);
    const int32_t s = slot_of_node[u];
    if (back[u] || s < 0) continue;
    for (int32_t e = start[s]; e < start[s + 1]; ++e) {
      if (--indeg[readers[e]] == 0) ready.push_back(readers[e]);
    }
  }
  const bool cycle = static_cast<int32_t>(order.size()) < n;
  if (cycle) {
    std::vector<char> seen(n, 0);
    for (int32_t u : order) seen[u] = 1;
    for (int32_t i = 0; i < n; ++i) {
      if (!seen[i]) order.push_back(i);
    }
  }
  // nodes grouped by op type
  std::vector<int32_t> op_count(op_order.size(), 0), op_start(op_order.size() + 1, 0);
  for (int32_t i = 0; i < n; ++i) ++op_count[op_of_node[i]];
  for (size_t j = 0; j < op_order.size(); ++j) op_start[j + 1] = op_start[j] + op_count[j];
  std::vector<int32_t> members(n);
  for (int32_t i = 0; i < n; ++i) members[op_start[op_of_node[i]]++] = i;

  const std::vector<int32_t> classes =
      late != nullptr ? std::vector<int32_t>() : SignatureClasses(graph, op_of_node, op_order, fast);

  // the distinct (reader, position) pairs and each edge's pair: a data input
  // (reader, k) is one edge; (reader, -1) is shared by its control inputs
  std::vector<int32_t> pair_reader, pair_pos, edge_pair(ne);
  std::vector<int32_t> ctrl_pair(n, -1);
  pair_reader.reserve(ne);
  pair_pos.reserve(ne);
  for (size_t e = 0; e < ne; ++e) {
    int32_t id;
    if (positions[e] < 0) {
      id = ctrl_pair[readers[e]];
      if (id < 0) {
        id = ctrl_pair[readers[e]] = static_cast<int32_t>(pair_reader.size());
        pair_reader.push_back(readers[e]);
        pair_pos.push_back(-1);
      }
    } else {
      id = static_cast<int32_t>(pair_reader.size());
      pair_reader.push_back(readers[e]);
      pair_pos.push_back(positions[e]);
    }
    edge_pair[e] = id;
  }
  // (shared pairs pay only when many edges share one: else the NPUIDX4
  // layout, a reader and a position per edge; BERT-like graphs have ~0.9
  // pairs per edge, where the indirection cost more than it saved)
  const bool shared = pair_reader.size() * 4 <= ne * 3;

  out->clear();
  out->reserve(static_cast<size_t>(n) * 48 + ns * 48 + (4 * n + 2 * ne + ns) * 4 + 64);
  out->append(shared ? "NPUIDX5+s" : "NPUIDX4+s");
  out->append(late != nullptr ? "+l\x02" : "\x02");
  out->append(std::to_string(n));
  out->push_back('\x02');
  out->push_back(cycle ? '1' : '0');
  out->push_back('\x02');
  out->append(std::to_string(ns));
  if (shared) {
    out->push_back('\x02');
    out->append(std::to_string(pair_reader.size()));
  }
  out->push_back('\x03');
  for (int32_t i = 0; i < n; ++i) {
    if (i) out->push_back('\x01');
    out->append(views.name[i].data(), views.name[i].size());
  }
  out->push_back('\x03');
  AppendJoined(op_order, out);
  AppendJoined(src_order, out);
  AppendInt32s(op_count, out);
  AppendInt32s(src_count, out);
  AppendInt32s(members, out);
  if (shared) {
    AppendInt32s(pair_reader, out);
    AppendInt32s(pair_pos, out);
    AppendInt32s(edge_pair, out);
  } else {
    AppendInt32s(readers, out);
    AppendInt32s(positions, out);
  }
  AppendInt32s(order, out);
  AppendInt32s(classes, out);  // (none with `late`)
  AppendInt32s(src_node, out);
  if (keep != nullptr) {
    if (fast) {
      keep->names = std::move(table);
    } else {
      keep->names.Reserve(static_cast<size_t>(n));
      for (int32_t i = 0; i < n; ++i) keep->names.Insert(views.name[i]);
    }
    keep->slot_of_node = std::move(slot_of_node);
    keep->dangling = std::move(dangling_slot);
    keep->start = std::move(start);
    keep->readers = std::move(readers);
    keep->positions = std::move(positions);
    keep->valid = true;
  }
  if (late != nullptr) {
    late->op_of_node = std::move(op_of_node);
    late->op_order = std::move(op_order);
  }
  return true;
}

// ---- the item's bytes (issue 17) ----------------------------------------------
// SerializeGraph writes the bytes tsl::SerializeToStringDeterministic writes
// for a GraphDef (fields in number order, map entries sorted by key, key and
// value always written, a set oneof member always written), without the
// generated code's UTF-8 verification of every name, op, input and device
// string (proto3 `string` fields: ~11 of the ~29 M instructions that call
// takes on the Keras ResNet-50 training graph, 63k inputs).  Grappler's item
// holds strings TF itself produced, and Python's parser accepts any bytes the
// generated code would have written (protobuf only logs invalid UTF-8 when
// it serializes; Python's parser refuses it either way).  A NodeDef with more
// than fields 1-5 or with unknown fields, an attr value other than a scalar
// (type, i, f, b, s) or a list of scalars, and every field of the GraphDef
// after `node` are written by the generated code, deterministic, in place.  g_serialize_fast = false: the generated code
// for all of it (the reference; tests compare both).
bool g_serialize_fast = true;

namespace wire {
inline size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}
inline char* PutVarint(char* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<char>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<char>(v);
  return p;
}
// a length-delimited field with a one-byte tag (field numbers < 16)
inline size_t LenSize(size_t len) { return 1 + VarintSize(len) + len; }
inline char* PutTagLen(char* p, int field, size_t len) {
  *p++ = static_cast<char>(field << 3 | 2);
  return PutVarint(p, len);
}
inline char* PutBytes(char* p, int field, std::string_view s) {
  p = PutTagLen(p, field, s.size());
  std::memcpy(p, s.data(), s.size());
  return p + s.size();
}
}  // namespace wire

// An attr value written by hand: a scalar oneof member (type, i, f, b, s) or
// a list of scalars only (s, i, f, b, type; no shape, tensor or func), and
// no unknown fields; else (0) the generated code writes it.
enum AttrKind : uint8_t { kAttrGenerated = 0, kAttrScalar = 1, kAttrList = 2 };

inline size_t EnumSize(int v) { return wire::VarintSize(static_cast<uint64_t>(static_cast<int64_t>(v))); }

// (issue 17) The message's unknown-field container, read through the
// protected member every generated message inherits (a pointer to a base
// member formed in a derived class: no object of this type is made).
struct MetadataPeek : google::protobuf::MessageLite {
  static bool MayHaveUnknown(const google::protobuf::MessageLite& m) {
    return (m.*(&MetadataPeek::_internal_metadata_)).have_unknown_fields();
  }
};

// No unknown fields in `m` (its own, not its sub-messages'): without a
// container there are none, else the reflection says whether it is empty
// (one GetReflection() per message cost the serialiser ~4 M instructions on
// a 9k-node graph: the descriptors' call_once behind it).
bool NoUnknown(const google::protobuf::Message& m) {
  return !MetadataPeek::MayHaveUnknown(m) || m.GetReflection()->GetUnknownFields(m).empty();
}

// The payload sizes of a scalar list's packed fields (i, f, b, type) and its total size.
size_t ListSize(const tensorflow::AttrValue::ListValue& l, size_t* packed) {
  size_t total = 0;
  for (const auto& x : l.s()) total += wire::LenSize(x.size());
  packed[0] = 0;
  for (int64_t x : l.i()) packed[0] += wire::VarintSize(static_cast<uint64_t>(x));
  packed[1] = 4 * static_cast<size_t>(l.f_size());
  packed[2] = static_cast<size_t>(l.b_size());
  packed[3] = 0;
  for (int t : l.type()) packed[3] += EnumSize(t);
  for (size_t k = 0; k < 4; ++k) {
    if (packed[k]) total += wire::LenSize(packed[k]);
  }
  return total;
}

// (kind, size) of one attr value
std::pair<AttrKind, size_t> AttrPlan(const tensorflow::AttrValue& v) {
  using tensorflow::AttrValue;
  const auto c = v.value_case();
  if (c == AttrValue::kList) {
    const auto& l = v.list();
    if (l.shape_size() || l.tensor_size() || l.func_size() || !NoUnknown(v) || !NoUnknown(l)) {
      return {kAttrGenerated, 0};
    }
    size_t packed[4];
    return {kAttrList, wire::LenSize(ListSize(l, packed))};
  }
  size_t n = 0;
  switch (c) {
    case AttrValue::kType: n = 1 + EnumSize(v.type()); break;
    case AttrValue::kI: n = 1 + wire::VarintSize(static_cast<uint64_t>(v.i())); break;
    case AttrValue::kF: n = 5; break;
    case AttrValue::kB: n = 2; break;
    case AttrValue::kS: n = wire::LenSize(v.s().size()); break;
    default: return {kAttrGenerated, 0};
  }
  if (!NoUnknown(v)) return {kAttrGenerated, 0};
  return {kAttrScalar, n};
}

char* PutFloat(char* p, float f) {
  std::memcpy(p, &f, 4);  // little-endian (x86-64, aarch64)
  return p + 4;
}

char* PutAttr(char* p, const tensorflow::AttrValue& v, AttrKind kind) {
  using tensorflow::AttrValue;
  if (kind == kAttrList) {
    const auto& l = v.list();
    size_t packed[4];
    p = wire::PutTagLen(p, 1, ListSize(l, packed));
    for (const auto& x : l.s()) p = wire::PutBytes(p, 2, x);
    if (packed[0]) {
      p = wire::PutTagLen(p, 3, packed[0]);
      for (int64_t x : l.i()) p = wire::PutVarint(p, static_cast<uint64_t>(x));
    }
    if (packed[1]) {
      p = wire::PutTagLen(p, 4, packed[1]);
      for (float x : l.f()) p = PutFloat(p, x);
    }
    if (packed[2]) {
      p = wire::PutTagLen(p, 5, packed[2]);
      for (bool x : l.b()) *p++ = x ? 1 : 0;
    }
    if (packed[3]) {
      p = wire::PutTagLen(p, 6, packed[3]);
      for (int t : l.type()) p = wire::PutVarint(p, static_cast<uint64_t>(static_cast<int64_t>(t)));
    }
    return p;
  }
  switch (v.value_case()) {
    case AttrValue::kType:
      *p++ = static_cast<char>(6 << 3);
      return wire::PutVarint(p, static_cast<uint64_t>(static_cast<int64_t>(v.type())));
    case AttrValue::kI:
      *p++ = static_cast<char>(3 << 3);
      return wire::PutVarint(p, static_cast<uint64_t>(v.i()));
    case AttrValue::kF:
      *p++ = static_cast<char>(4 << 3 | 5);
      return PutFloat(p, v.f());
    case AttrValue::kB:
      *p++ = static_cast<char>(5 << 3);
      *p++ = v.b() ? 1 : 0;
      return p;
    case AttrValue::kS:
      return wire::PutBytes(p, 2, v.s());
    default:
      return p;
  }
}

struct AttrEntry {
  const std::string* key;
  const tensorflow::AttrValue* value;
  size_t size;  // the AttrValue's bytes
  AttrKind kind;
};

// Whether this TF's messages have exactly the fields the writer knows (by
// number): a field added by a later TF would otherwise be dropped, so then
// the generated code writes everything.  (TF 2.15.1 and 2.21.0: GraphDef
// 1-5, NodeDef 1-7, AttrValue 1-10, AttrValue.ListValue 2-9.)
bool KnownSchema() {
  static const bool known = [] {
    auto exact = [](const google::protobuf::Descriptor* d, int lo, int hi) {
      if (d == nullptr || d->field_count() != hi - lo + 1) return false;
      for (int f = lo; f <= hi; ++f) {
        if (d->FindFieldByNumber(f) == nullptr) return false;
      }
      return true;
    };
    return exact(tensorflow::GraphDef::descriptor(), 1, 5) && exact(tensorflow::NodeDef::descriptor(), 1, 7) &&
           exact(tensorflow::AttrValue::descriptor(), 1, 10) &&
           exact(tensorflow::AttrValue::ListValue::descriptor(), 2, 9);
  }();
  return known;
}

// The item's bytes as SerializeGraph writes them for the callback (issue 17):
// a buffer sized without filling it first (std::string::resize writes every
// byte it adds, 4.3 MB on the Keras ResNet-50 training graph, before the
// writer overwrites them).
class ItemBytes {
 public:
  // `n` bytes of unspecified content, to be overwritten.
  void ResizeForOverwrite(size_t n) {
    buf_.reset(new char[n > 0 ? n : 1]);  // (default-initialised: not zeroed)
    size_ = n;
  }
  void Assign(const std::string& s) {
    ResizeForOverwrite(s.size());
    std::memcpy(buf_.get(), s.data(), s.size());
  }
  char* data() { return buf_.get(); }
  const char* data() const { return buf_.get(); }
  size_t size() const { return size_; }
  std::string_view view() const { return std::string_view(buf_.get(), size_); }
  void Free() {
    buf_.reset();
    size_ = 0;
  }

 private:
  std::unique_ptr<char[]> buf_;
  size_t size_ = 0;
};

void ResizeForOverwrite(std::string* out, size_t n) { out->resize(n); }
void ResizeForOverwrite(ItemBytes* out, size_t n) { out->ResizeForOverwrite(n); }
bool GeneratedSerialization(const tensorflow::GraphDef& graph, std::string* out) {
  return tensorflow::SerializeToStringDeterministic(graph, out);
}
bool GeneratedSerialization(const tensorflow::GraphDef& graph, ItemBytes* out) {
  std::string s;
  if (!tensorflow::SerializeToStringDeterministic(graph, &s)) return false;
  out->Assign(s);
  return true;
}

// (issue 17) SerializeGraph's two passes over a graph of at least
// kSplitNodes nodes run in two halves, the second half's on a helper thread
// (the same bytes: each half is written at its own offset).  Wall time only.
// g_serialize_split = false: one thread (the reference; tests compare both).
constexpr int kSplitNodes = 1024;
bool g_serialize_split = true;

// The per-node plan of the nodes [lo, hi) (SerializeGraph's first pass):
// body[i] its body's bytes, whole[i] whether the generated code writes it
// whole (fields beyond 1-5 or unknown fields), its attrs sorted by key at
// entries[first[i], first[i] + nattr[i]).  Returns the bytes of their
// records (tag, length and body).
size_t PlanNodes(const tensorflow::GraphDef& graph, int lo, int hi, std::vector<size_t>& body,
                 std::vector<uint8_t>& whole, std::vector<uint32_t>& first,
                 std::vector<uint32_t>& nattr, std::vector<AttrEntry>& entries) {
  size_t total = 0;
  for (int i = lo; i < hi; ++i) {
    const tensorflow::NodeDef& node = graph.node(i);
    first[i] = static_cast<uint32_t>(entries.size());
    if (node.has_experimental_debug_info() || node.has_experimental_type() || !NoUnknown(node)) {
      whole[i] = 1;
      body[i] = node.ByteSizeLong();  // (caches the sizes the write below uses)
    } else {
      size_t b = 0;
      if (!node.name().empty()) b += wire::LenSize(node.name().size());
      if (!node.op().empty()) b += wire::LenSize(node.op().size());
      for (const auto& in : node.input()) b += wire::LenSize(in.size());
      if (!node.device().empty()) b += wire::LenSize(node.device().size());
      for (const auto& kv : node.attr()) {
        auto [kind, vs] = AttrPlan(kv.second);
        if (kind == kAttrGenerated) vs = kv.second.ByteSizeLong();
        entries.push_back({&kv.first, &kv.second, vs, kind});
        b += wire::LenSize(wire::LenSize(kv.first.size()) + wire::LenSize(vs));
      }
      if (entries.size() - first[i] > 1) {
        std::sort(entries.begin() + first[i], entries.end(),
                  [](const AttrEntry& x, const AttrEntry& y) { return *x.key < *y.key; });
      }
      body[i] = b;
    }
    nattr[i] = static_cast<uint32_t>(entries.size() - first[i]);
    total += wire::LenSize(body[i]);
  }
  return total;
}

// The records of the nodes [lo, hi) as PlanNodes planned them, from `p`:
// the end, or nullptr when the generated code fails.
char* WriteNodes(const tensorflow::GraphDef& graph, int lo, int hi, const std::vector<size_t>& body,
                 const std::vector<uint8_t>& whole, const std::vector<uint32_t>& first,
                 const std::vector<uint32_t>& nattr, const std::vector<AttrEntry>& entries, char* p) {
  for (int i = lo; i < hi; ++i) {
    const tensorflow::NodeDef& node = graph.node(i);
    p = wire::PutTagLen(p, 1, body[i]);
    if (whole[i]) {
      if (!tensorflow::SerializeToBufferDeterministic(node, p, body[i])) return nullptr;
      p += body[i];
      continue;
    }
    if (!node.name().empty()) p = wire::PutBytes(p, 1, node.name());
    if (!node.op().empty()) p = wire::PutBytes(p, 2, node.op());
    for (const auto& in : node.input()) p = wire::PutBytes(p, 3, in);
    if (!node.device().empty()) p = wire::PutBytes(p, 4, node.device());
    for (uint32_t k = first[i]; k < first[i] + nattr[i]; ++k) {
      const AttrEntry& e = entries[k];
      p = wire::PutTagLen(p, 5, wire::LenSize(e.key->size()) + wire::LenSize(e.size));
      p = wire::PutBytes(p, 1, *e.key);
      p = wire::PutTagLen(p, 2, e.size);
      if (e.kind != kAttrGenerated) {
        p = PutAttr(p, *e.value, e.kind);
      } else {
        if (!tensorflow::SerializeToBufferDeterministic(*e.value, p, e.size)) return nullptr;
        p += e.size;
      }
    }
  }
  return p;
}

// `main()` on this thread and `side()` on a helper thread (`split`; inline
// after `main()` when not, or when no thread can be had), both done on
// return; false when `side()` threw (bad_alloc): its work is then not done.
template <typename Main, typename Side>
bool BothHalves(bool split, Main main, Side side) {
  bool side_ok = true;
  auto guarded = [&side, &side_ok] {
    try {
      side();
    } catch (...) {
      side_ok = false;
    }
  };
  npu_amp_tf::Job helper;  // (a kept helper thread, worker.h)
  try {
    if (split) helper = npu_amp_tf::Job(guarded);
  } catch (...) {  // (std::system_error: no thread)
  }
  main();  // (may throw bad_alloc: the helper is joined first)
  if (helper.joinable()) {
    helper.join();
  } else {
    guarded();
  }
  return side_ok;
}

// `Out`: std::string (offline) or ItemBytes (the callback's item bytes).
// `split`: the two halves of a large graph on two threads (g_serialize_split).
template <typename Out>
bool SerializeGraph(const tensorflow::GraphDef& graph, Out* out, bool fast, bool split = true) {
  if (!fast || !KnownSchema() || !NoUnknown(graph)) {
    return GeneratedSerialization(graph, out);
  }
  const int n = graph.node_size();
  // Kept between calls (capacity only): allocated and freed per call
  // (~1 MB on ResNet-50), the callback that follows read +7 ms on TF 2.21.0
  // (min of 15; on identical bytes), +3 ms with them kept (within noise).
  // The second half's attrs are the calling thread's too (`entries2`).  The
  // helper thread reaches them through these references (a thread_local
  // named in a lambda is the running thread's own, not captured).
  thread_local std::vector<size_t> body_tl;
  thread_local std::vector<uint8_t> whole_tl;
  thread_local std::vector<uint32_t> first_tl, nattr_tl;
  thread_local std::vector<AttrEntry> entries_tl, entries2_tl;
  std::vector<size_t>& body = body_tl;
  std::vector<uint8_t>& whole = whole_tl;
  std::vector<uint32_t>& first = first_tl;
  std::vector<uint32_t>& nattr = nattr_tl;
  std::vector<AttrEntry>& entries = entries_tl;
  std::vector<AttrEntry>& entries2 = entries2_tl;
  body.assign(n, 0);
  whole.assign(n, 0);
  first.assign(n, 0);
  nattr.assign(n, 0);
  entries.clear();
  entries2.clear();
  const int h = split && g_serialize_split && n >= kSplitNodes ? n / 2 : n;
  entries.reserve(static_cast<size_t>(h) * 4);
  entries2.reserve(static_cast<size_t>(n - h) * 4);
  // (h == n: one thread, the second half empty)
  size_t first_half = 0, second_half = 0;
  if (!BothHalves(h < n, [&] { first_half = PlanNodes(graph, 0, h, body, whole, first, nattr, entries); },
                  [&] { second_half = PlanNodes(graph, h, n, body, whole, first, nattr, entries2); })) {
    return GeneratedSerialization(graph, out);
  }
  size_t total = first_half + second_half;
  // the fields after `node`, each written as its own field by the generated code
  const bool has_lib = graph.has_library(), has_ver = graph.has_versions(),
             has_dbg = graph.has_debug_info();
  const size_t lib = has_lib ? graph.library().ByteSizeLong() : 0;
  const size_t ver = has_ver ? graph.versions().ByteSizeLong() : 0;
  const size_t dbg = has_dbg ? graph.debug_info().ByteSizeLong() : 0;
  const int32_t old_version = graph.version();  // (deprecated field 3)
  if (has_lib) total += wire::LenSize(lib);
  if (old_version != 0) total += 1 + EnumSize(old_version);
  if (has_ver) total += wire::LenSize(ver);
  if (has_dbg) total += wire::LenSize(dbg);
  ResizeForOverwrite(out, total);
  char* const data = out->data();
  char* const end = data + total;
  char *p = nullptr, *q = nullptr;
  if (!BothHalves(h < n, [&] { p = WriteNodes(graph, 0, h, body, whole, first, nattr, entries, data); },
                  [&] { q = WriteNodes(graph, h, n, body, whole, first, nattr, entries2, data + first_half); }) ||
      p != data + first_half || q != data + first_half + second_half) {
    return false;
  }
  p = q;
  if (has_lib) {
    p = wire::PutTagLen(p, 2, lib);
    if (!tensorflow::SerializeToBufferDeterministic(graph.library(), p, lib)) return false;
    p += lib;
  }
  if (old_version != 0) {
    *p++ = static_cast<char>(3 << 3);
    p = wire::PutVarint(p, static_cast<uint64_t>(static_cast<int64_t>(old_version)));
  }
  if (has_ver) {
    p = wire::PutTagLen(p, 4, ver);
    if (!tensorflow::SerializeToBufferDeterministic(graph.versions(), p, ver)) return false;
    p += ver;
  }
  if (has_dbg) {
    p = wire::PutTagLen(p, 5, dbg);
    if (!tensorflow::SerializeToBufferDeterministic(graph.debug_info(), p, dbg)) return false;
    p += dbg;
  }
  return p == end;
}

// ---- work skipped before Python is called -------------------------------------
std::mutex g_seen_mu;
std::deque<uint64_t> g_seen;  // fingerprints of graphs known to need nothing
constexpr size_t kSeenMax = 256;
std::atomic<uint64_t> g_skip_seen{0};
std::atomic<uint64_t> g_skip_tf_data{0};
std::atomic<uint64_t> g_skip_no_float{0};

uint64_t Fingerprint(std::string_view graph_bytes, const std::string& context) {
#ifdef NPU_AMP_FARMHASH
  const uint64_t a = ::util::Fingerprint64(graph_bytes.data(), graph_bytes.size());
#else
  const uint64_t a = std::hash<std::string_view>{}(std::string_view(graph_bytes));
#endif
  const uint64_t b = std::hash<std::string_view>{}(std::string_view(context));
  return a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2)) ^ (graph_bytes.size() << 1);
}

constexpr char kDoneAttr[] = "_npu_amp_tf_rewritten";

// The node that carries kDoneAttr: the first preserved node present.
tensorflow::NodeDef* MarkerNode(tensorflow::GraphDef* graph, const std::vector<std::string>& preserve) {
  if (preserve.empty()) return nullptr;
  size_t tried = 0;
  for (const auto& want : preserve) {
    if (++tried > 4) break;  // preserved nodes exist; do not scan for long lists of strays
    for (auto& node : *graph->mutable_node()) {
      if (node.name() == want) return &node;
    }
  }
  return nullptr;
}

bool CarriesMark(const tensorflow::GraphDef& graph, const std::vector<std::string>& preserve,
                 int64_t mark) {
  auto* node = MarkerNode(const_cast<tensorflow::GraphDef*>(&graph), preserve);
  if (node == nullptr) return false;
  auto it = node->attr().find(kDoneAttr);
  return it != node->attr().end() && it->second.i() == mark;
}

bool Seen(uint64_t fp) {
  std::lock_guard<std::mutex> lock(g_seen_mu);
  return std::find(g_seen.begin(), g_seen.end(), fp) != g_seen.end();
}

void Remember(uint64_t fp) {
  std::lock_guard<std::mutex> lock(g_seen_mu);
  if (std::find(g_seen.begin(), g_seen.end(), fp) != g_seen.end()) return;
  g_seen.push_back(fp);
  while (g_seen.size() > kSeenMax) g_seen.pop_front();
}

bool IsFloat(tensorflow::DataType dt) {
  dt = tensorflow::BaseType(dt);
  return dt == tensorflow::DT_FLOAT || dt == tensorflow::DT_HALF || dt == tensorflow::DT_BFLOAT16;
}

bool NodeHasFloat(const tensorflow::NodeDef& node) {
  for (const auto& kv : node.attr()) {
    const auto& v = kv.second;
    if (v.value_case() == tensorflow::AttrValue::kType && IsFloat(v.type())) return true;
    if (v.value_case() == tensorflow::AttrValue::kList) {
      for (int t : v.list().type()) {
        if (IsFloat(static_cast<tensorflow::DataType>(t))) return true;
      }
    }
  }
  return false;
}

// True when no node of the graph or of its function library names a float type.
bool HasNoFloat(const tensorflow::GraphDef& graph) {
  for (const auto& node : graph.node()) {
    if (NodeHasFloat(node)) return false;
  }
  for (const auto& f : graph.library().function()) {
    for (const auto& node : f.node_def()) {
      if (NodeHasFloat(node)) return false;
    }
    for (const auto& a : f.signature().input_arg()) {
      if (IsFloat(a.type())) return false;
    }
    for (const auto& a : f.signature().output_arg()) {
      if (IsFloat(a.type())) return false;
    }
  }
  return true;
}

// The rewritten graph from a patch of `base` (issue 17h): output node k is
// base.node(order[k]) when order[k] >= 0, else the next node of `patch` (a
// serialized GraphDef holding the created or edited nodes, in output order,
// and the output's library and versions).  The same GraphDef as parsing
// graph_passes.graph.Graph.serialize()'s bytes: the nodes the pipeline left
// alone are the item's own (copied here, not serialized in Python and parsed
// again).  False (message in *error) when the patch does not fit `base`.
// (`patch` parsed already; its nodes are moved into *out)
bool AssembleParsedPatch(const tensorflow::GraphDef& base, const std::vector<int32_t>& order,
                         tensorflow::GraphDef& patch, tensorflow::GraphDef* out,
                         std::string* error, tensorflow::GraphDef* movable = nullptr) {
  out->Clear();
  int next = 0;
  const int n_base = base.node_size();
  {
    // (issue 17) every refusal before any node moves: `patch` and `movable`
    // stay whole (the bridge puts nodes taken out of the item back from `patch`)
    int fresh = 0;
    for (const int32_t k : order) {
      if (k >= n_base) {
        *error = "the patch names a node the graph does not have";
        return false;
      }
      if (k < 0 && ++fresh > patch.node_size()) {
        *error = "the patch holds fewer nodes than its order needs";
        return false;
      }
    }
    if (fresh != patch.node_size()) {
      *error = "the patch holds more nodes than its order uses";
      return false;
    }
  }
  out->mutable_node()->Reserve(static_cast<int>(order.size()));
  if (movable != nullptr) {
    // (issue 17r) the base nodes are moved, not copied, only when the patch
    // fits: every index in range, none twice, as many new nodes as the
    // patch holds (a failure below must leave `movable` whole)
    std::vector<char> used(n_base, 0);
    int fresh = 0;
    for (const int32_t k : order) {
      if (k >= n_base || (k >= 0 && used[k]++)) {
        movable = nullptr;
        break;
      }
      if (k < 0) ++fresh;
    }
    if (fresh != patch.node_size()) movable = nullptr;
  }
  for (const int32_t k : order) {
    if (k >= 0) {
      if (k >= n_base) {
        *error = "the patch names a node the graph does not have";
        return false;
      }
      if (movable != nullptr) {
        out->add_node()->Swap(movable->mutable_node(k));
      } else {
        *out->add_node() = base.node(k);
      }
    } else {
      if (next >= patch.node_size()) {
        *error = "the patch holds fewer nodes than its order needs";
        return false;
      }
      out->add_node()->Swap(patch.mutable_node(next++));
    }
  }
  if (next != patch.node_size()) {
    *error = "the patch holds more nodes than its order uses";
    return false;
  }
  out->mutable_library()->Swap(patch.mutable_library());
  out->mutable_versions()->Swap(patch.mutable_versions());
  // colocation with a node that is gone: the rule of Python's
  // graph_passes.graph._colocation_kept / _drop_colocation, on the copied
  // nodes (the patch's nodes come with it applied)
  // (issue 17) the output's names in a NameTable (no allocation per name),
  // made at the first colocation entry met; each node's attrs read through
  // the const map (mutable_attr() marks the map dirty) until one must change
  npu_amp_tf::NameTable names;
  bool have_names = false;
  constexpr std::string_view kLoc = "loc:@";
  auto dangling = [&names, &have_names, out, kLoc](const std::string& v) {
    if (v.size() < kLoc.size() || std::string_view(v).substr(0, kLoc.size()) != kLoc) return false;
    if (!have_names) {
      names.Reserve(static_cast<size_t>(out->node_size()));
      for (const auto& node : out->node()) names.Insert(node.name());
      have_names = true;
    }
    return names.Find(std::string_view(v).substr(kLoc.size())) < 0;
  };
  // (every node: a node made from patch records is the base node's; the
  // payload's come with the rule applied, and it changes nothing twice)
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& read = out->node(static_cast<int>(k)).attr();
    const auto found = read.find("_class");
    if (found == read.end()) continue;
    const auto& seen = found->second.list().s();
    if (std::none_of(seen.begin(), seen.end(), dangling)) continue;
    auto* attrs = out->mutable_node(static_cast<int>(k))->mutable_attr();
    auto it = attrs->find("_class");
    const auto& vals = it->second.list().s();
    std::vector<std::string> keep;
    for (const auto& v : vals) {
      if (!dangling(v)) keep.push_back(v);
    }
    if (keep.empty()) {
      attrs->erase(it);
    } else {
      auto* s = it->second.mutable_list()->mutable_s();
      s->Clear();
      for (auto& v : keep) s->Add(std::move(v));
    }
  }
  return true;
}

bool AssemblePatch(const tensorflow::GraphDef& base, const std::vector<int32_t>& order,
                   const std::string& patch_bytes, tensorflow::GraphDef* out, std::string* error) {
  tensorflow::GraphDef patch;
  std::vector<int32_t> full;
  if (!npu_amp_tf::ParsePatch(base, order.data(), order.size(), patch_bytes.data(),
                              patch_bytes.size(), &patch, &full, error)) {
    return false;
  }
  return AssembleParsedPatch(base, full, patch, out, error);
}

std::string JoinLines(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) {
    if (!out.empty()) out.push_back('\n');
    out += s;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// C ABI used from Python (ctypes)
// ---------------------------------------------------------------------------
NPU_AMP_EXPORT void NpuAmpSetCallback(NpuAmpCallbackFn cb) { g_callback.store(cb); }

NPU_AMP_EXPORT int NpuAmpHasCallback() { return g_callback.load() != nullptr; }

// (issue 17) The patch records' format this library reads (npu_amp_tf::
// ParsePatch): Python sends records only when it is the one it writes.
NPU_AMP_EXPORT int NpuAmpPatchRecordsVersion() { return npu_amp_tf::kPatchRecordsVersion; }

// (issue 17) How many record nodes the pre-check took out of items instead
// of copying them (bridge.STEAL_RECORDS), and how many were put back (a
// path that did not assemble that patch).  Tests.
NPU_AMP_EXPORT void NpuAmpStealCounts(uint64_t* stolen, uint64_t* restored) {
  *stolen = g_stolen.load();
  *restored = g_stolen_restored.load();
}

NPU_AMP_EXPORT void NpuAmpWriteResult(void* sink, const char* data, size_t len) {
  auto* s = static_cast<Sink*>(sink);
  s->result.assign(data, len);
  s->has_result = true;
}

// The result as a patch of the item's graph (see AssemblePatch): `order`
// holds n int32 entries, `data` the serialized GraphDef of the changed nodes.
NPU_AMP_EXPORT void NpuAmpWritePatch(void* sink, const int32_t* order, size_t n, const char* data,
                                     size_t len) {
  auto* s = static_cast<Sink*>(sink);
  s->patch_order.assign(order, order + n);
  s->patch.assign(data, len);
  s->has_patch = true;
}

// (issue 17r) The sink's flags (kFlag*): kFlagMoveItemNodes lets the patch
// written to it move the item's unchanged nodes into grappler's output
// instead of copying them (see Optimize); kFlagIndexFromBytes builds
// NpuAmpItemIndex from the item's serialized bytes (ViewsOfBytes).
NPU_AMP_EXPORT void NpuAmpSinkFlags(void* sink, int flags) {
  auto* s = static_cast<Sink*>(sink);
  s->flags = flags;
  const bool first = !s->flags_set;
  s->flags_set = true;
  if (!first) return;  // (a later call, e.g. a test's: the index may be in use)
  g_early_flags.store(flags);
  if (s->early_index &&
      (!(flags & kFlagEarlyIndex) || (s->index_flags & kIndexFlags) != (flags & kIndexFlags))) {
    // started before the callback with the previous call's flags, not these:
    // dropped, and built again as these flags say (the same bytes either way)
    s->ForgetIndex();
    s->early_index = false;
    g_early_discarded.fetch_add(1);
  }
}

// (issue 17, kFlagEarlyMirror) The gradient-region mirror Optimize began
// loading from the item's bytes before the callback, its load done: the
// handle, which the caller owns from here (NpuAmpGrMirrorFree), or null
// (none was started, it was taken already, or its load refused: freed here).
NPU_AMP_EXPORT void* NpuAmpSinkTakeMirror(void* sink) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call() || s->early_mirror == nullptr) return nullptr;
  void* h = s->early_mirror;
  s->early_mirror = nullptr;
  if (NpuAmpGrMirrorWait(h) != 0) {
    NpuAmpGrMirrorFree(h);
    return nullptr;
  }
  g_early_mirrors_taken.fetch_add(1);
  return h;
}

// (issue 17) The flags the next items' early work starts with
// (kFlagEarlyIndex, kFlagEarlyMirror), set again by a callback at its end,
// once it knows whether it used what NpuAmpSinkFlags asked for at its entry.
NPU_AMP_EXPORT void NpuAmpNextFlags(int flags) { g_early_flags.store(flags); }

// How many mirrors Optimize started loading before the callback, and how
// many the callbacks took (for tests).
NPU_AMP_EXPORT void NpuAmpEarlyMirrorCounts(uint64_t* started, uint64_t* taken) {
  *started = g_early_mirrors.load();
  *taken = g_early_mirrors_taken.load();
}

// (issue 17) How many item indexes Optimize started before the callback, and
// how many of them the callback's flags discarded (for tests).
NPU_AMP_EXPORT void NpuAmpEarlyIndexCounts(uint64_t* started, uint64_t* discarded) {
  *started = g_early_started.load();
  *discarded = g_early_discarded.load();
}

// (issue 17u) The fingerprint Optimize() computed of the item's bytes and its
// context (parameters, fetch, preserve, devices: what it remembers graphs
// by), for Python's memo key instead of hashing the same bytes again; 0
// and *fp = 0 outside the callback.
NPU_AMP_EXPORT int NpuAmpItemFingerprint(void* sink, uint64_t* fp) {
  auto* s = static_cast<Sink*>(sink);
  *fp = 0;
  if (s == nullptr || !s->in_call()) return 1;
  *fp = s->fingerprint;
  return 0;
}

namespace {
// Whether a node of the item grappler is optimizing now satisfies `has`
// (given the node and `what`): 1 yes, 0 no, -1 outside the callback.
template <typename Has>
int ItemHasNode(void* sink, const char* what, Has has) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call() || what == nullptr) return -1;
  const std::string want(what);
  for (const auto& node : s->WholeItem().graph.node()) {
    if (has(node, want)) return 1;
  }
  return 0;
}
}  // namespace

// A node of op type `op` in the item (ItemHasNode's answers).  Python asks it
// for its own error op before the item's 4 MB would be searched for the name.
NPU_AMP_EXPORT int NpuAmpItemHasOp(void* sink, const char* op) {
  return ItemHasNode(sink, op, [](const tensorflow::NodeDef& n, const std::string& w) {
    return n.op() == w;
  });
}

// (issue 17) The item's attr and device questions answered from the views
// its index read (GraphViews::want_attrs: one read of its bytes, on the
// index's thread): `what` an attr name beginning with '_' (does a node carry
// it?), or "" (does a node have a device string?).  1 yes, 0 no, -1 not
// known so (outside the callback, no index built from the bytes, another
// attr name, or more '_' names than the views keep): ItemHasNode's walk over
// the NodeDefs answers then.  On BERT-12 that walk takes ~1 ms for an attr
// (a cold attr map per node), ~0.15 ms for the device.
NPU_AMP_EXPORT int NpuAmpItemAttrByIndex(void* sink, const char* what) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call() || what == nullptr) return -1;
  if (what[0] != '\0' && what[0] != '_') return -1;
  s->WaitIndex();  // (the views are handed over with the index)
  const GraphViews* v = s->views.get();
  // (the count only: GraphAsTaken, which puts back no node the pre-check took out)
  if (v == nullptr || static_cast<int64_t>(v->name.size()) != s->GraphAsTaken().node_size()) {
    return -1;
  }
  if (what[0] == '\0') return v->device_known ? (v->any_device ? 1 : 0) : -1;
  if (!v->attrs_known) return -1;
  const std::string_view want(what);
  return std::find(v->private_attrs.begin(), v->private_attrs.end(), want) != v->private_attrs.end() ? 1 : 0;
}

// A node carrying the attr `name` in the item (ItemHasNode's answers).  The
// precision pass asks it for the user's _keep_dtype marks before reading
// every node's attr map.
NPU_AMP_EXPORT int NpuAmpItemHasAttr(void* sink, const char* name) {
  return ItemHasNode(sink, name, [](const tensorflow::NodeDef& n, const std::string& w) {
    return n.attr().count(w) != 0;
  });
}

// A node with a device string in the item (ItemHasNode's answers).  The
// precision pass asks it before reading every node's device: in a graph
// grappler optimizes before placement, usually none has one.
NPU_AMP_EXPORT int NpuAmpItemHasDevice(void* sink) {
  return ItemHasNode(sink, "", [](const tensorflow::NodeDef& n, const std::string&) {
    return !n.device().empty();
  });
}

// AssemblePatch offline, for tests: `graph` a serialized GraphDef; writes the
// assembled graph's deterministic serialization.  Returns 0, or 1 and a
// message in *out.  The bytes stay valid until the next call on the thread.
NPU_AMP_EXPORT int NpuAmpAssemblePatch(const char* graph, size_t graph_len, const int32_t* order,
                                       size_t n, const char* data, size_t len, const char** out,
                                       size_t* out_len) {
  thread_local std::string buf;
  tensorflow::GraphDef base, result;
  int rc = 0;
  if (!base.ParseFromArray(graph, static_cast<int>(graph_len))) {
    buf = "the bytes do not parse as a GraphDef";
    rc = 1;
  } else if (!AssemblePatch(base, std::vector<int32_t>(order, order + n), std::string(data, len),
                            &result, &buf)) {
    rc = 1;
  } else if (!tensorflow::SerializeToStringDeterministic(result, &buf)) {
    buf = "cannot serialize the assembled graph";
    rc = 1;
  }
  *out = buf.data();
  *out_len = buf.size();
  return rc;
}

NPU_AMP_EXPORT void NpuAmpWriteError(void* sink, const char* msg, size_t len) {
  auto* s = static_cast<Sink*>(sink);
  s->error.assign(msg, len);
  s->has_error = true;
}

NPU_AMP_EXPORT int NpuAmpBridgeAbiVersion() { return kBridgeAbiVersion; }

// (issue 17) graph_passes/fusion/core.py _removable's registry question for
// the layer-norm fusion before the parse (grad_region.cc NormFuser): 1 when
// `op` is registered and not stateful, else 0.
NPU_AMP_EXPORT int NpuAmpOpRemovable(const char* op, size_t len) {
  if (op == nullptr) return 0;
  const tensorflow::OpDef* od = nullptr;
  if (!tensorflow::OpRegistry::Global()->LookUpOpDef(std::string(op, len), &od).ok() || od == nullptr) {
    return 0;
  }
  return od->is_stateful() ? 0 : 1;
}

// How many times grappler called NpuAmpOptimizer::Optimize in this process.
NPU_AMP_EXPORT uint64_t NpuAmpOptimizeCount() { return g_optimize_calls.load(); }

// Address of a static in this library: lets tests check that ctypes.CDLL and
// tf.load_op_library share one copy of the library's globals.
NPU_AMP_EXPORT const void* NpuAmpStateAddress() { return &g_callback; }

// Number of Optimize() calls currently inside the Python callback.
NPU_AMP_EXPORT int NpuAmpInFlight() { return g_in_flight.load(); }

// Shapes of the item being optimized (only valid inside the callback).
// Returns 0 and the line format in *data/*len, or 1 and a message.  The bytes
// stay valid until the callback returns.
NPU_AMP_EXPORT int NpuAmpItemShapes(void* sink, const char** data, size_t* len) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call()) {
    static const char kMsg[] = "no grappler item: NpuAmpItemShapes called outside Optimize";
    *data = kMsg;
    *len = sizeof(kMsg) - 1;
    return 1;
  }
  if (!s->has_shapes) {
    const tensorflow::grappler::GrapplerItem& whole = s->WholeItem();  // (inference reads every node)
    s->has_shapes = true;
    bool ok;
    if (s->prefused_graph != nullptr) {
      // (issue 17) the item as it came, not the fused graph it holds now
      // (NpuAmpSinkUsePrefused): the passes' shape table is the input's, as
      // when the fusion pass makes the fusions (copied: inference is lazy and
      // costs more than the copy)
      tensorflow::grappler::GrapplerItem original(whole);
      auto* nodes = original.graph.mutable_node();
      nodes->Clear();
      nodes->Reserve(static_cast<int>(s->prefused_orig.size()));
      for (const tensorflow::NodeDef* p : s->prefused_orig) *nodes->Add() = *p;
      ok = InferShapesText(original, &s->shapes);
    } else {
      ok = InferShapesText(whole, &s->shapes);
    }
    if (!ok) {
      s->shapes = "grappler shape inference failed: " + s->shapes;
      s->set_item(nullptr);  // remember the failure as the message
    }
  }
  *data = s->shapes.data();
  *len = s->shapes.size();
  return !s->in_call() ? 1 : 0;
}

// Shapes of a serialized GraphDef (offline use).  The bytes stay valid until
// the next call on the same thread.
NPU_AMP_EXPORT int NpuAmpGraphShapes(const char* graph, size_t graph_len, const char** data,
                                     size_t* len) {
  thread_local std::string buf;
  tensorflow::grappler::GrapplerItem item;
  item.id = "npu_amp_tf_shapes";
  int rc = 0;
  if (!item.graph.ParseFromArray(graph, static_cast<int>(graph_len))) {
    buf = "the bytes do not parse as a GraphDef";
    rc = 1;
  } else if (!InferShapesText(item, &buf)) {
    buf = "grappler shape inference failed: " + buf;
    rc = 1;
  }
  *data = buf.data();
  *len = buf.size();
  return rc;
}

// The graph index (GraphIndexText) of the item being optimized (only valid
// inside the callback).  Returns 0 and the index in *data/*len, or 1 (nothing
// written): Python then builds the index itself.  The bytes stay valid until
// the callback returns.
// Builds the item's index into s->index (and s->kept, s->views): 0, or 1.
// `graph`: the item's, whole (Sink::WholeItem, taken before a thread starts).
// `late`: the classes left out (GraphIndexText's).
static int BuildItemIndex(Sink* s, const tensorflow::GraphDef& graph, int flags,
                          LateClasses* late = nullptr) {
  const int64_t t0 = ThreadCpuNs();
  std::shared_ptr<GraphViews> held = std::move(s->prefused_views);
  s->prefused_views.reset();
  if (held == nullptr || !(flags & kFlagIndexFromBytes)) {
    held = std::make_shared<GraphViews>();
    held->want_attrs = true;  // (the item's attr and device questions: NpuAmpItemAttrByIndex)
    if (!(flags & kFlagIndexFromBytes) || !ViewsOfBytes(s->graph_bytes, held.get())) {
      *held = GraphViews();
      ViewsOfGraph(graph, held.get());
    }
  }
  GraphViews& views = *held;
  if (!views.device_known && (flags & kFlagIndexFromBytes) && !s->graph_bytes.empty()) {
    // (the views of the layer-norm fusions' bytes, read on the callback's
    // thread without them: the attrs and devices read here, on the index's)
    AttrsOfBytes(s->graph_bytes, &views);
  }
  const bool ok = GraphIndexText(graph, views, &s->index, (flags & kFlagFastIndex) != 0,
                                 (flags & kFlagPrecheckFromIndex) ? &s->kept : nullptr, late);
  if (static_cast<int64_t>(views.name.size()) == graph.node_size()) s->views = std::move(held);
  g_step_ns[kStepIndex].fetch_add(ThreadCpuNs() - t0);
  return ok ? 0 : 1;
}

NPU_AMP_EXPORT int NpuAmpItemIndex(void* sink, const char** data, size_t* len) {
  auto* s = static_cast<Sink*>(sink);
  *data = nullptr;
  *len = 0;
  if (s == nullptr || !s->in_call()) return 1;
  s->WaitIndex();  // (handed over: the thread may still be computing the classes)
  if (s->index_rc < 0) {  // (no thread ran: built here)
    s->index_rc = BuildItemIndex(s, s->WholeItem().graph, s->flags);  // (its classes read the nodes)
  }
  if (s->index_rc != 0) return 1;
  *data = s->index.data();
  *len = s->index.size();
  return 0;
}

// (issue 17) Starts building the item's index (NpuAmpItemIndex's) on a helper
// thread, with the flags set now, so that it overlaps Python's parse of the
// bytes; NpuAmpItemIndex then waits for it.  0 started, 1 not (no item, built
// or started already, or no thread to be had: NpuAmpItemIndex builds it).
static int StartIndexThread(Sink* s, int flags) {
  if (s == nullptr || !s->in_call() || s->index_rc >= 0 || s->index_thread.joinable()) return 1;
  const tensorflow::GraphDef* graph = &s->WholeItem().graph;  // (the thread reads its nodes)
  s->index_flags = flags;
  try {
    s->index_published = false;
    s->index_thread = npu_amp_tf::Job([s, graph, flags] {
      int rc = 1;
      LateClasses late;
      LateClasses* defer = (flags & kFlagLateClasses) ? &late : nullptr;
      try {
        rc = BuildItemIndex(s, *graph, flags, defer);
      } catch (...) {  // (bad_alloc: NpuAmpItemIndex answers 1, Python indexes)
        rc = 1;
      }
      s->PublishIndex(rc);
      if (rc != 0 || defer == nullptr) return;
      g_late_indexes.fetch_add(1);
      const int64_t t0 = ThreadCpuNs();
      try {  // (the item's nodes are read: every entry that edits the item joins first)
        s->classes = SignatureClasses(*graph, late.op_of_node, late.op_order, (flags & kFlagFastIndex) != 0);
        s->classes_rc = 0;
        g_late_classes.fetch_add(1);
      } catch (...) {  // (bad_alloc: NpuAmpItemClasses answers 1, Python goes without)
        s->classes_rc = 1;
      }
      g_step_ns[kStepIndex].fetch_add(ThreadCpuNs() - t0);
    });
  } catch (...) {  // std::system_error: no thread; built when asked
    return 1;
  }
  return 0;
}

// (issue 17) The layer-norm fusions made before the parse
// (graph_passes/fusion/prefuse.py, custom_ops/grad_region.cc NormFuser) put
// into the item (only valid inside the callback): `data` is the item's
// bytes with the fusions applied, `map` per node of `data` the index of the
// item node it is (unchanged), or -1 (created, or edited: parsed from
// `data`).  The item's graph then holds exactly `data`'s graph (the item's
// nodes moved into it, in their new order), the sink's bytes are `data`, and
// the item's index is built again from them, so that every item-based step
// after (the index, the paint strings, the OpDef pre-check, the patch's
// assembly, the shapes) sees the graph Python parses.  Optimize puts the
// item's own nodes back on every path that hands the graph back unchanged.
// `start_index`: build the new index on a helper thread now (else when asked).
// 0 done, 1 refused (nothing changed: Python parses the item's own bytes).
// `v`'s views of the bytes at `from` made views of the same bytes copied to `to`
static void RebaseViews(GraphViews* v, const char* from, const char* to) {
  for (auto* sec : {&v->name, &v->op, &v->input, &v->def, &v->private_attrs}) {
    for (std::string_view& x : *sec) {
      if (x.data() != nullptr) x = std::string_view(to + (x.data() - from), x.size());
    }
  }
}

NPU_AMP_EXPORT int NpuAmpSinkUsePrefused(void* sink, const char* data, size_t len, const int32_t* map,
                                         size_t n, int start_index) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call() || s->prefused_graph != nullptr || data == nullptr ||
      (n && map == nullptr)) {
    return 1;
  }
  s->JoinIndex();
  tensorflow::GraphDef* graph = s->MutableWholeGraph();
  const int n0 = graph->node_size();
  try {
    // the node records of `data`, in order
    std::vector<std::string_view> recs;
    recs.reserve(n);
    const char* p = data;
    const char* end = data + len;
    while (p < end) {
      uint64_t tag, size;
      if (!npu_amp_tf::ReadVarint(p, end, &tag)) return 1;
      if (tag == ((1 << 3) | 2)) {
        if (!npu_amp_tf::ReadVarint(p, end, &size) || size > static_cast<uint64_t>(end - p)) return 1;
        recs.emplace_back(p, size);
        p += size;
      } else if (!npu_amp_tf::SkipField(p, end, tag & 7)) {
        return 1;
      }
    }
    if (recs.size() != n) return 1;
    std::vector<char> kept(static_cast<size_t>(n0), 0);
    std::vector<std::unique_ptr<tensorflow::NodeDef>> fresh(n);
    auto held = std::make_shared<GraphViews>();
    GraphViews& views = *held;
    if (!ViewsOfBytes(std::string_view(data, len), &views) || views.name.size() != n) return 1;
    // each node kept checked against the item's node it names: by the names
    // in the item's bytes (one sequential read), else by the NodeDefs' own
    // (a cold heap read per node: ~1.3 ms on BERT-12)
    std::vector<std::string_view> base;
    base.reserve(static_cast<size_t>(n0));
    const bool by_bytes = !s->graph_bytes.empty() && npu_amp_tf::NamesOfBytes(s->graph_bytes, &base) &&
                          static_cast<int64_t>(base.size()) == n0;
    for (size_t i = 0; i < n; ++i) {
      const int32_t k = map[i];
      if (k >= 0) {
        if (k >= n0 || kept[k]++ ||
            (by_bytes ? base[k] : std::string_view(graph->node(k).name())) != views.name[i]) {
          return 1;
        }
        continue;
      }
      fresh[i] = std::make_unique<tensorflow::NodeDef>();
      if (!fresh[i]->ParseFromArray(recs[i].data(), static_cast<int>(recs[i].size()))) return 1;
    }
    // (nothing below fails but bad_alloc)
    s->prefused_bytes.assign(data, len);
    RebaseViews(&views, data, s->prefused_bytes.data());  // (for the index: of prefused_bytes)
    s->prefused_views = std::move(held);
    std::vector<tensorflow::NodeDef*> orig(static_cast<size_t>(n0));
    auto* nodes = graph->mutable_node();
    if (n0) nodes->ExtractSubrange(0, n0, orig.data());
    s->prefused_orig = std::move(orig);
    s->prefused_kept = std::move(kept);
    s->prefused_graph = graph;
    for (size_t i = 0; i < n; ++i) {
      nodes->AddAllocated(map[i] >= 0 ? s->prefused_orig[map[i]] : fresh[i].release());
    }
  } catch (...) {  // (bad_alloc: the item as it came, if it was taken apart)
    s->prefused_views.reset();
    s->RestorePrefused();
    return 1;
  }
  s->graph_bytes = s->prefused_bytes;
  // the index, views and shapes of the item as it came are no longer its
  s->ForgetIndex();
  s->has_shapes = false;
  s->shapes.clear();
  // (bridge.INDEX_IN_BACKGROUND, as the callback's entry would have; else built when asked)
  if (start_index) StartIndexThread(s, s->flags);
  return 0;
}

// (issue 17, kFlagLateClasses) The signature classes of the index handed
// over without them (its magic's "+l"), in its node order, once the helper
// thread has computed them: 0 with *data / *n (valid until the callback
// returns), 1 none (no such index, or the thread could not).
NPU_AMP_EXPORT int NpuAmpItemClasses(void* sink, const int32_t** data, size_t* n) {
  auto* s = static_cast<Sink*>(sink);
  *data = nullptr;
  *n = 0;
  if (s == nullptr || !s->in_call()) return 1;
  s->JoinIndex();
  if (s->classes_rc != 0) return 1;
  *data = s->classes.data();
  *n = s->classes.size();
  return 0;
}

// NpuAmpItemClasses' counts: indexes handed over before their classes, and
// classes computed after (for tests).
NPU_AMP_EXPORT void NpuAmpLateClassesCounts(uint64_t* indexes, uint64_t* classes) {
  *indexes = g_late_indexes.load();
  *classes = g_late_classes.load();
}

NPU_AMP_EXPORT int NpuAmpItemIndexStart(void* sink) {
  auto* s = static_cast<Sink*>(sink);
  return StartIndexThread(s, s == nullptr ? 0 : s->flags);
}

// The same for a serialized GraphDef (offline use).  The bytes stay valid
// until the next call on the same thread.
// (issue 17r: NpuAmpGraphIndexFlags with kFlagIndexFromBytes reads the names,
// ops and inputs from the bytes, as NpuAmpItemIndex does; the same index.)
NPU_AMP_EXPORT int NpuAmpGraphIndexFlags(const char* graph, size_t graph_len, int flags,
                                         const char** data, size_t* len) {
  thread_local std::string buf;
  *data = nullptr;
  *len = 0;
  tensorflow::GraphDef gd;
  if (!gd.ParseFromArray(graph, static_cast<int>(graph_len))) return 1;
  GraphViews views;
  if (!(flags & kFlagIndexFromBytes) ||
      !ViewsOfBytes(std::string_view(graph, graph_len), &views)) {
    views = GraphViews();
    ViewsOfGraph(gd, &views);
  }
  if (!GraphIndexText(gd, views, &buf, (flags & kFlagFastIndex) != 0)) return 1;
  *data = buf.data();
  *len = buf.size();
  return 0;
}

// (issue 17, for tests) The item's bytes as the bridge writes them, of a
// serialized GraphDef: `fast` 1 the hand-written writer (a large graph's
// halves on two threads, as g_serialize_split says), 2 the same on one
// thread, 0 the generated code (deterministic).  The bytes stay valid until
// the next call on the same thread.  1 when the bytes do not parse or a
// writer fails.
NPU_AMP_EXPORT int NpuAmpSerializeGraph(const char* graph, size_t graph_len, int fast, const char** data,
                                        size_t* len) {
  thread_local std::string buf;
  *data = nullptr;
  *len = 0;
  tensorflow::GraphDef gd;
  if (!gd.ParseFromArray(graph, static_cast<int>(graph_len))) return 1;
  if (!SerializeGraph(gd, &buf, fast != 0, /*split=*/fast != 2)) return 1;
  *data = buf.data();
  *len = buf.size();
  return 0;
}

// Whether SerializeGraph's own writer applies to this TF's messages (KnownSchema).
NPU_AMP_EXPORT int NpuAmpSerializeKnownSchema() { return KnownSchema() ? 1 : 0; }

// (issue 17) Whether SerializeGraph writes a large graph's halves on two
// threads (g_serialize_split); returns the previous setting.
NPU_AMP_EXPORT int NpuAmpSetSerializeSplit(int split) {
  const bool was = g_serialize_split;
  g_serialize_split = split != 0;
  return was ? 1 : 0;
}

// (issue 17) The node count from which the OpDef pre-check runs its checks in
// two halves on two threads (0: never, the reference); returns the previous one.
NPU_AMP_EXPORT int64_t NpuAmpSetPrecheckSplit(int64_t min_nodes) {
  return npu_amp_tf::g_precheck_split_min.exchange(min_nodes < 0 ? 0 : min_nodes);
}

// Whether the bridge writes the item's bytes by hand (SerializeGraph); returns the previous setting.
NPU_AMP_EXPORT int NpuAmpSetSerializeFast(int fast) {
  const bool was = g_serialize_fast;
  g_serialize_fast = fast != 0;
  return was ? 1 : 0;
}

NPU_AMP_EXPORT int NpuAmpGraphIndex(const char* graph, size_t graph_len, const char** data,
                                    size_t* len) {
  return NpuAmpGraphIndexFlags(graph, graph_len, 0, data, len);
}

// The OpDef guard's pre-check (issue 17m, opdef_precheck.cc) on the graph
// the callback is about to hand back as a patch of the item (order / data as
// for NpuAmpWritePatch; only valid inside the callback): 0 clean (the Python
// guard need not run), 1 flagged, 2 cannot tell.  `broken`: the known-broken
// kernel table, `device`: the default device type (see OpdefPrecheck).  The
// parsed patch is kept: NpuAmpWritePatch with the same bytes reuses it.
NPU_AMP_EXPORT int NpuAmpItemOpdefPrecheck(void* sink, const int32_t* order, size_t n,
                                           const char* data, size_t len, const char* broken,
                                           size_t broken_len, const char* device) {
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call()) return npu_amp_tf::kPrecheckUnable;
  s->JoinIndex();
  struct Timer {
    int64_t t0 = ThreadCpuNs();
    ~Timer() { g_step_ns[kStepPrecheck].fetch_add(ThreadCpuNs() - t0); }
  } timer;
  const tensorflow::GraphDef& base = s->WholeItem().graph;  // (a second pre-check: whole again first)
  s->has_checked = false;
  std::string why;
  // (issue 17) the record nodes taken out of the item, not copied, when the
  // assembly moves the item's nodes anyway (kFlagMoveItemNodes)
  auto* steal = (s->flags & kFlagMoveItemNodes) && (s->flags & kFlagStealRecords)
                    ? s->MutableWholeGraph()
                    : nullptr;
  const int64_t t_parse = ThreadCpuNs();
  const bool parsed = npu_amp_tf::ParsePatch(base, order, n, data, len, &s->checked,
                                             &s->checked_full, &why, steal,
                                             steal != nullptr ? &s->stolen : nullptr);
  g_step_ns[kStepPrecheckParse].fetch_add(ThreadCpuNs() - t_parse);
  if (!parsed) return npu_amp_tf::kPrecheckUnable;
  if (!s->stolen.empty()) s->stolen_from = steal;
  g_stolen.fetch_add(s->stolen.size());
  s->checked_order.assign(order, order + n);
  s->checked_bytes.assign(data, len);
  s->has_checked = true;
  if ((s->flags & kFlagPrecheckFromIndex) && s->kept.valid) {
    // (issue 17u) the item index's names and consumers: the same answer
    return npu_amp_tf::OpdefPrecheckIndexed(s->GraphAsTaken(), s->kept, s->checked_full, s->checked,
                                            std::string_view(broken, broken_len),
                                            std::string_view(device ? device : "CPU"));
  }
  std::vector<const tensorflow::NodeDef*> nodes;
  std::vector<char> changed;
  if (!npu_amp_tf::PatchNodes(s->GraphAsTaken(), s->checked_full, s->checked, &nodes, &changed)) {
    return npu_amp_tf::kPrecheckUnable;
  }
  return npu_amp_tf::OpdefPrecheck(nodes, changed, s->checked.library(),
                                   std::string_view(broken, broken_len),
                                   std::string_view(device ? device : "CPU"));
}

// (issue 17u) The pre-check offline with NpuAmpItemOpdefPrecheck's paths:
// `flags` & kFlagPrecheckFromIndex builds the input's C++ index (with
// kFlagFastIndex: its NameTable lookups) and answers with
// OpdefPrecheckIndexed, as the callback does (when the index refuses the
// graph, the reference check answers); else NpuAmpGraphOpdefPrecheck.
// Arguments and answers as NpuAmpGraphOpdefPrecheck's.
NPU_AMP_EXPORT int NpuAmpGraphOpdefPrecheckFlags(const char* graph, size_t graph_len, int flags,
                                                 const int32_t* order, size_t n, const char* patch,
                                                 size_t patch_len, const char* broken,
                                                 size_t broken_len, const char* device) {
  if (!(flags & kFlagPrecheckFromIndex)) {
    return NpuAmpGraphOpdefPrecheck(graph, graph_len, order, n, patch, patch_len, broken,
                                    broken_len, device);
  }
  tensorflow::GraphDef base, delta;
  std::vector<int32_t> full;
  std::string why;
  if (!base.ParseFromArray(graph, static_cast<int>(graph_len)) ||
      !npu_amp_tf::ParsePatch(base, order, n, patch, patch_len, &delta, &full, &why)) {
    return npu_amp_tf::kPrecheckUnable;
  }
  GraphViews views;
  ViewsOfGraph(base, &views);
  std::string text;
  npu_amp_tf::BaseIndex kept;
  if (!GraphIndexText(base, views, &text, (flags & kFlagFastIndex) != 0, &kept)) {
    return NpuAmpGraphOpdefPrecheck(graph, graph_len, order, n, patch, patch_len, broken,
                                    broken_len, device);
  }
  return npu_amp_tf::OpdefPrecheckIndexed(base, kept, full, delta,
                                          std::string_view(broken, broken_len),
                                          std::string_view(device ? device : "CPU"));
}

// Kahn's topological order over integer arrays (issue 17f), the rule of
// graph_passes.graph.Graph._compute_topo_order: nodes 0..n-1 in graph order,
// counts[u] consumer entries of node u (data and control, in the consumers
// index's order) flattened in readers[] (a reader's node index, -1 for a
// reader that is no node: ignored); a node with back[u] != 0 (NextIteration)
// is ordered but releases no reader (loop back edges).  FIFO; the first
// nodes without inputs in graph order.  Writes the order to order[] and
// returns its length (< n when a cycle outside loops leaves nodes out; the
// caller appends them), or -1 on a bad array.
NPU_AMP_EXPORT int NpuAmpKahnOrder(int32_t n, const int32_t* counts, const int32_t* readers,
                                   int64_t n_readers, const uint8_t* back, int32_t* order) {
  if (n < 0) return -1;
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0);
  for (int32_t u = 0; u < n; ++u) {
    if (counts[u] < 0) return -1;
    start[u + 1] = start[u] + counts[u];
  }
  if (start[n] != n_readers) return -1;
  std::vector<int32_t> indeg(n, 0);
  for (int64_t e = 0; e < n_readers; ++e) {
    if (readers[e] >= n) return -1;
  }
  for (int32_t u = 0; u < n; ++u) {
    if (back[u]) continue;
    for (int64_t e = start[u]; e < start[u + 1]; ++e) {
      if (readers[e] >= 0) ++indeg[readers[e]];
    }
  }
  // the order doubles as the FIFO queue: nodes are appended when ready
  int32_t tail = 0;
  for (int32_t u = 0; u < n; ++u) {
    if (indeg[u] == 0) order[tail++] = u;
  }
  for (int32_t head = 0; head < tail; ++head) {
    const int32_t u = order[head];
    if (back[u]) continue;
    for (int64_t e = start[u]; e < start[u + 1]; ++e) {
      const int32_t r = readers[e];
      if (r >= 0 && --indeg[r] == 0) order[tail++] = r;
    }
  }
  return tail;
}

// The kernels TF registers for several op types at once: the serialized
// KernelList of every registered kernel whose op is one of the '\n'-joined
// names in ops[0:ops_len], in the registry's order (the order
// TF_GetRegisteredKernelsForOp gives for one op).  That C API call scans the
// whole registry (~10k kernels) once per op type, ~1-2.5 ms each; the passes
// ask about 30-50 op types of a graph, so one scan for all of them saves
// tens of milliseconds on the first graph of a process.  Returns 0 and the
// bytes in *data/*len (valid until the next call on this thread), 1 when the
// list does not serialize.
NPU_AMP_EXPORT int NpuAmpKernelsForOps(const char* ops, size_t ops_len, const char** data,
                                       size_t* len) {
  thread_local std::string buf;
  *data = nullptr;
  *len = 0;
  std::unordered_set<std::string> wanted;
  std::string_view rest(ops, ops_len);
  while (!rest.empty()) {
    const size_t cut = rest.find('\n');
    const std::string_view op = rest.substr(0, cut);
    if (!op.empty()) wanted.emplace(op);
    if (cut == std::string_view::npos) break;
    rest.remove_prefix(cut + 1);
  }
  const tensorflow::KernelList list = tensorflow::GetFilteredRegisteredKernels(
      [&wanted](const tensorflow::KernelDef& k) { return wanted.count(k.op()) > 0; });
  buf.clear();
  if (!list.SerializeToString(&buf)) return 1;
  *data = buf.data();
  *len = buf.size();
  return 0;
}

// The precision pass's painting input (issue 17, graph_passes/precision/native.py):
// its strings section, names joined by \x01, \x03, then per node the first
// counts[i] of its inputs (all of them when counts[i] < 0) joined by \x01,
// nodes joined by \x02 -- with the inputs of every node the passes left
// unchanged read here from the item grappler holds instead of turned into
// Python strings and joined there (most of a graph's nodes; ~5-8 ms of
// Python per callback on a ResNet-50 / BERT-base training graph).
// `names`: the section's names part (n names, \x01-joined); `base[i]`: node
// i's index in the item's graph, or -1 for a node created or edited since
// (its inputs come from `extra`: those nodes' sections in node order, joined
// by \x02).  Every base node's name is compared with the item node's.
// Returns 0 and the whole section in *data/*len (valid until the next call
// on this thread), 1 when the arguments do not describe the item (Python
// then joins every node's inputs itself).  The item's inputs are read through
// the views NpuAmpItemIndex kept (one sequential read of its bytes), or
// views of the parsed graph built here when no index was asked for.
NPU_AMP_EXPORT int NpuAmpItemPaintStrings(void* sink, const char* names, size_t names_len,
                                          const int32_t* base, const int32_t* counts, int64_t n,
                                          const char* extra, size_t extra_len, const char** data,
                                          size_t* len) {
  thread_local std::string buf;
  *data = nullptr;
  *len = 0;
  auto* s = static_cast<Sink*>(sink);
  if (s == nullptr || !s->in_call() || n < 0 || (n > 0 && (base == nullptr || counts == nullptr))) {
    return 1;
  }
  const tensorflow::GraphDef& whole = s->WholeItem().graph;
  s->JoinIndex();
  if (s->views == nullptr) {  // (no index built this call: views of the parsed graph)
    auto held = std::make_shared<GraphViews>();
    ViewsOfGraph(whole, held.get());
    s->views = std::move(held);
  }
  const GraphViews& views = *s->views;
  const int64_t size = static_cast<int64_t>(views.name.size());
  const std::string_view all_names(names, names_len);
  std::string_view rest_extra(extra == nullptr ? "" : extra, extra == nullptr ? 0 : extra_len);
  int64_t pending = 0;  // the nodes whose section comes from `extra`
  for (int64_t i = 0; i < n; ++i) pending += base[i] < 0 ? 1 : 0;
  buf.clear();
  buf.reserve(names_len + 1 + extra_len + static_cast<size_t>(n) * 48);
  buf.append(all_names);
  buf.push_back('\x03');
  size_t at = 0;  // the next name in `names`
  for (int64_t i = 0; i < n; ++i) {
    size_t end = all_names.find('\x01', at);
    if (end == std::string_view::npos) {
      if (i != n - 1) return 1;
      end = all_names.size();
    }
    const std::string_view name = all_names.substr(at, end - at);
    at = end + 1;
    if (i > 0) buf.push_back('\x02');
    const int32_t k = base[i];
    if (k < 0) {
      size_t cut = rest_extra.find('\x02');
      if ((--pending > 0) != (cut != std::string_view::npos)) return 1;  // one section per such node
      if (cut == std::string_view::npos) cut = rest_extra.size();
      buf.append(rest_extra.substr(0, cut));
      rest_extra.remove_prefix(cut == rest_extra.size() ? cut : cut + 1);
      continue;
    }
    if (k >= size || views.name[k] != name) return 1;
    const int64_t first = views.in_start[k], have = views.in_start[k + 1] - first;
    const int64_t m = counts[i] < 0 ? have : std::min<int64_t>(counts[i], have);
    for (int64_t j = 0; j < m; ++j) {
      if (j > 0) buf.push_back('\x01');
      buf.append(views.input[first + j]);
    }
  }
  if (at < all_names.size() || !rest_extra.empty()) return 1;
  *data = buf.data();
  *len = buf.size();
  return 0;
}

// The step timings of the last Optimize() that called Python (see Step):
// writes min(n, kStepCount) values (thread CPU ns) to out, returns kStepCount.
NPU_AMP_EXPORT int NpuAmpStepTimes(int64_t* out, int n) {
  for (int k = 0; k < n && k < kStepCount; ++k) out[k] = g_step_ns[k].load();
  return kStepCount;
}

// Optimize() calls answered without calling Python: kind 0 = a graph seen
// before (our own output, or left unchanged), 1 = tf.data function, 2 = no float.
NPU_AMP_EXPORT uint64_t NpuAmpSkipCount(int kind) {
  return kind == 0 ? g_skip_seen.load() : kind == 1 ? g_skip_tf_data.load() : g_skip_no_float.load();
}

// Forget the fingerprints of graphs seen before (bridge.clear_reports()).
NPU_AMP_EXPORT void NpuAmpClearSeen() {
  std::lock_guard<std::mutex> lock(g_seen_mu);
  g_seen.clear();
  g_skip_seen.store(0);
  g_skip_tf_data.store(0);
  g_skip_no_float.store(0);
}

namespace tensorflow {
namespace grappler {

class NpuAmpOptimizer : public CustomGraphOptimizer {
 public:
  NpuAmpOptimizer() = default;
  explicit NpuAmpOptimizer(std::string name) : name_(std::move(name)) {}
  ~NpuAmpOptimizer() override = default;

  std::string name() const override { return name_; }

  // The precision pass rewrites function bodies together with their callers.
  bool UsesFunctionLibrary() const override { return true; }

  // Parameters are validated by the Python options module in Optimize():
  // an error returned from Init() would only make grappler skip *all* its
  // optimizers silently (GraphExecutionState falls back to the unoptimized
  // graph), so Init never fails.
  Status Init(const RewriterConfig_CustomGraphOptimizer* config) override {
    config_bytes_.clear();
    if (config != nullptr) {
      if (!SerializeToStringDeterministic(*config, &config_bytes_)) {
        return errors::Internal("NpuAmpOptimizer: cannot serialize its RewriterConfig entry");
      }
    }
    return OkStatus();
  }

  Status Optimize(Cluster* cluster, const GrapplerItem& item, GraphDef* optimized_graph) override {
    g_optimize_calls.fetch_add(1);
    NpuAmpCallbackFn cb = g_callback.load();
    if (cb == nullptr) {
      return errors::FailedPrecondition(
          "NpuAmpOptimizer: the npu_amp_tf Python bridge is not registered in this process "
          "(import npu_amp_tf before creating the session or calling the function)");
    }

    if (item.id.find("Dataset_") != std::string::npos) {  // a tf.data function
      g_skip_tf_data.fetch_add(1);
      return errors::Aborted("NpuAmpOptimizer: tf.data function '", item.id, "' left unchanged");
    }
    const int64_t t_start = ThreadCpuNs();
    if (HasNoFloat(item.graph)) {
      g_skip_no_float.fetch_add(1);
      return errors::Aborted("NpuAmpOptimizer: graph '", item.id, "' has no float tensors");
    }
    const int64_t t_nofloat = ThreadCpuNs();
    // (issue 17) the context and the mark first: a graph this optimizer
    // already rewrote (grappler's second iteration) is recognised without
    // writing its bytes
    std::vector<std::string> preserve_list;
    for (const auto& n : item.NodesToPreserve()) preserve_list.push_back(n);
    std::sort(preserve_list.begin(), preserve_list.end());
    const std::string fetch = JoinLines(item.fetch);
    const std::string preserve = JoinLines(preserve_list);
    std::vector<std::string> device_list;
    if (cluster != nullptr) device_list = cluster->GetDeviceNames();
    if (device_list.empty()) {
      for (const auto& d : item.devices()) device_list.push_back(d);
    }
    std::sort(device_list.begin(), device_list.end());
    const std::string devices = JoinLines(device_list);
    std::string context = config_bytes_;
    for (const std::string* part : {&fetch, &preserve, &devices}) {
      context.push_back('\0');
      context += *part;
    }
    const int64_t mark = static_cast<int64_t>(
        std::hash<std::string_view>{}(std::string_view(context)) & 0x7fffffffffffffffULL);
    if (CarriesMark(item.graph, preserve_list, mark)) {
      g_skip_seen.fetch_add(1);
      return errors::Aborted("NpuAmpOptimizer: graph '", item.id,
                             "' was already rewritten by it; left unchanged");
    }
    const int64_t t_marked = ThreadCpuNs();
    ItemBytes graph_bytes;
    if (!SerializeGraph(item.graph, &graph_bytes, g_serialize_fast)) {
      return errors::Internal("NpuAmpOptimizer: cannot serialize the GraphDef of item '",
                              item.id, "'");
    }
    const int64_t t_serialize = ThreadCpuNs();
    for (auto& t : g_step_ns) t.store(0);  // (before the index's thread adds to its step)
    Sink sink;  // (after graph_bytes: destroyed, and its thread joined, first)
    sink.set_item(&item);
    sink.graph_bytes = graph_bytes.view();
    // (issue 17, kFlagEarlyIndex) the index starts now, with the flags of the
    // previous callback, so that it overlaps the fingerprint below and the
    // callback's entry; the callback's own flags keep or drop it
    // (NpuAmpSinkFlags)
    const int early = g_early_flags.load();
    if (early >= 0 && (early & kFlagEarlyIndex)) {
      sink.flags = early;
      if (StartIndexThread(&sink, early) == 0) {
        sink.early_index = true;
        g_early_started.fetch_add(1);
      }
    }
    // (issue 17, kFlagEarlyMirror) the mirror of the layer-norm fusion before
    // the parse loads now, overlapping the fingerprint and the callback's
    // entry; the callback takes it (NpuAmpSinkTakeMirror) or it is dropped
    if (early >= 0 && (early & kFlagEarlyMirror) && !graph_bytes.view().empty()) {
      void* h = NpuAmpGrMirrorNew();
      if (h != nullptr && NpuAmpGrMirrorLoadAsync(h, graph_bytes.data(), graph_bytes.size()) == 0) {
        sink.early_mirror = h;
        g_early_mirrors.fetch_add(1);
      } else {
        NpuAmpGrMirrorFree(h);
      }
    }
    const uint64_t fp_in = Fingerprint(graph_bytes.view(), context);
    if (Seen(fp_in)) {
      g_skip_seen.fetch_add(1);
      return errors::Aborted("NpuAmpOptimizer: graph '", item.id,
                             "' is one it already optimized; left unchanged");
    }
    sink.fingerprint = fp_in;
    g_step_ns[kStepNoFloat].store(t_nofloat - t_start);
    g_step_ns[kStepSerialize].store(t_serialize - t_marked);
    const int64_t t_context = ThreadCpuNs();
    g_step_ns[kStepContext].store((t_marked - t_nofloat) + (t_context - t_serialize));
    g_in_flight.fetch_add(1);
    const int rc = cb(&sink, graph_bytes.data(), graph_bytes.size(), config_bytes_.data(),
                      config_bytes_.size(), fetch.c_str(), preserve.c_str(), devices.c_str(),
                      item.id.c_str());
    g_in_flight.fetch_sub(1);
    sink.JoinIndex();  // (a helper thread reads the item and graph_bytes)
    sink.DropEarlyMirror();  // (the same: an untaken mirror's load)
    sink.set_item(nullptr);
    sink.graph_bytes = std::string_view();
    sink.kept = npu_amp_tf::BaseIndex();  // (its views are of graph_bytes)
    sink.views.reset();                     // (the same)
    sink.prefused_views.reset();            // (the same, of the fused bytes: no index built)
    graph_bytes.Free();
    const int64_t t_callback = ThreadCpuNs();
    g_step_ns[kStepCallback].store(t_callback - t_context);

    if (rc == 1 || rc == 3) {
      sink.RestoreStolen();
      sink.RestorePrefused();
      if (rc == 1) Remember(fp_in);
      return errors::Aborted("NpuAmpOptimizer left graph '", item.id, "' unchanged");
    }
    if (rc != 0 || sink.has_error || !(sink.has_result || sink.has_patch)) {
      sink.RestoreStolen();
      sink.RestorePrefused();
      return errors::Internal("NpuAmpOptimizer failed on graph '", item.id, "': ",
                              sink.has_error ? sink.error
                                             : std::string("the Python bridge returned no graph"));
    }
    if (!sink.has_patch) sink.RestoreStolen();  // (the output comes from bytes)
    if (sink.has_patch) {
      std::string why;
      // (the patch the OpDef pre-check parsed, when it is the one written)
      const bool checked = sink.has_checked && sink.checked_order == sink.patch_order &&
                           sink.checked_bytes == sink.patch;
      if (!checked) sink.RestoreStolen();  // (AssemblePatch reads the item whole)
      // (issue 17r) the item's nodes the patch keeps are moved into the
      // output, not copied, when Python asked for it (bridge.MOVE_ITEM_NODES):
      // grappler's MetaOptimizer::RunOptimizer hands us its own working
      // item, and on success it only reads the item's node and edge counts
      // for its log line (the edges of the moved nodes then count as 0)
      // before replacing the item's graph with ours.
      GraphDef* movable =
          (sink.flags & kFlagMoveItemNodes) ? const_cast<GraphDef*>(&item.graph) : nullptr;
      if (!(checked ? AssembleParsedPatch(item.graph, sink.checked_full, sink.checked,
                                          optimized_graph, &why, movable)
                    : AssemblePatch(item.graph, sink.patch_order, sink.patch, optimized_graph,
                                    &why))) {
        sink.RestoreStolen();  // (a refusal comes before any node moved)
        sink.RestorePrefused();
        return errors::Internal("NpuAmpOptimizer: the Python bridge returned a patch that does "
                                "not fit graph '", item.id, "': ", why);
      }
      sink.CommitStolen();  // (moved on into the output with `checked`)
    } else if (!optimized_graph->ParseFromString(sink.result)) {
      sink.RestorePrefused();
      return errors::Internal("NpuAmpOptimizer: the Python bridge returned bytes that do not "
                              "parse as a GraphDef for graph '", item.id, "'");
    }
    sink.CommitPrefused();  // (grappler replaces the item's graph with ours)
    const int64_t t_assemble = ThreadCpuNs();
    g_step_ns[kStepAssemble].store(t_assemble - t_callback);
    // mark our output: grappler's next iteration hands it back
    if (auto* marker = MarkerNode(optimized_graph, preserve_list)) {
      (*marker->mutable_attr())[kDoneAttr].set_i(mark);
      // (no fingerprint needed: CarriesMark, checked first, recognises this
      // graph; serializing it again cost ~5-10 ms on a 6k-node graph)
    } else {
      std::string out_bytes;
      if (SerializeToStringDeterministic(*optimized_graph, &out_bytes)) {
        Remember(Fingerprint(out_bytes, context));
      }
    }
    const int64_t t_mark = ThreadCpuNs();
    g_step_ns[kStepMark].store(t_mark - t_assemble);
    g_step_ns[kStepTotal].store(t_mark - t_start);
    return OkStatus();
  }

 private:
  std::string name_ = "NpuAmpOptimizer";
  std::string config_bytes_;
};

REGISTER_GRAPH_OPTIMIZER_AS(NpuAmpOptimizer, "NpuAmpOptimizer");

}  // namespace grappler
}  // namespace tensorflow

// Register the same optimizer under a second name (tf_adapter's
// "NpuOptimizer"), at run time and only when no optimizer of that name is
// registered yet: Python calls it when Huawei's tf_adapter is absent, so a
// hand-written `custom_op.name = "NpuOptimizer"` entry runs the pipeline
// instead of being silently ignored.  Returns 0 when registered now, 1 when
// the name was already taken (by us earlier or by the real tf_adapter).
NPU_AMP_EXPORT int NpuAmpRegisterAlias(const char* name) {
  using tensorflow::grappler::CustomGraphOptimizerRegistry;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const std::string alias(name);
  for (const auto& n : CustomGraphOptimizerRegistry::GetRegisteredOptimizers()) {
    if (n == alias) return 1;
  }
  CustomGraphOptimizerRegistry::RegisterOptimizerOrDie(
      [alias]() { return new tensorflow::grappler::NpuAmpOptimizer(alias); }, alias);
  return 0;
}

namespace tensorflow {
namespace grappler {

}  // namespace grappler

// ---------------------------------------------------------------------------
// NpuAmpRaiseError: fails the step with `message` (see the header comment).
// ---------------------------------------------------------------------------
REGISTER_OP("NpuAmpRaiseError")
    .Attr("message: string")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext*) { return OkStatus(); })
    .Doc(R"doc(
Fails the step with InvalidArgument(message). Inserted by the npu_amp_tf
grappler bridge so that invalid parameters fail the first run loudly.
)doc");

class NpuAmpRaiseErrorOp : public OpKernel {
 public:
  explicit NpuAmpRaiseErrorOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }
  void Compute(OpKernelContext* ctx) override {
    ctx->SetStatus(errors::InvalidArgument(message_));
  }

 private:
  std::string message_;
};

REGISTER_KERNEL_BUILDER(Name("NpuAmpRaiseError").Device(DEVICE_CPU), NpuAmpRaiseErrorOp);
REGISTER_KERNEL_BUILDER(Name("NpuAmpRaiseError").Device(DEVICE_GPU), NpuAmpRaiseErrorOp);

}  // namespace tensorflow
