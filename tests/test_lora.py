"""LoRA adapters on the engine: each kind gives mlx-lm's own tokens under `load(base,
adapter_path=...)` for every cache kind; rows of several adapters and of the base share one
batch and give what each gives alone; blocks are keyed by the adapter's content; bad
adapters are refused with the reason."""

from __future__ import annotations

import json
import os

import pytest

from macinfer import LLM
from macinfer.lora.adapter import LoraError
from macinfer.sampling_params import SamplingParams
from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.lora_adapters import mlx_lm_adapter, mlx_lm_lora_greedy, peft_from_mlx_lm
from tests.zoo import tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = [5, 9, 23, 44, 71, 12, 8, 99, 100, 31, 7, 3, 55]
LONG = PROMPT * 3
ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
# What an adapter of each kind adapts (mlx-lm's defaults: every linear layer of a block, an
# MoE's experts included; or the keys given).
CASES = {
    "llama": ("llama", None, "auto"),  # the hand-written Llama file: fused q/k/v and gate/up
    "llama-mlx-lm": ("llama", None, "mlx-lm"),
    "sliding": ("gemma3_text", None, "auto"),
    "hybrid": ("qwen3_next", ATTENTION + ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                                          "linear_attn.out_proj"], "auto"),
    "mla": ("deepseek_v3", ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"], "auto"),
    "moe": ("qwen3_moe", None, "auto"),  # attention, router gate and each expert's (switch) LoRA
    "moe-mla": ("deepseek_v3", None, "auto"),  # MLA, shared and routed experts
}


def _base(tmp_path, model_type: str, **extra) -> str:
    cfg = tiny_config(model_type, **extra)
    if "query_pre_attn_scalar" in cfg:
        cfg["query_pre_attn_scalar"] = 16  # (transformers' config class wants an int)
    return save_model_dir(str(tmp_path / "-".join([model_type, *map(str, extra.values())])), cfg,
                          make_mlx_lm_model(cfg, 0))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama and eight adapters of it (different ranks, scales, layers, modules)."""
    tmp = tmp_path_factory.mktemp("lora")
    base = _base(tmp, "llama")
    adapters = {"a": mlx_lm_adapter(base, str(tmp / "a"), rank=4, seed=1),
                "b": mlx_lm_adapter(base, str(tmp / "b"), rank=8, scale=5.0, seed=2),
                "c": mlx_lm_adapter(base, str(tmp / "c"), rank=2, num_layers=1, keys=ATTENTION, seed=3)}
    for i, name in enumerate("defgh"):
        adapters[name] = mlx_lm_adapter(base, str(tmp / name), rank=1 + i, scale=2.0 + i, seed=10 + i,
                                        keys=None if i % 2 else ["mlp.down_proj", "self_attn.v_proj"])
    return base, adapters


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_gives_mlx_lm_tokens(tmp_path, case):
    model_type, keys, impl = CASES[case]
    base = _base(tmp_path, model_type)
    adapter = mlx_lm_adapter(base, str(tmp_path / "adapter"), keys=keys)
    llm = LLM(base, kv_cache_gb=0.01, model_impl=impl)
    try:
        llm.load_lora("mine", adapter)
        # one batch, both rows; 39 tokens: an MoE's 78 expert picks are sorted by expert (and slot)
        ours = llm.generate([LONG, LONG], GREEDY, lora=["mine", None])
    finally:
        llm.close()
    with_adapter, without = mlx_lm_lora_greedy(base, adapter, LONG, 10), mlx_lm_lora_greedy(base, None, LONG, 10)
    assert with_adapter != without  # the adapter matters on this model
    assert [o.token_ids for o in ours] == [with_adapter, without]


def test_dora_peft_and_rslora_give_their_references(llama, tmp_path):
    """DoRA as mlx-lm trains it; the same LoRA factors in PEFT's layout (alpha / r), and as
    rsLoRA (alpha / sqrt(r)): the same tokens as mlx-lm's adapter."""
    base, adapters = llama
    dora = mlx_lm_adapter(base, str(tmp_path / "dora"), rank=4, dora=True, seed=4)
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        llm.load_lora("dora", dora)
        llm.load_lora("peft", peft_from_mlx_lm(adapters["a"], str(tmp_path / "peft")))
        llm.load_lora("rslora", peft_from_mlx_lm(adapters["a"], str(tmp_path / "rslora"), rslora=True))
        outs = llm.generate([PROMPT] * 3, GREEDY, lora=["dora", "peft", "rslora"])
    finally:
        llm.close()
    reference = mlx_lm_lora_greedy(base, adapters["a"], PROMPT, 10)
    assert [o.token_ids for o in outs] == [mlx_lm_lora_greedy(base, dora, PROMPT, 10), reference, reference]


