"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3/Phi-4-mini, Gemma 2/3, and the
mixtures of experts Mixtral, Qwen3-MoE, OLMoE) over a paged KV cache. The families differ in features the
config names (model/loader/registry.py): q/k/v and o biases, Qwen3's RMSNorm over each head's q and k
(q_norm / k_norm, None where the family has none), Phi's partial rotary (config.rotary_dim) and LongRoPE
(layers/rotary.py), sliding-window attention in the layers config.layer_types marks, and Gemma's: GeGLU,
(1 + weight) RMSNorms around each sublayer as well as before it, embeddings scaled by sqrt(hidden_size),
soft-capped attention scores and logits, its own attention scale, and (Gemma 3) a second RoPE base for
the sliding layers. Phi-3's fused qkv_proj and gate_up_proj are split into q/k/v and gate/up at load
(model/loader/hf_config.py), so it is this model.
Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): a layer config.is_moe_layer names has a router and
experts (layers/moe.py) where the others have one MLP, each expert this file's MLP; OLMoE's q/k norms span
the whole projection (config.qk_norm_full) and it may clip q, k and v (config.clip_qkv).

The model sees one flat batch of new tokens from many sequences; it knows nothing of requests. K/V are
written to the paged cache at `slot_mapping` and read back through block tables (attention/paged.py).

This is the one definition of the model. Its fast operations are named ops (RMSNorm, rotary,
silu_and_mul, write_kv, paged_attention, the linears) whose backend the op table (ops.py) picks once for
this machine; nothing here asks which CPU it runs on. A fused multi-layer kernel (decode_stack.py) may run
the decoder layers instead of the loop below, when it implements every feature of this model.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged import paged_attention, write_kv
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import all_gather, all_reduce
from pagedllm.model import decode_stack
from pagedllm.model.layers.activation import act, act_and_mul
from pagedllm.model.layers.moe import SparseMoeBlock
from pagedllm.model.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, rotate


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    return GemmaRMSNorm if config.gemma_norms else RMSNorm


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        # Llama's and Qwen3's attention_bias covers o_proj too; Qwen2 has q/k/v bias only
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=config.o_proj_bias)
        # Qwen3: one RMSNorm over each head's q (and k), weight [head_dim] shared by every head, so
        # tensor parallelism keeps it whole on every rank. OLMoE (qk_norm_full): one over the whole q (and k)
        # projection, weight [heads * head_dim]
        norm = norm_class(config)
        self.qk_norm_full = config.qk_norm_full
        q_width, k_width = (self.head_dim, self.head_dim)
        if config.qk_norm_full:
            q_width, k_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_norm = norm(q_width, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(k_width, config.rms_norm_eps) if config.qk_norm else None
        self.clip_qkv = config.clip_qkv  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping  # Gemma 2
        self.sliding_window = config.sliding_window if config.is_sliding(layer_idx) else None
        self.qkv_proj: nn.Module | None = None  # q/k/v in one matmul, set by fuse.py for inference
        self.qkv_sizes = (self.num_heads * self.head_dim, *(2 * [self.num_kv_heads * self.head_dim]))

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_full:  # OLMoE: over every head's q (and k) at once, before they are cut into heads
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:  # rows of [T * heads, head_dim]: the 2-D kernel
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
        if self.k_norm is not None and not self.qk_norm_full:
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, k, *rope)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.softcap)
        # under tensor parallelism each rank holds some heads: the o rows' partial products add up here
        return all_reduce(self.o_proj(o.reshape(t, -1)))


class LlamaMLP(nn.Module):
    """The gated MLP; also each expert of a MoE block (layers/moe.py), there of moe_intermediate_size and
    without its own all-reduce (reduce_results=False): the block reduces the experts' sum once."""

    def __init__(
        self, config: ModelConfig, intermediate_size: int | None = None, reduce_results: bool = True
    ):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.reduce_results = reduce_results
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate/up in one matmul, set by fuse.py for inference
        self.hidden_act = config.hidden_act  # silu, or Gemma's tanh GELU (GeGLU)

    def forward(self, x):
        if self.gate_up_proj is not None:
            h = act_and_mul(self.gate_up_proj(x), self.hidden_act)
        else:
            h = act(self.gate_proj(x), self.hidden_act) * self.up_proj(x)
        out = self.down_proj(h)  # under tensor parallelism each rank's slice of the intermediate size adds up
        return all_reduce(out) if self.reduce_results else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = (
            layer_idx  # families differ per layer: sliding-window or global attention, MoE or dense
        )
        self.self_attn = LlamaAttention(config, layer_idx)
        # a MoE layer has a router and experts instead (layers/moe.py), each expert this MLP, narrower
        self.mlp = (
            SparseMoeBlock(config, lambda: LlamaMLP(config, config.moe_intermediate_size, False))
            if config.is_moe_layer(layer_idx)
            else LlamaMLP(config)
        )
        norm, d, eps = norm_class(config), config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(d, eps)
        self.post_attention_layernorm = norm(d, eps)
        # Gemma's sandwich: post_attention_layernorm norms the attention's output before the residual add,
        # and the MLP has a norm before it (what Llama's post_attention_layernorm is) and one after it
        self.pre_feedforward_layernorm = norm(d, eps) if config.gemma_norms else None
        self.post_feedforward_layernorm = norm(d, eps) if config.gemma_norms else None

    def forward(self, x, rope, kv_cache, meta):
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        if self.pre_feedforward_layernorm is not None:
            x, h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(attn), x)
            return x + self.post_feedforward_layernorm(self.mlp(h))
        x, h = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm in one pass
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # _weight: no random initialisation (the checkpoint fills it), and on the meta device no normal_,
        # whose first call imports torch._dynamo (~1.3 s of every load)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)


