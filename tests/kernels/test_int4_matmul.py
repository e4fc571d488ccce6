"""INT4 matmul: layout helpers, and every Triton path against ``int4_matmul_ref`` on edge shapes.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py turns it on; fp16 / fp32
only: the interpreter's bf16 dot is wrong); with one they run compiled, and the ``gpu`` tests add bf16,
the asm decode, large M and graph capture.
"""

import gc
import weakref

import pytest
import torch

from kernels import int4_matmul_triton as T
from kernels.int4_matmul import (
    Int4Weight,
    dequantize,
    int4_matmul,
    int4_matmul_ref,
    int4_matmul_silu_mul,
    int4_matmul_silu_mul_ref,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(N: int, K: int, G: int, use_zero_point: bool, dtype: torch.dtype, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = quantize_rtn(torch.randn(N, K, generator=g), G, use_zero_point, dtype=dtype)
    return w.to(DEVICE)


def _x(M: int, K: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _ref(x: torch.Tensor, w: Int4Weight, bias=None, residual=None) -> torch.Tensor:
    """fp32 reference on the same codes (upcast scales, zeros and inputs)."""
    w32 = Int4Weight(w.qweight, w.scales.float(), None if w.zeros is None else w.zeros.float(), w.group_size)
    return int4_matmul_ref(x.float(), w32, None if bias is None else bias.float(),
                           None if residual is None else residual.float())


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not y.isnan().any()
    return ((y.float() - ref).norm() / ref.norm()).item()


TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


# ---------------------------------------------------------------------------------------------------
# Layout helpers (pure torch)
# ---------------------------------------------------------------------------------------------------


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (48, 64), generator=torch.Generator().manual_seed(0))
    q = pack_int4(codes)
    assert q.shape == (8, 48) and q.dtype == torch.int32
    assert torch.equal(unpack_int4(q), codes)
    # GPTQ bit order: code k % 8 in bits 4 (k % 8) .. of word k // 8.
    assert (q[0, 0].item() & 0xF) == codes[0, 0] and ((q[0, 0].item() >> 28) & 0xF) == codes[0, 7]


@pytest.mark.parametrize("use_zero_point", [True, False])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_quantize_rtn_error_bound(G, use_zero_point):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(G))
    q = quantize_rtn(w, G, use_zero_point, dtype=torch.float32)
    err = (dequantize(q) - w).abs().reshape(40, 256 // G, G)
    half_step = q.scales.T.reshape(40, 256 // G, 1) / 2
    assert (err <= half_step * (1 + 1e-5) + 1e-7).all()  # round to nearest: within half a step


# ---------------------------------------------------------------------------------------------------
# Triton paths vs the reference (interpreter on CPU, compiled on CUDA)
# ---------------------------------------------------------------------------------------------------

EDGE = [  # (M, N, K, G): M = 1 / 3 (GEMV), 16 / 17 (one tile, one row over); ragged N; K = 576 not a multiple of 128
    (1, 96, 256, 128),
    (3, 100, 576, 64),
    (16, 72, 576, 32),
    (17, 100, 512, 128),
]


@pytest.mark.parametrize("use_zero_point", [True, False])
@pytest.mark.parametrize("M,N,K,G", EDGE)
def test_dispatch_matches_ref(M, N, K, G, use_zero_point):
    w = _weight(N, K, G, use_zero_point, torch.float16)
    x, bias = _x(M, K, torch.float16), _x(1, N, torch.float16, seed=2)[0]
    y = int4_matmul(x, w, bias, use_triton=True)
    assert y.shape == (M, N) and y.dtype == torch.float16
    assert _rel_err(y, _ref(x, w, bias)) < TOL[torch.float16]


def _configs(M: int, N: int, K: int) -> list[T.KernelConfig]:
    """Each kernel kind, with and without split-K (GEMV with several rows too)."""
    out = []
    for cfg in T._candidates(M, N, K, False, num_sms=132):
        if not any(c.kind == cfg.kind and (c.split_k > 1) == (cfg.split_k > 1) for c in out):
            out.append(cfg)
    out += [T.KernelConfig("mma", 16, 64, 128, 1, 4, 2), T.KernelConfig("dequant")]
    if M <= 4:
        out += [T.KernelConfig("gemv", 4 if M > 2 else M, 128, 64, 3, 4, 1)]
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K,G", [(2, 100, 576, 64), (5, 64, 1024, 128), (33, 40, 256, 32)])
def test_every_kernel_matches_ref(monkeypatch, M, N, K, G, dtype):
    """Every kind, split and unsplit; split-K sums by atomic adds (SPECGATE_INT4_FIX_ATOMIC=1) for fp16 and
    by the serial fix-up (the default, and batch-invariant mode's) for fp32."""
    monkeypatch.setattr(T, "FIX_ATOMIC", dtype == torch.float16)
    w = _weight(N, K, G, True, dtype)
    x, bias = _x(M, K, dtype), _x(1, N, dtype, seed=2)[0]
    ref = _ref(x, w, bias)
    for cfg in _configs(M, N, K):
        y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, bias=bias, config=cfg)
        assert _rel_err(y, ref) < TOL[dtype], cfg


@pytest.mark.parametrize("use_zero_point", [True, False])
@pytest.mark.parametrize("M,N,split_k,silu", [(3, 200, 1, False), (16, 96, 4, True), (13, 320, 2, False)])
def test_mma_scale_dot_matches_ref(monkeypatch, M, N, split_k, silu, use_zero_point):
    """SPECGATE_INT4_SCALE_DOT's path (off by default): scales and zero points through one-hot dots.
    Ragged N masks the scale tile's columns; split-K starts a program mid-K, at a later group."""
    monkeypatch.setattr(T, "SCALE_DOT", True)
    K, G = 512, 128
    w = _weight(N, K, G, use_zero_point, torch.float16)
    x, bias = _x(M, K, torch.float16), _x(1, N, torch.float16, seed=2)[0]
    cfg = T.KernelConfig("mma", 16, 64, 128, split_k, 4, 2)
    assert T.kernel_for(cfg, True, G, False)[1]["SCALE_DOT"]
    if silu:
        gate, up = _ref(x, w, bias).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    else:
        ref = _ref(x, w, bias)
    y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, bias=bias, silu=silu, config=cfg)
    assert _rel_err(y, ref) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K,G,use_zero_point,block_m,split_k,silu", [
    (3, 100, 576, 64, True, 16, 1, False),  # ragged K, a group smaller than the tile: unfactored decode
    (33, 200, 512, 128, False, 16, 2, False),  # three token tiles, the last one row deep; split-K
    (17, 128, 512, 128, True, 32, 1, True),  # SiLU epilogue on transposed tiles
    (40, 72, 1024, 32, True, 64, 4, False),  # one 64-token tile, four splits, ragged N
])
@pytest.mark.parametrize("whole_zeros", [False, True])
def test_swapped_mma_matches_ref(M, N, K, G, use_zero_point, block_m, split_k, silu, dtype, whole_zeros):
    """The swap-AB MMA path ("mmat": y^T = W x^T) on a poisoned output: every element written, right;
    with whole zero points subtracted in the decode (ZDEC) or factored out."""
    w = _weight(N, K, G, use_zero_point, dtype, seed=M + N)
    x = _x(M, K, dtype, seed=K) * (0.05 if silu else 1.0)
    cfg = T.KernelConfig("mmat", block_m, 64, 128, split_k, 4, 2)
    assert T.kernel_for(cfg, dtype != torch.float32, G, False, whole_zeros=whole_zeros)[1]["ZDEC"] == (
        whole_zeros and dtype != torch.float32 and G % 128 == 0)
    out = torch.full((M, N // 2 if silu else N), float("nan"), dtype=dtype, device=DEVICE)
    y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, silu=silu, config=cfg, out=out,
                             whole_zeros=whole_zeros)
    ref = _ref(x, w)
    if silu:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    assert _rel_err(y, ref) < TOL[dtype]


def test_swapped_path_is_a_candidate_from_two_rows(monkeypatch):
    """The tuner times the swap-AB path from M = 2 (M = 1 belongs to the GEMVs) and at every M bucket,
    SiLU included; SPECGATE_INT4_MMAT=0 (T.MMAT) leaves it out for A/B runs."""
    kinds = lambda M, silu=False: {c.kind for c in T._candidates(M, 28672, 4096, silu, 132)}  # noqa: E731
    assert "mmat" not in kinds(1)
    for M in (2, 16, 64, 128, 300):
        assert "mmat" in kinds(M) and "mmat" in kinds(M, silu=True), M
    monkeypatch.setattr(T, "MMAT", False)
    assert not any("mmat" in kinds(M) for M in (2, 16, 64, 128, 300))


def test_tuner_leaves_out_configs_that_cannot_build(caplog):
    """A candidate that runs out of shared memory (or that ptxas rejects) on this GPU is dropped with a
    warning instead of failing the first call; any other error propagates; none buildable is an error."""
    from triton.runtime.errors import OutOfResources

    a, b, c = (T.KernelConfig("mmat", bm, 128, 128, 1, 4, 3) for bm in (16, 32, 64))
    calls = []

    def run(cfg):
        calls.append(cfg)
        if cfg is b:
            raise OutOfResources(300000, 232448, "shared memory")

    with caplog.at_level("WARNING", logger="specgate.int4"):
        assert T._buildable(run, [a, b, c]) == [a, c]
    assert calls == [a, a, b, c, c] and "left out" in caplog.text
    with pytest.raises(RuntimeError, match="no INT4 kernel config"):
        T._buildable(run, [b])

    def broken(cfg):
        raise ValueError("a bug, not a resource limit")

    with pytest.raises(ValueError):
        T._buildable(broken, [a])


@pytest.mark.parametrize("kind", ["mma", "mmat"])
@pytest.mark.parametrize("use_zero_point", [True, False])
def test_whole_zero_points_decode_exactly(kind, use_zero_point):
    """ZDEC subtracts MAGIC + z from the decoded codes in fp16: exact for whole zero points, so the MMA
    paths match the reference as closely as the factored form does; split-K starts mid-K."""
    M, N, K, G = 20, 192, 1024, 128
    w = _weight(N, K, G, use_zero_point, torch.float16, seed=7)
    assert w.zeros_are_whole()
    x = _x(M, K, torch.float16, seed=8)
    ref = _ref(x, w)
    cfg = T.KernelConfig(kind, 16, 64, 128, 2, 4, 2)
    assert T.kernel_for(cfg, True, G, False, whole_zeros=True)[1]["ZDEC"]
    for whole in (False, True):
        y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg, whole_zeros=whole)
        assert _rel_err(y, ref) < TOL[torch.float16], whole


