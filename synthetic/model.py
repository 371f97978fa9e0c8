"""The one-layer factual-recall transformer of the paper, addressable with llmprobe's hook names.

Forward pass for a token sequence ``ids`` [b, t] (ids as in :mod:`synthetic.tasks`: subjects, then relations)::

    x          = E[ids] (+ P[:t] when positional embeddings are on)         blocks.0.resid_pre   [b, t, d]
    attn       = uniform causal mean of x  (or learned softmax attention)   blocks.0.attn_out    [b, t, d]
    mid        = x + attn                                                   blocks.0.resid_mid   [b, t, d]
    hidden     = relu(mid W_in + b_in)                                      blocks.0.mlp_hidden  [b, t, m]
    mlp        = hidden W_out + b_out                                       blocks.0.mlp_out     [b, t, d]
    post       = mid + mlp                                                  blocks.0.resid_post  [b, t, d]
    logits     = post U^T (+ c)                                             over the n_outputs attributes

``E`` is two tables: subject embeddings [N, d] (trainable, or frozen at their random init) and relation embeddings
[R, d]; ``frozen_unembed`` also freezes the attribute unembedding U at its random init (then only the relation
embeddings and the MLP learn: the associative-memory regime of earlier work). Uniform attention is the paper's
simplest case and has no parameters: position t reads the mean of positions 0..t (for the one-hop input (s, r)
the last state is x_r + (x_s + x_r)/2). Learned attention is one causal softmax head with W_Q, W_K, W_V, W_O.
There is no layer norm. The MLP width defaults to 8d (docs/synthetic.md: it lowers d* against 4d).

The ``nn.Identity`` modules returned by :meth:`FactRecallModel.hook_points` are called on the real tensors, so
``llmprobe.model.capture`` and ``llmprobe.model.capture.patch`` read and edit this model exactly as they do a Hugging Face one.
Training uses :meth:`FactRecallModel.loss`, which computes states only at target positions and a chunked, fused
softmax cross-entropy whose gradient is formed during the forward pass (the N-way softmax dominates the cost).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmprobe.names import EMBEDDING_MODES

HOOK_NAMES = ("blocks.0.resid_pre", "blocks.0.attn_out", "blocks.0.resid_mid", "blocks.0.mlp_hidden",
              "blocks.0.mlp_out", "blocks.0.resid_post")


@dataclass
class ModelConfig:
    """Architecture of :class:`FactRecallModel`. ``d_mlp`` None = 8 * d_model (see docs/synthetic.md)."""

    n_subjects: int
    n_relations: int
    n_outputs: int
    d_model: int
    d_mlp: int | None = None
    max_len: int = 2
    attention: str = "uniform"          # "uniform" | "learned"
    frozen_subjects: bool = False
    frozen_unembed: bool = False        # also freeze the attribute unembedding (all-random associative memory)
    pos_embed: bool | None = None       # None: on when max_len > 2 (k-hop needs word order)
    unembed_bias: bool = False
    embed_std: float = 1.0              # N(0, embed_std^2) subject / relation embeddings
    unembed_std: float | None = None    # None: 1/sqrt(d_model)
    seed: int = 0
    model_type: str = "synthetic-fact-recall"

    def __post_init__(self):
        if self.d_mlp is None:
            self.d_mlp = 8 * self.d_model
        if self.pos_embed is None:
            self.pos_embed = self.max_len > 2
        if self.attention not in ("uniform", "learned"):
            raise ValueError(f"attention must be 'uniform' or 'learned', not {self.attention!r}")

    @property
    def vocab_size(self) -> int:
        return self.n_subjects + self.n_relations

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict) -> "ModelConfig":
        known = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def mode_flags(mode: str) -> dict[str, bool]:
    """The :class:`ModelConfig` flags that an embedding mode sets (:data:`llmprobe.names.EMBEDDING_MODES`), e.g.
    ``frozen_all`` -> {"frozen_subjects": True, "frozen_unembed": True}; ``trainable`` -> {}."""
    if mode not in EMBEDDING_MODES:
        raise ValueError(f"unknown embedding mode {mode!r}; choose from {', '.join(EMBEDDING_MODES)}")
    return {flag: True for flag in EMBEDDING_MODES[mode]}


class FactRecallModel(nn.Module):
    """One-layer transformer for (s, r) -> a recall; see the module docstring for the forward pass."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        d, m = c.d_model, c.d_mlp
        g = torch.Generator().manual_seed(int(c.seed))
        self.subject_embed = nn.Parameter(torch.randn(c.n_subjects, d, generator=g) * c.embed_std,
                                          requires_grad=not c.frozen_subjects)
        self.relation_embed = nn.Parameter(torch.randn(c.n_relations, d, generator=g) * c.embed_std)
        self.pos = nn.Parameter(torch.zeros(c.max_len, d)) if c.pos_embed else None
        if c.attention == "learned":
            s = 1.0 / math.sqrt(d)
            self.W_Q = nn.Parameter(torch.randn(d, d, generator=g) * s)
            self.W_K = nn.Parameter(torch.randn(d, d, generator=g) * s)
            self.W_V = nn.Parameter(torch.randn(d, d, generator=g) * s)
            self.W_O = nn.Parameter(torch.randn(d, d, generator=g) * s)
        bound_in, bound_out = 1.0 / math.sqrt(d), 1.0 / math.sqrt(m)
        self.W_in = nn.Parameter((torch.rand(d, m, generator=g) * 2 - 1) * bound_in)
        self.b_in = nn.Parameter((torch.rand(m, generator=g) * 2 - 1) * bound_in)
        self.W_out = nn.Parameter((torch.rand(m, d, generator=g) * 2 - 1) * bound_out)
        self.b_out = nn.Parameter((torch.rand(d, generator=g) * 2 - 1) * bound_out)
        ustd = c.unembed_std if c.unembed_std is not None else 1.0 / math.sqrt(d)
        self.unembed_weight = nn.Parameter(torch.randn(c.n_outputs, d, generator=g) * ustd,
                                           requires_grad=not c.frozen_unembed)
        self.unembed_bias = nn.Parameter(torch.zeros(c.n_outputs)) if c.unembed_bias else None
        # hook points, in forward order
        self.hook_resid_pre = nn.Identity()
        self.hook_attn_out = nn.Identity()
        self.hook_resid_mid = nn.Identity()
        self.hook_mlp_hidden = nn.Identity()
        self.hook_mlp_out = nn.Identity()
        self.hook_resid_post = nn.Identity()

    # ------------------------------------------------------------------ naming / readout API
    def hook_points(self) -> dict[str, nn.Module]:
        """llmprobe hook names -> the ``nn.Identity`` modules that sit on those tensors in :meth:`forward`."""
        return {
            "blocks.0.resid_pre": self.hook_resid_pre,
            "blocks.0.attn_out": self.hook_attn_out,
            "blocks.0.resid_mid": self.hook_resid_mid,
            "blocks.0.mlp_hidden": self.hook_mlp_hidden,
            "blocks.0.mlp_out": self.hook_mlp_out,
            "blocks.0.resid_post": self.hook_resid_post,
        }

    def subject_embeddings(self) -> torch.Tensor:
        """Subject embedding table [N, d] (what enters the residual stream at a subject token)."""
        return self.subject_embed.detach()

    def relation_embeddings(self) -> torch.Tensor:
        return self.relation_embed.detach()

    def attribute_vectors(self) -> torch.Tensor:
        """Unembedding rows, one per output attribute [n_outputs, d]."""
        return self.unembed_weight.detach()

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Residual states [..., d] -> logits [..., n_outputs] (no final norm in this model)."""
        logits = resid @ self.unembed_weight.T
        return logits + self.unembed_bias if self.unembed_bias is not None else logits

    def n_params(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return {"total": total, "trainable": trainable}

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = torch.cat([self.subject_embed, self.relation_embed], dim=0)
        x = F.embedding(input_ids, table)
        if self.pos is not None:
            x = x + self.pos[: input_ids.shape[1]]
        return x

    def _attend(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Attention output at ``positions`` (all when None) for inputs x [b, t, d]."""
        t = x.shape[1]
        if self.config.attention == "uniform":
            if positions is None:
                count = torch.arange(1, t + 1, device=x.device, dtype=x.dtype)[None, :, None]
                return x.cumsum(dim=1) / count
            if t == 2 and positions.numel() == 1 and int(positions[0]) == 1:
                return ((x[:, 0] + x[:, 1]) * 0.5)[:, None]
            count = (positions + 1).to(x.dtype)[None, :, None]
            return x.cumsum(dim=1)[:, positions] / count
        q_pos = torch.arange(t, device=x.device) if positions is None else positions.to(x.device)
        q = x[:, q_pos] @ self.W_Q
        k = x @ self.W_K
        v = x @ self.W_V
        scores = q @ k.transpose(1, 2) / math.sqrt(self.config.d_model)
        mask = torch.arange(t, device=x.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v @ self.W_O

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, t, n_outputs] at every position (the one-hop answer is at the last position)."""
        x = self.hook_resid_pre(self.embed(input_ids))
        attn = self.hook_attn_out(self._attend(x, None))
        mid = self.hook_resid_mid(x + attn)
        hidden = self.hook_mlp_hidden(torch.relu(mid @ self.W_in + self.b_in))
        mlp = self.hook_mlp_out(hidden @ self.W_out + self.b_out)
        post = self.hook_resid_post(mid + mlp)
        return self.unembed(post)

    def final_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Residual stream after the block at ``positions`` only [b, k, d] (training path, no hooks)."""
        x = self.embed(input_ids)
        mid = x[:, positions] + self._attend(x, positions)
        hidden = torch.relu(mid @ self.W_in + self.b_in)
        return mid + hidden @ self.W_out + self.b_out

    def loss(self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
             chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy over all targets [b, k] and the number of correct predictions (strict argmax: the
        target is the unique maximum, a tie counts as wrong)."""
        h = self.final_states(input_ids, positions).reshape(-1, self.config.d_model)
        return softmax_cross_entropy(h, self.unembed_weight, self.unembed_bias, targets.reshape(-1), chunk)

    @torch.no_grad()
    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Argmax output ids [b, k] at ``positions`` (chunked so the [b, n_outputs] logits stay small)."""
        out = []
        for i in range(0, input_ids.shape[0], chunk):
            h = self.final_states(input_ids[i:i + chunk], positions)
            out.append(self.unembed(h).argmax(-1))
        return torch.cat(out) if out else torch.empty(0, positions.numel(), dtype=torch.long)


class _SoftmaxCE(torch.autograd.Function):
    """Mean softmax cross-entropy of ``h @ W.T (+ b)`` against ``targets``, in row chunks, with the gradient
    formed in the forward pass (one fused softmax, in place; no [B, n] tensor is kept for backward), and the number
    of correct predictions (strict argmax). One model: h [B, d], weight [n, d], bias [n] or None, targets [B] ->
    (loss, correct) scalars. M stacked models (:mod:`synthetic.batched`): a leading model dimension, h [M, B, D],
    weight [M, n, D], bias [M, n] or None, targets [M, B] -> (loss [M], correct [M])."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk):
        stacked = h.dim() == 3
        B = h.shape[-2]
        if not chunk:
            chunk = max(1, auto_chunk(weight.shape[-2], h.device) // (h.shape[0] if stacked else 1))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        gb = torch.zeros_like(bias) if (bias is not None and need_b) else None
        loss = torch.zeros(h.shape[:-2], dtype=torch.float64, device=h.device)
        correct = torch.zeros(h.shape[:-2], dtype=torch.long, device=h.device)
        wt = weight.transpose(-1, -2)
        for i in range(0, B, chunk):
            hc, yc = h[..., i:i + chunk, :], targets[..., i:i + chunk, None]
            if stacked:
                logits = torch.baddbmm(bias[:, None], hc, wt) if bias is not None else torch.bmm(hc, wt)
            else:
                logits = torch.addmm(bias, hc, wt) if bias is not None else hc @ wt
            p = torch.softmax(logits, dim=-1)
            del logits
            pt = p.gather(-1, yc)[..., 0]
            loss -= pt.clamp_min(1e-30).log().sum(-1).double()
            p.scatter_add_(-1, yc, torch.full(yc.shape, -1.0, dtype=p.dtype, device=p.device))   # softmax - onehot
            # correct = the target's probability is the row's *unique* maximum: a tie is not correct (strict
            # argmax). After the subtraction the target's entry is pt - 1 <= 0 and every other entry is >= 0, so the
            # row's max is the largest *other* probability: one amax pass (argmax is ~10x slower)
            correct += (pt > p.amax(-1)).sum(-1)
            if gh is not None:
                if stacked:
                    gh[:, i:i + chunk] = torch.bmm(p, weight)
                else:
                    torch.mm(p, weight, out=gh[i:i + chunk])
            if gw is not None:
                if stacked:
                    gw.baddbmm_(p.transpose(1, 2), hc)
                else:
                    gw.addmm_(p.t(), hc)
            if gb is not None:
                gb += p.sum(-2)
        scale = 1.0 / max(B, 1)
        for g in (gh, gw, gb):
            if g is not None:
                g.mul_(scale)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (gh, gw, gb)))
        ctx.has = (gh is not None, gw is not None, gb is not None)
        return (loss * scale).to(h.dtype), correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        saved = ctx.saved_tensors
        grads = [saved[i] * grad_loss.reshape(grad_loss.shape + (1,) * (saved[i].dim() - grad_loss.dim()))
                 if ctx.has[i] else None for i in range(3)]
        return grads[0], grads[1], grads[2], None, None


def auto_chunk(n_outputs: int, device) -> int:
    """Rows per softmax chunk: about 1 MiB of logits on CPU (cache-resident), large chunks on GPUs."""
    if torch.device(device).type != "cpu":
        return max(1024, (1 << 26) // max(1, n_outputs))
    return int(min(4096, max(32, (1 << 18) // max(1, n_outputs))))


def softmax_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                          chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean CE loss, number correct) for logits ``h @ weight.T + bias``; memory O(chunk * n_outputs). One model
    (h [B, d]: scalars) or a stack with a leading model dimension (h [M, B, D]: [M] each); see :class:`_SoftmaxCE`."""
    return _SoftmaxCE.apply(h, weight, bias, targets, chunk)
