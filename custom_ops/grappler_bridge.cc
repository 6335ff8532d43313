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
//          │ Python calls NpuAmpWriteResult(sink, bytes) or
//          │ NpuAmpWriteError(sink, message) before returning
//          ▼
//        parse the bytes back into `out`
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
//
// The NpuAmpRaiseError op exists so that errors the user must see (invalid
// parameters, a pass failure with fail_on_error=True) reach the user even
// though grappler and its callers swallow optimizer errors: the Python side
// returns a graph in which every root node waits on an NpuAmpRaiseError
// node, so the first Session.run / function call fails with the message.

#include <mutex>
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/grappler/clusters/cluster.h"
#include "tensorflow/core/grappler/grappler_item.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/lib/strings/proto_serialization.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/protobuf/rewriter_config.pb.h"

#define NPU_AMP_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
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

struct Sink {
  std::string result;
  std::string error;
  bool has_result = false;
  bool has_error = false;
};

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

NPU_AMP_EXPORT void NpuAmpWriteResult(void* sink, const char* data, size_t len) {
  auto* s = static_cast<Sink*>(sink);
  s->result.assign(data, len);
  s->has_result = true;
}

NPU_AMP_EXPORT void NpuAmpWriteError(void* sink, const char* msg, size_t len) {
  auto* s = static_cast<Sink*>(sink);
  s->error.assign(msg, len);
  s->has_error = true;
}

NPU_AMP_EXPORT int NpuAmpBridgeAbiVersion() { return kBridgeAbiVersion; }

// How many times grappler called NpuAmpOptimizer::Optimize in this process.
NPU_AMP_EXPORT uint64_t NpuAmpOptimizeCount() { return g_optimize_calls.load(); }

// Address of a static in this library: lets tests check that ctypes.CDLL and
// tf.load_op_library share one copy of the library's globals.
NPU_AMP_EXPORT const void* NpuAmpStateAddress() { return &g_callback; }

// Number of Optimize() calls currently inside the Python callback.
NPU_AMP_EXPORT int NpuAmpInFlight() { return g_in_flight.load(); }

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

    std::string graph_bytes;
    if (!SerializeToStringDeterministic(item.graph, &graph_bytes)) {
      return errors::Internal("NpuAmpOptimizer: cannot serialize the GraphDef of item '",
                              item.id, "'");
    }
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

    Sink sink;
    g_in_flight.fetch_add(1);
    const int rc = cb(&sink, graph_bytes.data(), graph_bytes.size(), config_bytes_.data(),
                      config_bytes_.size(), fetch.c_str(), preserve.c_str(), devices.c_str(),
                      item.id.c_str());
    g_in_flight.fetch_sub(1);
    graph_bytes.clear();
    graph_bytes.shrink_to_fit();

    if (rc == 1) {
      return errors::Aborted("NpuAmpOptimizer left graph '", item.id, "' unchanged");
    }
    if (rc != 0 || sink.has_error || !sink.has_result) {
      return errors::Internal("NpuAmpOptimizer failed on graph '", item.id, "': ",
                              sink.has_error ? sink.error
                                             : std::string("the Python bridge returned no graph"));
    }
    if (!optimized_graph->ParseFromString(sink.result)) {
      return errors::Internal("NpuAmpOptimizer: the Python bridge returned bytes that do not "
                              "parse as a GraphDef for graph '", item.id, "'");
    }
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
