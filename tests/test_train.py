"""Training pipeline on a tiny target: shards, packed block training, curriculum, resume, export."""

import json
import math
import os
import random

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM

import dartree
from dartree.train.data import generate_batch, load_shard, load_shards, save_shard, tapped_target_states
from dartree.train.drafter import TrainConfig, Trainer, block_batch, draft_vocabulary, export, vocabulary_coverage


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tiny import make_tiny_target

    root = tmp_path_factory.mktemp("train")
    target_dir = make_tiny_target(root / "target", vocab_size=16, hidden_size=32, num_layers=4, seed=7)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    rng = random.Random(0)
    data = root / "data"
    data.mkdir()
    for k in range(3):
        prompts = [[rng.randrange(16) for _ in range(rng.randint(2, 6))] for _ in range(8)]
        seqs = generate_batch(target, prompts, 24, 1.0 if k == 2 else 0.0, set(), 0, torch.Generator().manual_seed(k))
        save_shard(data / f"shard-{k:05d}.safetensors", seqs, {"shard": k})
    return target_dir, target, data


def test_batched_generation_matches_unbatched_greedy(tiny_data):
    target_dir, target, data = tiny_data
    seqs = load_shard(data / "shard-00000.safetensors")
    assert len(seqs) == 8
    for s in seqs:
        prompt = s.tokens[: s.prompt_len].tolist()
        assert s.tokens[s.prompt_len:].tolist() == hf_greedy(target, prompt, 24)


def test_length_grouped_prefill_and_dropping_ended_rows_keep_greedy_exact(tiny_data):
    """21 prompts of 1-12 tokens: prefilled 8 at a time, each group padded to its own longest, then
    stacked into one left-padded cache; rows that hit the stop token leave the batch mid-way. The
    logits and every response equal the prompt run alone."""
    from dartree.train.data import prefill_left_padded

    target_dir, target, data = tiny_data
    rng = random.Random(1)
    prompts = [[rng.randrange(16) for _ in range(rng.randint(1, 12))] for _ in range(21)]
    with torch.no_grad():
        logits, cache, attn = prefill_left_padded(target, prompts, pad_id=0, group=8)
        alone = torch.stack([target(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, alone)
    assert attn.shape == (21, 12) and attn.sum(-1).tolist() == [len(p) for p in prompts]
    assert cache.get_seq_length() == 12
    stop = 5
    seqs = generate_batch(target, prompts, 20, 0.0, {stop}, 0, torch.Generator())
    lengths = []
    for p, s in zip(prompts, seqs):
        want = hf_greedy(target, p, 20, eos=stop)
        assert s.tokens.tolist() == p + want and s.prompt_len == len(p)
        lengths.append(len(want))
    assert sum(n < 20 for n in lengths) >= 3 and max(lengths) == 20  # rows ended at different steps


def test_shards_hold_token_ids_only_and_features_are_recomputed(tiny_data):
    from safetensors.torch import load_file

    target_dir, target, data = tiny_data
    assert set(load_file(str(data / "shard-00000.safetensors"))) == {"tokens", "offsets", "prompt_lens"}
    s = load_shard(data / "shard-00001.safetensors")[0]
    feats, final = tapped_target_states(target, [1, 2], s.tokens)
    ref = target(s.tokens[None].long(), output_hidden_states=True)
    # hidden_states[i + 1] is the output of layer i; the last one is already final-normed
    torch.testing.assert_close(feats[:, :32], ref.hidden_states[2][0])
    torch.testing.assert_close(feats[:, 32:], ref.hidden_states[3][0])
    torch.testing.assert_close(target.lm_head(final), ref.logits[0])


def test_draft_vocabulary_is_the_most_frequent_response_tokens():
    from dartree.train.data import Sequence

    seqs = [Sequence(torch.tensor([9, 9, 9, 1, 1, 2, 5, 5, 5]), 3), Sequence(torch.tensor([0, 5, 1, 7]), 1)]
    # responses: 1 1 2 5 5 5 | 5 1 7 -> 5 x4, 1 x3, then 2 and 7 once (tie: the smaller id); the prompt's 9s do not count
    assert draft_vocabulary(seqs, 3, 10).tolist() == [1, 2, 5]
    cov = vocabulary_coverage(seqs, 10, sizes=(1, 2, 4))
    assert cov == {1: 4 / 9, 2: 7 / 9, 4: 1.0}


def test_block_batch_labels_are_shifted():
    seq = type("S", (), {})()
    seq.tokens = torch.arange(100, 120)
    seq.prompt_len = 5
    a, valid, labels, prev = block_batch(seq, 4, 6, random.Random(0))
    for j, anchor in enumerate(a.tolist()):
        assert anchor >= 5
        for k in range(6):
            if valid[j, k]:
                assert labels[j, k] == 100 + anchor + k + 1 and prev[j, k] == 100 + anchor + k


def test_training_reduces_loss_resumes_and_exports(tiny_data, tmp_path):
    target_dir, target, data = tiny_data
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=40, seqs_per_step=2, anchors=6, block_size=5,
                      gru=16, rank=8, lr=3e-3, heldout_seqs=4, eval_new_tokens=8, eval_every=20, save_every=20, tapped=[1, 2], draft_vocab=12)
    trainer = Trainer(target, cfg, "drafter")
    first = trainer.evaluate()["heldout_loss"]
    cfg.steps = 20
    trainer.run()
    assert trainer.step == 20
    cfg.steps = 40
    resumed = Trainer(target, cfg, "drafter")  # picks up the checkpoint at step 20
    assert resumed.step == 20
    resumed.run()
    assert resumed.step == 40
    assert resumed.evaluate()["heldout_loss"] < first
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("sim_tau_base") >= 2
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("replay_tau_dartree_b16") >= 2

    mcfg = TrainConfig(data=str(data), out=str(tmp_path / "markov"), steps=10, anchors=6, block_size=5, markov_rank=8,
                       heldout_seqs=4, eval_new_tokens=8, eval_every=10, save_every=10, tapped=[1, 2], init_drafter=str(tmp_path / "run" / "checkpoint"))
    Trainer(target, mcfg, "markov").run()
    # the Markov head is measured as the decoder uses it too: replay tau of its trees on held-out prompts
    assert (tmp_path / "markov" / "metrics.jsonl").read_text().count("replay_tau_dartree_b16") >= 2

    # an exported drafter (the committed asset) resumes in a fresh folder at its recorded step
    export(tmp_path / "run" / "checkpoint", tmp_path / "shipped")
    assert json.loads((tmp_path / "shipped" / "training.json").read_text())["step"] == 40
    more = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "run-next"), "steps": 44, "resume_from": str(tmp_path / "shipped")})
    again = Trainer(target, more, "drafter")
    assert again.step == 40
    torch.testing.assert_close(again.model.fc.weight, resumed.model.fc.weight.to(torch.bfloat16).float())
    again.run()
    assert again.step == 44

    # exported checkpoints load through the generic loader and decode losslessly
    for name, ckpt in (("domino", tmp_path / "run" / "checkpoint"), ("markov", tmp_path / "markov" / "checkpoint")):
        export(ckpt, tmp_path / f"export-{name}")
        pipe = dartree.load(target_dir, tmp_path / f"export-{name}", dtype=torch.float64)
        assert pipe.drafter.config.projector_type == name
        want = hf_greedy(pipe.target_model, [3, 1, 4], 12)
        for method in ("dflash", "domino", "dartree"):
            assert pipe.generate(input_ids=[3, 1, 4], method=method, max_new_tokens=12, stop_token_ids=[]).token_ids == want