def test_adapters_and_the_base_batch_as_they_run_alone(llama):
    """32 requests over eight adapters and the base, different prompts, in one batch: each
    gives what it gives alone, and what mlx-lm gives under its adapter."""
    base, adapters = llama
    names = ([None, *sorted(adapters)] * 4)[:32]
    prompts = [PROMPT[: 5 + i % 7] + [10 + i] for i in range(len(names))]
    llm = LLM(base, kv_cache_gb=0.02, max_num_seqs=32)
    try:
        for name, path in adapters.items():
            llm.load_lora(name, path)
        together = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
        alone = [llm.generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(prompts[:9], names[:9])]
    finally:
        llm.close()
    assert together[:9] == alone  # the base and each adapter once
    for p, n, t in list(zip(prompts, names, together))[:9:2]:
        assert t == mlx_lm_lora_greedy(base, adapters.get(n), p, 10)


def test_blocks_are_keyed_by_the_adapters_content(llama):
    """The same prompt under two adapters shares no block (nor with the base); the same
    adapter's files under another name share every one, and a repeat hits the prefix cache."""
    base, adapters = llama
    prompt = list(range(3, 60))
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        eng = llm.engine
        llm.load_lora("a", adapters["a"])
        llm.load_lora("b", adapters["b"])
        llm.load_lora("a-again", adapters["a"])
        hashes = {}
        for name in (None, "a", "b", "a-again"):
            rid = eng.add_request(prompt, GREEDY, lora=name)
            seq = eng.requests[rid].seq
            hashes[name] = eng.block_manager._hashes(seq, 3)
            eng.abort_request(rid)
        assert len({tuple(h) for h in hashes.values()}) == 3 and hashes["a"] == hashes["a-again"]
        first, again = (llm.generate([prompt], GREEDY, lora="a")[0] for _ in range(2))
        assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    finally:
        llm.close()


def test_an_adapter_unloaded_in_use_finishes_its_requests(llama):
    base, adapters = llama
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        eng = llm.engine
        llm.load_lora("a", adapters["a"])
        rid = eng.add_request(PROMPT, GREEDY, lora="a")
        eng.step()
        llm.unload_lora("a")  # in use: served to its running request, refused to new ones
        with pytest.raises(LoraError, match="no LoRA adapter named 'a'"):
            eng.add_request(PROMPT, GREEDY, lora="a")
        out = None
        while eng.has_unfinished_requests():
            out = next((o for o in eng.step() if o.request_id == rid and o.finished), out)
        assert out.token_ids == mlx_lm_lora_greedy(base, adapters["a"], PROMPT, 10)
        assert not eng.loras.adapters and "a" not in eng.loras.slots  # its slot freed when it ended
    finally:
        llm.close()


