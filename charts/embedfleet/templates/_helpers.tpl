{{- /*
Shared names. Only the subset of Helm that Go's text/template + sprig render is used in this chart
(define/template, if/range/with, toYaml, nindent, quote, default, printf, trunc): no include, tpl,
required, lookup or Files access. See the chart README for why.
*/ -}}
{{- define "embedfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "embedfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.name -}}
{{- .Values.serviceAccount.name -}}
{{- else -}}
{{- template "embedfleet.fullname" . -}}
{{- end -}}
{{- end -}}

{{- /* Object labels for a top-level object, used as `  labels:{{ template "embedfleet.labels" . }}`. */ -}}
{{- define "embedfleet.labels" }}
    app.kubernetes.io/name: embedfleet-operator
    app.kubernetes.io/instance: {{ .Release.Name | quote }}
    app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
    app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
    helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
    embedfleet.dev/role: {{ .Values.role | quote }}
{{- end -}}
