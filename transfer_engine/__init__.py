"""Out-of-band KV-cache transport between workers. KV bytes never travel over NATS."""
