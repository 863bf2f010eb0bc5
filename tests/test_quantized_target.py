"""The quantised target (``targets/quantized.py``): the lean forward on integer products over GGUF
blocks (a tiny GGUF written here, as llama.cpp's converter writes Llama) or Q8_0 at load. It is
row-invariant, so every method reproduces its own greedy decoding token for token (hypothesis) and
samples its own distribution at T = 1 (chi-square); bad files and settings give one clear error."""

import math

import numpy as np
import pytest
import torch
from conftest import synthetic_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import make_tiny_drafter, make_tiny_target

import dartree
from dartree import quant
from dartree.errors import DartreeError
from dartree.loading import load_drafter, load_target
from dartree.pipeline import Pipeline
from dartree.targets import LeanTarget, forward_tree, prefill
from dartree.targets.lean import Rows
from dartree.targets.quantized import GGUFTensors, QuantizedWeights
from dartree.trees import available_methods

gguf = pytest.importorskip("gguf")
METHODS = available_methods(True, True)
DRAFTER_FREE_METHODS = available_methods(False, False)
LLAMA_ROLES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


# the K-quants gguf cannot write (no quantiser): random blocks, with d (and dmin) at these fp16 offsets set small
K_QUANT_SCALES = {gguf.GGMLQuantizationType.Q4_K: ((0, 4e-4), (2, 3e-3)), gguf.GGMLQuantizationType.Q5_K: ((0, 2e-4), (2, 3e-3)),
                  gguf.GGMLQuantizationType.Q6_K: ((208, 1e-4),)}


