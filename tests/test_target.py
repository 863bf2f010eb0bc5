"""The Hugging Face target (``targets.hf``): tapped states, the tree forward with its ancestor mask, and KV compaction."""

import pytest
import torch
from conftest import FAMILIES
from transformers import AutoModelForCausalLM

from dartree.targets import HFTarget, forward_tree, prefill
from dartree.trees import DraftTree
from dartree.verify import ancestor_matrix, follow_tree


@pytest.fixture(scope="module", params=FAMILIES)
def hf_model(request, model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs[(request.param, "target")], dtype=torch.float64)


def test_hooks_equal_hf_hidden_states(hf_model):
    layers = [0, 1, 2]  # HF's last hidden_states entry is after the final norm, so the last layer is not compared
    adapter = HFTarget(hf_model, layers)
    ids = torch.tensor([3, 1, 4, 1, 5])
    _, feats = prefill(adapter, ids)
    ref = hf_model(ids[None], output_hidden_states=True).hidden_states
    h = hf_model.config.hidden_size
    for j, layer in enumerate(layers):
        torch.testing.assert_close(feats[:, j * h:(j + 1) * h], ref[layer + 1][0], rtol=0, atol=1e-12)
    adapter.close()


def sample_tree():
    # root 0; node rows 1..6:  1(d1) 2(d1) 3(d2, parent 1) 4(d2, parent 1) 5(d3, parent 4) 6(d2, parent 2)
    return DraftTree.from_lists([5, 6, 1, 2, 7, 3], [0, 0, 1, 1, 4, 2], [1, 1, 2, 2, 3, 2])


def test_ancestor_matrix():
    vis = ancestor_matrix(sample_tree())
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 4, 5}, 6: {0, 2, 6}}
    for row, cols in want.items():
        assert set(torch.nonzero(vis[row]).flatten().tolist()) == cols


def test_tree_mask_is_additive_and_sees_the_prefix(hf_model):
    adapter = HFTarget(hf_model, [])
    prefill(adapter, torch.tensor([1, 2, 3]))
    mask = adapter.tree_mask(ancestor_matrix(sample_tree()))
    assert mask.shape == (1, 1, 7, 3 + 7)
    assert torch.all(mask[..., :3] == 0)
    assert mask[0, 0, 5, 3 + 4] == 0 and mask[0, 0, 5, 3 + 2] == torch.finfo(torch.float64).min


def test_tree_mask_reuses_one_buffer_across_rounds(hf_model):
    """Rounds of different sizes at a growing context get the mask a fresh build gives (no -inf left
    over from an earlier round's window), all as views of one buffer while it is large enough."""
    import random

    def fresh(visibility, past):
        mask = torch.zeros(1, 1, visibility.shape[0], past + visibility.shape[0], dtype=torch.float64)
        mask[0, 0, :, past:].masked_fill_(~visibility, torch.finfo(torch.float64).min)
        return mask

    rng = random.Random(0)
    adapter = HFTarget(hf_model, [])
    prefill(adapter, torch.tensor([1, 2, 3]))
    storage = set()
    for _ in range(12):
        n = rng.randint(1, 9)
        parents = [rng.randint(0, i) for i in range(n)]  # node i's parent row: the root (0) or a node before it
        depths = []
        for p in parents:
            depths.append(1 if p == 0 else depths[p - 1] + 1)
        vocab = hf_model.config.vocab_size
        tree = DraftTree.from_lists([rng.randrange(vocab) for _ in range(n)], parents, depths)
        vis = ancestor_matrix(tree)
        mask = adapter.tree_mask(vis)
        assert torch.equal(mask, fresh(vis, adapter.cache_length))
        storage.add(mask.untyped_storage().data_ptr())
        rows, tree_depths = tree.rows(rng.randrange(vocab))
        forward_tree(adapter, rows, tree_depths, vis)  # the cache grows by the tree; keep a prefix
        adapter.keep(0, adapter.cache_length - len(rows), torch.arange(rng.randint(1, len(rows))))
    assert len(storage) == 1


def test_tree_forward_equals_sequential_forward_on_every_path(hf_model):
    """Each node's logits equal a plain causal forward over prefix + its root-to-node path."""
    prefix = [4, 0, 6]
    tree = sample_tree()
    adapter = HFTarget(hf_model, [1])
    prefill(adapter, torch.tensor(prefix))
    root = 2
    rows, depths = tree.rows(root)
    logits, feats = forward_tree(adapter, rows, depths, ancestor_matrix(tree))
    parents = [-1] + tree.parents.tolist()
    for row in range(len(rows)):
        path, r = [], row
        while r != -1:
            path.append(int(rows[r]))
            r = parents[r]
        seq = torch.tensor([prefix + path[::-1]])
        out = hf_model(seq, output_hidden_states=True)
        torch.testing.assert_close(logits[row], out.logits[0, -1], rtol=0, atol=1e-10)
        torch.testing.assert_close(feats[row], out.hidden_states[2][0, -1], rtol=0, atol=1e-10)


