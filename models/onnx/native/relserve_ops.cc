// Native CPU kernels for two of the com.relserve custom ops (see relserve/models/onnx/ops.py for their contract):
// LogBucketRelativePosition and RelativePositionBias (T5). DisentangledAttentionBias has no kernel here: a
// session with this library registered runs that op's model-local portable function, as stock ORT does.
//
// Kept only where the op-level benchmark shows the kernel beating the portable function
// (`python -m relserve.loadtest.bench.onnx_ops`, DeBERTa-v3-base shapes, CPU fp32, 2 intra-op threads,
// native:portable time): LogBucketRelativePosition 0.08 at 8x128 / 0.06 at 8x512, RelativePositionBias 0.29 /
// 0.33. The DisentangledAttentionBias kernel (per-element dot products) measured 2.33 / 5.54, slower than the
// function's MatMul + GatherElements, and was removed.
//
// Built by `make onnx-native` (models/onnx/native/build.sh) against the ONNX Runtime C/C++ API headers of
// Debian's libonnxruntime-dev (API 21), which the 1.31 runtime accepts. Loaded with
// SessionOptions.register_custom_ops_library(path); the library calls RegisterCustomOps, adds its two ops
// to the "com.relserve" domain, and ORT then runs these kernels instead of inlining the model-local
// functions of those ops. float32 only (other types fall back to nothing: the graphs we export are float32).
//
// Float arithmetic of the bucket functions follows the torch code (float32, same operation order), so the
// bucket ids equal what torch computes.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

namespace {

int64_t ScalarInt(const Ort::ConstValue& v) { return v.GetTensorData<int64_t>()[0]; }

// ------------------------------------------------------------------------------------ LogBucketRelativePosition

int64_t LogBucket(int64_t rel, int64_t bucket_size, int64_t max_position, float log_base) {
  if (bucket_size <= 0 || max_position <= 0) return rel;
  const int64_t mid = bucket_size / 2;
  const bool near = rel < mid && rel > -mid;
  const int64_t abs_pos = near ? mid - 1 : (rel < 0 ? -rel : rel);
  if (abs_pos <= mid) return rel;
  const float log_ratio = std::log(static_cast<float>(abs_pos) / static_cast<float>(mid));
  const float log_pos = std::ceil(log_ratio / log_base * static_cast<float>(mid - 1)) + static_cast<float>(mid);
  const float sign = rel > 0 ? 1.f : (rel < 0 ? -1.f : 0.f);
  return static_cast<int64_t>(log_pos * sign);
}

struct LogBucketKernel {
  int64_t bucket_size, max_position;
  LogBucketKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    bucket_size = ki.GetAttribute<int64_t>("bucket_size");
    max_position = ki.GetAttribute<int64_t>("max_position");
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const int64_t q = ScalarInt(ctx.GetInput(0)), k = ScalarInt(ctx.GetInput(1));
    std::vector<int64_t> shape{q, k};
    int64_t* out = ctx.GetOutput(0, shape).GetTensorMutableData<int64_t>();
    const int64_t mid = bucket_size / 2;
    const float log_base =
        mid > 0 ? std::log(static_cast<float>(static_cast<double>(max_position - 1) / static_cast<double>(mid))) : 1.f;
    // δ = i - j only takes q + k - 1 values: bucket each once
    std::vector<int64_t> table(static_cast<size_t>(q + k > 0 ? q + k - 1 : 0));
    for (int64_t d = -(k - 1); d <= q - 1; ++d) table[d + k - 1] = LogBucket(d, bucket_size, max_position, log_base);
    for (int64_t i = 0; i < q; ++i)
      for (int64_t j = 0; j < k; ++j) out[i * k + j] = table[i - j + k - 1];
  }
};

struct LogBucketOp : Ort::CustomOpBase<LogBucketOp, LogBucketKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new LogBucketKernel(api, info); }
  const char* GetName() const { return "LogBucketRelativePosition"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

// ------------------------------------------------------------------------------------ RelativePositionBias (T5)

struct RpbKernel {
  int64_t max_distance, bidirectional;
  RpbKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    max_distance = ki.GetAttribute<int64_t>("max_distance");
    bidirectional = ki.GetAttribute<int64_t>("is_bidirectional");
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto table = ctx.GetInput(0);
    const int64_t q = ScalarInt(ctx.GetInput(1)), k = ScalarInt(ctx.GetInput(2));
    auto ts = table.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t nb_all = ts[0], heads = ts[1];
    const float* tab = table.GetTensorData<float>();
    std::vector<int64_t> shape{1, heads, q, k};
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const int64_t nb = bidirectional ? nb_all / 2 : nb_all;
    const int64_t max_exact = nb / 2;
    const float log_base = static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
    std::vector<int64_t> bucket(static_cast<size_t>(q + k > 0 ? q + k - 1 : 0));
    for (int64_t rel = -(q - 1); rel <= k - 1; ++rel) {  // memory - context
      int64_t base = 0, rp;
      if (bidirectional) {
        base = rel > 0 ? nb : 0;
        rp = rel < 0 ? -rel : rel;
      } else {
        rp = rel < 0 ? -rel : 0;
      }
      int64_t b;
      if (rp < max_exact) {
        b = rp;
      } else {
        const float v = std::log(static_cast<float>(rp) / static_cast<float>(max_exact)) / log_base *
                        static_cast<float>(nb - max_exact);
        b = std::min(max_exact + static_cast<int64_t>(v), nb - 1);
      }
      bucket[rel + q - 1] = base + b;
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < q; ++i)
        for (int64_t j = 0; j < k; ++j) out[(h * q + i) * k + j] = tab[bucket[j - i + q - 1] * heads + h];
  }
};

struct RpbOp : Ort::CustomOpBase<RpbOp, RpbKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new RpbKernel(api, info); }
  const char* GetName() const { return "RelativePositionBias"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static LogBucketOp log_bucket;
  static RpbOp rpb;
  static std::once_flag once;
  static Ort::CustomOpDomain* domain = nullptr;
  try {
    std::call_once(once, [] {
      domain = new Ort::CustomOpDomain("com.relserve");  // lives as long as the process: sessions keep pointers
      domain->Add(&log_bucket);
      domain->Add(&rpb);
    });
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}
