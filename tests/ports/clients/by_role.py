"""What the four by-role sample ports (``push_blocks``, ``push_cache``, ``switch_role``,
``transfer_cache_async``) share that is no llm_datadist call: the cluster ids, the ports
the test harness hands in, the gloo group the two processes meet in, and the ``__main__``
frame (the command line, ``Sample start`` / ``Sample end``, the party by ``--role``).

The vendor's samples each repeat this set-up; the ports keep it here once, so that each
sample holds only its own llm_datadist flow (every call, argument and order). A sample
imports this module from its own folder, where the harness runs it.
"""

import argparse
import datetime
import logging
import os
from collections.abc import Callable

import torch.distributed as dist

PROMPT, DECODER = 0, 1  # cluster ids, also the gloo ranks
GLOO_PORT = os.environ["PORTS_MASTER_PORT"]  # port: harness port, was 29500
LISTEN_PORT = {  # port: harness ports, were 26000 and 26001 (which party: per sample)
    PROMPT: int(os.environ["PORTS_PROMPT_PORT"]),
    DECODER: int(os.environ["PORTS_DECODER_PORT"]),
}

log = logging.getLogger("sample")


def join_group(rank: int, args: argparse.Namespace) -> None:
    """Join the two-process gloo group as ``rank`` (master: the lower of the two hosts)."""
    os.environ["MASTER_ADDR"] = min(args.local_host_ip, args.remote_host_ip)
    os.environ["MASTER_PORT"] = GLOO_PORT  # port: harness port
    dist.init_process_group(
        backend="gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )


Party = Callable[[argparse.Namespace], None]


def run_by_role(prompt: Party, decoder: Party, *, backend_options: bool = True) -> None:
    """A sample's ``__main__``: parse its command line (``--device_id``, ``--role p|d``,
    ``--local_host_ip``, ``--remote_host_ip`` and, with ``backend_options``,
    ``--local_comm_res`` and ``--transfer_backend``), log ``Sample start``, run
    ``prompt(args)`` (``--role p``) or ``decoder(args)`` (``--role d``), log ``Sample end``
    (what the harness looks for) once that party returned."""
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, choices=range(8))
    parser.add_argument("--role", choices=["p", "d"], required=True)
    parser.add_argument("--local_host_ip", required=True)
    parser.add_argument("--remote_host_ip", required=True)
    if backend_options:
        parser.add_argument("--local_comm_res")
        parser.add_argument("--transfer_backend", default="", help="'hixl', or empty for adxl")
    args = parser.parse_args()
    log.info("Sample start, role %s, device %d", args.role, args.device_id)
    # port: CPU, no torch.npu.set_device(args.device_id)
    (prompt if args.role == "p" else decoder)(args)
    log.info("Sample end")
