"""`iterserve operator run`: the kopf operator, cluster-wide or for a list of namespaces, with
kopf's liveness endpoint and its own Prometheus metrics."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def configure(parser: argparse.ArgumentParser) -> None:
    from iterserve.operator.podsecurity import ADMISSION_POLICY_FILE, RULE_NAMES

    commands = parser.add_subparsers(dest="operator_command", metavar="COMMAND", required=True)
    policy = commands.add_parser("admission-policy", help="print the chart's ValidatingAdmissionPolicy template "
                                                          f"(make crds writes {ADMISSION_POLICY_FILE})")
    policy.add_argument("-o", "--output", metavar="FILE", help="write it here instead of stdout")
    run = commands.add_parser("run", help="reconcile InferenceServices into engine Deployments")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeat for several); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG, then ~/.kube/config)")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                     help="kopf liveness endpoint (default http://0.0.0.0:8080/healthz; 'none' disables)")
    run.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 disables)")
    run.add_argument("--metrics-host", default="0.0.0.0", help="address for /metrics (default 0.0.0.0)")
    run.add_argument("--resync-seconds", type=float, default=15.0,
                     help="reconcile every InferenceService this often even without events (default 15)")
    run.add_argument("--peering", metavar="NAME",
                     help="kopf peering object for several operator replicas (default: standalone)")
    run.add_argument("--prometheus-url", default=os.environ.get("ITERSERVE_PROMETHEUS_URL"), metavar="URL",
                     help="Prometheus HTTP API for InferenceServices with autoscaling.metricsSource: prometheus "
                          "(default: $ITERSERVE_PROMETHEUS_URL)")
    run.add_argument("--crd-wait-seconds", type=float, default=60,
                     help="wait this long for the InferenceService CRD to be served (default 60)")
    run.add_argument("--allow-pod-security", action="append", default=[], choices=RULE_NAMES, metavar="RULE",
                     help="let InferenceServices ask for what this rule of operator/podsecurity.py refuses "
                          f"(repeat for several; one of {', '.join(RULE_NAMES)}); the chart sets it from "
                          "admissionPolicy.allow")
    run.add_argument("--allow-runtime-class", action="append", default=[], metavar="NAME",
                     help="let InferenceServices set spec.podTemplatePatch.spec.runtimeClassName to NAME "
                          "(repeat for several); the chart sets it from admissionPolicy.runtimeClasses")
    run.add_argument("--no-network-policy", dest="network_policy", action="store_false",
                     help="make no NetworkPolicy for the engine pods (and delete those made before); the chart "
                          "sets it when networkPolicy.enabled is false")
    run.add_argument("--network-policy-peer", action="append", default=[], metavar="JSON",
                     help="a NetworkPolicyPeer ({\"namespaceSelector\": ..., \"podSelector\": ...}) allowed to the "
                          "engines' HTTP port besides the router, e.g. the operator and Prometheus (repeat for several)")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _api_client(kubeconfig: str | None):
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)


def _wait_for_crd(kube, namespaces: list[str], seconds: float) -> bool:
    """kopf resolves resources once at start (scanning is off), so the CRD must be served first."""
    deadline = time.monotonic() + seconds
    while not (kube.inference_services_discoverable()
               and all(kube.inference_services_listable(ns) for ns in namespaces or [None])):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def run(args: argparse.Namespace) -> int:
    if args.operator_command == "admission-policy":
        return _write_admission_policy(args.output)
    return _run_operator(args)


def _write_admission_policy(output: str | None) -> int:
    from iterserve.operator.podsecurity import admission_policy_template

    text = admission_policy_template()
    if output:
        with open(output, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _run_operator(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        # Before the kubernetes package is imported: it reads $KUBECONFIG once, at import.
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf
    from prometheus_client import start_http_server

    from iterserve.operator.adapters import AdapterHook
    from iterserve.operator.autoscaling.hook import AutoscalerHook
    from iterserve.operator.handlers import configure_settings, register
    from iterserve.operator.kube import Kube
    from iterserve.operator.metrics import OperatorMetrics
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.operator.reconcile import Reconciler

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.resync_seconds <= 0:
        print("iterserve operator run: --resync-seconds must be positive")
        return 2
    from iterserve.operator.network_policy import NetworkPolicySettings, parse_peer

    try:  # a bad flag fails at once, not after the wait for the CRD
        peers = tuple(parse_peer(text) for text in args.network_policy_peer)
    except ValueError as error:
        print(f"iterserve operator run: {error}", file=sys.stderr)
        return 2
    kube = Kube(_api_client(args.kubeconfig))
    if not _wait_for_crd(kube, args.namespace, args.crd_wait_seconds):
        print(f"iterserve operator run: the API server does not serve {PLURAL}.{GROUP}/{VERSION}; "
              "install the CRD first: kubectl apply -f crds/inferenceservice.yaml", file=sys.stderr)
        return 1
    from iterserve.operator.podsecurity import RUNTIME_CLASS_ALLOWED

    reconciler = Reconciler(kube, allowed_pod_security=frozenset(
        [*args.allow_pod_security, *(RUNTIME_CLASS_ALLOWED + name for name in args.allow_runtime_class)]),
        network=NetworkPolicySettings(args.network_policy, peers))
    registry = kopf.OperatorRegistry()
    autoscaler = AutoscalerHook(prometheus_url=args.prometheus_url, metrics=OperatorMetrics())
    # spec.adapters on running pods (operator/adapters.py), after the autoscaler's tick
    register(registry, reconciler, resync_seconds=args.resync_seconds, tick_hooks=[autoscaler, AdapterHook()])
    settings = kopf.OperatorSettings()
    configure_settings(settings)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host)
    namespaces = args.namespace
    logging.getLogger(__name__).info(
        "iterserve operator: watching %s", ", ".join(namespaces) if namespaces else "all namespaces")
    kopf.run(
        registry=registry,
        settings=settings,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=None if args.liveness == "none" else args.liveness,
    )
    return 0