def test_a_later_adapter_passes_layers_only_earlier_ones_adapt(llama):
    """An adapter of the attention only, loaded after one of every layer: its rows pass the MLP
    layers the first one adapts, where its slot must be a row of zeros (every layer's stacks
    grow with the slots), and give mlx-lm's tokens."""
    base, adapters = llama
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        llm.load_lora("all", adapters["a"])
        llm.load_lora("attention", adapters["c"])
        outs = [o.token_ids for o in llm.generate([PROMPT] * 2, GREEDY, lora=["attention", "all"])]
        stacks = {w.a.shape[0] for w in llm.engine.loras._wrapped.values()}
    finally:
        llm.close()
    assert stacks == {3}  # the base and two slots in every adapted layer, the MLP's too
    assert outs == [mlx_lm_lora_greedy(base, adapters["c"], PROMPT, 10), mlx_lm_lora_greedy(base, adapters["a"], PROMPT, 10)]


def test_idle_adapters_are_evicted_past_max_loras(llama):
    base, adapters = llama
    llm = LLM(base, kv_cache_gb=0.01, max_loras=2)
    try:
        for name in ("a", "b", "c"):
            llm.load_lora(name, adapters[name])
        assert sorted(llm.engine.loras.names()) == ["b", "c"]  # "a", the least recently used, went
    finally:
        llm.close()


