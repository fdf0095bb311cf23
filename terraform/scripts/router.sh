# A router replica: `globalpool router --region R` behind the global load balancer,
# reading the regions.yaml that Terraform read, with batch.storage set to the deployment's
# bucket (metadata key globalpool-regions-yaml). The bucket is reached with the machine's
# service account, through the metadata server: no key file, no GOOGLE_* variable.

main() {
  ensure_user
  install_ops_agent
  # The compiled build of the request path (setup.py): a C compiler and Python's headers.
  apt_install python3-venv gcc python3-dev
  GLOBALPOOL_COMPILE=1 globalpool_install /opt/globalpool

  meta instance/attributes/globalpool-regions-yaml | write_private "$ETC/regions.yaml"

  local secrets=$ETC/secrets
  secret "$(setting heartbeat_keys_secret)" | write_private "$secrets/heartbeat-keys"
  optional_secret "$(setting upstream_api_key_secret)" "$secrets/upstream-api-key"

  # API keys: the keys file named by regions.yaml auth.keys_file (hashes only), relative to
  # regions.yaml like the router reads it.
  local keys_file
  keys_file=$(setting keys_file)
  if [[ $keys_file != null ]]; then
    [[ $keys_file == /* ]] || keys_file=$ETC/$keys_file
    install -d -m 0750 -o root -g globalpool "$(dirname "$keys_file")"
    secret "$(setting api_keys_secret)" | write_private "$keys_file"
  fi

  {
    echo "REDIS_URL=$(redis_url)"
    echo "GLOBALPOOL_HEARTBEAT_KEYS_FILE=$secrets/heartbeat-keys"
    echo "$(setting admin_token_env)=$(secret "$(setting admin_token_secret)")"
    # regions.yaml regions.<name>.upstream_api_key_env: the key the routers send to the
    # workers of that region (the workers' vLLM requires it).
    if [[ -f $secrets/upstream-api-key ]]; then
      local name
      for name in $(setting upstream_key_envs | python3 -c 'import json, sys; print(" ".join(json.load(sys.stdin)))'); do
        echo "$name=$(cat "$secrets/upstream-api-key")"
      done
    fi
  } | write_private "$ETC/router.env"

  start_unit globalpool-router <<EOF
[Unit]
Description=globalpool router replica ($(setting region))
After=network-online.target
Wants=network-online.target

[Service]
User=globalpool
Group=globalpool
EnvironmentFile=$ETC/router.env
ExecStart=/opt/globalpool/bin/globalpool router --config $ETC/regions.yaml --region $(setting region) --host 0.0.0.0 --port $(setting port)
ExecReload=/bin/kill -HUP $MAINPID
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=60
Restart=always
RestartSec=2
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
EOF
  log "router started in $(setting region)"
}

main "$@"