def test_fractional_zero_points_take_the_factored_path():
    """A fractional zero point (GGUF Q4_1's minimum, tuned zeros) must not be rounded into the decode:
    the weight says so, and the dispatcher's result still matches the reference."""
    N, K, G = 96, 512, 128
    w = _weight(N, K, G, True, torch.float16, seed=9)
    w.zeros = (w.zeros.float() + 0.375).to(torch.float16)  # exact in fp16, not whole
    assert not w.zeros_are_whole()
    assert _weight(N, K, G, False, torch.float16).zeros_are_whole()  # symmetric: no zero points at all
    x = _x(24, K, torch.float16, seed=10)
    assert _rel_err(int4_matmul(x, w, use_triton=True), _ref(x, w)) < TOL[torch.float16]
    # forcing the 16-bit subtraction on such zeros is what the flag prevents: it moves the result
    cfg = T.KernelConfig("mmat", 16, 64, 128, 1, 4, 2)
    wrong = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg, whole_zeros=True)
    assert _rel_err(wrong, _ref(x, w)) > 10 * TOL[torch.float16]


@pytest.mark.parametrize("fix_rows,split_k", [(4, 6), (32, 24)])
def test_hgemv_fix_up_rounds(monkeypatch, fix_rows, split_k):
    """SPECGATE_INT4_FIX_ROWS (T.FIX_ROWS): the last program reads the partials that many rows a round, the last
    round ragged (6 splits in rounds of 4) or all in one (24 of 32); the sum stays the reference's."""
    monkeypatch.setattr(T, "FIX_ROWS", fix_rows)
    monkeypatch.setattr(T, "FIX_ATOMIC", False)  # the serial fix-up reads the rounds
    N, K, G = 1024, 3072, 128
    w = _weight(N, K, G, True, torch.float16, seed=split_k)
    x = _x(1, K, torch.float16, seed=3)
    cfg = T.KernelConfig("hgemv", 1, 512, 128, split_k, 4, 1)
    assert T.kernel_for(cfg, True, G, False)[1]["FIX_R"] == fix_rows
    out = torch.full((1, N), float("nan"), dtype=torch.float16, device=DEVICE)
    y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg, out=out)
    assert _rel_err(y, _ref(x, w)) < TOL[torch.float16]