def test_bad_adapters_are_refused_with_the_reason(llama, tmp_path):
    base, adapters = llama
    other = _base(tmp_path, "llama", hidden_size=96)  # another base: other shapes
    full = mlx_lm_adapter(base, str(tmp_path / "full"))
    with open(os.path.join(full, "adapter_config.json"), "w") as f:
        f.write('{"fine_tune_type": "full", "num_layers": 2, "lora_parameters": {}}')
    truncated = str(tmp_path / "truncated")
    os.makedirs(truncated)
    for f in ("adapter_config.json", "adapters.safetensors"):
        with open(os.path.join(adapters["a"], f), "rb") as src, open(os.path.join(truncated, f), "wb") as dst:
            data = src.read()
            dst.write(data[: len(data) // 2] if f.endswith(".safetensors") else data)
    cases = {
        str(tmp_path / "missing"): "is not a folder",
        "nobody/no-such-adapter": "nor a repo in the Hugging Face cache",
        str(tmp_path): "has no adapter_config.json",
        truncated: "cannot be read",
        mlx_lm_adapter(other, str(tmp_path / "other")): "an adapter for another base model",
        full: "a full fine-tune",
    }
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        for path, why in cases.items():
            with pytest.raises(LoraError, match=why):
                llm.load_lora("bad", path)
        with pytest.raises(LoraError, match="no LoRA adapter named 'nope'"):
            llm.generate([PROMPT], GREEDY, lora="nope")
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == mlx_lm_lora_greedy(base, None, PROMPT, 10)
    finally:
        llm.close()


def test_adapter_rows_speculate_and_survive_preemption(llama):
    """Prompt-lookup drafts verified under the row's adapter, and requests preempted for want
    of blocks and recomputed: the same tokens as a roomy engine without speculation."""
    base, adapters = llama
    prompts = [[40 + i] + PROMPT * 2 + PROMPT[:3] for i in range(6)]  # repetitive: the lookup drafts
    names = ["a", "b", None] * 2
    outs = {}
    for key, kwargs in (("plain", dict(kv_cache_gb=0.01)),
                        ("tight", dict(num_kv_blocks=8, num_speculative_tokens=3, speculative_max_batch=8))):
        llm = LLM(base, **kwargs)
        try:
            llm.load_lora("a", adapters["a"])
            llm.load_lora("b", adapters["b"])
            outs[key] = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
            stats = dict(llm.engine.stats, preemptions=llm.engine.scheduler.num_preemptions)
        finally:
            llm.close()
    assert outs["tight"] == outs["plain"]
    assert stats["preemptions"] > 0 and stats["spec_draft_tokens"] > 0, stats


def _app(base: str, adapters: dict[str, str], api_keys: list[str]):
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.server.app import create_app
    from macinfer.server.model_pool import ModelPool

    engine = LLMEngine(base, EngineConfig(kv_cache_gb=0.02))
    for name, path in adapters.items():
        engine.load_lora(name, path)
    return create_app(ModelPool.one(engine, "m"), api_keys=api_keys), engine


def test_the_server_addresses_adapters_by_name_and_loads_them_at_run_time(llama):
    """`model` names an adapter in every API (the official openai client's completions and
    chat, Anthropic's messages); /v1/models lists adapters with their base; vLLM's load and
    unload routes, behind the API key, with the reason for a bad adapter."""
    import asyncio

    import httpx
    import openai

    base, adapters = llama
    app, engine = _app(base, {"a": adapters["a"]}, ["k"])
    auth = {"Authorization": "Bearer k"}
    chat = [{"role": "user", "content": "hi there"}]
    llm = LLM(base, kv_cache_gb=0.01)  # the engine's own texts (its tokens are mlx-lm's: the tests above)
    try:
        llm.load_lora("a", adapters["a"])
        llm.load_lora("b", adapters["b"])
        expected = {n: llm.generate([PROMPT], GREEDY, lora=n)[0].text for n in ("a", "b", None)}
        expected["chat"] = llm.chat(chat, SamplingParams(temperature=0, max_tokens=6), lora="a").text
    finally:
        llm.close()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth, timeout=120) as c:
            client = openai.AsyncOpenAI(api_key="k", base_url="http://t/v1", http_client=c)
            out = {}
            models = (await c.get("/v1/models")).json()["data"]
            out["models"] = {m["id"]: m.get("parent") for m in models}

            async def complete(model):
                r = await client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
                return r.choices[0].text

            out["a"], out["base"] = await complete("a"), await complete("m")
            out["load"] = (await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]})).status_code
            out["b"] = await complete("b")
            out["bad"] = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
            out["unload"] = (await c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})).status_code
            out["unknown"] = (await c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})).status_code
            out["after"] = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            out["chat"] = (await client.chat.completions.create(model="a", messages=chat, max_tokens=6,
                                                                temperature=0)).choices[0].message.content
            msg = await c.post("/v1/messages", json={"model": "a", "max_tokens": 6, "messages": chat,
                                                     "temperature": 0})
            out["anthropic"] = msg.json()["content"][0]["text"]
            resp = await c.post("/v1/responses", json={"model": "a", "input": chat, "max_output_tokens": 6,
                                                       "temperature": 0})
            out["responses"] = resp.json()["output"][0]["content"][0]["text"]
            olla = await c.post("/api/chat", json={"model": "a", "messages": chat, "stream": False,
                                                   "options": {"temperature": 0, "num_predict": 6}})
            out["ollama"] = olla.json()["message"]["content"]
            out["collision"] = await c.post("/v1/load_lora_adapter", json={"lora_name": "m",
                                                                           "lora_path": adapters["b"]})
            out["typo"] = await c.post("/v1/completions", json={"model": "aa", "prompt": PROMPT, "max_tokens": 2})
            return out

    try:
        out = asyncio.run(go())
    finally:
        app.state.pool.shutdown()
    assert out["models"] == {"m": None, "a": "m"}
    assert (out["a"], out["base"], out["b"]) == (expected["a"], expected[None], expected["b"])
    assert out["load"] == 200 and out["unload"] == 200 and out["unknown"] == 404
    assert out["bad"].status_code == 400 and "is not a folder" in out["bad"].json()["error"]["message"]
    assert out["after"] == ["m", "a"]
    assert out["chat"] == out["anthropic"] == out["responses"] == out["ollama"] == expected["chat"]
    assert out["collision"].status_code == 400 and "names a served model" in out["collision"].json()["error"]["message"]
    # A mistyped adapter name: a 404, never the base model answering in its place.
    assert out["typo"].status_code == 404 and out["typo"].json()["error"]["code"] == "model_not_found"
    open_app, _ = _app(base, {}, [])
    try:
        async def no_key():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_app), base_url="http://t") as c:
                return await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]})
        r = asyncio.run(no_key())
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]

        async def any_name():  # one model without adapters takes any name (agents send their own)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_app), base_url="http://t") as c:
                return await c.post("/v1/completions", json={"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 2})
        assert asyncio.run(any_name()).status_code == 200
    finally:
        open_app.state.pool.shutdown()


def test_the_cli_generates_under_an_adapter_and_refuses_a_bad_one(llama, tmp_path):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    base, adapters = llama
    args = ["generate", base, "-p", "hello world", "-n", "8", "--kv-cache-gb", "0.01", "--no-chat-template"]
    plain, adapted = (CliRunner().invoke(main, [*args, *extra]) for extra in ([], ["--lora", adapters["a"]]))
    assert plain.exit_code == 0 and adapted.exit_code == 0, adapted.output
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        llm.load_lora("a", adapters["a"])
        ids = llm.tokenizer.encode("hello world")
        expected = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), lora="a")[0].text
    finally:
        llm.close()
    assert adapted.stdout.rstrip("\n") == expected and adapted.stdout != plain.stdout
    bad = CliRunner().invoke(main, [*args, "--lora", str(tmp_path)])
    assert bad.exit_code == 1 and "has no adapter_config.json" in bad.output
    serve = CliRunner().invoke(main, ["serve", base, "--lora", "oops"])
    assert serve.exit_code == 2 and "NAME=PATH" in serve.output


