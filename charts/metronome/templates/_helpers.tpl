{{/* Names and labels shared by the templates. */}}
{{- define "metronome.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "metronome.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "metronome.selectorLabels" -}}
app.kubernetes.io/name: {{ include "metronome.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "metronome.labels" -}}
{{ include "metronome.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: metronome
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "metronome.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "metronome.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does inside the namespaces it manages — every verb is used:
- inferenceservices: kopf lists/watches them; patch: spec.replicas when the autotuner scales.
- inferenceservices/status: status patches. inferenceservices/finalizers update: children set
  blockOwnerDeletion on their owner reference (enforced where OwnerReferencesPermissionEnforcement is on).
- every child kind (configmaps, deployments, services, poddisruptionbudgets, podmonitors, prometheusrules,
  inferencepools): list/watch (selected by the operator's label: a deleted or edited child is put back), create +
  patch (server-side apply, and its dry run before a change). delete only for the children a spec change or a flag
  retires (the PDB, the PodMonitor, the SLO PrometheusRule, the service's own InferencePool) and an
  experiment's candidate ConfigMap once the experiment ends; the rest is garbage-collected through owner
  references. get: a child written before its kind's watch ran (a CRD installed just now) is looked up once; so
  is a pool of the same name the watch does not show (someone else's, never overwritten) before the service's own
  is written.
- pods list/watch (selected by the operator's label): why pods are not ready, in the Ready condition; patch: an
  experiment's variant label (outside the Deployment's selector: nothing restarts).
- events create: an Event for every change.
- horizontalpodautoscalers, scaledobjects list/watch (all of them: they are the user's, without the operator's
  label): whether another autoscaler targets a service or its Deployment (then the control loop leaves the
  replicas to it: condition ReplicasManagedExternally). Never written.
*/}}
{{- define "metronome.namespacedRules" -}}
- apiGroups: [metronome.dev]
  resources: [inferenceservices]
  verbs: [list, watch, patch]
- apiGroups: [metronome.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [metronome.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors, prometheusrules]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [list, watch]
{{- end -}}

{{/*
Cluster-scoped reads: kopf discovers resources through CRDs and watches them (a PodMonitor or PrometheusRule
CRD installed later is served at once). With explicit namespaces kopf also observes Namespace objects (to follow
namespaces that come and go).
*/}}
{{- define "metronome.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end -}}

{{/*
The servers' scrape interval in seconds ("0" = unknown: the operator's PodMonitors pick their own per service).
A ServiceMonitor needs one: 15 unless monitor.intervalSeconds says otherwise.
*/}}
{{- define "metronome.scrapeIntervalSeconds" -}}
{{- $seconds := int .Values.monitor.intervalSeconds -}}
{{- if and (eq $seconds 0) (eq .Values.monitor.kind "ServiceMonitor") }}15{{ else }}{{ $seconds }}{{ end -}}
{{- end -}}


{{/*
Whether the server pods carry prometheus.io/* scrape annotations (--scrape-annotations): monitor.scrapeAnnotations
when set, else by monitor.kind — never under the chart's ServiceMonitor, always without a monitor, and with
PodMonitors only while the operator writes none (the cluster does not serve the PodMonitor API). One way of
scraping each pod: a Prometheus that also discovers pods by annotation would otherwise count every pod twice.
*/}}
{{- define "metronome.scrapeAnnotations" -}}
{{- if .Values.monitor.scrapeAnnotations -}}{{ .Values.monitor.scrapeAnnotations }}
{{- else if eq .Values.monitor.kind "ServiceMonitor" -}}never
{{- else if eq .Values.monitor.kind "none" -}}always
{{- else -}}auto
{{- end -}}
{{- end -}}

{{/*
The labels of every PrometheusRule (the chart's and the operator's per-service SLO rules): the monitors' labels,
which a kube-prometheus-stack selects rules by as it selects monitors (`release: <its release name>`), and
prometheusRule.labels.
*/}}
{{- define "metronome.ruleLabels" -}}
{{- $labels := merge (deepCopy (.Values.prometheusRule.labels | default dict)) (.Values.monitor.labels | default dict) -}}
{{- if $labels }}{{ toYaml $labels }}{{ end -}}
{{- end -}}