def _hgemv_run(x, w, G, bias, cfg, silu):
    """One row through ``cfg`` into a poisoned output, with a bias, or gated (SiLU) without one: (y, the fp32
    reference, the output buffer)."""
    N = w.qweight.shape[1]
    out = torch.full((1, N // 2 if silu else N), float("nan"), dtype=torch.float16, device=DEVICE)
    if silu:
        x = x * 0.05  # keeps the gate's sigmoid in range (the interpreter turns exp's overflow into an error)
        y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, silu=True, config=cfg, out=out)
        gate, up = _ref(x, w).chunk(2, dim=-1)
        return y, torch.nn.functional.silu(gate) * up, out
    y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, bias=bias, config=cfg, out=out)
    return y, _ref(x, w, bias), out


@pytest.mark.parametrize("silu", [False, True])
def test_hgemv_atomic_fix_up(monkeypatch, silu):
    """SPECGATE_INT4_FIX_ATOMIC (T.FIX_ATOMIC): partials summed by atomic adds into the shared fp32 row. Two
    launches of different shapes in a row: each must leave the row zeroed for the next (a stale sum would
    add into the second's outputs), with a ragged N, a bias and the gated (SiLU) epilogue."""
    monkeypatch.setattr(T, "FIX_ATOMIC", True)
    G = 64
    for N, K, split_k, seed in [(1000, 1536, 8, 1), (600, 768, 3, 2)]:
        w = _weight(N, K, G, True, torch.float16, seed=seed)
        x, bias = _x(1, K, torch.float16, seed=seed + 10), _x(1, N, torch.float16, seed=seed + 20)[0]
        cfg = T.KernelConfig("hgemv", 1, 512, 64, split_k, 4, 2)
        assert T.kernel_for(cfg, True, G, False)[1]["ATOMIC"]
        y, ref, _ = _hgemv_run(x, w, G, bias, cfg, silu)
        assert _rel_err(y, ref) < TOL[torch.float16]
        assert not T._SUMS[x.device][:N].any()  # left zeroed for the next launch
        assert not T._counters(x.device, 1)[:8].any()