def test_compaction_keeps_the_accepted_path(hf_model):
    prefix = [4, 0, 6]
    tree = sample_tree()
    adapter = HFTarget(hf_model, [])
    prefill(adapter, torch.tensor(prefix))
    rows, depths = tree.rows(2)
    forward_tree(adapter, rows, depths, ancestor_matrix(tree))
    accepted = torch.tensor([0, 1, 4, 5])  # root -> 5 -> 2 -> 7
    adapter.keep(0, len(prefix), accepted)
    assert adapter.cache_length == len(prefix) + 4
    # Continuing from the compacted cache equals a fresh forward over the committed sequence.
    next_logits, _ = forward_tree(adapter, torch.tensor([1]), torch.tensor([0]))
    committed = prefix + rows[accepted].tolist() + [1]
    ref = hf_model(torch.tensor([committed])).logits[0, -1]
    torch.testing.assert_close(next_logits[0], ref, rtol=0, atol=1e-10)
    # and the cache itself equals the fresh cache of the committed tokens
    fresh = HFTarget(hf_model, [])
    prefill(fresh, torch.tensor(committed[:-1]))
    for a, b in zip(adapter.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.keys[:, :, : len(committed) - 1], b.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(a.values[:, :, : len(committed) - 1], b.values, rtol=0, atol=1e-10)


def test_walk_follows_matching_children():
    tree = sample_tree()
    # target choices per row: root picks 5 (row 1), row 1 picks 2 (row 4), row 4 picks 7 (row 5), row 5 picks 0
    choices = torch.tensor([5, 2, 9, 9, 7, 0, 9])
    accepted, bonus = follow_tree(tree, choices)
    assert accepted == [0, 1, 4, 5] and bonus == 0
    accepted, bonus = follow_tree(tree, torch.tensor([3, 0, 0, 0, 0, 0, 0]))
    assert accepted == [0] and bonus == 3


def test_a_round_commits_the_greedy_path_and_compacts_the_cache(hf_model):
    """The round's verify: one forward over [root, tree], the walk, the compaction. A tree holding
    the greedy continuation among decoys commits exactly that continuation and leaves the cache as if
    the committed tokens had been fed one by one."""
    from conftest import hf_greedy

    from dartree.engine import Request, run_round
    from dartree.trees import DraftTree, TreeBuilder, TreeSettings
    from dartree.verify import Sampler

    prefix, root = [4, 0, 6], 2
    greedy = hf_greedy(hf_model, prefix + [root], 4)
    decoy = [(t + 1) % 8 for t in greedy]
    # rows: 1 decoy(d1), 2 greedy[0], 3 decoy(d2) under 2, 4 greedy[1] under 2, 5 greedy[2] under 4
    tree = DraftTree.from_lists([decoy[0], greedy[0], decoy[1], greedy[1], greedy[2]], [0, 0, 2, 2, 4], [1, 1, 2, 2, 3])

    class FixedTree(TreeBuilder):
        name = "fixed"

        def build(self, draft, head, size):
            return tree

    class NoDraft:  # a proposer (``proposers.base.Proposer``) whose proposal the fixed tree ignores
        name, reads_tapped_states, head, batch_key, num_depths = "no-draft", True, None, None, 3

        def __init__(self):
            self.seen = []

        def observe(self, tokens, tapped_states):
            self.seen.append((tokens.tolist(), tapped_states))

        @classmethod
        def propose_batch(cls, proposers, bonuses, positions):
            assert bonuses == [root] and positions == [len(prefix)]
            assert [len(t) for t, _ in proposers[0].seen] == [len(prefix)]  # it has seen the prompt's rows
            return ["no draft: the fixed tree ignores it"]

    adapter = HFTarget(hf_model, [1])
    adapter.capture = True
    _, features = prefill(adapter, torch.tensor(prefix))
    proposer = NoDraft()
    proposer.observe(torch.tensor(prefix), features)
    request = Request(torch.tensor(prefix), FixedTree(TreeSettings()), Sampler(0.0), 10, set(), proposer=proposer,
                      slot=0, output=[root], prefilled=len(prefix), bonus=root, drafted=True)
    run_round(adapter, [request])
    assert request.stats.acceptance_lengths == [4] and request.stats.tree_sizes == [5]
    assert request.output == [root] + greedy[:4] and request.bonus == greedy[3]
    tokens, tapped = proposer.seen[-1]  # the proposer is shown the accepted path with its tapped states
    assert tokens == [root] + greedy[:3] and tapped.shape[0] == 4
    assert adapter.cache_length == len(prefix) + 4
    fresh = HFTarget(hf_model, [])
    prefill(fresh, torch.tensor(prefix + [root] + greedy[:3]))
    for a, b in zip(adapter.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-10)


def test_the_walk_asks_for_the_likely_path_first_then_the_likeliest_other_rows():
    """One output-layer batch holds the drafter's likely path, then the other rows the walk may reach,
    most probable first, up to OUTPUT_ROWS_PER_ASK; a branch outside it costs one more batch, of rows
    below where the walk is and not yet known, and rows the walk cannot reach are never computed."""
    from dartree.trees import DraftTree
    from dartree.verify import OUTPUT_ROWS_PER_ASK as ask
    from dartree.verify import first_ask, walk

    # rows: 1 = a (root), 2 = b (root, better), 3 = c under a, 4 = d under b, 5 = e under a
    tree = DraftTree.from_lists([10, 11, 12, 13, 14], [0, 0, 1, 2, 1], [1, 1, 2, 2, 2])
    tree.log_probs = torch.tensor([-2.0, -1.0, -2.5, -1.5, -3.0])
    choices = {0: 11, 1: 14, 2: 13, 3: 0, 4: 0, 5: 0}
    asked = []

    def choose(rows):
        asked.append(list(rows))
        return [choices[r] for r in rows]

    assert ask >= 6 and first_ask(tree) == [0, 2, 4, 1, 3, 5]  # path b, d; then a, c, e by probability
    assert walk(tree, choose) == ([0, 2, 4], 0)
    assert asked == [[0, 2, 4, 1, 3, 5]]
    choices[0] = 10  # the target prefers a: no second ask, every row was in the first
    asked.clear()
    assert walk(tree, choose) == ([0, 1, 5], 0)
    assert asked == [[0, 2, 4, 1, 3, 5]]

    # a root with ask + 2 children, the first ask + 1 of them with a child each: rows 1..n are the
    # children (decreasing probability), rows n+1.. their children
    n = ask + 2
    kids = ask + 1
    parents = [0] * n + list(range(1, kids + 1))
    scores = [-float(i) for i in range(1, n + 1)] + [-float(i) - 0.5 for i in range(1, kids + 1)]
    big = DraftTree.from_lists(list(range(100, 100 + n + kids)), parents, [1] * n + [2] * kids)
    big.log_probs = torch.tensor(scores)
    first = first_ask(big)
    # the likely path (root, child 1, its child), then the rest by probability: child 2, its child, ...
    expected = [0, 1, n + 1]
    for i in range(2, n + 1):
        expected += [i] + ([n + i] if i <= kids else [])
    assert first == expected[:ask]
    target = {r: 0 for r in range(len(big) + 1)}
    target[0] = 100 + n - 1  # the target picks the root's last child (row n), outside the first ask
    asked.clear()
    assert walk(big, lambda rows: (asked.append(list(rows)), [target[r] for r in rows])[1]) == ([0, n], 0)
    assert asked == [first, [n]]  # the second ask: row n only (it has no children)
    assert set(asked[0]) | set(asked[1]) <= set(range(len(big) + 1)) and len(asked[0]) == ask


def test_the_walk_asks_for_a_long_likely_path_a_batch_at_a_time():
    """A chain longer than OUTPUT_ROWS_PER_ASK: the output layer runs on the first batch of the path,
    and on the next batch only when the target accepts all of the first."""
    from dartree.trees import DraftTree
    from dartree.verify import OUTPUT_ROWS_PER_ASK as ask
    from dartree.verify import walk

    n = 2 * ask + 3
    chain = DraftTree.chain(torch.arange(100, 100 + n))
    accept_all = {row: 100 + row for row in range(n + 1)}  # row r's choice is the token of row r + 1
    asked = []

    def choose(rows):
        asked.append(list(rows))
        return [accept_all.get(r, 0) for r in rows]

    assert walk(chain, choose) == (list(range(n + 1)), 100 + n)
    assert asked == [list(range(0, ask)), list(range(ask, 2 * ask)), list(range(2 * ask, n + 1))]
    asked.clear()
    accept_all[2] = 0  # rejected at row 2: one batch, never the rest of the chain
    assert walk(chain, choose) == ([0, 1, 2], 0)
    assert asked == [list(range(0, ask))]


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_targets_run_bf16_attention_in_float32_on_cpu(family, model_dirs, monkeypatch):
    """load_target's attention is HF's SDPA, upcast to fp32 for a bf16 CPU model (torch's bf16 CPU
    kernel is slower than fp32's): fp32 models are unchanged bit for bit, and a bf16 model calls SDPA
    with fp32 q/k/v and returns bf16 states close to the fp32 model's."""
    from transformers.integrations import sdpa_attention

    import dartree.attention as attention
    import dartree.loading as loading

    path = model_dirs[(family, "target")]
    ids = torch.tensor([[3, 1, 4, 1, 5, 7, 2, 6]])
    fp32 = loading.load_target(path, torch.float32, "cpu")
    assert fp32.config._attn_implementation == attention.ATTENTION
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    loading.cpu_products(plain)  # the same products, so only the attention differs
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(fp32(ids).logits, want)
        seen = []
        real = sdpa_attention.sdpa_attention_forward
        monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda m, q, *a, **k: seen.append(q.dtype) or real(m, q, *a, **k))
        bf16 = loading.load_target(path, torch.bfloat16, "cpu")
        got = bf16(ids).logits
    assert got.dtype == torch.bfloat16 and seen and set(seen) == {torch.float32}
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.1 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_cpu_cache_keeps_kv_in_float32_with_the_same_outputs(family, model_dirs):
    """A bf16 CPU target's attention runs in fp32, so its KV cache stores fp32 (no cast of the whole
    cache at each step); bf16 -> fp32 is exact, so prefill and steps give bit-identical logits to a
    bf16 cache. A model with plain SDPA keeps K/V in its own dtype (its attention wants them so)."""
    import dartree.attention as attention
    import dartree.loading as loading
    from dartree.targets.hf import growing_cache

    path = model_dirs[(family, "target")]
    model = loading.load_target(path, torch.bfloat16, "cpu")
    assert attention.kv_cache_dtype(model) == torch.float32
    assert attention.kv_cache_dtype(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")) == torch.bfloat16
    assert attention.kv_cache_dtype(loading.load_target(path, torch.float32, "cpu")) == torch.float32
    ids = torch.tensor([[3, 1, 4, 1, 5, 7, 2, 6]])
    outs = {}
    for store in (torch.float32, torch.bfloat16):
        cache = growing_cache(model.config, store)
        with torch.no_grad():
            logits = [model(ids[:, :5], cache=cache, use_cache=True).logits[0, -1]]
            logits += [model(ids[:, k:k + 1], cache=cache, use_cache=True).logits[0, -1] for k in range(5, 8)]
        assert cache.layers[0].keys.dtype == store and cache.get_seq_length() == 8
        outs[store] = torch.stack(logits)
    assert torch.equal(outs[torch.float32], outs[torch.bfloat16])


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_float_targets_run_their_products_on_cpu_linears(family, model_dirs):
    """fp32/fp64 CPU targets keep Hugging Face's weights (same state dict, row-major, a tied output
    layer still shared with the embedding) but every Linear is a CpuLinear (fp32 on oneDNN-packed
    weights where torch has oneDNN); logits match the model as Hugging Face loads it, over one row,
    a few rows and many; bf16 models keep plain Linears (oneDNN already)."""
    import dartree.loading as loading
    import dartree.products as products

    path = model_dirs[(family, "target")]
    ids = torch.tensor([[3, 1, 4, 1, 5, 7, 2, 6, 9, 8, 3, 2]])
    assert ids.shape[1] > products.FEW_ROWS
    for dtype in (torch.float32, torch.float64):
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model = loading.load_target(path, dtype, "cpu")
        ids = ids % plain.config.vocab_size
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is products.CpuLinear and m.weight.is_contiguous() for m in linears)
        assert all(m.pack_weights == products.onednn_packing_available() for m in linears)
        if plain.config.tie_word_embeddings:
            assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        for (name, want), (_, got) in zip(plain.state_dict().items(), model.state_dict().items()):
            assert torch.equal(want, got), name
        assert model.state_dict().keys() == plain.state_dict().keys()
        tol = {} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
        with torch.no_grad():
            want = plain(ids).logits
            for rows in range(1, ids.shape[1] + 1):  # prefixes: products over 1 .. 12 rows
                torch.testing.assert_close(model(ids[:, :rows]).logits, want[:, :rows], **tol)
    bf16 = loading.load_target(path, torch.bfloat16, "cpu")
    assert all(type(m) is torch.nn.Linear for m in bf16.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("pack", [True, False])
def test_cpu_linear_matches_linear_for_any_rows_shape_and_bias(pack):
    """CpuLinear equals F.linear for 0 to 70 rows in any leading shape, with and without bias: fp32
    on packed weights (oneDNN) or weight-first, fp64 weight-first. The packed copy follows in-place
    changes and replacements of the weights, a module pickles (the packed copy is made again on
    use), and while autograd records the product is F.linear (gradients flow)."""
    import io

    from dartree.products import CpuLinear, cpu_products, onednn_packing_available

    if pack and not onednn_packing_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    shapes = [(1, 7), (2, 7), (1, 1, 7), (1, 3, 7), (2, 2, 7), (1, 6, 7), (1, 9, 7), (0, 7), (3, 3, 7), (1, 17, 7), (70, 7)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-13)):
        for bias in (True, False):
            layer = torch.nn.Linear(7, 5, bias=bias, dtype=dtype)
            fast = torch.nn.Sequential(torch.nn.Linear(7, 5, bias=bias, dtype=dtype))
            fast[0].load_state_dict(layer.state_dict())
            cpu_products(fast, pack=pack)
            assert type(fast[0]) is CpuLinear and fast[0].pack_weights == pack
            for _ in range(2):  # the second pass runs on the copy packed by the first
                for shape in shapes:
                    x = torch.randn(*shape, dtype=dtype)
                    with torch.no_grad():
                        got = fast(x)
                    assert got.shape == (*shape[:-1], 5)
                    torch.testing.assert_close(got, layer(x).detach(), rtol=tol, atol=tol)
                with torch.no_grad():  # in place, as load_state_dict or an optimizer step does
                    layer.weight.mul_(-2.0)
                    fast[0].weight.mul_(-2.0)
            with torch.no_grad():  # a replaced weight is packed anew too
                fast(torch.randn(2, 7, dtype=dtype))  # packs the weight in its present version
                layer.weight.copy_(torch.randn(5, 7, dtype=dtype))
                replacement = torch.nn.Parameter(layer.weight.detach().clone())
                while replacement._version < fast[0].weight._version:  # the same version number as the old one
                    replacement.add_(0)
                fast[0].weight = replacement
                x = torch.randn(4, 7, dtype=dtype)
                torch.testing.assert_close(fast(x), layer(x), rtol=tol, atol=tol)
            x = torch.randn(3, 7, dtype=dtype)
            fast(x).sum().backward()
            layer(x).sum().backward()
            torch.testing.assert_close(fast[0].weight.grad, layer.weight.grad, rtol=tol, atol=tol)
            buffer = io.BytesIO()
            torch.save(fast, buffer)
            buffer.seek(0)
            with torch.no_grad():
                torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), layer(x), rtol=tol, atol=tol)



