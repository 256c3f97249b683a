"""Integrations of aiokv into serving engines.

* :mod:`aiokv.integrations.vllm` — ``AiokvConnector``, a vLLM V1 KV connector.
"""

__all__: list[str] = []