def random_k_quant(kind, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of a K-quant for an [n, k] weight (k a multiple of 256), its scales small."""
    values, size = quant.BLOCK_FORMAT[kind.name]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // values, size), generator=gen, dtype=torch.uint8)
    for offset, scale in K_QUANT_SCALES[kind]:
        d = (torch.rand(n, k // values, 1, generator=gen) * scale + scale / 4).to(torch.float16)
        raw[..., offset:offset + 2] = d.view(torch.uint8)
    return raw.reshape(n, -1).numpy()


def write_tiny_gguf(model_dir, out_dir, qtype=gguf.GGMLQuantizationType.Q4_1, tied=False,
                    embed_qtype=gguf.GGMLQuantizationType.Q8_0, norms=False, v_qtype=None, rope_freqs=None):
    """Quantise a tiny float32 Llama's linear weights to ``qtype`` (the output layer to Q8_0) into a
    GGUF file with llama.cpp's names and q/k row order, and save the model with the dequantised
    values (what a checkpoint converted from that file holds). ``tied``: no ``output.weight`` in the
    file, the output layer being the embedding (as the bundled SmolLM2's). Returns (checkpoint dir, gguf path)."""
    from gguf import quants

    model = load_target(model_dir, torch.float32, "cpu")
    cfg = model.config
    path = out_dir / "tiny.gguf"
    arch = cfg.model_type  # "llama" or "qwen3": llama.cpp's converter permutes only Llama's q/k rows
    writer = gguf.GGUFWriter(str(path), arch)

    written = []  # the tensors' names so far (a K-quant's random blocks are seeded by its place)

    def put(name, weight, kind, rows_permuted_for=None):
        w = weight.detach().numpy().astype(np.float32)
        if rows_permuted_for is not None:  # llama.cpp's converter interleaves each head's rotary halves
            h = rows_permuted_for
            w = w.reshape(h, 2, w.shape[0] // h // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        raw = random_k_quant(kind, *w.shape, seed=len(written)) if kind in K_QUANT_SCALES else quants.quantize(w, kind)
        written.append(name)
        writer.add_tensor(name, raw, raw_dtype=kind)
        back = quants.dequantize(raw, kind)
        if rows_permuted_for is not None:
            h = rows_permuted_for
            back = back.reshape(h, back.shape[0] // h // 2, 2, back.shape[1]).swapaxes(1, 2).reshape(back.shape)
        weight.data.copy_(torch.from_numpy(np.ascontiguousarray(back)))

    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            for hf, name in LLAMA_ROLES.items():
                module = getattr(block.self_attn if hf.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else block.mlp, hf)
                heads = cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads if hf == "k_proj" else None
                kind = v_qtype if (hf == "v_proj" and v_qtype is not None) else qtype  # Q4_K_M's mixed layers
                put(f"blk.{i}.{name}.weight", module.weight, kind, heads if arch == "llama" else None)
            if norms:  # the F32 norms a real file holds (a target straight from the file reads them from it)
                parts = {"attn_norm": block.input_layernorm, "ffn_norm": block.post_attention_layernorm}
                if arch == "qwen3":
                    parts.update(attn_q_norm=block.self_attn.q_norm, attn_k_norm=block.self_attn.k_norm)
                for name, norm in parts.items():
                    writer.add_tensor(f"blk.{i}.{name}.weight", norm.weight.detach().numpy().astype(np.float32))
        if norms:
            writer.add_tensor("output_norm.weight", model.model.norm.weight.detach().numpy().astype(np.float32))
        if rope_freqs is not None:  # Llama 3.1+'s RoPE scaling as llama.cpp's converter stores it
            writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
        if not tied:
            put("output.weight", model.lm_head.weight, gguf.GGMLQuantizationType.Q8_0)
        put("token_embd.weight", model.model.embed_tokens.weight, embed_qtype)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.config.tie_word_embeddings = tied
    model.save_pretrained(out_dir / "checkpoint")
    return out_dir / "checkpoint", path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    target = make_tiny_target(root / "t", family="llama", vocab_size=16, hidden_size=64, num_layers=2, seed=7,
                              logit_scale=3.0)
    checkpoint, path = write_tiny_gguf(target, root)
    drafter = make_tiny_drafter(root / "d", checkpoint, head="domino", block_size=5, seed=8)
    return checkpoint, path, drafter


@pytest.fixture(scope="module")
def file_pipe(tiny_gguf):
    checkpoint, path, drafter = tiny_gguf
    pipe = Pipeline(load_target(checkpoint, torch.float32, "cpu"), load_drafter(drafter, dtype=torch.float32),
                    weights="file", gguf=path, cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))
    return pipe


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A file whose layers mix types within one product, as llama.cpp's Q4_K_M does (v rows in another type)."""
    root = tmp_path_factory.mktemp("mixed")
    target = make_tiny_target(root / "t", family="llama", vocab_size=16, hidden_size=64, num_layers=2, seed=29,
                              logit_scale=3.0)
    checkpoint, path = write_tiny_gguf(target, root, norms=True, v_qtype=gguf.GGMLQuantizationType.Q8_0)
    return checkpoint, path, make_tiny_drafter(root / "d", checkpoint, head="domino", block_size=5, seed=31)


@pytest.fixture(scope="module")
def mixed_pipe(mixed_gguf):
    checkpoint, path, drafter = mixed_gguf
    return Pipeline(load_target(checkpoint, torch.float32, "cpu"), load_drafter(drafter, dtype=torch.float32),
                    weights="file", gguf=path, cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))


@pytest.fixture(scope="module")
def narrow_gguf(tmp_path_factory):
    """llama.cpp's Q4_K_M of a model whose widths are no multiples of 256 (SmolLM2's 576): its Q4_K rows fall back
    to Q5_0 and its Q6_K rows to Q8_0 (llama-quantize's fallbacks), so q/k/o/gate/up are Q5_0 beside Q8_0 v rows."""
    root = tmp_path_factory.mktemp("narrow")
    target = make_tiny_target(root / "t", family="llama", vocab_size=16, hidden_size=64, num_layers=2, seed=37,
                              logit_scale=3.0)
    q5_0 = gguf.GGMLQuantizationType.Q5_0
    checkpoint, path = write_tiny_gguf(target, root, qtype=q5_0, norms=True, v_qtype=gguf.GGMLQuantizationType.Q8_0,
                                       embed_qtype=q5_0)
    return checkpoint, path


@pytest.fixture(scope="module")
def narrow_pipe(narrow_gguf):
    checkpoint, path = narrow_gguf
    return Pipeline(load_target(checkpoint, torch.float32, "cpu"), None, weights="file", gguf=path,
                    cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))


@pytest.fixture(scope="module")
def narrow5_gguf(tmp_path_factory):
    """llama.cpp's Q5_K_M of a narrow model: its Q5_K rows fall back to Q5_1, its Q6_K rows to Q8_0."""
    root = tmp_path_factory.mktemp("narrow5")
    target = make_tiny_target(root / "t", family="llama", vocab_size=16, hidden_size=64, num_layers=2, seed=41,
                              logit_scale=3.0)
    q5_1 = gguf.GGMLQuantizationType.Q5_1
    return write_tiny_gguf(target, root, qtype=q5_1, norms=True, v_qtype=gguf.GGMLQuantizationType.Q8_0, embed_qtype=q5_1)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A Q5_K_M-like file of a model whose widths are multiples of 256: Q5_K layers and embedding, Q6_K v rows
    (random blocks, the checkpoint holding their dequantised values)."""
    root = tmp_path_factory.mktemp("kquant")
    target = make_tiny_target(root / "t", family="llama", vocab_size=16, hidden_size=256, num_layers=2, seed=43,
                              logit_scale=3.0)
    q5_k = gguf.GGMLQuantizationType.Q5_K
    return write_tiny_gguf(target, root, qtype=q5_k, norms=True, v_qtype=gguf.GGMLQuantizationType.Q6_K, embed_qtype=q5_k)


def _drafterless_pipe(checkpoint, path):
    return Pipeline(load_target(checkpoint, torch.float32, "cpu"), None, weights="file", gguf=path,
                    cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))


@pytest.fixture(scope="module")
def narrow5_pipe(narrow5_gguf):
    return _drafterless_pipe(*narrow5_gguf)


@pytest.fixture(scope="module")
def k_quant_pipe(k_quant_gguf):
    return _drafterless_pipe(*k_quant_gguf)


@pytest.fixture(scope="module")
def q8_pipe(model_dirs):
    pipe = dartree.load(model_dirs[("qwen3", "target")], model_dirs[("qwen3", "domino")], dtype=torch.float32,
                        weights="q8_0", cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))
    return pipe


def test_the_file_target_runs_the_files_blocks(file_pipe, tiny_gguf):
    target = file_pipe.target
    assert isinstance(target, LeanTarget) and target.row_invariant and target.name == "lean-q4_1+q8_0"
    assert isinstance(target.weights, QuantizedWeights)
    # close to the float32 forward over the same (dequantised) weights: only the activations' int8 rounding differs
    float_target = LeanTarget(file_pipe.target_model, [])
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    (q, _), (f, _) = prefill(target, ids), prefill(float_target, ids)
    assert not torch.equal(q, f)
    assert (q - f).abs().max() < 0.05 * f.abs().max()


def test_the_file_target_looks_tokens_up_in_the_files_q8_0_embedding(file_pipe, tiny_gguf):
    from dartree.targets.quantized import GGUFTensors, StoredEmbedding, stored_embedding

    embedding = file_pipe.target.embed_tokens
    assert isinstance(embedding, StoredEmbedding) and file_pipe.head._embed is embedding  # the drafter's head reads it too
    table = file_pipe.target_model.get_input_embeddings().weight
    every = torch.arange(table.shape[0])
    assert torch.equal(embedding(every), table) and torch.equal(embedding(every.view(4, -1)), table.view(4, -1, table.shape[1]))
    # a checkpoint whose table is not the file's keeps its own
    other = load_target(tiny_gguf[0], torch.float32, "cpu")
    with torch.no_grad():
        other.get_input_embeddings().weight[-1, 0] += 1.0
    assert stored_embedding(GGUFTensors(tiny_gguf[1]), other) is None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tree_rows_equal_their_paths_bitwise_on_quantised_weights(file_pipe, q8_pipe, mixed_pipe, narrow_pipe, narrow5_pipe,
                                                                   k_quant_pipe, data):
    """Each row of one tree forward has exactly the logits of its own path decoded one token at a time."""
    target = data.draw(st.sampled_from([p.target for p in (file_pipe, q8_pipe, mixed_pipe, narrow_pipe, narrow5_pipe,
                                                           k_quant_pipe)]))
    vocab = target.weights.vocab
    size = data.draw(st.integers(1, 40))
    parents = [-1] + [data.draw(st.integers(0, i)) for i in range(size)]
    depths, visible = [0] * (size + 1), torch.eye(size + 1, dtype=torch.bool)
    for i in range(1, size + 1):
        depths[i] = depths[parents[i]] + 1
        visible[i] |= visible[parents[i]]
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=size + 1, max_size=size + 1)))
    prefill(target, torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))))
    start = target.slot_length(0)
    tree_logits, _ = forward_tree(target, tokens, torch.tensor(depths), visible)
    for row in data.draw(st.lists(st.integers(0, size), min_size=1, max_size=3, unique=True)):
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        target.keep(0, start, torch.zeros(0, dtype=torch.long))
        for r in reversed(path):
            step, _ = forward_tree(target, tokens[r:r + 1], torch.zeros(1, dtype=torch.long))
        assert torch.equal(step[0], tree_logits[row])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["file", "q8_0", "mixed", "narrow", "narrow5", "k_quant"]),
       prompt=st.lists(st.integers(0, 7), min_size=1, max_size=12),
       method=st.sampled_from(METHODS), budget=st.sampled_from([4, 16, "auto"]), max_new_tokens=st.integers(1, 24))
def test_every_method_reproduces_the_quantised_targets_greedy_text(file_pipe, q8_pipe, mixed_pipe, narrow_pipe, narrow5_pipe,
                                                                  k_quant_pipe, which, prompt, method, budget, max_new_tokens):
    pipe = {"file": file_pipe, "q8_0": q8_pipe, "mixed": mixed_pipe, "narrow": narrow_pipe, "narrow5": narrow5_pipe,
            "k_quant": k_quant_pipe}[which]
    if pipe.drafter is None and method not in DRAFTER_FREE_METHODS:
        method = "ngram"  # (the drafterless files' pipelines)
    ar = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=max_new_tokens, stop_token_ids=[]).token_ids
    out = pipe.generate(input_ids=prompt, method=method, budget=budget, max_new_tokens=max_new_tokens, stop_token_ids=[])
    assert out.token_ids == ar


def test_drafts_are_accepted_on_the_quantised_target(file_pipe):
    """The identity above is only meaningful if verification accepts draft tokens there."""
    stats = [file_pipe.generate(input_ids=[i, (3 * i) % 16], method="dartree", budget=16, max_new_tokens=24,
                                stop_token_ids=[]).stats for i in range(6)]
    assert sum(sum(s.acceptance_lengths) - s.rounds for s in stats) > 0


def test_temperature_one_samples_the_quantised_targets_distribution(tmp_path):
    """The joint of the first three tokens (prefill, root sample, the accepted child's sample) matches
    the quantised target's own distribution, enumerated with its own forward (chi-square, p = 1e-4)."""
    from test_lossless_sampling import chi_square_rejects

    vocab, prompt, samples = 4, [1, 2], 2000
    target_dir = make_tiny_target(tmp_path / "t", vocab_size=vocab, hidden_size=32, num_layers=2, seed=3)
    drafter = make_tiny_drafter(tmp_path / "d", target_dir, head="domino", block_size=4, seed=5)
    pipe = dartree.load(target_dir, drafter, dtype=torch.float32, weights="q8_0",
                        cost_model=synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))
    truth = {}
    for a in range(vocab):
        for b in range(vocab):
            first, _ = prefill(pipe.target, torch.tensor(prompt))  # p(a | prompt), then p(b | .. a), p(c | .. a b)
            rest, _ = forward_tree(pipe.target, torch.tensor([a, b]), torch.arange(2))
            logp = [torch.log_softmax(x.double(), -1) for x in (first, rest[0], rest[1])]
            for c in range(vocab):
                truth[(a, b, c)] = math.exp(logp[0][a] + logp[1][b] + logp[2][c])
    counts = {}
    for seed in range(samples):
        res = pipe.generate(input_ids=prompt, method="dartree", max_new_tokens=3, temperature=1.0, seed=seed, budget=4,
                            width=2, tree_top_k=4, stop_token_ids=[])
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
    rejected, stat, crit = chi_square_rejects(counts, truth, samples)
    assert not rejected, f"chi-square {stat:.1f} > {crit:.1f}"


def test_bad_weights_settings_and_files_give_one_clear_error(tmp_path, model_dirs, tiny_gguf):
    target = model_dirs[("llama", "target")]
    with pytest.raises(DartreeError, match="weights must be"):
        dartree.load(target, dtype=torch.float32, weights="q3_k")
    with pytest.raises(DartreeError, match="runs a GGUF file as stored"):
        dartree.load(target, dtype=torch.float32, weights="file")
    with pytest.raises(DartreeError, match="float32 model"):
        dartree.load(target, dtype=torch.float64, weights="q8_0")
    checkpoint, path, _ = tiny_gguf
    model = load_target(checkpoint, torch.float32, "cpu")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DartreeError, match="not a readable GGUF file"):
        QuantizedWeights(model, "file", truncated)
    other = load_target(make_tiny_target(tmp_path / "other", family="llama", vocab_size=16, hidden_size=64,
                                         num_layers=2, seed=99), torch.float32, "cpu")
    with pytest.raises(DartreeError, match="does not hold this model's weights"):
        QuantizedWeights(other, "file", path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_target_straight_from_the_file_computes_the_checkpoints_file_target(tmp_path, family):
    """``model_from_gguf``: a Llama or Qwen3 GGUF file with nothing beside it but its config (no float32 weights)
    gives the target that the float32 checkpoint with the same file gives, bit for bit (norms, Qwen3's q/k norms
    and the RoPE tables read from the file and the config), and so the same greedy text for every method."""
    from dartree.targets.quantized import from_gguf, model_from_gguf

    target = make_tiny_target(tmp_path / "t", family=family, vocab_size=24, hidden_size=64, num_layers=2, seed=17,
                              logit_scale=3.0)
    with torch.no_grad():  # norms that are not all ones, so that reading the wrong one shows
        model = load_target(target, torch.float32, "cpu")
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        model.save_pretrained(target)
    checkpoint, path = write_tiny_gguf(target, tmp_path, norms=True)
    reference = load_target(checkpoint, torch.float32, "cpu")
    straight = model_from_gguf(checkpoint, GGUFTensors(path))
    assert from_gguf(straight) and not from_gguf(reference)
    cost = synthetic_cost(1.0, 0.05)
    a = Pipeline(straight, None, weights="file", gguf=path, cost_model=cost)
    b = Pipeline(reference, None, weights="file", gguf=path, cost_model=cost)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    (la, _), (lb, _) = prefill(a.target, ids), prefill(b.target, ids)
    assert torch.equal(la, lb)
    for method in ("ar", "ngram"):
        want = b.generate(input_ids=[3, 1, 4, 1, 3, 1, 4], method=method, max_new_tokens=16, stop_token_ids=[]).token_ids
        assert a.generate(input_ids=[3, 1, 4, 1, 3, 1, 4], method=method, max_new_tokens=16,
                          stop_token_ids=[]).token_ids == want


def _llama3_factors(cfg) -> list[float]:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs`` for a Llama 3.1 rope config."""
    rp = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    low_wavelen = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
    high_wavelen = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rp["rope_theta"] ** (i / dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rp["factor"])
        else:
            smooth = (rp["original_max_position_embeddings"] / wavelen - rp["low_freq_factor"]) / (
                rp["high_freq_factor"] - rp["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rp["factor"] + smooth))
    return factors


def test_a_files_rope_frequency_factors_scale_its_rope_tables(tmp_path):
    """A Llama 3.1+ file's ``rope_freqs`` divide the RoPE frequencies of the target straight from the file (what
    llama.cpp does, and what Hugging Face's llama3 rope type computes from the same parameters); without them the
    tables, and so the logits, differ."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dartree.targets.quantized import model_from_gguf

    target = make_tiny_target(tmp_path / "t", family="llama", vocab_size=24, hidden_size=64, num_layers=2, seed=19,
                              logit_scale=3.0)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    factors = _llama3_factors(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope))
    assert 1.0 in factors and 8.0 in factors and any(1 < f < 8 for f in factors)  # every regime of the scaling
    (tmp_path / "scaled").mkdir()
    (tmp_path / "plain").mkdir()
    checkpoint, scaled = write_tiny_gguf(target, tmp_path / "scaled", norms=True, rope_freqs=factors)
    _, plain = write_tiny_gguf(target, tmp_path / "plain", norms=True)
    a, b = model_from_gguf(checkpoint, GGUFTensors(scaled)), model_from_gguf(checkpoint, GGUFTensors(plain))
    base = b.model.rotary_emb.inv_freq
    assert torch.equal(a.model.rotary_emb.inv_freq, base / torch.tensor(factors))
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope), "cpu")
    assert torch.allclose(a.model.rotary_emb.inv_freq, hf.to(base.dtype), rtol=1e-6, atol=0)
    cost = synthetic_cost(1.0, 0.05)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    (la, _), (lb, _) = (prefill(Pipeline(m, None, weights="file", gguf=f, cost_model=cost).target, ids)
                        for m, f in ((a, scaled), (b, plain)))
    assert not torch.equal(la, lb)  # the scaled tables reach the forward


