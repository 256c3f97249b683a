"""A tiny random Llama for the vLLM end-to-end tests and examples (no hub access).

Two layers, small hidden size, a few hundred tokens of vocabulary, random weights drawn
with a fixed seed and saved as safetensors: greedy decoding on it is deterministic and its
outputs depend on every KV row (unlike ``load_format="dummy"``, whose constant weights make
every output loop).
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEED = 1234


def make_tiny_llama(directory: str | Path) -> Path:
    """Write the model (config.json + model.safetensors) into ``directory`` once; return it."""
    path = Path(directory)
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with torch.no_grad():
        for param in model.parameters():  # larger than the default init: sharper logits
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/aiokv-tiny-llama"))
