"""The OpenAI server as a client sees it: the official `openai` client against uvicorn on a loopback port,
a tiny Llama target speculating with a random EAGLE-3 head (debug checks on every step).

Streams must say exactly what the non-streaming answer says; every user mistake is a 400 naming its
field and leaves the server up; a client that disconnects gets its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.server import post, serving, slow_steps, wait_idle
from tsengine.config import EngineConfig, SpeculativeConfig
from tsengine.entrypoints.llm import LLM
from tsengine.entrypoints.openai.async_engine import AsyncEngine
from tsengine.errors import UserError
from tsengine.sampling_params import SamplingParams

KEY, MODEL, CONTEXT = "sk-test", "tiny-llama", 128
PROMPT = "the water is hot and"


@pytest.fixture(scope="module")
def head_dir(heads):
    return heads["llama"]  # conftest's: decisive logits, no near-ties among drafts


def spec_json(head_dir) -> dict:
    return {"method": "eagle3", "adaptive": False, "model": str(head_dir), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def server(tiny_dirs, head_dir):
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=CONTEXT, block_size=4, debug_checks=True,
                               speculative=SpeculativeConfig.resolve(config_json=spec_json(head_dir)))
    with serving(config, MODEL, KEY) as s:
        yield s


def streamed(stream, chat: bool) -> tuple[list[str], list[str | None], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], usage


# ---- generation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=7)])
@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream(server, chat, sampling):
    kw = dict(model=MODEL, max_tokens=12, extra_body={"ignore_eos": True}, **sampling)
    if chat:
        create = server.client.chat.completions.create
        kw["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    else:
        create, kw["prompt"] = server.client.completions.create, PROMPT
    full = create(**kw)
    texts, reasons, usage = streamed(create(stream=True, stream_options={"include_usage": True}, **kw), chat)
    choice = full.choices[0]
    assert texts == [choice.message.content if chat else choice.text] and texts[0]
    assert reasons == [choice.finish_reason] == ["length"]
    assert full.usage.completion_tokens == usage.completion_tokens == 12
    assert full.usage.prompt_tokens == usage.prompt_tokens > 0
    if sampling.get("seed") is not None:  # seeded: the same draws on every call
        again = create(**kw).choices[0]
        assert (again.message.content if chat else again.text) == texts[0]
    wait_idle(server.engine)


def test_concurrent_requests_match_sequential(server):
    """Requests batched together by the engine get what each gets alone (keyed sampling, exact verify)."""
    jobs = [dict(prompt=PROMPT[:k + 6], temperature=t, seed=k, max_tokens=6 + k)
            for k, t in enumerate([0, 0.8, 1.0, 0, 0.5, 1.2])]

    def run(job):
        return server.client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **job).choices[0].text

    alone = [run(j) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(run, jobs)) == alone
    wait_idle(server.engine)


def test_usage_reports_speculation(server):
    ids = server.engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    r = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 10, len(ids) + 10)
    verify, accepted = u.model_extra["spec_verify_steps"], u.model_extra["spec_accepted_tokens"]
    assert verify >= 1 and 0 <= accepted <= 3 * verify
    assert u.completion_tokens / verify >= 1  # τ: every verify step commits at least its bonus token
    assert u.completion_tokens == 1 + verify + accepted  # the prefill's token, then a + 1 per verify step


def test_n_choices(server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    r = server.client.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    one = server.client.completions.create(n=1, **kw)
    assert r.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed, as in LLM.generate
    texts, reasons, _ = streamed(server.client.completions.create(n=2, stream=True, **kw), chat=False)
    assert texts == [c.text for c in r.choices] and reasons == ["length", "length"]
    c = server.client.chat.completions.create(n=2, model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=4, temperature=0)
    assert len(c.choices) == 2 and c.choices[0].message.content == c.choices[1].message.content


def test_stop_strings(server):
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    full = server.client.completions.create(max_tokens=24, **kw).choices[0].text
    assert len(full) > 8, full
    stop = full[5:8]
    want = full[:full.find(stop)]
    with slow_steps(server.engine):  # 100 tokens would take seconds: ending at once proves the abort
        r = server.client.completions.create(stop=[stop, "\x00never"], max_tokens=100, **kw)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        wait_idle(server.engine, timeout=1)
        texts, reasons, _ = streamed(server.client.completions.create(stop=stop, stream=True, max_tokens=100, **kw),
                                     chat=False)
        assert (texts, reasons) == ([want], ["stop"])
        wait_idle(server.engine, timeout=1)


def test_server_matches_llm_generate(server, tiny_dirs, head_dir):
    """Same prompt ids, greedy: the server's text is the offline API's text."""
    ids = [5, 17, 33, 2, 9, 100, 41, 7, 8, 9, 10]
    llm = LLM(str(tiny_dirs["llama"]), speculative_config=spec_json(head_dir), max_model_len=CONTEXT)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    r = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0).choices[0]
    assert (r.text, r.finish_reason) == (want.text, want.finish_reason)


@pytest.mark.parametrize("extra", [
    {"eagle_topk": 2, "num_draft_tokens": 6},
    {"eagle_topk": 2, "num_draft_tokens": 6, "tree_sampling": "multiround"},
    {"enable_speculative_sampling": True},
    {"method": "ngram", "model": None},
], ids=["tree", "tree-multiround", "rejection", "ngram"])
def test_tree_ngram_and_sampling_rules_through_the_server(tiny_dirs, head_dir, extra):
    """Every speculation mode is reachable through `serve`'s config: greedy equals plain greedy (the
    offline API without speculation), and a seeded sampled request answers the same twice."""
    spec = {k: v for k, v in {**spec_json(head_dir), **extra}.items() if v is not None}
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=CONTEXT, block_size=4, debug_checks=True,
                               speculative=SpeculativeConfig.resolve(config_json=spec))
    ids = [5, 17, 33, 2, 9, 100, 41, 7, 8, 9, 10]
    want = LLM(str(tiny_dirs["llama"]), max_model_len=CONTEXT).generate(
        [ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    with serving(config, MODEL, KEY) as s:
        kw = dict(model=MODEL, prompt=ids, max_tokens=16, extra_body={"ignore_eos": True})
        assert s.client.completions.create(temperature=0, **kw).choices[0].text == want
        a, b = (s.client.completions.create(temperature=0.9, seed=5, **kw).choices[0].text for _ in range(2))
        assert a == b
        assert s.engine.stats.num_drafts > 0
        wait_idle(s.engine)


# ---- the other endpoints -------------------------------------------------------------------------------------
def test_models_health_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for family in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                   "spec_decode_num_accepted_tokens_per_pos", "request_success", "prompt_tokens",
                   "generation_tokens"):
        assert f"# TYPE tsengine:{family}_total counter" in text, family
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert f"# TYPE tsengine:{family} histogram" in text, family
        assert values[f"tsengine:{family}_count"] > 0
    assert values["tsengine:spec_decode_num_drafts_total"] > 0
    assert values["tsengine:spec_decode_num_draft_tokens_total"] == 3 * values["tsengine:spec_decode_num_drafts_total"]
    assert 'tsengine:spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in values
    assert values['tsengine:request_success_total{finished_reason="length"}'] > 0
    assert values["tsengine:prompt_tokens_total"] > 0 and values["tsengine:generation_tokens_total"] >= 6


# ---- mistakes ----------------------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": [5] * CONTEXT}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * CONTEXT}]}, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 0, "stream": True}, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize("path, body, field", BAD, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == (404 if field == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] in (None, "model_not_found")
    assert "Traceback" not in r.text


def test_malformed_json_and_wrong_key(server):
    for content in (b"{not json", b"", b"[1, 2]"):
        r = post(server, "/v1/completions", None, content=content)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = post(server, "/v1/completions", {"prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


# ---- disconnects and failures ---------------------------------------------------------------------------------
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_blocks(server):
    e = server.engine
    with slow_steps(e):
        before = e.stats.generated_tokens
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
        wait_idle(e, timeout=2)
        assert e.stats.generated_tokens - before < 100, "the request ran to the end"
        before = e.stats.generated_tokens
        with pytest.raises(httpx.TimeoutException):  # non-streaming: the client gives up while it decodes
            httpx.post(server.url + "/v1/completions", json=LONG, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=0.3)
        wait_idle(e, timeout=2)
        assert e.stats.generated_tokens - before < 100, "the request ran to the end"
    r = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_async_generate_aborts_when_the_consumer_leaves(server):
    """AsyncEngine.generate on its own event loop: an early exit aborts; a bad prompt raises UserError."""
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        got = []
        with slow_steps(server.engine):
            gen = server.async_engine.generate("direct", [5, 6, 7], sp)
            async for out in gen:
                got += out.new_tokens
                if len(got) >= 2:
                    break
            await gen.aclose()
            wait_idle(server.engine, timeout=2)
        with pytest.raises(UserError, match="max_model_len"):
            async for _ in server.async_engine.generate("too-long", [5] * CONTEXT, sp):
                pass
        return got

    assert len(asyncio.run(main())) >= 2


def test_a_steps_tokens_reach_the_stream_before_the_head_drafts(server):
    """The first token is out while the drafter of the step that produced it is still running (held here
    on a gate): drafting time is no part of time to first token or of the gap between tokens."""
    gate, drafting = threading.Event(), threading.Event()
    real = server.engine.proposer.propose

    def propose(proposal):
        if proposal.drafting:
            drafting.set()
            gate.wait(10)
        return real(proposal)

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        gen = server.async_engine.generate("early", [5, 6, 7], sp)
        first = await asyncio.wait_for(gen.__anext__(), 5)  # times out where outputs wait for the drafter
        held = drafting.wait(5) and not gate.is_set()  # the drafter of that very step is still held
        gate.set()
        return first, held, [out async for out in gen]

    server.engine.proposer.propose = propose
    try:
        first, held, rest = asyncio.run(main())
    finally:
        gate.set()
        server.engine.proposer.propose = real
    assert held and first.new_tokens
    assert sum(len(o.new_tokens) for o in (first, *rest)) == 4 and rest[-1].finished


def test_engine_built_on_its_thread_and_startup_errors_reach_the_caller(server, tiny_dirs):
    """The factory runs on the engine thread (one OpenMP pool per process; see async_engine), and a bad
    config raises its UserError where AsyncEngine was created, leaving no thread behind."""
    built_on = []

    def factory():
        built_on.append(threading.current_thread())
        raise UserError("max_model_len 99999 exceeds the model's max_position_embeddings")

    with pytest.raises(UserError, match="max_model_len"):
        AsyncEngine(factory)
    assert [t.name for t in built_on] == ["tsengine-engine"] and not built_on[0].is_alive()


def test_engine_wide_failure_fails_requests_not_the_server(server):
    """A failure outside any one request's data (here the step itself) fails the open requests with a 503
    whose message names no internals, and the server goes on."""
    engine, real = server.engine, server.engine.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 2:  # after the prefill: the request holds blocks when it fails
            raise RuntimeError("injected failure")
        return real()

    engine.step = broken
    try:
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "ignore_eos": True})
    finally:
        del engine.step
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and "injected" not in message and r.headers["x-request-id"] in message
    wait_idle(server.engine)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_warm_servers_compiles_wait_for_an_idle_moment(tiny_dirs, monkeypatch):
    """`tsengine serve` builds its engine warm, then makes its compiles wait for a moment it is idle: a
    compile shares the cores and the GIL with the steps it overlaps (tsengine/model/compile_worker.py)."""
    from tsengine.entrypoints.openai.app import server_engine
    from tsengine.entrypoints.openai.settings import ServerSettings
    from tsengine.model import compile_worker

    monkeypatch.setattr(compile_worker.WORKER, "idle_wait_s", 0.0)
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=CONTEXT, block_size=4)
    engine = server_engine(config, ServerSettings(model_name="m", api_key=None))
    assert engine.max_model_len == CONTEXT
    assert compile_worker.WORKER.idle_wait_s == compile_worker.SERVER_IDLE_WAIT_S
