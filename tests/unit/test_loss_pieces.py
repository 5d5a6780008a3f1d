"""The LM head and the loss in pieces (issue 31.3, ``trainer.loss_chunk_tokens``): the same loss, gradients and
logits as one piece, and autograd keeps no logits for the backward (each piece is made again in its own
backward: torch.utils.checkpoint)."""
from __future__ import annotations

import pytest
import torch

from helpers.config import compose
from hybridtrain.models.stages import one_process_model
from hybridtrain.plan import model_config

B, S, VOCAB = 2, 32, 8000


def _step(overrides: tuple, chunk: int, ids, labels):
    """Loss, flat gradient and logits of one weighted micro-batch, and the largest tensor (in elements) with the
    vocabulary as its last dimension that autograd saved for the backward."""
    cfg = compose(*overrides, f"trainer.loss_chunk_tokens={chunk}")
    model = one_process_model(cfg, model_config(cfg))
    pos = torch.arange(S).expand(B, S)
    largest = [0]

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == VOCAB:
            largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model((ids, pos), (labels, torch.tensor(0.25)))
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    with torch.no_grad():
        logits = model.logits((ids, pos))
    return loss.detach(), grads, logits, largest[0]


@pytest.mark.parametrize("overrides", [("+recipe=gpt_tiny",), ("+recipe=llama_tiny", "model.config.tie_word_embeddings=false")],
                         ids=["tied_head", "lm_head"])  # the embedding as the head, and an LM head of its own
def test_pieces_give_the_loss_gradients_and_logits_of_one_piece(overrides):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, S))
    labels = torch.randint(0, VOCAB, (B, S))
    labels[0, :5] = -100  # a piece with fewer loss tokens
    whole = _step(overrides, B * S, ids, labels)
    pieces = _step(overrides, 7, ids, labels)  # 64 tokens in pieces of 7: they cross the rows' boundary
    assert torch.equal(pieces[0], whole[0]) or abs(float(pieces[0] - whole[0])) <= 1e-6 * abs(float(whole[0]))
    assert torch.allclose(pieces[1], whole[1], rtol=0, atol=1e-5 * float(whole[1].abs().max()))  # fp32 sum order
    assert torch.equal(pieces[2], whole[2])  # logits for export checks: the head asked to compute them
    assert whole[3] >= B * S * VOCAB  # one piece: the micro-batch's logits kept for the backward
    assert pieces[3] == 0  # in pieces: no logits kept at all; each piece is made again in its own backward
