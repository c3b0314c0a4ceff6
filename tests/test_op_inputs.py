"""Bad input to rlkernel's public ops is refused with a message that names the argument — before any kernel reads
memory by it. Before these checks (a helper's audit, session 37) the CPU kernels crashed the process or read and wrote
outside the tensors: cu_seqlens past the rows (heap corruption), a block id outside the cache, k/v of another head
size than the cache, a weight on another device (segfault); negative rope positions read a cached table's other rows;
float positions, targets and offsets were truncated; eps < 0, theta 0, entropy at temperature 0 computed garbage; a
strict block pinned to impl='native' ran torch's ops. Dtypes (session 38, from a helper's audit of every caller): a
mixed call meant something on one backend and nothing on another (the CPU GEMM widened a bf16 weight beside fp32 x, the
Triton GEMM refused it, the Triton logprob and attention kernels would have fed two dtypes to one dot), float64 was
rounded to float32 silently, and k / v were rounded into a cache of another dtype by a copy documented as exact; the
one declared mix, rms_norm's weight, still runs. Valid neighbours of each bad call still run."""
import pytest
import torch

import rlkernel as rk
from rlkernel.models import DecoderConfig, pack_sequences

Q, K, V = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
KC, VC = torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8)
QD = torch.randn(3, 4, 8)
X, POS = torch.randn(3, 2, 8), torch.tensor([1, 2, 3])
ONE = torch.tensor([1, 2], dtype=torch.int32)


def _paged(tables, lens, qsl):
    return rk.attention_paged(QD, KC, VC, torch.tensor(tables), torch.tensor(lens), torch.tensor(qsl))


