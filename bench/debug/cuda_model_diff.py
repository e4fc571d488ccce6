"""Which kernel moves the CUDA model away from the CPU reference? Swap each dispatcher for its ref."""
import sys
sys.path[:0] = [".", "tests"]
import torch
import target.model as M
import kernels.int4_matmul as I
import kernels.tree_attention as TA
from engine_util import random_weights, tiny_config
from target.batch import Segment, build_batch
from target.model import Transformer
from draft.tree import TokenTree
CFG = dict(vocab=512, layers=4, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=64)
def mixed_forward(model: Transformer) -> torch.Tensor:
    """A prefill chunk of 70 tokens, a 1-token decode and a branching tree over 40 cached tokens."""
    cache = model.new_cache(64, 16)
    a, b, c = cache.new_table(), cache.new_table(), cache.new_table()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    for t in (b, c):
        model.forward(build_batch([Segment(t, 0, ids(40), logits="none")], cache, model.device), cache)
    tree = TokenTree.from_lists(ids(6), [-1, 0, 0, 1, 1, 2])
    segs = [Segment(a, 0, ids(70), logits="all"), Segment(b, 40, ids(1), logits="all"),
            Segment(c, 40, tree.tokens.tolist(), positions=(40 + tree.depths).tolist(),
                    mask_bits=tree.ancestor_bits().tolist(), logits="all")]
    return model.forward(build_batch(segs, cache, model.device), cache)



cfg = tiny_config(**CFG); w = random_weights(cfg, scale=0.05)
def rel(a, b): return float((a.float().cpu() - b).abs().max() / b.abs().max())
ref = mixed_forward(Transformer.from_weights(cfg, w, torch.float32, "cpu").quantize(64))
ref_dense = mixed_forward(Transformer.from_weights(cfg, w, torch.float32, "cpu"))
print("cpu bf16 dense vs fp32 dense", rel(mixed_forward(Transformer.from_weights(cfg, w, torch.bfloat16, "cpu")), ref_dense))
print("cuda bf16 dense vs fp32 dense", rel(mixed_forward(Transformer.from_weights(cfg, w, torch.bfloat16, "cuda")), ref_dense))
print("cuda fp32 dense vs fp32 dense", rel(mixed_forward(Transformer.from_weights(cfg, w, torch.float32, "cuda")), ref_dense))
for g in (64, 128):
    refg = mixed_forward(Transformer.from_weights(cfg, w, torch.float32, "cpu").quantize(g))
    gpu = Transformer.from_weights(cfg, w, torch.bfloat16, "cuda").quantize(g)
    print(g, "all triton", rel(mixed_forward(gpu), refg))
    orig = (M.int4_matmul, M.int4_matmul_silu_mul, M.tree_attention)
    M.int4_matmul = lambda x, w, b=None, residual=None: I.int4_matmul_ref(x, w, b, residual)
    M.int4_matmul_silu_mul = lambda x, w: I.int4_matmul_silu_mul_ref(x, w)
    print(g, "int4 refs, triton attention", rel(mixed_forward(gpu), refg))
    M.tree_attention = lambda *a, **k: TA.tree_attention_ref(*a)
    print(g, "all refs (bf16 cuda)", rel(mixed_forward(gpu), refg))
    M.int4_matmul, M.int4_matmul_silu_mul, _ = orig
    print(g, "triton int4, ref attention", rel(mixed_forward(gpu), refg))
    M.tree_attention = orig[2]
    gpu32 = Transformer.from_weights(cfg, w, torch.float32, "cuda").quantize(g)
    print(g, "fp32 cuda all triton", rel(mixed_forward(gpu32), refg))