# (fixture of the file, of its pipeline, the layers' type, the v rows' type)
FALLBACK_FILES = {"q4_k_m-narrow": ("narrow_gguf", "narrow_pipe", "Q5_0", "Q8_0"),
                  "q5_k_m-narrow": ("narrow5_gguf", "narrow5_pipe", "Q5_1", "Q8_0"),
                  "q5_k_m": ("k_quant_gguf", "k_quant_pipe", "Q5_K", "Q6_K")}


@pytest.mark.parametrize("which", list(FALLBACK_FILES))
def test_q4_k_m_and_q5_k_m_files_run_as_stored(which, request):
    """The types of llama.cpp's Q4_K_M and Q5_K_M beyond Q4_K and Q6_K run on the integer products: Q5_0 (the Q4_K
    rows' fallback where a width is no multiple of 256) held in Q8_0's records; Q5_K and Q5_1 (its fallback) as bytes
    beside their scales and minimums. The file as stored, not its float32 conversion; the checkpoint's values (the
    embedding's rows bit for bit); close to the float forward over them."""
    from dartree.targets.quantized import file_target_reason

    file_fixture, pipe_fixture, layer_type, v_type = FALLBACK_FILES[which]
    path, pipe = request.getfixturevalue(file_fixture)[1], request.getfixturevalue(pipe_fixture)
    assert file_target_reason(GGUFTensors(path)) is None
    target = pipe.target
    assert target.name == f"lean-{'+'.join(sorted({layer_type.lower(), v_type.lower(), 'q8_0'}))}"
    assert isinstance(target.weights, QuantizedWeights)
    assert [w.qtype for w in target.weights.layers[0].qkv.parts] == [layer_type, v_type]
    assert target.weights.layers[0].gate_up.qtype == layer_type and target.embed_tokens.weight.qtype == layer_type
    table = pipe.target_model.get_input_embeddings().weight
    assert torch.equal(target.embed_tokens(torch.arange(table.shape[0])), table)
    float_target = LeanTarget(pipe.target_model, [])
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    (q, _), (f, _) = prefill(target, ids), prefill(float_target, ids)
    assert not torch.equal(q, f) and (q - f).abs().max() < 0.05 * f.abs().max()
    assert len(set(pipe.generate(input_ids=[i], method="ar", max_new_tokens=6).token_ids[0] for i in range(8))) > 1


