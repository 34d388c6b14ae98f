// Every decoder layer of a step in one C++ call, for models whose linears are quantized in the AMX layout
// (quantization/linear.py) or bf16 prepacked for oneDNN (model/layers/packed_linear.py), on the steps
// that are all decodes, or one prompt's whole prefill.
//
// Why: a single-stream step of the default model served from its GGUF blocks spent ~13 ms in its 121
// matmuls and ~6 ms in everything else, most of it the Python and dispatch around ~12 small calls a
// layer. Here each layer is the same calls made from C++: the same functions the Python path binds
// (layer_ops.h, paged_decode.h, woq_gemv.h, woq_amx.h) and the same ATen / oneDNN ops, on the same
// tensors in the same order, so the result is the Python path's bit for bit, without its per-call cost.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "../../attention/csrc/paged_decode.h"
#include "../../quantization/csrc/woq_amx.h"
#include "../../quantization/csrc/woq_gemv.h"
#include "../layers/csrc/layer_ops.h"

#include <vector>

namespace {

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): what model/layers/packed_linear.py
// calls for a bf16 weight oneDNN reordered once. Called boxed: its schema's C++ types vary across torch
// releases, its values do not.
at::Tensor packed_bf16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), std::string("")};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// One linear of a layer: quantized in the AMX layout (codes, scales, mins; a float32 bias or none), with
// bits == 16 bf16 weights in the same tile order (codes; scales and mins empty), or, with bits == 0, a
// bf16 weight prepacked for oneDNN (packed; a bf16 bias or none).
struct Linear {
  at::Tensor codes, scales, mins, bias, packed;
  int64_t bits, group_size, out_features;

  // the kernel the Python layer picks: QuantLinear.path() and PackedLinear in the tile order (dot
  // products for a few rows, AMX tiles above), or PackedLinear's oneDNN call
  at::Tensor operator()(const at::Tensor& x) const {
    if (bits == 0) return packed_bf16_linear(x, packed, bias);
    return woq::linear_tensor(x, codes, scales, mins, bias, bits, group_size, out_features);
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  // Per layer, in this order: input norm weight, post-attention norm weight, then for qkv, o, gate_up,
  // down: codes, scales, mins, bias (a prepacked bf16 linear: packed weight, two empty tensors, bias; an
  // empty tensor for no bias); `shapes` holds (bits, group_size, out_features) for each of the four
  // linears of each layer, bits 0 for a prepacked bf16 one.
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> shapes, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    constexpr size_t kTensors = 2 + 4 * 4, kShapes = 4 * 3;
    TORCH_CHECK(tensors.size() % kTensors == 0 && shapes.size() == tensors.size() / kTensors * kShapes,
                "decode_stack: tensors and shapes do not describe whole layers");
    for (size_t l = 0; l < tensors.size() / kTensors; ++l) {
      const at::Tensor* t = tensors.data() + l * kTensors;
      const int64_t* s = shapes.data() + l * kShapes;
      auto linear = [&](int i) {
        const at::Tensor* p = t + 2 + 4 * i;
        const int64_t bits = s[3 * i];
        if (bits == 0) return Linear{{}, {}, {}, p[3].numel() ? p[3] : at::Tensor(), p[0], 0, 0, s[3 * i + 2]};
        const at::Tensor bias = p[3].numel() ? p[3].to(at::kFloat).contiguous() : at::Tensor();
        return Linear{p[0], p[1], p[2], bias, {}, bits, s[3 * i + 1], s[3 * i + 2]};
      };
      layers_.push_back(Layer{t[0], t[1], linear(0), linear(1), linear(2), linear(3)});
    }
  }

  // x [T, hidden] bf16 (the embeddings); cos / sin as rotary.cos_sin gives them; one cache per layer.
  // prefill: the T rows are one prompt with nothing cached before it (attention over the fresh K/V, as
  // attention/paged.py's _prefill_one); else T sequences decoding one token each (paged_decode).
  // Returns the hidden states after the last layer (before the final norm).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& slot_mapping, bool prefill) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "decode_stack: one KV cache per layer");
    const int64_t B = x.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    if (layers_.empty()) return x;
    // h: the layer's normed input. Each layer's last residual add is fused into the next layer's input
    // norm (add_rms_norm rounds the sum to the dtype first, as x + mlp then rms_norm(x) does).
    at::Tensor h = layer_ops::rms_norm(x, layers_[0].input_norm, eps_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // attention: LlamaAttention.forward
      const at::Tensor qkv = layer.qkv(h);
      const at::Tensor q = qkv.narrow(1, 0, H * D).view({B, H, D});
      const at::Tensor k = qkv.narrow(1, H * D, KVH * D).view({B, KVH, D});
      const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({B, KVH, D});
      layer_ops::rotary_(qkv.narrow(1, 0, (H + KVH) * D).view({B, H + KVH, D}), cos, sin);  // q and k heads
      paged::write_kv(k, v, kv_caches[l], slot_mapping);
      const at::Tensor o = prefill ? prefill_attention(q, k, v)
                                   : paged::paged_decode(q, kv_caches[l], block_tables, seq_lens, scale_);
      const at::Tensor attn = layer.o(o.view({B, H * D}));
      // residual + norm, then the MLP: LlamaDecoderLayer.forward, LlamaMLP.forward
      std::vector<at::Tensor> sum_h = layer_ops::add_rms_norm(attn, x, layer.post_attention_norm, eps_);
      const at::Tensor mlp = layer.down(layer_ops::silu_mul(layer.gate_up(sum_h[1])));
      if (l + 1 == layers_.size()) return sum_h[0] + mlp;
      sum_h = layer_ops::add_rms_norm(mlp, sum_h[0], layers_[l + 1].input_norm, eps_);
      x = sum_h[0];
      h = sum_h[1];
    }
    return x;
  }

 private:
  // causal attention of one prompt over its own K/V [T, heads, D], in SDPA's [1, heads, T, D] layout
  at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    auto sdpa_layout = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
    const at::Tensor o = at::scaled_dot_product_attention(sdpa_layout(q), sdpa_layout(k), sdpa_layout(v), {}, 0.0,
                                                          /*is_causal=*/true, scale_, /*enable_gqa=*/true);
    return o.squeeze(0).transpose(0, 1).contiguous();
  }

  std::vector<Layer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double,
                          double>())
      .def("forward", &DecodeStack::forward, "all decoder layers of a decode step, or of one prompt's prefill");
}
