"""Drafter backbone and heads: on-disk format, KV-cache cropping, label conventions, head maths."""

import json

import pytest
import torch
from tiny import make_tiny_drafter

from dartree.drafter import DrafterConfig, default_target_layer_ids
from dartree.proposers import DraftProposer
from dartree.loading import load_drafter, save_drafter


def test_published_default_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("head", [None, "domino", "markov"])
def test_save_load_round_trip(model_dirs, tmp_path, head):
    src = model_dirs[("llama", head)]
    model = load_drafter(src, dtype=torch.float64)
    save_drafter(model, tmp_path / "copy")
    again = load_drafter(tmp_path / "copy", dtype=torch.float64)
    assert json.loads((src / "config.json").read_text()) == json.loads((tmp_path / "copy" / "config.json").read_text())
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_on_disk_names_are_the_published_ones(model_dirs):
    from safetensors import safe_open

    names = set(safe_open(str(model_dirs[("llama", "domino")] / "model.safetensors"), "pt").keys())
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight", "prefix_gru.weight_ih_l0",
                 "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"):
        assert name in names
    markov = set(safe_open(str(model_dirs[("llama", "markov")] / "model.safetensors"), "pt").keys())
    assert {"markov_w1.weight", "markov_w2.weight"} <= markov
    cfg = json.loads((model_dirs[("llama", "domino")] / "config.json").read_text())
    assert cfg["dflash_config"]["projector_type"] == "domino" and cfg["dflash_config"]["shift_label"] is True


def test_legacy_projector_name(model_dirs):
    raw = json.loads((model_dirs[("llama", "domino")] / "config.json").read_text())
    raw["dflash_config"]["projector_type"] = "causal_v5"
    assert DrafterConfig.from_dict(raw).projector_type == "domino"


@pytest.mark.parametrize("shift", [False, True])
def test_label_convention_sets_the_number_of_depths(model_dirs, tmp_path, shift):
    from transformers import AutoModelForCausalLM

    target_dir = model_dirs[("llama", "target")]
    d = make_tiny_drafter(tmp_path / "d", target_dir, head=None, block_size=6, shift_label=shift)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    proposer = DraftProposer(load_drafter(d, dtype=torch.float64), target.get_input_embeddings(), target.get_output_embeddings())
    feats = torch.randn(3, 2 * 32, dtype=torch.float64)
    out = proposer.draft(bonus=1, new_tapped_states=feats, start=3)
    assert out.hidden.shape[0] == out.base_logits.shape[0] == (6 if shift else 5)