def test_grown_shared_buffer_keeps_the_old_one(monkeypatch):
    """A CUDA graph captured before the split-K counters or sums grew still replays into the old buffer: growth
    must keep it alive (freed, a later tensor would take the replays' counter bumps and partial sums)."""
    monkeypatch.setattr(T, "_RETIRED", [])
    store: dict = {}
    first = T._shared_zeros(store, torch.device("cpu"), 10, torch.float32, "sums")
    assert T._shared_zeros(store, torch.device("cpu"), 1 << 16, torch.float32, "sums") is first  # fits: no growth
    ptr, old = first.data_ptr(), weakref.ref(first)
    del first
    grown = T._shared_zeros(store, torch.device("cpu"), (1 << 16) + 1, torch.float32, "sums")
    gc.collect()
    assert old() is not None and old().data_ptr() == ptr
    assert grown.numel() == 1 << 17 and not grown.any()  # at least doubled, zeroed
    assert T._shared_zeros(store, torch.device("cpu"), 5, torch.float32, "sums") is grown


@pytest.mark.parametrize("kind,M,block_m,split_k", [("mma", 3, 16, 4), ("mma", 17, 16, 2), ("mmat", 16, 16, 4),
                                                     ("mmat", 5, 16, 2)])
def test_mma_atomic_fix_up(monkeypatch, kind, M, block_m, split_k):
    """T.FIX_ATOMIC on the tensor-core paths: ragged rows (masked out of the sums), several row tiles sharing
    the sum buffer, a residual epilogue; then a second launch over the same outputs finds the sums zeroed."""
    monkeypatch.setattr(T, "FIX_ATOMIC", True)
    N, K, G = 200, 1024, 64
    w = _weight(N, K, G, True, torch.float16, seed=M)
    cfg = T.KernelConfig(kind, block_m, 64, 128, split_k, 4, 2)
    assert T.kernel_for(cfg, True, G, False)[1]["ATOMIC"]
    for seed in (1, 2):
        x, res = _x(M, K, torch.float16, seed=seed), _x(M, N, torch.float16, seed=seed + 5)
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device=DEVICE)
        y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, residual=res, config=cfg, out=out)
        assert _rel_err(y, _ref(x, w, residual=res)) < TOL[torch.float16]
        assert not T._SUMS[x.device][: M * N].any()


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("N,K,G,use_zero_point,split_k", [(1000, 576, 64, True, 3), (300, 1024, 32, False, 1),
                                                          (2048, 4096, 128, True, 8), (96, 512, 128, False, 2),
                                                          (200, 1536, 128, True, 8)])  # splits start mid-group
def test_hgemv_matches_ref(N, K, G, use_zero_point, split_k, silu):
    """The packed-fp16 M = 1 path: ragged N, every group size, split and unsplit K, a poisoned output."""
    w = _weight(N, K, G, use_zero_point, torch.float16, seed=N + K)
    x, bias = _x(1, K, torch.float16, seed=K), _x(1, N, torch.float16, seed=2)[0]
    cfg = T.KernelConfig("hgemv", 1, 512, min(64, G), split_k, 4, 2 if split_k > 2 else 1)  # 1 or 2 tiles in flight
    y, ref, out = _hgemv_run(x, w, G, bias, cfg, silu)
    assert y.data_ptr() == out.data_ptr()
    assert _rel_err(y, ref) < TOL[torch.float16]


