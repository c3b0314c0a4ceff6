#!/usr/bin/env python3
"""Many GPU checks in one device call: named steps, each with its own time limit, log and exit status.

    python3 scripts/gpu_session.py --out $OUT STEP [STEP ...]      # steps run in the order given
    python3 scripts/gpu_session.py --list

A device call is precious (30 minutes a session, a fresh machine after 30 s idle), so one call runs
many steps; a failing or hanging step is recorded and the next one runs. OUT/gpu_session.json gets, per step: the
command, rc, seconds, the last stdout line that parses as a JSON object (the project's scripts print their
report last) and the tail of the step's stdout+stderr (the device returns only a few files per call). Exit status: the
number of failed steps (0: all passed). Run it in the checkout's root with the project importable
(`../shared/gpu-vllm/README.md`: PYTHONPATH=/tmp/site:$PWD and `pip install -e .`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

TQ = "/tmp/tq"  # a tiny random Qwen3 checkpoint (head_dim 64) the parity steps share
_PARITY = f"vime parity --model {TQ} --num-prompts 32 --max-tokens 32"
# the shape smoke's toy width (hidden 64, head dim 16, vocab 211) and the parity run the update diagnoses share
_TOY = ("python3 scripts/make_tiny_checkpoint.py /tmp/toy --vocab-size 211 --hidden-size 64 --intermediate-size 96 "
        "--dtype bfloat16 > /dev/null")
_TOY_PARITY = "--dtype bfloat16 --num-prompts 64 --max-tokens 24 --max-num-seqs 64 --max-num-batched-tokens 512"

# the strict arm of the GPU loop against the native arm a previous call ran on this machine (loop_qwen3_native first)
_STRICT_VS_NATIVE = "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 20 --arms native,strict --reuse native"

# name -> (seconds, command); {out} is the output directory
STEPS: dict[str, tuple[int, str]] = {
    "trainer_check": (240, "python3 scripts/gpu_trainer_check.py float32 bfloat16 > {out}/h200_trainer_check.json"),
    "tp_update": (420, "torchrun --standalone --nproc_per_node=2 scripts/gpu_tp_parity.py --only grads,update --out {out}"),
    "tp_cp": (420, "torchrun --standalone --nproc_per_node=2 scripts/gpu_tp_parity.py --only cp --out {out}"),  # x2
    # the CUDA-only tests CI skips (the native arm's varlen flash attention among them)
    "gpu_tests": (300, "python3 -m pytest -q -p no:cacheprovider tests/test_gpu_reference.py tests/test_fa3.py tests/test_dispatch.py tests/test_triton_launch.py tests/test_gemm_gluon.py"),
    # the fast launch path (backends/triton/launch.py) runs Triton's own compiled kernel for every specialization tried
    "launch_tests": (240, "python3 -m pytest -q -p no:cacheprovider tests/test_triton_launch.py tests/test_gemm_gluon.py"),
    # context parallelism's GPU path (session 31, written on a CPU: the interpreter checked float32 only): the packed
    # pieces forward and the virtual-sequence backward on the Triton kernels, float32 and bfloat16 (one GPU)
    "cp_pieces": (120, "python3 scripts/check_cp_pieces.py float32 && python3 scripts/check_cp_pieces.py bfloat16"),
    # session 33: the attention prefill's variants (the query tile in registers, q.k^T before p.v) bit-checked against
    # the Triton kernel and timed, then interleaved rounds against SDPA; Nsight Compute's counters on the kernels that
    # cap issue 10's last ratios (attention prefill, the segmented o GEMM, each beside SDPA / cuBLAS)
    # (session 33 call 1 ran it with qreg,qk_first,qreg_qk_first,qreg_qk_first_s3,diag_no_softmax_qreg: all bit-equal,
    # none faster; session 34 call 1 with the persistent walk and 16-byte output stores: the stores kept)
    "attn_variants": (300, "python3 scripts/gpu_gluon_attn.py --out {out} --cases q8b_varlen_bits,q8b_8x4096,q06_8x4096,"
                           "q8b_4x1024 --variants production,qreg,qk_first,diag_no_softmax && "
                           "python3 scripts/gpu_gluon_attn.py --out {out} --ab 5 --ab-variants qreg,qk_first"),
    # session 41: production's %clock64 timeline (DIAG 4: where a chunk's cycles go; call 2 also ran PAIR's A/B rounds).
    # (session 41's attn_pair / attn_maxtree — PAIR, two chunks a turn, and the row max as a tree: bit-equal, none
    # faster — are at commit 97b00f4)
    "attn_trace": (120, "timeout 100 python3 scripts/gpu_gluon_attn.py --out {out} --trace"),
    # (session 41's attn_rit — chunk c's rescale moved into turn c + 1 beside its q.k^T: bit-equal, 0.955-0.995x —
    # is at commit d98ca3a)
    # o / down: the segmented 128 x 128 tile beside its unsegmented twin (sessions 34-35 also timed 5-7 stages and a
    # 128 x 64 tile here; they lost and left gpu_gluon_gemm's PLAN)
    # (sessions 36-40's three-consumer prefill steps — attn_three, attn_osm, attn_fold, attn_osm_diag, osm_k3_again,
    # osm_k3_fault, prefill3_osm_check — and the kernel they measured are at commit 6fcfcb8: every version bit-equal,
    # none faster than production; benchmarks/H200_NOTES.md)
    "gemm_stages": (240, "python3 scripts/gpu_gluon_gemm.py --out {out} --gemms o,down --seg-ms 1024,4096,16384"),
    "ncu_probe": (240, "ncu --clock-control none --profile-from-start off --set full -f -o /tmp/probe "
                       "python3 scripts/gpu_ncu_probe.py && ncu -i /tmp/probe.ncu-rep --page details > {out}/ncu_details.txt "
                       "&& ncu -i /tmp/probe.ncu-rep --page raw --csv > /tmp/raw.csv && gzip -c /tmp/raw.csv > {out}/ncu_raw.csv.gz "
                       "&& ls -la /tmp/probe.ncu-rep {out}"),
    "launch_bench": (240, "python3 scripts/bench_launch.py --out {out}"),
    "tiny_ckpt": (120, f"python3 scripts/make_tiny_checkpoint.py {TQ} --head-dim 64"),
    "parity_strict": (300, _PARITY),
    "parity_strict_bf16": (300, f"{_PARITY} --dtype bfloat16 --update-weights"),
    "parity_strict_megatron": (300, f"{_PARITY} --scorer megatron --update-weights"),
    "parity_strict_tp2": (300, f"{_PARITY} --tp 2 --cuda-graphs off"),
    # session 30: the strict engine's TP merges gather through vLLM's own communicator, which its CUDA graphs capture:
    # the experiment that would prove the strict decode graphs at TP=2 (two GPUs; strict_tp_graphs_experiment in the JSON)
    "parity_strict_tp2_graphs": (300, f"VIME_STRICT_TP_GRAPHS=1 {_PARITY} --tp 2 --cuda-graphs on"),
    "parity_native": (300, f"{_PARITY} --mode native"),
    # CUDA graphs: the strict engine's decode graphs (no compile) and stock vLLM compiled with graphs, each with a weight
    # update; 32 sequences at a time so decode batches of many sizes replay captured graphs
    "parity_strict_graphs": (300, f"vime parity --model {TQ} --num-prompts 64 --max-tokens 48 --max-num-seqs 32 "
                                  "--max-num-batched-tokens 256 --dtype bfloat16 --update-weights --cuda-graphs"),
    "parity_native_graphs": (300, f"vime parity --model {TQ} --num-prompts 64 --max-tokens 48 --max-num-seqs 32 "
                                  "--max-num-batched-tokens 256 --dtype bfloat16 --update-weights --cuda-graphs --mode native"),
    # the whole loop, strict then native arm (scripts/gpu_loop.py writes its JSON, metrics and curves to {out})
    "loop_qwen3": (520, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 20 --out {out}"),
    # the same in two device calls (each arm ~5 min with the model build and engine starts): native, then strict + report
    "loop_qwen3_native": (560, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 20 --arms native --out {out} "
                                 "trainer.profile_update=10"),
    "loop_qwen3_strict": (560, f"{_STRICT_VS_NATIVE} --out {{out}} trainer.profile_update=10"),
    # the cold first strict step with compile-ahead (after loop_qwen3_native + loop_qwen3_strict on this machine: the
    # strict run wrote its trainer's and engine's kernel manifests): the manifests kept aside, Triton's cache emptied,
    # the strict arm again with trainer.kernel_manifest pointing at them (the engine reads <stem>_vllm-0.json beside it);
    # first_step_compile_seconds and compile_ahead (trainer provenance, rlkernel_info) against the cold run's
    "loop_qwen3_strict_ahead": (560, "rm -rf /tmp/km && mkdir -p /tmp/km && cp /tmp/vime_gpu_runs/grpo_qwen3_gpu_strict/"
                                     "triton_kernels*.json /tmp/km/ && ls -la /tmp/km && TRITON_CACHE_DIR=$(mktemp -d) "
                                     f"{_STRICT_VS_NATIVE} --tag h200_loop_grpo_qwen3_gpu_ahead --out {{out}} "
                                     "strict:trainer.kernel_manifest=/tmp/km/triton_kernels.json"),
    # re-record the recipe's kernel seed (after loop_qwen3_native on this machine): the strict arm without the shipped
    # seed, whose entries a seeded run would carry forward, stale ones too; then scripts/make_kernel_seed.py on the
    # <tag>_kernel_manifests.json it brings back (session 47)
    "loop_qwen3_strict_seed": (560, f"{_STRICT_VS_NATIVE} --tag h200_loop_grpo_qwen3_gpu_seed --out {{out}} "
                                    "strict:trainer.kernel_manifest_seed=null"),
    # the strict arm at rlkernel.row_segments=1 (a TP=1 run's plain row-parallel GEMMs; since session 48 the default
    # auto gives a TP=1 run 1, so this is loop_qwen3_strict again) against the native arm of a previous call on this
    # machine (loop_qwen3_native first)
    "loop_qwen3_strict_rs1": (560, f"{_STRICT_VS_NATIVE} --tag h200_loop_grpo_qwen3_gpu_rs1 --out {{out}} "
                                   "strict:rlkernel.row_segments=1 trainer.profile_update=10"),
    # the strict arm with 4 canonical segments pinned (rlkernel.row_segments=4: bits comparable with TP 2 and 4 runs; the
    # default before session 48) against the native arm of a previous call on this machine
    "loop_qwen3_strict_rs4": (560, f"{_STRICT_VS_NATIVE} --tag h200_loop_grpo_qwen3_gpu_rs4 --out {{out}} "
                                   "strict:rlkernel.row_segments=4 trainer.profile_update=10"),
    # the same with FA3 as the strict arm's attention (the opt-in contract): benchmarks/h200_loop_grpo_qwen3_gpu.json
    "loop_qwen3_strict_fa3": (560, f"{_STRICT_VS_NATIVE} --out {{out}} strict:rlkernel.ops.attention=fa3"),
    # both arms at once on two GPUs (x2), one arm per GPU: production native vs strict, and vs strict with FA3 attention
    "loop_qwen3_parallel": (580, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 20 --parallel --out {out}"),
    "loop_qwen3_fa3_parallel": (580, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 20 --parallel "
                                     "--tag h200_loop_grpo_qwen3_gpu_fa3 --out {out} strict:rlkernel.ops.attention=fa3"),
    # nvidia-h200-x2, staged: the loop with the trainer at TP=2 and one engine at rollout TP=2 on the same two GPUs, weights
    # synced by CUDA IPC handles (each worker opens those of the trainer rank on its GPU; session 32), both arms, 8 steps
    "loop_qwen3_tp2_handles": (590, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 8 --arms native,strict "
                                    "--tag h200x2_loop_tp2_handles --out {out} resources.gpus=2 trainer.tp=2 rollout.tp=2 "
                                    "rollout.weight_sync=handles"),
    # the loop's short form with the weights synced by CUDA IPC handles named explicitly (session 32's sync; `auto`
    # takes it on GPUs): the strict arm alone, 4 steps. Session 35 ran both arms at 5 steps in one call (staged, 545 s):
    # native finished in 305 s, strict reached 2 steps (mismatch 0, time_sync 0.10 s; 68 s of cold Triton compiles)
    "loop_qwen3_short": (590, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu --steps 4 --arms strict "
                              "--tag h200_loop_short_handles --out {out} rollout.weight_sync=handles"),
    # rollout tokens/s at the Qwen3-0.6B shape (random weights, bf16), 256 prompts x 128 tokens: strict (eager) vs stock
    # vLLM eager and with CUDA graphs
    # issue 15 on eight H200s (nvidia-h200-x8, staged): a random Qwen3-8B drawn on the GPU (make_tiny_checkpoint --init
    # stream, 4 GiB shards) and the synthetic dapo-layout set; then the native arm, then the strict arm beside it in
    # a second call on the same warm machine (--reuse native). Responses capped at 512 tokens: a random 8B model seldom
    # samples EOS, so every response would run to the recipe's 7,168 (say so with the figures)
    "qwen3_8b_ckpt": (420, "python3 scripts/make_tiny_checkpoint.py /models/Qwen3-8B --vocab-size 151936 --hidden-size 4096 "
                           "--intermediate-size 12288 --num-layers 36 --num-heads 32 --num-kv-heads 8 --head-dim 128 "
                           "--max-position-embeddings 40960 --dtype bfloat16 --untied --init stream --device cuda && "
                           "python3 scripts/make_dataset.py /data/dapo-math-17k.parquet --task addition --n 17000"),
    "loop_qwen3_8b_native": (590, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_8b --steps 20 --arms native "
                                  "--out {out} rollout.max_tokens=512 rollout.max_model_len=2560"),
    "loop_qwen3_8b_strict": (590, "python3 scripts/gpu_loop.py --config-name grpo_qwen3_8b --steps 20 --arms native,strict "
                                  "--reuse native --out {out} rollout.max_tokens=512 rollout.max_model_len=2560"),
    "qwen06_ckpt": (180, "python3 scripts/make_tiny_checkpoint.py /tmp/q06 --vocab-size 151936 --hidden-size 1024 --intermediate-size 3072 "
                         "--num-layers 28 --num-heads 16 --num-kv-heads 8 --head-dim 128"),
    "rollout_bench": (540, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                           "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeat 2 --rounds 1 "
                           "--engines stock_graphs,stock,strict --out {out}/h200_rollout_bench.json"),
    "rollout_bench_graphs": (560, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                                  "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeat 2 --rounds 3 "
                                  "--engines stock_graphs,strict_graphs --out {out}/h200_rollout_bench_graphs_2engines.json"),
    # the same with the strict engine's FA3 attention contract as a third engine (the loop's fastest strict arm)
    "rollout_bench_fa3": (590, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                               "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeat 2 --rounds 2 "
                               "--engines stock_graphs,strict_graphs,strict_fa3_graphs --profile 25 --out {out}/h200_rollout_bench_graphs.json"),
    # what the rollout gap is made of (issue 11): stock and strict on V2 (both engines' default on CUDA since session 24)
    # and each forced onto V1, one round each, runner and host time by function (cProfile) per engine
    "rollout_diag": (590, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                          "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --repeat 2 --rounds 1 --cprofile 30 "
                          "--keep-going --engines stock_graphs,stock_graphs_v1,strict_graphs,strict_graphs_v1 "
                          "--out {out}/h200_rollout_diag.json"),
    # the rollout ratio without the engine-start lottery: stock and strict alive at once (0.4 of the GPU each), their
    # generates interleaved for 10 rounds, order flipped each round; the median of the per-round ratios
    "rollout_paired": (560, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                            "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --rounds 20 --paired "
                            "--engines stock_graphs,strict_graphs --out {out}/h200_rollout_paired.json"),
    # session 20: at the 0.6B shape both engines are host-bound (one core busy the whole generate, the GPU 22-54 %
    # busy), so the paired ratio there measures two host loops; the same pairing at the Qwen3-1.7B width (28 layers)
    "q17_ckpt": (180, "python3 scripts/make_tiny_checkpoint.py /tmp/q17 --vocab-size 151936 --hidden-size 2048 "
                      "--intermediate-size 6144 --num-layers 28 --num-heads 16 --num-kv-heads 8 --head-dim 128"),
    "rollout_paired_q17": (560, "python3 scripts/bench_rollout.py --model /tmp/q17 --dtype bfloat16 --num-prompts 256 "
                                "--prompt-len 64 --max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --rounds 10 "
                                "--paired --engines stock_graphs,strict_graphs --out {out}/h200_rollout_paired_q17.json"),
    # the same pairing with the strict engine on V1 (raw_logits; its runner until session 24): what V2 is worth
    "rollout_paired_v1": (560, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                               "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --rounds 10 --paired "
                               "--engines strict_graphs_v1,strict_graphs --out {out}/h200_rollout_paired_v1.json"),
    "rollout_paired_rs1": (560, "python3 scripts/bench_rollout.py --model /tmp/q06 --dtype bfloat16 --num-prompts 256 --prompt-len 64 "
                                "--max-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --rounds 20 --paired "
                                "--engines stock_graphs,strict_graphs_rs1 --out {out}/h200_rollout_paired_rs1.json"),
    # the strict path on four other model shapes (toy, SmolLM2-135M, Qwen3-1.7B, Llama-1B widths; 2 layers each): every
    # kernel launches, vLLM == trainer before/after an update, two strict updates (scripts/gpu_shape_smoke.py)
    "shape_smoke": (590, "python3 scripts/gpu_shape_smoke.py --out {out}"),
    # the same in two calls (session 17: the four shapes with the updates in a child process ran past 590 s)
    "shape_smoke_a": (590, "python3 scripts/gpu_shape_smoke.py --shapes toy,smollm2_135m --out {out}/smoke_a"),
    "shape_smoke_b": (590, "python3 scripts/gpu_shape_smoke.py --shapes qwen3_1p7b,llama_1b --out {out}/smoke_b"),
    # session 16: after `--update-weights` the engine and Megatron differed on the toy shape (12 of 951 tokens eager, 794
    # with CUDA graphs) where the 0.6B loop holds 0: which side holds other weights (--check-weights), with and
    # without graphs, against Megatron and against rlkernel's reference scorer
    "update_diag": (560, _TOY + " && " + "; ".join(  # each parity runs
        [f"vime parity --model /tmp/toy {_TOY_PARITY} --update-weights --check-weights --restart-check --scorer {sc} "
         f"--cuda-graphs {g} > {{out}}/update_diag_{sc}_{g}.json"
         for sc, g in (("megatron", "off"), ("megatron", "on"), ("reference", "on"))])),
    # session 17: update_diag found the engine exact after an update (its weights as sent, a fresh engine from the v1
    # weights gives its logprobs) and Megatron 12 of 961 off where the reference scorer is 0; with graphs the engine's
    # replays read a RoPE table the in-process Megatron grew (fixed: rope_table keeps replaced tables). Here: every
    # checked fusion on many inputs; the v1 weights saved and re-run as a fresh model (both sides from them: is the
    # 12 the weights or the update's history?); `vime diagnose` on them (fusions off under its taps; Megatron on the
    # GPU); and the graphs run again after the RoPE fix
    "update_diag2": (590, "python3 scripts/gpu_fusion_check.py --out {out}; " + _TOY + " && " + "; ".join(
        [f"vime parity --model /tmp/toy {_TOY_PARITY} --update-weights --check-weights --restart-check --scorer megatron "
         f"--cuda-graphs on --save-updated /tmp/toy1 > {{out}}/update_diag_megatron_on.json",
         *(f"vime parity --model /tmp/toy1 {_TOY_PARITY} --scorer {sc} --cuda-graphs off > {{out}}/parity_toy1_{sc}_off.json"
           for sc in ("megatron", "reference")),
         "vime diagnose --model /tmp/toy1 --dtype bfloat16 --num-prompts 32 --max-tokens 24 --out {out}/diag_toy1 "
         "> {out}/diagnose_toy1.txt 2>&1"])),
    # session 17's finding after update_diag2: with both sides started from the same weights the engine differs from
    # Megatron AND from rlkernel's reference scorer (toy at the saved v1 weights 10 of 934; SmolLM2-135M width 29 of
    # 989 at v0, no update at all; Qwen3-1.7B width 0): a call-pattern dependence of some op at some weights on the GPU.
    # `vime diagnose` (both real engines, every op's rows compared, Megatron on the GPU) names the first op, on the
    # shape smoke's SmolLM2-width checkpoint and on the toy's v1 weights
    "diag_gpu": (590, "python3 scripts/gpu_shape_smoke.py --shapes smollm2_135m --checkpoints-to /tmp/ck > /dev/null && "
                      "vime diagnose --model /tmp/ck/smollm2_135m --dtype bfloat16 --num-prompts 32 --max-tokens 24 "
                      "--out {out}/diag_smol > {out}/diagnose_smol.txt 2>&1; " + _TOY + " && "
                      f"vime parity --model /tmp/toy {_TOY_PARITY} --update-weights --scorer megatron --cuda-graphs off "
                      "--save-updated /tmp/toy1 > {out}/parity_toy_save.json && vime diagnose --model /tmp/toy1 "
                      "--dtype bfloat16 --num-prompts 32 --max-tokens 24 --out {out}/diag_toy1 > {out}/diagnose_toy1.txt 2>&1"),
    # every checked fusion on many inputs, and the strict linear's rows alone vs in batches of every tile class at K
    # tails (SmolLM2's K = 576 is no multiple of the table's block_k 256; the tile-independence proof ran at K % 256 == 0)
    "fusion_check": (300, "python3 scripts/gpu_fusion_check.py --out {out}"),
    # the same question without vLLM: rlkernel's own rollout-style paged decode (shifting batches, engine layout) vs
    # packed training-style scoring at the SmolLM2-135M, toy and Qwen3-1.7B widths (random weights, 2 layers): a
    # mismatch here is the kernels; none here and one in `diag_gpu` is the vLLM integration
    "parity_small_dims": (560, " && ".join(
        f"python3 scripts/gpu_strict_parity.py --only parity --dims {d} --layers 2 --seqs 256 --concurrency 64 "
        f"--gen-min 16 --gen-max 96 --out {{out}}" for d in ("smollm2_135m", "toy", "qwen3_1p7b"))),
    # session 18: parity_small_dims found the kernels at fault without vLLM (SmolLM2 width 4,769 of 14,155 tokens, and a
    # rerun of the rollout with other batches differs from the first in 1,860 of 3,763: the rollout itself depends on
    # its batches; toy 91; Qwen3-1.7B 0), and `vime diagnose` on the toy's v1 weights named 0.down_proj (inputs equal,
    # 5 of 818 rows). Which layout piece (fused q/k/v, gate/up, residual adds in the norms) and which op's rows differ
    "layouts_small": (580, " && ".join(
        f"python3 scripts/gpu_strict_parity.py --only layouts --dims {d} --layers 2 --seqs 128 --concurrency 64 "
        f"--gen-min 16 --gen-max 96 --out {{out}}" for d in ("smollm2_135m", "toy"))),
    # session 18's layouts_small named the row-parallel layers (o_proj, down_proj: rows differ on equal inputs) at the
    # SmolLM2 and toy widths, every layout alike: a K segment that is no multiple of block_k, under every tile, schedule
    # and M (with 5,000 rows: one plain GEMM per segment, the packed scorer's schedule)
    "gemm_tail": (300, "python3 scripts/gpu_fusion_check.py --only gemm_tail,gemm_rows --out {out}"),
    # its 8 rows saw nothing: every row of 5,000 against the packed scorer's schedule, at two row offsets
    "gemm_tail_rows": (300, "python3 scripts/gpu_fusion_check.py --only gemm_tail_rows --out {out}"),
    # the GEMM's tile configs vs cuBLAS at small and mid M, bit-checked, two timers (issue 10's M = 256 bar)
    "gemm_sweep": (560, "python3 scripts/gpu_gemm_sweep.py --ms 1,16,256,1024 --out {out}"),
    # the row-parallel layers' 4 canonical K segments in one launch: the contract's segments_config (the table's tile fitted
    # to the live accumulators, session 11; until then one 128x128 tile, the candidate 128x128x64_s4_w8) vs the others
    "gemm_segments": (500, "python3 scripts/gpu_gemm_sweep.py --segments 4 --ms 1,16,64,256,1024,2048 "
                           "--shapes o,down,q06_o,q06_down --candidates contract,64x32x128_s4_w4,64x32x256_s4_w4,"
                           "64x64x128_s4_w4,64x64x256_s3_w4,64x128x64_s6_w4,64x128x128_s4_w4,128x64x128_s4_w4,"
                           "128x128x64_s4_w8,128x128x128_s3_w8 --out {out}"),
    # the same segments under "fixup" (one launch, a tile's segments as separate programs, the last to finish merges
    # them): every candidate, and each row's contract tile under launches, registers and fixup (bit-compared)
    "gemm_fixup": (360, "python3 scripts/gpu_gemm_sweep.py --segments 4 --schedule fixup --ms 1,16,64,256,1024,4096 "
                        "--shapes o,down --name h200_gemm_sweep_segments4_fixup.json --out {out}"),
    # the fixup schedule's tile rule (contracts.gpu.fixup_config) against its candidates, 8B and 0.6B row-parallel shapes
    "gemm_fixup_rule": (300, "python3 scripts/gpu_gemm_sweep.py --segments 4 --schedule fixup --ms 64,128,256,512,1024 "
                             "--shapes o,down,q06_o,q06_down --candidates contract,64x32x256_s4_w4,64x128x128_s4_w4,"
                             "128x128x64_s4_w8,128x256x64_s3_w8_ptr --name h200_gemm_sweep_segments4_fixup_rule.json "
                             "--out {out}"),
    # the "scratch" schedule (registers' walk, one accumulator live, waiting subtrees in L2-resident fp32 slots: the table's
    # tile unfitted) at the row-parallel shapes from decode to training sizes, each row also under the other schedules
    "gemm_scratch": (420, "python3 scripts/gpu_gemm_sweep.py --segments 4 --schedule scratch --ms 64,128,256,512,1024,2048,4096 "
                          "--shapes o,down,q06_o,q06_down --candidates contract,128x256x64_s3_w8,128x128x64_s4_w8,"
                          "64x128x128_s4_w4,64x128x64_s6_w4,128x64x128_s4_w8 --name h200_gemm_sweep_segments4_scratch.json "
                          "--out {out}"),
    # does a K-split qkv / gate_up beat wave quantisation at M = 256 (qkv: 96 tiles of 128x128 on 132 SMs)? 2 and 4
    # segments under fixup against cuBLAS and the unsegmented contract (each row's "unsegmented")
    "gemm_qkv_k2": (300, " && ".join(
        f"python3 scripts/gpu_gemm_sweep.py --segments {s} --schedule fixup --ms 256,512,1024 --shapes qkv,gate_up "
        "--candidates contract,64x128x128_s4_w4,128x128x64_s4_w8,128x128x128_s3_w8,128x256x64_s3_w8,64x256x64_s4_w4 "
        f"--name h200_gemm_sweep_qkv_k{s}_fixup.json --out {{out}}" for s in (2, 4))),
    # clusters of two CTAs per tile (num_ctas=2; Hopper's shared loads) at the M where the table is short of 0.9x cuBLAS
    "gemm_clusters": (300, "python3 scripts/gpu_gemm_sweep.py --ms 256,512,1024 --shapes qkv,gate_up,o "
                           "--candidates contract,64x128x128_s4_w4,64x128x128_s4_w4_c2,128x128x64_s4_w8,128x128x64_s4_w8_c2,"
                           "128x256x64_s3_w8,128x256x64_s3_w8_c2,64x256x64_s4_w4,64x256x64_s4_w4_c2 --name h200_gemm_sweep_clusters.json "
                           "--out {out}"),
    # the contract's table (by N and M) against the runners-up, M from decode to training sizes
    "gemm_table": (400, "python3 scripts/gpu_gemm_sweep.py --ms 1,16,64,128,256,512,1024,2048,4096,16384 --shapes qkv,o,down,gate_up "
                        "--candidates contract,64x128x128_s4_w4,128x128x64_s4_w8,128x128x128_s3_w8,128x256x64_s3_w8,"
                        "64x256x64_s4_w4 --name h200_gemm_sweep_table.json --out {out}"),
    # two-accumulator tiles (96 or 192 columns: a wave of 132 SMs divides their tiles) against the table's and cuBLAS
    # where the table is short of 0.9x (qkv and gate_up at M = 128-1,024), bit-checked against the contract's tile
    "gemm_dual": (420, "python3 scripts/gpu_gemm_sweep.py --ms 128,256,512,1024 --shapes qkv,q06_gate_up,gate_up "
                       "--candidates contract,64x128x128_s4_w4,128x128x64_s4_w8,dual --name h200_gemm_sweep_dual.json "
                       "--out {out}"),
    # the GEMM against the number of 128 x 128 tiles at M = 256 / 512 (K = 4,096; N from 2,048 to 16,896; qkv is 6,144):
    # is qkv's M = 256 gap its idle SMs or a shared bandwidth? (session 24)
    "gemm_waves": (400, "python3 scripts/gpu_gemm_sweep.py --ms 256,512 --shapes k4096_n2048,k4096_n4096,qkv,k4096_n8192,"
                        "k4096_n8448,k4096_n12288,k4096_n16896 --candidates contract,128x128x64_s4_w8,64x128x128_s4_w4,"
                        "128x256x64_s3_w8 --name h200_gemm_waves.json --out {out}"),
    # the attention prefill's kernel feature by feature (TMA loads, load masks, alpha's where, the segment accumulator,
    # the tile), each variant bit-checked against production and timed against SDPA's backends (issue 10: 0.56-0.60x)
    "attn_sweep": (420, "python3 scripts/gpu_attn_sweep.py --out {out}"),
    # the production attention at candidate contract tiles (block_n, seg_keys): prefill, decode at batch 1-256, bits
    "attn_contracts": (420, "python3 scripts/gpu_attn_sweep.py --contracts --out {out}"),
    # session 26's experiment: a warp-specialised Gluon GEMM (producer warp of TMA loads, wgmma consumer; what Triton's
    # automatic pass does not emit on sm_90) against the strict GEMM's bits and cuBLAS's time at the 8B shapes
    "gluon_ws": (300, "python3 scripts/gpu_gluon_ws.py --out {out}"),
    # session 27's experiment: the strict attention prefill in Gluon (a producer warp of TMA loads, one or two consumer
    # warpgroups each running the contract's 64-row tile op for op), bit-checked against production, timed against it
    # and SDPA; a mbarrier deadlock would spin until this limit, so it is short
    # which kernel cuBLAS runs at each Qwen3-8B GEMM shape (tile, cluster, split-K or not) and each kernel's device time,
    # beside the strict GEMM's and the 4-segment row-parallel GEMM's (session 28)
    "cublas_probe": (180, "python3 scripts/gpu_cublas_probe.py --out {out}"),
    # session 28's experiment: Gluon tiles of 96 / 192 columns (two accumulators; cuBLAS's wave-balanced nvjet tiles at
    # M = 256) and the row-parallel 4-segment tree in a warp-specialised consumer, bits vs the strict GEMM, chain times
    "gluon_gemm": (420, "python3 scripts/gpu_gluon_gemm.py --out {out}"),
    "gluon_attn": (240, "python3 scripts/gpu_gluon_attn.py --out {out}"),
    # compile-ahead (rlkernel/backends/triton/precompile.py) on cold caches: record a strict workload's kernels, then
    # compile them ahead (16 worker processes; and threads only, session 25's first version) before the same workload
    # in fresh processes; then two processes as a TP group (precompile.start_group: rank 0 compiles, both preload); bits
    # hashed in each
    "precompile_check": (580, "python3 scripts/gpu_precompile_check.py --out {out}"),
    # the whole harness in one process on one card (every section from this code, no merge): golden bits, kernels,
    # the 1M-token parity, the native control, the ratios, and `targets` (issue 10's verdicts, session 48)
    "harness": (590, "python3 -m rlkernel.golden --check-gpu && python3 scripts/gpu_strict_parity.py --out {out}"),
    # session 49: the column-parallel rows at M = 256 (the library's tiles and their predecessors in 9 interleaved
    # rounds, bits checked), then why chained and one-at-a-time times differ (a sleep between calls, one weight, NVML
    # clock and power): on an H100 gate_up there runs at the 700 W cap
    "gemm_m256": (300, "python3 scripts/gpu_gluon_gemm.py --out {out}/m256 --gemms qkv,gate_up --ms 256 --rounds 9 "
                       "--device-us --plan 'qkv=64x192_s7,64x192_s6;gate_up=128x192_s5_p,128x192_s5' && "
                       "python3 scripts/gpu_chain_gap.py --out {out}/gap --tiles 64x192_s7,128x192_s5_p"),
    # the L2 prefetch of W (session 51: one cp.async.bulk.prefetch.tensor a round through W's own tensor map; session
    # 50's per-row requests lost ~2x) at the M = 256 / 1,024 column-parallel rows beside the library's tiles, then the
    # chain gap (wall-time gap: below and at the power cap)
    "gemm_prefetch": (300, "python3 scripts/gpu_gluon_gemm.py --out {out}/pf --gemms qkv,gate_up --ms 256,1024 --rounds 7 "
                           "--plan 'qkv=64x192_s7,64x192_s7_pf8,128x192_s5_p,128x192_s5_p_pf8;gate_up=128x192_s5_p,"
                           "128x192_s5_p_pf4,128x192_s5_p_pf8,128x192_s5_p_pf16,128x192_s5_p_pf32,256x192_s4_p,"
                           "256x192_s4_p_pf8' && python3 scripts/gpu_chain_gap.py --out {out}/gap --cases "
                           "gate_up:256,qkv:1024 --tiles 128x192_s5_p_pf4,128x192_s5_p_pf8,128x192_s5_p_pf16"),
    # after a change that keeps the bits (session 25: the packed prefill's K / V through TMA): the committed golden bits
    # checked, then issue 10's timing and train ratios, then the 1,000,000-token parity (hash 04f49fb5e81035b6 under
    # attention v2, session 42; 8f3204762ef5c300 under v1), merged into the harness JSON
    "strict_recheck": (590, "python3 -m rlkernel.golden --check-gpu && python3 scripts/gpu_strict_parity.py --only "
                            "timing,train,parity --merge benchmarks/h200_strict_parity.json --out {out}"),
    # the GEMM + SwiGLU epilogue (gemm.matmul_swiglu; off in the engine since session 12, contracts.gpu.SWIGLU_EPILOGUE) vs
    # the strict two launches and stock cuBLAS + silu_and_mul
    "gemm_swiglu": (300, "python3 scripts/gpu_gemm_sweep.py --swiglu --ms 1,16,64,256,512,1024,4096 --out {out}"),
    # FA3 with num_splits=1 (inside vLLM) vs rlkernel's Triton attention: speed and the bit properties a contract needs
    "fa3_compare": (300, "python3 scripts/gpu_fa3_compare.py --out {out}"),
    # the FA3 attention contract (rlkernel/backends/fa3.py): its probe, the golden bits recorded for this GPU and vLLM (the
    # file comes back in {out}: commit it as rlkernel/contracts/fa3_golden.json), then rollout == trainer with FA3 on both
    # sides (graphs, bf16, a weight update; the Megatron trainer as the scorer)
    "fa3_golden": (240, "python3 -m rlkernel.backends.fa3 --record && cp rlkernel/contracts/fa3_golden.json {out}/"),
    # the Triton kernels' golden bits on this GPU's architecture (rlkernel/golden.py): record every case, then check them
    # in a fresh process; the file comes back in {out}: commit it as rlkernel/contracts/gpu_golden.json (from then on the
    # backend checks the slice at its first use on that architecture)
    "gpu_golden": (300, "python3 -m rlkernel.golden --record-gpu && python3 -m rlkernel.golden --check-gpu && "
                        "cp rlkernel/contracts/gpu_golden.json {out}/"),
    "parity_fa3": (300, f"vime parity --model {TQ} --num-prompts 64 --max-tokens 48 --max-num-seqs 32 --max-num-batched-tokens 256 "
                        "--dtype bfloat16 --update-weights --cuda-graphs --attention fa3 --scorer megatron"),
    # issue 10's harness after the engine-layout fusions: the launch savers and fusions bit for bit (reduce), then the
    # 1,000,000-token parity with the rollout side in the engine layout, and the native control, merged into the JSON
    "strict_reduce_parity": (580, "python3 scripts/gpu_strict_parity.py --only reduce,parity,native "
                                  "--merge benchmarks/h200_strict_parity.json --out {out}"),
    # where the strict update's time goes at the loop's size (Qwen3-0.6B shape, 128 short samples), strict vs native
    "update_profile": (300, "python3 scripts/gpu_update_profile.py --top 40 --out {out}"),
    "loop_tiny": (400, "python3 scripts/gpu_loop.py --config-name grpo_tiny --steps 20 --out {out} --tag h200_loop_grpo_tiny resources.gpus=1"),
}


def last_json(text: str):
    """A child's result: its last stdout line that is a JSON object (an engine or Ray may log after it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_step(name: str, out: Path) -> dict:
    seconds, cmd = STEPS[name]
    cmd = cmd.format(out=shlex.quote(str(out)))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=seconds)
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
    took = round(time.perf_counter() - t0, 1)
    report = last_json(text)
    if report is None and ">" in cmd:  # the report went to a file
        target = Path(cmd.rsplit(">", 1)[1].strip().strip("'\""))
        if target.exists():
            report = last_json(target.read_text())
    tail = "\n".join(text.splitlines()[-3:])
    print(f"[{name}] rc={rc} {took}s {tail[-400:]}", flush=True)
    # the log's tail rides in the JSON: the device returns only a few files per call
    return {"step": name, "command": cmd, "rc": rc, "seconds": took, "report": report, "log_tail": text[-(3000 if rc == 0 else 12000):]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", nargs="*", help=f"of {', '.join(STEPS)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list or not args.steps:
        for k, (s, c) in STEPS.items():
            print(f"{k:24s} {s:4d}s  {c}")
        return 0
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {list(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vime.stamp import code_stamp

    stamp, results = code_stamp(), []
    for name in args.steps:
        results.append(run_step(name, out))
        (out / "gpu_session.json").write_text(json.dumps({"code": stamp, "steps": results}, indent=1))
    return sum(r["rc"] != 0 for r in results)


if __name__ == "__main__":
    sys.exit(main())