def test_training_step_makes_every_tensor_on_the_model_device(tiny_data, tmp_path):
    """A GPU run needs every tensor of a step on the model's device. Here the model is on the CPU and
    the default device is ``meta``: a tensor created without ``device=`` lands on meta, and mixing it
    with the CPU tensors fails, so this catches a forgotten device argument without a GPU."""
    target_dir, target, data = tiny_data
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=2, anchors=6, block_size=5, gru=16, rank=8,
                      heldout_seqs=4, eval_new_tokens=8, tapped=[1, 2], device="cpu")
    trainer = Trainer(target, cfg, "drafter")
    seq = trainer.train_seqs[0]
    with torch.device("meta"):
        l_final, l_base, *_ = trainer.sequence_losses(seq, random.Random(0), grad=True)
        metrics = trainer._evaluate(trainer.heldout, key_base=-1)  # the anchor metrics; replay runs the decoder's round
    assert l_final.device.type == "cpu" and torch.isfinite(l_final + l_base)
    (l_final + l_base).backward()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in trainer.model.parameters() if p.requires_grad)
    assert metrics["sim_tau_corrected"] >= 1.0


def test_feature_cache_reuses_the_target_forward(tiny_data, tmp_path, monkeypatch):
    """A cached sequence skips the target's forward and yields the very tensors it would recompute;
    past the memory cap, sequences are recomputed instead of cached."""
    import dartree.train.drafter as drafter_mod

    _, target, data = tiny_data
    calls = []
    real = drafter_mod.tapped_target_states
    monkeypatch.setattr(drafter_mod, "tapped_target_states", lambda *a: calls.append(1) or real(*a))
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=2, anchors=6, block_size=5, gru=16, rank=8,
                      heldout_seqs=4, eval_new_tokens=8, tapped=[1, 2])
    trainer = Trainer(target, cfg, "drafter")
    seq = trainer.train_seqs[3]
    fresh = trainer.features(seq)
    cached = [trainer.features(seq, key=3) for _ in range(3)]
    assert len(calls) == 2  # the uncached call, then one forward for key 3
    for again in cached:
        for a, b in zip(fresh, again):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    trainer.cfg.feature_cache_gb = 0.0
    trainer.features(trainer.train_seqs[4], key=4)
    trainer.features(trainer.train_seqs[4], key=4)
    assert len(calls) == 4 and 4 not in trainer._feature_cache


