"""The lean forward: row-invariant kernels (bitwise, 1..65 rows, any neighbours), logits equal to
Hugging Face's within fp32 summation tolerance, and every method token-exact against lean ``ar``
in float32 by construction."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_tiny_target

import dartree
from dartree import kernels
from dartree.loading import load_target
from dartree.targets import HFTarget, LeanTarget, forward_tree, make_target, prefill
from dartree.targets.lean import KVStore, LeanWeights, Rows, forward
from dartree.trees import available_methods

ext = kernels.load()
ROWS = range(1, 66)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 37), (16, 5)])
def test_product_is_row_invariant_and_correct(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen, dtype=dtype)
    x = torch.randn(65, k, generator=gen, dtype=dtype)
    res = torch.randn(65, n, generator=gen, dtype=dtype)
    packed = ext.pack_weight(w)
    full = ext.product(x, packed, n, res)
    tol = 1e-4 * k ** 0.5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(full, res + x @ w.T, rtol=0, atol=tol)
    for m in ROWS:  # any prefix of the rows, and each row alone, gives the same bits
        assert torch.equal(ext.product(x[:m].contiguous(), packed, n, res[:m].contiguous()), full[:m])
    for i in range(65):
        assert torch.equal(ext.product(x[i:i + 1].contiguous(), packed, n, res[i:i + 1].contiguous()), full[i:i + 1])


def test_norm_and_swiglu_are_row_invariant():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(65, 576, generator=gen), torch.randn(576, generator=gen)
    y = ext.rmsnorm(x, w, 1e-5)
    torch.testing.assert_close(y, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))
    gu = torch.randn(65, 2 * 96, generator=gen) * 6
    s = ext.swiglu(gu)
    torch.testing.assert_close(s, torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:])
    for i in range(65):
        assert torch.equal(ext.rmsnorm(x[i:i + 1].contiguous(), w, 1e-5), y[i:i + 1])
        assert torch.equal(ext.swiglu(gu[i:i + 1].contiguous()), s[i:i + 1])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny32(request, tmp_path_factory):
    d = make_tiny_target(tmp_path_factory.mktemp(request.param), family=request.param, vocab_size=64, hidden_size=64,
                         num_layers=3, seed=3)
    return load_target(d, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_equal_hugging_face_within_tolerance(tmp_path, dtype):
    for family in ("llama", "qwen3"):
        model = load_target(make_tiny_target(tmp_path / family, family=family, vocab_size=64, hidden_size=64, num_layers=3),
                            dtype, "cpu")
        hf, lean = HFTarget(model, [0, 2]), LeanTarget(model, [0, 2])
        ids = torch.randint(64, (300,), generator=torch.Generator().manual_seed(1))  # two prefill chunks
        a, fa = prefill(hf, ids)
        b, fb = prefill(lean, ids)
        # Hugging Face's RMSNorm computes in float32 even for a float64 model, so fp32 tolerance for both
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fb, fa, rtol=1e-3, atol=1e-3)
        tokens, depths = torch.tensor([5, 9, 11, 2]), torch.tensor([0, 1, 1, 2])
        vis = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        la, _ = forward_tree(hf, tokens, depths, vis)
        lb, _ = forward_tree(lean, tokens, depths, vis)
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)


def _random_tree(draw_parents):
    """parents (-1: the root) -> depths and the ancestor matrix of [root, nodes]."""
    n = len(draw_parents) + 1
    parents = [-1] + [p for p in draw_parents]
    depths = [0] * n
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    return torch.tensor(depths), vis, parents


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_tree_rows_equal_their_paths_bitwise(tiny32, data):
    """Each row of one tree forward has exactly the logits of its own path decoded one token at a time."""
    size = data.draw(st.integers(1, 64))
    raw = [data.draw(st.integers(0, i)) for i in range(size)]  # node i+1's parent among rows 0..i
    depths, vis, parents = _random_tree(raw)
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=size + 1, max_size=size + 1)))
    prompt = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=40)))
    target = LeanTarget(tiny32)
    prefill(target, prompt)
    start = target.slot_length(0)
    tree_logits, _ = forward_tree(target, tokens, depths, vis)
    for row in data.draw(st.lists(st.integers(0, size), min_size=1, max_size=4, unique=True)):
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        target.keep(0, start, torch.zeros(0, dtype=torch.long))
        for r in path:  # one-token steps along the path
            step, _ = forward_tree(target, tokens[r:r + 1], torch.zeros(1, dtype=torch.long))
        assert torch.equal(step[0], tree_logits[row])


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_request_is_unaffected_by_what_shares_its_forward(tiny32, data):
    """Rows of several slots in one forward give each slot's rows the bits they get alone."""
    weights = LeanWeights(tiny32)
    slots = data.draw(st.integers(2, 4))
    store, alone = KVStore(weights, slots=slots), KVStore(weights, slots=1)
    rows = []
    for s in range(slots):
        past = data.draw(st.integers(1, 30))
        prompt = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=past, max_size=past)))
        tri = torch.ones(past, past, dtype=torch.bool).tril()
        forward(weights, store, Rows.one_request(prompt, s, 0, torch.arange(past), tri))
        n = data.draw(st.integers(1, 9))
        new = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n)))
        rows.append((s, past, new))
    width = max(new.numel() for _, _, new in rows)
    parts = []
    for s, past, new in rows:
        n = new.numel()
        vis = torch.zeros(n, width, dtype=torch.bool)
        vis[:, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        parts.append(Rows.one_request(new, s, past, torch.arange(n), vis))
    batch = Rows(*(torch.cat([getattr(p, f) for p in parts]) for f in ("tokens", "slots", "positions", "cache_positions", "past", "visible")))
    hidden, _ = forward(weights, store, batch)
    offset = 0
    for (s, past, new), part in zip(rows, parts):
        n = new.numel()
        k0 = store.k[:, s:s + 1, :, :past].clone()
        v0 = store.v[:, s:s + 1, :, :past].clone()
        alone.reserve(past + n)
        alone.k[:, :, :, :past], alone.v[:, :, :, :past] = k0, v0
        solo = Rows.one_request(new, 0, past, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        h, _ = forward(weights, alone, solo)
        assert torch.equal(h, hidden[offset:offset + n])
        offset += n


@pytest.fixture(scope="module")
def fp32_pipeline(model_dirs):
    return dartree.load(model_dirs[("qwen3", "target")], model_dirs[("qwen3", "domino")], dtype=torch.float32)


@settings(max_examples=12, deadline=None)
@given(prompt=st.lists(st.integers(0, 7), min_size=1, max_size=12), seed=st.integers(0, 3))
def test_every_method_reproduces_lean_ar_in_float32(fp32_pipeline, prompt, seed):
    """In float32 (where a non-invariant product would round tree rows differently) every method's
    greedy text equals the lean ``ar`` text token for token."""
    pipe = fp32_pipeline
    assert isinstance(pipe.target, LeanTarget)
    ref = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=24, seed=seed).token_ids
    for method in available_methods(True, True):
        for budget in (3, 16):
            out = pipe.generate(input_ids=prompt, method=method, max_new_tokens=24, seed=seed, budget=budget).token_ids
            assert out == ref, (method, budget)


def test_lean_can_be_refused_and_insisted_on(model_dirs):
    target, drafter = model_dirs[("llama", "target")], model_dirs[("llama", None)]
    assert type(dartree.load(target, drafter, dtype=torch.float32, lean=False).target) is HFTarget
    assert type(dartree.load(target, drafter, dtype=torch.float32, lean=True).target) is LeanTarget
    with pytest.raises(ValueError, match="lean=True.*dtype"):
        dartree.load(target, drafter, dtype=torch.bfloat16, lean=True)
    with pytest.raises(ValueError, match="lean must be"):
        dartree.load(target, drafter, dtype=torch.float32, lean="yes")


def test_products_use_every_thread_and_keep_their_bits_on_another_thread():
    """The kernels are built with OpenMP (without it ATen's parallel_for runs serially): a product
    split over 1 or 2 threads, on the main thread or on a worker thread after the main thread's
    OpenMP workers were handed over, gives the same bits."""
    import threading

    from dartree.hardware import hand_over_threads

    assert ext.built_with_openmp()
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(960, 576, generator=gen), torch.randn(7, 576, generator=gen)
    packed = ext.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.product(x, packed, 960)
        torch.set_num_threads(2)
        two = ext.product(x, packed, 960)
        assert torch.equal(one, two)
        assert hand_over_threads()  # torch's own libgomp is found and frees this thread's workers
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("y", ext.product(x, packed, 960)))
        worker.start()
        worker.join()
        assert torch.equal(out["y"], one)
        assert torch.equal(ext.product(x, packed, 960), one)  # and the main thread computes again afterwards
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_drafter_linear_on_the_lean_products_equals_f_linear(dtype):
    """``cpu_products(lean=True)`` (the drafter's products): up to LEAN_MAX_ROWS rows on the lean
    kernels, beyond on the other path, every count equal to F.linear within the sums' rounding, the
    bias added, and a weight changed in place packed again."""
    from dartree.products import LEAN_MAX_ROWS, CpuLinear, cpu_products

    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.Linear(33, 17, bias=False)).to(dtype)
    cpu_products(model, lean=True)
    assert all(isinstance(m, CpuLinear) and m.lean_products for m in model)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for rows in (1, 2, 3, 16, LEAN_MAX_ROWS, LEAN_MAX_ROWS + 1, 100):
            x = torch.randn(rows, 40, generator=gen, dtype=dtype)
            want = torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].weight, model[0].bias), model[1].weight)
            torch.testing.assert_close(model(x), want, **tol)
        assert model[0]._lean_packed is not None  # the lean path ran
        model[0].weight.mul_(2.0)
        x = torch.randn(5, 40, generator=gen, dtype=dtype)
        torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias), **tol)
        x3 = torch.randn(2, 4, 40, generator=gen, dtype=dtype)  # leading dimensions kept
        torch.testing.assert_close(model[0](x3), torch.nn.functional.linear(x3, model[0].weight, model[0].bias), **tol)


