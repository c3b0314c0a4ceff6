#!/usr/bin/env python3
"""Build a tiny HF-format Qwen3/Llama checkpoint + character tokenizer locally (no hub)."""
import argparse

from vime.tiny_model import make_tiny_checkpoint


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--intermediate-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-position-embeddings", type=int, default=2048,
                    help="the model's length limit (a recipe's rollout.max_model_len must fit: grpo_qwen3_8b needs 9216)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    path = make_tiny_checkpoint(a.out, arch=a.arch, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                                intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
                                num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, tie_word_embeddings=not a.untied,
                                max_position_embeddings=a.max_position_embeddings, dtype=a.dtype, seed=a.seed)
    print(path)


if __name__ == "__main__":
    main()
