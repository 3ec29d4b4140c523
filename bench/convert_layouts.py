"""Measured effect of each difference between the paper and clean delta layouts (docs/CONVERSION.md).

    python bench/convert_layouts.py [--layers 12] [--seed 0]

A tiny Llama-shaped decoder (d=64, 4 heads, H=8 routing heads, blocks of 4 layers) gets
"trained-like" routing parameters (gates 0.1, pseudo-queries N(0, 0.5), key norms 1 + N(0, 0.1),
null N(0, 0.1)); each row compares two models that differ in one point only, as the relative
logit difference max|a - b| / max|a| in fp64. At gates 0 every row is exactly 0 (the identity).
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from mhar_titan.convert.delta import delta_args
from mhar_titan.models import ModelArgs, Transformer


def backbone(n_layers: int) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32,
                     norm_eps=1e-5, qk_norm=False, tie_embeddings=False)


def build(args: ModelArgs, seed: int, scale: float) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(scale / 0.02)  # activation RMS ~ scale
    return model


def trained_like(model: Transformer, seed: int, final_gate: float = 0.0) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    r = model.routing
    with torch.no_grad():
        r.alpha.fill_(0.1)
        r.query.copy_(torch.randn(r.query.shape, generator=g, dtype=torch.float64) * 0.5)
        r.key_norm.copy_(1 + 0.1 * torch.randn(r.key_norm.shape, generator=g, dtype=torch.float64))
        null = 0.1 * torch.randn(model.args.dim, generator=g, dtype=torch.float64)
        r.null_source.copy_(null.expand_as(r.null_source))
        if model.plan.final is not None:
            r.alpha[-1] = final_gate


def share(paper: Transformer, clean: Transformer) -> None:
    """Give the clean model the paper model's backbone and per-site routing rows (final site apart)."""
    clean.load_state_dict({k: v for k, v in paper.state_dict().items() if not k.startswith("routing.")}, strict=False)
    with torch.no_grad():
        for name in ("query", "key_norm", "alpha"):
            getattr(clean.routing, name)[:-1].copy_(getattr(paper.routing, name))
        clean.routing.null_source.copy_(paper.routing.null_source[0])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(opts.seed))
    rows = []
    for n_layers, what in ((8, "3 timing (2 blocks closed: block sources identical)"),
                           (12, "3 + 4 timing and block sources (3 blocks closed)")):
        base = backbone(n_layers)
        paper = build(delta_args(base, "paper"), opts.seed, 0.02)
        trained_like(paper, opts.seed)
        clean = build(delta_args(base, "clean", routing_eps=1e-5), opts.seed, 0.02)
        share(paper, clean)
        rows.append((f"{what}, L={n_layers}", rel(logits(paper, tokens), logits(clean, tokens))))
    base = backbone(8)
    clean = build(delta_args(base, "clean", routing_eps=1e-5), opts.seed, 0.02)
    trained_like(clean, opts.seed, final_gate=0.0)
    with_final = build(delta_args(base, "clean", routing_eps=1e-5), opts.seed, 0.02)
    with_final.load_state_dict(clean.state_dict())
    with torch.no_grad():
        with_final.routing.alpha[-1] = 0.1
    rows.append(("2 final routing site (gate 0.1 vs none)", rel(logits(with_final, tokens), logits(clean, tokens))))
    for scale in (0.02, 0.01):
        eps5 = build(delta_args(base, "clean", routing_eps=1e-5), opts.seed, scale)
        trained_like(eps5, opts.seed)
        eps6 = build(dataclasses.replace(eps5.args, routing_eps=1e-6), opts.seed, scale)
        eps6.load_state_dict(eps5.state_dict())
        rows.append((f"5 routing eps 1e-5 vs 1e-6, activation RMS {scale}", rel(logits(eps5, tokens), logits(eps6, tokens))))
    print("| layout point | relative logit difference |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value:.2e} |")


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
