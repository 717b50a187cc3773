#!/usr/bin/env bash
# `docker compose up`, proven against a real Docker engine: build, start compose.yaml and then
# the fleet (compose.fleet.yaml over it), wait on the healthchecks, stream a chat completion
# through the gateway with the OpenAI SDK, check /metrics on every service (through Prometheus)
# and the trace in the collector, stop the fleet under load, tear everything down.
#
#   sudo scripts/compose_check.sh | tee bench/results/compose-check-$(date +%F).txt
#
# Prints the timings (build, image size, time to healthy, first-token latency) and one
# PASS/FAIL line per check; exits 1 if any failed. Uses `docker compose` when the CLI has it,
# else docker-compose (1.29); COMPOSE="docker-compose" forces one. Starts dockerd if none
# answers (and stops it at the end); makes the base image (scripts/make_base_image.sh) and
# build/wheels (scripts/make_wheels.sh) when missing. Environment: KEEP=1 leaves the stack up;
# LOAD_STREAMS (8) and LOAD_MAX_TOKENS (192) size the stop-under-load check: its streams
# must still run when `stop` starts, and end within the gateway's 30 s drain (see docs/mesh.md).
#
# GROUP=1 checks the two-node worker group instead (compose.group.yaml over compose.yaml):
#
#   GROUP=1 scripts/compose_check.sh | tee bench/results/compose-group-check-$(date +%F).txt
#
# up and healthy, both nodes joined one group (each container's log), a streamed chat completion
# and its trace, then node 1 killed mid-stream: the stream must end with an error, the leader
# exit and the gateway's /ready turn 503 within seconds; node 1 started again: the group
# re-forms and serves; node 1 killed while idle: the next request fails and the leader exits.
# CUT_MAX_TOKENS (400) sizes the stream.
#
# PD=1 checks prefill/decode disaggregation instead (compose.pd.yaml over compose.yaml: its
# replica prefills, the -decode services decode, the router pairs them; docs/disaggregation.md):
#
#   PD=1 scripts/compose_check.sh | tee bench/results/compose-pd-check-$(date +%F).txt
#
# up and healthy, the router's two pools (/admin/replicas: one prefill and one decode replica,
# healthy), a streamed chat completion and its trace, one not streamed, /ready 200, every target
# scraped, the prefill scheduler's radixmesh:kv_transfer_bytes > 0 (through Prometheus: the KV
# crossed to the decode worker), and n: 2 refused with a 400 naming n.
# Not part of the pytest suite: it takes minutes and a Docker engine.
set -uo pipefail
cd "$(dirname "$0")/.."

project=radixmesh-check
base=(-f compose.yaml)
fleet=(-f compose.yaml -f compose.fleet.yaml)
group=(-f compose.yaml -f compose.group.yaml)
pd=(-f compose.yaml -f compose.pd.yaml)
files=("${fleet[@]}")  # what cleanup and build use
[[ ${GROUP:-0} == 1 ]] && files=("${group[@]}")
[[ ${PD:-0} == 1 ]] && files=("${pd[@]}")
[[ ${GROUP:-0} == 1 && ${PD:-0} == 1 ]] && { echo "GROUP=1 and PD=1: one at a time" >&2; exit 2; }
url=http://127.0.0.1:8000
collector=http://127.0.0.1:16686
prometheus=http://127.0.0.1:9090
py=.venv/bin/python; [[ -x $py ]] || py=python3
probe=("$py" scripts/compose_probe.py)
work=build/compose-check
mkdir -p "$work"
failed=0
started_dockerd=

say() { printf '%s\n' "$*"; }
check() {  # check NAME COMMAND...: PASS/FAIL line, the command's output indented
  local name=$1; shift
  local out rc
  out=$("$@" 2>&1); rc=$?
  [[ -n $out ]] && sed 's/^/    /' <<<"$out"
  if [[ $rc == 0 ]]; then say "PASS  $name"; else say "FAIL  $name"; failed=1; fi
  return $rc
}
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

cleanup() {
  if [[ ${KEEP:-0} != 1 ]] && docker info >/dev/null 2>&1; then
    "${compose[@]}" -p "$project" "${files[@]}" down -v --remove-orphans >"$work/down.log" 2>&1
  fi
  if [[ -n $started_dockerd ]]; then
    kill "$started_dockerd" 2>/dev/null && wait "$started_dockerd" 2>/dev/null
    say "stopped the dockerd this check started"
  fi
}
trap cleanup EXIT

