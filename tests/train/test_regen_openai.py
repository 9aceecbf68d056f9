"""Regeneration on OpenAI-compatible servers (train/regen_openai.py, `regen.backend: openai`), against two
`tsengine serve` apps on the tiny target: the rows are shared by the servers, the records equal the
in-process engine's (greedy, and sampled with the same per-row seeds), a restart resumes by id, and a
server that keeps failing stops the run with its URL named and the answers so far kept."""

from __future__ import annotations

import contextlib
import json
import random

import httpx
import pytest

from tests.helpers.server import serving
from tsengine.config import EngineConfig
from tsengine.errors import UserError
from tsengine.train.regen_engine import EngineRegenerator
from tsengine.train.regen_openai import OpenAIRegenerator
from tsengine.train.regenerate import read_done

WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this".split()
MAX_NEW = 12


def rows(n: int = 7) -> list[dict]:
    rng = random.Random(1)
    out = [{"id": f"p{i}", "temperature": 0.9 if i % 3 == 2 else 0.0,
            "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))}]}
           for i in range(n)]
    out.append({"id": "multi", "messages": [{"role": "user", "content": "the water"},
                                            {"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "and then"}]})
    return out


def generation_tokens(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("tsengine:generation_tokens_total"))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def servers(tiny_dirs):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serving(EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=256),
                                           "tiny", None)) for _ in range(2)]


def test_two_servers_share_the_rows_and_answer_as_the_engine(servers, tiny_models, tiny_dirs, tmp_path):
    _, tok = tiny_models["llama"]
    engine_out, served_out = tmp_path / "engine.jsonl", tmp_path / "served.jsonl"
    EngineRegenerator(str(tiny_dirs["llama"]), tok, 4, MAX_NEW, seed=3).run(rows(), engine_out, progress=False)
    before = [generation_tokens(s.url) for s in servers]
    regen = OpenAIRegenerator([s.url + "/v1" for s in servers], concurrency=2, max_new_tokens=MAX_NEW, seed=3)
    assert not regen.run(rows()[:4], served_out, progress=False).reasons
    with served_out.open("a") as f:
        f.write('{"id": "torn", "mess')  # killed mid-write: dropped, and the rest resumes
    assert not regen.run(rows(), served_out, progress=False).reasons
    got = {r["id"]: r for r in map(json.loads, served_out.read_text().splitlines())}
    want = {r["id"]: r for r in map(json.loads, engine_out.read_text().splitlines())}
    assert got == want and len(got) == len(rows())
    assert any(r["temperature"] for r in rows()) and got["multi"]["messages"][1]["content"] != "x"
    assert all(generation_tokens(s.url) > b for s, b in zip(servers, before)), "each server answers a share"


def test_a_failing_server_stops_the_run_naming_it_and_keeps_the_answers(servers, tmp_path, monkeypatch):
    import tsengine.train.regen_openai as module

    monkeypatch.setattr(module, "RETRIES", 1)
    out = tmp_path / "out.jsonl"
    good = OpenAIRegenerator([servers[0].url], max_new_tokens=4)
    good.run(rows()[:2], out, progress=False)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    with pytest.raises(UserError, match="127.0.0.1:9/v1/chat/completions failed 2 times"):
        OpenAIRegenerator([dead], model="tiny", max_new_tokens=4).run(rows(), out, progress=False)
    assert read_done(out) == {"p0", "p1"}
    with pytest.raises(UserError, match="answered 404"):
        OpenAIRegenerator([servers[0].url + "/nothing"], model="tiny", max_new_tokens=4).run(rows(), out,
                                                                                             progress=False)


def test_the_recipe_asks_for_servers_with_the_openai_backend():
    from tsengine.train.recipe import validate

    with pytest.raises(UserError, match="needs regen.base_urls"):
        validate({"target": "x", "regen": {"backend": "openai"}})
    with pytest.raises(UserError, match="are for regen.backend openai"):
        validate({"target": "x", "regen": {"base_urls": ["http://h:8000/v1"]}})
    with pytest.raises(UserError, match="must start with http"):
        validate({"target": "x", "regen": {"backend": "openai", "base_urls": ["h:8000"]}})
    r = validate({"target": "x", "regen": {"backend": "openai", "base_urls": ["http://h:8000/v1"]}})
    assert r.regen.base_urls == ["http://h:8000/v1"]