def test_bf16_autocast_step_matches_float32(tiny_data, tmp_path):
    """Autocast only rounds the products: losses and gradients stay close to the fp32 step, the
    weights and their gradients stay fp32, and training still lowers the held-out loss."""
    _, target, data = tiny_data
    runs = {}
    for autocast in (False, True):
        torch.manual_seed(0)
        cfg = TrainConfig(data=str(data), out=str(tmp_path / f"run-{autocast}"), steps=30, anchors=6, block_size=5, gru=16,
                          rank=8, lr=3e-3, heldout_seqs=4, eval_new_tokens=8, tapped=[1, 2], draft_vocab=12, eval_every=30, autocast=autocast)
        trainer = Trainer(target, cfg, "drafter")
        l_final, l_base, *_ = trainer.sequence_losses(trainer.train_seqs[0], random.Random(0), grad=True)
        (l_final + l_base).backward()
        runs[autocast] = (l_final.item(), trainer.model.fc.weight.grad.clone())
        assert trainer.model.fc.weight.dtype == trainer.model.fc.weight.grad.dtype == torch.float32
        if autocast:
            trainer.model.zero_grad()
            first = trainer.evaluate()["heldout_loss"]
            trainer.run()
            assert trainer.evaluate()["heldout_loss"] < first
    assert runs[True][0] == pytest.approx(runs[False][0], rel=2e-2)
    assert torch.nn.functional.cosine_similarity(runs[True][1].flatten(), runs[False][1].flatten(), dim=0) > 0.99