@pytest.mark.parametrize("magnitude", [1e4, 1e-3, 0.0])
def test_hgemv_scales_x_into_fp16_range(magnitude):
    """x is scaled per split by a power of two: huge and tiny activations keep their precision; an
    outlier beside small values neither overflows nor flushes them."""
    g = torch.Generator().manual_seed(0)
    w = quantize_rtn(torch.randn(128, 1024, generator=g) * 0.01, 128, True, dtype=torch.float16).to(DEVICE)
    x = _x(1, 1024, torch.float16) * magnitude  # small weights keep y inside fp16's range
    x[0, 5] = 6e4 if magnitude else 0.0  # an outlier in the first split
    cfg = T.KernelConfig("hgemv", 1, 512, 64, 2, 4, 1)
    y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 128, config=cfg)
    ref = _ref(x, w)
    if magnitude == 0.0:
        assert not y.any()
    else:
        assert _rel_err(y, ref) < TOL[torch.float16]
        # the second split holds no outlier: its share alone must be exact too
        x2 = x.clone()
        x2[0, :512] = 0
        y2 = T.int4_matmul_triton(x2, w.qweight, w.scales, w.zeros, 128, config=cfg)
        assert _rel_err(y2, _ref(x2, w)) < TOL[torch.float16]


@pytest.mark.parametrize("kind", ["mma", "hgemv", "gemv"])
def test_split_must_divide_k_blocks(kind):
    """An explicit config whose split count leaves K blocks over would drop them from the sum: an error."""
    w = _weight(64, 1024, 128, True, torch.float16)  # 8 K blocks of 128
    M = 16 if kind == "mma" else 1
    with pytest.raises(ValueError, match="split_k must divide the 8 K blocks"):
        T.int4_matmul_triton(_x(M, 1024, torch.float16), w.qweight, w.scales, w.zeros, 128,
                             config=T.KernelConfig(kind, 16 if kind == "mma" else 1, 64, 128, 3, 4, 1))


def test_hgemv_rejects_what_it_cannot_run():
    w = _weight(64, 256, 128, True, torch.float16)
    with pytest.raises(ValueError, match="hgemv"):
        T.int4_matmul_triton(_x(2, 256, torch.float16), w.qweight, w.scales, w.zeros, 128,
                             config=T.KernelConfig("hgemv", 1, 512, 64, 1, 4, 1))


def test_residual_and_strided_rows():
    w = _weight(64, 256, 64, True, torch.float16)
    x = _x(6, 512, torch.float16)[:, ::2]  # non-unit K stride: the dispatcher makes rows contiguous
    residual = _x(6, 64, torch.float16, seed=3)
    y = int4_matmul(x.reshape(2, 3, 256), w, residual=residual.reshape(2, 3, 64), use_triton=True)
    assert y.shape == (2, 3, 64)
    assert _rel_err(y.reshape(6, 64), _ref(x, w, residual=residual)) < TOL[torch.float16]


@pytest.mark.parametrize("M", [1, 20])
def test_silu_mul_matches_ref(M):
    w = _weight(2 * 48, 256, 128, True, torch.float16)  # gate rows 0..47, up rows 48..95
    x = _x(M, 256, torch.float16)
    y = int4_matmul_silu_mul(x, w, use_triton=True)
    ref = int4_matmul_silu_mul_ref(x.float(), Int4Weight(w.qweight, w.scales.float(), w.zeros.float(), 128))
    assert y.shape == (M, 48)
    assert _rel_err(y, ref) < TOL[torch.float16]


def test_split_k_is_deterministic_and_resets_counters(monkeypatch):
    """The serial fix-up sums the partials in split order: two launches agree bit for bit (the atomic one
    sums in arrival order; test_hgemv_atomic_fix_up and test_mma_atomic_fix_up cover it)."""
    monkeypatch.setattr(T, "FIX_ATOMIC", False)
    w = _weight(64, 1024, 128, True, torch.float16)
    x = _x(3, 1024, torch.float16)
    cfg = T.KernelConfig("gemv", 4, 64, 128, 4, 4, 1)
    a = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 128, config=cfg)
    b = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 128, config=cfg)
    assert torch.equal(a, b)
    assert not T._COUNTERS[x.device].any()


def test_dequantize_triton_matches_dequantize():
    w = _weight(100, 576, 64, True, torch.float16)
    got = T.dequantize_triton(w.qweight, w.scales, w.zeros, 64, torch.float16)  # [K, N]
    assert torch.allclose(got.float(), dequantize(w).float().T, atol=1e-3, rtol=1e-3)


def test_empty_batch():
    w = _weight(64, 256, 128, True, torch.float16)
    assert int4_matmul(_x(0, 256, torch.float16), w, use_triton=True).shape == (0, 64)


