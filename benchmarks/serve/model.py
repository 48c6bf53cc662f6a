"""Local Llama models for the serving benchmark and the vLLM stage: seeded random weights, a
word-level tokenizer, nothing downloaded (needs ``torch`` and ``transformers``, which vLLM
installs).

Weights are N(0, 0.2): vLLM's dummy weights are so small that attention is flat, and a
wrong KV block would then not change the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 1024  # tokens w0 .. w1023, one word each


@dataclass(frozen=True)
class ModelShape:
    """A Llama's shape; KV bytes per token are ``2 * layers * kv_heads * head_dim * 4`` (fp32)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


SHAPES = {
    "tiny": ModelShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2),  # the vLLM stage's
    # prefill dominates on a CPU: ~1.4 ms per prompt token on 2 cores, 16 KiB of KV per token
    "bench": ModelShape(layers=8, hidden=768, intermediate=2048, heads=12, kv_heads=4),
}


def make_model(
    directory: Path,
    shape: ModelShape = SHAPES["tiny"],
    seed: int = 0,
    max_len: int = 4096,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    architecture: str = "llama",
) -> Path:
    """Save a Llama of `shape` with N(0, 0.2) weights (fp32) and a word-level tokenizer
    (`make_tokenizer`) in `directory`; returns it. `layer_types`: each layer's attention,
    ``"full_attention"`` or ``"sliding_attention"`` over the last `sliding_window` tokens
    (vLLM reads both from the config: a hybrid model, in KV-cache groups by kind); None:
    every layer full attention. `architecture`: ``llama``; ``cohere2`` (Command-R7B's,
    whose sliding layers vLLM gives `sliding_window` + 1 tokens); ``gemma3`` (text only);
    ``mistral`` (every layer sliding: give `layer_types` all ``sliding_attention``);
    ``llama4`` (dense; its ``chunked_attention`` layers attend within chunks of
    `sliding_window` tokens). With `layer_types`, its length is the number of layers."""
    import torch
    import transformers

    tokens = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}  # some defaults are past this vocabulary
    architectures: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"head_dim": shape.head_dim}),
        "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM, tokens),
        "gemma3": (
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            {**tokens, "head_dim": shape.head_dim, "query_pre_attn_scalar": shape.head_dim},
        ),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"head_dim": shape.head_dim}),
        "llama4": (  # dense (no experts), each layer's attention local to chunks of `sliding_window` tokens
            transformers.Llama4TextConfig,
            transformers.Llama4ForCausalLM,
            {
                **tokens,
                "head_dim": shape.head_dim,
                "intermediate_size_mlp": shape.intermediate,
                "interleave_moe_layer_step": 0,
                "moe_layers": [],
                "attention_chunk_size": sliding_window,
            },
        ),
    }
    config_cls, model_cls, own = architectures[architecture]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=len(layer_types) if layer_types else shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_len,
        torch_dtype="float32",
        **own,
    )
    if layer_types is not None:
        config.layer_types, config.sliding_window = layer_types, sliding_window
    model = model_cls(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return make_tokenizer(directory)


def make_tokenizer(directory: Path) -> Path:
    """Save a word-level tokenizer (``w0`` .. ``w1023``, one token each) in `directory`, for
    vLLM's OpenAI server, which loads one; returns `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1").save_pretrained(directory)
    return directory
