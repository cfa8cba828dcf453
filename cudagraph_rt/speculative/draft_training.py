"""``cgrt train-drafter --kind model``: a small Llama of the target's vocabulary trained on
the target's own generations (next-token cross-entropy on the generated positions), saved
as a transformers checkpoint folder (``--drafter model:PATH`` loads it)."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .training import Corpus, TrainReport, _autocast, optimizer_step

__all__ = ["draft_acceptance", "train_draft_model"]


def _batch(corpus: Corpus, rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, L] (right-padded with 0) and a mask of the positions whose next token
    is a generated one (the prompt's last position onward)."""
    seqs = [corpus.sequences[i] for i in rows]
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.int64)
    mask = torch.zeros(len(seqs), L - 1, dtype=torch.bool)
    for b, (i, s) in enumerate(zip(rows, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        first = len(s) - int(corpus.lengths[i]) - 1  # the prompt's last position
        mask[b, first:len(s) - 1] = True
    return ids.to(device), mask.to(device)


@torch.no_grad()
def draft_acceptance(lm, corpus: Corpus, k: int) -> tuple[float, tuple[float, ...]]:
    """Greedy acceptance of a draft LM on ``corpus`` (teacher-forced: accepted drafts equal
    the target's tokens, so draft j from position p is accepted iff the LM's argmax is
    right at p .. p + j - 1). (mean accepted of k, per position)."""
    if not len(corpus.sequences):
        return 0.0, (0.0,) * k
    ids, mask = _batch(corpus, list(range(len(corpus.sequences))), next(lm.parameters()).device)
    right = (lm(input_ids=ids).logits[:, :-1].argmax(-1) == ids[:, 1:]) & mask
    per, run = [], mask.clone()
    for j in range(k):
        run = run & torch.roll(right, -j, 1) & torch.roll(mask, -j, 1) if j else run & right
        starts = mask.clone()
        if j:
            starts[:, -j:] = False
        per.append(float(run[starts].float().mean()) if starts.any() else 0.0)
    return float(sum(per)), tuple(per)


def train_draft_model(target, train: Corpus, held: Corpus, *, out: str, steps: int, batch: int, lr: float,
                      hidden: int | None, layers: int, k: int, seed: int, on_step=None) -> TrainReport:
    """Build a Llama (``hidden`` wide, default a quarter of the target's and at least 64;
    ``layers``; the target's vocabulary and max_len), train it for ``steps`` AdamW steps of
    ``batch`` sequences (capped at the corpus), save it to ``out``."""
    from ..models.hf import _transformers

    tf = _transformers()
    cfg = target.config
    width = hidden or max(64, cfg.hidden // 4)
    heads = max(1, width // 64)
    conf = tf.LlamaConfig(vocab_size=cfg.vocab, hidden_size=width, intermediate_size=4 * width,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          head_dim=width // heads, max_position_embeddings=max(cfg.max_len, 128),
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    dev = target.device
    lm = tf.LlamaForCausalLM(conf).to(dev)
    before = draft_acceptance(lm.eval(), held, k)
    opt = torch.optim.AdamW(lm.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    g = torch.Generator().manual_seed(seed)
    n = len(train.sequences)
    losses = []
    lm.train()
    t0 = time.perf_counter()
    for i in range(steps):
        rows = torch.randint(n, (min(batch, n),), generator=g).tolist()
        ids, mask = _batch(train, rows, dev)
        with _autocast(dev):
            logits = lm(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.float()[mask], ids[:, 1:][mask])
        optimizer_step(loss, lm, opt, sched, losses, on_step, i)
    seconds = time.perf_counter() - t0
    lm.eval()
    after = draft_acceptance(lm, held, k)
    lm.to(cfg.dtype).save_pretrained(out)
    return TrainReport(tuple(float(x) for x in torch.stack(losses).cpu()), seconds, int(train.rows.shape[0]), k,
                       before, after, 1.0)
