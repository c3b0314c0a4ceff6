"""Claims: every recipe composes and validates; the keys checks rely on override as documented;
bad values fail at load time with the key named; the 8-GPU recipe fails early on this machine
naming the missing GPUs and paths."""
import pytest

from vime.config import RECIPES, load_config
from vime.preflight import PreflightError, check_resources


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("*.yaml")))
def test_recipes_compose(name):
    cfg, plain = load_config(name)
    assert plain["run"]["name"] == name and cfg.trainer.total_steps >= 1


def test_documented_overrides():
    cfg, _ = load_config("grpo_tiny", ["run.output_dir=/tmp/x", "trainer.total_steps=3", "rlkernel.mode=native",
                                       "algorithm.use_rollout_logprobs=true", "rlkernel.ops.attention=strict", "rlkernel.ops.linear_logprob=native"])
    assert (cfg.run.output_dir, cfg.trainer.total_steps, cfg.rlkernel.mode, cfg.algorithm.use_rollout_logprobs) == ("/tmp/x", 3, "native", True)
    assert cfg.rlkernel.ops.as_dict() == {"attention": "strict", "linear_logprob": "native"}


@pytest.mark.parametrize("override,key", [("rlkernel.mode=fast", "rlkernel.mode"), ("rlkernel.ops.attention=fast", "rlkernel.ops.attention"),
                                          ("data.layout=alpaca", "data.layout"), ("run.executor=slurm", "run.executor"),
                                          ("rlkernel.row_segments=3", "rlkernel.row_segments"),
                                          ("rlkernel.row_segments=0", "rlkernel.row_segments"),
                                          ("trainer.profile_update=-1", "trainer.profile_update"),
                                          ("trainer.compile_workers=0", "trainer.compile_workers"),
                                          ("run.start_timeout_s=0", "run.start_timeout_s")])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        load_config("grpo_tiny", [override])


def test_kernel_manifest_is_the_run_directorys_on_gpu_runs_a_named_path_or_off():
    """trainer.kernel_manifest (compile-ahead of the Triton kernels): "auto" is run_dir/triton_kernels.json on a GPU run,
    a path is taken as given, null turns it off; CPU runs compile no Triton kernels and get none."""
    from vime.roles import _kernel_manifest

    gpu = ["resources.gpus=1", "run.output_dir=/tmp/run_a"]
    assert _kernel_manifest(load_config("grpo_qwen3_gpu", ["run.output_dir=/tmp/run_a"])[0]) == "/tmp/run_a/triton_kernels.json"
    assert _kernel_manifest(load_config("grpo_tiny", gpu)[0]) == "/tmp/run_a/triton_kernels.json"
    assert _kernel_manifest(load_config("grpo_tiny", gpu + ["trainer.kernel_manifest=/tmp/old/triton_kernels.json"])[0]) \
        == "/tmp/old/triton_kernels.json"
    assert _kernel_manifest(load_config("grpo_tiny", gpu + ["trainer.kernel_manifest=null"])[0]) is None
    assert _kernel_manifest(load_config("grpo_tiny", ["run.output_dir=/tmp/run_a"])[0]) is None  # CPU
    # a rollout engine's own file beside it (each process writes only its own)
    assert _kernel_manifest(load_config("grpo_tiny", gpu)[0], "vllm-1") == "/tmp/run_a/triton_kernels_vllm-1.json"
    assert _kernel_manifest(load_config("grpo_tiny", gpu + ["trainer.kernel_manifest=/tmp/old/k.json"])[0], "vllm-0") \
        == "/tmp/old/k_vllm-0.json"


