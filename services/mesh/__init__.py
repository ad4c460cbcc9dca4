"""What every ripplemesh service shares: connecting to NATS (or starting it embedded),
provisioning streams, publishing with trace context, the consume loop with dead-lettering,
metrics and health endpoints, structured logs and graceful shutdown."""
