"""Model configuration: the fields of a Hugging Face `config.json` the engine uses.

One config class covers both families: Llama-style decoders (Llama, Qwen2, Qwen3) and
DeepSeek-V2/V3-style decoders (MLA attention, MoE feed-forward). `from_hf_dict` reads the
config.json of either, in the old (`rope_theta` + `rope_scaling`) or new
(`rope_parameters`) spelling; `to_hf_dict` writes one that transformers and vLLM load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class ModelConfig:
    """A model's shape, as config.json gives it (Llama and DeepSeek families)."""

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # RoPE: rope_type in ROPE_TYPES plus that type's parameters (factor, ...).
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Llama family variants
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only; Llama attention_bias: on q/k/v/o
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # DeepSeek MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"  # V3: sigmoid + bias-corrected group top-k; V2: greedy
    scoring_func: str = "sigmoid"
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in LLAMA_TYPES + DEEPSEEK_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: "
                             f"{', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.is_mla and self.kv_lora_rank <= 0:
            raise ValueError("a DeepSeek config needs kv_lora_rank > 0")

    # ---- derived ----------------------------------------------------------------------
    @property
    def family(self) -> str:
        """The model family: "deepseek" or "llama"."""
        return "deepseek" if self.model_type in DEEPSEEK_TYPES else "llama"

    @property
    def is_mla(self) -> bool:
        """Whether the model uses multi-head latent attention (DeepSeek)."""
        return self.model_type in DEEPSEEK_TYPES

    @property
    def qk_head_dim(self) -> int:
        """MLA's query/key head width: its no-RoPE part plus its RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates per head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence token ids (none, one or several)."""
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a mixture of experts."""
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % max(self.moe_layer_freq, 1) == 0)

    # ---- config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of a Hugging Face config.json (a supported model type only)."""
        mt = d.get("model_type")
        if mt not in LLAMA_TYPES + DEEPSEEK_TYPES:
            raise ValueError(f"config.json model_type {mt!r} is not supported; supported: "
                             f"{', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json lacks {key!r}")
        if d.get("use_sliding_window") or (mt == "mistral" and d.get("sliding_window")):
            raise ValueError("sliding-window attention is not supported")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings",
                            d.get("original_max_position_embeddings",
                                  d.get("max_position_embeddings", 2048)))
        if rope["rope_type"] == "default":
            rope = {}
        attn_bias = bool(d.get("attention_bias", False))
        kw: dict[str, Any] = dict(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            hidden_act=d.get("hidden_act", "silu"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_theta=float(theta), rope_scaling=rope,
            qkv_bias=mt == "qwen2" or attn_bias, o_bias=attn_bias and mt != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=mt == "qwen3",
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        if mt in DEEPSEEK_TYPES:
            kw.update(
                num_key_value_heads=heads, head_dim=d["qk_rope_head_dim"],
                q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
                qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                v_head_dim=d["v_head_dim"],
                # DeepSeek-V2's checkpoints are interleaved too; transformers' V2 port
                # always de-interleaves, as does its V3 port unless told otherwise.
                rope_interleave=bool(d.get("rope_interleave", True)),
                n_routed_experts=d.get("n_routed_experts") or 0,
                n_shared_experts=d.get("n_shared_experts") or 0,
                num_experts_per_tok=d.get("num_experts_per_tok") or 0,
                moe_intermediate_size=d.get("moe_intermediate_size") or 0,
                first_k_dense_replace=d.get("first_k_dense_replace") or 0,
                moe_layer_freq=d.get("moe_layer_freq") or 1,
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
                topk_method=d.get("topk_method") or ("noaux_tc" if mt == "deepseek_v3" else "greedy"),
                scoring_func=d.get("scoring_func") or ("sigmoid" if mt == "deepseek_v3" else "softmax"),
                qkv_bias=attn_bias, o_bias=attn_bias, qk_norm=False,
            )
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json for this model (transformers 4.x/5.x and vLLM read it)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM"}[self.model_type]
        rope = dict(self.rope_scaling)
        d: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act, "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
            "attention_bias": self.o_bias if self.model_type != "qwen2" else False,
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.is_mla:
            del d["head_dim"]
            d.update(
                q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave,
                n_routed_experts=self.n_routed_experts, n_shared_experts=self.n_shared_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                first_k_dense_replace=self.first_k_dense_replace,
                moe_layer_freq=self.moe_layer_freq,
                routed_scaling_factor=self.routed_scaling_factor,
                norm_topk_prob=self.norm_topk_prob, n_group=self.n_group,
                topk_group=self.topk_group, topk_method=self.topk_method,
                scoring_func=self.scoring_func,
            )
        return d
