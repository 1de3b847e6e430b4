//go:build tools

// Package prometheus pins Prometheus (built with only its file, http and kubernetes service
// discovery: tags remove_all_sd,enable_kubernetes_sd) for the live alerting and HPA tests; the
// Debian package's Prometheus is built without kubernetes_sd_configs.
package prometheus

import _ "github.com/prometheus/prometheus/cmd/prometheus"