def test_a_file_mixing_types_within_one_product_runs_it_in_parts(mixed_pipe, mixed_gguf):
    """llama.cpp's Q4_K_M stores some layers' v rows as Q6_K beside Q4_K q and k: the product is then made of parts,
    each on its own blocks as stored (q+k in one type, v in the other), outputs side by side; it is the checkpoint's
    (checked at load) and exact like any file target (the hypothesis tests above and below run it too)."""
    from dartree.targets.quantized import WeightInParts, file_target_reason

    weights = mixed_pipe.target.weights
    qkv = weights.layers[0].qkv
    assert isinstance(qkv, WeightInParts) and [w.qtype for w in qkv.parts] == ["Q4_1", "Q8_0"]
    assert qkv.shape == (weights.layers[0].qkv.parts[0].shape[0] + weights.layers[0].qkv.parts[1].shape[0], 64)
    assert mixed_pipe.target.name == "lean-q4_1+q8_0" and file_target_reason(GGUFTensors(mixed_gguf[1])) is None
    float_target = LeanTarget(mixed_pipe.target_model, [])  # the checkpoint holds the file's dequantised values
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    (q, _), (f, _) = prefill(mixed_pipe.target, ids), prefill(float_target, ids)
    assert not torch.equal(q, f) and (q - f).abs().max() < 0.05 * f.abs().max()


