# A Redis node: redis-server and a sentinel, one pair per region, TLS only (6379 and
# 26379) with AUTH everywhere. Heartbeats, pub/sub notifications, rate-limit counters and
# drain flags live on the primary; every other node is a replica of it.
#
# Failover is automatic: when a majority of the sentinels (the quorum) agree that the
# primary is down, they promote a replica, and clients, which ask the sentinels for the
# primary on every new connection (rediss+sentinel://), follow. Terraform's
# redis_primary_region names the initial primary only. This script runs at every boot and
# decides the node's role then: it asks the other nodes' sentinels who the primary is and
# follows it (stays primary if it is this node). When none answers (every node booting at
# once), it follows the primary its own sentinel last knew; only at the deployment's first
# start, with no sentinel state anywhere, does it take its initial role.

readonly REDIS_PORT=6379
readonly SENTINEL_PORT=26379
readonly REDIS_TLS=/etc/redis/tls
readonly REDIS_CONF=/etc/redis/globalpool.conf
readonly SENTINEL_DIR=/var/lib/globalpool-sentinel
readonly SENTINEL_CONF=$SENTINEL_DIR/sentinel.conf

main() {
  ensure_user
  install_ops_agent
  apt_install redis-server openssl
  remove_role_watcher

  local password address service
  password=$(secret "$(setting redis_password_secret)")
  address=$(meta instance/network-interfaces/0/ip)
  service=$(setting redis_service)

  install -d -m 0750 -o root -g redis "$REDIS_TLS"
  secret "$(setting redis_tls_ca_cert_secret)" | install -m 0644 /dev/stdin "$REDIS_TLS/ca.pem"
  secret "$(setting redis_tls_ca_key_secret)" | node_certificate "$REDIS_TLS" "$address" "$(setting node_host)"
  chgrp redis "$REDIS_TLS/node.key"

  local fallback primary host others=()
  fallback=$(learnt_primary "$SENTINEL_CONF" "$service")
  if [[ -z $fallback && $(setting role) == primary ]]; then
    fallback=$address
  elif [[ -z $fallback ]]; then
    fallback=$(address_of "$(setting initial_primary_host)")
  fi
  for host in $(setting redis_nodes); do
    [[ $host == "$(setting node_host)" ]] || others+=("$host")
  done
  primary=$(boot_primary "$address" "$fallback" "$password" "$service" "${others[@]}")
  if [[ $primary == "$address" ]]; then
    log "redis in $(setting region) starts as the primary"
  else
    log "redis in $(setting region) starts as a replica of $primary"
  fi

  # redis-server reads our file, not Debian's redis.conf: a CONFIG REWRITE (which the
  # sentinels send after a failover) appends its own replicaof and password lines to the
  # file Redis was started with, and lines appended after an `include` of ours would
  # override it at the next boot.
  if [[ $primary == "$address" ]]; then
    redis_conf "$address" "$password"
  else
    redis_conf "$address" "$password" "$primary"
  fi | install -m 0640 -o redis -g redis /dev/stdin "$REDIS_CONF"
  install -d -m 0755 /etc/systemd/system/redis-server.service.d
  install -m 0644 /dev/stdin /etc/systemd/system/redis-server.service.d/globalpool.conf <<EOF
# globalpool: redis-server reads the configuration the start-up script writes at boot.
[Service]
ExecStart=
ExecStart=/usr/bin/redis-server $REDIS_CONF --supervised systemd --daemonize no
EOF
  systemctl daemon-reload
  # Started by this script once the role is decided, never before it at boot.
  systemctl disable --quiet redis-server
  systemctl restart redis-server

  # The sentinel's file holds what it has learnt (stopped first, so that it cannot
  # rewrite the file while it is merged).
  systemctl stop globalpool-sentinel 2>/dev/null || true
  install -d -m 0750 -o redis -g redis "$SENTINEL_DIR"
  sentinel_conf "$SENTINEL_CONF" "$service" "$address" "$primary" "$(setting sentinel_quorum)" \
    "$(setting down_after_ms)" "$(setting failover_timeout_ms)" "$password" |
    install -m 0600 -o redis -g redis /dev/stdin "$SENTINEL_CONF.new"
  mv "$SENTINEL_CONF.new" "$SENTINEL_CONF"

  start_unit globalpool-sentinel <<EOF
[Unit]
Description=globalpool: Redis Sentinel (automatic failover of the Redis primary)
After=network-online.target redis-server.service
Wants=network-online.target

[Service]
Type=notify
ExecStart=/usr/bin/redis-server $SENTINEL_CONF --sentinel --supervised systemd --daemonize no
User=redis
Group=redis
UMask=0077
Restart=always
RestartSec=1
LimitNOFILE=65535
NoNewPrivileges=true
PrivateTmp=true
ProtectHome=true
ProtectSystem=strict
ReadWritePaths=$SENTINEL_DIR

[Install]
WantedBy=multi-user.target
EOF
  log "redis and its sentinel started in $(setting region)"
}