def test_kernel_manifest_seed_is_the_recipes_file_on_gpu_runs_and_a_missing_one_stops_the_run(tmp_path):
    """trainer.kernel_manifest_seed: a relative path is the recipes directory's (the GPU recipe ships its seed), an
    absolute one is taken as given; CPU runs, runs without a manifest and runs of another mode than the seed's arm get
    none; a seed that is not there, or not a seed, is an error naming the key and the fix (the controller asks before
    any role starts)."""
    from vime.config import RECIPES
    from vime.roles import _kernel_manifest_seed

    cfg = load_config("grpo_qwen3_gpu", ["run.output_dir=/tmp/run_a"])[0]
    assert cfg.trainer.kernel_manifest_seed == "kernel_manifests/grpo_qwen3_gpu.json.gz"
    assert _kernel_manifest_seed(cfg) == str(RECIPES / "kernel_manifests" / "grpo_qwen3_gpu.json.gz")
    assert _kernel_manifest_seed(load_config("grpo_qwen3_gpu", ["resources.gpus=0"])[0]) is None
    assert _kernel_manifest_seed(load_config("grpo_qwen3_gpu", ["trainer.kernel_manifest=null"])[0]) is None
    assert _kernel_manifest_seed(load_config("grpo_qwen3_gpu", ["rlkernel.mode=native"])[0]) is None  # a strict seed
    assert _kernel_manifest_seed(load_config("grpo_tiny", ["resources.gpus=1"])[0]) is None  # no seed named
    from rlkernel.backends.triton.precompile import make_seed

    mine = tmp_path / "seed.json.gz"
    make_seed(mine, {"trainer": {"format": 1, "triton": "3.6.0", "entries": []}}, {"arm": "native"})
    native = ["resources.gpus=1", f"trainer.kernel_manifest_seed={mine}", "rlkernel.mode=native"]
    assert _kernel_manifest_seed(load_config("grpo_tiny", native)[0]) == str(mine)
    assert _kernel_manifest_seed(load_config("grpo_tiny", native[:2] + ["rlkernel.mode=strict"])[0]) is None
    mine.write_bytes(b"not a seed")
    with pytest.raises(ValueError, match="not a kernel manifest seed"):
        _kernel_manifest_seed(load_config("grpo_tiny", native)[0])
    bad = load_config("grpo_qwen3_gpu", ["trainer.kernel_manifest_seed=kernel_manifests/none.json.gz"])[0]
    with pytest.raises(FileNotFoundError, match=r"trainer\.kernel_manifest_seed=kernel_manifests/none\.json\.gz.*null"):
        _kernel_manifest_seed(bad)


def test_row_segments_reach_both_engines_and_bound_the_tp_size():
    """rlkernel.row_segments is one key for both engines (the roles pass it to the vLLM plugin and to the trainer); a TP
    size that does not divide it is refused at load, naming the key and the fix."""
    cfg, plain = load_config("grpo_tiny", ["rlkernel.row_segments=1"])
    assert cfg.rlkernel.row_segments == 1 and plain["rlkernel"]["row_segments"] == 1
    cfg, plain = load_config("grpo_tiny", ["rlkernel.row_segments=4"])
    assert cfg.rlkernel.row_segments == 4 and plain["rlkernel"]["row_segments"] == 4
    with pytest.raises(Exception, match=r"trainer\.tp.*rlkernel\.row_segments=1"):
        load_config("grpo_tiny", ["rlkernel.row_segments=1", "trainer.tp=2", "run.executor=ray"])
    with pytest.raises(Exception, match=r"rollout\.tp.*rlkernel\.row_segments=2"):
        load_config("grpo_tiny", ["rlkernel.row_segments=2", "rollout.tp=4"])


@pytest.mark.parametrize("overrides,segments", [
    ([], 1),  # TP=1 on both sides: no tree, plain GEMMs
    (["rollout.tp=2"], 2),
    (["trainer.tp=2", "run.executor=ray"], 2),
    (["trainer.tp=4", "rollout.tp=2", "run.executor=ray"], 4),
    (["trainer.tp=2", "rollout.tp=8", "run.executor=ray"], 8),
    (["rlkernel.row_segments=auto", "rollout.tp=4"], 4),
])
def test_row_segments_auto_is_the_largest_tp_size(overrides, segments):
    """rlkernel.row_segments=auto (the default) resolves at load to the smallest power of two every TP size of the run
    divides, so each rank of the engine with the most ranks holds one canonical segment. The config object carries the
    number (what the roles pass both engines); the plain config keeps what was asked (provenance's record), and every
    TP size divides the number (the check a pinned value must pass)."""
    cfg, plain = load_config("grpo_tiny", overrides)
    assert cfg.rlkernel.row_segments == segments and plain["rlkernel"]["row_segments"] == "auto"
    assert cfg.rlkernel.row_segments % cfg.trainer.tp == cfg.rlkernel.row_segments % cfg.rollout.tp == 0


