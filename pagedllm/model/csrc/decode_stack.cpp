// Every decoder layer of a step in one C++ call, for models whose linears are quantized in the AMX layout
// (quantization/linear.py) or bf16 prepacked for oneDNN (model/layers/packed_linear.py) on the amx tier,
// or quantized in the AVX2 layout (quantization/avx2.py; float32 or bf16 activations) on every tier from
// avx2 up, on the steps that are all decodes, or one prompt's whole prefill.
//
// Why: a single-stream step of the default model served from its GGUF blocks spent ~13 ms in its 121
// matmuls and ~6 ms in everything else, most of it the Python and dispatch around ~12 small calls a
// layer. Here each layer is the same calls made from C++: the same functions the Python path binds
// (layer_ops.h, paged_decode.h, woq_gemv.h, woq_amx.h, woq_avx2.h) and the same ATen / oneDNN ops, on the same
// tensors in the same order, so the result is the Python path's bit for bit, without its per-call cost.
// Decode steps of 1-8 sequences on AMX-layout linears go one step further (small_decode): raw pointers
// into buffers made once a step, no tensors per call.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "../../attention/csrc/paged_decode.h"
#include "../../lora/csrc/lora.h"
#include "../../quantization/csrc/woq_avx2.h"
#include "../layers/csrc/layer_ops.h"

// The amx tier's build (kernels.py builds this file for the process's tier from avx2 up): the AMX-layout
// linears and small_decode. Below it only the AVX2-layout and prepacked kinds exist.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLLM_STACK_AMX 1
#include "../../quantization/csrc/woq_amx.h"
#include "../../quantization/csrc/woq_gemv.h"
#endif
#if defined(PAGEDLLM_STACK_AMX) && defined(PAGEDLLM_DECODE_BF16)
#define PAGEDLLM_STACK_SMALL_DECODE 1
#endif

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

// The kinds of linear (the first of the four shape numbers of each, decode_stack.py's _linear_parts).
enum LinearKind : int64_t { kPacked = 0, kAmx = 1, kAvx2 = 2 };

// A step's LoRA rows (lora/manager.py sets them before the step): each row's adapter slot, -1 for the base
struct LoraStep {
  at::Tensor row_slots;
  int64_t rank = 0;
};

// One linear of a layer: quantized in the AMX layout (codes, scales, mins; a float32 bias or none), in the
// AVX2 layout (avx2.pack's codes, scales, mins; a float32 bias or none), or a bf16 weight prepacked for
// oneDNN (packed; a bf16 bias or none).
struct Linear {
  at::Tensor codes, scales, mins, bias, packed;
  int64_t kind, bits, group_size, out_features;
  // the LoRA adapters' stacked weights of the LoRALinear around this linear (lora/layers.py; attach_lora),
  // and its slices' output widths; undefined where no adapters are served
  at::Tensor lora_a, lora_b;
  std::vector<int64_t> lora_widths;

  // the kernel the Python layer picks: QuantLinear.path() (dot products for a few rows, AMX tiles above;
  // or the AVX2 int8-activation kernel), or PackedLinear's oneDNN call; then, in a step with adapter rows,
  // their products as LoRALinear adds them (the `lora` op's C++ backend)
  at::Tensor operator()(const at::Tensor& x, const LoraStep* lora) const {
    at::Tensor y = base(x);
    if (lora != nullptr && lora_a.defined()) lora::add_lora_(y, x.contiguous(), lora_a, lora_b, lora->row_slots, lora->rank, lora_widths);
    return y;
  }

