"""Helpers the backward's GPU tests share (not a test module): seeded inputs that require grad, a spy on the fused
backward's plan (which configuration each backward call takes), and the score_mod pair an upstream user writes."""

import torch


def rand_grad(*shape, dtype=torch.bfloat16, seed=0):
    """N(0, 1) values on the GPU from a seeded generator, in ``dtype``, requiring grad."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype).requires_grad_()


def spy_fused_plan(monkeypatch, configs=None):
    """Record the fused configuration each backward call takes (None: the dK/dV + dQ kernel pair) by wrapping
    dispatch_bwd.fused_plan; returns the list (``configs`` when given)."""
    from flash_attn_4_sm120 import dispatch_bwd

    seen = [] if configs is None else configs
    real = dispatch_bwd.fused_plan

    def spy(plan, device, relay=False):
        fused = real(plan, device, relay)
        seen.append(None if fused is None else fused[0])
        return fused
    monkeypatch.setattr(dispatch_bwd, "fused_plan", spy)
    return seen


def times_two_mods():
    """(score_mod, score_mod_bwd) written as for upstream flash-attn-4: the score doubled (TensorSSA arithmetic,
    keyword indices), its gradient doubled."""
    import cutlass.cute as cute

    @cute.jit
    def times_two(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score * cute.full_like(score, 2.0)

    @cute.jit
    def times_two_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad * cute.full_like(grad, 2.0)
    return times_two, times_two_bwd
