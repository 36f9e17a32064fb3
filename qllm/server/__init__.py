"""``qllm serve``: an OpenAI-compatible HTTP server (optional extra ``qllm[serve]``).

Modules: ``protocol`` (request/response models), ``async_engine`` (the engine in one
background thread, feeding per-request asyncio streams), ``openai_serving`` (the
completions and chat logic), ``api_server`` (the FastAPI app and uvicorn), ``metrics``
(Prometheus text format) and ``cli``. Nothing here is imported by the core, and fastapi /
uvicorn are imported only by the modules that need them.
"""
