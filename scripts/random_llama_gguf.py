"""A 1B-class Llama (hidden 2048, 16 layers, 8192 MLP, 32/8 heads, untied output layer) with random weights and
SmolLM2's tokenizer and chat template, as an F32 GGUF: for timing both servers on llama.cpp's K-quants of a realistic
shape, which the bundled 576-wide model barely has (the tokens it writes mean nothing; no weights are downloaded).

    bash scripts/build_llama_cpp.sh      # llama-quantize, and SmolLM2's F32 GGUF (the tokenizer's source)
    .venv/bin/python scripts/random_llama_gguf.py /tmp/llama1b-random-F32.gguf
    LD_LIBRARY_PATH=.cache/llama.cpp/bin .cache/llama.cpp/bin/llama-quantize /tmp/llama1b-random-F32.gguf \
        /tmp/llama1b-random-Q4_K_M.gguf Q4_K_M 2
"""
import argparse

import gguf
import numpy as np

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("out", help="the F32 GGUF to write (~4.7 GB)")
ap.add_argument("--tokenizer-from", default=".cache/llama.cpp/SmolLM2-135M-Instruct.F32.gguf",
                help="a llama GGUF whose metadata (tokenizer, chat template, RoPE base, eps) is copied")
args = ap.parse_args()
src = gguf.GGUFReader(args.tokenizer_from)
H, L, I, NH, NKV, HD, V = 2048, 16, 8192, 32, 8, 64, 49152
w = gguf.GGUFWriter(args.out, "llama")
shape = {"llama.embedding_length": H, "llama.block_count": L, "llama.feed_forward_length": I,
         "llama.attention.head_count": NH, "llama.attention.head_count_kv": NKV, "llama.rope.dimension_count": HD}
for field in src.fields.values():
    name = field.name
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    vtype = field.types[0]
    if name in shape:
        w.add_uint32(name, shape[name]); continue
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            vals = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        else:
            vals = [field.parts[i].tolist()[0] for i in field.data]
        w.add_key_value(name, vals, vtype, sub_type=sub)
    elif vtype == gguf.GGUFValueType.STRING:
        w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
    else:
        w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
rng = np.random.default_rng(0)
def rand(*s, scale=0.02):
    return (rng.standard_normal(s, dtype=np.float32) * scale)
w.add_tensor("token_embd.weight", rand(V, H))
w.add_tensor("output_norm.weight", np.ones(H, np.float32))
w.add_tensor("output.weight", rand(V, H))
for i in range(L):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(f"blk.{i}.attn_q.weight", rand(NH * HD, H))
    w.add_tensor(f"blk.{i}.attn_k.weight", rand(NKV * HD, H))
    w.add_tensor(f"blk.{i}.attn_v.weight", rand(NKV * HD, H))
    w.add_tensor(f"blk.{i}.attn_output.weight", rand(H, NH * HD))
    w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(I, H))
    w.add_tensor(f"blk.{i}.ffn_up.weight", rand(I, H))
    w.add_tensor(f"blk.{i}.ffn_down.weight", rand(H, I))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
