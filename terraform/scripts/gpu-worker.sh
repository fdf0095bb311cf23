# A GPU machine of a regional pool: vLLM, launched and supervised by the globalpool
# worker agent, which heartbeats its capacity and load to the Redis primary.
#   globalpool worker --region R --launch -- vllm serve MODEL --served-model-name NAME ...

main() {
  ensure_user
  install_ops_agent
  apt_install python3-venv

  log "waiting for the NVIDIA driver"
  local tries=0
  until nvidia-smi >/dev/null 2>&1; do
    tries=$((tries + 1))
    if ((tries > 60)); then log "no GPU visible after 10 minutes"; exit 1; fi
    sleep 10
  done

  # Two environments, so that vLLM's pins and globalpool's never have to agree.
  venv_install /opt/vllm "$(setting vllm_pip_spec)"
  globalpool_install /opt/globalpool

  local secrets=$ETC/secrets
  secret "$(setting heartbeat_keys_secret)" | write_private "$secrets/heartbeat-keys"
  optional_secret "$(setting hf_token_secret)" "$secrets/hf-token"
  optional_secret "$(setting upstream_api_key_secret)" "$secrets/upstream-api-key"
  install -d -m 0750 -o globalpool -g globalpool /var/lib/globalpool/hf

  {
    echo "REDIS_URL=$(redis_url)"
    echo "GLOBALPOOL_HEARTBEAT_KEYS_FILE=$secrets/heartbeat-keys"
    echo "HF_HOME=/var/lib/globalpool/hf"
    echo "VLLM_NO_USAGE_STATS=1"
    if [[ -f $secrets/hf-token ]]; then echo "HF_TOKEN=$(cat "$secrets/hf-token")"; fi
    # vLLM then requires `Authorization: Bearer` on /v1; the routers send it.
    if [[ -f $secrets/upstream-api-key ]]; then echo "VLLM_API_KEY=$(cat "$secrets/upstream-api-key")"; fi
  } | write_private "$ETC/worker.env"

  local ip port command
  ip=$(meta instance/network-interfaces/0/ip)
  port=$(setting engine_port)
  # The engine's argv comes from Terraform as JSON; quote it once, here, for bash.
  command=$(setting vllm_argv | python3 -c '
import json, shlex, sys
print(shlex.join(["/opt/vllm/bin/vllm", "serve", *json.load(sys.stdin)]))')
  cat >/usr/local/bin/globalpool-worker <<EOF
#!/bin/bash
exec /opt/globalpool/bin/globalpool worker \\
  --region $(printf '%q' "$(setting region)") \\
  --engine-url http://127.0.0.1:$port --advertise-url http://$ip:$port \\
  --key-prefix $(printf '%q' "$(setting key_prefix)") \\
  --interval-s $(setting heartbeat_interval_s) --ttl-s $(setting heartbeat_ttl_s) \\
  --max-num-seqs $(setting max_num_seqs) \\
  --drain-timeout-s $(setting drain_timeout_s) \\
  --start-timeout-s $(setting start_timeout_s) \\
  --launch -- $command
EOF
  chmod 0755 /usr/local/bin/globalpool-worker

  # SIGTERM (instance deletion, preemption, rolling replacement) makes the agent publish
  # `draining`, finish in-flight requests, then stop vLLM.
  start_unit globalpool-worker <<EOF
[Unit]
Description=globalpool worker agent supervising vLLM ($(setting model))
After=network-online.target
Wants=network-online.target

[Service]
User=globalpool
Group=globalpool
EnvironmentFile=$ETC/worker.env
ExecStart=/usr/local/bin/globalpool-worker
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=$(($(setting drain_timeout_s) + 45))
Restart=always
RestartSec=5
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
  log "worker started for $(setting model) in $(setting region)"
}

main "$@"
