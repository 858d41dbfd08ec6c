{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "lora-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: the release name, or <release>-<chart>. */}}
{{- define "lora-operator.fullname" -}}
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

{{/* Labels that select the operator pod; never change them across upgrades. */}}
{{- define "lora-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lora-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object of the chart. */}}
{{- define "lora-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "lora-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: lora-operator
{{- end }}

{{/* The operator's service account name. */}}
{{- define "lora-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lora-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator settings file (lora_operator.settings.OperatorSettings, camelCase). The chart's
values map onto it one to one; keys left empty are omitted so the operator's defaults apply.
*/}}
{{- define "lora-operator.settings" -}}
{{- $s := dict
  "trainerImage" .Values.trainer.image
  "allowedImages" .Values.trainer.allowedImages
  "requireImageDigest" .Values.trainer.requireImageDigest
  "allowedServiceAccounts" .Values.trainer.allowedServiceAccounts
  "allowedPriorityClasses" .Values.trainer.allowedPriorityClasses
  "allowedTokenSecrets" .Values.trainer.allowedTokenSecrets
  "allowedLocalPaths" .Values.trainer.allowedLocalPaths
  "sharedCompilationCaches" .Values.trainer.sharedCompilationCaches
  "defaultTpuType" .Values.defaultTpuType
  "allowHostNetwork" .Values.allowHostNetwork
  "watchNamespaces" .Values.watchNamespaces
  "logLevel" .Values.logLevel
  "progressPollSeconds" .Values.progressPollSeconds
  "jobTtlSecondsAfterFinished" .Values.jobTtlSecondsAfterFinished
  "exportResources" .Values.exportResources
}}
{{- with .Values.defaultQueueName }}
{{- $_ := set $s "defaultQueueName" . }}
{{- end }}
{{- with .Values.topologyAwareScheduling }}
{{- $_ := set $s "topologyAwareScheduling" . }}
{{- end }}
{{- with .Values.podTemplateOverlay }}
{{- $_ := set $s "podTemplateOverlay" . }}
{{- end }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- $le := dict "enabled" true "leaseName" (include "lora-operator.fullname" .) "leaseNamespace" .Release.Namespace }}
{{- $_ := set $s "leaderElection" (merge $le .Values.leaderElection) }}
{{- end }}
{{- toYaml $s }}
{{- end }}

{{/*
Namespaced rules: what the operator does in a watched namespace. Kept in one place so the
ClusterRole (all namespaces) and the per-namespace Roles grant exactly the same.
*/}}
{{- define "lora-operator.namespacedRules" -}}
# The custom resources: watch them, record kopf's progress annotations, write status.
- apiGroups: ["lora-operator.dev"]
  resources: ["lorafinetunes", "adapterconversions"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["lora-operator.dev"]
  resources: ["lorafinetunes/status", "adapterconversions/status"]
  verbs: ["patch"]
# The trainer: one JobSet per LoraFinetune (get: observe it on every reconcile; patch: spec.suspend and
# the operator's tracking finalizer, removed once the run's status records what the JobSet did).
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Export and conversion Jobs (watched for their outcome; patch: the tracking finalizer).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The train config handed to the trainer pods (get: adopt it after an operator restart).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create"]
# Checks that spec.hfTokenSecretRef names an existing Secret (it is mounted, never read into status).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# Events on the custom resources (kopf posts them through the core API).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Cluster-scoped reads kopf needs in every mode: it watches CRDs to discover its resources. */}}
{{- define "lora-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