def test_without_working_onednn_packing_linears_stay_weight_first(monkeypatch):
    """Where the packed product is missing or fails (another platform or torch build), loading
    keeps the weight-first products: CpuLinears that do not pack and still equal F.linear."""
    import types

    import dartree.products as products

    def broken(*args, **kwargs):
        raise RuntimeError("no oneDNN here")

    fake_ops = types.SimpleNamespace(_reorder_linear_weight=broken, _linear_pointwise=broken)
    monkeypatch.setattr(products.torch.ops, "mkldnn", fake_ops)
    products.onednn_packing_available.cache_clear()
    try:
        assert not products.onednn_packing_available()
        model = torch.nn.Sequential(torch.nn.Linear(6, 4))
        want = model(torch.ones(3, 6)).detach()
        products.cpu_products(model)
        assert type(model[0]) is products.CpuLinear and not model[0].pack_weights
        with torch.no_grad():
            torch.testing.assert_close(model(torch.ones(3, 6)), want)
    finally:
        monkeypatch.undo()
        products.onednn_packing_available.cache_clear()


def test_weights_are_packed_only_while_the_copy_fits_in_memory(monkeypatch):
    """The packed copy doubles a model's weights: cpu_products packs only while that copy takes at
    most PACKED_SHARE_OF_MEMORY of the machine's memory."""
    import dartree.products as products

    if not products.onednn_packing_available():
        pytest.skip("this torch build has no oneDNN")
    model = torch.nn.Sequential(torch.nn.Linear(100, 100))  # 40 kB of fp32 weights
    monkeypatch.setattr(products, "_physical_memory", lambda: 100_000)  # a quarter: 25 kB
    products.cpu_products(model)
    assert not model[0].pack_weights
    monkeypatch.setattr(products, "_physical_memory", lambda: 1_000_000)
    products.cpu_products(model)
    assert model[0].pack_weights
