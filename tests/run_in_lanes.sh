#!/usr/bin/env bash
# The whole suite as two pytest runs at once (what `make test` and CI run):
#   cluster lane: tests marked cluster or e2e. They mostly wait: on the control plane, Prometheus,
#                 the operator's timers and fake-model engines that sleep their step time.
#                 And the tests marked beside_cluster: long compute tests that use the core the
#                 cluster tests leave idle (without them the compute lane ran 41 minutes on 2
#                 cores, the cluster lane 31).
#   compute lane: everything else. Mostly one core of work at a time (one-thread servers, engines
#                 and transformers references).
# Run one after the other they left a core idle most of the time (31-34 min on 2 cores).
# The cluster lane's output is kept in a file and printed after the compute lane's, whole.
# Usage: tests/run_in_lanes.sh PYTEST [PYTEST_ARGS...]; exit status: the worse of the two.
set -uo pipefail

pytest=$1
shift
cluster_log=$(mktemp -t iterserve-cluster-lane.XXXXXX)
trap 'rm -f "$cluster_log"' EXIT

started=$SECONDS
# A background job of a script ignores SIGINT; --default-signal gives it back, so Ctrl-C stops
# both lanes and pytest still tears its fixtures down (the control plane among them).
env --default-signal=INT "$pytest" -q -m "cluster or e2e or beside_cluster" "$@" >"$cluster_log" 2>&1 &
cluster_pid=$!
"$pytest" -q -m "not cluster and not e2e and not beside_cluster" "$@"
compute=$?
compute_seconds=$((SECONDS - started))
wait "$cluster_pid"
cluster=$?

echo
echo "================================ the cluster lane ================================"
cat "$cluster_log"
# 5: the lane's selection (PYTEST_ARGS naming files of one kind) had no test in it.
(( compute == 5 && cluster != 5 )) && compute=0
(( cluster == 5 && compute != 5 )) && cluster=0
echo "lanes: compute exit ${compute} after ${compute_seconds} s, cluster exit ${cluster}; both done after $((SECONDS - started)) s"
(( compute == 0 && cluster == 0 ))