@pytest.mark.parametrize("overrides,match", [
    (["rollout.tp=3"], r"rollout\.tp: rlkernel\.row_segments=auto needs power-of-two TP sizes.*got 3.*set rollout\.tp to 1, 2, 4"),
    (["trainer.tp=6", "run.executor=ray"], r"trainer\.tp: rlkernel\.row_segments=auto needs power-of-two TP sizes.*got 6"),
    (["rlkernel.row_segments=3"], r"rlkernel\.row_segments: must be auto or a power of two from 1 to 64, got 3"),
    (["rlkernel.row_segments=128"], r"rlkernel\.row_segments: must be auto or a power of two.*got 128"),
    (["rlkernel.row_segments=true"], r"rlkernel\.row_segments: must be auto or a power of two.*got True"),
    (["rlkernel.row_segments=fast"], r"rlkernel\.row_segments: must be auto or a power of two.*got 'fast'"),
])
def test_row_segments_bad_values_are_refused_with_the_fix(overrides, match):
    with pytest.raises(Exception, match=match):
        load_config("grpo_tiny", overrides)


def test_gpu_preflight_refuses_a_head_dim_the_triton_attention_cannot_tile():
    """On GPUs the strict attention is rlkernel's Triton kernel, which tiles a head dim that is a power of two >= 16: a
    model with head_dim 12 is refused before any engine starts, naming the fix; head_dim 16 is not refused for it."""
    over = ["resources.gpus=1", "model.path=/nonexistent/tiny", "model.init=tiny_sft"]
    with pytest.raises(PreflightError, match=r"head_dim=12 is not a power of two.*rlkernel\.ops\.attention=fa3"):
        check_resources(load_config("grpo_tiny", over + ["model.tiny.head_dim=12"])[0])
    with pytest.raises(PreflightError) as e:  # refused for the missing GPU only
        check_resources(load_config("grpo_tiny", over + ["model.tiny.head_dim=16"])[0])
    assert "head_dim" not in str(e.value) and "needs 1 GPUs" in str(e.value)


def test_unknown_recipe():
    with pytest.raises(FileNotFoundError, match="grpo_tiny"):
        load_config("nope")


def test_qwen3_8b_recipe_fails_early_with_reasons():
    cfg, plain = load_config("grpo_qwen3_8b")
    assert (cfg.trainer.tp, cfg.trainer.cp, cfg.rollout.num_engines, cfg.rollout.tp, cfg.data.samples_per_prompt) == (4, 2, 2, 4, 8)
    assert (cfg.algorithm.kl_coef, cfg.rollout.max_tokens, cfg.run.seed, cfg.trainer.total_steps) == (0.001, 7168, 1234, 200)
    with pytest.raises(PreflightError) as e:
        check_resources(cfg)
    msg = str(e.value)
    assert "needs 8 GPUs" in msg and "/models/Qwen3-8B" in msg and "/data/dapo-math-17k.parquet" in msg
    assert "trainer.cp" not in msg  # CP=2 scores like CP=1 on two H200s (benchmarks/h200x2_tp_cp.json: 0 of 63,217 tokens differ)
    assert "trainer.tp" not in msg  # TP=2 training on two H200s updates bitwise like TP=1 (benchmarks/h200x2_tp_update.json)
    assert "rollout.tp" not in msg  # vLLM at TP=4 runs (the strict model shards like the trainer)


def test_a_runs_row_segments_are_what_its_trainer_ran(tmp_path):
    """vime replay / diagnose rebuild a run's trainer at the segment count it ran: the trainer's provenance first (the
    controller checked the engine's against it), else the config's number, auto resolved from the config's TP sizes,
    else the default of runs before the key (4)."""
    import json

    from vime.replay import run_row_segments

    def run(config, trainer=None):
        d = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "provenance.json").write_text(json.dumps({"config": config, "trainer": trainer or {}}))
        return d

    tps = {"trainer": {"tp": 2}, "rollout": {"tp": 1}}
    assert run_row_segments(run({"rlkernel": {"row_segments": "auto"}, **tps}, {"row_segments": 8})) == 8
    assert run_row_segments(run({"rlkernel": {"row_segments": "auto"}, **tps})) == 2
    assert run_row_segments(run({"rlkernel": {"row_segments": 1}, **tps})) == 1
    assert run_row_segments(run({"rlkernel": {}, **tps})) == 4
