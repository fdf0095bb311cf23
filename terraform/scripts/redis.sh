# A Redis node: the primary in one region, a replica of it in every other region.
# Heartbeats, pub/sub notifications, rate-limit counters and drain flags live here.
# The role is a metadata value; a watcher applies a change at once (promotion) or after
# the DNS name of the primary has moved (demotion), so that failover is a Terraform apply
# with another redis_primary_region.

main() {
  ensure_user
  install_ops_agent
  apt_install redis-server

  local password
  password=$(secret "$(setting redis_password_secret)")
  install -m 0640 -o redis -g redis /dev/stdin /etc/redis/globalpool.conf <<EOF
# Written by the globalpool start-up script on every boot.
bind 0.0.0.0
protected-mode no
port 6379
requirepass $password
masterauth $password
appendonly yes
appendfsync everysec
replica-read-only yes
# Routers and workers reconnect on their own; keep idle clients.
timeout 0
tcp-keepalive 60
EOF
  grep -q '^include /etc/redis/globalpool.conf' /etc/redis/redis.conf ||
    echo 'include /etc/redis/globalpool.conf' >>/etc/redis/redis.conf
  systemctl enable redis-server
  systemctl restart redis-server

  install -m 0750 -o root -g root /dev/stdin /usr/local/bin/globalpool-redis-role <<'EOF'
#!/bin/bash
# Applies the metadata role (primary / replica of the primary's DNS name) to Redis,
# then again whenever the instance's metadata changes.
set -uo pipefail
METADATA=http://metadata.google.internal/computeMetadata/v1/instance/attributes
settings() { curl -fsS -H 'Metadata-Flavor: Google' "$METADATA/globalpool-settings"; }
field() { python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
cli() { REDISCLI_AUTH=$(sed -n 's/^requirepass //p' /etc/redis/globalpool.conf) redis-cli "$@"; }
apply() {
  local doc role host
  doc=$(settings) || return 1
  role=$(field role <<<"$doc")
  host=$(field primary_host <<<"$doc")
  if [[ $role == primary ]]; then
    cli REPLICAOF NO ONE
  else
    if [[ $(cli ROLE | head -1) == master && ${1:-} == changed ]]; then
      # Demoted: wait until the primary's DNS name points at the new primary, then
      # follow it and drop clients so that they reconnect there.
      sleep 60
      cli REPLICAOF "$host" 6379
      cli CLIENT KILL TYPE normal
    else
      cli REPLICAOF "$host" 6379
    fi
  fi
}
until apply; do sleep 5; done
while true; do
  if curl -fsS -H 'Metadata-Flavor: Google' "$METADATA/?recursive=true&wait_for_change=true" >/dev/null; then
    apply changed || sleep 5
  else
    sleep 5
  fi
done
EOF

  start_unit globalpool-redis-role <<EOF
[Unit]
Description=globalpool: keep this Redis node's role in line with its metadata
After=redis-server.service
Requires=redis-server.service

[Service]
ExecStart=/usr/local/bin/globalpool-redis-role
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
EOF
  log "redis $(setting role) started in $(setting region)"
}

main "$@"