@pytest.mark.parametrize("embed_qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_an_embedding_stored_in_another_type_is_looked_up_in_it(tmp_path, embed_qtype):
    """A file whose token embedding is not Q8_0 (most Q4_K_M files store it as Q4_K or Q6_K): the rows are
    dequantised from its own blocks, the checkpoint's rows bit for bit."""
    from dartree.targets.quantized import StoredEmbedding

    target = make_tiny_target(tmp_path / "t", family="llama", vocab_size=24, hidden_size=64, num_layers=2, seed=13)
    checkpoint, path = write_tiny_gguf(target, tmp_path, embed_qtype=getattr(gguf.GGMLQuantizationType, embed_qtype))
    model = load_target(checkpoint, torch.float32, "cpu")
    weights = QuantizedWeights(model, "file", path)
    assert isinstance(weights.embedding, StoredEmbedding) and weights.embedding.weight.qtype == embed_qtype
    table = model.get_input_embeddings().weight
    assert torch.equal(weights.embedding(torch.arange(24)), table)


def test_a_tied_files_embedding_is_its_output_layers_weight_held_once(tmp_path):
    target = make_tiny_target(tmp_path / "t", family="llama", vocab_size=40, hidden_size=64, num_layers=2, seed=11)
    checkpoint, path = write_tiny_gguf(target, tmp_path, tied=True)
    model = load_target(checkpoint, torch.float32, "cpu")
    weights = QuantizedWeights(model, "file", path)
    assert weights.embedding.weight is weights.output  # one packed table for both
    table = model.get_input_embeddings().weight
    assert torch.equal(table, model.lm_head.weight)
    ids = torch.tensor([[39, 0, 7], [7, 7, 21]])
    assert torch.equal(weights.embedding(ids), table[ids])  # the checkpoint's rows, bit for bit
    assert torch.equal(weights.embedding(torch.arange(40)), quant.dequantize(weights.output))
    with pytest.raises(RuntimeError, match="outside the weight"):
        weights.embedding(torch.tensor([40]))
    # the same weights through an untied file: two tables, the same lookups and logits
    (tmp_path / "untied").mkdir()
    untied_checkpoint, untied_path = write_tiny_gguf(target, tmp_path / "untied", tied=False)
    untied = QuantizedWeights(load_target(untied_checkpoint, torch.float32, "cpu"), "file", untied_path)
    assert untied.embedding.weight is not untied.output
    assert torch.equal(untied.embedding(ids), weights.embedding(ids))


def _same_index(ours: GGUFTensors, path) -> None:
    """``ours`` holds what gguf's own reader finds in ``path``: every tensor (type, shape, offset, bytes),
    the data's start, and every field that is not an array, value for value."""
    library = gguf.GGUFReader(str(path))
    assert ours.reader.data_offset == library.data_offset and ours.reader.alignment == library.alignment
    assert list(ours.tensors) == [t.name for t in library.tensors]
    for t in library.tensors:
        mine = ours.tensors[t.name]
        assert (mine.tensor_type, list(mine.shape), mine.data_offset) == (t.tensor_type, list(t.shape), t.data_offset)
        assert np.array_equal(mine.data, t.data)
    arrays = {k for k, f in library.fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY}
    assert set(ours.reader.fields) == set(library.fields) - arrays
    for key, field in ours.reader.fields.items():
        other = library.fields[key]
        assert (field.offset, field.types) == (other.offset, other.types)
        assert [bytes(field.parts[i]) for i in field.data] == [bytes(other.parts[i]) for i in other.data]


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_the_tensor_index_skips_the_metadatas_arrays_and_reads_what_the_library_reads(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("index") / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    texts = st.text(max_size=12)
    writer.add_array("tokenizer.ggml.tokens", data.draw(st.lists(texts, max_size=40)))
    writer.add_array("tokenizer.ggml.scores", data.draw(st.lists(st.floats(-10, 10, width=32), max_size=30)))
    writer.add_array("tokenizer.ggml.token_type", data.draw(st.lists(st.integers(0, 6), max_size=30)))
    writer.add_array("nested", [data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5)) for _ in range(3)])
    writer.add_array("nested.strings", [data.draw(st.lists(texts, min_size=1, max_size=4)) for _ in range(2)])
    for item_type in (gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT64,
                      gguf.GGUFValueType.FLOAT64, gguf.GGUFValueType.BOOL):  # every item size: 1, 2, 8 bytes
        values = data.draw(st.lists(st.booleans() if item_type == gguf.GGUFValueType.BOOL else st.integers(0, 100),
                                    min_size=1, max_size=9))
        writer.add_key_value(f"sized.{item_type.name.lower()}", values, gguf.GGUFValueType.ARRAY, sub_type=item_type)
    writer.add_custom_alignment(data.draw(st.sampled_from([16, 32, 64])))
    writer.add_string("general.name", data.draw(texts))
    writer.add_float32("llama.rope.freq_base", 10000.0)
    for i in range(data.draw(st.integers(1, 3))):
        values = np.arange(32 * (i + 1), dtype=np.float32).reshape(i + 1, 32)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_index(GGUFTensors(path), path)
    # cut inside the metadata or the tensor index: one clear line, as for any unreadable file
    cut = path.with_name("cut.gguf")
    cut.write_bytes(path.read_bytes()[: data.draw(st.integers(4, header_end(path)))])
    with pytest.raises(DartreeError, match="not a readable GGUF file"):
        GGUFTensors(cut)


