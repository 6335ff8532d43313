// The OpDef guard's pre-check in C++ (issue 17m): is a rewritten graph clean
// where the pipeline changed it?  See opdef_precheck.cc.
#ifndef NPU_AMP_TF_OPDEF_PRECHECK_H_
#define NPU_AMP_TF_OPDEF_PRECHECK_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "name_table.h"  // npu_amp_tf::NameTable
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/function.pb.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"

namespace npu_amp_tf {

// Answers of OpdefPrecheck.
constexpr int kPrecheckClean = 0;    // no problem at the changed nodes and their edges
constexpr int kPrecheckFlagged = 1;  // maybe a problem: the Python guard must look
constexpr int kPrecheckUnable = 2;   // cannot tell (bad input, a byte it cannot mirror)

// The output graph of a patch (graph_passes.graph.Graph.serialize_patch):
// node k is base.node(order[k]) when order[k] >= 0, else the next node of
// `patch`; changed[k] = 1 for the latter.  False when the patch does not fit.
bool PatchNodes(const tensorflow::GraphDef& base, const std::vector<int32_t>& order,
                const tensorflow::GraphDef& patch,
                std::vector<const tensorflow::NodeDef*>* nodes, std::vector<char>* changed);

// (issue 17) A patch's payload (graph_passes.graph.Graph.serialize_patch)
// may begin with a records field (kPatchRecordsField, length-delimited): the
// nodes a pass only re-typed or re-wired are sent as their edits, not as
// NodeDefs.  Their order entries are -2 - (their index in `base`); the
// records (little-endian int32s; a string is its int32 length, then its
// bytes) hold: the format (kPatchRecordsVersion); the distinct attr sets,
// each [(type attr name, serialized AttrValue)]; the groups, as G member
// counts, G set numbers, then every group's members (indices in `base`),
// each member given its set's attrs; then E input edits, as E indices in
// `base`, E input positions, and the E new inputs joined by '\x01'.  ParsePatch parses `data` into *patch with those nodes made
// (a copy of the base node, the edits applied) and put in their output
// places, so that *order (the order given, their entries now -1) and *patch
// are a patch without records: what PatchNodes, OpdefPrecheckIndexed and the
// bridge's AssembleParsedPatch read.  An edit naming a node that is no
// record node (created, removed, or sent whole) is skipped.  False (message
// in *why) when the bytes do not parse or do not fit `base`.
constexpr uint32_t kPatchRecordsField = 2047;
constexpr int32_t kPatchRecordsVersion = 2;
// (issue 17) A record node taken out of the base (ParsePatch with `steal`):
// its NodeDef's contents swapped out of base.node(base_index) into `node`
// (owned by *patch once ParsePatch returns true), the edits' old values
// logged in edit order, so that RestoreStolen puts the node back as it was.
struct StolenNode {
  int32_t base_index = -1;
  tensorflow::NodeDef* node = nullptr;
  // (an attr's old value; null: the attr was absent)
  std::vector<std::pair<std::string, std::unique_ptr<tensorflow::AttrValue>>> attrs;
  std::vector<std::pair<int, std::string>> inputs;  // (position, old input)
};
// `steal` (null, or &base made mutable: the bridge's item, whose nodes the
// assembly moves anyway): the record nodes are swapped out of it instead of
// copied (a NodeDef copy costs what its parse does), each logged in
// *stolen; the base then holds empty NodeDefs at those places until
// RestoreStolen, or until the patch's nodes are moved into the output.  On
// false nothing stays stolen.
bool ParsePatch(const tensorflow::GraphDef& base, const int32_t* order, size_t n,
                const char* data, size_t len, tensorflow::GraphDef* patch,
                std::vector<int32_t>* order_out, std::string* why,
                tensorflow::GraphDef* steal = nullptr, std::vector<StolenNode>* stolen = nullptr);
// The nodes of *stolen put back into *base with their edits undone, the
// last stolen first; *stolen emptied.  The NodeDefs they were moved to must
// still hold them (not moved on into an output).
void RestoreStolen(tensorflow::GraphDef* base, std::vector<StolenNode>* stolen);

// (issue 17) The checks of a graph of kPrecheckSplitNodes nodes or more run
// in two halves on two threads (the library's kept helper threads, worker.h):
// the same answer.  g_precheck_split_min: the node count from which they are
// split (0: never, the reference; NpuAmpSetPrecheckSplit).
constexpr int64_t kPrecheckSplitNodes = 2048;
extern std::atomic<int64_t> g_precheck_split_min;

// kPrecheckClean only when graph_passes.opdef_check.changed_problems(after,
// changed, default_device) is empty for the graph of `nodes` (library:
// `library`), the nodes with changed[k] != 0 as `changed`; see the comment
// at the top of opdef_precheck.cc.  `broken` lists the known-broken kernels
// (registry.BROKEN_KERNELS, registry.BROKEN_FUSED_OPS as this TF applies
// them): entries "op \x01 device type \x01 dtype \x01 fused op or empty"
// joined by '\n'.
int OpdefPrecheck(const std::vector<const tensorflow::NodeDef*>& nodes,
                  const std::vector<char>& changed, const tensorflow::FunctionDefLibrary& library,
                  std::string_view broken, std::string_view default_device);

// (issue 17u) The input graph's names and consumers as the bridge's C++ index
// (GraphIndexText) built them, kept for OpdefPrecheckIndexed: node ids are
// base node indices; the edges grouped by consumed name ("slot"), in the
// index's order; a slot of a name that is no node is in `dangling`.  Views
// point into the bytes / graph the index was built from.
struct BaseIndex {
  bool valid = false;
  NameTable names;                      // base node name -> id
  std::vector<int32_t> slot_of_node;    // per id: its slot, or -1 (nothing reads it)
  std::unordered_map<std::string_view, int32_t> dangling;  // consumed name, no node -> slot
  std::vector<int32_t> start;           // per slot: its edges [start[s], start[s+1])
  std::vector<int32_t> readers;         // per edge: the reader's id
  std::vector<int32_t> positions;       // per edge: the input position (-1: control)
};

// OpdefPrecheck of the graph PatchNodes(base, order, patch) gives, with the
// same answer, but looking names up in `index` (of `base`, built from the
// same graph: every input printable ASCII, names unique) and visiting only
// the unchanged nodes that read a changed node (from the index's consumers)
// instead of every node's inputs.
int OpdefPrecheckIndexed(const tensorflow::GraphDef& base, const BaseIndex& index,
                         const std::vector<int32_t>& order, const tensorflow::GraphDef& patch,
                         std::string_view broken, std::string_view default_device);

}  // namespace npu_amp_tf

// The pre-check offline (opdef_precheck.cc; also called by
// NpuAmpGraphOpdefPrecheckFlags in grappler_bridge.cc).
extern "C" __attribute__((visibility("default"))) int NpuAmpGraphOpdefPrecheck(
    const char* graph, size_t graph_len, const int32_t* order, size_t n, const char* patch,
    size_t patch_len, const char* broken, size_t broken_len, const char* device);

#endif  // NPU_AMP_TF_OPDEF_PRECHECK_H_
