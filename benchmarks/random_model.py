"""Save a random-weight model of a given architecture, for timing and memory runs where the real
weights are not at hand (the way ``vllm serve --load-format dummy`` benchmarks a model).

Costs (prefill, correction, anchors, memory) depend only on the architecture and the lengths, so a
run on such a model times what the real model would; its accuracy, gate decisions and KV errors
mean nothing. The folder gets the tokenizer of ``--tokenizer`` (default: the packaged SmolLM2), and
the vocabulary is resized to that tokenizer's so that every id it produces has an embedding.

    python benchmarks/random_model.py OUT_DIR [--preset smollm2-135m|llama-3.1-8b] [--config DIR]
        [--tokenizer DIR] [--dtype bfloat16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# Llama-3.1-8B-Instruct's published config.json (the paper's model), with its rope scaling.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (config.json, weights, tokenizer)")
    ap.add_argument("--preset", default="smollm2-135m", choices=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--config", default=None, help="a model folder whose config.json to use instead of --preset")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the packaged SmolLM2's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="where to draw the weights (cuda is faster for 8B)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvcmas_bench.modeling import default_model_dir

    tok_dir = args.tokenizer or str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if args.config:
        cfg = AutoConfig.from_pretrained(args.config)
    elif args.preset == "llama-3.1-8b":
        cfg = AutoConfig.for_model(**LLAMA_31_8B)
    else:
        cfg = AutoConfig.from_pretrained(tok_dir)
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)  # the architecture's own initializer
    out = Path(args.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    note = {"random_weights": True, "preset": args.config or args.preset, "seed": args.seed, "tokenizer": tok_dir}
    (out / "RANDOM_WEIGHTS.json").write_text(json.dumps(note, indent=1) + "\n")
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: random {cfg.model_type} with {n / 1e9:.2f}B parameters, {args.dtype}; accuracy from it means nothing"
    )


if __name__ == "__main__":
    main()
