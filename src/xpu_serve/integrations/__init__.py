"""Integrations with the operator's world: systemd notify, Prometheus metrics, incident webhook."""
