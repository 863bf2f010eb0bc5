import json, torch, dartree
torch.set_num_threads(1)
from dartree.bench.datasets import load_samples, select
p = dartree.load()
g = {}
for l in open("docs/results/ablations/greedy.jsonl"):
    r = json.loads(l); g[(r["dataset"], r["sample_id"])] = r["tokens"]
import collections
hit = collections.Counter(); hit_off = collections.Counter(); hit_prev = collections.Counter(); n = collections.Counter()
for smp in select(load_samples("gsm8k"), 3, 0):
    y = g[("gsm8k", smp.sample_id)]
    ids = p.encode(messages=[{"role":"user","content":smp.turns[0]}])
    p.target.capture = True
    full = torch.cat([ids, torch.tensor(y)])
    _, feats = p.target.prefill(full)
    p.proposer.reset(); P = ids.numel(); cached = 0
    for i in range(0, 150):
        d = p.proposer.draft(y[i], feats[cached:P+i], P+i); cached = P+i
        top = d.base_logits.argmax(-1).tolist()
        for k in range(len(top)):
            if i+k+1 < len(y):
                n[k] += 1; hit[k] += top[k] == y[i+k+1]
                if i+k+2 < len(y): hit_off[k] += top[k] == y[i+k+2]
                hit_prev[k] += top[k] == y[i+k]
for k in range(8):
    print(k+1, f"acc={hit[k]/n[k]:.3f} next={hit_off[k]/n[k]:.3f} prev={hit_prev[k]/n[k]:.3f}")