  at::Tensor base(const at::Tensor& x) const {
    if (kind == kPacked) return packed_bf16_linear(x, packed, bias);
    if (kind == kAvx2)  // avx2.matmul: x contiguous, the bias as float32
      return woq_avx2::matmul_tensor(x.contiguous(), codes, scales, mins, bias, bits, group_size, out_features);
#ifdef PAGEDLLM_STACK_AMX
    return woq::linear_tensor(x, codes, scales, mins, bias, bits, group_size, out_features);
#else
    TORCH_CHECK(false, "decode_stack: an AMX-layout linear in a build without AMX");
    return {};
#endif
  }

#ifdef PAGEDLLM_STACK_SMALL_DECODE
  // The same as operator() for 1-8 rows of an AMX-layout linear (bits 4, 8), written into out [M, N]:
  // woq::gemv_tensor's kernel and split, without its tensors.
  void gemv_into(const at::BFloat16* x, int64_t M, int64_t K, at::BFloat16* out) const {
    woq::gemv_into(M, bits, x, K, codes, scales, mins, bias.defined() ? bias.data_ptr<float>() : nullptr,
                   group_size, out_features, out);
  }
#endif
};

// A layer's projection: one linear, or the linears whose outputs sit side by side in it (q, k, v of different
// GGUF types, e.g. Q4_K_M's Q4_K q / k and Q6_K v, cannot be one matmul; the model's layer loop then calls
// them one by one and concatenates, and so does this).
struct Projection {
  std::vector<Linear> parts;
  int64_t out_features = 0;

  at::Tensor operator()(const at::Tensor& x, const LoraStep* lora) const {
    if (parts.size() == 1) return parts[0](x, lora);
    std::vector<at::Tensor> outs;
    for (const Linear& lin : parts) outs.push_back(lin(x, lora));
    return at::cat(outs, 1);
  }

#ifdef PAGEDLLM_STACK_SMALL_DECODE
  void gemv_into(const at::BFloat16* x, int64_t M, int64_t K, at::BFloat16* out) const {
    parts[0].gemv_into(x, M, K, out);  // small_decode runs single-part projections only
  }
#endif
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  // Per layer: `shapes` starts with the number of linears of its qkv and of its gate_up projection (1, or
  // 3 and 2 where they are not merged), then holds (kind, bits, group_size, out_features) for each linear
  // in the order qkv's, o, gate_up's, down (LinearKind; bits and group_size 0 for a prepacked bf16 one);
  // `tensors` holds the input norm weight, the post-attention norm weight, then for each linear in that
  // order codes, scales, mins, bias (a prepacked bf16 linear: packed weight, two empty tensors, bias; an
  // empty tensor for no bias).
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> shapes, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    size_t t = 0, s = 0;
    auto linear = [&]() {
      TORCH_CHECK(t + 4 <= tensors.size() && s + 4 <= shapes.size(), "decode_stack: a linear is cut short");
      const at::Tensor* p = tensors.data() + t;
      const int64_t kind = shapes[s], bits = shapes[s + 1], group_size = shapes[s + 2], n = shapes[s + 3];
      t += 4;
      s += 4;
      if (kind == kPacked) return Linear{{}, {}, {}, p[3].numel() ? p[3] : at::Tensor(), p[0], kind, 0, 0, n};
#ifndef PAGEDLLM_STACK_AMX
      TORCH_CHECK(kind == kAvx2, "decode_stack: this build (below the amx tier) takes AVX2-layout linears only");
#endif
      TORCH_CHECK(kind == kAmx || kind == kAvx2, "decode_stack: unknown linear kind ", kind);
      const at::Tensor bias = p[3].numel() ? p[3].to(at::kFloat).contiguous() : at::Tensor();
      return Linear{p[0], p[1], p[2], bias, {}, kind, bits, group_size, n};
    };
    auto projection = [&](int64_t count) {
      TORCH_CHECK(count >= 1, "decode_stack: a projection needs at least one linear");
      Projection proj;
      for (int64_t i = 0; i < count; ++i) {
        proj.parts.push_back(linear());
        proj.out_features += proj.parts.back().out_features;
      }
      return proj;
    };
    while (t < tensors.size()) {
      TORCH_CHECK(t + 2 <= tensors.size() && s + 2 <= shapes.size(), "decode_stack: a layer is cut short");
      const int64_t qkv_parts = shapes[s], gate_up_parts = shapes[s + 1];
      const at::Tensor input_norm = tensors[t], post_norm = tensors[t + 1];
      t += 2;
      s += 2;
      Projection qkv = projection(qkv_parts), o = projection(1), gate_up = projection(gate_up_parts),
                 down = projection(1);
      layers_.push_back(Layer{input_norm, post_norm, std::move(qkv), std::move(o), std::move(gate_up),
                              std::move(down)});
    }
    TORCH_CHECK(s == shapes.size(), "decode_stack: tensors and shapes do not describe whole layers");
#ifdef PAGEDLLM_STACK_SMALL_DECODE
    // small_decode's kernels: every linear in the AMX layout, and bf16 attention tasks for these heads
    small_decode_layers_ = !layers_.empty() && paged::decode_tasks_bf16_for(head_dim, num_heads / num_kv_heads);
    for (const Layer& layer : layers_)
      for (const Projection* proj : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        small_decode_layers_ = small_decode_layers_ && proj->parts.size() == 1 && proj->parts[0].kind == kAmx;
#endif
  }