def header_end(path) -> int:
    """Where a GGUF file's header (metadata and tensor index) ends."""
    return int(gguf.GGUFReader(str(path)).data_offset) - 1


def test_the_bundled_files_tensor_index_is_the_librarys():
    from dartree.default_model import gguf_path

    _same_index(GGUFTensors(gguf_path()), gguf_path())


def _random_batch(data, pasts: list[int], vocab: int):
    """Rows of requests (slot s after its committed ``pasts[s]`` tokens): each a random tree (a row sees
    itself and some earlier rows of its request), as the round's verification forward lays them out."""
    parts = []
    for s, past in enumerate(pasts):
        n = data.draw(st.integers(1, 9))
        tokens = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]  # -1: a root row
        vis = torch.eye(n, dtype=torch.bool)
        depths = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(parents):
            if p >= 0:
                vis[i] |= vis[p]
                depths[i] = depths[p] + 1
        parts.append(Rows.one_request(tokens, s, past, depths, vis))
    width = max(p.visible.shape[1] for p in parts)
    for p in parts:  # one width for the batch
        p.visible = torch.nn.functional.pad(p.visible, (0, width - p.visible.shape[1])).contiguous()
    return [p.tokens.numel() for p in parts], Rows(*(torch.cat([getattr(p, f) for p in parts])
                                                     for f in ("tokens", "slots", "positions", "cache_positions", "past", "visible")))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), which=st.sampled_from(["file", "q8_0", "mixed", "float32", "float64"]))