mode=; [[ ${GROUP:-0} == 1 ]] && mode=" (GROUP=1: the worker group)"
[[ ${PD:-0} == 1 ]] && mode=" (PD=1: prefill/decode disaggregation)"
say "== radixmesh compose check$mode, $(date -u +%FT%TZ), $(uname -m), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB"
loadavg() { say "load average (1, 5, 15 min): $(cut -d' ' -f1-3 /proc/loadavg)"; }
loadavg

# --- the engine ------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || { say "FAIL  no Docker engine and no dockerd (apt-get install docker.io)"; exit 1; }
  dockerd >"$work/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "FAIL  dockerd did not start: $work/dockerd.log"; exit 1; }
  say "started dockerd (pid $started_dockerd)"
fi
if [[ -n ${COMPOSE:-} ]]; then read -ra compose <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then compose=(docker compose)
else compose=(docker-compose); fi
say "engine: Docker $(docker version -f '{{.Server.Version}}'), $(docker info -f '{{.Driver}}'); compose: ${compose[*]} ($("${compose[@]}" version --short 2>/dev/null || "${compose[@]}" version | head -1))"

# --- build -----------------------------------------------------------------------------------
t=$(date +%s.%N)
if ! docker image inspect "${RADIXMESH_BASE_IMAGE:-debian:bookworm-slim}" >/dev/null 2>&1; then
  check "base image from debootstrap" scripts/make_base_image.sh || exit 1
fi
if [[ ! -d build/wheels ]] || [[ ${REFRESH_WHEELS:-0} == 1 ]]; then
  check "wheels from the host's pip" scripts/make_wheels.sh || exit 1
fi
say "base image and wheels: $(elapsed "$t") s"
t=$(date +%s.%N)
# One service per image: every radixmesh service shares radixmesh:latest, which the collector's
# build makes (building each service would send the context a dozen times). NO_CACHE=1: cold.
if "${compose[@]}" -p "$project" "${files[@]}" build ${NO_CACHE:+--no-cache} collector prometheus \
     >"$work/build.log" 2>&1; then
  say "PASS  build ($(elapsed "$t") s; log $work/build.log)"
else
  tail -20 "$work/build.log"; say "FAIL  build"; exit 1
fi
for image in radixmesh:latest radixmesh-prometheus:latest; do
  say "image $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}')"
done

# --- up: waits on the healthchecks -----------------------------------------------------------
healthy() {  # every container of the project running and, where it has a healthcheck, healthy
  local ids states
  ids=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
  [[ -n $ids ]] || return 1
  states=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' $ids)
  ! grep -qv -E '^running (healthy|none)$' <<<"$states"
}
up() {  # up NAME FILES...: compose up -d, then wait until all is healthy
  local name=$1; shift
  local t; t=$(date +%s.%N)
  if ! "${compose[@]}" -p "$project" "$@" up -d >"$work/up-$name.log" 2>&1; then
    tail -20 "$work/up-$name.log"; say "FAIL  up ($name)"; failed=1; return 1
  fi
  local up_s; up_s=$(elapsed "$t")
  for _ in $(seq 300); do healthy && break; sleep 2; done
  if healthy; then
    say "PASS  up ($name): $(docker ps -q --filter "label=com.docker.compose.project=$project" | wc -l) containers healthy in $(elapsed "$t") s (compose up returned after $up_s s)"
  else
    docker ps -a --filter "label=com.docker.compose.project=$project" --format '    {{.Names}}: {{.Status}}'
    say "FAIL  up ($name): not all healthy after $(elapsed "$t") s"; failed=1; return 1
  fi
}
chat_and_trace() {  # chat_and_trace NAME SERVICE...: a streamed completion; its trace from each SERVICE
  local name=$1; shift
  local out trace_id
  if out=$("${probe[@]}" chat "$url" 2>&1); then
    sed 's/^/    /' <<<"$out"; say "PASS  streamed chat completion through the gateway ($name)"
  else
    sed 's/^/    /' <<<"$out"; say "FAIL  streamed chat completion through the gateway ($name)"; failed=1; return 1
  fi
  loadavg
  say "first-token latency ($name, cold): $(sed -n 's/.*"ttft_ms": \([0-9.]*\).*/\1/p' <<<"$out") ms"
  local warm=()
  for _ in 1 2 3 4 5; do
    warm+=("$("${probe[@]}" chat "$url" 2>/dev/null | sed -n 's/.*"ttft_ms": \([0-9.]*\).*/\1/p')")
  done
  say "first-token latency ($name, warm, 5 requests): $(printf '%s\n' "${warm[@]}" | sort -n | awk '{a[NR]=$1} END {printf "median %s ms, min %s ms, max %s ms", a[int((NR+1)/2)], a[1], a[NR]}')"
  trace_id=$(sed -n 's/.*"trace_id": "\([0-9a-f]*\)".*/\1/p' <<<"$out" | head -1)
  check "spans of that request reached the collector from all $# services ($name)" \
    "${probe[@]}" trace "$collector" "$trace_id" "${@/#/radixmesh-}"
}

