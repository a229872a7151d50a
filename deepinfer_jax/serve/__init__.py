"""An OpenAI- and Anthropic-compatible HTTP server over ``LLM`` (the optional ``serve`` extra).

    python -m deepinfer_jax.serve --port 8000          # the shipped model on 127.0.0.1:8000

or in Python::

    import uvicorn
    from deepinfer_jax import LLM
    from deepinfer_jax.serve import build_app

    uvicorn.run(build_app(LLM(), api_key="secret"), host="127.0.0.1", port=8000)

Modules: ``app`` (routes, authentication, body checks), ``handlers`` (one request's run through
the ``engine.async_engine.AsyncEngine`` and the recipe's stream parser), ``errors`` (each
protocol's error shape and status), ``metrics`` (Prometheus text), ``__main__`` (the command line).
Needs ``fastapi`` and ``uvicorn`` (``pip install -e ".[serve]"``).
"""

from deepinfer_jax.serve.app import ServerState, build_app

__all__ = ["ServerState", "build_app"]