def rotary_embeddings(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The RoPE tables, and Gemma 3's second ones for its sliding layers (their own base, no scaling)."""
    rotary = RotaryEmbedding(
        config.rotary_width, config.max_position_embeddings, config.rope_theta, config.rope_scaling
    )
    if config.rope_local_theta is None:
        return rotary, None
    return rotary, RotaryEmbedding(
        config.rotary_width, config.max_position_embeddings, config.rope_local_theta
    )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # from_weights builds on the meta device and computes the tables for real afterwards; there, meta
        # arange's first call would import torch._dynamo (~1.3 s of every load) for tables it throws away
        on_meta = torch.empty(0).is_meta
        self.rotary, self.rotary_local = (None, None) if on_meta else rotary_embeddings(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the decoder layers as one C++ call for decode steps and fresh prefills (decode_stack.py), by fuse.py
        self.decode_stack = None
        self.tp_vocab_size: int | None = (
            None  # set by tensor_parallel.py: the lm_head holds a vocabulary slice
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        if self.decode_stack is not None and decode_stack.applies(meta, x, kv_caches):
            prefill = decode_stack.is_fresh_prefill(meta)
            x = self.decode_stack.forward(
                x, *rope, kv_caches, meta.block_tables, meta.seq_lens_tensor, meta.slot_mapping, prefill
            )
        else:
            local = self.rotary_local.cos_sin(positions, x.dtype) if self.rotary_local is not None else rope
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x = layer(x, local if layer.self_attn.sliding_window else rope, kv_cache, meta)
        return self.model.norm(x)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: what the token embedding gives decoder layer 0."""
        embed = self.model.embed_tokens
        return embed.weight.dtype if hasattr(embed, "weight") else embed.dtype  # QuantEmbedding: its own

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What enters decoder layer 0: the token embeddings (Gemma: times sqrt(hidden_size), rounded to
        the model's dtype first, as transformers does)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.gemma_norms:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits for the rows that sample only: the lm_head is the largest matmul of a decode step. In
        float32, or with upcast=False in the model's dtype (the sampler upcasts where it needs to)."""
        logits = self.lm_head(hidden)
        if self.tp_vocab_size is not None:  # every rank's vocabulary slice, in order
            logits = all_gather(logits)[..., : self.tp_vocab_size]
        cap = self.config.final_logit_softcapping  # Gemma 2
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if upcast else logits

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        modules: dict[str, nn.Module] | None = None,
    ) -> LlamaForCausalLM:
        """Build without random initialisation (seconds saved at start-up), then load the checkpoint.
        modules: layers built already (quantized linears, {module name: layer}) that take their places
        before anything is allocated, so the float layers they replace never exist."""
        with torch.device("meta"):
            model = cls(config)
        prebuilt = set()
        for name, module in (modules or {}).items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module)
            prebuilt.update(id(m) for m in module.modules())  # a QuantEmbedding's table too

        def empty(t: torch.Tensor) -> torch.Tensor:  # not to_empty: meta empty_like imports sympy (0.4 s)
            return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

        for m in model.modules():  # materialize the rest, one module's own tensors at a time
            if id(m) not in prebuilt:
                m._apply(empty, recurse=False)
        if config.tie_word_embeddings and "lm_head" not in (modules or {}):
            model.lm_head.weight = model.model.embed_tokens.weight  # to_empty gave each its own storage
        # non-persistent buffers are not in the checkpoint: compute them for real
        model.rotary, model.rotary_local = (
            r.to(device=device, dtype=dtype) if r is not None else None for r in rotary_embeddings(config)
        )
        built = {n for n, m in model.named_modules() if id(m) in prebuilt}  # their parameters came with them
        model.load_weights(
            weights,
            prebuilt={f"{n}.{p}" for n in built for p, _ in model.get_submodule(n).named_parameters()},
        )
        return model.eval()

    def load_weights(self, weights: dict[str, torch.Tensor], prebuilt: set[str] = frozenset()) -> None:
        """Copy the checkpoint's tensors in; `prebuilt`: parameters of modules built already (not loaded)."""
        params = dict(self.named_parameters())
        missing = set(params) - set(weights) - prebuilt
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
        with torch.no_grad():
            for name, tensor in weights.items():
                if name in params and not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                    if params[name].shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