BAD = [  # (call, phrase of the message)
    (lambda: rk.attention_varlen(Q, K, V, torch.tensor([0, 3, 12])), "cu_seqlens must start at 0, not decrease and end at the row count 8"),
    (lambda: rk.attention_varlen(Q, K, V, torch.tensor([-2, 3, 8])), "got [-2, 3, 8]"),
    (lambda: rk.attention_varlen(Q, K, V, torch.tensor([0, 5, 3, 8])), "not decrease"),
    (lambda: rk.attention_varlen(Q, K, V, torch.tensor([0, 3, 6])), "end at the row count 8"),
    (lambda: rk.attention_varlen(Q, K, V, torch.tensor([0.0, 3.0, 8.0])), "cu_seqlens must be a 1-D integer tensor"),
    (lambda: rk.attention_varlen(Q, K[:4], V[:4], torch.tensor([0, 3, 8])), "q has 8 rows but k/v have 4"),
    (lambda: rk.attention_varlen(Q[..., :4], K, V, torch.tensor([0, 3, 8])), "q head_dim 4 != k/v head_dim 8"),
    (lambda: _paged([[5], [0]], [5, 6], [0, 1, 3]), "block_tables names block 5, outside the cache's [0, 4)"),
    (lambda: _paged([[-1], [0]], [5, 6], [0, 1, 3]), "block_tables names block -1"),
    (lambda: _paged([[1]], [5, 6], [0, 1, 3]), "block_tables with >= 2 rows"),
    (lambda: _paged([[1], [0]], [5, 6], [0, 1, 6]), "query_start_loc must start at 0, not decrease and end within the 3 rows"),
    (lambda: _paged([[1], [0]], [5, 20], [0, 1, 3]), "needs 2 blocks of 16; block_tables has 1 columns"),
    (lambda: _paged([[1], [0]], [5, -6], [0, 1, 3]), "seq_lens must be >= 0"),
    (lambda: rk.write_kv_cache(torch.randn(3, 2, 16), torch.randn(3, 2, 16), KC, VC, torch.tensor([0, 1, 2])), "of the same Hkv and D"),
    (lambda: rk.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 1, 8), KC, VC, torch.tensor([0, 1, 2])), "equal in shape"),
    (lambda: rk.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), KC, VC, torch.tensor([[0, 1, 2]])), "slot_mapping must be a 1-D"),
    (lambda: rk.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), KC, VC, torch.tensor([0, 1, 64])), "slot 64 is outside"),
    (lambda: rk.linear(torch.randn(2, 8), torch.randn(3, 8, device="meta")), "all tensor arguments must be on one device"),
    (lambda: rk.linear(torch.tensor(1.0), torch.randn(3, 8)), "want x [..., K] and weight [N, K]"),
    (lambda: rk.linear(torch.randn(2, 8), torch.randn(3, 8), k_segments=2.0), "k_segments must be an int"),
    (lambda: rk.linear(torch.randn(2, 8), torch.randn(3, 8), backend=""), "backend='' names no implementation"),
    (lambda: rk.rope(X, torch.tensor([-1, 2, 3]), 1e4, backend="reference"), "positions must be >= 0, got -1"),
    (lambda: rk.rope(X, torch.tensor([-1, 2, 3]), 1e4, backend="reference", max_position=8), "positions must be >= 0"),
    (lambda: rk.rope(X, torch.tensor([1, 2, 2 ** 40]), 1e4, backend="reference"), "pass max_position"),
    (lambda: rk.rope(X, POS + 0.7, 1e4), "positions must be an integer tensor"),
    (lambda: rk.rope(X, POS, 0.0), "theta must be a finite number > 0"),
    (lambda: rk.rms_norm_rope(X, torch.ones(8), 1e-6, POS.float(), 1e4), "positions must be an integer tensor"),
    (lambda: rk.rms_norm(torch.randn(3, 8), torch.ones(8), -1.0), "eps must be a finite number >= 0"),
    (lambda: rk.rms_norm(torch.randn(3, 8), torch.ones(8), float("nan")), "eps must be a finite number >= 0"),
    (lambda: rk.linear_entropy(torch.randn(3, 8), torch.randn(10, 8), 0.0), "temperature must be > 0"),
    (lambda: rk.linear_logprob(torch.randn(3, 8), torch.randn(10, 8), torch.tensor([0.0, 5.9, 1.0])), "targets must be an integer tensor"),
    (lambda: rk.mode("strict", impl="native").__enter__(), "for torch's own ops use mode='native'"),
    (lambda: rk.linear(torch.randn(2, 8), torch.randn(3, 8).bfloat16()), "x and weight must share one dtype"),
    (lambda: rk.linear(torch.randn(2, 8), torch.randn(3, 8), torch.zeros(3).bfloat16()), "x and weight and bias must share one dtype"),
    (lambda: rk.linear(torch.randn(2, 8).double(), torch.randn(3, 8).double()), "x is torch.float64"),
    (lambda: rk.linear_logprob(torch.randn(3, 8), torch.randn(10, 8).bfloat16(), torch.tensor([0, 5, 1])), "hidden and weight must share"),
    (lambda: rk.linear_entropy(torch.randn(3, 8).double(), torch.randn(10, 8).double()), "hidden is torch.float64"),
    (lambda: rk.linear_logprobs_full(torch.randn(3, 8).half(), torch.randn(10, 8)), "hidden and weight must share"),
    (lambda: rk.swiglu(torch.randn(3, 8), torch.randn(3, 8).bfloat16()), "gate and up must share one dtype"),
    (lambda: rk.rope(X.double(), POS, 1e4), "x is torch.float64"),
    (lambda: rk.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6, residual=torch.randn(3, 8).bfloat16()), "x and residual must share"),
    (lambda: rk.rms_norm(torch.randn(3, 8), torch.ones(8).double()), "weight is torch.float64"),
    (lambda: rk.attention_varlen(Q, K.bfloat16(), V.bfloat16(), torch.tensor([0, 3, 8])), "q and k and v must share one dtype"),
    (lambda: rk.attention_paged(QD.bfloat16(), KC, VC, torch.tensor([[1], [0]]), torch.tensor([5, 6]), torch.tensor([0, 1, 3])),
     "q and k_cache and v_cache must share one dtype"),
    (lambda: rk.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), KC.bfloat16(), VC.bfloat16(), torch.tensor([0, 1, 2])),
     "k and v and k_cache and v_cache must share one dtype"),
    (lambda: pack_sequences([[1.5, 2.2]]), "token ids must be ints"),
    (lambda: DecoderConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=0,
                           num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True),
     "num_heads must be a positive int"),
    (lambda: DecoderConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=0.0, tie_word_embeddings=True),
     "rope_theta must be a finite number > 0"),
]


