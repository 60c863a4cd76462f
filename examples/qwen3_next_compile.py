"""A tiny transformers Qwen3-Next (random weights) under ``torch.compile(model, backend=qla_compile.backend)``.

Prints eager vs compiled time per training step on CPU and the ``explain`` report.  Run:
``python examples/qwen3_next_compile.py``.
"""
import time

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

import qla_compile


def tiny_model():
    cfg = Qwen3NextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg)


def step_seconds(fn, model, ids, repeats=3):
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn(ids, use_cache=False).logits.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 512))
    print(qla_compile.explain(model, ids, use_cache=False))

    compiled = torch.compile(model, backend=qla_compile.backend)
    start = time.perf_counter()
    step_seconds(compiled, model, ids, repeats=1)
    print(f"first compiled step (compile included): {time.perf_counter() - start:.1f} s")
    eager = step_seconds(model, model, ids)
    fast = step_seconds(compiled, model, ids)
    print(f"train step, T=512, CPU: eager {eager:.3f} s, compiled {fast:.3f} s ({eager / fast:.2f}x)")


if __name__ == "__main__":
    main()