@pytest.mark.slow
def test_the_bundled_smollm2_under_an_adapter_gives_mlx_lm_tokens(smollm2_mlx_dir, tmp_path):
    """The real test model (SmolLM2-135M, its quantized weights as mlx-lm loads them) with an
    adapter made by mlx-lm's LoRA layers on them: mlx-lm's greedy tokens, base and adapter rows
    in one batch."""
    adapter = mlx_lm_adapter(smollm2_mlx_dir, str(tmp_path / "adapter"), rank=8, scale=4.0, seed=5)
    llm = LLM(smollm2_mlx_dir, kv_cache_gb=0.05, max_model_len=512)
    try:
        llm.load_lora("tuned", adapter)
        prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ours = [o.token_ids for o in llm.generate([prompt, prompt], GREEDY, lora=["tuned", None])]
    finally:
        llm.close()
    # (the base row's parity with mlx-lm is test_smollm2_parity's: one mlx-lm load fewer here)
    assert ours[0] == mlx_lm_lora_greedy(smollm2_mlx_dir, adapter, prompt, 10) and ours[0] != ours[1]


def test_a_vision_checkpoints_adapter_applies_to_its_language_model(llama, tmp_path):
    """An adapter trained on a vision checkpoint names its language model's layers under
    `language_model.` (mlx-vlm's names): it applies to the language model the engine runs,
    as the same factors under mlx-lm's names do, image prompts included."""
    import json as jsonlib

    import mlx.core as mx

    from tests.vision_models import picture, tiny_vlm_dir

    _, adapters = llama
    vlm = tiny_vlm_dir(tmp_path, "llava")  # its language model: the tiny Llama's shapes
    prefixed = str(tmp_path / "prefixed")
    os.makedirs(prefixed)
    weights = mx.load(os.path.join(adapters["a"], "adapters.safetensors"))
    mx.save_safetensors(os.path.join(prefixed, "adapters.safetensors"),
                        {f"language_model.{k}": v for k, v in weights.items()})
    with open(os.path.join(adapters["a"], "adapter_config.json")) as f, \
            open(os.path.join(prefixed, "adapter_config.json"), "w") as g:
        jsonlib.dump(jsonlib.load(f), g)
    llm = LLM(vlm, kv_cache_gb=0.01, max_model_len=512)
    try:
        llm.load_lora("plain", adapters["a"])
        llm.load_lora("vlm", prefixed)
        ask = [{"role": "user", "content": [{"type": "image", "image": picture(0)}, {"type": "text", "text": "hi"}]}]
        outs = [o.token_ids for o in llm.chat([ask] * 3, GREEDY, lora=["plain", "vlm", None])]
    finally:
        llm.close()
    assert outs[0] == outs[1] != outs[2]


