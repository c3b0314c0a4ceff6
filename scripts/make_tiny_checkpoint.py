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
    ap.add_argument("--init", default="hf", choices=["hf", "stream"],
                    help="hf: transformers builds and initialises the model (the tests' and recipes' weights); stream: "
                         "each tensor drawn on its own, in parallel, written in shards, without building the model "
                         "(for real widths: a random Qwen3-8B; other weights than hf's for the same seed)")
    ap.add_argument("--device", default="cpu", help="with --init stream: where the tensors are drawn (cpu or cuda)")
    ap.add_argument("--max-shard-gb", type=float, default=4.0, help="with --init stream: the largest weight file")
    a = ap.parse_args()
    if a.init == "hf" and a.device != "cpu":
        ap.error("--device applies to --init stream only")
    path = make_tiny_checkpoint(a.out, arch=a.arch, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                                intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
                                num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, tie_word_embeddings=not a.untied,
                                max_position_embeddings=a.max_position_embeddings, dtype=a.dtype, seed=a.seed,
                                init=a.init, device=a.device, max_shard_bytes=int(a.max_shard_gb * (1 << 30)))
    print(path)


if __name__ == "__main__":
    main()
