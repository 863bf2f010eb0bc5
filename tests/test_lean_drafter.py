"""The drafter's lean forward: close to ``DrafterModel.forward``, the same bits alone or batched, and
what the drafter proposer runs on a CPU in float32."""

import pytest
import torch
from torch import nn

from dartree import kernels
from dartree.drafter import DrafterConfig, DrafterModel
from dartree.lean_drafter import LeanDrafterWeights, lean_draft_forward, lean_logits
from dartree.proposers.drafter import DraftProposer, draft_batch
from dartree.targets.lean import KVStore

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no compiler for the lean kernels")

HIDDEN, VOCAB, TAPPED = 64, 101, 2


def tiny_drafter(seed: int = 0, draft_vocab_size: int | None = 64) -> tuple[DrafterModel, nn.Embedding]:
    cfg = DrafterConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=6, num_target_layers=4,
                        mask_token_id=VOCAB - 1, target_layer_ids=[1, 2], rope_theta=10_000.0, shift_label=True,
                        draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    model = DrafterModel(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return model.eval(), nn.Embedding(VOCAB, HIDDEN)


def states(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, TAPPED * HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("products", ["float32", "q8_0"])
def test_lean_drafter_follows_the_module_forward(products):
    model, embed = tiny_drafter()
    lean = LeanDrafterWeights(model, model.lm_head, products)
    store = KVStore(lean, slots=1, capacity=8)  # grown on the way
    reference = DraftProposer(model, embed, model.lm_head)
    reference.lean = reference.store = None  # the module forward
    tol = 2e-4 if products == "float32" else 0.15
    context = 0
    for step, new in enumerate([9, 1, 3, 2, 14]):  # a prompt, then rounds reading 1-14 new positions
        start = context + new
        tapped = states(new, step)
        want = reference.draft(7 + step, tapped, start)
        embeds = model.block_embeddings(embed, torch.tensor([7 + step]))
        hidden = lean_draft_forward(lean, [store], embeds, [tapped], [start])[0]
        torch.testing.assert_close(hidden, want.hidden, rtol=0, atol=tol)
        torch.testing.assert_close(lean_logits(lean, hidden), want.base_logits, rtol=0, atol=4 * tol)
        assert store.lengths[0] == start  # the context kept, the block not
        context = start


def test_lean_drafter_batched_gives_each_request_its_alone_bits():
    model, embed = tiny_drafter(1)
    alone = [DraftProposer(model, embed, model.lm_head) for _ in range(3)]
    batched = [DraftProposer(model, embed, model.lm_head) for _ in range(3)]
    assert all(p.lean is not None for p in alone + batched)  # float32 on a CPU: the lean forward
    prompts = [5, 11, 2]
    for i, n in enumerate(prompts):
        for group in (alone, batched):
            group[i].draft(3, states(n, 10 + i), n)
    starts = [n + 1 + i for i, n in enumerate(prompts)]  # 1, 2 and 3 new positions
    new = [states(s - n, 20 + i) for i, (s, n) in enumerate(zip(starts, prompts))]
    want = [p.draft(4 + i, f, s) for i, (p, f, s) in enumerate(zip(alone, new, starts))]
    got = draft_batch(batched, [4, 5, 6], new, starts)
    for w, g in zip(want, got):
        assert torch.equal(w.hidden, g.hidden) and torch.equal(w.base_logits, g.base_logits)
    for p, s in zip(batched, starts):
        assert p.context_length == s
        p.reset()
        assert p.context_length == 0


def test_lean_weights_follow_the_drafters_weights_when_they_change():
    """Training's evaluation loads new weights into the same drafter each time (``load_state_dict``, in
    place): the next proposer must draft with them, not with the lean copies of the first evaluation."""
    from dartree.lean_drafter import lean_weights_of

    model, embed = tiny_drafter(2)
    first = lean_weights_of(model, model.lm_head)
    assert lean_weights_of(model, model.lm_head) is first  # unchanged weights: prepared once
    tapped = states(5, 0)
    held = DraftProposer(model, embed, model.lm_head)  # made before the change, as a pipeline's own proposer is
    before = held.draft(3, tapped, 5)
    newer, _ = tiny_drafter(3)
    model.load_state_dict(newer.state_dict())
    second = lean_weights_of(model, model.lm_head)
    assert second is not first
    want = DraftProposer(newer, embed, newer.lm_head).draft(3, tapped, 5)
    after = DraftProposer(model, embed, model.lm_head).draft(3, tapped, 5)
    held.reset()  # a new prompt
    again = held.draft(3, tapped, 5)
    assert not torch.equal(want.base_logits, before.base_logits)
    assert torch.equal(after.base_logits, want.base_logits) and torch.equal(again.base_logits, want.base_logits)


def test_released_float_weights_draft_the_same_and_say_how_to_keep_them(tmp_path):
    from dartree.errors import DartreeError
    from dartree.lean_drafter import lean_weights_of, release_float_weights
    from dartree.loading import save_drafter

    model, embed = tiny_drafter(4)
    kept, _ = tiny_drafter(4)
    dropped = release_float_weights(model, model.lm_head)
    linears = [model.fc, model.lm_head] + [m for layer in model.layers for m in (*layer.self_attn.children(), *layer.mlp.children())
                                           if isinstance(m, nn.Linear)]
    assert dropped == sum(m.weight.numel() * 4 for m in {id(m): m for m in linears}.values())
    assert model.float_weights_released and all(m.weight.device.type == "meta" for m in linears)
    assert model.norm.weight.device.type == "cpu"
    for step, new in enumerate([7, 2, 5]):  # the proposers made after the release draft as before it
        a = DraftProposer(model, embed, model.lm_head).draft(4 + step, states(new, step), new)
        b = DraftProposer(kept, embed, kept.lm_head).draft(4 + step, states(new, step), new)
        assert torch.equal(a.base_logits, b.base_logits) and torch.equal(a.hidden, b.hidden)
    proposer = DraftProposer(model, embed, model.lm_head)
    proposer.lean = proposer.store = None  # the module forward
    with pytest.raises(DartreeError, match="keep_drafter_weights=True"):
        proposer.draft(4, states(3, 0), 3)
    with pytest.raises(DartreeError, match="keep_drafter_weights=True"):
        lean_weights_of(model, model.lm_head, "float32")  # new lean copies need the float weights
    with pytest.raises(DartreeError, match="keep_drafter_weights=True"):
        save_drafter(model, tmp_path / "released")  # it would write no weights


def test_releasing_a_drafter_without_its_own_output_layer_keeps_the_targets():
    """A drafter over the target's vocabulary drafts with the target's output layer: that weight is not the drafter's
    to drop."""
    from dartree.lean_drafter import release_float_weights

    model, embed = tiny_drafter(5, draft_vocab_size=None)
    kept, _ = tiny_drafter(5, draft_vocab_size=None)
    assert model.lm_head is None
    target_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    release_float_weights(model, target_head)
    assert model.float_weights_released and target_head.weight.device.type == "cpu"
    for step, new in enumerate([6, 3]):
        a = DraftProposer(model, embed, target_head).draft(2 + step, states(new, 10 + step), new)
        b = DraftProposer(kept, embed, target_head).draft(2 + step, states(new, 10 + step), new)
        assert torch.equal(a.base_logits, b.base_logits)