  // The LoRALinears' buffers (lora/manager.py), for each linear in the order of the constructor's: a and b_t
  // (the tensors the Python layer's C++ op reads, shared, so a slot written later is seen here), and in
  // `shapes` the number of its slices then their output widths.
  void attach_lora(std::vector<at::Tensor> tensors, std::vector<int64_t> shapes, int64_t rank) {
    size_t t = 0, s = 0;
    for (Layer& layer : layers_)
      for (Projection* proj : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        for (Linear& lin : proj->parts) {
          TORCH_CHECK(t + 2 <= tensors.size() && s < shapes.size() && s + 1 + shapes[s] <= shapes.size(),
                      "decode_stack: attach_lora's tensors and shapes are cut short");
          lin.lora_a = tensors[t];
          lin.lora_b = tensors[t + 1];
          lin.lora_widths.assign(shapes.begin() + s + 1, shapes.begin() + s + 1 + shapes[s]);
          t += 2;
          s += 1 + shapes[s];
        }
    TORCH_CHECK(t == tensors.size() && s == shapes.size(), "decode_stack: attach_lora got more than the linears");
    lora_.rank = rank;
  }

  // this step's rows' adapter slots ([T] int64, -1 for the base), or an empty tensor: no adapter row
  void set_lora_rows(at::Tensor row_slots) { lora_.row_slots = row_slots.numel() ? row_slots : at::Tensor(); }

  // x [T, hidden] bf16, or float32 (AVX2-layout linears) (the embeddings); cos / sin as rotary.cos_sin gives them; one cache per layer.
  // prefill: the T rows are one prompt with nothing cached before it (attention over the fresh K/V, as
  // attention/paged.py's _prefill_one); else T sequences decoding one token each (paged_decode).
  // Returns the hidden states after the last layer (before the final norm).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& slot_mapping, bool prefill) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "decode_stack: one KV cache per layer");
    const int64_t B = x.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    if (layers_.empty()) return x;
    const LoraStep* lora = lora_.row_slots.defined() ? &lora_ : nullptr;
    TORCH_CHECK(lora == nullptr || lora_.row_slots.numel() == B, "decode_stack: the LoRA rows are not this step's");
#ifdef PAGEDLLM_STACK_SMALL_DECODE
    if (!prefill && lora == nullptr && small_decode_applies(x, kv_caches, block_tables, seq_lens, slot_mapping))
      return small_decode(x, cos, sin, kv_caches, block_tables, seq_lens, slot_mapping);
#endif
    // h: the layer's normed input. Each layer's last residual add is fused into the next layer's input
    // norm (add_rms_norm rounds the sum to the dtype first, as x + mlp then rms_norm(x) does).
    at::Tensor h = layer_ops::rms_norm(x, layers_[0].input_norm, eps_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // attention: LlamaAttention.forward
      const at::Tensor qkv = layer.qkv(h, lora);
      const at::Tensor q = qkv.narrow(1, 0, H * D).view({B, H, D});
      const at::Tensor k = qkv.narrow(1, H * D, KVH * D).view({B, KVH, D});
      const at::Tensor v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({B, KVH, D});
      layer_ops::rotary_(qkv.narrow(1, 0, (H + KVH) * D).view({B, H + KVH, D}), cos, sin);  // q and k heads
      paged::write_kv(k, v, kv_caches[l], slot_mapping);
      const at::Tensor o = prefill ? prefill_attention(q, k, v)
                                   : paged::paged_decode(q, kv_caches[l], block_tables, seq_lens, scale_);
      const at::Tensor attn = layer.o(o.view({B, H * D}), lora);
      // residual + norm, then the MLP: LlamaDecoderLayer.forward, LlamaMLP.forward
      std::vector<at::Tensor> sum_h = layer_ops::add_rms_norm(attn, x, layer.post_attention_norm, eps_);
      const at::Tensor mlp = layer.down(layer_ops::silu_mul(layer.gate_up(sum_h[1], lora)), lora);
      if (l + 1 == layers_.size()) return sum_h[0] + mlp;
      sum_h = layer_ops::add_rms_norm(mlp, sum_h[0], layers_[l + 1].input_norm, eps_);
      x = sum_h[0];
      h = sum_h[1];
    }
    return x;
  }