def test_the_compiled_layer_loop_gives_the_python_loops_bits(file_pipe, q8_pipe, mixed_pipe, model_dirs, data, which):
    """``lean.forward`` runs its layer loop in one compiled call (forward_kernels.cpp); the loop written in
    Python over the same kernels is its reference: the same states, tapped states and K/V store, bit for
    bit, for quantised and float weights, random batches of trees over random contexts."""
    from dartree.targets.lean import KVStore, LeanWeights, forward
    if which in ("file", "q8_0", "mixed"):
        weights = {"file": file_pipe, "q8_0": q8_pipe, "mixed": mixed_pipe}[which].target.weights
    else:
        model = load_target(model_dirs[("qwen3", "target")], getattr(torch, which), "cpu")
        weights = LeanWeights(model)
    assert weights.compiled_forward() is not None
    vocab = weights.model.config.vocab_size
    slots = data.draw(st.integers(1, 3))
    tapped = sorted(data.draw(st.sets(st.integers(0, len(weights.layers) - 1), max_size=2)))
    stores = [KVStore(weights, slots=slots) for _ in range(2)]
    pasts = [data.draw(st.integers(1, 20)) for _ in range(slots)]
    for s, past in enumerate(pasts):  # the same committed contexts in both stores
        context = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=past, max_size=past)))
        for store in stores:
            forward(weights, store, Rows.one_request(context, s, 0, torch.arange(past), torch.ones(past, past, dtype=torch.bool).tril()),
                    compiled=False)
    sizes, rows = _random_batch(data, pasts, vocab)
    python = forward(weights, stores[0], rows, tapped, compiled=False)
    compiled = forward(weights, stores[1], rows, tapped)
    assert torch.equal(python[0], compiled[0])
    assert (python[1] is None) == (compiled[1] is None) == (not tapped)
    if tapped:
        assert torch.equal(python[1], compiled[1])
    for s, (past, n) in enumerate(zip(pasts, sizes)):  # the K/V written (the rest of the store is never read)
        for a, b in ((stores[0].k, stores[1].k), (stores[0].v, stores[1].v)):
            assert torch.equal(a[:, s, :, :past + n], b[:, s, :, :past + n])


