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
- inferenceservices: kopf lists/watches them and patches annotations (progress, last-handled spec); get for reads.
- inferenceservices/status: status patches. inferenceservices/finalizers update: children set
  blockOwnerDeletion on their owner reference (enforced where OwnerReferencesPermissionEnforcement is on).
- deployments, services, configmaps, podmonitors: get + server-side apply (patch; create for new objects).
  No delete: children are garbage-collected through their owner references.
- poddisruptionbudgets: get + server-side apply, and delete when spec.disruption.enabled turns false.
- inferencepools (Gateway API Inference Extension): get + server-side apply where spec.routing.inferencePool is
  enabled, and delete (of the service's own pool only) when it turns false.
- pods list: why pods are not ready (scheduling failures) in the Ready condition.
- events create: an Event for every change.
- horizontalpodautoscalers, scaledobjects list: whether another autoscaler targets a service or its Deployment
  (then the control loop leaves the replicas to it: condition ReplicasManagedExternally).
*/}}
{{- define "metronome.namespacedRules" -}}
- apiGroups: [metronome.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
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
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [list]
{{- end -}}

{{/*
Cluster-scoped reads: kopf discovers resources through CRDs; the operator checks for the PodMonitor CRD. With
explicit namespaces kopf also observes Namespace objects (to follow namespaces that come and go).
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
