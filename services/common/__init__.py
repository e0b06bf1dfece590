"""The small shared runtime: NATS connection (with an embedded server), data dir, logging, HTTP error
bodies and the ``llmgw`` CLI. Nothing domain-specific lives here."""