def test_a_file_the_products_do_not_take_falls_back_to_float32_with_one_line(tmp_path, monkeypatch, capsys):
    """weights='auto' on a file of a type the products do not take (F16 here): one line says why and how big the
    float32 checkpoint will be, before the conversion starts."""
    from dartree import pipeline

    class Converting(Exception):
        pass

    def convert(gguf, verbose=True):
        raise Converting  # (transformers would make a default-sized model of this tiny file without config fields)

    monkeypatch.setattr(pipeline, "gguf_checkpoint_dir", convert)
    target = make_tiny_target(tmp_path / "t", family="llama", vocab_size=24, hidden_size=64, num_layers=2, seed=37)
    _, path = write_tiny_gguf(target, tmp_path, qtype=gguf.GGMLQuantizationType.F16, norms=True)
    with pytest.raises(Converting):
        dartree.load(str(path), cost_model=None)
    err = capsys.readouterr().err
    assert "runs dequantised to float32 (a 0.0 GB checkpoint" in err and "holds F16 weights" in err


def test_a_conversion_transformers_cannot_do_is_one_line_and_leaves_no_folder(tmp_path):
    from dartree import default_model
    from dartree.errors import CheckpointError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))  # the magic, then nothing a reader can parse
    (tmp_path / "cache").mkdir()
    for write in (default_model.write_gguf_config, default_model.convert_gguf):
        with pytest.raises(CheckpointError, match="bad.gguf: transformers could not"):
            write(bad, tmp_path / "cache" / "out")
    assert not any((tmp_path / "cache").iterdir())  # no .partial-* folder left behind