# ---------------------------------------------------------------------------------------------------
# GPU only: bf16, the asm decode at real sizes, the large-M path, graph capture
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 4, 16, 50, 128, 300])
def test_gpu_llama_shape(M, dtype):
    w = _weight(1024, 4096, 128, True, dtype)
    x, bias = _x(M, 4096, dtype), _x(1, 1024, dtype, seed=2)[0]
    ref = _ref(x, w, bias)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cands = T._candidates(M, 1024, 4096, False, sms)
    kinds = {c.kind: c for c in reversed(cands)}  # the first candidate of each path
    for cfg in [None] + cands[:3] + list(kinds.values()):
        for whole in (False, True):  # the factored zero point, and whole zero points in the decode
            y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 128, bias=bias, config=cfg, whole_zeros=whole)
            assert _rel_err(y, ref) < TOL[dtype], (cfg, whole)


def test_chain_tuner_weighs_unsplit_and_narrow_configs_for_short_k(monkeypatch):
    """TUNE = "chain" adds one split and narrower tiles where K <= SHORT_K (SmolLM2's 576 and 1536), and nothing
    for long K (an 8B layer's 4096); the cold tuner's candidates stay as they were."""
    def cands(M, N, K):
        return set(T._candidates(M, N, K, False, 132, G=32))

    monkeypatch.setattr(T, "TUNE", "cold")
    cold = {(M, N, K): cands(M, N, K) for M in (1, 4) for N, K in ((960, 576), (576, 1536), (4096, 4096))}
    monkeypatch.setattr(T, "TUNE", "chain")
    for (M, N, K), before in cold.items():
        extra = cands(M, N, K) - before
        if K > T.SHORT_K:
            assert not extra
            continue
        assert before < cands(M, N, K)
        assert any(c.split_k == 1 and c.kind == ("hgemv" if M == 1 else "mma") for c in extra), extra
        assert any(c.block_n == (128 if M == 1 else 32) for c in extra), extra
    assert T._splits(15, 5, 132) == [5] and T._splits(15, 5, 132, unsplit=True) == [5, 1]
    assert T._splits(1000, 4, 132, unsplit=True) == [1]  # already among the picks
    # the untuned default (the first candidate) is the cold tuner's first, whatever the mode
    for M in (1, 4, 16, 64):
        monkeypatch.setattr(T, "TUNE", "cold")
        first = T._candidates(M, 960, 576, False, 132, G=32)[0]
        monkeypatch.setattr(T, "TUNE", "chain")
        assert T._candidates(M, 960, 576, False, 132, G=32)[0] == first


@pytest.mark.parametrize("M,N,K,G", [(1, 192, 576, 32), (4, 96, 576, 64), (3, 100, 1536, 32)])
def test_chain_candidates_match_ref(monkeypatch, M, N, K, G):
    """Every config the chain tuner adds (unsplit, 128-wide hgemv and 32-wide MMA tiles) computes the product,
    with and without silu(gate) * up."""
    w = _weight(N, K, G, True, torch.float16)
    x = _x(M, K, torch.float16) / 4  # silu's exp stays in fp32 range under the interpreter
    monkeypatch.setattr(T, "TUNE", "cold")
    cold = set(T._candidates(M, N, K, False, 132, G)) | set(T._candidates(M, N, K, True, 132, G))
    monkeypatch.setattr(T, "TUNE", "chain")
    for silu in (False, True):
        ref = int4_matmul_silu_mul_ref(x.float(), Int4Weight(w.qweight, w.scales.float(), w.zeros.float(), G)) \
            if silu else _ref(x, w)
        added = [c for c in T._candidates(M, N, K, silu, 132, G) if c not in cold]
        assert added
        for cfg in added:
            y = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, silu=silu, config=cfg)
            assert _rel_err(y, ref) < TOL[torch.float16], (cfg, silu)


def test_auto_tuning_chains_2_to_64_rows(monkeypatch):
    """The default, TUNE = "auto": chained timing (and its short-K candidates) for 2 <= M <= 64, the rows it was
    timed faster at; a single row and prefill-sized calls keep the cold timing."""
    monkeypatch.setattr(T, "TUNE", "auto")
    assert [M for M in (1, 2, 3, 16, 33, 64, 65, 128, 256) if T.chain_timed(M)] == [2, 3, 16, 33, 64]
    monkeypatch.setattr(T, "TUNE", "cold")
    cold = {M: set(T._candidates(M, 960, 576, False, 132, G=32)) for M in (1, 4, 128)}
    monkeypatch.setattr(T, "TUNE", "auto")
    assert {M: set(T._candidates(M, 960, 576, False, 132, G=32)) == c for M, c in cold.items()} == {
        1: True, 4: False, 128: True}
    monkeypatch.setattr(T, "TUNE", "cold")
    assert not any(T.chain_timed(M) for M in (1, 4, 64))