def test_load_and_unload_at_run_time_under_load_lose_no_request(llama):
    """Eight requests under an adapter and eight on the base, all admitted, while the adapter
    is unloaded and another one loaded: every request ends with its own
    tokens; the unloaded adapter serves its running requests to the end, then frees its slot."""
    import asyncio

    import httpx

    base, adapters = llama
    app, engine = _app(base, {"a": adapters["a"]}, ["k"])
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    llm = LLM(base, kv_cache_gb=0.01)
    try:
        llm.load_lora("a", adapters["a"])
        expected = {n: llm.generate([PROMPT], params, lora=n)[0].text for n in ("a", None)}
    finally:
        llm.close()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120,
                                     headers={"Authorization": "Bearer k"}) as c:
            async def complete(model):
                r = await c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 160,
                                                          "temperature": 0, "ignore_eos": True})
                return model, r.status_code, r.json()["choices"][0]["text"]

            jobs = [asyncio.create_task(complete(m)) for m in ["a", "m"] * 8]
            deadline = asyncio.get_running_loop().time() + 60
            while engine.loras.users.get("a", 0) < 8:  # the eight under it admitted (they hold it)
                assert asyncio.get_running_loop().time() < deadline, "requests were not admitted"
                await asyncio.sleep(0.005)
            unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            in_flight = "a" in engine.loras.retired  # unloaded while its requests ran: they keep it
            load = await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]})
            return load.status_code, unload.status_code, in_flight, await asyncio.gather(*jobs)

    try:
        load, unload, in_flight, results = asyncio.run(go())
        assert "a" not in engine.loras.adapters  # its slot freed once they ended
    finally:
        app.state.pool.shutdown()
    assert (load, unload, in_flight) == (200, 200, True)
    assert all(status == 200 and text == expected["a" if model == "a" else None]
               for model, status, text in results), results


def test_adapted_quantized_mlps_leave_the_kernel_path_only_for_adapter_rows(tmp_path, monkeypatch):
    """Quantized MLPs on the batched qmv kernel (emulated here): a step with adapter rows runs
    the adapted layers (the kernel reads a layer's weights itself, so it would skip the
    adapter), a step without them keeps the kernel; the tokens are the reference path's."""
    from tests.helpers import tiny_model_dir

    SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # (the emulated kernel is slow)

    path, _ = tiny_model_dir(tmp_path, "llama", quantize={"group_size": 32, "bits": 4}, hidden_size=128,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    adapter = mlx_lm_adapter(path, str(tmp_path / "adapter"), keys=["mlp.gate_proj", "mlp.up_proj"])
    monkeypatch.setenv("MACINFER_CPU_WEIGHTS", "quantized")
    monkeypatch.setenv("MACINFER_QMV_KERNEL", "1")
    from macinfer.kernels import quantized as qk

    calls, real = [], qk.qmv_call
    monkeypatch.setattr(qk, "qmv_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs, kernel_calls = {}, {}
    for mode in ("reference", "emulate"):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        llm = LLM(path, kv_cache_gb=0.01)
        try:
            llm.load_lora("mlp", adapter)
            outs[mode] = [o.token_ids for o in llm.generate([PROMPT, PROMPT], SHORT, lora=["mlp", None])]
            calls.clear()
            outs[mode].append(llm.generate([PROMPT], SHORT)[0].token_ids)  # base rows alone: the kernel
            kernel_calls[mode] = len(calls)
        finally:
            llm.close()
    assert outs["emulate"] == outs["reference"] and kernel_calls["emulate"] > 0
    assert outs["reference"][0] == mlx_lm_lora_greedy(path, adapter, PROMPT, 4) != outs["reference"][1]
