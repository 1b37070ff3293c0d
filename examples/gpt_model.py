"""The model and the data of the two example loops: a small GPT and a seeded sampler over a token corpus.

Nothing here knows about sdcguard. ``gpt_ddp_plain.py`` trains this model
with a plain DDP loop; ``gpt_ddp_guarded.py`` trains it under the guard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model."""

    vocab: int = 256
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out.

    Not ``F.scaled_dot_product_attention``: the fused attention kernels' backward
    on GPUs is not deterministic, and the guard's audit compares bits.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = self.attn_drop(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        return self.resid_drop(self.proj((attn @ v).transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, a head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(_init)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def param_groups(self, weight_decay: float) -> list[dict[str, object]]:
        """AdamW groups: weight decay on matrices and embeddings, none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of one micro-batch (in fp32, also under autocast)."""
    inputs, targets = batch
    logits = module(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TokenSampler:
    """Micro-batches of windows from a fixed token corpus, chosen by a generator seeded from (step, rank).

    ``sampler(step, rank)`` is what ``rank`` trains on at ``step``: a list of
    ``accum`` micro-batches of (inputs, targets), each ``[micro_batch, seq]``.
    Any rank can compute any other rank's batch, and a restarted job sees the
    same data at the same step. The last tenth of the corpus is held out for
    evaluation.
    """

    def __init__(self, cfg: GPTConfig, micro_batch: int, accum: int, device: torch.device, *, seed: int = 0,
                 corpus_tokens: int = 1 << 16) -> None:
        self.cfg, self.micro_batch, self.accum, self.device, self.seed = cfg, micro_batch, accum, device, seed
        self.corpus = _markov_corpus(cfg.vocab, corpus_tokens, seed)
        self.split = corpus_tokens - corpus_tokens // 10

    def __call__(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 65_537 + rank)
        return [self._windows(torch.randint(self.split - self.cfg.seq - 1, (self.micro_batch,), generator=g))
                for _ in range(self.accum)]

    def held_out(self, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Evaluation batches from the held-out tail (the same on every rank)."""
        g = torch.Generator().manual_seed(self.seed + 7)
        span = len(self.corpus) - self.split - self.cfg.seq - 1
        return [self._windows(self.split + torch.randint(span, (self.micro_batch,), generator=g))
                for _ in range(batches)]

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = starts[:, None] + torch.arange(self.cfg.seq + 1)
        tokens = self.corpus[index].to(self.device)
        return tokens[:, :-1], tokens[:, 1:]


def _markov_corpus(vocab: int, tokens: int, seed: int) -> torch.Tensor:
    """A token stream from a fixed random Markov chain: each token has a few likely successors, so it is learnable."""
    g = torch.Generator().manual_seed(seed)
    transitions = (torch.randn(vocab, vocab, generator=g) * 3.0).softmax(dim=-1)
    chains, length = 256, -(-tokens // 256)
    out = torch.empty(chains, length, dtype=torch.int64)
    out[:, 0] = torch.randint(vocab, (chains,), generator=g)
    for i in range(1, length):
        out[:, i] = torch.multinomial(transitions[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out.reshape(-1)[:tokens]