def test_bf16_products_follow_the_exact_forward_closely_and_only_where_asked(tiny32):
    """``lean_products="bfloat16"``: the same forward with bf16 weight products (for the drafter's
    data) stays close to the exact one (logits within bf16 rounding over a prefill and a tree), its
    weights are bf16, attention and the K/V store float32; exact stays the default, an unknown name
    and a target the lean forward cannot run are refused."""
    exact, fast = LeanTarget(tiny32), LeanTarget(tiny32, products="bfloat16")
    assert exact.weights.products == "exact" and fast.weights.layers[0].qkv.dtype == torch.bfloat16
    assert fast.store.k.dtype == torch.float32
    ids = torch.randint(64, (300,), generator=torch.Generator().manual_seed(5))
    a, _ = prefill(exact, ids)
    b, _ = prefill(fast, ids)
    assert not torch.equal(a, b)  # the products did change
    torch.testing.assert_close(b, a, rtol=0, atol=0.05 * a.abs().max().item())
    tokens, depths = torch.tensor([5, 9, 11, 2]), torch.tensor([0, 1, 1, 2])
    vis = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    la, _ = forward_tree(exact, tokens, depths, vis)
    lb, _ = forward_tree(fast, tokens, depths, vis)
    torch.testing.assert_close(lb, la, rtol=0, atol=0.05 * la.abs().max().item())
    with pytest.raises(ValueError, match="products must be one of"):
        LeanWeights(tiny32, products="int8")


