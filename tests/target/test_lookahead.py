"""The forward names each INT4 projection's lookahead (``SPECGATE_INT4_LOOKAHEAD``): the projection it runs after
the latency-bound kernels that follow (qkv -> o across RoPE and attention, o -> gate_up across RMSNorm, down ->
the next layer's qkv), and nothing after the last layer. On the CPU the reference path ignores it; the kernels'
side is tested in tests/kernels/test_int4_matmul.py and, compiled for sm_90, in tests/test_sass_bench.py."""

from __future__ import annotations

import torch

import target.model as model_mod
from engine_util import random_weights, tiny_config
from target.batch import Segment, build_batch
from target.model import Transformer


def _on_the_int4_path(model: Transformer) -> Transformer:
    """Drop the CPU's dequantized copies, so every projection calls the INT4 entry points (their reference path
    on the CPU), as a CUDA model's do."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.dequantized = lin.cpu_int4 = None
    return model


def test_each_projection_names_the_next_one_across_the_small_kernels(monkeypatch):
    cfg = tiny_config(vocab=128, layers=3, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    model = _on_the_int4_path(Transformer.from_weights(cfg, random_weights(cfg), torch.float32, "cpu").quantize(32))
    calls = []

    def record(name, fn):
        def wrapped(x, w, *args, lookahead=None, **kw):
            calls.append((name, w, lookahead))
            return fn(x, w, *args, **kw)
        monkeypatch.setattr(model_mod, name, wrapped)

    for name in ("int4_matmul", "int4_matmul_silu_mul", "int4_qkv_rope_cache"):
        record(name, getattr(model_mod, name))
    cache = model.new_cache(16, 16)
    model.forward(build_batch([Segment(cache.new_table(), 0, list(range(1, 9)), logits="last")], cache, "cpu"), cache)
    layers = model.layers
    want = []
    for i, layer in enumerate(layers):
        after = layers[i + 1].qkv.weight if i + 1 < len(layers) else None
        want += [("int4_qkv_rope_cache", layer.qkv.weight, layer.o.weight),
                 ("int4_matmul", layer.o.weight, layer.gate_up.weight),
                 ("int4_matmul_silu_mul", layer.gate_up.weight, None),
                 ("int4_matmul", layer.down.weight, after)]
    assert [(n, id(w), id(a)) for n, w, a in calls[: len(want)]] == [(n, id(w), id(a)) for n, w, a in want]


def test_a_projection_off_the_int4_path_is_never_a_lookahead():
    cfg = tiny_config(vocab=128, layers=1, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    model = Transformer.from_weights(cfg, random_weights(cfg), torch.float32, "cpu").quantize(32)
    layer = model.layers[0]
    assert layer.o.dequantized is not None and layer.o.int4 is None  # the CPU multiplies its dequantized copy
    assert _on_the_int4_path(model).layers[0].o.int4 is layer.o.weight