 private:
  // A decode step of 1-8 sequences is bound by streaming the weights, and the ~25 tensors a layer's calls
  // make (views, outputs, checks) cost ~10 us a layer on top: a tenth of a single-stream step. Here the
  // same kernels run on raw pointers into buffers made once a step: woq::gemv with gemv_tensor's split,
  // layer_ops' row functions (silu_mul's rows included), paged_decode's bf16 tasks with its split, and
  // write_kv's copies. So the result is the general path's bit for bit (tests/test_decode_stack.py).
#ifdef PAGEDLLM_STACK_SMALL_DECODE
  bool small_decode_applies(const at::Tensor& x, const std::vector<at::Tensor>& kv_caches,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& slot_mapping) const {
    if (!small_decode_layers_ || x.size(0) > woq::kGemvMaxRows) return false;
    if (x.scalar_type() != at::kBFloat16 || !x.is_contiguous()) return false;
    for (const at::Tensor* t : {&block_tables, &seq_lens, &slot_mapping})
      if (t->scalar_type() != at::kLong || !t->is_contiguous()) return false;
    for (const at::Tensor& cache : kv_caches)
      if (cache.scalar_type() != at::kBFloat16 || !cache.is_contiguous()) return false;
    return true;
  }

  at::Tensor small_decode(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                          const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& slot_mapping) const {
    using bf16 = at::BFloat16;
    const int64_t B = x_in.size(0), d = x_in.size(1), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
    const int64_t W = (H + 2 * KVH) * D;  // the qkv projection's width
    const int64_t F = layers_[0].gate_up.out_features / 2;
    const float eps = float(eps_);
    const at::Tensor cos = cos_in.reshape({B, D}).contiguous(), sin = sin_in.reshape({B, D}).contiguous();
    // every buffer of the step: two residual streams taking turns, the normed input, and one per product
    auto buf = [&](int64_t width) { return at::empty({B, width}, x_in.options()); };
    at::Tensor x = x_in.clone(), x_next = buf(d), h = buf(d), qkv = buf(W), attn = buf(H * D),
               o = buf(d), gate_up = buf(2 * F), act = buf(F), mlp = buf(d);
    std::vector<float> scratch(std::max(d, 2 * F));
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    auto norm_rows = [&](const bf16* in, const at::Tensor& weight, bf16* out) {
      for (int64_t r = 0; r < B; ++r)
        layer_ops::rms_norm_row(in + r * d, weight.data_ptr<bf16>(), out + r * d, scratch.data(), d, eps);
    };
    // out = a + b, then h = norm(out), per row (add_rms_norm)
    auto add_norm_rows = [&](const bf16* a, const bf16* b, const at::Tensor& weight, bf16* out) {
      for (int64_t r = 0; r < B; ++r) {
        layer_ops::combine_row(a + r * d, b + r * d, out + r * d, d, std::plus<>());
        layer_ops::rms_norm_row(out + r * d, weight.data_ptr<bf16>(), h.data_ptr<bf16>() + r * d, scratch.data(), d,
                                eps);
      }
    };
    norm_rows(x.data_ptr<bf16>(), layers_[0].input_norm, h.data_ptr<bf16>());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      layer.qkv.gemv_into(h.data_ptr<bf16>(), B, d, qkv.data_ptr<bf16>());
      layer_ops::rotary_rows(qkv.data_ptr<bf16>(), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(), B, H + KVH, D, W, D);
      const at::Tensor& cache = kv_caches[l];
      const int64_t NB = cache.size(1), BS = cache.size(2);
      bf16* kc = cache.data_ptr<bf16>();
      bf16* vc = kc + NB * BS * KVH * D;
      const bf16* k = qkv.data_ptr<bf16>() + H * D;
      paged::write_kv_rows(k, k + KVH * D, W, W, D, D, kc, vc, slots, B, KVH, D, NB * BS);
      paged::decode_bf16(qkv.data_ptr<bf16>(), W, kc, vc, tables, block_tables.size(1), lens, B, H, KVH, D, BS,
                         float(scale_), attn.data_ptr<bf16>());
      layer.o.gemv_into(attn.data_ptr<bf16>(), B, H * D, o.data_ptr<bf16>());
      add_norm_rows(o.data_ptr<bf16>(), x.data_ptr<bf16>(), layer.post_attention_norm, x_next.data_ptr<bf16>());
      std::swap(x, x_next);
      layer.gate_up.gemv_into(h.data_ptr<bf16>(), B, d, gate_up.data_ptr<bf16>());
      for (int64_t r = 0; r < B; ++r)
        layer_ops::silu_mul_row(gate_up.data_ptr<bf16>() + r * 2 * F, gate_up.data_ptr<bf16>() + r * 2 * F + F,
                                act.data_ptr<bf16>() + r * F, F);
      layer.down.gemv_into(act.data_ptr<bf16>(), B, F, mlp.data_ptr<bf16>());
      if (l + 1 == layers_.size()) {
        for (int64_t r = 0; r < B; ++r)
          layer_ops::combine_row(mlp.data_ptr<bf16>() + r * d, x.data_ptr<bf16>() + r * d,
                                 x_next.data_ptr<bf16>() + r * d, d, std::plus<>());
        return x_next;
      }
      add_norm_rows(mlp.data_ptr<bf16>(), x.data_ptr<bf16>(), layers_[l + 1].input_norm, x_next.data_ptr<bf16>());
      std::swap(x, x_next);
    }
    return x;
  }
#endif

  // causal attention of one prompt over its own K/V [T, heads, D], in SDPA's [1, heads, T, D] layout
  at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    auto sdpa_layout = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
    const at::Tensor o = at::scaled_dot_product_attention(sdpa_layout(q), sdpa_layout(k), sdpa_layout(v), {}, 0.0,
                                                          /*is_causal=*/true, scale_, /*enable_gqa=*/true);
    return o.squeeze(0).transpose(0, 1).contiguous();
  }

  std::vector<Layer> layers_;
  LoraStep lora_;  // the step's adapter rows (set_lora_rows), the rank (attach_lora)
  bool small_decode_layers_ = false;  // whether small_decode can run these layers (set once, above)
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef PAGEDLLM_STACK_AMX
  m.attr("amx") = true;  // whether this build takes AMX-layout linears (the amx tier's)
#else
  m.attr("amx") = false;
#endif
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double,
                          double>())
      .def("forward", &DecodeStack::forward, "all decoder layers of a decode step, or of one prompt's prefill")
      .def("attach_lora", &DecodeStack::attach_lora, "the LoRALinears' stacked adapter weights, linear by linear")
      .def("set_lora_rows", &DecodeStack::set_lora_rows, "this step's rows' adapter slots (empty: none)");
}
