{{- /*
Shared names and labels. The chart is rendered and installed by the real `helm` in tests
(tests/chart/), so every Helm function is available.
*/ -}}
{{- define "embedfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "embedfleet.serviceAccountName" -}}
{{- default (include "embedfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* The operator's leader-election Lease, in the release namespace: one per release, so two releases
in one namespace (say a hub and a spoke on the same cluster) never wait on each other. For the release
name "embedfleet" it is the operator's default, embedfleet-operator. */ -}}
{{- define "embedfleet.leaseName" -}}
{{- printf "%s-operator" (include "embedfleet.fullname" .) -}}
{{- end -}}

{{- /* The spoke's heartbeat Lease (spoke/heartbeat.py LEASE_NAME); the hub reads it. */ -}}
{{- define "embedfleet.heartbeatLeaseName" -}}
embedfleet-spoke
{{- end -}}

{{- /* The node agent's DaemonSet, ServiceAccount and ClusterRole: at most 63 characters like every name. */ -}}
{{- define "embedfleet.nodeAgentName" -}}
{{- printf "%s-node-agent" (include "embedfleet.fullname" . | trunc 52 | trimSuffix "-") -}}
{{- end -}}

{{- define "embedfleet.gatewayName" -}}
{{- printf "%s-gateway" (include "embedfleet.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "embedfleet.hubAccessServiceAccountName" -}}
{{- default (printf "%s-hub" (include "embedfleet.fullname" .)) .Values.hubAccess.serviceAccount.name -}}
{{- end -}}

{{- define "embedfleet.selectorLabels" -}}
app.kubernetes.io/name: embedfleet-operator
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{- define "embedfleet.labels" -}}
{{ include "embedfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
embedfleet.dev/role: {{ .Values.role | quote }}
{{- end -}}

{{- /* The operator's ServiceAccount as an RBAC subject (a list item). */ -}}
{{- define "embedfleet.operatorSubject" -}}
- kind: ServiceAccount
  name: {{ include "embedfleet.serviceAccountName" . | quote }}
  namespace: {{ .Release.Namespace | quote }}
{{- end -}}

{{- /* Settings the values schema cannot express; a bad combination fails the render with a message. */ -}}
{{- define "embedfleet.validate" -}}
{{- $le := .Values.leaderElection -}}
{{- if $le.enabled -}}
{{- if not (and (lt (float64 $le.retryPeriod) (float64 $le.renewDeadline)) (lt (float64 $le.renewDeadline) (float64 $le.leaseDuration))) -}}
{{- fail (printf "leaderElection: need retryPeriod < renewDeadline < leaseDuration, got %v < %v < %v" $le.retryPeriod $le.renewDeadline $le.leaseDuration) -}}
{{- end -}}
{{- end -}}
{{- /* The default runtime image must pass the platform's own allow-list (platform.image_allowed's rules),
or every deployment that names no image would be refused. */ -}}
{{- $image := include "embedfleet.runtimeImage" . -}}
{{- $allowed := (.Values.platform | default dict).allowedImages | default list -}}
{{- $ok := false -}}
{{- range $entry := $allowed -}}
{{- if or (eq $entry "*") (eq $image $entry) (and (hasSuffix "/" $entry) (hasPrefix $entry $image)) (and (not (hasSuffix "/" $entry)) (or (hasPrefix (printf "%s:" $entry) $image) (hasPrefix (printf "%s@" $entry) $image))) -}}
{{- $ok = true -}}
{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- fail (printf "runtimeImage: %s is not allowed by platform.allowedImages (%s)" $image (join ", " $allowed)) -}}
{{- end -}}
{{- end -}}

{{- /* The runtime image of deployments that name none (EMBEDFLEET_DEFAULT_RUNTIME_IMAGE): runtimeImage.repository,
tagged runtimeImage.tag or, when that is empty, the chart's appVersion. */ -}}
{{- define "embedfleet.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtimeImage.repository (.Values.runtimeImage.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The platform allow-lists as the JSON the operator and the node agent read (EMBEDFLEET_PLATFORM_POLICY).
*/}}
{{- define "embedfleet.platformPolicy" -}}
{{- .Values.platform | toJson -}}
{{- end }}