def test_drafter_cache_is_cropped_to_the_context(model_dirs):
    """Feeding the context in pieces over several rounds equals feeding it at once."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dirs[("llama", "target")], dtype=torch.float64)
    model = load_drafter(model_dirs[("llama", "domino")], dtype=torch.float64)
    feats = torch.randn(9, 64, dtype=torch.float64)
    a = DraftProposer(model, target.get_input_embeddings(), target.get_output_embeddings())
    a.draft(2, feats[:4], 4)
    assert a.cache.length == 4
    a.draft(3, feats[4:7], 7)
    last = a.draft(5, feats[7:], 9)
    b = DraftProposer(model, target.get_input_embeddings(), target.get_output_embeddings())
    whole = b.draft(5, feats, 9)
    torch.testing.assert_close(last.base_logits, whole.base_logits, rtol=0, atol=1e-10)


def test_gru_step_equals_torch_gru(model_dirs):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dirs[("llama", "target")], dtype=torch.float64)
    head = load_drafter(model_dirs[("llama", "domino")], dtype=torch.float64).head
    head.bind(target.get_input_embeddings())
    tokens = torch.tensor([3, 1, 4, 1, 5])
    ref, _ = head.prefix_gru(target.get_input_embeddings()(tokens)[None])
    state = head.initial_state(int(tokens[0]))
    torch.testing.assert_close(state[0], ref[0, 0])
    for i in range(1, len(tokens)):
        state = head.advance(state, tokens[i:i + 1])
        torch.testing.assert_close(state[0], ref[0, i])


@pytest.mark.parametrize("head_kind", ["domino", "markov"])
def test_teacher_forced_block_logits_equal_incremental_logits(model_dirs, head_kind):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dirs[("llama", "target")], dtype=torch.float64)
    head = load_drafter(model_dirs[("llama", head_kind)], dtype=torch.float64).head
    head.bind(target.get_input_embeddings())
    q = 5
    hidden = torch.randn(1, q, 32, dtype=torch.float64)
    base = target.get_output_embeddings()(hidden)
    prev = torch.tensor([[2, 7, 1, 0, 3]])  # slot k conditions on prev[:k+1]
    block = head.block_logits(hidden, base, prev)[0]
    rnd = head.start_round(hidden[0], base[0])
    state = head.initial_state(int(prev[0, 0]))
    for k in range(q):
        torch.testing.assert_close(block[k], head.logits(rnd, k, state)[0], rtol=0, atol=1e-10)
        if k + 1 < q:
            state = head.advance(state, prev[0, k + 1:k + 2])
    if head_kind == "domino":
        torch.testing.assert_close(block[0], base[0, 0])  # pure-draft prefix slot


@pytest.mark.parametrize("head", [None, "domino"])
def test_one_batched_draft_call_equals_each_request_drafted_alone(model_dirs, head):
    """draft_batch pads the requests' new context rows and cached keys to the longest and masks the
    padding: each request's draft and its drafter cache afterwards equal its own call's."""
    import dartree
    from dartree.proposers import draft_batch

    pipe = dartree.load(model_dirs[("llama", "target")], model_dirs[("llama", head)], dtype="float64")
    width = len(pipe.drafter.config.target_layer_ids) * pipe.target_model.config.hidden_size
    gen = torch.Generator().manual_seed(0)

    def proposer():
        return DraftProposer(pipe.drafter, pipe.target.embed_tokens, pipe.target.lm_head)

    # three requests with 0, 5 and 11 cached context rows, then 1, 4 and 2 new ones
    history = [[], [5], [7, 4]]
    new_rows = [1, 4, 2]
    batched, alone = [proposer() for _ in history], [proposer() for _ in history]
    for b, a, sizes in zip(batched, alone, history):
        start = 0
        for n in sizes:
            f = torch.randn(n, width, generator=gen, dtype=torch.float64)
            b.draft(3, f, start + n)
            a.draft(3, f, start + n)
            start += n
    starts = [sum(h) + n for h, n in zip(history, new_rows)]
    feats = [torch.randn(n, width, generator=gen, dtype=torch.float64) for n in new_rows]
    bonuses = [4, 1, 2]
    together = draft_batch(batched, bonuses, feats, starts)
    for out, a, bonus, f, start, b in zip(together, alone, bonuses, feats, starts, batched):
        ref = a.draft(bonus, f, start)
        torch.testing.assert_close(out.hidden, ref.hidden, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.base_logits, ref.base_logits, rtol=1e-10, atol=1e-10)
        assert b.cache.length == a.cache.length == start
        for kb, ka in zip(b.cache.keys + b.cache.values, a.cache.keys + a.cache.values):
            torch.testing.assert_close(kb, ka, rtol=1e-10, atol=1e-10)


def test_drafters_with_one_backbone_share_its_file(model_dirs, tmp_path):
    """A Markov drafter on the Domino drafter's frozen backbone writes only its head, names the
    shared file in config.json and loads back equal; a backbone that differs is refused."""
    import shutil

    from safetensors import safe_open

    from dartree.errors import CheckpointError

    domino = load_drafter(model_dirs[("llama", "domino")], dtype=torch.float64)
    markov = load_drafter(model_dirs[("llama", "markov")], dtype=torch.float64)
    backbone = {k: v for k, v in domino.state_dict().items() if not k.startswith("head.")}
    markov.load_state_dict({**markov.state_dict(), **backbone})  # the Markov head on the Domino backbone
    save_drafter(domino, tmp_path / "domino")
    save_drafter(markov, tmp_path / "markov", shared_backbone="../domino/model.safetensors")
    names = set(safe_open(str(tmp_path / "markov" / "model.safetensors"), "pt").keys())
    assert names == {"markov_w1.weight", "markov_w2.weight"}
    assert json.loads((tmp_path / "markov" / "config.json").read_text())["backbone_weights"] == "../domino/model.safetensors"
    again = load_drafter(tmp_path / "markov", dtype=torch.float64)
    a, b = markov.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_drafter(model_dirs[("qwen3", "domino")], dtype=torch.float64)
    save_drafter(other, tmp_path / "other")
    with pytest.raises(CheckpointError, match="backbones differ"):
        save_drafter(markov, tmp_path / "markov2", shared_backbone="../other/model.safetensors")
    shutil.rmtree(tmp_path / "domino")
    with pytest.raises(CheckpointError, match="backbone_weights"):
        load_drafter(tmp_path / "markov")


def test_the_shipped_markov_drafter_reads_the_domino_drafters_backbone():
    from dartree.default_model import default_drafter_dir

    shipped = default_drafter_dir().parent
    domino, markov = load_drafter(shipped / "smollm2-drafter-domino"), load_drafter(shipped / "smollm2-drafter-markov")
    assert markov.config.projector_type == "markov"
    a, b = domino.state_dict(), markov.state_dict()
    shared = [k for k in a if not k.startswith("head.")]
    assert shared and all(torch.equal(a[k], b[k]) for k in shared)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_depth_limit_runs_a_shorter_block_and_keeps_the_context(model_dirs, dtype):
    """A proposer's depth_limit makes the call run only the block positions those depths need (on the
    module forward in float64, on the lean kernels in float32): its draft is the drafter's output for
    that shorter block, and the context it keeps is the same as after a full-depth call. In a batch the
    deepest limit counts, and one request without a limit makes the whole block run."""
    import dartree
    from dartree.proposers import draft_batch
    from dartree.proposers.drafter import block_length

    pipe = dartree.load(model_dirs[("llama", "target")], model_dirs[("llama", "domino")], dtype=dtype)
    cfg = pipe.drafter.config
    full = cfg.num_draft_depths
    assert block_length(cfg, [None]) == cfg.block_size and block_length(cfg, [2, None]) == cfg.block_size
    assert block_length(cfg, [2, 3]) == (3 if cfg.shift_label else 4) and block_length(cfg, [99]) == cfg.block_size
    width = len(cfg.target_layer_ids) * pipe.target_model.config.hidden_size
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    states = [torch.randn(n, width, generator=gen, dtype=torch.float64).to(torch_dtype) for n in (4, 2)]
    made = [DraftProposer(pipe.drafter, pipe.target.embed_tokens, pipe.target.lm_head) for _ in range(3)]
    outs = {}
    for limit, p in zip((None, 2, 1), made):
        p.depth_limit = limit
        p.draft(3, states[0], 4)
        outs[limit] = p.draft(5, states[1], 6)
    assert outs[None].base_logits.shape[0] == full
    assert outs[2].base_logits.shape[0] == 2 and outs[1].base_logits.shape[0] == 1
    # the shorter block's draft is what the drafter computes for a block of that length
    ref = DraftProposer(pipe.drafter, pipe.target.embed_tokens, pipe.target.lm_head)
    ref.draft(3, states[0], 4)
    short, configured = block_length(cfg, [2]), cfg.block_size
    object.__setattr__(cfg, "block_size", short)  # a drafter configured with the shorter block
    try:
        want = ref.draft(5, states[1], 6)
    finally:
        object.__setattr__(cfg, "block_size", configured)
    torch.testing.assert_close(outs[2].base_logits, want.base_logits, rtol=0, atol=0)
    assert not torch.equal(outs[2].base_logits, outs[None].base_logits[:2])  # a different draft, not a slice
    # the next full call after a short one equals the next full call after a full one
    follow = torch.randn(3, width, generator=gen, dtype=torch.float64).to(torch_dtype)
    made[1].depth_limit = made[0].depth_limit = None
    torch.testing.assert_close(made[1].draft(7, follow, 9).base_logits, made[0].draft(7, follow, 9).base_logits, rtol=0, atol=0)
    # in a batch: the deepest limit, or every depth where one request has none
    a, b = (DraftProposer(pipe.drafter, pipe.target.embed_tokens, pipe.target.lm_head) for _ in range(2))
    a.depth_limit, b.depth_limit = 1, 3
    drafts = draft_batch([a, b], [1, 2], [states[0], states[1]], [4, 2])
    assert [d.base_logits.shape[0] for d in drafts] == [3, 3]
    a.depth_limit, b.depth_limit = 1, None
    drafts = draft_batch([a, b], [1, 2], [states[1][:1], states[0][:1]], [5, 3])
    assert [d.base_logits.shape[0] for d in drafts] == [full, full]
