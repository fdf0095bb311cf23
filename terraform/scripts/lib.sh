# Shared by every globalpool start-up script (prepended to each by Terraform).
# Compute Engine runs the start-up script as root on every boot, so every step is
# idempotent. Settings come from the instance metadata key `globalpool-settings` (JSON
# written by Terraform); secrets come from Secret Manager at boot and never from
# metadata, Terraform variables or Terraform state.
set -euo pipefail
umask 027

readonly METADATA=http://metadata.google.internal/computeMetadata/v1
readonly ETC=/etc/globalpool

log() { echo "globalpool-startup: $*" >&2; }

# meta PATH: a metadata value, e.g. `meta instance/attributes/globalpool-settings`.
meta() { curl -fsS --retry 10 --retry-connrefused -H 'Metadata-Flavor: Google' "$METADATA/$1"; }

# setting KEY: one key of the JSON settings; strings as-is, anything else as JSON.
setting() {
  meta instance/attributes/globalpool-settings | python3 -c '
import json, sys
value = json.load(sys.stdin).get(sys.argv[1])
print(value if isinstance(value, str) else json.dumps(value))' "$1"
}

access_token() {
  meta instance/service-accounts/default/token |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])'
}

# secret_once SECRET_ID: the latest version's payload on stdout; exit 1 if there is none
# (yet) or this machine may not read it.
secret_once() {
  local body
  body=$(curl -fsS -H "Authorization: Bearer $(access_token)" \
    "https://secretmanager.googleapis.com/v1/$1/versions/latest:access") || return 1
  printf '%s' "$body" |
    python3 -c 'import base64, json, sys; sys.stdout.write(base64.b64decode(json.load(sys.stdin)["payload"]["data"]).decode())'
}

# secret SECRET_ID: like secret_once, but waits (logging every minute) until an operator
# has added a version: `gcloud secrets versions add ID --data-file=-`.
secret() {
  local waited=0
  until secret_once "$1"; do
    if ((waited % 60 == 0)); then log "waiting for a version of secret $1"; fi
    sleep 10
    waited=$((waited + 10))
  done
}

# optional_secret SECRET_ID FILE: write the secret to FILE if it has a version, else
# remove FILE; exit 0 either way.
optional_secret() {
  local value
  if value=$(secret_once "$1"); then printf '%s\n' "$value" | write_private "$2"; else rm -f "$2"; fi
}

ensure_user() {
  id globalpool >/dev/null 2>&1 ||
    useradd --system --create-home --home-dir /var/lib/globalpool --shell /usr/sbin/nologin globalpool
  install -d -m 0750 -o root -g globalpool "$ETC" "$ETC/secrets"
}

apt_install() {
  local missing=()
  for package in "$@"; do dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package"); done
  if ((${#missing[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
}

# venv_install DIR SPEC [CONSTRAINTS]: a virtual environment at DIR with the pip SPEC and,
# when a CONSTRAINTS file is named, its dependencies at the versions that file pins;
# reinstalled only when the SPEC or the constraints change.
venv_install() {
  local dir=$1 spec=$2 constraints=${3:-}
  local wanted=$spec pip_args=()
  if [[ -n $constraints ]]; then
    wanted="$spec, constraints sha256 $(sha256sum <"$constraints" | cut -d' ' -f1)"
    pip_args=(--constraint "$constraints")
  fi
  if [[ -f $dir/.globalpool-spec && $(cat "$dir/.globalpool-spec") == "$wanted" ]]; then return 0; fi
  log "installing $wanted into $dir"
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install --quiet --upgrade pip
  "$dir/bin/pip" install --quiet "${pip_args[@]}" "$spec"
  printf '%s' "$wanted" >"$dir/.globalpool-spec"
}

# globalpool_install DIR: globalpool_pip_spec into DIR, its dependencies at the versions of
# the repository's requirements.lock (which Terraform sends), the ones CI tested.
globalpool_install() {
  local lock=$ETC/requirements.lock
  setting requirements_lock | write_private "$lock"
  venv_install "$1" "$(setting globalpool_pip_spec)" "$lock"
}

# The CA certificate that Redis nodes' certificates are checked against (not a secret).
readonly REDIS_CA=$ETC/redis-ca.pem

# redis_url: the URL of the Redis primary, found through the sentinels of every Redis node
# (rediss+sentinel://: TLS to the sentinels and to the primary, both checked against the
# CA in REDIS_CA, which this writes), with the password from Secret Manager, URL-quoted,
# for the primary and for the sentinels. Every new connection asks the sentinels where the
# primary is, so a failover needs nothing from here.
redis_url() {
  local password
  secret "$(setting redis_tls_ca_cert_secret)" | install -m 0644 -o root -g root /dev/stdin "$REDIS_CA"
  password=$(secret "$(setting redis_password_secret)" |
    python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.stdin.read(), safe=""))')
  printf 'rediss+sentinel://:%s@%s/%s/0?ssl_ca_certs=%s&sentinel_password=%s' \
    "$password" "$(setting redis_sentinels)" "$(setting redis_service)" "$REDIS_CA" "$password"
}

install_ops_agent() {
  [[ $(setting ops_agent) == true ]] || return 0
  systemctl is-active --quiet google-cloud-ops-agent && return 0
  log "installing the Ops Agent (logs and metrics to Cloud Logging/Monitoring)"
  curl -fsS https://dl.google.com/cloudagents/add-google-cloud-ops-agent-repo.sh | bash -s -- --also-install ||
    log "Ops Agent install failed; continuing without it"
}

# start_unit NAME: install /etc/systemd/system/NAME.service from stdin and (re)start it.
# Units are not enabled: this script starts them on every boot, after the secrets and
# settings they read are in place.
start_unit() {
  install -m 0644 /dev/stdin "/etc/systemd/system/$1.service"
  systemctl daemon-reload
  systemctl restart "$1"
}

# write_private FILE: stdin to FILE, readable by root and the globalpool group only.
write_private() {
  install -m 0640 -o root -g globalpool /dev/stdin "$1"
}