# redis_quote VALUE: VALUE as a double-quoted string of a Redis configuration file.
redis_quote() {
  local value=${1//\\/\\\\}
  value=${value//\"/\\\"}
  printf '"%s"' "$value"
}

# redis_conf ADDRESS PASSWORD [PRIMARY]: redis-server's configuration; with PRIMARY, as a
# replica of the node at that address.
redis_conf() {
  local address=$1 password=$2 primary=${3:-}
  cat <<EOF
# Written by the globalpool start-up script at every boot. The CONFIG REWRITE that the
# sentinels send when they change this node's role may edit it until the next boot.
bind 0.0.0.0
protected-mode no
# TLS only, no plain-text port. Clients authenticate with the password (AUTH), not with
# certificates; replication to and from the other nodes is TLS too.
port 0
tls-port $REDIS_PORT
tls-cert-file $REDIS_TLS/node.crt
tls-key-file $REDIS_TLS/node.key
tls-ca-cert-file $REDIS_TLS/ca.pem
tls-auth-clients no
tls-replication yes
requirepass $(redis_quote "$password")
masterauth $(redis_quote "$password")
# The sentinels hand this address to clients after promoting this node; it is in the
# node's certificate.
replica-announce-ip $address
dir /var/lib/redis
pidfile /run/redis/redis-server.pid
logfile ""
appendonly yes
appendfsync everysec
replica-read-only yes
# Routers and workers reconnect on their own; keep idle clients.
timeout 0
tcp-keepalive 60
EOF
  if [[ -n $primary ]]; then echo "replicaof $primary $REDIS_PORT"; fi
}

# sentinel_conf FILE SERVICE ADDRESS PRIMARY QUORUM DOWN_AFTER_MS FAILOVER_TIMEOUT_MS PASSWORD:
# the sentinel's configuration, on stdout, to replace FILE.
#
# The sentinel writes into FILE what it learns: its id, the epochs, which node is the
# primary now, the replicas and other sentinels it knows. A reboot must not lose that (a
# sentinel that forgot a failover would name the old primary again), so when FILE exists
# its learnt lines are kept, and the primary it names too; only what Terraform and Secret
# Manager own is written anew (TLS, the password, the quorum and the timings), so that a
# rotated password or a new quorum still takes effect at the next boot. A new FILE monitors
# PRIMARY (whom this boot found to be the primary).
sentinel_conf() {
  local file=$1 service=$2 address=$3 primary=$4 quorum=$5 down_after_ms=$6
  local failover_timeout_ms=$7 password=$8
  local monitored learnt=""
  monitored=$(learnt_primary "$file" "$service")
  if [[ -n $monitored ]]; then
    learnt=$(grep -E "^sentinel (myid|current-epoch) |^sentinel (config-epoch|leader-epoch|known-replica|known-slave|known-sentinel) $service " "$file" || true)
  else
    monitored=$primary
  fi
  cat <<EOF
# Written by the globalpool start-up script, and rewritten by the sentinel as it learns;
# at boot the script keeps what the sentinel learnt and renews the rest.
bind 0.0.0.0
protected-mode no
port 0
tls-port $SENTINEL_PORT
tls-cert-file $REDIS_TLS/node.crt
tls-key-file $REDIS_TLS/node.key
tls-ca-cert-file $REDIS_TLS/ca.pem
tls-auth-clients no
tls-replication yes
requirepass $(redis_quote "$password")
dir $SENTINEL_DIR
logfile ""
sentinel announce-ip $address
sentinel announce-port $SENTINEL_PORT
sentinel resolve-hostnames no
sentinel monitor $service $monitored $REDIS_PORT $quorum
sentinel auth-pass $service $(redis_quote "$password")
sentinel down-after-milliseconds $service $down_after_ms
sentinel failover-timeout $service $failover_timeout_ms
sentinel parallel-syncs $service 1
EOF
  if [[ -n $learnt ]]; then printf '%s\n' "$learnt"; fi
}

# learnt_primary FILE SERVICE: the address of SERVICE's primary as the sentinel's FILE
# names it (what this node's sentinel last knew); nothing when there is no such file.
learnt_primary() {
  [[ -s $1 ]] || return 0
  awk -v service="$2" '$1 == "sentinel" && $2 == "monitor" && $3 == service { print $4; exit }' "$1"
}

# node_certificate DIR ADDRESS HOST: a new key and certificate for this node (DIR/node.key,
# DIR/node.crt), signed by the CA of DIR/ca.pem with the CA's key read from stdin (it is
# never written to disk). Valid for ADDRESS, which clients check since the sentinels give
# them addresses, for HOST, and for 127.0.0.1 (redis-cli on the node). Made anew at every
# boot, so that a new CA or address takes effect with a reboot.
node_certificate() {
  local dir=$1 address=$2 host=$3 ca_key
  ca_key=$(cat)
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/node.key.new"
  openssl req -new -key "$dir/node.key.new" -subj "/CN=$address" -out "$dir/node.csr"
  if ! openssl x509 -req -in "$dir/node.csr" -CA "$dir/ca.pem" -CAkey <(printf '%s\n' "$ca_key") \
    -set_serial "0x$(openssl rand -hex 16)" -days 3650 -sha256 -out "$dir/node.crt.new" \
    -extfile <(printf 'subjectAltName=IP:%s,IP:127.0.0.1,DNS:%s,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' "$address" "$host"); then
    log "cannot sign this node's certificate: do the secrets redis-tls-ca-cert and redis-tls-ca-key hold a CA certificate and its key?"
    return 1
  fi
  rm -f "$dir/node.csr"
  chmod 0640 "$dir/node.key.new" # the caller gives it to redis's group
  chmod 0644 "$dir/node.crt.new"
  mv "$dir/node.key.new" "$dir/node.key"
  mv "$dir/node.crt.new" "$dir/node.crt"
}

# address_of HOST: HOST's IPv4 address, waiting (logging every minute) until it resolves.
address_of() {
  local found waited=0
  until found=$(getent ahostsv4 "$1" | awk 'NR == 1 { print $1 }') && [[ -n $found ]]; do
    if ((waited % 60 == 0)); then log "waiting for $1 to resolve"; fi
    sleep 5
    waited=$((waited + 5))
  done
  printf '%s\n' "$found"
}

# sentinel_cli PASSWORD HOST ARGS...: a command to HOST's sentinel (TLS, at most 5 s).
sentinel_cli() {
  local password=$1 host=$2
  shift 2
  REDISCLI_AUTH=$password timeout 5 redis-cli --tls --cacert "$REDIS_TLS/ca.pem" \
    -h "$host" -p "$SENTINEL_PORT" --raw "$@" 2>/dev/null
}

# named_primary PASSWORD SERVICE HOST...: the primary's address as the first of these
# nodes' sentinels that answers names it; exit 1 when none answers.
named_primary() {
  local password=$1 service=$2 host reply
  shift 2
  for host in "$@"; do
    reply=$(sentinel_cli "$password" "$host" SENTINEL get-master-addr-by-name "$service") || continue
    reply=${reply%%$'\n'*}
    if [[ $reply =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
      printf '%s\n' "$reply"
      return 0
    fi
  done
  return 1
}

# answers ADDRESS PASSWORD: whether the Redis server at ADDRESS answers a PING.
answers() {
  [[ $(REDISCLI_AUTH=$2 timeout 5 redis-cli --tls --cacert "$REDIS_TLS/ca.pem" \
    -h "$1" -p "$REDIS_PORT" --raw PING 2>/dev/null) == PONG ]]
}

# boot_primary ADDRESS FALLBACK PASSWORD SERVICE HOST...: whom this node follows at boot
# (its own ADDRESS: nobody, it is the primary). The primary the other nodes' sentinels
# name; when one names a primary that does not answer (it has just been lost, and the
# failover is still under way), asked again for up to a minute. FALLBACK when no sentinel
# answers.
boot_primary() {
  local address=$1 fallback=$2 password=$3 service=$4 named tries=0
  shift 4
  while named=$(named_primary "$password" "$service" "$@"); do
    if [[ $named == "$address" ]] || answers "$named" "$password" || ((tries >= 12)); then
      printf '%s\n' "$named"
      return 0
    fi
    tries=$((tries + 1))
    sleep 5
  done
  printf '%s\n' "$fallback"
}

# Before Sentinel, a watcher applied a role written in the instance metadata: remove it.
remove_role_watcher() {
  [[ -e /etc/systemd/system/globalpool-redis-role.service ]] || return 0
  systemctl stop globalpool-redis-role || true
  rm -f /etc/systemd/system/globalpool-redis-role.service /usr/local/bin/globalpool-redis-role
  systemctl daemon-reload
}

main "$@"
