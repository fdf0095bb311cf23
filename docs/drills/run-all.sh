#!/usr/bin/env bash
# Run every drill of DRILLS.md at full length, one after the other (about 2 min each),
# writing docs/drills/<name>/{report.json,report.md,timeline.png}. Latencies are only
# meaningful on a machine that is otherwise idle: before each drill this waits (up to
# 30 min) until the 1-minute load average is below the number of CPUs (or QUIET_LOAD).
# KEEP_RAW=1 keeps the children's logs and the per-request records next to the reports.
set -uo pipefail
cd "$(dirname "$0")/../.."
GLOBALPOOL=${GLOBALPOOL:-globalpool}
only=("$@")

quiet() {
  local limit=${QUIET_LOAD:-$(nproc)} waited=0
  while (( waited < 1800 )); do
    awk -v c="$limit" '{exit !($1 < c)}' /proc/loadavg && return
    sleep 10; waited=$((waited + 10))
  done
}

drill() {
  local name=$1; shift
  if (( ${#only[@]} )) && [[ ! " ${only[*]} " =~ " $name " ]]; then return; fi
  quiet
  echo "== $name: $GLOBALPOOL drill $* --out docs/drills/$name (load $(cut -d' ' -f1 /proc/loadavg))"
  $GLOBALPOOL drill "$@" --out "docs/drills/$name" > "docs/drills/$name.log" 2>&1
  echo "   exit $? (3: a goal was missed); $(tail -n 1 "docs/drills/$name.log")"
  [[ -n "${KEEP_RAW:-}" ]] && return  # keep the children's logs and per-request records
  rm -rf "docs/drills/$name/logs" "docs/drills/$name/requests.jsonl" \
         "docs/drills/$name/health.jsonl" "docs/drills/$name.log"
}

drill kill-region          kill-region
drill drain-region         drain-region
drill drain-region-admin   drain-region --drain-via admin
drill drain-region-config  drain-region --drain-via config
drill partition-region     partition-region
drill partition-region-5s  partition-region --set router.timeouts.first_byte_s=5
drill slow-region          slow-region
drill redis-outage         redis-outage
drill redis-outage-freeze  redis-outage --redis-mode freeze
drill redis-failover       redis-failover
drill redis-cluster-failover redis-cluster-failover
drill worker-flap          worker-flap
${PYTHON:-python} -m lab.drill.summary docs/drills
