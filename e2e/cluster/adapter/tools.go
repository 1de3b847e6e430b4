//go:build tools

// Package adapter pins prometheus-adapter (the external metrics API for the HPA test) in go.mod.
package adapter

import _ "sigs.k8s.io/prometheus-adapter/cmd/adapter"
