{{/* Chart name, overridable. */}}
{{- define "iterserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every object name: the release name, with the chart name unless it already has it. */}}
{{- define "iterserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Kubernetes recommended labels, on every object; the component is added by the callers. */}}
{{- define "iterserve.baseLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: iterserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of the operator's objects. */}}
{{- define "iterserve.labels" -}}
{{ include "iterserve.baseLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of the monitoring objects (monitors, rules, dashboard). */}}
{{- define "iterserve.monitoringLabels" -}}
{{ include "iterserve.baseLabels" . }}
app.kubernetes.io/component: monitoring
{{- end }}

{{/* Labels that select the operator pods. */}}
{{- define "iterserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "iterserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "iterserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "iterserve.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* The namespaces the operator watches in namespaced mode; fails early when there are none. */}}
{{- define "iterserve.watchedNamespaces" -}}
{{- if eq .Values.operator.watch.mode "namespaced" }}
{{- if not .Values.operator.watch.namespaces }}
{{- fail "operator.watch.namespaces must list at least one namespace when operator.watch.mode is \"namespaced\" (or set operator.watch.mode=cluster)" }}
{{- end }}
{{- join "," .Values.operator.watch.namespaces }}
{{- end }}
{{- end }}

{{/* Prometheus label name of a pod label, as Kubernetes service discovery spells it. */}}
{{- define "iterserve.podLabelMeta" -}}
{{- printf "__meta_kubernetes_pod_label_%s" (regexReplaceAll "[^a-zA-Z0-9_]" . "_") }}
{{- end }}

{{/* Label selector of the engine series, used by the alerts. */}}
{{- define "iterserve.engineJobSelector" -}}
{{- printf "job=%q" .Values.monitoring.engines.job }}
{{- end }}

{{/* runbook_url of an alert: the runbook page and the alert's section anchor. */}}
{{- define "iterserve.runbookUrl" -}}
{{- printf "%s#%s" .root.Values.alerts.runbookBaseUrl (lower .alert) }}
{{- end }}