@gpu
def test_gpu_chain_tuner_falls_back_to_cold_timing_when_out_of_memory(monkeypatch, caplog):
    """Chained timing needs weight copies and graph pools; where they do not fit, the tuner times alone."""
    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room for the copies")

    monkeypatch.setattr(T, "TUNE", "chain")
    monkeypatch.setattr(T, "_CONFIG_CACHE", {})
    monkeypatch.setattr(T, "_TUNE_PATH", None)  # an engine built earlier in this process may have named a tune file
    monkeypatch.setattr(T, "_time_chain", no_room)
    w = _weight(960, 576, 32, True, torch.bfloat16, seed=6)
    x = _x(4, 576, torch.bfloat16)
    with caplog.at_level("WARNING", logger="specgate.int4"):
        y = int4_matmul(x, w)
    assert _rel_err(y, _ref(x, w)) < TOL[torch.bfloat16]
    assert len(T._CONFIG_CACHE) == 1 and "ran out of memory" in caplog.text


def test_chain_launches_stream_twice_the_l2():
    assert T.chain_launches(1 << 20, 50 << 20) == 100
    assert T.chain_launches(60 << 20, 50 << 20) == 2  # at least two: the second overlaps the first's tail
    assert T.chain_launches(1 << 10, 50 << 20) == T.CHAIN_MAX_LAUNCHES


@gpu
def test_gpu_chain_tuner_picks_a_candidate_that_computes(monkeypatch):
    """TUNE = "chain" on CUDA: the tuner times candidates in graphs over weight copies, keeps one of them, and the
    call's output matches the reference; the copies and graphs are gone after."""
    monkeypatch.setattr(T, "TUNE", "chain")
    monkeypatch.setattr(T, "_CONFIG_CACHE", {})
    monkeypatch.setattr(T, "_TUNE_PATH", None)  # timed here, not taken from an earlier engine's tune file
    w = _weight(960, 576, 32, True, torch.bfloat16, seed=5)
    before = torch.cuda.memory_allocated()
    for M in (1, 4):
        x = _x(M, 576, torch.bfloat16)
        y = int4_matmul(x, w)
        assert _rel_err(y, _ref(x, w)) < TOL[torch.bfloat16]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert len(T._CONFIG_CACHE) == 2
    for key, pick in T._CONFIG_CACHE.items():  # key[0]: the M bucket
        assert pick in T._candidates(key[0], 960, 576, False, sms, 32), (key, pick)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 64 << 20  # no copy of the weight survives the tuning


@pytest.mark.gpu
@gpu
def test_gpu_graph_replay():
    w = _weight(512, 1024, 128, True, torch.bfloat16)
    x = _x(16, 1024, torch.bfloat16)
    int4_matmul(x, w)  # compile and tune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_matmul(x, w)
    x.copy_(_x(16, 1024, torch.bfloat16, seed=7))
    graph.replay()
    assert _rel_err(y, _ref(x, w)) < TOL[torch.bfloat16]


