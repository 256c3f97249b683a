"""Runnable examples, shipped with the package, each run by the test suite
(``tests/examples/test_examples.py``). Run one with ``python -m aiokv.examples.<name>``:

- ``local_blocks``: allocate paged caches, swap blocks out to host and back in, fork
  blocks copy-on-write with ``copy_blocks`` (what ``aiokv demo`` runs first);
- ``pull_two_processes``: a decode process pulls blocks from a prefill process;
- ``layerwise_push``: ``transfer_cache_async`` sends each layer as the model finishes it;
- ``sync_datadist``: an llm_datadist-style blocking program on ``aiokv.sync``;
- ``tiny_model``: the demo's transformer over a paged KV cache (a library, no ``main``).

The async ones have ``async def main(..., say=print)``; ``sync_datadist`` a plain
``def main``. They use only the public API (``from aiokv import ...``): read them as
documentation.
"""
