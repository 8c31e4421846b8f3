"""Cross-service code: wire messages, subjects, config, errors, the service base class."""