@pytest.mark.parametrize("call,phrase", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_refused_naming_it(call, phrase):
    with pytest.raises(ValueError) as e:
        call()
    assert phrase in str(e.value), str(e.value)


def test_the_valid_neighbours_run():
    """The calls above with their argument made right run (the checks refuse only what is wrong): int32 offsets and
    positions, padding slots (-1), a table wider than the requests need, blocks within the cache."""
    assert rk.attention_varlen(Q, K, V, torch.tensor([0, 3, 8], dtype=torch.int32)).shape == (8, 4, 8)
    assert rk.attention_varlen(Q, K, V, torch.tensor([0, 3, 3, 8])).shape == (8, 4, 8)  # an empty sequence
    assert _paged([[1, 3], [0, 2]], [5, 6], [0, 1, 3]).shape == (3, 4, 8)
    assert _paged([[3], [0]], [0, 6], [0, 0, 3]).shape == (3, 4, 8)  # a request of no tokens reads no block
    assert _paged([[1], [0]], [5, 6], [0, 1, 2]).shape == (3, 4, 8)  # a padded batch: row 2 past the last request
    rk.write_kv_cache(torch.randn(3, 2, 8), torch.randn(3, 2, 8), KC, VC, torch.tensor([0, -1, 63]))
    assert rk.rope(X, ONE.repeat(2)[:3], 1e4).shape == X.shape
    assert rk.rms_norm(torch.randn(3, 8), torch.ones(8), 0).shape == (3, 8)
    assert rk.linear(torch.randn(2, 8), torch.randn(3, 8), k_segments=__import__("numpy").int64(2)).shape == (2, 3)
    # one dtype throughout, in each of the contracts' three; rms_norm's weight in another dtype (declared: the output
    # is in the weight's dtype, the new residual in x's)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert rk.linear(torch.randn(2, 8, dtype=dt), torch.randn(3, 8, dtype=dt), torch.zeros(3, dtype=dt)).dtype == dt
        assert rk.swiglu(torch.randn(3, 8, dtype=dt), torch.randn(3, 8, dtype=dt)).dtype == dt
        assert rk.linear_logprob(torch.randn(3, 8, dtype=dt), torch.randn(10, 8, dtype=dt), torch.tensor([0, 5, 1])).dtype == torch.float32
    y, res = rk.rms_norm(torch.randn(3, 8), torch.ones(8).bfloat16(), 1e-6, residual=torch.randn(3, 8))
    assert (y.dtype, res.dtype) == (torch.bfloat16, torch.float32)
    assert rk.attention_varlen(Q.bfloat16(), K.bfloat16(), V.bfloat16(), torch.tensor([0, 3, 8])).dtype == torch.bfloat16
    rk.write_kv_cache(torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16(), KC.bfloat16(), VC.bfloat16(), torch.tensor([0, 1, 2]))
    with rk.mode("strict", impl="reference", ops={"attention": "native"}):
        assert rk.linear(torch.randn(2, 8), torch.randn(3, 8)).shape == (2, 3)


CPP_BAD = [  # (call on the C++ library itself, phrase): rows a kernel would read or write past, caught there too
    (lambda o: o.attention_varlen(Q, K, V, torch.tensor([0, 3, 12]), 1.0), "cu_seqlens must rise from >= 0 to <= k's 8 rows"),
    (lambda o: o.attention_varlen(Q, K, V, torch.tensor([-2, 3, 8]), 1.0), "cu_seqlens must rise"),
    (lambda o: o.attention_varlen(Q, K, V, torch.tensor([0, 5, 3, 8]), 1.0), "cu_seqlens must rise"),
    (lambda o: o.attention_varlen(Q[:4], K, V, torch.tensor([0, 3, 8]), 1.0), "query rows [3, 8) are outside q's 4 rows"),
    (lambda o: o.attention_varlen(Q[..., :4], K, V, torch.tensor([0, 3, 8]), 1.0), "q's head_dim 4 but k's 8"),
    (lambda o: o.attention_paged(QD, KC, VC, torch.tensor([[5], [0]]), torch.tensor([5, 6]), torch.tensor([0, 1, 3]), 1.0),
     "request 0's block 0 is 5, outside the cache's 4 blocks"),
    (lambda o: o.attention_paged(QD, KC, VC, torch.tensor([[1], [0]]), torch.tensor([5, 6]), torch.tensor([0, 1]), 1.0),
     "query_start_loc must be [3]"),
    (lambda o: o.attention_paged(QD, KC, VC, torch.tensor([[1]]), torch.tensor([5, 6]), torch.tensor([0, 1, 3]), 1.0),
     "block_tables must be [>= 2"),
    (lambda o: o.attention_paged(QD, KC, VC, torch.tensor([[1], [0]]), torch.tensor([5, 6]), torch.tensor([0, 1, 6]), 1.0),
     "request 1's query rows [1, 6) are outside q's 3 rows"),
]


@pytest.mark.parametrize("call,phrase", CPP_BAD, ids=[str(i) for i in range(len(CPP_BAD))])
def test_the_cpu_library_refuses_rows_outside_its_tensors(call, phrase):
    """The C++ kernels check the rows they index by themselves (session 39), for a caller of `torch.ops.rlkernel`
    past the public ops' checks: before, these calls read or wrote outside q, k / v or the cache. The valid call
    beside them runs and equals the public op's."""
    from rlkernel.backends import cpu

    if not cpu.available():
        pytest.skip(f"the CPU library is not built here: {cpu.status()}")
    ops = torch.ops.rlkernel
    with pytest.raises(ValueError) as e:
        call(ops)
    assert phrase in str(e.value), str(e.value)
    cu = torch.tensor([0, 3, 8])
    assert torch.equal(ops.attention_varlen(Q, K, V, cu, 8 ** -0.5), rk.attention_varlen(Q, K, V, cu, backend="reference"))
