"""OpenAI's chat and completions routes, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from macinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from macinfer.server.routing import Routing
from macinfer.server.errors import APIError

MAX_CHARS_PER_TOKEN = 64  # /tokenize's cap: longer prompts cannot fit the context anyway


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
            cap = MAX_CHARS_PER_TOKEN * m.engine.max_model_len
            if req.prompt is not None and len(req.prompt) > cap:
                raise APIError(400, f"prompt is {len(req.prompt)} characters; /tokenize takes at most {cap} "
                               f"({MAX_CHARS_PER_TOKEN} per token of this model's {m.engine.max_model_len}-token "
                               "context: a longer text cannot fit it)", param="prompt")

            def count() -> dict:  # off the event loop: megabytes take seconds to tokenize
                if req.messages is not None:
                    chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
                    ids = m.serving.chat_prompt(chat).ids
                else:
                    ids = m.engine.tokenizer.encode(req.prompt, req.add_special_tokens)
                out = {"count": len(ids), "max_model_len": m.engine.max_model_len, "tokens": ids}
                if req.return_token_strs:
                    out["token_strs"] = [m.engine.tokenizer.id_to_token(i) for i in ids]
                return out

            # the JSON of a million ids is written off the loop too
            return await asyncio.to_thread(lambda: JSONResponse(count()))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        async with pool.use(req.model) as m:
            vocab = m.engine.model.args.vocab_size
            if any(not 0 <= t < vocab for t in req.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return {"prompt": m.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
