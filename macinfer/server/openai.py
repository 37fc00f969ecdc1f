"""OpenAI's chat and completions routes, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from macinfer.server.routing import Routing
from macinfer.server.serving import APIError


def add_routes(app: FastAPI, routing: Routing) -> None:
    pool = routing.pool

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        async with pool.use(req.model) as m:
            turn = await asyncio.to_thread(m.serving.chat_prompt, req)
            routing.say_ignored(request, turn)
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            return await routing.run(m, "chat", req, turn.ids, req.max_completion_tokens or req.max_tokens, logprobs,
                                     request, turn)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        async with pool.use(req.model) as m:
            return await routing.run(m, "completion", req, prompt, req.max_tokens or 16, req.logprobs, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """vLLM's /tokenize: a prompt, or messages through the chat template."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either `prompt` or `messages`", param="prompt")
        async with pool.use(req.model) as m:
            if req.messages is not None:
                chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
                ids = (await asyncio.to_thread(m.serving.chat_prompt, chat)).ids
            else:
                ids = await asyncio.to_thread(m.engine.tokenizer.encode, req.prompt, req.add_special_tokens)
            out = {"count": len(ids), "max_model_len": m.engine.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [m.engine.tokenizer.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        async with pool.use(req.model) as m:
            vocab = m.engine.model.args.vocab_size
            if any(not 0 <= t < vocab for t in req.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": m.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