@gpu
def test_gpu_capture_of_an_unlooked_at_weight():
    """A weight first met inside a graph capture cannot sync to look at its zero points: it takes the
    factored path (right for any zero points) and is looked at on its next eager call."""
    w = _weight(512, 1024, 128, True, torch.bfloat16, seed=3)
    x = _x(16, 1024, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int4_matmul(x, w)
    assert w.whole_zeros is None
    graph.replay()
    assert _rel_err(y, _ref(x, w)) < TOL[torch.bfloat16]
    int4_matmul(x, w)
    assert w.whole_zeros is True


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 2, 16, 64])
def test_gpu_atomic_fix_up_every_candidate(monkeypatch, M):
    """T.FIX_ATOMIC on the GPU: every split-K candidate the tuner would time for an 8B shape, eagerly twice and
    as three launches in one graph (the sums row must come back zeroed each time, PDL overlapping them)."""
    monkeypatch.setattr(T, "FIX_ATOMIC", True)
    N, K, dtype = 4096, 4096, torch.bfloat16
    w = _weight(N, K, 128, True, dtype, seed=M)
    xs = [_x(M, K, dtype, seed=s) for s in range(3)]
    refs = [_ref(x, w) for x in xs]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bad = []
    for cfg in T._candidates(M, N, K, False, sms):
        if cfg.split_k == 1:
            continue
        run = lambda x: T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 128, config=cfg,  # noqa: E731
                                             whole_zeros=True)
        eager = [_rel_err(run(x), r) for x, r in zip(xs[:2], refs)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = [run(x) for x in xs]
        for _ in range(3):
            graph.replay()
        errs = eager + [_rel_err(y, r) for y, r in zip(ys, refs)]
        if not max(errs) < TOL[dtype]:
            bad.append((str(cfg), [round(e, 4) for e in errs]))
    assert not bad, bad


def test_lookahead_lines_cover_the_capped_rows_and_their_scales():
    w = _weight(256, 1024, 128, True, torch.float16)  # words 128 x 256 int32 = 128 KB, scales 8 x 256 fp16 = 4 KB
    assert T.lookahead_lines(w.qweight, w.scales, 1 << 30) == (1024, 32)  # the whole weight
    assert T.lookahead_lines(w.qweight, w.scales, 32 << 10) == (256, 8)  # a quarter of the rows, their scales
    assert T.lookahead_lines(w.qweight, w.scales, 100) == (1, 1)  # rounded up to whole lines


@pytest.mark.parametrize("M", [1, 16])
def test_a_lookahead_leaves_the_result_alone(monkeypatch, M):
    """A lookahead only asks L2 for another weight: on the GPU the kernels compile it in, under the interpreter
    (no PTX) the launch drops it; either way the product is the one without it, bit for bit (serial sums)."""
    monkeypatch.setattr(T, "FIX_ATOMIC", False)
    monkeypatch.setattr(T, "LOOKAHEAD_BYTES", 1 << 20)
    dtype = torch.float16
    w, nxt = _weight(192, 512, 64, True, dtype), _weight(320, 256, 64, False, dtype, seed=3)
    x = _x(M, 512, dtype)
    for cfg in T._candidates(M, 192, 512, False, 132, 64)[:3]:
        run = lambda ahead: T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, 64, config=cfg,  # noqa: E731
                                                 whole_zeros=True, lookahead=ahead)
        assert torch.equal(run((nxt.qweight, nxt.scales)), run(None)), cfg


def test_precompile_builds_every_candidate_as_a_warm_up_on_a_pool(monkeypatch, caplog):
    """The tuner's parallel build: one warm-up launch per candidate (cuBLAS's dequant path has no kernel to
    build), none with one thread, and a failure there is logged, not raised (the launches build one by one)."""
    cands = [T.KernelConfig("hgemv", 1, 512, 64, 8, 4, 2), T.KernelConfig("mma", 16, 128, 128, 4, 4, 3),
             T.KernelConfig("dequant")]
    calls = []

    def run(cfg, warmup=False):
        calls.append((cfg.kind, warmup))

    monkeypatch.setattr(T, "COMPILE_THREADS", 4)
    T._precompile(run, cands)
    assert sorted(calls) == [("hgemv", True), ("mma", True)]
    calls.clear()
    monkeypatch.setattr(T, "COMPILE_THREADS", 1)
    T._precompile(run, cands)
    assert calls == []

    def broken(cfg, warmup=False):
        raise RuntimeError("no driver")

    monkeypatch.setattr(T, "COMPILE_THREADS", 4)
    with caplog.at_level("WARNING", logger="specgate.int4"):
        T._precompile(broken, cands)
    assert "one by one" in caplog.text


@pytest.mark.gpu
@gpu
def test_gpu_precompile_leaves_nothing_for_the_launches_to_build(monkeypatch):
    """After ``_precompile`` every candidate of a shape no test built before launches without a build (the JIT
    caches do not grow), and each computes the product."""
    monkeypatch.setattr(T, "COMPILE_THREADS", 8)
    N, K, G, dtype = 704, 1472, 64, torch.float16  # a shape of its own, so its kernels are not built yet
    w, x = _weight(N, K, G, True, dtype, seed=11), _x(16, K, dtype, seed=12)
    kernels = (T._int4_gemv_f16_kernel, T._int4_gemv_kernel, T._int4_matmul_kernel, T._int4_matmul_t_kernel)
    dev = torch.cuda.current_device()
    built = lambda: sum(len(k.device_caches[dev][0]) for k in kernels if dev in k.device_caches)  # noqa: E731
    cands = [c for c in T._candidates(16, N, K, False, torch.cuda.get_device_properties(0).multi_processor_count, G)
             if c.kind != "dequant"]
    run = lambda c, warmup=False: T._launch(c, x, w.qweight, w.scales, w.zeros, G, None, None, False,  # noqa: E731
                                            torch.empty(16, N, dtype=dtype, device="cuda"), True, warmup=warmup)
    before = built()
    T._precompile(run, cands)
    after = built()
    assert after > before
    ref = _ref(x, w)
    for c in cands:
        y = torch.empty(16, N, dtype=dtype, device="cuda")
        T._launch(c, x, w.qweight, w.scales, w.zeros, G, None, None, False, y, True)
        assert _rel_err(y, ref) < TOL[dtype], c
    assert built() == after
