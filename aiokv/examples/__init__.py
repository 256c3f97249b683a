"""Runnable examples, shipped with the package: what ``aiokv demo`` runs.

Each module has ``async def main(..., say=print)`` and runs on its own with
``python -m aiokv.examples.<name>``. They use only the public API (``from aiokv import
...``): read them as documentation.
"""
