"""How far rounding moves the logits of ``bench/model.py``'s dense and MoE models, on any machine (transformers'
PyTorch GDN, eager, no grad): bf16 against the fp32 model, and a 1e-3 relative perturbation of one GDN layer's
output against plain bf16. A model whose logits move far under either (top-k expert routing flipping) cannot
check a GDN kernel through its logits.

    python bench/model_sensitivity.py [--T 512]
"""
import argparse
import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import rel_l2  # noqa: E402
from bench.model import config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=512)
    args = ap.parse_args()
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    m.torch_chunk_gated_delta_rule = inspect.unwrap(m.torch_chunk_gated_delta_rule)  # the PyTorch GDN, any device
    ids = torch.randint(0, 4096, (1, args.T), generator=torch.Generator().manual_seed(args.T))
    for kind in ("dense", "moe"):
        torch.manual_seed(0)
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**config(kind))).eval()
        with torch.no_grad():
            fp32 = model(input_ids=ids, use_cache=False).logits
            bf16 = model.to(torch.bfloat16)(input_ids=ids, use_cache=False).logits
            hook = model.model.layers[0].linear_attn.out_proj.register_forward_pre_hook(
                lambda _, a: (a[0] * (1 + 1e-3 * torch.randn_like(a[0])),))
            noisy = model(input_ids=ids, use_cache=False).logits
            hook.remove()
        print(f"{kind}: bf16 vs fp32 {rel_l2(bf16, fp32):.4f}; bf16 with 1e-3 noise on one GDN output vs bf16 "
              f"{rel_l2(noisy, bf16):.4f}", flush=True)


if __name__ == "__main__":
    main()
