// The OpDef guard's pre-check in C++ (issue 17m): is a rewritten graph clean
// where the pipeline changed it?  See opdef_precheck.cc.
#ifndef NPU_AMP_TF_OPDEF_PRECHECK_H_
#define NPU_AMP_TF_OPDEF_PRECHECK_H_

#include <cstdint>
#include <string_view>
#include <vector>

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

}  // namespace npu_amp_tf

#endif  // NPU_AMP_TF_OPDEF_PRECHECK_H_
