{{/*
The operator's API calls, as RBAC rules: exactly the calls listed in operator/rbac.py
(tests/unit/test_chart_rbac.py fails when the two differ). No wildcards.
*/}}

{{/* Rules on namespaced resources: in the ClusterRole (cluster mode) or a Role per watched namespace. */}}
{{- define "iterserve.namespacedRules" -}}
- apiGroups: [iterserve.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [iterserve.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [iterserve.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [controllerrevisions]
  verbs: [list]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, create, patch, delete]
{{- if and .Values.operator.peering.enabled (eq .Values.operator.watch.mode "namespaced") }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}

{{/* Rules on cluster-scoped resources; only cluster mode needs any. */}}
{{- define "iterserve.clusterScopedRules" -}}
{{- if .Values.operator.peering.enabled }}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}