def test_resolve_device(monkeypatch):
    from dartree.errors import DartreeError
    from dartree.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DartreeError, match="no usable CUDA GPU.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(DartreeError, match="unknown device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(DartreeError, match="has 1 CUDA GPU"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("argv", [["train", "drafter", "--device", "cuda"], ["train", "data", "--device", "cuda"],
                                  ["generate", "hi", "--device", "cuda"]])
def test_missing_gpu_is_a_one_line_cli_error(argv, monkeypatch, capsys):
    from dartree.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no usable CUDA GPU" in err and "Traceback" not in err


def test_every_train_flag_is_a_trainconfig_declaration_that_parses_to_it(capsys):
    """``dartree train drafter|markov`` has a flag for each TrainConfig setting declared with flags (for
    the steps that declare it), its default the declared one (or the step's own), parsed by its
    declaration into the same TrainConfig; the help carries each default and no measurements."""
    from dartree.cli import build_parser, main
    from dartree.cli.train import train_config
    from dartree.train.drafter import STAGES

    given = dict(data="a,b", out="x", steps=7, seqs_per_step=2, anchors=5, draft_vocab=0, layers=2, gru=16, rank=8,
                 markov_rank=4, lr=0.01, hard_weight=0.5, base_weight=0.2, heldout_per_category=1, balance="sqrt",
                 eval_every=3, replay_eval=False, max_minutes=1.5, init_drafter="d", resume_from="r", tapped=[0, 2],
                 feature_cache_gb=0.5, rerank_vocab=True, rescan_every=0)
    parser = build_parser()
    for stage in STAGES:
        assert train_config(parser.parse_args(["train", stage])) == TrainConfig(out=f"runs/{stage}")
        flagged = [s for s in TrainConfig.declarations() if s.metadata["flags"] and stage in s.metadata["stages"]]
        assert {"steps", "tapped", "balance", "replay_eval"} <= {s.name for s in flagged}
        assert all(s.name in given for s in flagged), "give the new setting a value above"
        argv = ["train", stage]
        for s in flagged:
            flag, value = s.metadata["flags"][0], given[s.name]
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
        assert train_config(parser.parse_args(argv)) == TrainConfig(**{s.name: given[s.name] for s in flagged})
        with pytest.raises(SystemExit):
            main(["train", stage, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
        assert "measured" not in text and "(default 1,7,14,21,27)" in text and "(default --replay-eval)" in text
    for argv in (["train", "--help"], ["train", "data", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "measured" not in capsys.readouterr().out
    assert main(["train", "drafter", "--layers", "0"]) == 2
    assert "--layers must be at least 1, got 0" in capsys.readouterr().err
    assert main(["train", "drafter", "--hard-weight", "1.5"]) == 2
    assert "--hard-weight must be between 0 and 1, got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "drafter", "--tapped", "1,x"])
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_growing_a_resumed_drafter_keeps_its_outputs_then_trains_the_new_layer(tiny_data, tmp_path):
    """``--layers 2 --resume-from`` a 1-layer drafter: the grown drafter's logits equal the trained
    one's (the new layer starts as the identity), training then moves the new layer, the grown
    checkpoint saves and loads with 2 layers, and a Markov head trains on the 2-layer backbone."""
    target_dir, target, data = tiny_data
    base = dict(data=str(data), anchors=6, block_size=5, gru=16, rank=8, lr=3e-3, heldout_seqs=4, eval_new_tokens=8, eval_every=10,
                save_every=10, tapped=[1, 2], draft_vocab=12)
    one = Trainer(target, TrainConfig(out=str(tmp_path / "one"), steps=10, **base), "drafter")
    one.run()
    export(tmp_path / "one" / "checkpoint", tmp_path / "one-shipped", dtype=torch.float32)
    grown = Trainer(target, TrainConfig(out=str(tmp_path / "two"), steps=30, layers=2,
                                        resume_from=str(tmp_path / "one-shipped"), **base), "drafter")
    assert grown.step == 10 and len(grown.model.layers) == 2 and grown.model.config.num_hidden_layers == 2
    one.model.eval(), grown.model.eval()
    seq = one.heldout[0]
    before = one.sequence_losses(seq, random.Random(3), grad=False)
    after = grown.sequence_losses(seq, random.Random(3), grad=False)
    for b, a in zip(before[3:5], after[3:5]):  # base and corrected logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    new_layer = {k: v.clone() for k, v in grown.model.layers[1].state_dict().items()}
    grown.model.train()
    grown.run()
    assert grown.step == 30
    moved = [k for k, v in grown.model.layers[1].state_dict().items() if not torch.equal(v, new_layer[k])]
    assert any("o_proj" in k for k in moved) and any("q_proj" in k for k in moved)
    again = dartree.loading.load_drafter(tmp_path / "two" / "checkpoint")
    assert again.config.num_hidden_layers == 2 and len(again.layers) == 2
    with pytest.raises(dartree.errors.DartreeError, match="holds a 2-layer drafter; to grow it to 3 layers"):
        Trainer(target, TrainConfig(out=str(tmp_path / "two"), steps=40, layers=3, **base), "drafter")
    with pytest.raises(dartree.errors.DartreeError, match="fewer than the 2 layers"):
        Trainer(target, TrainConfig(out=str(tmp_path / "three"), steps=31, layers=1,
                                    resume_from=str(tmp_path / "two" / "checkpoint"), **base), "drafter")
    markov = Trainer(target, TrainConfig(out=str(tmp_path / "markov"), steps=4, markov_rank=8,
                                         init_drafter=str(tmp_path / "two" / "checkpoint"),
                                         **{k: v for k, v in base.items() if k != "draft_vocab"}), "markov")
    assert len(markov.model.layers) == 2
    markov.run()
    pipe = dartree.load(target_dir, tmp_path / "markov" / "checkpoint", dtype=torch.float64)
    want = hf_greedy(pipe.target_model, [3, 1, 4], 10)
    assert pipe.generate(input_ids=[3, 1, 4], method="dartree", max_new_tokens=10, stop_token_ids=[]).token_ids == want


def test_data_generation_starts_at_a_shard_and_skips_what_another_process_wrote(tmp_path, monkeypatch):
    """Two data processes share the work: one started at --start-shard 3 writes 3, 4, then wraps to
    0, 1; a shard present at the start (2) and one written meanwhile by the other process (0) are
    skipped, never generated twice."""
    import dartree.train.data as data_mod

    monkeypatch.setattr(data_mod, "original_prompts",
                        lambda *_: [data_mod.TrainingPrompt(f"prompt {i}", "gsm8k_train", "math") for i in range(10)])
    tok = type("Tok", (), {"eos_token_id": 0, "apply_chat_template": lambda self, msgs, **_: [1, 2, len(msgs[0]["content"])]})()
    out = tmp_path / "data"
    out.mkdir()
    save_shard(out / "shard-00002.safetensors", [data_mod.Sequence(torch.tensor([1, 2, 3], dtype=torch.int32), 2)], {})
    written = []

    def fake_batch(model, batch, *_):
        if written == [3]:  # while this process generates shard 4, the other one finishes shard 0
            save_shard(out / "shard-00000.safetensors", [data_mod.Sequence(torch.tensor([1, 2, 3], dtype=torch.int32), 2)], {})
        return [data_mod.Sequence(torch.tensor(p + [5], dtype=torch.int32), len(p)) for p in batch]

    real_save = data_mod.save_shard
    monkeypatch.setattr(data_mod, "generate_batch", fake_batch)
    monkeypatch.setattr(data_mod, "save_shard", lambda path, seqs, meta: written.append(meta["shard"]) or real_save(path, seqs, meta))
    model = torch.nn.Linear(1, 1)
    data_mod.generate_data(model, tok, "unused", out, batch_size=2, start_shard=3)
    assert written == [3, 4, 1]
    assert sorted(p.name for p in out.iterdir()) == [f"shard-{k:05d}.safetensors" for k in range(5)]
    with pytest.raises(dartree.errors.DartreeError, match="--start-shard must be between 0 and 4"):
        data_mod.generate_data(model, tok, "unused", out, batch_size=2, start_shard=5)


def test_data_processes_skip_a_shard_another_live_process_has_claimed(tmp_path, monkeypatch):
    """Once one data process catches up with another it must not write the other's shard under way:
    a shard claimed by a live process (here this test's parent) is skipped, one claimed by a process
    that has exited (a killed job) is taken over and written, and no claim is left behind."""
    import socket
    import subprocess
    import dartree.train.data as data_mod

    monkeypatch.setattr(data_mod, "original_prompts",
                        lambda *_: [data_mod.TrainingPrompt(f"prompt {i}", "gsm8k_train", "math") for i in range(8)])
    tok = type("Tok", (), {"eos_token_id": 0, "apply_chat_template": lambda self, msgs, **_: [1, 2, len(msgs[0]["content"])]})()
    out = tmp_path / "data"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    (out / "shard-00001.claim").write_text(f"{host} {os.getppid()}")  # alive: the process that started pytest
    (out / "shard-00002.claim").write_text(f"{host} {gone.pid}")      # exited
    (out / "shard-00003.claim").write_text(f"another-host-{host} {os.getpid()}")  # another machine's job
    written = []
    real_save = data_mod.save_shard
    monkeypatch.setattr(data_mod, "generate_batch",
                        lambda model, batch, *_: [data_mod.Sequence(torch.tensor(p + [5], dtype=torch.int32), len(p)) for p in batch])
    monkeypatch.setattr(data_mod, "save_shard", lambda path, seqs, meta: written.append(meta["shard"]) or real_save(path, seqs, meta))
    data_mod.generate_data(torch.nn.Linear(1, 1), tok, "unused", out, batch_size=2)
    assert written == [0, 2]
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors", "shard-00001.claim",
                                                     "shard-00002.safetensors", "shard-00003.claim"]
    assert data_mod.claim_shard(out, 1) is False and data_mod.claim_shard(out, 3) is False
    assert data_mod.claim_shard(out, 0) is True  # a claim says nothing of whether the shard exists
    data_mod.release_shard(out, 0)
    assert not (out / "shard-00000.claim").exists()


def test_training_picks_up_shards_written_while_it_runs(tiny_data, tmp_path):
    """A data job writing shards beside training feeds it: at a rescan the new shard's sequences are
    appended (earlier ones keep their indices, so cached features stay theirs); held-out stays fixed."""
    import shutil

    _, target, data = tiny_data
    mine = tmp_path / "data"
    mine.mkdir()
    for k in range(2):
        shutil.copy(data / f"shard-{k:05d}.safetensors", mine)
    cfg = TrainConfig(data=str(mine), out=str(tmp_path / "run"), steps=6, anchors=6, block_size=5, gru=16, rank=8,
                      heldout_seqs=4, eval_new_tokens=8, eval_every=100, tapped=[1, 2], rescan_every=3)
    trainer = Trainer(target, cfg, "drafter")
    before, held = list(trainer.train_seqs), [s.tokens for s in trainer.heldout]
    trainer.features(before[5], key=5)
    cfg.steps = 2
    trainer.run()
    assert len(trainer.train_seqs) == len(before)  # no rescan before step 3
    (mine / "shard-00002.00042.partial").write_bytes(b"half-written")  # a shard being written is not read
    shutil.copy(data / "shard-00002.safetensors", mine)
    cfg.steps = 6
    trainer.run()
    extra = load_shards([data / "shard-00002.safetensors"])
    assert len(trainer.train_seqs) == len(before) + len(extra)
    assert all(a is b for a, b in zip(trainer.train_seqs, before))
    assert [s.tokens.tolist() for s in trainer.train_seqs[len(before):]] == [s.tokens.tolist() for s in extra]
    assert all(s.tokens is t for s, t in zip(trainer.heldout, held)) and 5 in trainer._feature_cache
    assert trainer.add_new_shards() == 0


def test_engine_data_answers_each_prompt_as_the_target_alone(model_dirs):
    """``engine_responses``: three shards' prompts through the batched engine with fewer slots than
    prompts, so requests of the next shard join while the last answers of one are written. Every
    greedy answer equals HF greedy decoding of that prompt alone, every sampled answer the same
    request (seed) generated alone, and each shard comes back whole, in prompt order."""
    from dartree.engine import run_alone
    from dartree.targets.lean import LeanTarget
    from dartree.settings import GenerationSettings
    from dartree.train.data import ShardJob, TrainingPrompt, engine_responses

    pipe = dartree.load(model_dirs[("llama", "target")], None, dtype=torch.float32)
    assert isinstance(pipe.target, LeanTarget)
    rng = random.Random(3)
    jobs = []
    for k, temperature in enumerate([0.0, 1.0, 0.0]):
        encoded = [[rng.randrange(8) for _ in range(rng.randint(1, 9))] for _ in range(5)]
        jobs.append(ShardJob(k, [TrainingPrompt("", "s", "c")] * 5, encoded, temperature, 100 + k))
    stop = {3}
    answered = list(engine_responses(pipe, jobs, 12, stop, slots=3))
    assert sorted(job.k for job, _ in answered) == [0, 1, 2]
    ended_early = 0
    for job, seqs in answered:
        for i, (ids, s) in enumerate(zip(job.encoded, seqs)):
            assert s.prompt_len == len(ids) and s.tokens[: len(ids)].tolist() == ids
            answer = s.tokens[len(ids):].tolist()
            if job.temperature == 0:
                assert answer == hf_greedy(pipe.target_model, ids, 12, eos=3)
            settings = GenerationSettings(method="ar", max_new_tokens=12, temperature=job.temperature, seed=job.seed * 4096 + i)
            alone = run_alone(pipe.target, pipe.request(torch.tensor(ids), settings, stop_token_ids=[3]))
            assert answer == alone.output
            ended_early += len(answer) < 12
    assert ended_early >= 2  # some answers ended at the stop token, so slots freed at different rounds


def test_category_balance_held_out_categories_and_the_non_commercial_source(tiny_data, tmp_path):
    """Two folders read as one data set: each step draws a category uniformly whatever their sizes;
    each category's first sequences are held out (never trained on) and evaluated apart; Alpaca's
    sequences (CC BY-NC) are never trained on."""
    from dartree.train.data import NON_COMMERCIAL_SOURCES

    _, target, data = tiny_data
    seqs = load_shards(sorted(data.glob("shard-*.safetensors")))
    labelled = []
    for i, s in enumerate(seqs):  # 18 math, 4 coding, 2 of the non-commercial file
        source = f"{NON_COMMERCIAL_SOURCES[0]}/instruction" if i < 2 else ("x/coding" if i < 6 else "y/math")
        labelled.append(type(s)(s.tokens, s.prompt_len, source))
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    save_shard(first / "shard-00000.safetensors", labelled[:12], {})
    save_shard(second / "shard-00000.safetensors", labelled[12:], {})
    cfg = TrainConfig(data=f"{first},{second}", out=str(tmp_path / "run"), anchors=6, block_size=5, gru=16, rank=8,
                      heldout_seqs=1, heldout_per_category=2, tapped=[1, 2], eval_new_tokens=8)
    trainer = Trainer(target, cfg, "drafter")
    assert not any(s.source.startswith(NON_COMMERCIAL_SOURCES[0]) for s in trainer.train_seqs)
    assert {c: len(g) for c, g in trainer.heldout_by_category.items()} == {"coding": 2, "math": 2}
    held = {id(s) for s in trainer.heldout} | {id(s) for g in trainer.heldout_by_category.values() for s in g}
    assert not held & {id(s) for s in trainer.train_seqs}
    counts = trainer.category_counts()
    assert counts["math"] > 3 * counts["coding"]  # unbalanced data ...
    drawn = [trainer.train_seqs[trainer.draw_sequence()].source.rpartition("/")[2] for _ in range(2000)]
    assert 0.45 < drawn.count("coding") / len(drawn) < 0.55  # ... balanced steps
    metrics = trainer.evaluate()
    assert set(metrics["heldout_loss_by_category"]) == {"coding", "math"}
    assert set(metrics["replay_tau_dartree_b16_by_category"]) == {"coding", "math"}
    assert metrics["replay_tau_dartree_b16"] >= 1.0
    cfg.replay_eval = False  # --no-replay-eval: the held-out loss stays, the replay is skipped
    quick = trainer.evaluate()
    assert quick["heldout_loss"] == metrics["heldout_loss"] and not any(k.startswith("replay_tau") for k in quick)
    cfg.replay_eval = True
    cfg.balance = "sqrt"  # a category's share of the steps follows the square root of its size
    weighted = Trainer(target, cfg, "drafter")
    counts = weighted.category_counts()
    want = math.sqrt(counts["coding"]) / (math.sqrt(counts["coding"]) + math.sqrt(counts["math"]))
    drawn = [weighted.train_seqs[weighted.draw_sequence()].source.rpartition("/")[2] for _ in range(4000)]
    assert abs(drawn.count("coding") / len(drawn) - want) < 0.04 and want < 0.4
    cfg.balance = "none"
    plain = Trainer(target, cfg, "drafter")
    drawn = [plain.train_seqs[plain.draw_sequence()].source.rpartition("/")[2] for _ in range(2000)]
    assert drawn.count("coding") / len(drawn) < 0.3


def test_original_shards_are_labelled_by_their_prompts_text(monkeypatch):
    """Shards written before sources were kept get each prompt's file and category back from its text
    (the chat template's user turn); a prompt that matches none stays unlabelled."""
    import dartree.train.data as data_mod

    prompts = [data_mod.TrainingPrompt("What is 2 + 2?", "gsm8k_train", "math"),
               data_mod.TrainingPrompt("Write a haiku.", "alpaca_train_2000", "instruction"),
               data_mod.TrainingPrompt("x" * 300 + "def f(): pass", "mbpp_full", "coding")]
    monkeypatch.setattr(data_mod, "original_prompts", lambda *_: prompts)
    texts = {1: "What is 2 + 2?", 2: "Write a haiku.", 3: "x" * 200 + "def f(): pass", 4: "unknown"}  # 3: cut to its end

    class Tok:
        def batch_decode(self, batch):
            return [f"<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n{texts[int(ids[0])]}<|im_end|>\n<|im_start|>assistant\n"
                    for ids in batch]

    seqs = [data_mod.Sequence(torch.tensor([k, 9, 9]), 2) for k in (1, 2, 3, 4)]
    seqs.append(data_mod.Sequence(torch.tensor([1, 9]), 1, "kept/open_qa"))
    assert data_mod.label_original_sources(seqs, ".", Tok()) == 3
    assert [s.source for s in seqs] == ["gsm8k_train/math", "alpaca_train_2000/instruction", "mbpp_full/coding", "", "kept/open_qa"]
    assert [data_mod.sequence_category(s) for s in seqs] == ["math", "instruction", "coding", "unlabelled", "open_qa"]


def test_labelling_without_the_original_prompt_files_leaves_sequences_unlabelled(tmp_path):
    import dartree.train.data as data_mod

    seqs = [data_mod.Sequence(torch.tensor([1, 9, 9]), 2)]
    assert data_mod.label_original_sources(seqs, tmp_path, tokenizer=None) == 0
    assert seqs[0].source == ""


def test_engine_data_with_bf16_products_writes_whole_shards_and_says_how(model_dirs, tmp_path, monkeypatch):
    """``train data`` on the engine with bf16 products (what ``--dtype auto`` picks on a CPU with
    native bf16): every shard whole, in prompt order, prompts kept, and each shard's metadata names
    the products its answers came from."""
    from safetensors import safe_open

    import dartree.train.data as data_mod
    from dartree.loading import load_target
    from dartree.pipeline import Pipeline

    monkeypatch.setattr(data_mod, "original_prompts",
                        lambda *_: [data_mod.TrainingPrompt(f"prompt {i}", "gsm8k_train", "math") for i in range(7)])
    tok = type("Tok", (), {"eos_token_id": 3, "apply_chat_template": lambda self, msgs, **_: [1, 2, len(msgs[0]["content"]) % 8]})()
    model = load_target(model_dirs[("llama", "target")], torch.float32, "cpu")
    pipe = Pipeline(model, None, None, lean=True, lean_products="bfloat16")
    data_mod.generate_data(pipe, tok, "unused", tmp_path, batch_size=3, max_new_tokens=10, slots=2)
    files = data_mod.shard_files(tmp_path)
    assert len(files) == 3
    for k, f in enumerate(files):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
        assert meta["generator"] == "engine, bfloat16 products" and meta["dtype"] == "float32"
        seqs = data_mod.load_shard(f)
        assert len(seqs) == (3 if k < 2 else 1)
        for i, s in enumerate(seqs):
            assert s.tokens[: s.prompt_len].tolist() == [1, 2, len(f"prompt {3 * k + i}") % 8]
            assert 1 <= s.tokens.numel() - s.prompt_len <= 10


def test_reranking_a_resumed_drafters_vocabulary_keeps_trained_rows_and_adds_the_targets(tiny_data, tmp_path):
    """``--rerank-vocab --draft-vocab 14`` on an 8-token drafter: every kept token's base and
    corrected logits are the trained drafter's, a new token's output row is the target's mapped by
    the least-squares map of the kept rows and its correction row the kept rows' mean;
    the re-ranked drafter trains, saves, loads and decodes greedy-exact."""
    target_dir, target, data = tiny_data
    base = dict(data=str(data), anchors=6, block_size=5, gru=16, rank=8, lr=3e-3, heldout_seqs=4, eval_new_tokens=8, eval_every=10,
                save_every=10, tapped=[1, 2])
    small = Trainer(target, TrainConfig(out=str(tmp_path / "small"), steps=10, draft_vocab=8, **base), "drafter")
    small.run()
    export(tmp_path / "small" / "checkpoint", tmp_path / "small-shipped", dtype=torch.float32)
    wide = Trainer(target, TrainConfig(out=str(tmp_path / "wide"), steps=20, draft_vocab=14, rerank_vocab=True,
                                       resume_from=str(tmp_path / "small-shipped"), **base), "drafter")
    assert wide.step == 10 and wide.model.config.output_vocab_size == 14
    old_ids = small.model.draft_to_target(torch.arange(8))
    new_ids = wide.model.draft_to_target(torch.arange(14))
    assert set(old_ids.tolist()) < set(new_ids.tolist()) and new_ids.tolist() == sorted(new_ids.tolist())
    kept = wide.model.target_to_draft(16)[old_ids]  # new draft ids of the old vocabulary, in old order
    added = torch.tensor([i for i in range(14) if i not in kept.tolist()])
    target_rows = target.get_output_embeddings().weight.double()
    to_trained = torch.linalg.lstsq(target_rows[old_ids], small.model.lm_head.weight.double()).solution
    torch.testing.assert_close(wide.model.lm_head.weight[added], (target_rows[new_ids[added]] @ to_trained).float())
    mean_row = small.model.head.embed_proj[2].weight.mean(0)
    torch.testing.assert_close(wide.model.head.embed_proj[2].weight[added], mean_row.expand(len(added), -1))
    small.model.eval(), wide.model.eval()
    seq = small.heldout[0]
    before = small.sequence_losses(seq, random.Random(3), grad=False)
    after = wide.sequence_losses(seq, random.Random(3), grad=False)
    for b, a in zip(before[3:5], after[3:5]):  # base and corrected logits over the kept tokens
        torch.testing.assert_close(a[..., kept], b, rtol=0, atol=1e-6)
    wide.model.train()
    wide.run()
    again = dartree.loading.load_drafter(tmp_path / "wide" / "checkpoint")
    assert again.config.draft_vocab_size == 14 and torch.equal(again.draft_to_target(torch.arange(14)), new_ids)
    pipe = dartree.load(target_dir, tmp_path / "wide" / "checkpoint", dtype=torch.float64)
    for prompt in ([3, 1, 4], [2, 7], [9, 9, 5, 0]):
        want = hf_greedy(pipe.target_model, prompt, 10)
        assert pipe.generate(input_ids=prompt, method="dartree", max_new_tokens=10, stop_token_ids=[]).token_ids == want
    full = Trainer(target, TrainConfig(out=str(tmp_path / "full"), steps=1, draft_vocab=0, **base), "drafter").model
    with pytest.raises(dartree.errors.DartreeError, match="full output layer"):
        dartree.train.drafter.rerank_vocabulary(full, new_ids, small.out_weight)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_packed_block_attention_is_the_dense_masked_attention(tiny_data, tmp_path, num_layers):
    """The training forward's packed attention (scores only where a block can see) gives the dense
    [Q, C + Q] mask's hidden states and gradients, on many random sequences and anchor sets, and no
    block sees another."""
    from tiny import make_tiny_drafter

    from dartree.loading import load_drafter
    from dartree.train.drafter import drafter_outputs

    target_dir, target, _ = tiny_data
    block = 5
    model = load_drafter(make_tiny_drafter(tmp_path / "d", target_dir, head="gru", block_size=block, num_layers=num_layers,
                                           use_mask_embedding=True), dtype=torch.float64)
    embed = torch.nn.Embedding(16, target.config.hidden_size, dtype=torch.float64)
    torch.nn.init.normal_(embed.weight)
    gen, rng = torch.Generator().manual_seed(1), random.Random(1)
    width = model.fc.in_features
    for trial in range(12):
        n_ctx = rng.randint(8, 40)
        tokens = torch.randint(0, 16, (n_ctx + 2,), generator=gen)
        a = torch.tensor(sorted(rng.sample(range(1, n_ctx + 1), rng.randint(1, min(12, n_ctx)))))
        runs = []
        for dense in (True, False):
            feats = torch.randn(n_ctx, width, generator=torch.Generator().manual_seed(trial), dtype=torch.float64, requires_grad=True)
            model.zero_grad()
            hidden = drafter_outputs(model, embed, tokens, feats, a, block, dense_mask=dense)
            (hidden * torch.linspace(-1, 1, hidden.numel(), dtype=torch.float64).view_as(hidden)).sum().backward()
            runs.append((hidden.detach(), feats.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (h_dense, g_dense, p_dense), (h_packed, g_packed, p_packed) = runs
        assert h_packed.shape == (a.numel(), block, model.config.hidden_size)
        torch.testing.assert_close(h_packed, h_dense, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(g_packed, g_dense, rtol=1e-10, atol=1e-10)
        assert len(p_packed) == len(p_dense) > 0
        for gp, gd in zip(p_packed, p_dense):
            torch.testing.assert_close(gp, gd, rtol=1e-10, atol=1e-10)
    # Blocks are independent: changing the last anchor's token moves only the last block.
    with torch.no_grad():
        feats = torch.randn(30, width, dtype=torch.float64, generator=gen)
        a = torch.tensor([3, 9, 20, 28])
        tokens = torch.randint(0, 16, (32,), generator=gen)
        before = drafter_outputs(model, embed, tokens, feats, a, block)
        tokens[28] = (tokens[28] + 1) % 16
        after = drafter_outputs(model, embed, tokens, feats, a, block)
    assert torch.equal(before[:3], after[:3]) and not torch.allclose(before[3], after[3])
