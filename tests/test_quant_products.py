"""Products on GGUF block-quantised weights (dartree/quant.py, csrc/quant_kernels.cpp): bitwise row
invariance (1..128 rows, any neighbours), the same bits on every instruction-set path (AVX-512 VNNI,
AVX2, scalar), float64 references (the block terms' sum within fp32 rounding, the unquantised product
within the activation quantisation's own bound), and the real bundled GGUF (dequantisation equal to
gguf's own, products on real layers)."""

import pytest
import torch

from dartree import quant
from dartree.hardware import cpu_info

gguf = pytest.importorskip("gguf")
ext = quant.load()
TYPES = list(quant.TYPES)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
# where each type's fp16 scales sit in its GGUF block (the rest of a random block is random quants)
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}
GGUF_QUANTISES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the types gguf's own quantiser writes
WIDE = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # held a byte a value (Q5_0 in Q8_0's records, Q5_K in Q5_1's)
HALF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # GGUF's fp16 scales kept; the K-quants': fp16 d and integer scales
WITH_MIN = ("Q4_1", "Q4_K", "Q5_1", "Q5_K")


def random_weight(qtype: str, n: int, k: int, seed: int) -> tuple[quant.QuantWeight, torch.Tensor]:
    """A random weight: a float weight quantised by gguf's own quantiser (``GGUF_QUANTISES``), else random
    GGUF blocks with small fp16 scales (gguf has no K-quant quantiser). -> (packed weight, raw blocks)"""
    gen = torch.Generator().manual_seed(seed)
    if qtype in GGUF_QUANTISES:
        w = (torch.randn(n, k, generator=gen) * 0.05 + torch.rand(n, 1, generator=gen) * 0.02).numpy()
        raw = torch.from_numpy(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype)))
    else:
        values, size = quant.BLOCK_FORMAT[qtype]
        raw = torch.randint(0, 256, (n, k // values, size), generator=gen, dtype=torch.uint8)
        for offset in SCALE_OFFSETS[qtype]:  # d (and dmin): small, positive
            scale = (torch.rand(n, k // values, 1, generator=gen) * 0.004 + 0.0005).to(torch.float16)
            raw[..., offset:offset + 2] = scale.view(torch.uint8)
        raw = raw.reshape(n, -1)
    return quant.QuantWeight.from_blocks(qtype, raw, k), raw


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with the features that reach the edge cases: a block of zeros (d = 0), outliers,
    and a block whose values sit exactly on rounding ties (max 127, so x / d = x)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 4 + 0.1)
    x[:, :32] = 0.0
    if k >= 96:
        x[:, 32:64] *= 30.0
        ties = torch.randint(-126, 126, (m, 32), generator=gen).float() + 0.5
        ties[:, 0] = 127.0
        x[:, 64:96] = ties
    return x


def shape_for(qtype: str, n: int, k: int) -> tuple[int, int]:
    """(n, k) with k rounded to the type's block (256 for the K-quants)."""
    values = quant.BLOCK_FORMAT[qtype][0]
    return n, max(values, k // values * values)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (100, 64)])
def test_each_row_has_the_same_bits_whatever_shares_the_call(qtype, n, k):
    n, k = shape_for(qtype, n, k)
    qw, _ = random_weight(qtype, n, k, seed=n + k)
    x, res = activations(128, k, seed=1), torch.randn(128, n, generator=torch.Generator().manual_seed(2))
    full, full_res = qw.product(x), qw.product(x, res)
    assert torch.equal(full_res, res + full)  # the residual is added after the whole sum
    for m in range(1, 129):  # any prefix of the rows
        assert torch.equal(qw.product(x[:m]), full[:m]), m
    for i in range(128):  # each row alone (and every 7th with the residual)
        assert torch.equal(qw.product(x[i:i + 1]), full[i:i + 1]), i
        if i % 7 == 0:
            assert torch.equal(qw.product(x[i:i + 1], res[i:i + 1].contiguous()), full_res[i:i + 1]), i
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):  # random batches: any rows, in any order, beside any others
        idx = torch.randint(0, 128, (int(torch.randint(1, 70, (1,), generator=gen)),), generator=gen)
        assert torch.equal(qw.product(x[idx]), full[idx])


@pytest.mark.parametrize("variant", list(quant.VARIANTS))
def test_every_instruction_set_path_gives_the_same_bits(variant):
    if variant == "avx2" and "avx2" not in cpu_info()[1]:
        pytest.skip("no AVX2 on this CPU")
    other = quant.load(extra_cflags=quant.VARIANTS[variant])
    assert other.path() == variant
    for k, ns in ((576, (960, 16, 1)), (1536, (100,)), (32, (100, 16, 1)), (256, (100, 1))):
        x = activations(130, k, seed=k)
        for a, b in zip(quant.quantize_rows(x), quant.quantize_rows(x, other)):
            assert torch.equal(a, b)
        for qtype in TYPES:
            if k % quant.BLOCK_FORMAT[qtype][0]:
                continue
            for n in ns:
                qw, raw = random_weight(qtype, n, k, seed=n * k)
                qo = quant.QuantWeight.from_blocks(qtype, raw, k, other)
                assert torch.equal(qw.packed, qo.packed)
                assert torch.equal(quant.dequantize(qw), quant.dequantize(qo, other))
                res = torch.randn(130, n)
                for m in (1, 2, 3, 5, 8, 9, 17, 64, 130):
                    assert torch.equal(qw.product(x[:m]), qo.product(x[:m], ext=other)), (qtype, n, k, m)
                assert torch.equal(qw.product(x, res), qo.product(x, res, ext=other)), (qtype, n, k)


def test_activation_quantisation_is_llama_cpp_q8_0_with_ties_to_even():
    x = activations(40, 576, seed=4)
    q, d, s = quant.quantize_rows(x)
    blocks = x.view(40, -1, 32)
    ref_d = blocks.abs().amax(dim=2) / 127
    inv = torch.where(ref_d == 0, torch.zeros_like(ref_d), 1 / ref_d)
    ref_q = torch.round(blocks * inv[..., None]).clamp(-127, 127)  # torch.round: half to even
    assert torch.equal(d, ref_d)
    assert torch.equal(q.view(40, -1, 32).float(), ref_q)
    assert torch.equal(s, ref_q.sum(dim=2).int())
    assert torch.equal(q[:, 64:96].float(), torch.round(x[:, 64:96]))  # the ties went to even


def record_parts(qw: quant.QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed records read back by the layout csrc/quant_kernels.cpp documents: (q [N, K/32, 32] the
    signed integer values, a [N, K/32, 2] the scales of inputs 0..15 and 16..31, b [N, K/32] the minimum)."""
    n, _ = qw.shape
    groups, nb, _ = qw.packed.shape
    wide = qw.qtype in WIDE
    qb = 512 if wide else 256
    units = qw.packed[..., :qb].reshape(groups, nb, -1, 16, 4).int()  # [group, block, t, j, i]
    if wide:
        q = units - 128
    else:
        q = torch.cat([units & 0x0F, units >> 4], dim=2) - (8 if qw.qtype == "Q4_0" else 0)
    q = q.permute(0, 3, 1, 2, 4).reshape(groups * 16, nb, 32)[:n].double()
    if qw.qtype in ("Q4_K", "Q5_K", "Q6_K"):  # each row's fp16 d (and dmin), then its integer scales (and minimums)
        assert qw.packed.shape[2] == qb + (96 if qw.qtype != "Q6_K" else 64 + 16)  # (Q6_K's padding)
        f = qw.packed[..., qb:]
        d = f[..., :32].contiguous().view(torch.float16).reshape(groups, nb, 1, 16).double()
        if qw.qtype == "Q6_K":
            floats = d * f[..., 32:64].contiguous().view(torch.int8).reshape(groups, nb, 2, 16).double()
        else:
            dmin = f[..., 32:64].contiguous().view(torch.float16).reshape(groups, nb, 1, 16).double()
            sc_m = f[..., 64:96].reshape(groups, nb, 2, 16).double()
            floats = torch.cat([d * sc_m[:, :, :1], -(dmin * sc_m[:, :, 1:])], dim=2)
    else:
        float_type = torch.float16 if qw.qtype in HALF else torch.float32
        count = 2 if qw.qtype in WITH_MIN else 1
        assert qw.packed.shape[2] == qb + 16 * 2 * count
        floats = qw.packed[..., qb:].contiguous().view(float_type).reshape(groups, nb, -1, 16)
    floats = floats.permute(0, 3, 1, 2).reshape(groups * 16, nb, -1)[:n].double()  # fp16 widens exactly
    a = floats[..., :2] if qw.qtype == "Q6_K" else floats[..., :1].expand(n, nb, 2)
    b = floats[..., 1] if qw.qtype in WITH_MIN else torch.zeros(n, nb, dtype=torch.float64)
    return q, a, b


def block_terms(qw: quant.QuantWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 sum of the block terms a d_x isum (+ b d_x sum(q_x)) from the exact integer sums, and the
    sum of their magnitudes."""
    q_w, a, b = record_parts(qw)
    nb = q_w.shape[1]
    q, d, s = quant.quantize_rows(x)
    isum = torch.einsum("mbhi,nbhi->mnbh", q.double().view(-1, nb, 2, 16), q_w.view(-1, nb, 2, 16))  # exact
    terms = torch.cat([a[None] * d.double()[:, None, :, None] * isum,
                       (b[None] * (d.double() * s.double())[:, None])[..., None]], dim=-1)
    return terms.sum(dim=(2, 3)), terms.abs().sum(dim=(2, 3))


@pytest.mark.parametrize("qtype", TYPES)
def test_close_to_float64_references(qtype):
    n, k = 200, 768
    qw, raw = random_weight(qtype, n, k, seed=7)
    w_deq = quant.dequantize(qw)  # gguf's own values, bit for bit
    assert torch.equal(w_deq, torch.from_numpy(gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, qtype))))
    w_deq = w_deq.double()
    x = activations(33, k, seed=8)
    y = qw.product(x).double()
    exact, magnitude = block_terms(qw, x)
    q, d, _ = quant.quantize_rows(x)
    x_deq = (q.double().view(33, -1, 32) * d.double()[..., None]).view(33, k)
    if qtype == "Q5_K":  # d * sc * q (22 bits) - dmin * m can need more than float32's 24: gguf's values are rounded
        assert ((exact - x_deq @ w_deq.T).abs() <= 2 ** -24 * (x_deq.abs() @ w_deq.abs().T)).all()
    else:
        torch.testing.assert_close(exact, x_deq @ w_deq.T, rtol=1e-12, atol=1e-12)  # the decomposition itself
    assert ((y - exact).abs() <= 1e-5 * magnitude + 1e-30).all()  # only the fp32 rounding of the block sum
    # against the unquantised activations: within |W| . (d_x / 2), the activation rounding's own bound
    bound = w_deq.abs() @ (d.double() / 2).repeat_interleave(32, dim=1).T
    assert ((y - x.double() @ w_deq.T).abs() <= bound.T + 1e-5 * magnitude).all()


def test_the_bundled_gguf_dequantises_as_gguf_does_and_its_products_follow_fp32():
    from dartree.default_model import gguf_path

    reader = gguf.GGUFReader(str(gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_q.weight", "blk.29.ffn_gate.weight"):
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        qw = quant.read_gguf_tensor(reader, name)
        w = quant.dequantize(qw)
        assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))
        x = torch.randn(9, qw.shape[1], generator=torch.Generator().manual_seed(9))
        y, ref = qw.product(x), x @ w.T
        _, d, _ = quant.quantize_rows(x)
        bound = w.double().abs() @ (d.double() / 2).repeat_interleave(32, dim=1).T
        assert ((y.double() - ref.double()).abs() <= bound.T * 1.001 + 1e-4).all(), name
        assert (y - ref).norm() <= 0.01 * ref.norm(), name  # the activations' int8 rounding: well under 1 %
    with pytest.raises(KeyError):
        quant.read_gguf_tensor(reader, "no.such.weight")
    with pytest.raises(ValueError, match="F32"):
        quant.read_gguf_tensor(reader, "blk.0.attn_norm.weight")
    # the Q8_0 token embedding (the tied output layer): gguf's values, and quantize_q8_0 writes gguf's blocks
    emb = tensors["token_embd.weight"]
    q8 = quant.QuantWeight.from_blocks("Q8_0", torch.from_numpy(emb.data[:4096].copy()), 576)
    w = torch.from_numpy(gguf.quants.dequantize(emb.data[:4096], emb.tensor_type))
    assert torch.equal(quant.dequantize(q8), w)
    assert torch.equal(quant.quantize_q8_0(w).packed, q8.packed)  # exactly GGUF's Q8_0 blocks again
    noisy = w + torch.randn(w.shape, generator=torch.Generator().manual_seed(10)) * 1e-3
    theirs = torch.from_numpy(gguf.quants.quantize(noisy.numpy(), emb.tensor_type))
    assert torch.equal(quant.quantize_q8_0(noisy).packed, quant.QuantWeight.from_blocks("Q8_0", theirs, 576).packed)


def test_non_finite_rows_give_nan_and_leave_the_others_alone():
    qw, _ = random_weight("Q4_1", 40, 64, seed=2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    clean = qw.product(x)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    y = qw.product(x)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[[0, 3]], clean[[0, 3]])


def test_bad_inputs_are_refused():
    qw, _ = random_weight("Q4_1", 20, 64, seed=1)
    with pytest.raises(RuntimeError, match="columns"):
        qw.product(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="residual"):
        qw.product(torch.randn(2, 64), torch.randn(2, 21))
    with pytest.raises(ValueError, match="IQ4_XS"):
        quant.QuantWeight.from_blocks("IQ4_XS", torch.zeros(1, 136, dtype=torch.uint8), 256)
    with pytest.raises(RuntimeError, match="is not Q4_0"):
        ext.pack(torch.zeros(1, 136, dtype=torch.uint8), 23, 256)  # IQ4_XS's id
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.pack(torch.zeros(1, 20, dtype=torch.uint8), quant.TYPES["Q4_1"], 48)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.pack(torch.zeros(1, 72, dtype=torch.uint8), quant.TYPES["Q4_K"], 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_q8_0(torch.randn(3, 40))
    assert qw.product(torch.randn(0, 64)).shape == (0, 20)