def test_bf16_products_are_refused_where_the_lean_forward_cannot_run(model_dirs):
    model = load_target(model_dirs[("llama", "target")], torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="lean_products='bfloat16'.*dtype"):
        make_target(model, (), "auto", lean_products="bfloat16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_scores_committed_keys_in_blocks_with_the_bits_of_one_at_a_time(dtype):
    """The committed keys are scored 16 at a time (AVX-512, float32), the visible new rows one at a
    time: a row that sees p keys as its committed cache gets the same bits as the same row seeing
    the same keys as visible new rows, for every p (blocks, remainders, none)."""
    gen = torch.Generator().manual_seed(11)
    nh, nkv, hd, T = 6, 2, 64, 96
    k = torch.randn(1, nkv, T, hd, generator=gen, dtype=dtype)
    v = torch.randn(1, nkv, T, hd, generator=gen, dtype=dtype)
    q = torch.randn(1, nh * hd, generator=gen, dtype=dtype) * 2
    slot = torch.zeros(1, dtype=torch.long)
    for p in list(range(1, 50)) + [64, 80, 95]:
        committed = ext.attention(q, k, v, slot, torch.tensor([p]), torch.zeros(1, 1, dtype=torch.uint8), nh, hd ** -0.5)
        as_new = ext.attention(q, k, v, slot, torch.tensor([0]), torch.ones(1, p, dtype=torch.uint8), nh, hd ** -0.5)
        assert torch.equal(committed, as_new), p
        ref = torch.softmax((q.view(nh, 1, hd) @ k[0].repeat_interleave(nh // nkv, 0)[:, :p].transpose(1, 2)) * hd ** -0.5, -1)
        ref = (ref @ v[0].repeat_interleave(nh // nkv, 0)[:, :p]).reshape(1, nh * hd)
        torch.testing.assert_close(committed, ref, rtol=1e-5, atol=1e-5)


# Builds of the kernels without AVX-512 (the AVX2 paths) and without AVX2/FMA (the scalar code);
# on a CPU without AVX-512 the native build is the AVX2 one.
ISA_VARIANTS = {"no AVX-512": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


@pytest.mark.parametrize("variant", list(ISA_VARIANTS))
def test_every_instruction_set_path_gives_the_same_bits(variant):
    """The vector paths (AVX-512, AVX2) use only correctly rounded operations in the scalar code's
    order, so the kernels built for another instruction set give bit for bit what the native build
    gives: products, norms, SwiGLU and attention, float32 and float64, over row counts, head sizes
    and visibility patterns that reach the blocked, the remainder and the one-at-a-time code."""
    other = kernels.load(extra_cflags=ISA_VARIANTS[variant])
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        for n, k in ((960, 576), (100, 37)):
            w = torch.randn(n, k, generator=gen, dtype=dtype)
            packed, packed_other = ext.pack_weight(w), other.pack_weight(w)
            for m in (1, 2, 3, 5, 8, 17, 130):
                x = torch.randn(m, k, generator=gen, dtype=dtype)
                res = torch.randn(m, n, generator=gen, dtype=dtype)
                assert torch.equal(ext.product(x, packed, n, res), other.product(x, packed_other, n, res)), (dtype, n, m)
        gu = torch.randn(33, 2 * 1539, generator=gen, dtype=dtype) * 6
        assert torch.equal(ext.swiglu(gu), other.swiglu(gu))
        x, w = torch.randn(33, 577, generator=gen, dtype=dtype), torch.randn(577, generator=gen, dtype=dtype)
        assert torch.equal(ext.rmsnorm(x, w, 1e-5), other.rmsnorm(x, w, 1e-5))
        nh, nkv, slots_count, capacity = 6, 2, 3, 120
        for hd in (64, 128, 48):
            k = torch.randn(slots_count, nkv, capacity, hd, generator=gen, dtype=dtype)
            v = torch.randn(slots_count, nkv, capacity, hd, generator=gen, dtype=dtype)
            for rows, width in ((1, 1), (7, 5), (20, 17)):
                q = torch.randn(rows, nh * hd, generator=gen, dtype=dtype) * 3
                slots = torch.randint(0, slots_count, (rows,), generator=gen)
                past = torch.randint(0, capacity - width, (rows,), generator=gen)
                visible = (torch.rand(rows, width, generator=gen) < 0.6).to(torch.uint8)
                visible[:, 0] = 1
                args = (slots, past, visible, nh, hd ** -0.5)
                assert torch.equal(ext.attention(q, k, v, *args), other.attention(q, k, v, *args)), (dtype, hd, rows)


@pytest.mark.parametrize("hd", [64, 128])
def test_attention_of_rows_taken_together_gives_each_row_its_bits_alone(hd):
    """Rows that share a slot and a committed length (a tree's, a prompt chunk's) are attended
    together (each key and value read once for all of them, AVX-512 and AVX2): every row gets the bits of the
    per-query path and of its own call alone, whatever the runs, their lengths and what each row sees."""
    gen = torch.Generator().manual_seed(21)
    nh, nkv, slots_count, capacity, width = 9, 3, 3, 200, 19
    k = torch.randn(slots_count, nkv, capacity, hd, generator=gen)
    v = torch.randn(slots_count, nkv, capacity, hd, generator=gen)
    for runs in ([(0, 37, 19)], [(1, 0, 5), (1, 0, 3), (2, 150, 11)], [(0, 16, 1), (2, 64, 17), (1, 99, 2)]):
        slots = torch.cat([torch.full((n,), s) for s, _, n in runs])
        past = torch.cat([torch.full((n,), p) for _, p, n in runs])
        visible = (torch.rand(slots.numel(), width, generator=gen) < 0.5).to(torch.uint8)
        q = torch.randn(slots.numel(), nh * hd, generator=gen) * 3
        together = ext.attention(q, k, v, slots, past, visible, nh, hd ** -0.5)
        for r in range(slots.numel()):
            alone = ext.attention(q[r:r + 1], k, v, slots[r:r + 1], past[r:r + 1], visible[r:r + 1].contiguous(), nh, hd ** -0.5)
            assert torch.equal(together[r:r + 1], alone), (runs, r)
        ext.set_grouped_attention(False)
        try:
            assert torch.equal(ext.attention(q, k, v, slots, past, visible, nh, hd ** -0.5), together), runs
        finally:
            ext.set_grouped_attention(True)


def test_a_lock_left_by_an_interrupted_build_is_cleared_and_a_live_build_is_waited_for(tmp_path, capsys):
    """torch's loader waits without end on the bare lock file a killed build leaves: dartree's own build lock
    (released by the system when its holder dies) clears it; a build in progress in another process is waited for."""
    import subprocess
    import sys
    import threading
    import time

    from dartree.kernels import TORCH_LOCK, build_lock

    (tmp_path / TORCH_LOCK).touch()  # a build that was killed
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_LOCK).exists()
    assert "interrupted" in capsys.readouterr().err
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys; h = open(sys.argv[1], 'a+'); fcntl.flock(h, fcntl.LOCK_EX); print('held', flush=True); "
        "sys.stdin.read()"), str(tmp_path / ".dartree-build")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    (tmp_path / TORCH_LOCK).touch()  # the live build's own lock: not touched while it runs
    release = threading.Timer(0.5, holder.stdin.close)  # the holder ends, and the system drops its lock, once released
    start = time.perf_counter()
    release.start()
    with build_lock(tmp_path):
        waited = time.perf_counter() - start
    holder.wait()
    holder.stdout.close()
    assert waited > 0.3 and "waiting for another process" in capsys.readouterr().err