fleet_checks() {  # compose.yaml's one replica, then the fleet, stopped under load
  if up one-replica "${base[@]}"; then
    chat_and_trace one-replica gateway tokenizer scheduler worker detokenizer
    check "/metrics answers on all 5 services: Prometheus scrapes every target up (one-replica)" \
      "${probe[@]}" targets "$prometheus" 5
  fi

  # From one replica to the fleet: down first (volumes kept). In place, compose would recreate the
  # worker with its new flags while leaving its scheduler up, which reports NOT_SERVING (unhealthy)
  # until the worker is back, and `up` stops at that unhealthy dependency.
  t=$(date +%s.%N)
  "${compose[@]}" -p "$project" "${base[@]}" down >"$work/down-one-replica.log" 2>&1
  say "down (one-replica): $(elapsed "$t") s"
  if up fleet "${fleet[@]}"; then
    check "the router reports 2 replicas (fleet)" "${probe[@]}" replicas "$url" 2
    chat_and_trace fleet gateway router tokenizer scheduler worker detokenizer
    check "/metrics answers on all 11 services: Prometheus scrapes every target up (fleet)" \
      "${probe[@]}" targets "$prometheus" 11

    # --- stop under load: every in-flight stream ends with length or abort, nothing hangs ------
    ready="$work/load-ready"; rm -f "$ready"
    "${probe[@]}" load "$url" "${LOAD_STREAMS:-8}" "${LOAD_MAX_TOKENS:-192}" "$ready" >"$work/load.json" 2>&1 &
    load_pid=$!
    for _ in $(seq 240); do [[ -e $ready ]] && break; kill -0 $load_pid 2>/dev/null || break; sleep 0.5; done
    if [[ -e $ready ]]; then
      t=$(date +%s.%N)
      "${compose[@]}" -p "$project" "${fleet[@]}" stop >"$work/stop.log" 2>&1
      say "compose stop under load: $(elapsed "$t") s (stop_grace_period 40 s, drain 30 s)"
    fi
    wait $load_pid; load_rc=$?
    sed 's/^/    /' "$work/load.json"
    if [[ -e $ready && $load_rc == 0 ]]; then
      say "PASS  stop under load: all ${LOAD_STREAMS:-8} streams in flight at stop ended cleanly (length or abort)"
    else say "FAIL  stop under load"; failed=1; fi
    killed=$(docker ps -aq --filter "label=com.docker.compose.project=$project" | xargs -r docker inspect \
      -f '{{.Name}} {{.State.ExitCode}}' | awk '$2 != 0 {print}')
    if [[ -z $killed ]]; then say "PASS  every container exited 0 on stop (drained, none SIGKILLed)"
    else sed 's/^/    exit status: /' <<<"$killed"; say "FAIL  containers that did not exit 0"; failed=1; fi
  fi
}

