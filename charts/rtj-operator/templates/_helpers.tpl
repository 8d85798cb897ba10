{{/*
Standard helpers (name, fullname, chart, labels, selectorLabels), as in the jobset and
cert-manager charts. Names are truncated to 63 characters, the limit for label values and DNS names.
*/}}

{{- define "rtj-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart>, or the release name alone when it already contains the chart name.
*/}}
{{- define "rtj-operator.fullname" -}}
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

{{- define "rtj-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rtj-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rtj-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rtj-operator.labels" -}}
helm.sh/chart: {{ include "rtj-operator.chart" . }}
{{ include "rtj-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: resilient-training
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rtj-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rtj-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rtj-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The namespace whose jobs the operator serves; empty means every namespace. In namespaced RBAC mode
it can never be empty: it falls back to the release namespace, where the Roles are.
*/}}
{{- define "rtj-operator.watchNamespace" -}}
{{- if .Values.rbac.clusterScoped }}
{{- .Values.operator.watchNamespace }}
{{- else }}
{{- default .Release.Namespace .Values.operator.watchNamespace }}
{{- end }}
{{- end }}

{{/*
A label map as `k=v,k=v` (sorted by key), the form RTJ_OPERATOR_*_LABELS settings take.
*/}}
{{- define "rtj-operator.labelList" -}}
{{- $pairs := list -}}
{{- range $key, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
