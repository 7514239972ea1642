"""The model families ftcore maps: what sets each apart from Llama, in one table.

`model.family` names a row. The flags turn on megatron-core's own switches (`add_qkv_bias`,
`qk_layernorm`) in models/llama.py; the planner counts the extra parameters (planner/params.py);
the HF mapping adds the extra tensors (hf/mappings.py); hf/config.py reads and writes the
architecture name and `model_type`. Everything else (SwiGLU, RMSNorm, RoPE, GQA, an explicit head
dim) is shared. `mla`: multi-head latent attention (DeepSeek-V3's; the model's `q_lora_rank` ...
`v_head_dim` fields say its shapes, docs/deepseek.md). A model may set `qkv_bias`/`qk_layernorm`
itself (GLM-4.5 reads both from config.json): `family(m)` is the row with those applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ftcore.errors import FtcoreError


@dataclass(frozen=True)
class Family:
    name: str  # model.family
    architecture: str  # HF config.json `architectures`
    model_type: str  # HF config.json `model_type`
    qkv_bias: bool = False  # q/k/v projections have biases (o_proj and the MLP none)
    qk_layernorm: bool = False  # RMSNorm over each q and k head (one [head_dim] weight each)
    mla: bool = False  # multi-head latent attention (q/kv down and up projections, their norms)
    # config.json keys export writes (besides the shapes) so transformers builds the same model
    export_keys: dict = field(default_factory=dict)

    @property
    def spec_flags(self) -> dict:
        """megatron's layer-spec switches (get_gpt_layer_*_spec): MLA's latent norms are its
        `qk_layernorm`."""
        return {"qk_layernorm": self.qk_layernorm or self.mla, "multi_latent_attention": self.mla}


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama",
               export_keys={"attention_bias": False, "mlp_bias": False}),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_layernorm=True,
               export_keys={"attention_bias": False}),
        Family("mistral", "MistralForCausalLM", "mistral"),
        # mixtures of experts (docs/moe.md): model.num_experts and the moe_* fields say the rest
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", qk_layernorm=True,
               export_keys={"attention_bias": False}),
        Family("mixtral", "MixtralForCausalLM", "mixtral"),
        # shared experts, sigmoid router with an expert bias (docs/deepseek.md); Kimi-K2 ships
        # DeepseekV3ForCausalLM's architecture with its own config values
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", mla=True),
        # GLM-4.5/4.6: q/k/v biases and q/k norms as config.json says (GLM-4.5-Air: no norms)
        Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", qkv_bias=True, qk_layernorm=True),
    )
}  # fmt: skip
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def family(m) -> Family:
    """The row of cfg.model (`model.family`, default llama)."""
    name = m.get("family", "llama") if hasattr(m, "get") else getattr(m, "family", "llama")
    try:
        row = FAMILIES[name or "llama"]
    except KeyError:
        raise FtcoreError(f"unknown model family {name!r}", field="model.family",
                          fix=f"use one of {', '.join(FAMILIES)}") from None  # fmt: skip
    get = m.get if hasattr(m, "get") else lambda k, d=None: getattr(m, k, d)
    own = {k: bool(get(k)) for k in ("qkv_bias", "qk_layernorm") if get(k) is not None}
    return replace(row, **own) if own else row