group_checks() {  # compose.group.yaml: the two-node worker group, then node 1 killed mid-stream
  local leader node1 out kill_at restarts0 t
  up group "${group[@]}" || return
  leader=$("${compose[@]}" -p "$project" "${group[@]}" ps -q worker)
  node1=$("${compose[@]}" -p "$project" "${group[@]}" ps -q worker-node1)
  check "both nodes joined one group: rank 0 in worker, rank 1 in worker-node1, world size 2, ready" \
    group_formed "$leader" "$node1"
  chat_and_trace group gateway tokenizer scheduler worker detokenizer
  check "/metrics answers on all 5 services: Prometheus scrapes every target up (group)" \
    "${probe[@]}" targets "$prometheus" 5

  # --- node 1 dies mid-stream: an error to the client, the leader down, /ready 503 ------------
  local ready="$work/cut-ready"; rm -f "$ready"
  restarts0=$(docker inspect -f '{{.RestartCount}}' "$leader")
  "${probe[@]}" cut "$url" "${CUT_MAX_TOKENS:-400}" "$ready" >"$work/cut.json" 2>&1 &
  local cut_pid=$!
  for _ in $(seq 240); do [[ -e $ready ]] && break; kill -0 $cut_pid 2>/dev/null || break; sleep 0.1; done
  kill_at=$(date +%s.%N)  # the times below count from here, the kill's start
  docker kill "$node1" >/dev/null
  say "killed worker-node1 mid-stream (docker kill, SIGKILL: returned after $(elapsed "$kill_at") s)"
  "${probe[@]}" ready "$url" 0 60 >"$work/unready.json" 2>&1 &
  local unready_pid=$!
  wait $cut_pid; local cut_rc=$?
  out=$(cat "$work/cut.json"); sed 's/^/    /' <<<"$out"
  local ended; ended=$(sed -n 's/.*"ended_at_epoch": \([0-9.]*\).*/\1/p' <<<"$out")
  if [[ $cut_rc == 0 ]]; then
    say "PASS  the stream in flight ended with an error $(awk -v a="$kill_at" -v b="$ended" 'BEGIN { printf "%.1f", b - a }') s after the kill"
  else say "FAIL  the stream in flight did not end with an error"; failed=1; fi
  local down_s=
  for _ in $(seq 300); do
    if [[ $(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$leader") != "$restarts0 true" ]]; then
      down_s=$(elapsed "$kill_at"); break
    fi
    sleep 0.1
  done
  docker logs "$leader" 2>&1 | grep -m1 'worker group broken' | cut -c1-400 | sed 's/^/    /'
  if [[ -n $down_s ]]; then say "PASS  the leader exited $down_s s after the kill (worker group broken; compose restarts it)"
  else say "FAIL  the leader still runs 30 s after node 1 died"; failed=1; fi
  wait $unready_pid; local unready_rc=$?
  out=$(cat "$work/unready.json"); sed 's/^/    /' <<<"$out"
  ended=$(sed -n 's/.*"ended_at_epoch": \([0-9.]*\).*/\1/p' <<<"$out")
  if [[ $unready_rc == 0 ]]; then
    say "PASS  the gateway's /ready turned 503 $(awk -v a="$kill_at" -v b="$ended" 'BEGIN { printf "%.1f", b - a }') s after the kill"
  else say "FAIL  the gateway's /ready stayed 200 after node 1 died"; failed=1; fi

  # --- node 1 back: the group re-forms and serves ---------------------------------------------
  t=$(date +%s.%N)
  docker start "$node1" >/dev/null
  for _ in $(seq 300); do healthy && break; sleep 2; done
  if healthy; then say "PASS  node 1 started again: the group re-formed, every container healthy in $(elapsed "$t") s"
  else
    docker ps -a --filter "label=com.docker.compose.project=$project" --format '    {{.Names}}: {{.Status}}'
    say "FAIL  the group did not re-form within 600 s of node 1's start"; failed=1; return 1
  fi
  check "the group, re-formed, serves: ready, then a streamed chat completion" \
    bash -c '"$@" ready "$0" 1 60 && "$@" chat "$0"' "$url" "${probe[@]}"

  # --- node 1 dies while the group is idle: the leader learns it at its next step -------------
  restarts0=$(docker inspect -f '{{.RestartCount}}' "$leader")
  docker kill "$node1" >/dev/null
  sleep 3
  say "killed worker-node1 while idle; 3 s later the leader: $(docker inspect -f 'running {{.State.Running}}, restarts {{.RestartCount}}' "$leader") (it notices a node's death at its next step)"
  t=$(date +%s.%N)
  if out=$("${probe[@]}" chat "$url" 2>&1); then
    sed 's/^/    /' <<<"$out"; say "FAIL  the first request after node 1's death while idle succeeded"; failed=1
  else
    tail -1 <<<"$out" | cut -c1-300 | sed 's/^/    /'
    say "PASS  the first request after node 1's death while idle failed with an error after $(elapsed "$t") s"
  fi
  down_s=
  for _ in $(seq 300); do
    if [[ $(docker inspect -f '{{.RestartCount}} {{.State.Running}}' "$leader") != "$restarts0 true" ]]; then
      down_s=$(elapsed "$t"); break
    fi
    sleep 0.1
  done
  if [[ -n $down_s ]]; then say "PASS  then the leader exited, $down_s s after that request began"
  else say "FAIL  the leader still runs 30 s after that request"; failed=1; fi
}

group_formed() {  # group_formed LEADER NODE1: each container's log says it joined as its rank and is ready
  local lead node
  lead=$(docker logs "$1" 2>&1); node=$(docker logs "$2" 2>&1)
  grep -m1 '"msg": "joined the worker group"' <<<"$lead" | cut -c1-300
  grep -m1 '"msg": "worker group ready"' <<<"$lead" | cut -c1-300
  grep -m1 '"msg": "joined the worker group"' <<<"$node" | cut -c1-300
  grep -m1 '"msg": "node ready"' <<<"$node" | cut -c1-300
  grep '"msg": "joined the worker group"' <<<"$lead" | grep -q '"rank": 0, "world_size": 2' \
    && grep -q '"msg": "worker group ready"' <<<"$lead" \
    && grep '"msg": "joined the worker group"' <<<"$node" | grep -q '"rank": 1, "world_size": 2' \
    && grep '"msg": "node ready"' <<<"$node" | grep -q '"node_rank": 1'
}

pd_checks() {  # compose.pd.yaml: a prefill replica and a decode replica, paired by the router
  up pd "${pd[@]}" || return
  check "the router lists a prefill and a decode replica, both healthy (pd)" pd_probe roles "$url"
  chat_and_trace pd gateway router tokenizer scheduler worker detokenizer
  check "a chat completion, not streamed, through the gateway (pd)" pd_probe complete "$url"
  check "the gateway's /ready is 200 (pd)" "${probe[@]}" ready "$url" 1 30
  check "/metrics answers on all 10 services: Prometheus scrapes every target up (pd)" \
    "${probe[@]}" targets "$prometheus" 10
  check "the prefill scheduler sent the KV: radixmesh:kv_transfer_bytes > 0 (Prometheus, pd)" \
    pd_probe kv "$prometheus"
  check "n: 2 is refused: 400 naming n (pd)" pd_probe n2 "$url"
}

pd_probe() {  # pd_probe WHAT URL: the PD checks compose_probe.py has no command for; one JSON line
  "$py" - "$@" <<'EOF'
import json, re, sys, time, urllib.error, urllib.parse, urllib.request

what, base = sys.argv[1], sys.argv[2]


def call(path, body=None):
    req = urllib.request.Request(base + path, data=body and json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat(**extra):
    model = call("/v1/models")[1]["data"][0]["id"]
    return call("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0, **extra})


def prom(query):  # {"role/service": value} of an instant query
    got = call("/api/v1/query?" + urllib.parse.urlencode({"query": query}))[1]["data"]["result"]
    return {f'{r["metric"].get("role", "-")}/{r["metric"].get("service")}': float(r["value"][1]) for r in got}


if what == "roles":  # the router's two pools, through the gateway's /admin
    status, got = call("/admin/replicas")
    rows = [{k: r.get(k) for k in ("address", "role", "state")} for r in got.get("replicas", [])]
    print(json.dumps({"status": status, "policy": got.get("policy"), "replicas": rows}))
    ok = sorted(r["role"] for r in rows) == ["decode", "prefill"] and all(r["state"] == "healthy" for r in rows)
elif what == "complete":
    status, got = chat()
    choice = (got.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content")
    print(json.dumps({"status": status, "finish_reason": choice.get("finish_reason"), "text": text,
                      "usage": got.get("usage"), "error": got.get("error")}))
    ok = status == 200 and bool(text) and choice.get("finish_reason") in ("stop", "length")
elif what == "n2":
    status, got = chat(n=2)
    error = got.get("error") or {}
    print(json.dumps({"status": status, "error": error}))
    ok = status == 400 and (error.get("param") == "n" or re.search(r"\bn\b", error.get("message", "")) is not None)
else:  # kv: the prefill scheduler's counter; the decode side's and the router's beside it
    time.sleep(6)  # one scrape interval (5 s): every target's counters then count every request above
    deadline = time.monotonic() + 30
    while True:
        sent = prom("radixmesh:kv_transfer_bytes_total")
        ok = sent.get("prefill/scheduler", 0) > 0
        if ok or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(json.dumps({
        "kv_transfer_bytes": sent, "kv_transfer_pages": prom("radixmesh:kv_transfer_pages_total"),
        "kv_transfer_gbps": prom("radixmesh:kv_transfer_gbps"),
        "decode_attach_to_done_requests": prom("radixmesh:kv_transfer_request_seconds_count"),
        "router_pairs": prom("sum by (service) (radixmesh:router_pairs_total)")}))
sys.exit(0 if ok else 1)
EOF
}

if [[ ${GROUP:-0} == 1 ]]; then group_checks
elif [[ ${PD:-0} == 1 ]]; then pd_checks
else fleet_checks; fi

if [[ ${KEEP:-0} != 1 ]]; then
  if "${compose[@]}" -p "$project" "${files[@]}" down -v --remove-orphans >"$work/down.log" 2>&1 \
     && [[ -z $(docker ps -aq --filter "label=com.docker.compose.project=$project") ]]; then
    say "PASS  down -v: containers, network and volumes removed"
  else say "FAIL  down -v"; failed=1; fi
fi
if [[ $failed == 0 ]]; then say "== compose check: PASS"; else say "== compose check: FAIL"; fi
exit $failed
